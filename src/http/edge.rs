//! What every request passes through, in one layer of the router (each
//! layer costs a boxed future and a service clone per request, so the edge
//! is one layer, not five): a span with the request ID, the host and
//! cross-site checks (`site.rs`), authorization, the body limit, the time
//! bound on requests that do not wait, problem+json for axum's bare 405,
//! `?pretty`, and the request metrics.
//!
//! A long-poll holds its request's futures for all of its wait, so their
//! size is memory per parked request. The edge is a layer of its own
//! rather than axum's `middleware::from_fn` (whose future keeps the
//! request's parts beside the middleware's and reaches the route through
//! one more boxed service); it decides a request before its future starts
//! (`arrive`, `admit`), so that the future holds the called handler and
//! not the request too; and what only some requests await is not inline
//! in everyone's (a JWT issuer's keys re-read is a future of its own,
//! `?pretty` is boxed).

use std::{
    convert::Infallible,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use axum::{
    body::Body,
    extract::{DefaultBodyLimit, MatchedPath, Request},
    http::{HeaderValue, Method, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{Route, future::RouteFuture},
};
use tokio::time::Instant;
use tower::{Layer, Service};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::{
    auth::{Auth, Decision, KeysToReread, STREAM_ROUTE, Token, WaitSlot},
    error::{ApiError, payload_too_large},
    query::{PRETTY, pretty_on, query_pairs},
};
use crate::metrics::Metrics;

/// The request-ID header, accepted from the client or generated. Header
/// names on every request's path are `HeaderName`s made at compile time:
/// a `&str` is parsed on each use (~1,000 instructions each).
pub const REQUEST_ID_HEADER: axum::http::HeaderName =
    axum::http::HeaderName::from_static("x-request-id");

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
pub const STORE_HEADER: axum::http::HeaderName =
    axum::http::HeaderName::from_static("x-taskgate-store");

/// A client's request ID is kept if it is short printable ASCII.
fn client_request_id(req: &Request) -> Option<HeaderValue> {
    let v = req.headers().get(REQUEST_ID_HEADER)?;
    let ok = !v.is_empty() && v.len() <= 128 && v.as_bytes().iter().all(u8::is_ascii_graphic);
    ok.then(|| v.clone())
}

/// A generated request ID: `n` as 32 lowercase hex digits (written here:
/// through `format!` it was 4% of a heartbeat's instructions).
fn request_id(n: u128) -> HeaderValue {
    let mut hex = [0u8; 32];
    for (i, digit) in hex.iter_mut().enumerate() {
        *digit = b"0123456789abcdef"[(n >> (124 - 4 * i) & 0xf) as usize];
    }
    HeaderValue::from_bytes(&hex).expect("hex is a valid header value")
}

/// The edge as the router's layer (`Router::layer`): every route's
/// requests, and the fallback's, pass through it.
#[derive(Clone)]
pub struct EdgeLayer(pub Arc<Edge>);

impl Layer<Route> for EdgeLayer {
    type Service = EdgeService;

    fn layer(&self, route: Route) -> EdgeService {
        EdgeService {
            edge: self.0.clone(),
            route,
        }
    }
}

/// A route behind the edge.
#[derive(Clone)]
pub struct EdgeService {
    edge: Arc<Edge>,
    route: Route,
}

impl Service<Request> for EdgeService {
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // A route is always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request) -> Self::Future {
        let passing = Passing::new(self.edge.clone(), &req);
        let span = passing.span.clone();
        match span.in_scope(|| arrive(&passing, req, &mut self.route)) {
            Arrival::Admitted(admitted) => Box::pin(edge(passing, admitted).instrument(span)),
            Arrival::Reread(req, keys) => {
                // A future of its own: the requests that need no keys
                // re-read carry no room for the wait.
                let mut route = self.route.clone();
                // The re-read counts against the request's time, as the
                // handler does (`edge`).
                let reread = async move {
                    let auth = &passing.edge.auth;
                    let reread = auth.check_after_reread(req, passing.route(), keys);
                    let (req, decided) = if passing.waits() {
                        reread.await
                    } else {
                        match tokio::time::timeout_at(passing.deadline(), reread).await {
                            Ok(decided) => decided,
                            Err(_) => return Ok(passing.answered(timed_out())),
                        }
                    };
                    let admitted = admit(&passing, req, decided, &mut route);
                    edge(passing, admitted).await
                };
                Box::pin(reread.instrument(span))
            }
        }
    }
}

/// What the edge makes of a request when it arrives.
enum Arrival {
    Admitted(Admitted),
    /// Its JWT names a key that its issuer's keys lack: they are re-read
    /// before it is decided.
    Reread(Request, KeysToReread),
}

/// A request decided by the edge.
#[allow(clippy::large_enum_variant)] // boxing the handler would cost every request an allocation
enum Admitted {
    /// Refused, or answered by the edge itself.
    Answer(Response),
    /// Let through: its route's handler, called.
    Handler {
        handler: RouteFuture<Infallible>,
        /// The token whose wait the request takes if it parks (`handled`).
        parks: Option<Arc<Token>>,
        /// The wait an event stream took of its token.
        stream_slot: Option<WaitSlot>,
        /// Whether the route may wait (then no request timeout).
        waits: bool,
    },
}

/// The host and cross-site checks, and authorization when it need not
/// wait (`Auth::check_now`); then `admit`.
fn arrive(passing: &Passing, req: Request, route: &mut Route) -> Arrival {
    let edge = &*passing.edge;
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
        return Arrival::Admitted(Admitted::Answer(refused.answer.into_response()));
    }
    match edge.auth.check_now(&req, passing.route()) {
        Ok(decided) => Arrival::Admitted(admit(passing, req, decided, route)),
        Err(keys) => Arrival::Reread(req, keys),
    }
}

/// The rest of the edge's decisions once authorization `decided`: a
/// token's waits, the body limit; a request let through has its handler
/// called.
fn admit(passing: &Passing, mut req: Request, decided: Decision, route: &mut Route) -> Admitted {
    let edge = &*passing.edge;
    let matched = passing.route();
    let caller = match decided {
        Ok(caller) => caller,
        Err(denied) => return Admitted::Answer(*denied),
    };
    let waits = passing.waits();
    let stream = waits && matched == Some(STREAM_ROUTE);
    // A token's waits count against its own limit while they last. A
    // stream always waits, so it takes its wait here; the other waiting
    // routes take one only if they park (`handled`).
    let mut stream_slot = None;
    if let Some(token) = &caller {
        if stream {
            match edge.auth.wait_slot(token) {
                Some(slot) => stream_slot = Some(slot),
                None => return Admitted::Answer(quota_exceeded(token)),
            }
        }
        // Registration applies the caller's own quota and checks its
        // dependencies' targets; a task query counts as a sign of life
        // only from a caller that may act for the task.
        req.extensions_mut()
            .insert(super::auth::Caller(token.clone()));
    }
    if announced_length(&req).is_some_and(|n| n > edge.body_limit as u64) {
        return Admitted::Answer(payload_too_large().into_response());
    }
    DefaultBodyLimit::max(edge.body_limit).apply(&mut req);
    Admitted::Handler {
        handler: route.call(req),
        parks: caller.filter(|_| waits && !stream),
        stream_slot,
        waits,
    }
}

/// A request passing the edge: what its closing log line and metrics
/// need. Dropped before it is answered (the client went away, and its
/// future with it), it counts the request as status 499, as nginx does, so
/// that it is not lost from the metrics.
struct Passing {
    edge: Arc<Edge>,
    started: Instant,
    method: Method,
    matched: Option<MatchedPath>,
    request_id: HeaderValue,
    span: tracing::Span,
    /// `?pretty`: the JSON answer is re-rendered indented.
    pretty: bool,
    answered: bool,
}

impl Passing {
    fn new(edge: Arc<Edge>, req: &Request) -> Self {
        let started = Instant::now();
        let method = req.method().clone();
        let matched = req.extensions().get::<MatchedPath>().cloned();
        let route = matched.as_ref().map(MatchedPath::as_str);
        let request_id = client_request_id(req).unwrap_or_else(|| request_id(fastrand::u128(..)));
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
        Self {
            edge,
            started,
            method,
            matched,
            request_id,
            span,
            pretty,
            answered: false,
        }
    }

    /// The matched route, if any.
    fn route(&self) -> Option<&str> {
        self.matched.as_ref().map(MatchedPath::as_str)
    }

    /// Whether the request may wait (then no request timeout).
    fn waits(&self) -> bool {
        (self.method == Method::GET || self.method == Method::HEAD)
            && self.route().is_some_and(|r| WAITING_ROUTES.contains(&r))
    }

    /// When a request that does not wait runs out of time: the request
    /// timeout from its arrival, which a JWT's keys re-read counts in.
    fn deadline(&self) -> Instant {
        self.started + self.edge.request_timeout
    }

    /// The request's closing log line and metrics; the answer with the
    /// request ID and the store's ID.
    fn answered(mut self, mut res: Response) -> Response {
        self.answered = true;
        // Status and latency go on the request's closing event rather than
        // being recorded into the span: recording re-renders the span's
        // fields, a cost every request would pay even when nothing is
        // logged.
        let latency = self.started.elapsed();
        let status = res.status().as_u16();
        if self.edge.traces {
            answered(&self.span, status);
        }
        let latency_ms = latency.as_secs_f64() * 1000.0;
        // A parked wait answered 503 `shutting_down` is the shutdown
        // working as designed (every parked request gets one), not a
        // failure; a 503 `jwt_keys_unavailable` is a refusal, logged at
        // info (anyone can get one with a made-up `kid`).
        let by_design = res
            .extensions()
            .get::<super::error::ProblemCode>()
            .is_some_and(|c| c.0 == "shutting_down" || c.0 == "jwt_keys_unavailable");
        if status >= 500 && !by_design {
            tracing::warn!(parent: &self.span, status, latency_ms, "request failed");
        } else {
            tracing::debug!(parent: &self.span, status, latency_ms, "request");
        }
        self.edge.metrics.http_request(
            self.method.as_str(),
            self.route().unwrap_or("unmatched"),
            status,
            latency,
        );
        let request_id = std::mem::replace(&mut self.request_id, HeaderValue::from_static(""));
        res.headers_mut().insert(REQUEST_ID_HEADER, request_id);
        res.headers_mut()
            .insert(STORE_HEADER, self.edge.store_id.clone());
        res
    }
}

impl Drop for Passing {
    fn drop(&mut self) {
        if !self.answered {
            let latency = self.started.elapsed();
            tracing::debug!(parent: &self.span, latency_ms = latency.as_secs_f64() * 1000.0, "the client went away before its answer");
            self.edge.metrics.http_request(
                self.method.as_str(),
                self.route().unwrap_or("unmatched"),
                499,
                latency,
            );
        }
    }
}

/// A decided request to its answer, in the request's span
/// (`EdgeService::call`): its handler run (by the request's deadline,
/// unless its route waits), then `Passing::answered`. A function returning
/// an `async` block rather than an `async fn`, which would keep a second
/// copy of each argument: a long-poll holds this future for all of its
/// wait.
#[allow(clippy::manual_async_fn)] // see above
fn edge(
    passing: Passing,
    mut admitted: Admitted,
) -> impl Future<Output = Result<Response, Infallible>> + Send {
    async move {
        let res = match &mut admitted {
            Admitted::Answer(res) => std::mem::take(res),
            Admitted::Handler {
                handler,
                parks,
                stream_slot,
                waits,
            } => {
                let edge = &*passing.edge;
                let parks = parks.as_ref().map(|token| (&*edge.auth, token));
                let mut slot = None;
                let run = std::future::poll_fn(|cx| handled(handler, parks, &mut slot, cx));
                let res = if *waits {
                    run.await
                } else {
                    match tokio::time::timeout_at(passing.deadline(), run).await {
                        Ok(res) => res,
                        Err(_) => timed_out(),
                    }
                };
                let mut res = problem_for_bare_405(res);
                if let Some(slot) = stream_slot.take() {
                    // A stream waits in its body, after this returns: the
                    // token's slot goes with it.
                    res = res.map(|body| axum::body::Body::new(Holding { body, _slot: slot }));
                }
                if passing.pretty {
                    Box::pin(prettify(res)).await
                } else {
                    res
                }
            }
        };
        Ok(passing.answered(res))
    }
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

/// Polls the route's handler. A request of a waiting route (not the
/// stream) made with a token (`parks`) takes one of the token's waits
/// when, and only if, it parks, and holds it (in `slot`) until it answers:
/// a plain GET, or a blocking query or start-condition that answers at
/// once, is no wait. It parks when its handler's future is first pending:
/// these handlers await nothing but the registry's wait, which parks
/// before it awaits, and answers without awaiting when it need not wait
/// (the test `only_parked_requests_hold_a_token_s_waits` holds them to
/// that). Taken here rather than in the registry, which knows nothing of
/// tokens. With no wait left, the parked request is let go (dropping its
/// future unparks it) and answered 429.
///
/// A handler that panics is answered 500 here, within the edge, so that
/// its answer has the request's ID and is counted as the 500 it is (caught
/// outside, by `served`, the request would be counted as one whose client
/// went away, and answered without its ID). The handler is not polled
/// again.
fn handled(
    handler: &mut RouteFuture<Infallible>,
    parks: Option<(&Auth, &Arc<Token>)>,
    slot: &mut Option<WaitSlot>,
    cx: &mut Context<'_>,
) -> Poll<Response> {
    let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Pin::new(&mut *handler).poll(cx)
    }));
    match polled.unwrap_or_else(|panic| Poll::Ready(Ok(super::panicked(panic)))) {
        Poll::Ready(Ok(res)) => Poll::Ready(res),
        Poll::Ready(Err(never)) => match never {},
        Poll::Pending => match parks {
            Some((auth, token)) if slot.is_none() => match auth.wait_slot(token) {
                Some(taken) => {
                    *slot = Some(taken);
                    Poll::Pending
                }
                None => Poll::Ready(quota_exceeded(token)),
            },
            _ => Poll::Pending,
        },
    }
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

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use axum::{
        Router,
        body::Body,
        http::{HeaderValue, Request},
        routing::get,
    };
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    use super::{Edge, EdgeLayer, REQUEST_ID_HEADER, STORE_HEADER, request_id};
    use crate::metrics::{Metrics, Scrape};

    #[test]
    fn a_generated_request_id_is_its_number_in_32_hex_digits() {
        let mut numbers = vec![0, 1, 0xf, 0xa5 << 120, u128::MAX, u128::MAX - 1];
        numbers.extend((0..100).map(|_| fastrand::u128(..)));
        for n in numbers {
            assert_eq!(request_id(n).as_bytes(), format!("{n:032x}").as_bytes());
        }
    }

    /// A handler that panics at once, and one on a waiting route that
    /// panics once it was woken after parking.
    async fn panics() -> &'static str {
        panic!("a handler's bug")
    }

    async fn panics_after_waiting() -> &'static str {
        tokio::task::yield_now().await;
        panic!("a waiting handler's bug")
    }

    /// A handler's panic is the edge's answer like any other: 500
    /// problem+json with the request's ID and the store's, counted once as
    /// the 500 it is (not as a client that went away, 499), on a route that
    /// waits as on one that does not.
    #[tokio::test]
    async fn a_handler_s_panic_is_answered_with_its_request_id_and_counted_as_a_500() {
        let metrics = Arc::new(Metrics::new());
        let edge = Edge {
            metrics: metrics.clone(),
            auth: Arc::default(),
            site: Arc::default(),
            request_timeout: Duration::from_secs(30),
            body_limit: 1024,
            store_id: HeaderValue::from_static("store-1"),
            traces: false,
        };
        let waiting = "/v1/allocations/{alloc_id}";
        let served = crate::http::served(
            Router::new()
                .route("/panics", get(panics))
                .route(waiting, get(panics_after_waiting))
                .layer(EdgeLayer(Arc::new(edge))),
        );
        for (uri, route) in [("/panics", "/panics"), ("/v1/allocations/a1", waiting)] {
            let req = Request::get(uri)
                .header("host", "localhost")
                .header(REQUEST_ID_HEADER, "mine-1")
                .body(Body::empty())
                .unwrap();
            let res = served.clone().oneshot(req).await.unwrap();
            assert_eq!(res.status(), 500, "{uri}");
            assert_eq!(res.headers()["content-type"], "application/problem+json");
            assert_eq!(
                res.headers().get(REQUEST_ID_HEADER).map(|v| v.as_bytes()),
                Some(&b"mine-1"[..]),
                "{uri}: the request ID is on the answer"
            );
            assert_eq!(
                res.headers().get(STORE_HEADER).map(|v| v.as_bytes()),
                Some(&b"store-1"[..]),
                "{uri}"
            );
            let body = res.into_body().collect().await.unwrap().to_bytes();
            let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(problem["code"], "internal", "{uri}");
            let text = metrics.render(Scrape::default());
            let series = |status: u16| {
                format!(
                    "taskgate_http_request_duration_seconds_count{{method=\"GET\",route=\"{route}\",status=\"{status}\"}}"
                )
            };
            assert!(
                text.contains(&format!("{} 1\n", series(500))),
                "{uri}: counted once as a 500:\n{text}"
            );
            assert!(
                !text.contains(&series(499)),
                "{uri}: not as a client that went away:\n{text}"
            );
        }
    }
}
