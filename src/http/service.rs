//! Service routes: health, metrics, the OpenAPI document, the docs UI.

use axum::{
    extract::State,
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};

use crate::{
    metrics::{self, Scrape},
    store::StoreHealth,
};

use super::{
    AppState,
    error::ApiError,
    error::Problem,
    extract::ApiQuery,
    extract::NoParams,
    views::{HealthView, ReplicaView},
};

/// The front door.
///
/// Someone who opens the server's address in a browser lands in the web
/// view; the body says where the API is described, for whoever reads it
/// without following the redirect (curl). Never needs a token.
#[utoipa::path(
    get, path = "/", operation_id = "getRoot", tag = "service",
    responses(
        (status = 307, description = "To the web view, `/ui`; the body points to `/docs` and `/openapi.json` too",
         body = String, content_type = "text/plain",
         headers(("Location" = String, description = "`/ui`"))),
    )
)]
pub async fn root(_: ApiQuery<NoParams>) -> Response {
    (
        StatusCode::TEMPORARY_REDIRECT,
        [
            (header::LOCATION, HeaderValue::from_static("/ui")),
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            ),
        ],
        "taskgate: the web view is at /ui; the HTTP API is described at /docs (Swagger UI) \
         and /openapi.json, its error codes at /errors.\n",
    )
        .into_response()
}

/// Health.
///
/// 200 once the store is loaded and the server accepts work: `{"status":
/// "ok"}`, or `{"status": "degraded", "problems": [...]}` while the store
/// takes writes but its background work fails (`checkpoints_failing`,
/// `log_rollover_failing`: the log grows toward its ceiling; the cause is
/// in the server's log), or while a replica on etcd finds records it
/// cannot read (`records_unreadable`, with the allocations in
/// `unreadable`: those are answered 503 `store_failed`, the rest served). 503 while it starts or stops, or while the store
/// refuses writes. Never needs a token, and never carries an internal
/// error's text.
#[utoipa::path(
    get, path = "/v1/health", operation_id = "getHealth", tag = "service",
    responses(
        (status = 200, description = "Serving: `ok`, or `degraded` with the problems of the store's background work", body = HealthView),
        (status = 503, description = "`starting` (the store is still loading), `shutting_down`, or `store_failed`: the store refuses writes, after a write it cannot vouch for (restart the server) or because its log reached its ceiling while checkpoints fail (writes resume once one succeeds); or `store_unavailable`: a replica on etcd cannot reach a quorum or has not caught up (it recovers by itself); the cause is in the server's log", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn health(
    State(s): State<AppState>,
    _: ApiQuery<NoParams>,
) -> Result<Response, ApiError> {
    if s.registry.is_shutting_down() {
        return Err(crate::registry::RegistryError::ShuttingDown.into());
    }
    let replica = s.registry.view_index().map(|index| ReplicaView {
        state: "synced",
        index,
    });
    // The supervised tasks' trouble (one restarted lately) and the
    // store's background work's.
    let tasks = s.registry.config().supervisor.problems();
    let view = match s.registry.store_health() {
        StoreHealth::Ok if tasks.is_empty() => HealthView {
            status: "ok",
            problems: Vec::new(),
            unreadable: Vec::new(),
            view: replica,
        },
        StoreHealth::Ok => HealthView {
            status: "degraded",
            problems: tasks,
            unreadable: Vec::new(),
            view: replica,
        },
        StoreHealth::Degraded(problems) => HealthView {
            status: "degraded",
            problems: problems
                .into_iter()
                .map(str::to_owned)
                .chain(tasks)
                .collect(),
            unreadable: s.registry.unreadable(100),
            view: replica,
        },
        StoreHealth::Refusing {
            code: "store_unavailable",
            ..
        } => {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store_unavailable",
                format!(
                    "this replica is syncing: it cannot reach a quorum of its etcd cluster, or \
                     has not caught up with it (its view is at index {}); reads answer from that \
                     view, writes are refused (the cause is in the server's log)",
                    s.registry.view_index().unwrap_or(0)
                ),
            )
            .retry_later());
        }
        StoreHealth::Refusing { code, .. } => {
            let detail = if code == "log_full" {
                "the store refuses writes: its log reached its ceiling because checkpoints fail; \
                 writes resume once one succeeds (the cause is in the server's log)"
            } else {
                "the store refuses writes after a write it cannot vouch for; restart the server \
                 (the cause is in the server's log)"
            };
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store_failed",
                detail,
            ));
        }
    };
    Ok(super::json(StatusCode::OK, &view))
}

/// Metrics in the Prometheus text format.
#[utoipa::path(
    get, path = "/metrics", operation_id = "getMetrics", tag = "service",
    responses((status = 200, description = "Prometheus text exposition", body = String, content_type = "text/plain"))
)]
pub async fn metrics(State(s): State<AppState>, _: ApiQuery<NoParams>) -> Response {
    let health = s.registry.store_health();
    let text = s.registry.metrics().render(Scrape {
        waiters: s.registry.waiters() as u64,
        allocations: s.registry.len() as u64,
        last_index: s.registry.last_index(),
        store_degraded: matches!(health, StoreHealth::Degraded(_)),
        store_refusing_writes: matches!(health, StoreHealth::Refusing { .. }),
        stream_rendered_bytes: s.registry.stream_rendered_bytes() as u64,
        timer_entries: s.registry.timer_entries() as u64,
    });
    let mut res = text.into_response();
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(metrics::CONTENT_TYPE),
    );
    res
}

/// This OpenAPI document.
#[utoipa::path(
    get, path = "/openapi.json", operation_id = "getOpenApiDocument", tag = "service",
    responses((status = 200, description = "The OpenAPI 3.1 document", body = Object))
)]
pub async fn openapi_json(State(s): State<AppState>, _: ApiQuery<NoParams>) -> Response {
    let mut res = (StatusCode::OK, s.openapi.to_string()).into_response();
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    res
}

/// The error codes, one section each: what `type` (`/errors#<code>`) of a
/// problem points to. Plain HTML, no script, no outside resource.
#[utoipa::path(
    get, path = "/errors", operation_id = "getErrorCodes", tag = "service",
    responses((status = 200, description = "Every problem code: its status, what it means, what to do", body = String, content_type = "text/html"))
)]
pub async fn errors(_: ApiQuery<NoParams>) -> Response {
    let mut html = String::from(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>taskgate: error codes</title></head><body>\
         <h1>taskgate error codes</h1><p>Every error is <code>application/problem+json</code> \
         with a stable <code>code</code>; its <code>type</code> links here.</p>",
    );
    for (code, status, text) in super::error::CODES {
        html.push_str(&format!(
            "<section id=\"{code}\"><h2><code>{code}</code> ({status})</h2><p>{}</p></section>",
            escape(text)
        ));
    }
    html.push_str("</body></html>");
    let mut res = html.into_response();
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    res
}

/// Text as HTML, with `code spans` kept as code.
fn escape(text: &str) -> String {
    let plain = text
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    // Backticks open and close code spans, in turn.
    let mut out = String::with_capacity(plain.len());
    for (i, part) in plain.split('`').enumerate() {
        if i % 2 == 1 {
            out.push_str("<code>");
            out.push_str(part);
            out.push_str("</code>");
        } else {
            out.push_str(part);
        }
    }
    out
}
