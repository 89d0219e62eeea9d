//! The connection loop: plain TCP or TLS (rustls), HTTP/1.1 with a bound on
//! how long a client may take to send its headers, and graceful shutdown
//! (stop accepting, let every open connection finish its request, close
//! idle keep-alive connections).

use std::{future::Future, path::Path, pin::pin, sync::Arc, time::Duration};

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    server::graceful::GracefulShutdown,
    service::TowerToHyperService,
};
use tokio::net::TcpListener;

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
        let mut stream = tokio_io_timeout::TimeoutStream::new(stream);
        stream.set_write_timeout(Some(options.write_timeout));
        let stream = Box::pin(stream);
        let service = TowerToHyperService::new(router.clone());
        let watcher = graceful.watcher();
        // Plain and TLS connections are separate tasks: a task is as large
        // as its future, and a plain connection should not carry the room a
        // TLS stream needs.
        match options.tls.clone() {
            None => {
                let builder = http1_builder(&options);
                tokio::spawn(async move {
                    let conn = builder.serve_connection(TokioIo::new(stream), service);
                    log_end(watcher.watch(conn).await);
                    drop(open);
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
