//! What every request passes through, in one middleware (each axum
//! `from_fn` layer costs a boxed future and a service clone per request,
//! so the edge is one layer, not five): a span with the request ID, the
//! host and cross-site checks (`site.rs`), authorization, the time bound
//! on requests that do not wait, problem+json for axum's bare 405,
//! `?pretty`, and the request metrics.

use std::{sync::Arc, task::Poll, time::Duration};

use axum::{
    body::Body,
    extract::{MatchedPath, Request, State},
    http::{HeaderValue, Method, StatusCode, header},
    middleware::Next,
    response::{IntoResponse, Response},
};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::{
    auth::{Auth, STREAM_ROUTE, Token},
    error::{ApiError, payload_too_large},
    query::{PRETTY, pretty_on, query_pairs},
};
use crate::metrics::Metrics;

/// The request-ID header, accepted from the client or generated.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Routes whose GET (and HEAD, which runs the GET handler) may wait
/// (bounded by the wait cap instead, or for the stream, by its client).
pub(crate) const WAITING_ROUTES: [&str; 5] = [
    "/v1/allocations/{alloc_id}",
    "/v1/allocations/{alloc_id}/events",
    "/v1/allocations/{alloc_id}/tasks/{task}",
    "/v1/allocations/{alloc_id}/tasks/{task}/start-condition",
    STREAM_ROUTE,
];

pub struct Edge {
    pub metrics: Arc<Metrics>,
    pub auth: Arc<Auth>,
    /// The hosts served and the cross-site rule, checked before the token.
    pub site: Arc<super::site::Site>,
    /// Longest time a request that does not wait may take.
    pub request_timeout: Duration,
    /// Largest request body; a larger announced `Content-Length` is
    /// refused before any of the body is read.
    pub body_limit: usize,
    /// The store's ID, on every answer (`X-Taskgate-Store`).
    pub store_id: HeaderValue,
    /// Whether traces are on: then the request's span gets a name, its
    /// allocation, task and status (`traced`), which cost nothing
    /// otherwise.
    pub traces: bool,
}

/// The store's ID, on every answer: a client tells "deleted" from "not
/// the store I was talking to" by it.
pub const STORE_HEADER: &str = "x-taskgate-store";

/// A client's request ID is kept if it is short printable ASCII.
fn client_request_id(req: &Request) -> Option<HeaderValue> {
    let v = req.headers().get(REQUEST_ID_HEADER)?;
    let ok = !v.is_empty() && v.len() <= 128 && v.as_bytes().iter().all(u8::is_ascii_graphic);
    ok.then(|| v.clone())
}

/// Counts a request whose client went away before its answer (the future
/// dropped mid-way) as status 499, as nginx does, so it is not lost from the
/// metrics; a request that ends normally disarms it.
struct Abandoned<'a> {
    edge: &'a Edge,
    method: &'a Method,
    route: Option<&'a str>,
    started: std::time::Instant,
    span: &'a tracing::Span,
    armed: bool,
}

impl Drop for Abandoned<'_> {
    fn drop(&mut self) {
        if self.armed {
            let latency = self.started.elapsed();
            tracing::debug!(parent: self.span, latency_ms = latency.as_secs_f64() * 1000.0, "the client went away before its answer");
            self.edge.metrics.http_request(
                self.method.as_str(),
                self.route.unwrap_or("unmatched"),
                499,
                latency,
            );
        }
    }
}

pub async fn edge(State(edge): State<Arc<Edge>>, req: Request, next: Next) -> Response {
    let started = std::time::Instant::now();
    let method = req.method().clone();
    let matched = req.extensions().get::<MatchedPath>().cloned();
    let route = matched.as_ref().map(MatchedPath::as_str);
    let request_id = client_request_id(&req).unwrap_or_else(|| {
        HeaderValue::from_str(&format!("{:032x}", fastrand::u128(..)))
            .expect("hex is a valid header value")
    });
    let span = if edge.traces {
        traced(&method, route, &request_id, req.uri().path())
    } else {
        tracing::info_span!(
            "request",
            method = %method,
            route = route.unwrap_or("unmatched"),
            request_id = request_id.to_str().unwrap_or_default(),
        )
    };
    let pretty = req.uri().query().is_some_and(|q| {
        query_pairs(Some(q)).is_some_and(|pairs| {
            pairs
                .iter()
                .any(|(k, v)| k == PRETTY && pretty_on(v) == Some(true))
        })
    });

    let mut abandoned = Abandoned {
        edge: &edge,
        method: &method,
        route,
        started,
        span: &span,
        armed: true,
    };
    let mut res = async {
        let mut req = req;
        if let Err(refused) = edge.site.admit(&req) {
            // Client-given values, Debug-quoted: a log line stays one line.
            tracing::info!(
                host = ?req.headers().get(header::HOST),
                origin = ?req.headers().get(header::ORIGIN),
                sec_fetch_site = ?req.headers().get("sec-fetch-site"),
                "refused ({}): {}",
                refused.answer.status.as_u16(),
                refused.why
            );
            return refused.answer.into_response();
        }
        let (checked, decided) = edge.auth.check(req, route).await;
        req = checked;
        let caller = match decided {
            Ok(caller) => caller,
            Err(denied) => return *denied,
        };
        let waits = (method == Method::GET || method == Method::HEAD)
            && route.is_some_and(|r| WAITING_ROUTES.contains(&r));
        let stream = waits && route == Some(STREAM_ROUTE);
        // A token's waits count against its own limit while they last. A
        // stream always waits, so it takes its wait here; the other
        // waiting routes take one only if they park (`parked_with_slot`).
        let mut stream_slot = None;
        if let Some(token) = &caller {
            if stream {
                match edge.auth.wait_slot(token) {
                    Some(slot) => stream_slot = Some(slot),
                    None => return quota_exceeded(token),
                }
            }
            // Registration applies the caller's own quota and checks its
            // dependencies' targets; a task query counts as a sign of life
            // only from a caller that may act for the task.
            req.extensions_mut()
                .insert(super::auth::Caller(token.clone()));
        }
        if announced_length(&req).is_some_and(|n| n > edge.body_limit as u64) {
            return payload_too_large().into_response();
        }
        let res = if waits {
            match caller.as_ref().filter(|_| !stream) {
                Some(token) => parked_with_slot(&edge.auth, token, next.run(req)).await,
                None => next.run(req).await,
            }
        } else {
            match tokio::time::timeout(edge.request_timeout, next.run(req)).await {
                Ok(res) => res,
                Err(_) => timed_out(),
            }
        };
        let mut res = problem_for_bare_405(res);
        if let Some(slot) = stream_slot {
            // A stream waits in its body, after this returns: the token's
            // slot goes with it.
            res = res.map(|body| axum::body::Body::new(Holding { body, _slot: slot }));
        }
        if pretty { prettify(res).await } else { res }
    }
    .instrument(span.clone())
    .await;

    abandoned.armed = false;
    drop(abandoned);
    // Status and latency go on the request's closing event rather than
    // being recorded into the span: recording re-renders the span's fields,
    // a cost every request would pay even when nothing is logged.
    let latency = started.elapsed();
    let status = res.status().as_u16();
    if edge.traces {
        answered(&span, status);
    }
    let latency_ms = latency.as_secs_f64() * 1000.0;
    // A parked wait answered 503 `shutting_down` is the shutdown working
    // as designed (every parked request gets one), not a failure; a 503
    // `jwt_keys_unavailable` is a refusal, logged at info (anyone can get
    // one with a made-up `kid`).
    let by_design = res
        .extensions()
        .get::<super::error::ProblemCode>()
        .is_some_and(|c| c.0 == "shutting_down" || c.0 == "jwt_keys_unavailable");
    if status >= 500 && !by_design {
        tracing::warn!(parent: &span, status, latency_ms, "request failed");
    } else {
        tracing::debug!(parent: &span, status, latency_ms, "request");
    }
    edge.metrics.http_request(
        method.as_str(),
        route.unwrap_or("unmatched"),
        status,
        latency,
    );
    res.headers_mut().insert(REQUEST_ID_HEADER, request_id);
    res.headers_mut()
        .insert(STORE_HEADER, edge.store_id.clone());
    res
}

/// With traces on, the request's span: as without them, named as
/// OpenTelemetry names it (`PUT /v1/allocations/{alloc_id}`, a server
/// span), with the allocation and task of its path (percent-decoded) as
/// OpenTelemetry attributes; its status is set once answered (`answered`).
/// A callsite of its own: without traces the span has none of this, which
/// every request would pay for. The attributes go to OpenTelemetry alone,
/// not into the span's fields, which the log layer renders.
fn traced(
    method: &Method,
    route: Option<&str>,
    request_id: &HeaderValue,
    path: &str,
) -> tracing::Span {
    let span = tracing::info_span!(
        "request",
        method = %method,
        route = route.unwrap_or("unmatched"),
        request_id = request_id.to_str().unwrap_or_default(),
        "otel.name" = %format_args!("{method} {}", route.unwrap_or("unmatched")),
        "otel.kind" = "server",
    );
    for (param, value) in route.unwrap_or_default().split('/').zip(path.split('/')) {
        let key = match param {
            "{alloc_id}" => "taskgate.alloc_id",
            "{task}" => "taskgate.task",
            _ => continue,
        };
        let value = percent_encoding::percent_decode_str(value).decode_utf8_lossy();
        span.set_attribute(key, value.into_owned());
    }
    span
}

/// With traces on, the request's status on its span (an error for a 5xx).
fn answered(span: &tracing::Span, status: u16) {
    span.set_attribute("http.response.status_code", i64::from(status));
    if status >= 500 {
        span.set_status(opentelemetry::trace::Status::error(""));
    }
}

/// 429 for a token that holds as many waits as it may.
fn quota_exceeded(token: &Token) -> Response {
    ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "quota_exceeded",
        format!("token {:?} holds as many waits as it may", token.name),
    )
    .retry_later()
    .into_response()
}

/// Runs a request of a waiting route (not the stream) for `token`, which
/// takes one of the token's waits when, and only if, it parks, and holds
/// it until it answers: a plain GET, or a blocking query or start-condition
/// that answers at once, is no wait. It parks when its handler's future is
/// first pending: these handlers await nothing but the registry's wait,
/// which parks before it awaits, and answers without awaiting when it
/// need not wait (the test `only_parked_requests_hold_a_token_s_waits`
/// holds them to that). Taken here rather than in the registry, which
/// knows nothing of tokens. With no wait left, the parked request is let
/// go (dropping its future unparks it) and answered 429.
async fn parked_with_slot(
    auth: &Auth,
    token: &Arc<Token>,
    run: impl Future<Output = Response>,
) -> Response {
    let mut run = std::pin::pin!(run);
    let mut slot = None;
    std::future::poll_fn(|cx| match run.as_mut().poll(cx) {
        Poll::Ready(res) => Poll::Ready(res),
        Poll::Pending if slot.is_some() => Poll::Pending,
        Poll::Pending => match auth.wait_slot(token) {
            Some(taken) => {
                slot = Some(taken);
                Poll::Pending
            }
            None => Poll::Ready(quota_exceeded(token)),
        },
    })
    .await
}

/// The body length a request announces in `Content-Length`.
fn announced_length(req: &Request) -> Option<u64> {
    req.headers()
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// A request that does not wait ran out of time. A write may still be
/// applied: its commit is not cancelled.
fn timed_out() -> Response {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "timeout",
        "the request took too long; a write may still have been applied",
    )
    .retry_later()
    .into_response()
}

/// Gives a problem+json body to the 405 that axum answers by itself.
/// (axum adds the `Allow` header outside route layers, so it is kept.)
fn problem_for_bare_405(res: Response) -> Response {
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

/// `?pretty`: re-renders a JSON answer indented, for curl.
async fn prettify(res: Response) -> Response {
    let is_json = res
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| {
            ct.starts_with("application/json") || ct.starts_with("application/problem+json")
        });
    if !is_json {
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

/// A response body that holds a token's wait slot until it is dropped.
struct Holding {
    body: axum::body::Body,
    _slot: super::auth::WaitSlot,
}

impl http_body::Body for Holding {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
