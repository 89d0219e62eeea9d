//! The connection loop: plain TCP or TLS (rustls), HTTP/1.1 with a bound on
//! how long a client may take to send its headers, and graceful shutdown
//! (stop accepting, let every open connection finish its request, close
//! idle keep-alive connections).

use std::{
    future::Future,
    path::Path,
    pin::{Pin, pin},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    server::graceful::GracefulShutdown,
    service::TowerToHyperService,
};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
};

use crate::metrics::Metrics;

/// Largest request head (request line and headers) accepted; a larger one
/// is answered 431 and the connection closed.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
use tokio_rustls::{
    TlsAcceptor,
    rustls::{
        self, ServerConfig,
        pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
    },
};

/// Loads a PEM certificate chain and private key into a TLS acceptor.
pub fn tls_acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, String> {
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|i| i.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("cannot read the certificate {}: {e}", cert.display()))?;
    if certs.is_empty() {
        return Err(format!("no certificate in {}", cert.display()));
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| format!("cannot read the private key {}: {e}", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup failed: {e}"))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| format!("the certificate and key do not fit: {e}"))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// How connections are served.
#[derive(Clone)]
pub struct ServeOptions {
    pub tls: Option<TlsAcceptor>,
    /// Longest time a client may take to send a request's headers (and,
    /// with TLS, to finish the handshake).
    pub header_timeout: Duration,
    /// Longest time a write may wait for the client to read.
    pub write_timeout: Duration,
    /// Connections served at once; one more is answered 503 and closed.
    pub max_connections: usize,
    /// Counts open connections (`taskgate_connections`).
    pub metrics: Arc<Metrics>,
    /// The kernel's send buffer (`SO_SNDBUF`) of a connection once it
    /// carries an event stream, in bytes the kernel may hold; `None` leaves
    /// it to the kernel's autotuning.
    pub stream_send_buffer: Option<usize>,
}

/// What the kernel holds for an event stream's connection by default: as
/// much as the stream's own backlog (`http::events::BACKLOG_BYTES`), so a
/// client that stops reading pins at most that much of the kernel's memory
/// until the write timeout, not the 4 MiB `tcp_wmem` lets a send buffer
/// autotune to. Only stream connections get it: a capped send buffer
/// limits a connection to about that much per round trip, which a large
/// answer over a long link would feel, and a stream is the one answer a
/// client can leave unread for as long as the write timeout.
pub const DEFAULT_STREAM_SEND_BUFFER: usize = 256 << 10;

/// A connection's handle in each of its requests (an extension): the event
/// stream marks its connection with it, and the connection's socket gets
/// the stream's send buffer before the stream's first byte is written.
#[derive(Clone, Default)]
pub struct StreamSocket(Arc<AtomicBool>);

impl StreamSocket {
    /// This connection carries an event stream from now on.
    pub fn mark(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A served TCP connection (under TLS, if any): the stream, bounded in how
/// long a write may wait, and what its requests ask of its socket.
struct Connection {
    io: TcpStream,
    /// Longest time a write may wait for the client to read.
    write_timeout: Duration,
    /// Runs out `write_timeout` after a write was first found waiting for
    /// the client; gone once a write is done. Made only then, and boxed:
    /// the connections that are not writing (idle, parked) hold no timer.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Marked by the event stream's handler; read by the writes, which run
    /// on the connection's own task after the handler answered (no
    /// ordering beyond the task's own is needed).
    marked: StreamSocket,
    /// The send buffer to set once `marked`; taken when set.
    send_buffer: Option<usize>,
}

impl Connection {
    /// Sets the stream's send buffer on the first write after the handler
    /// marked the connection: the answer's head is the first write, so the
    /// whole stream goes out under the cap.
    fn before_write(&mut self) {
        if let Some(bytes) = self.send_buffer
            && self.marked.0.load(Ordering::Relaxed)
        {
            self.send_buffer = None;
            // Linux doubles the value asked for (the other half is its
            // bookkeeping) and counts that against the buffer: half is
            // asked so that what the kernel holds is `bytes`.
            if let Err(e) = rustix::net::sockopt::set_socket_send_buffer_size(&self.io, bytes / 2) {
                tracing::debug!(error = %e, "cannot set an event stream's send buffer");
            }
        }
    }

    /// A write (or flush, or shutdown) as polled, bounded: one still
    /// waiting for the client to read `write_timeout` after a write was
    /// first found waiting fails (`TimedOut`, which ends the connection);
    /// one that is done ends the wait.
    fn bounded<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<std::io::Result<T>>,
    ) -> Poll<std::io::Result<T>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let timeout = self.write_timeout;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match stalled.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.stalled = None;
                Poll::Ready(Err(std::io::ErrorKind::TimedOut.into()))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        this.before_write();
        let polled = Pin::new(&mut this.io).poll_write(cx, buf);
        this.bounded(cx, polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        this.before_write();
        let polled = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.bounded(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_flush(cx);
        this.bounded(cx, polled)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_shutdown(cx);
        this.bounded(cx, polled)
    }
}

pin_project_lite::pin_project! {
    /// A plain connection's task: serves it, says how it ended, and counts
    /// it closed. A future of its own rather than an `async` block, which
    /// would keep what the connection was made of beside the connection
    /// for as long as it is open (a task is as large as its future).
    struct Serving<F> {
        #[pin]
        conn: F,
        open: Option<crate::metrics::OpenConnection>,
    }
}

impl<F: Future<Output = Result<(), hyper::Error>>> Future for Serving<F> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.project();
        let served = std::task::ready!(this.conn.poll(cx));
        log_end(served);
        this.open.take();
        Poll::Ready(())
    }
}

/// A request as hyper hands it to the router.
type Incoming = hyper::Request<hyper::body::Incoming>;

/// The router as hyper calls it.
type Routed = TowerToHyperService<crate::http::Served>;

/// The router, as hyper calls it for one connection: every request
/// carries the connection's [`StreamSocket`] (an `Arc` clone and an
/// extension per request).
#[derive(Clone)]
struct PerConnection {
    router: Routed,
    socket: StreamSocket,
}

impl hyper::service::Service<Incoming> for PerConnection {
    type Response = <Routed as hyper::service::Service<Incoming>>::Response;
    type Error = <Routed as hyper::service::Service<Incoming>>::Error;
    type Future = <Routed as hyper::service::Service<Incoming>>::Future;

    fn call(&self, mut req: Incoming) -> Self::Future {
        req.extensions_mut().insert(self.socket.clone());
        self.router.call(req)
    }
}

/// File descriptors kept for everything but client connections (the
/// store's files, the listener, logs).
const RESERVED_FDS: u64 = 128;

/// Connections served at once when `--max-connections` is not given and
/// the open-files limit leaves room for them.
pub const DEFAULT_MAX_CONNECTIONS: usize = 20_000;

/// The connection limit in force. Each connection holds a file, so no
/// more than the open-files limit leaves room for (beyond the reserve)
/// can be served: past it, accept would fail in a loop instead of
/// answering. `asked` above that is the operator's mistake and is warned
/// of; the default lowered to fit is said at info, since a machine's limit
/// (often 1024, or a container's) is what it is.
pub fn connection_limit(asked: Option<usize>) -> usize {
    let files = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    let fits = usize::try_from(files.saturating_sub(RESERVED_FDS))
        .unwrap_or(usize::MAX)
        .max(1);
    match asked {
        Some(asked) if asked > fits => {
            tracing::warn!(
                asked,
                open_files_limit = files,
                using = fits,
                "--max-connections is more than the open-files limit leaves room for \
                 ({RESERVED_FDS} files are kept for the store and the logs); using fewer: raise \
                 the limit (ulimit -n, systemd's LimitNOFILE=) or ask for fewer"
            );
            fits
        }
        Some(asked) => asked.max(1),
        None if fits < DEFAULT_MAX_CONNECTIONS => {
            tracing::info!(
                open_files_limit = files,
                using = fits,
                "serving at most {fits} connections at once: the open-files limit less \
                 {RESERVED_FDS} files kept for the store and the logs (--max-connections, with \
                 a higher limit, changes it)"
            );
            fits
        }
        None => DEFAULT_MAX_CONNECTIONS,
    }
}

/// The answer to a connection over the limit: problem+json, as every
/// answer of the service, written by hand (no request was read).
fn too_many_connections() -> Vec<u8> {
    let body = crate::http::error::ApiError::new(
        axum::http::StatusCode::SERVICE_UNAVAILABLE,
        "too_many_connections",
        "the server has as many connections open as it may; retry later",
    )
    .into_body();
    let mut answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/problem+json\r\n\
         Retry-After: {}\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        crate::http::error::RETRY_AFTER_SECS,
        body.len()
    )
    .into_bytes();
    answer.extend_from_slice(&body);
    answer
}

/// Answers a connection over the limit with 503 and closes it.
async fn turn_away(stream: tokio::net::TcpStream, tls: Option<TlsAcceptor>, within: Duration) {
    use tokio::io::AsyncWriteExt;
    let _ = tokio::time::timeout(within, async {
        match tls {
            None => {
                let mut stream = stream;
                let _ = stream.write_all(&too_many_connections()).await;
                let _ = stream.shutdown().await;
            }
            Some(acceptor) => {
                if let Ok(mut tls) = acceptor.accept(stream).await {
                    let _ = tls.write_all(&too_many_connections()).await;
                    let _ = tls.shutdown().await;
                }
            }
        }
    })
    .await;
}

/// Serves `router` on `listener` until `shutdown` completes, then drains.
/// Returns once every connection is closed.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    options: ServeOptions,
    shutdown: impl Future<Output = ()>,
) {
    let graceful = GracefulShutdown::new();
    let router = crate::http::served(router);
    let mut shutdown = pin!(shutdown);
    let mut accept_failing = false;
    loop {
        let (stream, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of file descriptors and the like: wait a little
                    // rather than spin; established connections go on.
                    // Said once until accepting works again.
                    if !std::mem::replace(&mut accept_failing, true) {
                        tracing::warn!(error = %e, "accept failed; retrying every 50 ms");
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        if std::mem::take(&mut accept_failing) {
            tracing::info!("accepting connections again");
        }
        let _ = stream.set_nodelay(true);
        if options.metrics.connections() >= options.max_connections as u64 {
            tokio::spawn(turn_away(
                stream,
                options.tls.clone(),
                options.header_timeout,
            ));
            continue;
        }
        let open = options.metrics.open_connection();
        // A client that stops reading its answer is dropped after the
        // write timeout, not held (with its buffers) for ever.
        let socket = StreamSocket::default();
        let stream = Connection {
            io: stream,
            write_timeout: options.write_timeout,
            stalled: None,
            marked: socket.clone(),
            send_buffer: options.stream_send_buffer,
        };
        let service = PerConnection {
            router: TowerToHyperService::new(router.clone()),
            socket,
        };
        let watcher = graceful.watcher();
        // Plain and TLS connections are separate tasks: a task is as large
        // as its future, and a plain connection should not carry the room a
        // TLS stream needs.
        match options.tls.clone() {
            None => {
                let conn = http1_builder(&options).serve_connection(TokioIo::new(stream), service);
                tokio::spawn(Serving {
                    conn: watcher.watch(conn),
                    open: Some(open),
                });
            }
            Some(acceptor) => {
                let builder = http1_builder(&options);
                let handshake = options.header_timeout;
                tokio::spawn(async move {
                    let tls = match tokio::time::timeout(handshake, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => tls,
                        Ok(Err(e)) => {
                            tracing::debug!(error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!("TLS handshake timed out");
                            return;
                        }
                    };
                    let conn = builder.serve_connection(TokioIo::new(tls), service);
                    log_end(watcher.watch(conn).await);
                    drop(open);
                });
            }
        }
    }
    drop(listener);
    graceful.shutdown().await;
}

fn http1_builder(options: &ServeOptions) -> http1::Builder {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(options.header_timeout)
        .max_header_size(MAX_HEADER_BYTES)
        .keep_alive(true);
    builder
}

fn log_end(served: Result<(), hyper::Error>) {
    if let Err(e) = served {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use axum::{Router, routing::get};
    use tokio::{
        io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
        net::{TcpListener, TcpStream},
    };

    use super::{ServeOptions, serve};
    use crate::metrics::Metrics;

    async fn panics() -> &'static str {
        panic!("a handler's bug")
    }

    /// Panics once it was woken after parking, as a long-poll would be.
    async fn panics_after_waiting() -> &'static str {
        tokio::task::yield_now().await;
        panic!("a waiting handler's bug")
    }

    /// Sends a GET on a kept-alive connection and reads its answer (framed
    /// by Content-Length): its status and body.
    async fn exchange(conn: &mut BufReader<TcpStream>, path: &str) -> (u16, String) {
        let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n");
        conn.get_mut().write_all(req.as_bytes()).await.unwrap();
        let mut status = String::new();
        conn.read_line(&mut status).await.unwrap();
        let mut length = 0;
        loop {
            let mut line = String::new();
            conn.read_line(&mut line).await.unwrap();
            if line == "\r\n" {
                break;
            }
            if let Some((name, value)) = line.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().unwrap();
            }
        }
        let mut body = vec![0; length];
        conn.read_exact(&mut body).await.unwrap();
        let status = status.split(' ').nth(1).unwrap().parse().unwrap();
        (status, String::from_utf8(body).unwrap())
    }

    /// Through the real connection loop, a handler that panics (at once,
    /// or once woken from a wait) is answered 500 problem+json, and the
    /// connection and the server go on serving.
    #[tokio::test]
    async fn a_panicking_handler_is_answered_500_and_its_connection_goes_on() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Router::new()
            .route("/panics", get(panics))
            .route("/waits", get(panics_after_waiting))
            .route("/answers", get(|| async { "answered" }));
        let options = ServeOptions {
            tls: None,
            header_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(10),
            max_connections: 16,
            metrics: Arc::new(Metrics::new()),
            stream_send_buffer: None,
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, router, options, async move {
            let _ = stopped.await;
        }));
        let mut conn = BufReader::new(TcpStream::connect(addr).await.unwrap());
        for path in ["/panics", "/waits", "/panics"] {
            let (status, body) = exchange(&mut conn, path).await;
            assert_eq!(status, 500, "{path}: {body}");
            assert!(body.contains(r#""code":"internal""#), "{path}: {body}");
            assert_eq!(
                exchange(&mut conn, "/answers").await,
                (200, "answered".into())
            );
        }
        drop(conn);
        stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(20), server)
            .await
            .expect("the server stopped")
            .unwrap();
    }
}
