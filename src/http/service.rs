//! Service routes: health, metrics, the OpenAPI document, the docs UI.

use axum::{
    extract::State,
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};

use super::{
    AppState, error::ApiError, error::Problem, extract::ApiQuery, extract::NoParams,
    views::HealthView,
};

/// Health.
///
/// 200 once the store is loaded and the server accepts work; 503 while it
/// starts or stops. Never needs a token.
#[utoipa::path(
    get, path = "/v1/health", tag = "service",
    responses(
        (status = 200, description = "Serving", body = HealthView),
        (status = 503, description = "`starting` (the store is still loading), `shutting_down`, or `store_failed` (the store takes no more changes after a write it cannot vouch for; restart the server)", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn health(
    State(s): State<AppState>,
    _: ApiQuery<NoParams>,
) -> Result<Response, ApiError> {
    if s.registry.is_shutting_down() {
        return Err(crate::registry::RegistryError::ShuttingDown.into());
    }
    if let Some(why) = s.registry.store_failure() {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_failed",
            why,
        ));
    }
    Ok(super::json(StatusCode::OK, &HealthView { status: "ok" }))
}

/// Metrics in the Prometheus text format.
#[utoipa::path(
    get, path = "/metrics", tag = "service",
    responses((status = 200, description = "Prometheus text exposition", body = String, content_type = "text/plain"))
)]
pub async fn metrics(State(s): State<AppState>, _: ApiQuery<NoParams>) -> Response {
    let gauges = [
        (
            "taskgate_waiters",
            "Requests parked in a long-poll or blocking query.",
            s.registry.waiters() as u64,
        ),
        (
            "taskgate_allocations",
            "Registered allocations.",
            s.registry.len() as u64,
        ),
        (
            "taskgate_last_index",
            "The last global index handed out.",
            s.registry.last_index(),
        ),
        (
            "taskgate_connections",
            "Client connections open now.",
            s.registry.metrics().connections(),
        ),
    ];
    let mut res = s.registry.metrics().render(&gauges).into_response();
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    res
}

/// This OpenAPI document.
#[utoipa::path(
    get, path = "/openapi.json", tag = "service",
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
