//! All axum and utoipa code: routes, extractors that turn rejections into
//! problem+json, the error type and the OpenAPI document. Handlers parse,
//! call one registry method and render; no lifecycle rule and no store call
//! lives here.

mod allocations;
pub mod auth;
pub mod dto;
pub mod error;
pub mod extract;
pub mod openapi;
pub mod params;
mod service;
mod tasks;
pub mod views;

use std::{sync::Arc, time::Duration};

use axum::{
    Router,
    body::Body,
    extract::{DefaultBodyLimit, Request},
    http::{HeaderValue, StatusCode, header},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{get, post, put},
};
use serde::Serialize;
use tower_http::catch_panic::CatchPanicLayer;
use tracing::Instrument;
use utoipa_swagger_ui::{Config as SwaggerConfig, SwaggerUi};

use crate::registry::Registry;
use error::ApiError;

/// The allocation's `modify_index` after the call.
pub const INDEX_HEADER: &str = "x-taskgate-index";
/// The token of the next page of a listing.
pub const NEXT_TOKEN_HEADER: &str = "x-taskgate-nexttoken";

/// HTTP-level settings.
#[derive(Clone, Copy, Debug)]
pub struct HttpConfig {
    /// Largest request body accepted.
    pub body_limit: usize,
    /// Wait of a blocking query or long-poll without `wait`.
    pub default_wait: Duration,
    /// Longest wait a client may ask for.
    pub max_wait: Duration,
    /// Longest time a request that does not wait may take.
    pub request_timeout: Duration,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            body_limit: 1024 * 1024,
            default_wait: Duration::from_secs(30),
            max_wait: Duration::from_secs(300),
            request_timeout: Duration::from_secs(30),
        }
    }
}

/// What every handler gets.
#[derive(Clone)]
pub struct AppState {
    pub registry: Registry,
    pub config: HttpConfig,
    /// The OpenAPI document, rendered once.
    openapi: Arc<str>,
}

impl AppState {
    /// How long a wait may last: the asked `wait` (or the default), capped,
    /// plus a random jitter of up to a sixteenth so that many clients with
    /// the same timeout do not all come back at once.
    pub fn wait_time(&self, asked: Option<Duration>) -> Duration {
        let base = asked
            .unwrap_or(self.config.default_wait)
            .min(self.config.max_wait);
        base + (base / 16).mul_f64(fastrand::f64())
    }
}

/// A JSON answer with `X-Taskgate-Index`.
pub(crate) fn indexed<T: Serialize>(status: StatusCode, index: u64, body: &T) -> Response {
    let mut res = json(status, body);
    res.headers_mut()
        .insert(INDEX_HEADER, HeaderValue::from(index));
    res
}

/// A JSON answer. Serialized into one buffer sized for an allocation view,
/// so a typical answer is written without growing it (axum's `Json`
/// starts small and reallocates several times for a multi-KiB view).
pub(crate) fn json<T: Serialize>(status: StatusCode, body: &T) -> Response {
    let mut buf = Vec::with_capacity(4096);
    match serde_json::to_writer(&mut buf, body) {
        Ok(()) => (
            status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            buf,
        )
            .into_response(),
        Err(e) => {
            tracing::error!(error = %e, "a response did not serialize");
            ApiError::internal().into_response()
        }
    }
}

/// The whole HTTP application.
pub fn app(registry: Registry, config: HttpConfig, auth: Arc<auth::Auth>) -> Router {
    let metrics = registry.metrics().clone();
    let state = AppState {
        registry,
        config,
        openapi: openapi::document().into(),
    };
    let api = Router::new()
        .route("/v1/allocations", get(allocations::list))
        .route(
            "/v1/allocations/{alloc_id}",
            put(allocations::register)
                .get(allocations::get)
                .delete(allocations::delete),
        )
        .route(
            "/v1/allocations/{alloc_id}/task-states",
            post(allocations::report_batch),
        )
        .route(
            "/v1/allocations/{alloc_id}/restart",
            post(allocations::restart),
        )
        .route(
            "/v1/allocations/{alloc_id}/restore",
            post(allocations::restore),
        )
        .route("/v1/allocations/{alloc_id}/tasks/{task}", get(tasks::get))
        .route(
            "/v1/allocations/{alloc_id}/tasks/{task}/state",
            put(tasks::report),
        )
        .route(
            "/v1/allocations/{alloc_id}/tasks/{task}/start-condition",
            get(tasks::start_condition),
        )
        .route("/v1/health", get(service::health))
        .route("/metrics", get(service::metrics))
        .route("/openapi.json", get(service::openapi_json))
        .with_state(state);
    let docs: Router = SwaggerUi::new("/docs")
        .config(SwaggerConfig::new(["/openapi.json"]))
        .into();
    api.merge(docs)
        .fallback(|| async { ApiError::not_found() })
        .layer(middleware::from_fn_with_state(
            config.request_timeout,
            request_timeout,
        ))
        .layer(middleware::from_fn_with_state(auth, auth::authorize))
        .layer(DefaultBodyLimit::max(config.body_limit))
        .layer(middleware::from_fn(problem_for_bare_errors))
        .layer(middleware::from_fn(pretty))
        .layer(middleware::from_fn_with_state(metrics, observe))
        .layer(CatchPanicLayer::custom(
            |_: Box<dyn std::any::Any + Send>| {
                tracing::error!("a request handler panicked");
                ApiError::internal().into_response()
            },
        ))
}

/// Routes whose GET may wait (bounded by the wait cap instead).
const WAITING_ROUTES: [&str; 3] = [
    "/v1/allocations/{alloc_id}",
    "/v1/allocations/{alloc_id}/tasks/{task}",
    "/v1/allocations/{alloc_id}/tasks/{task}/start-condition",
];

/// Bounds the time of requests that do not wait. A write that runs out of
/// time may still be applied: its commit is not cancelled.
async fn request_timeout(
    axum::extract::State(limit): axum::extract::State<Duration>,
    req: Request,
    next: Next,
) -> Response {
    let waits = req.method() == axum::http::Method::GET
        && req
            .extensions()
            .get::<axum::extract::MatchedPath>()
            .is_some_and(|m| WAITING_ROUTES.contains(&m.as_str()));
    if waits {
        return next.run(req).await;
    }
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(res) => res,
        Err(_) => {
            let mut res = ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "timeout",
                "the request took too long; a write may still have been applied",
            )
            .into_response();
            res.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            res
        }
    }
}

/// The request-ID header, accepted from the client or generated.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// A client's request ID is kept if it is short printable ASCII.
fn client_request_id(req: &Request) -> Option<HeaderValue> {
    let v = req.headers().get(REQUEST_ID_HEADER)?;
    let ok = !v.is_empty() && v.len() <= 128 && v.as_bytes().iter().all(|b| b.is_ascii_graphic());
    ok.then(|| v.clone())
}

/// One span per request (method, matched route, request ID, status,
/// latency), the request-ID header echoed, and the request counted.
async fn observe(
    axum::extract::State(metrics): axum::extract::State<Arc<crate::metrics::Metrics>>,
    req: Request,
    next: Next,
) -> Response {
    let started = std::time::Instant::now();
    let method = req.method().clone();
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .cloned();
    let route = route.as_ref().map_or("unmatched", |m| m.as_str());
    let request_id = client_request_id(&req).unwrap_or_else(|| {
        HeaderValue::from_str(&format!("{:032x}", fastrand::u128(..)))
            .expect("hex is a valid header value")
    });
    let span = tracing::info_span!(
        "request",
        method = %method,
        route = %route,
        request_id = request_id.to_str().unwrap_or_default(),
        status = tracing::field::Empty,
        latency_ms = tracing::field::Empty,
    );
    let mut res = next.run(req).instrument(span.clone()).await;
    let latency = started.elapsed();
    let status = res.status().as_u16();
    span.record("status", status);
    span.record("latency_ms", latency.as_secs_f64() * 1000.0);
    if status >= 500 {
        tracing::warn!(parent: &span, "request failed");
    } else {
        tracing::debug!(parent: &span, "request");
    }
    metrics.http_request(method.as_str(), route, status, latency);
    res.headers_mut().insert(REQUEST_ID_HEADER, request_id);
    res
}

/// Gives a problem+json body to the 405 that axum answers by itself.
/// (axum adds the `Allow` header outside route layers, so it is kept.)
async fn problem_for_bare_errors(req: Request, next: Next) -> Response {
    let res = next.run(req).await;
    if res.status() != StatusCode::METHOD_NOT_ALLOWED
        || res.headers().contains_key(header::CONTENT_TYPE)
    {
        return res;
    }
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this method is not allowed on this path; the Allow header lists those that are",
    )
    .into_response()
}

/// `?pretty` on any route: re-renders a JSON answer indented, for curl.
async fn pretty(req: Request, next: Next) -> Response {
    let wanted = extract::query_pairs(req.uri().query())
        .is_some_and(|pairs| pairs.iter().any(|(k, _)| k == extract::PRETTY));
    let res = next.run(req).await;
    let is_json = res
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| {
            ct.starts_with("application/json") || ct.starts_with("application/problem+json")
        });
    if !wanted || !is_json {
        return res;
    }
    let (mut parts, body) = res.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, usize::MAX).await else {
        return ApiError::internal().into_response();
    };
    let rendered = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| serde_json::to_vec_pretty(&v).ok());
    let mut out = rendered.unwrap_or_else(|| bytes.to_vec());
    out.push(b'\n');
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(out))
}
