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

/// Every code a problem can carry: its status, what it means and what to
/// do about it. `GET /errors` serves this table; each problem's `type` is
/// `/errors#<code>`.
pub const CODES: &[(&str, u16, &str)] = &[
    (
        "invalid_json",
        400,
        "The body is not the JSON the route takes: a syntax error, a wrong type, an unknown or missing field (named in `errors`). Fix the body; `GET /openapi.json` has every schema.",
    ),
    (
        "invalid_request",
        400,
        "The request breaks a rule of the API: an invalid ID or task name, a cross-task rule of a spec (one leader, unique names, readiness only on prestart sidecars and main tasks), `ready: true` without `running`, a size limit, an unknown query parameter. `errors` names each broken rule and its field.",
    ),
    (
        "unauthorized",
        401,
        "No token, or one the server does not know. Send `Authorization: Bearer <token>` with a token from the server's `--token-file`.",
    ),
    (
        "forbidden",
        403,
        "The token's role or prefixes do not allow this: readers read, agents report within their prefixes, operators do everything; semaphores are read and acquired only within a token's `semaphore_prefixes`. Use a token whose role and prefixes cover the allocation (or the semaphore).",
    ),
    (
        "cross_site_request",
        403,
        "A browser sent a request that changes something from a page of another site (its `Origin` is not this server, or `Sec-Fetch-Site` says so): refused with or without a token, so that no web page can act on the server through its users' browsers. Use the web view the server serves at `/ui`, or a client that is not a web page (curl, an agent); reads are never refused for this.",
    ),
    (
        "not_found",
        404,
        "No such route. `GET /openapi.json` lists the routes.",
    ),
    (
        "allocation_not_found",
        404,
        "No allocation has this ID. Check the ID (`GET /v1/allocations?prefix=` lists them) or register it (`PUT /v1/allocations/{id}`).",
    ),
    (
        "task_not_found",
        404,
        "The allocation has no task of this name; `detail` lists the tasks it has.",
    ),
    (
        "semaphore_not_found",
        404,
        "No semaphore has this name. `GET /v1/semaphores` lists them; an operator creates one with `PUT /v1/semaphores/{name}` (tasks that acquire a missing semaphore wait for it, `why: not_registered`).",
    ),
    (
        "barrier_not_found",
        404,
        "No task of a registered allocation names this barrier: a barrier exists while its members do (it is forgotten with the last one's allocation). Check the name in the tasks' `barrier`.",
    ),
    (
        "method_not_allowed",
        405,
        "The route exists but not with this method; the `Allow` header lists the methods it takes.",
    ),
    (
        "allocation_exists",
        409,
        "The ID is registered with a different task spec (the same spec again is a 200). Delete the allocation first (`DELETE /v1/allocations/{id}`) or register the new spec under another ID.",
    ),
    (
        "task_not_running",
        409,
        "Only a running task can be restarted alone. Restart it once it runs, or restart every task with `{\"all_tasks\": true}`.",
    ),
    (
        "allocation_finished",
        409,
        "The allocation has finished: a restart once the coordinator is in `poststop` (nothing is left to restart), or a stop once every task is dead (nothing is left to stop). Register a new allocation to run the group again.",
    ),
    (
        "task_lost",
        409,
        "The task was declared lost: it ran under a liveness TTL and its agent gave no sign of life (a report, a parked start-condition or task query, a heartbeat) within it. It is dead and failed for good (`lost_at` says when); its agent must stop its process. An all-tasks restart or a restore runs it again, with a new agent.",
    ),
    (
        "run_superseded",
        409,
        "The request names a run (`Taskgate-Run`) that is not the task's current one (`current_run` says which is, or `null`: none): the agent that sent it is a leftover of an earlier run, of an earlier registration of the allocation, or of a run a restart order replaced. It must stop its process and report nothing more for it.",
    ),
    (
        "task_claimed",
        409,
        "A `running` report that does not name the task's current run, for a task another agent runs (`run` names that run, `last_seen` its latest sign of life): a second agent never starts a second copy. Wait until that run ends or is lost (watch the start condition), then start.",
    ),
    (
        "task_dead",
        409,
        "The task is dead (`finished_at` says since when), and a report may take it out of `dead` only after an operator's all-tasks restart or restore made after it died (or owed to it when it was reported dead), and never once the allocation is in `poststop`, unless it is a poststop task. An agent that finds its task dead reports nothing and exits; an operator restarts every task (`POST .../restart` with `{\"all_tasks\": true}`) or restores the allocation to run it again.",
    ),
    (
        "barrier_closed",
        409,
        "A task names a barrier that takes no more members: it opened or timed out already (a barrier is met once), or it has its `size` members. `GET /v1/barriers/{name}` shows it; use a new barrier name for a new gathering (a barrier is forgotten once its last member's allocation is deleted).",
    ),
    (
        "barrier_mismatch",
        409,
        "A task names a barrier whose members say another `size` or `timeout` (`detail` says which): every member must say the same. Register it with the barrier's size and timeout, or under another barrier name.",
    ),
    (
        "idempotency_key_reused",
        422,
        "The request's `Idempotency-Key` came before with a different request to this task. A retry must send the same request with the same key; a new request needs a new key.",
    ),
    (
        "dependency_cycle",
        409,
        "The registration's dependencies close a cycle, so none of the tasks on it could ever start: 400 when the cycle is among its own tasks, 409 when it runs through allocations the server holds. `path` lists it (`alloc/task` steps). Break it: drop or change one of the dependencies named.",
    ),
    (
        "allocation_deleted",
        410,
        "The allocation was deleted while the request waited on it. Stop acting on it.",
    ),
    (
        "payload_too_large",
        413,
        "The body is larger than the server's limit (`--body-limit`). Send less: fewer tasks or smaller events.",
    ),
    (
        "unsupported_media_type",
        415,
        "A body was sent without `Content-Type: application/json`.",
    ),
    (
        "host_not_allowed",
        421,
        "The request names a host (`Host` header) the server does not serve: on a loopback address it serves only `localhost`, `127.x.y.z` and `[::1]`, so that a web page whose DNS name is pointed at it (DNS rebinding) cannot use it. Use one of those names, or start the server with `--allowed-hosts` naming the host (`*` for any).",
    ),
    (
        "quota_exceeded",
        429,
        "A limit on the caller is reached: the server's `--max-allocations` or `--max-dependents` (dependencies on one allocation's tasks from other allocations, together), or the token's `max_allocations`, `max_dependencies` (dependencies on other allocations its allocations declare together; `--max-dependencies-per-token` for an agent token by default) or `max_waiters`. `detail` names the limit. Delete allocations (or their dependencies), or wait for waits to end (`Retry-After`).",
    ),
    (
        "internal",
        500,
        "An error inside the server; the cause is in its log. Retry; report it if it persists.",
    ),
    (
        "starting",
        503,
        "The server is still loading its store. Retry after `Retry-After`.",
    ),
    (
        "shutting_down",
        503,
        "The server is stopping. Retry against another replica, or after it is back.",
    ),
    (
        "too_many_waiters",
        503,
        "The server holds as many long-polls and blocking queries as it may (`--max-waiters`), or as many event streams (`--max-streams`). Retry after `Retry-After`.",
    ),
    (
        "too_many_connections",
        503,
        "The server has as many connections open as it may (`--max-connections`). Retry after `Retry-After`.",
    ),
    (
        "jwt_keys_unavailable",
        503,
        "The token is a JWT whose key its issuer's keys (`--jwt-issuers`) lack, and they could not be read again for it: they never could be (the issuer's JWKS URL unreachable since the start), the read failed, or they were read less than 30 s ago. The key may be newer than them: retry after `Retry-After`. Once they were read for the token and still lack its key, the answer is `unauthorized`.",
    ),
    (
        "timeout",
        503,
        "The change kept losing to concurrent changes of the same allocation and was not made. Retry after `Retry-After`.",
    ),
    (
        "store_unavailable",
        503,
        "The store takes no writes for now: an etcd replica without a quorum, or a disk store whose log is at its ceiling or whose commit queue is full. It recovers by itself; `GET /v1/health` says why. Reads still work. Also: a replica whose view has not yet reached an allocation etcd holds (try again), and a write etcd did not confirm, which may have been applied (the detail says so: read the allocation before sending it again, or resend a report with the same `Idempotency-Key`); and a heartbeat while etcd acknowledges no lease renewal (the sign of life was heard but cannot be kept for the TTL: send the next one as usual).",
    ),
    (
        "store_failed",
        503,
        "The store failed a write, or refuses writes: the disk store takes no change after a write it cannot vouch for until taskgate is restarted (the change whose write failed may or may not be kept: read it back after the restart), or its log is at its ceiling while checkpoints fail. `GET /v1/health` says which; the server's log has the cause. With replicas: the allocation's record in etcd cannot be read by this build (health names it under `unreadable`; the other allocations are served; DELETE removes it).",
    ),
];

/// The `type` of a problem with this code: its entry on `GET /errors`.
pub fn type_uri(code: &str) -> String {
    format!("/errors#{code}")
}

/// An RFC 9457 problem document.
#[derive(Debug, Serialize, ToSchema)]
pub struct Problem {
    /// `/errors#<code>`: where this code is explained (a page the server
    /// serves), relative to the server.
    #[schema(example = "/errors#task_not_running")]
    pub r#type: String,
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
    /// `task_lost`: when the task was declared lost (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = "2026-11-25T10:00:30Z")]
    pub lost_at: Option<String>,
    /// `run_superseded`: the task's current run, or `null` (it runs none).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>, example = "1234")]
    pub current_run: Option<Option<String>>,
    /// `task_claimed`: the run another agent runs the task under.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = "1234")]
    pub run: Option<String>,
    /// `task_claimed`: that run's latest sign of life (RFC 3339), or
    /// `null` when this server has seen none.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>, example = "2026-11-25T10:00:30Z")]
    pub last_seen: Option<Option<String>>,
    /// `task_dead`: since when the task is dead (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = "2026-11-25T10:00:30Z")]
    pub finished_at: Option<String>,
    /// `dependency_cycle`: the cycle, as `alloc/task` steps from a task of
    /// the registration back to it; a step in an allocation the caller's
    /// token may not read is "(an allocation outside this token's
    /// prefixes)".
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = json!(["app/web", "db-7/db", "app/web"]))]
    pub path: Option<Vec<String>>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The most broken rules an answer lists, so that an answer stays small
/// however many rules a request breaks.
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
    /// What a few codes add (`task_lost`'s time, `dependency_cycle`'s
    /// path), out of line: every `Result` carrying an `ApiError` stays
    /// small.
    pub extra: Option<Box<Extra>>,
}

/// The members only some problems carry.
#[derive(Debug, Default)]
pub struct Extra {
    /// `task_lost`: when the task was declared lost.
    pub lost_at: Option<String>,
    /// `dependency_cycle`: the cycle's steps.
    pub path: Option<Vec<String>>,
    /// `run_superseded`: the task's current run (`Some(None)`: none).
    pub current_run: Option<Option<String>>,
    /// `task_claimed`: the run, and its latest sign of life.
    pub run: Option<String>,
    pub last_seen: Option<Option<String>>,
    /// `task_dead`: since when.
    pub finished_at: Option<String>,
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
            extra: None,
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

    /// 503 `too_many_waiters`: the event stream limit is reached.
    pub(crate) fn too_many_streams(max: usize) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "too_many_waiters",
            format!(
                "{max} event streams are open, as many as --max-streams allows; retry later, \
                 or close a stream"
            ),
        )
        .retry_later()
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
            RegistryError::SemaphoreNotFound(_) => {
                Self::new(StatusCode::NOT_FOUND, "semaphore_not_found", detail)
            }
            RegistryError::BarrierClosed { .. } => {
                Self::new(StatusCode::CONFLICT, "barrier_closed", detail)
            }
            RegistryError::BarrierMismatch { .. } => {
                Self::new(StatusCode::CONFLICT, "barrier_mismatch", detail)
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
            RegistryError::TaskLost { lost_at, index, .. } => {
                let mut e = Self::new(StatusCode::CONFLICT, "task_lost", detail).with_index(index);
                e.extra = Some(Box::new(Extra {
                    lost_at: Some(lost_at),
                    ..Extra::default()
                }));
                e
            }
            RegistryError::RunSuperseded { current, index, .. } => {
                let mut e =
                    Self::new(StatusCode::CONFLICT, "run_superseded", detail).with_index(index);
                e.extra = Some(Box::new(Extra {
                    current_run: Some(current.map(|r| r.to_string())),
                    ..Extra::default()
                }));
                e
            }
            RegistryError::TaskClaimed {
                run,
                last_seen,
                index,
                ..
            } => {
                let mut e =
                    Self::new(StatusCode::CONFLICT, "task_claimed", detail).with_index(index);
                e.extra = Some(Box::new(Extra {
                    run: Some(run.to_string()),
                    last_seen: Some(last_seen),
                    ..Extra::default()
                }));
                e
            }
            RegistryError::TaskDead {
                finished_at, index, ..
            } => {
                let mut e = Self::new(StatusCode::CONFLICT, "task_dead", detail).with_index(index);
                e.extra = Some(Box::new(Extra {
                    finished_at,
                    ..Extra::default()
                }));
                e
            }
            RegistryError::StopRefused { index, .. } => {
                Self::new(StatusCode::CONFLICT, "allocation_finished", detail).with_index(index)
            }
            RegistryError::KeyReused { index } => Self::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency_key_reused",
                detail,
            )
            .with_index(index),
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
            RegistryError::DependencyCycle { path, held } => {
                let status = if held {
                    StatusCode::CONFLICT
                } else {
                    StatusCode::BAD_REQUEST
                };
                let mut e = Self::new(status, "dependency_cycle", detail);
                e.errors.push(ProblemField {
                    field: "depends_on".into(),
                    message: path.join(" → "),
                });
                e.extra = Some(Box::new(Extra {
                    path: Some(path),
                    ..Extra::default()
                }));
                e
            }
            RegistryError::Invalid(errors) => Self::invalid(detail, errors),
            RegistryError::Unsupported(_) => {
                Self::new(StatusCode::BAD_REQUEST, "invalid_request", detail)
            }
            RegistryError::QuotaExceeded(_) => {
                Self::new(StatusCode::TOO_MANY_REQUESTS, "quota_exceeded", detail)
            }
            RegistryError::Unreadable { .. } => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store_failed",
                format!(
                    "{detail}. The other allocations are served; a newer build may read it, or \
                     the record can be deleted (DELETE answers for it once etcd holds a readable \
                     one; see docs/replicas.md)"
                ),
            ),
            RegistryError::Behind { .. }
            | RegistryError::Unrenewed { .. }
            | RegistryError::LeaseEnded { .. } => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", detail)
                    .retry_later()
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
            // A replica's write that no member confirmed: it may have
            // been applied.
            StoreError::Uncertain(_) => {
                tracing::warn!(error = %e, "a write's outcome is unknown");
                Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "store_unavailable",
                    "etcd did not confirm this change, and whether it was applied cannot be \
                     told: it may have been. Read the allocation before sending the request \
                     again, or send it again with the same Idempotency-Key",
                )
                .retry_later()
            }
            // The store failed the commit (a write or fsync of the disk
            // store, a refusal of etcd): the store's failure, not a fault
            // of the server, and a disk store takes no change after one
            // until a restart. The failed change may still be on disk (a
            // failed fsync does not say what reached it), so the answer
            // says "may", as `timeout` does.
            StoreError::Io(_) => {
                tracing::error!(error = %e, "store commit failed");
                Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "store_failed",
                    "the store failed to record this change; it may or may not be kept. After a \
                     failed write the disk store takes no change until taskgate is restarted: \
                     read the change back then. GET /v1/health says whether the store takes \
                     writes; the server's log has the cause",
                )
                .retry_later()
            }
            // Opening a store answers this; a commit never should.
            StoreError::Unusable(_) => {
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
            r#type: type_uri(self.code),
            title: self.status.canonical_reason().unwrap_or("Error").to_owned(),
            status: self.status.as_u16(),
            detail: self.detail,
            code: self.code,
            errors: self.errors,
            errors_omitted: self.errors_omitted,
            lost_at: self.extra.as_ref().and_then(|x| x.lost_at.clone()),
            current_run: self.extra.as_ref().and_then(|x| x.current_run.clone()),
            run: self.extra.as_ref().and_then(|x| x.run.clone()),
            last_seen: self.extra.as_ref().and_then(|x| x.last_seen.clone()),
            finished_at: self.extra.as_ref().and_then(|x| x.finished_at.clone()),
            path: self.extra.and_then(|x| x.path),
        };
        serde_json::to_vec(&problem).unwrap_or_default()
    }
}

/// A problem's code, on its response, for the edge's log: an answer that is
/// a 5xx by design (`shutting_down`) is not logged as a failure.
#[derive(Clone, Copy, Debug)]
pub struct ProblemCode(pub &'static str);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, index, retry_after, code) =
            (self.status, self.index, self.retry_after, self.code);
        let mut res = (status, self.into_body()).into_response();
        res.extensions_mut().insert(ProblemCode(code));
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
        assert_eq!((io.status.as_u16(), io.code), (503, "store_failed"));
        assert!(io.retry_after);
        assert!(!io.detail.contains("EIO"), "{}", io.detail);
        // A heartbeat while etcd acknowledges no lease renewal.
        let unrenewed = ApiError::from(RegistryError::Unrenewed {
            alloc: "a".into(),
            task: "web".into(),
        });
        assert_eq!(
            (unrenewed.status.as_u16(), unrenewed.code),
            (503, "store_unavailable")
        );
        assert!(unrenewed.retry_after);
        // A heartbeat while its run's lease has ended and the run is not
        // marked again yet.
        let ended = ApiError::from(RegistryError::LeaseEnded {
            alloc: "a".into(),
            task: "web".into(),
        });
        assert_eq!(
            (ended.status.as_u16(), ended.code),
            (503, "store_unavailable")
        );
        assert!(ended.retry_after);
    }

    /// The disk store after a failed write (here: EIO on the log's fsync)
    /// takes no change until a restart. Through the API, the write that
    /// failed and every write after it are 503 `store_failed` with
    /// `Retry-After` (not 500 `internal`), health says the same, and no
    /// answer carries the store's text.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writes_after_a_failed_write_of_the_disk_store_are_503_store_failed() {
        use std::{path::PathBuf, sync::Arc};

        use axum::body::Body;
        use http_body_util::BodyExt;
        use tower::ServiceExt;

        use crate::{
            http::{HttpConfig, app, auth::Auth},
            registry::{Registry, RegistryConfig},
            store::{
                DiskStore, DiskStoreConfig,
                fs::{Fs, sim},
            },
        };

        let fs = sim::SimFs::new();
        let dir = PathBuf::from("/sim/data");
        fs.create_dir_all(&dir).unwrap();
        let store = DiskStore::open(DiskStoreConfig {
            fs: Arc::new(fs.clone()),
            ..DiskStoreConfig::new(dir)
        })
        .unwrap();
        let registry = Registry::open(Arc::new(store), RegistryConfig::default()).unwrap();
        let router = app(registry, HttpConfig::default(), Arc::new(Auth::default()));
        let send = |method: &str, uri: &str, body: &str| {
            let mut req = axum::http::Request::builder().method(method).uri(uri);
            if !body.is_empty() {
                req = req.header(header::CONTENT_TYPE, "application/json");
            }
            let req = req.body(Body::from(body.to_owned())).unwrap();
            let router = router.clone();
            async move {
                let res = router.oneshot(req).await.unwrap();
                let (parts, body) = res.into_parts();
                let body = body.collect().await.unwrap().to_bytes();
                (parts, String::from_utf8(body.to_vec()).unwrap())
            }
        };
        let report = || {
            send(
                "PUT",
                "/v1/allocations/a1/tasks/web/state",
                r#"{"state": "running"}"#,
            )
        };
        let (registered, _) = send(
            "PUT",
            "/v1/allocations/a1",
            r#"{"tasks": [{"name": "web"}]}"#,
        )
        .await;
        assert_eq!(registered.status, StatusCode::CREATED);
        fs.fail_with(|op, path| {
            let log = path.to_string_lossy().contains("taskgate.wal.");
            (op == sim::Op::SyncData && log).then(|| std::io::Error::from_raw_os_error(5))
        });
        let first = report().await;
        fs.heal();
        let later = report().await;
        for (what, (parts, body)) in [("the failed write", first), ("a later write", later)] {
            assert_eq!(
                parts.status,
                StatusCode::SERVICE_UNAVAILABLE,
                "{what}: {body}"
            );
            assert!(body.contains(r#""code":"store_failed""#), "{what}: {body}");
            assert!(parts.headers.contains_key(header::RETRY_AFTER), "{what}");
            for internal in ["Input/output", "os error", "taskgate.wal"] {
                assert!(!body.contains(internal), "{what}: {body}");
            }
        }
        let (health, body) = send("GET", "/v1/health", "").await;
        assert_eq!(health.status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(body.contains(r#""code":"store_failed""#), "{body}");
    }
}
