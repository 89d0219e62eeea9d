//! The one error type of the HTTP layer: RFC 9457 problem+json with a
//! stable `code`. A 5xx never carries internal text; the cause is logged
//! once, here.

use axum::{
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use serde::Serialize;
use utoipa::ToSchema;

use crate::{
    lifecycle::{FieldError, RestartError},
    registry::RegistryError,
    store::StoreError,
};

use super::INDEX_HEADER;

/// Seconds a client is asked to wait before retrying a 503.
pub const RETRY_AFTER_SECS: &str = "1";

/// An RFC 9457 problem document.
#[derive(Debug, Serialize, ToSchema)]
pub struct Problem {
    /// Always `about:blank`: `code` carries the meaning.
    #[schema(example = "about:blank")]
    pub r#type: &'static str,
    /// The HTTP status text.
    #[schema(example = "Conflict")]
    pub title: String,
    pub status: u16,
    /// What went wrong, for a person.
    pub detail: String,
    /// Stable, machine-readable error code.
    #[schema(example = "task_not_running")]
    pub code: &'static str,
    /// On validation failures: each broken rule with the field it concerns
    /// (the first `MAX_ERRORS` of them).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<ProblemField>,
    /// How many more broken rules there were than `errors` lists.
    #[serde(skip_serializing_if = "is_zero")]
    pub errors_omitted: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The most broken rules an answer lists: a request with 30,000 bad query
/// parameters got a 3.2 MB answer, 54 times its own size.
pub const MAX_ERRORS: usize = 20;

/// One validation failure.
#[derive(Debug, Serialize, ToSchema)]
pub struct ProblemField {
    /// Path of the offending field (`tasks[1].name`) or query parameter.
    pub field: String,
    pub message: String,
}

impl From<FieldError> for ProblemField {
    fn from(e: FieldError) -> Self {
        Self {
            field: e.field,
            message: e.message,
        }
    }
}

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub detail: String,
    pub errors: Vec<ProblemField>,
    /// Broken rules left out of `errors` (see `MAX_ERRORS`).
    pub errors_omitted: usize,
    /// The allocation's `modify_index`, when the error concerns one that
    /// exists (sent as `X-Taskgate-Index`).
    pub index: Option<u64>,
    pub retry_after: bool,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            code,
            detail: detail.into(),
            errors: Vec::new(),
            errors_omitted: 0,
            index: None,
            retry_after: false,
        }
    }

    /// 400 `invalid_request` with the broken rules listed.
    /// 400 `invalid_request` with the broken rules (the first
    /// `MAX_ERRORS`, and how many more there were).
    pub fn invalid(detail: impl Into<String>, errors: Vec<FieldError>) -> Self {
        let mut e = Self::new(StatusCode::BAD_REQUEST, "invalid_request", detail);
        e.errors_omitted = errors.len().saturating_sub(MAX_ERRORS);
        e.errors = errors
            .into_iter()
            .take(MAX_ERRORS)
            .map(Into::into)
            .collect();
        e
    }

    /// 400 `invalid_json`, naming the field where decoding failed.
    pub fn invalid_json(field: Option<String>, message: String) -> Self {
        let mut e = Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!("the request body is not valid: {message}"),
        );
        if let Some(field) = field {
            e.errors.push(ProblemField { field, message });
        }
        e
    }

    pub fn not_found() -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", "no such route")
    }

    pub fn internal() -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "internal error; the cause is in the server log",
        )
    }

    fn with_index(mut self, index: u64) -> Self {
        self.index = Some(index);
        self
    }

    /// Adds `Retry-After` (for 503s).
    pub(crate) fn retry_later(mut self) -> Self {
        self.retry_after = true;
        self
    }
}

impl From<RegistryError> for ApiError {
    fn from(e: RegistryError) -> Self {
        let detail = e.to_string();
        match e {
            RegistryError::AllocationNotFound(_) => {
                Self::new(StatusCode::NOT_FOUND, "allocation_not_found", detail)
            }
            RegistryError::TaskNotFound { .. } => {
                Self::new(StatusCode::NOT_FOUND, "task_not_found", detail)
            }
            RegistryError::AllocationExists { index, .. } => {
                Self::new(StatusCode::CONFLICT, "allocation_exists", detail).with_index(index)
            }
            RegistryError::RestartRefused { error, index } => {
                let code = match error {
                    RestartError::AllocationFinished => "allocation_finished",
                    RestartError::TaskNotRunning(_) => "task_not_running",
                };
                Self::new(StatusCode::CONFLICT, code, detail).with_index(index)
            }
            RegistryError::Deleted(_) => Self::new(StatusCode::GONE, "allocation_deleted", detail),
            RegistryError::TooManyWaiters => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "too_many_waiters", detail).retry_later()
            }
            RegistryError::ShuttingDown => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "shutting_down", detail).retry_later()
            }
            RegistryError::Contended(_) => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "timeout", detail).retry_later()
            }
            RegistryError::QuotaExceeded(_) => {
                Self::new(StatusCode::TOO_MANY_REQUESTS, "quota_exceeded", detail)
            }
            RegistryError::Store(e) => e.into(),
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            // The server is stopping: the commit was refused, not failed.
            StoreError::Closed => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting_down",
                "the server is shutting down",
            )
            .retry_later(),
            StoreError::Unavailable(_) => {
                tracing::warn!(error = %e, "write refused by the store");
                Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "store_unavailable",
                    "the store takes no writes for now; see /v1/health",
                )
                .retry_later()
            }
            StoreError::Io(_) | StoreError::Unusable(_) => {
                tracing::error!(error = %e, "store commit failed");
                Self::internal()
            }
        }
    }
}

impl ApiError {
    /// The problem+json body of this error.
    pub fn into_body(self) -> Vec<u8> {
        let problem = Problem {
            r#type: "about:blank",
            title: self.status.canonical_reason().unwrap_or("Error").to_owned(),
            status: self.status.as_u16(),
            detail: self.detail,
            code: self.code,
            errors: self.errors,
            errors_omitted: self.errors_omitted,
        };
        serde_json::to_vec(&problem).unwrap_or_default()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, index, retry_after) = (self.status, self.index, self.retry_after);
        let mut res = (status, self.into_body()).into_response();
        let headers = res.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(index) = index {
            headers.insert(INDEX_HEADER, HeaderValue::from(index));
        }
        if retry_after {
            headers.insert(
                header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECS),
            );
        }
        res
    }
}

/// The answer to a body over the limit, from here or from an extractor.
pub fn payload_too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
        "the request body is larger than the configured limit",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A commit the store refused because it is closing is the server
    /// stopping (503 `shutting_down`), not an internal error; one refused
    /// at the log's ceiling is 503 `store_unavailable`; both say when to
    /// come back, and neither carries the store's own text.
    #[test]
    fn refused_commits_are_503_with_retry_after_and_no_internals() {
        let closed = ApiError::from(StoreError::Closed);
        assert_eq!(
            (closed.status.as_u16(), closed.code),
            (503, "shutting_down")
        );
        assert!(closed.retry_after);
        let full = ApiError::from(StoreError::Unavailable("ENOSPC at /data".into()));
        assert_eq!(
            (full.status.as_u16(), full.code),
            (503, "store_unavailable")
        );
        assert!(full.retry_after);
        assert!(!full.detail.contains("ENOSPC"), "{}", full.detail);
        let io = ApiError::from(StoreError::Io("EIO at /data".into()));
        assert_eq!((io.status.as_u16(), io.code), (500, "internal"));
        assert!(!io.detail.contains("EIO"), "{}", io.detail);
    }
}
