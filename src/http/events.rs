//! `GET /v1/events`: every allocation change after an index, as
//! newline-delimited JSON, for as long as the client reads.

use std::{
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use axum::{
    Extension,
    extract::State,
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use bytes::Bytes;
use http_body::Frame;
use tokio::sync::mpsc;

use super::{
    AppState, INDEX_HEADER,
    error::{ApiError, Problem},
    extract::ApiQuery,
    params::StreamParams,
    views::StreamLine,
};
use crate::{
    registry::{Subscription, feed::Next},
    server::StreamSocket,
};

/// A line sent after this long without another.
pub const HEARTBEAT: Duration = Duration::from_secs(10);

/// Changes taken from the feed at once.
const BATCH: usize = 256;

/// Bytes queued for a client ahead of what it has read, at most. A change
/// is sent as the feed's own rendered copy (shared by every reader, never
/// copied per reader), so what a client that stops reading holds is this
/// queue's references and its connection's buffers; past it the stream
/// waits for the client, and one that falls behind the kept changes gets a
/// `Resync`. A single change larger than this is still sent, alone. (The
/// kernel's send buffer under the stream is bounded to as much:
/// `--stream-send-buffer`.)
pub const BACKLOG_BYTES: usize = 256 << 10;

/// Follow allocation changes (a stream).
///
/// Newline-delimited JSON, one object per line, for as long as the client
/// reads: each change after `index` in index order, each once
/// (`Allocation` with the allocation's view, `AllocationDeleted`); a
/// `Resync` line first when `index` is older than the changes the server
/// keeps (`--event-buffer`; a restarted server keeps none from before), or
/// newer than any index it has reached (another server's, a restored
/// backup's): list the allocations again, then go on from the `Resync`'s
/// index, as the stream does; a `Heartbeat` line after 10 s without another. The
/// stream ends when the server shuts down: reconnect with the last index
/// seen. A scoped token must give a `prefix` within its prefixes. Counts as
/// a waiting request; at most `--max-streams` (default 1024) are open at
/// once.
#[utoipa::path(
    get, path = "/v1/events", operation_id = "streamEvents", tag = "allocations",
    params(
        ("index" = Option<u64>, Query, minimum = 0, description = "Changes after this index (default 0)"),
        ("prefix" = Option<String>, Query, description = "Only allocations whose ID starts with this"),
    ),
    responses(
        (status = 200, description = "The stream: one JSON object per line", body = StreamLine, content_type = "application/x-ndjson",
         headers(("X-Taskgate-Index" = u64, description = "The index the stream starts after"))),
        (status = 403, description = "`forbidden`: the token's role, or a `prefix` outside its prefixes", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "`quota_exceeded`: the token holds as many waits as it may", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = u64, description = "Seconds to wait before retrying"))),
        (status = 503, description = "`too_many_waiters` (the waiter or the stream limit), `shutting_down`, or `starting` (the store is still loading)", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = u64, description = "Seconds to wait before retrying"))),
    )
)]
pub async fn stream(
    State(s): State<AppState>,
    socket: Option<Extension<StreamSocket>>,
    ApiQuery(q): ApiQuery<StreamParams>,
) -> Result<Response, ApiError> {
    let index = q.index;
    let Ok(open) = s.streams.clone().try_acquire_owned() else {
        return Err(ApiError::too_many_streams(s.config.max_streams));
    };
    let sub = s.registry.subscribe(q.index, q.prefix)?;
    // The connection's kernel send buffer is bounded from the answer's
    // first byte on (absent when the router is called without a server,
    // as handler tests do).
    if let Some(Extension(socket)) = socket {
        socket.mark();
    }
    // The queue's length is bounded by the byte permits each chunk holds.
    let (tx, rx) = mpsc::unbounded_channel();
    let budget = std::sync::Arc::new(tokio::sync::Semaphore::new(BACKLOG_BYTES));
    tokio::spawn(async move {
        follow(sub, tx, budget).await;
        // The stream's place is free once its follower ends (the client
        // went away, or the server shuts down).
        drop(open);
    });
    let mut res = (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/x-ndjson"),
        )],
        axum::body::Body::new(Lines(rx)),
    )
        .into_response();
    res.headers_mut()
        .insert(INDEX_HEADER, HeaderValue::from(index));
    Ok(res)
}

/// A chunk of the stream and the share of the client's backlog it holds
/// until the connection takes it.
type Chunk = (Bytes, tokio::sync::OwnedSemaphorePermit);

/// Writes the stream's lines until the client goes away or the server
/// shuts down.
async fn follow(
    mut sub: Subscription,
    tx: mpsc::UnboundedSender<Chunk>,
    budget: std::sync::Arc<tokio::sync::Semaphore>,
) {
    loop {
        let chunks: Vec<Bytes> = tokio::select! {
            next = sub.next(BATCH) => match next {
                Ok(Next::Changes(events)) => events
                    .iter()
                    .map(|e| sub.render(e, |e| change_line(e, sub.registry())))
                    .collect(),
                Ok(Next::Resync(index)) => vec![line(&StreamLine::Resync { index })],
                // Shutting down: the client reconnects (elsewhere, or once
                // the server is back) with the last index it saw.
                Err(_) => return,
            },
            () = tokio::time::sleep(HEARTBEAT) => vec![line(&StreamLine::Heartbeat)],
            () = tx.closed() => return,
        };
        for chunk in chunks {
            let want = chunk.len().clamp(1, BACKLOG_BYTES) as u32;
            let permit = tokio::select! {
                p = budget.clone().acquire_many_owned(want) => match p {
                    Ok(p) => p,
                    Err(_) => return,
                },
                () = tx.closed() => return,
            };
            if tx.send((chunk, permit)).is_err() {
                return;
            }
        }
    }
}

/// `StreamLine::change(e, live)` and its newline; a change that leaves an
/// allocation written by `render` (the same bytes).
fn change_line(e: &crate::registry::feed::Event, live: &dyn super::views::Live) -> Bytes {
    let Some(a) = &e.allocation else {
        return line(&StreamLine::change(e, live));
    };
    let mut buf = Vec::with_capacity(super::render::size_hint(a) + 64);
    // As `line`: a view always serializes.
    super::render::change_line(&mut buf, e.index, a, &live.of(a))
        .expect("a stream line serializes");
    buf.push(b'\n');
    Bytes::from(buf)
}

/// One JSON object and its newline.
fn line(l: &StreamLine) -> Bytes {
    let mut buf = Vec::with_capacity(2048);
    // A view always serializes (string keys, no floats that are not finite).
    serde_json::to_writer(&mut buf, l).expect("a stream line serializes");
    buf.push(b'\n');
    Bytes::from(buf)
}

/// The response body: the chunks `follow` sends, as they come (each
/// chunk's share of the backlog is given back as the connection takes it).
struct Lines(mpsc::UnboundedReceiver<Chunk>);

impl http_body::Body for Lines {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|c| c.map(|(bytes, _permit)| Ok(Frame::data(bytes))))
    }
}
