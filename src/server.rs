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
    /// Counts open connections (`taskgate_connections`).
    pub metrics: Arc<Metrics>,
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
    loop {
        let (stream, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of file descriptors and the like: wait a little
                    // rather than spin; established connections go on.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let open = options.metrics.open_connection();
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
