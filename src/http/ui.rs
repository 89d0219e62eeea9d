//! The web view: a page and its script and style, built into the binary
//! (no network at run time), served without a token like `/docs`. Every
//! piece of data it shows comes from the API, with the token the operator
//! enters in the page, under the API's own rules.

use axum::{
    http::{HeaderName, HeaderValue, header},
    response::{IntoResponse, Response},
};

const PAGE: &str = include_str!("../../ui/index.html");
const SCRIPT: &str = include_str!("../../ui/app.js");
const STYLE: &str = include_str!("../../ui/app.css");

/// The page's own files only; no inline script or style, no framing.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                      img-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let headers: [(HeaderName, HeaderValue); 4] = [
        (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
        // Built into the binary: an upgraded server serves new files at
        // the same paths, so browsers ask again each time.
        (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        (
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(POLICY),
        ),
        (
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ),
    ];
    (headers, body).into_response()
}

/// `/ui`, `/ui/`, `/ui/allocations/{id}`, `/ui/semaphores` and
/// `/ui/semaphores/{name}`: one page, which reads its path.
pub async fn page() -> Response {
    asset("text/html; charset=utf-8", PAGE)
}

pub async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

pub async fn style() -> Response {
    asset("text/css; charset=utf-8", STYLE)
}
