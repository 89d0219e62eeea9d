//! All axum and utoipa code: routes, extractors that turn rejections into
//! problem+json, the error type and the OpenAPI document. Handlers parse,
//! call one registry method and render; no lifecycle rule and no store call
//! lives here.

mod allocations;
pub use allocations::HIDDEN_STEP;
pub mod auth;
mod barriers;
pub mod dto;
mod edge;
pub mod error;
mod events;
pub mod extract;
pub mod jwt;
pub mod openapi;
pub mod params;
pub mod prefer;
pub mod query;
pub mod render;
mod semaphores;
mod service;
pub mod site;
mod tasks;
mod ui;
pub mod views;

use std::{sync::Arc, time::Duration};

use axum::{
    Router,
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post, put},
};
use serde::Serialize;
use tower::Layer;
use tower_http::catch_panic::{CatchPanic, CatchPanicLayer};
use utoipa_swagger_ui::{Config as SwaggerConfig, SwaggerUi};

use crate::registry::Registry;
use error::ApiError;

/// The allocation's `modify_index` after the call.
pub const INDEX_HEADER: axum::http::HeaderName =
    axum::http::HeaderName::from_static("x-taskgate-index");
/// The token of the next page of a listing.
pub const NEXT_TOKEN_HEADER: &str = "x-taskgate-nexttoken";

/// HTTP-level settings.
#[derive(Clone, Debug)]
pub struct HttpConfig {
    /// Largest request body accepted.
    pub body_limit: usize,
    /// Wait of a blocking query or long-poll without `wait`.
    pub default_wait: Duration,
    /// Longest wait a client may ask for.
    pub max_wait: Duration,
    /// Longest time a request that does not wait may take.
    pub request_timeout: Duration,
    /// The hosts served, and the rule for cross-site writes (`site.rs`).
    pub site: Arc<site::Site>,
    /// Event streams open at once (`GET /v1/events`).
    pub max_streams: usize,
    /// Whether traces are on: then each request's span gets its
    /// allocation, task and status (`edge.rs`).
    pub traces: bool,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            body_limit: 1024 * 1024,
            default_wait: Duration::from_secs(30),
            max_wait: Duration::from_secs(300),
            request_timeout: Duration::from_secs(30),
            site: Arc::default(),
            max_streams: DEFAULT_MAX_STREAMS,
            traces: false,
        }
    }
}

/// Event streams open at once unless configured otherwise: each may hold
/// up to `events::BACKLOG_BYTES` (256 KiB) ahead of a reader that stopped
/// reading, so this bounds what streams can take to 256 MiB.
pub const DEFAULT_MAX_STREAMS: usize = 1024;

/// What every handler gets: one pointer, copied into each request's
/// futures (axum's and the handler's) for as long as a long-poll waits.
#[derive(Clone)]
pub struct AppState(Arc<AppStateInner>);

impl std::ops::Deref for AppState {
    type Target = AppStateInner;

    fn deref(&self) -> &AppStateInner {
        &self.0
    }
}

/// What `AppState` points to.
pub struct AppStateInner {
    pub registry: Registry,
    pub config: HttpConfig,
    /// One permit per open event stream (`config.max_streams`).
    streams: Arc<tokio::sync::Semaphore>,
    /// The OpenAPI document, rendered once.
    openapi: Arc<str>,
}

impl AppStateInner {
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

/// The allocation view of `a` (`views::AllocationView`) as a JSON answer
/// with `X-Taskgate-Index`, written by `render`: the same bytes as
/// `indexed(status, a.modify_index, &AllocationView::new(a, live))`.
pub(crate) fn allocation_answer(
    status: StatusCode,
    a: &crate::lifecycle::Allocation,
    live: &dyn views::Live,
) -> Response {
    let mut buf = Vec::with_capacity(render::size_hint(a));
    match render::allocation(&mut buf, a, &live.of(a)) {
        Ok(()) => {
            let mut res = json_bytes(status, buf);
            res.headers_mut()
                .insert(INDEX_HEADER, HeaderValue::from(a.modify_index));
            res
        }
        Err(e) => {
            tracing::error!(error = %e, "a response did not serialize");
            ApiError::internal().into_response()
        }
    }
}

/// Written JSON as an answer.
fn json_bytes(status: StatusCode, buf: Vec<u8>) -> Response {
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        buf,
    )
        .into_response()
}

/// A JSON answer. Serialized into one buffer sized for an allocation view,
/// so a typical answer is written without growing it (axum's `Json`
/// starts small and reallocates several times for a multi-KiB view).
pub(crate) fn json<T: Serialize>(status: StatusCode, body: &T) -> Response {
    let mut buf = Vec::with_capacity(4096);
    match serde_json::to_writer(&mut buf, body) {
        Ok(()) => json_bytes(status, buf),
        Err(e) => {
            tracing::error!(error = %e, "a response did not serialize");
            ApiError::internal().into_response()
        }
    }
}

/// The application as it is served (`server::serve`): a request that
/// panics is answered 500 and said, the connection and the server going
/// on. A handler's panic is caught by the edge (`edge::handled`), whose
/// answer carries the request's ID and is counted; this catches what
/// panics outside a handler. Around the router rather than one of its
/// layers, each of which boxes every request's future once more.
pub type Served = CatchPanic<Router, fn(Box<dyn std::any::Any + Send>) -> Response>;

/// `router` as it is served.
pub fn served(router: Router) -> Served {
    CatchPanicLayer::custom(panicked as fn(_) -> _).layer(router)
}

/// The answer to a request whose handler panicked.
fn panicked(_: Box<dyn std::any::Any + Send>) -> Response {
    tracing::error!("a request handler panicked");
    ApiError::internal().into_response()
}

/// The whole HTTP application.
pub fn app(registry: Registry, config: HttpConfig, auth: Arc<auth::Auth>) -> Router {
    let metrics = registry.metrics().clone();
    let store_id = registry.store_id().to_owned();
    let edge = edge::Edge {
        metrics,
        auth,
        site: config.site.clone(),
        request_timeout: config.request_timeout,
        body_limit: config.body_limit,
        traces: config.traces,
        store_id: HeaderValue::from_str(store_id.as_str())
            .unwrap_or_else(|_| HeaderValue::from_static("unidentified")),
    };
    let state = AppState(Arc::new(AppStateInner {
        registry,
        streams: Arc::new(tokio::sync::Semaphore::new(config.max_streams)),
        config,
        openapi: openapi::document().into(),
    }));
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
        .route("/v1/allocations/{alloc_id}/stop", post(allocations::stop))
        .route("/v1/allocations/{alloc_id}/tasks/{task}", get(tasks::get))
        .route(
            "/v1/allocations/{alloc_id}/tasks/{task}/state",
            put(tasks::report),
        )
        .route(
            "/v1/allocations/{alloc_id}/tasks/{task}/start-condition",
            get(tasks::start_condition),
        )
        .route(
            "/v1/allocations/{alloc_id}/tasks/{task}/heartbeat",
            put(tasks::heartbeat),
        )
        .route("/v1/semaphores", get(semaphores::list))
        .route(
            "/v1/semaphores/{name}",
            put(semaphores::put)
                .get(semaphores::get)
                .delete(semaphores::delete),
        )
        .route("/v1/barriers/{name}", get(barriers::get))
        .route("/", get(service::root))
        .route("/v1/health", get(service::health))
        .route("/metrics", get(service::metrics))
        .route("/openapi.json", get(service::openapi_json))
        .route("/errors", get(service::errors))
        .route(
            "/v1/allocations/{alloc_id}/events",
            get(allocations::timeline),
        )
        .route(auth::STREAM_ROUTE, get(events::stream))
        .route("/ui", get(ui::page))
        .route("/ui/", get(ui::page))
        .route("/ui/allocations/{alloc_id}", get(ui::page))
        .route("/ui/semaphores", get(ui::page))
        .route("/ui/semaphores/{name}", get(ui::page))
        .route("/ui/barriers/{name}", get(ui::page))
        .route("/ui/app.js", get(ui::script))
        .route("/ui/app.css", get(ui::style))
        .with_state(state);
    let docs: Router = SwaggerUi::new("/docs")
        .config(SwaggerConfig::new(["/openapi.json"]))
        .into();
    api.merge(docs)
        .fallback(|| async { ApiError::not_found() })
        .layer(edge::EdgeLayer(Arc::new(edge)))
}

#[cfg(test)]
mod tests {
    use axum::{Router, body::Body, http::Request, routing::get};
    use tower::ServiceExt;

    /// A handler that panics is answered 500 problem+json, and the router
    /// goes on answering.
    #[tokio::test]
    async fn a_panicking_handler_is_answered_500_and_the_router_goes_on() {
        async fn panics() -> &'static str {
            panic!("a handler's bug")
        }
        let served = super::served(
            Router::new()
                .route("/panics", get(panics))
                .route("/answers", get(|| async { "answered" })),
        );
        let get = |uri| Request::get(uri).body(Body::empty()).unwrap();
        let res = served.clone().oneshot(get("/panics")).await.unwrap();
        assert_eq!(res.status(), 500);
        assert_eq!(
            res.headers()["content-type"],
            "application/problem+json",
            "answered as every error is"
        );
        let res = served.oneshot(get("/answers")).await.unwrap();
        assert_eq!(res.status(), 200);
    }
}
