//! Extractors whose rejections are `ApiError`s: JSON bodies (415, 413,
//! `invalid_json` naming the field), strict query strings (unknown
//! parameters are a 400, `pretty` is always allowed) and validated path
//! identifiers.

use axum::{
    body::Bytes,
    extract::{FromRequest, FromRequestParts, Path, Request},
    http::{StatusCode, header, request::Parts},
};
use serde::de::DeserializeOwned;

use super::{
    error::ApiError,
    query::{PRETTY, query_pairs},
};
use crate::lifecycle::{AllocId, FieldError, TaskName};

/// A JSON request body. Requires `Content-Type: application/json`.
pub struct ApiJson<T>(pub T);

/// A JSON request body that may also be empty (then `T::default()`), for
/// `POST .../restart` where `{}` is the whole request.
pub struct ApiJsonOrEmpty<T>(pub T);

fn is_json(content_type: &str) -> bool {
    let mime = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
}

async fn body_bytes<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, ApiError> {
    Bytes::from_request(req, state).await.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            super::error::payload_too_large()
        } else {
            ApiError::invalid_json(None, rejection.body_text())
        }
    })
}

fn unsupported_media_type() -> ApiError {
    ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
        "the request body must be sent with Content-Type: application/json",
    )
}

/// Decodes JSON, naming the path of the first field that does not fit.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    // Most bodies are valid: decoded without tracking the path (which
    // costs every field of every body), and only a body that fails is
    // decoded again to name the field that broke.
    if let Ok(value) = serde_json::from_slice(bytes) {
        return Ok(value);
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let field = (path != ".").then_some(path);
        ApiError::invalid_json(field, e.into_inner().to_string())
    })?;
    de.end()
        .map_err(|e| ApiError::invalid_json(None, e.to_string()))?;
    Ok(value)
}

fn content_type(req: &Request) -> Option<&str> {
    req.headers()
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or(""))
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        if !content_type(&req).is_some_and(is_json) {
            return Err(unsupported_media_type());
        }
        let bytes = body_bytes(req, state).await?;
        decode(&bytes).map(ApiJson)
    }
}

impl<S: Send + Sync, T: DeserializeOwned + Default> FromRequest<S> for ApiJsonOrEmpty<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let declared = content_type(&req).map(is_json);
        let bytes = body_bytes(req, state).await?;
        match declared {
            None if bytes.is_empty() => Ok(ApiJsonOrEmpty(T::default())),
            Some(true) => decode(&bytes).map(ApiJsonOrEmpty),
            None | Some(false) => Err(unsupported_media_type()),
        }
    }
}

/// Query parameters a route accepts. `pretty` is accepted everywhere and
/// handled by the pretty-printing middleware.
pub trait QueryParams: Sized {
    /// Every parameter name this route accepts (besides `pretty`).
    const NAMES: &'static [&'static str];
    /// Builds the parameters from pairs already checked against `NAMES`.
    fn from_pairs(pairs: &Pairs) -> Result<Self, Vec<FieldError>>;
}

/// Query pairs, each name at most once.
pub struct Pairs(Vec<(String, String)>);

impl Pairs {
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Parsed, strictly checked query parameters.
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: QueryParams> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let Some(raw) = query_pairs(parts.uri.query()) else {
            return Err(ApiError::invalid(
                "the query string is not valid",
                vec![FieldError::new("query", "not valid URL form encoding")],
            ));
        };
        let mut errors = Vec::new();
        let mut pairs = Vec::new();
        for (k, v) in raw {
            if k == PRETTY {
                if super::query::pretty_on(&v).is_none() {
                    errors.push(FieldError::new(
                        k,
                        format!("{v:?} is not a value of pretty; give none, true or false"),
                    ));
                }
                continue;
            }
            if !T::NAMES.contains(&k.as_str()) {
                let expected = if T::NAMES.is_empty() {
                    "this route takes no query parameters besides `pretty`".to_owned()
                } else {
                    format!("expected one of: {}, pretty", T::NAMES.join(", "))
                };
                errors.push(FieldError::new(
                    k,
                    format!("unknown query parameter; {expected}"),
                ));
            } else if pairs.iter().any(|(seen, _): &(String, String)| *seen == k) {
                errors.push(FieldError::new(k, "given more than once"));
            } else {
                pairs.push((k, v));
            }
        }
        if errors.is_empty() {
            match T::from_pairs(&Pairs(pairs)) {
                Ok(params) => return Ok(ApiQuery(params)),
                Err(e) => errors = e,
            }
        }
        let mut names = errors
            .iter()
            .take(super::error::MAX_ERRORS)
            .map(|e| e.field.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        if errors.len() > super::error::MAX_ERRORS {
            names.push_str(&format!(
                " and {} more",
                errors.len() - super::error::MAX_ERRORS
            ));
        }
        Err(ApiError::invalid(
            format!("bad query parameter: {names}"),
            errors,
        ))
    }
}

/// Routes without parameters of their own.
pub struct NoParams;

impl QueryParams for NoParams {
    const NAMES: &'static [&'static str] = &[];
    fn from_pairs(_: &Pairs) -> Result<Self, Vec<FieldError>> {
        Ok(NoParams)
    }
}

fn path_rejected(e: axum::extract::rejection::PathRejection) -> ApiError {
    ApiError::invalid(
        "the request path is not valid",
        vec![FieldError::new("path", e.body_text())],
    )
}

fn parse_id<T>(
    field: &str,
    raw: &str,
    parse: fn(&str) -> Result<T, crate::lifecycle::IdError>,
) -> Result<T, FieldError> {
    parse(raw).map_err(|e| FieldError::new(field, format!("{raw:?} {e}")))
}

/// `/v1/allocations/{alloc_id}`.
pub struct AllocPath(pub AllocId);

impl<S: Send + Sync> FromRequestParts<S> for AllocPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(path_rejected)?;
        parse_id("alloc_id", &raw, AllocId::parse)
            .map(AllocPath)
            .map_err(|e| ApiError::invalid("invalid allocation ID", vec![e]))
    }
}

/// `/v1/semaphores/{name}`.
pub struct SemaphorePath(pub crate::lifecycle::SemName);

impl<S: Send + Sync> FromRequestParts<S> for SemaphorePath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(path_rejected)?;
        parse_id("name", &raw, crate::lifecycle::SemName::parse)
            .map(SemaphorePath)
            .map_err(|e| ApiError::invalid("invalid semaphore name", vec![e]))
    }
}

/// The run an agent names (`Taskgate-Run`, SEMANTICS "Runs"): the value
/// the server gave it, which no other run has. One that is not a run the
/// server could have given (not a number) names no current run.
pub struct RunHeader(pub Option<u64>);

/// The header's name.
pub const RUN_HEADER: axum::http::HeaderName = axum::http::HeaderName::from_static("taskgate-run");

impl<S: Send + Sync> FromRequestParts<S> for RunHeader {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let mut values = parts.headers.get_all(RUN_HEADER).iter();
        let Some(value) = values.next() else {
            return Ok(Self(None));
        };
        if values.next().is_some() {
            return Err(ApiError::invalid(
                "the Taskgate-Run header is not valid",
                vec![crate::lifecycle::FieldError::new(
                    "Taskgate-Run",
                    "give one Taskgate-Run, not several",
                )],
            ));
        }
        // Index 0 is never a run: a value that is not a number names none.
        let run = value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        Ok(Self(Some(run)))
    }
}

/// A write's `Idempotency-Key` (IETF httpapi draft): 1 to 255 printable
/// ASCII characters, as a bare token or a quoted string.
pub struct IdempotencyKey(pub Option<String>);

/// The header's name.
pub const IDEMPOTENCY_KEY: axum::http::HeaderName =
    axum::http::HeaderName::from_static("idempotency-key");

/// Longest key taken.
pub const MAX_IDEMPOTENCY_KEY: usize = 255;

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let mut values = parts.headers.get_all(IDEMPOTENCY_KEY).iter();
        let Some(value) = values.next() else {
            return Ok(Self(None));
        };
        let bad = |message: &str| {
            ApiError::invalid(
                "the Idempotency-Key header is not valid",
                vec![crate::lifecycle::FieldError::new(
                    "Idempotency-Key",
                    message,
                )],
            )
        };
        if values.next().is_some() {
            return Err(bad("give one Idempotency-Key, not several"));
        }
        let text = value.to_str().map_err(|_| bad("must be printable ASCII"))?;
        let key = text
            .strip_prefix('"')
            .and_then(|t| t.strip_suffix('"'))
            .unwrap_or(text);
        if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY {
            return Err(bad(&format!(
                "must be 1 to {MAX_IDEMPOTENCY_KEY} characters, got {}",
                key.len()
            )));
        }
        if !key.bytes().all(|b| b.is_ascii_graphic() || b == b' ') {
            return Err(bad("must be printable ASCII"));
        }
        Ok(Self(Some(key.to_owned())))
    }
}

impl IdempotencyKey {
    /// The key and the request it came with (`request` writes a
    /// canonical encoding of what the request asks; only called when a
    /// key came, since most reports carry none), as kept on tasks: the
    /// first 8 bytes of their SHA-256, the same on every replica and
    /// after every restart.
    pub fn with_request(
        &self,
        request: impl FnOnce(&mut Vec<u8>),
    ) -> Option<crate::lifecycle::IdemKey> {
        use sha2::{Digest, Sha256};
        let h = |bytes: &[u8]| {
            let d = Sha256::digest(bytes);
            u64::from_le_bytes(d[..8].try_into().expect("a SHA-256 has 32 bytes"))
        };
        let key = self.0.as_deref()?;
        let mut bytes = Vec::new();
        request(&mut bytes);
        Some(crate::lifecycle::IdemKey {
            key: h(key.as_bytes()),
            request: h(&bytes),
        })
    }
}

/// `/v1/allocations/{alloc_id}/tasks/{task}`.
pub struct TaskPath(pub AllocId, pub TaskName);

impl<S: Send + Sync> FromRequestParts<S> for TaskPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Path((alloc, task)) = Path::<(String, String)>::from_request_parts(parts, state)
            .await
            .map_err(path_rejected)?;
        let alloc = parse_id("alloc_id", &alloc, AllocId::parse);
        let task = parse_id("task", &task, TaskName::parse);
        match (alloc, task) {
            (Ok(a), Ok(t)) => Ok(TaskPath(a, t)),
            (a, t) => {
                let errors = [a.err(), t.err()].into_iter().flatten().collect();
                Err(ApiError::invalid("invalid identifier in path", errors))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_encoded_for_its_key_only_when_a_key_came() {
        let none = IdempotencyKey(None).with_request(|_| panic!("no key: nothing to encode"));
        assert_eq!(none, None);
        let key = IdempotencyKey(Some("r-1".to_owned()));
        let of = |bytes: &'static [u8]| {
            key.with_request(|r| r.extend_from_slice(bytes))
                .expect("a key came")
        };
        assert_eq!(of(b"running"), of(b"running"));
        assert_eq!(of(b"running").key, of(b"dead").key);
        assert_ne!(of(b"running").request, of(b"dead").request);
    }

    #[test]
    fn json_content_types() {
        assert!(is_json("application/json"));
        assert!(is_json("Application/JSON; charset=utf-8"));
        assert!(is_json("application/merge-patch+json"));
        assert!(!is_json("text/plain"));
        assert!(!is_json("application/jsonx"));
        assert!(!is_json(""));
    }

    #[derive(serde::Deserialize, Debug)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Outer {
        inner: Vec<Inner>,
    }
    #[derive(serde::Deserialize, Debug)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        n: u8,
    }

    #[test]
    fn decode_names_the_failing_field() {
        let e = decode::<Outer>(br#"{"inner":[{"n":1},{"n":"x"}]}"#).unwrap_err();
        assert_eq!(e.code, "invalid_json");
        assert_eq!(e.errors[0].field, "inner[1].n");
        let e = decode::<Outer>(br#"{"inner":[],"extra":1}"#).unwrap_err();
        assert_eq!(e.errors[0].field, "extra");
        let e = decode::<Outer>(br#"{"inner":[],"inner":[]}"#).unwrap_err();
        assert!(e.detail.contains("duplicate field"), "{}", e.detail);
        let e = decode::<Outer>(br#"{"inner":[]} trailing"#).unwrap_err();
        assert!(e.detail.contains("trailing"), "{}", e.detail);
    }
}
