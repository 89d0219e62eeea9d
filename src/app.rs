//! The application: bind, answer 503 while the store loads, rebuild the
//! registry, then serve until a shutdown future completes, drain, and close
//! the store.

use std::{future::Future, net::SocketAddr, sync::Arc, time::Duration};

use axum::{
    http::StatusCode,
    response::{IntoResponse, Response},
};
use tokio::net::TcpListener;

use crate::{
    config::ServeConfig,
    http::{self, HttpConfig, auth::Auth, error::ApiError},
    lifecycle::Limits,
    metrics::Metrics,
    registry::{Registry, RegistryConfig},
    server::ServeOptions,
    store::{DiskStore, DiskStoreConfig, MemoryStore, Store, StoreError},
    supervise::Supervisor,
};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {source}{}", bind_hint(.source))]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// The address cannot be had and the configuration is refused too:
    /// both are said, the address first, since the other may depend on it
    /// (a loopback address needs no tokens).
    #[error("two problems, in the order to fix them:\n  1. {address}\n  2. then: {config}")]
    AddressAndConfig {
        address: Box<StartError>,
        config: Box<StartError>,
    },
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error("{0}")]
    Config(String),
}

/// What to do about a bind error the user can fix.
fn bind_hint(e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::AddrInUse => {
            " (another process listens on that port: stop it, or choose another port with --listen)"
        }
        std::io::ErrorKind::PermissionDenied => {
            " (ports below 1024 need privileges: choose a higher port with --listen)"
        }
        std::io::ErrorKind::AddrNotAvailable => {
            " (no interface of this machine has that address: check --listen)"
        }
        _ => "",
    }
}

/// Binds with SO_REUSEADDR, so a restarted server gets its port back while
/// connections of the previous one linger in TIME_WAIT.
fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)?.into_std()
}

/// Stops the kernel from backing this process's memory with transparent
/// huge pages (for this process and the processes it starts). mimalloc
/// asks for them on its heap; with them, every 2 MiB of heap is resident
/// as soon as any of it is touched, so buffer space that connections never
/// use (hyper gives each an 8 KiB read and an 8 KiB write buffer) counts
/// in full.
pub fn no_transparent_huge_pages() -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    return rustix::thread::disable_transparent_huge_pages(true).map_err(std::io::Error::from);
    #[cfg(not(target_os = "linux"))]
    Ok(())
}

fn serve_options(config: &ServeConfig, metrics: Arc<Metrics>) -> Result<ServeOptions, StartError> {
    let tls = match (&config.tls_cert, &config.tls_key) {
        (Some(cert), Some(key)) => {
            Some(crate::server::tls_acceptor(cert, key).map_err(StartError::Config)?)
        }
        (None, None) => None,
        _ => {
            return Err(StartError::Config(
                "--tls-cert and --tls-key go together".into(),
            ));
        }
    };
    Ok(ServeOptions {
        tls,
        header_timeout: config.header_timeout,
        write_timeout: config.write_timeout,
        max_connections: crate::server::connection_limit(config.max_connections),
        metrics,
        stream_send_buffer: (config.stream_send_buffer > 0)
            .then(|| usize::try_from(config.stream_send_buffer).unwrap_or(usize::MAX)),
    })
}

/// The shortest operator secret accepted on a non-loopback address: it can
/// do everything, and is guessed offline from nothing but answers.
const MIN_OPERATOR_SECRET: usize = 32;

/// Tokens from the configuration; refuses an open server on a
/// non-loopback address unless told it is meant.
fn auth_for(config: &ServeConfig) -> Result<Arc<Auth>, StartError> {
    // Without the whitespace around it, which no presented token can
    // carry: a secret handed over from a file comes with its newline.
    let operator = config.operator_token.as_ref().map(|s| s.0.trim());
    if let Some(secret) = operator.filter(|s| !s.is_empty())
        && secret.len() < MIN_OPERATOR_SECRET
        && !config.listen.ip().is_loopback()
    {
        return Err(StartError::Config(format!(
            "refusing to listen on {} with an operator secret of {} bytes: it must be at least \
             {MIN_OPERATOR_SECRET} bytes off loopback (for example `openssl rand -hex 32`)",
            config.listen,
            secret.len()
        )));
    }
    let mut auth =
        Auth::load(config.token_file.as_deref(), operator).map_err(StartError::Config)?;
    if let Some(path) = &config.jwt_issuers {
        auth.set_jwt_issuers(crate::http::jwt::Issuers::load(path).map_err(StartError::Config)?);
    }
    auth.public_metrics = config.public_metrics;
    auth.max_waiters_per_token = config.max_waiters_per_token;
    auth.set_max_dependencies_per_token(config.max_dependencies_per_token);
    if !auth.enabled() && !config.listen.ip().is_loopback() && !config.insecure_no_auth {
        return Err(StartError::Config(format!(
            "refusing to listen on {} without authentication: give tokens with --token-file or \
             TASKGATE_OPERATOR_TOKEN (or trusted JWT issuers with --jwt-issuers), or pass \
             --insecure-no-auth if the network is trusted",
            config.listen
        )));
    }
    if !auth.enabled() {
        // On loopback this is the intended default (only this machine can
        // connect), so nothing to warn of; off it the operator opted out.
        if config.listen.ip().is_loopback() {
            tracing::info!("no tokens configured: every request is allowed (loopback only)");
        } else {
            tracing::warn!(
                "no tokens configured (--insecure-no-auth): every request from the network is \
                 allowed"
            );
        }
    }
    Ok(Arc::new(auth))
}

pub struct Application {
    listener: TcpListener,
    registry: Registry,
    store: Arc<dyn Store>,
    /// Owns the long-lived tasks; one the server cannot go on without
    /// ending stops it.
    supervisor: Supervisor,
    router: axum::Router,
    config: ServeConfig,
    options: ServeOptions,
}

/// What every request gets while the store is loading.
async fn starting() -> Response {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "starting",
        "the server is loading its store; retry shortly",
    )
    .retry_later()
    .into_response()
}

impl Application {
    /// Binds, then loads every record while answering 503 `starting` on the
    /// port, so health is never 200 before the store is loaded and clients
    /// are never refused a connection.
    pub async fn build(config: ServeConfig) -> Result<Self, StartError> {
        let bind_err = |source| StartError::Bind {
            addr: config.listen,
            source,
        };
        // Both checked, so that a start refused for its configuration also
        // says whether its address could be had (`--listen :8080` with no
        // tokens, on a busy port); a listener bound here for a refused
        // configuration is closed at once, having accepted nothing.
        let (auth, listener) = match (auth_for(&config), bind(config.listen).map_err(bind_err)) {
            (Ok(auth), Ok(listener)) => (auth, listener),
            (Err(refused), Ok(_)) => return Err(refused),
            (Ok(_), Err(address)) => return Err(address),
            (Err(refused), Err(address)) => {
                return Err(StartError::AddressAndConfig {
                    address: Box::new(address),
                    config: Box::new(refused),
                });
            }
        };
        let opener_config = config.clone();
        Self::build_on(listener, config, auth, move |opening| {
            open_configured_store(&opener_config, opening)
        })
        .await
    }

    /// As `build`, on a bound listener and with a given way to open the
    /// store (tests use both to watch the start-up window).
    pub async fn build_on(
        listener: std::net::TcpListener,
        config: ServeConfig,
        auth: Arc<Auth>,
        open: impl FnOnce(Opening) -> Result<Arc<dyn Store>, StoreError> + Send + 'static,
    ) -> Result<Self, StartError> {
        let bind_err = |source| StartError::Bind {
            addr: config.listen,
            source,
        };
        // A second handle on the same socket serves the 503s meanwhile.
        let interim =
            TcpListener::from_std(listener.try_clone().map_err(bind_err)?).map_err(bind_err)?;
        let listener = TcpListener::from_std(listener).map_err(bind_err)?;
        let (stop_interim, stopped) = tokio::sync::oneshot::channel::<()>();
        // JWT issuers' keys served at a URL are fetched meanwhile; one that
        // cannot be is said, and fetched again when a token needs it.
        if let Some(fetch) = auth.fetch_jwt_keys() {
            tokio::spawn(fetch);
        }
        let metrics = Arc::new(Metrics::new());
        let options = serve_options(&config, metrics.clone())?;
        let mut interim = tokio::spawn(crate::server::serve(
            interim,
            axum::Router::new().fallback(starting),
            options.clone(),
            async move {
                let _ = stopped.await;
            },
        ));

        let supervisor = Supervisor::new();
        let loaded = {
            let registry_config = registry_config(&config, metrics.clone(), supervisor.clone());
            let opening = Opening {
                metrics,
                supervisor: supervisor.clone(),
            };
            tokio::task::spawn_blocking(move || load(open(opening)?, registry_config))
                .await
                .map_err(|e| StoreError::Unusable(format!("loading the store failed: {e}")))
        };
        let _ = stop_interim.send(());
        if tokio::time::timeout(Duration::from_secs(5), &mut interim)
            .await
            .is_err()
        {
            // Not left running detached: its connections are closed.
            interim.abort();
            tracing::warn!("a client kept a connection of the start-up window open; closed it");
        }
        let (store, registry) = loaded??;
        Ok(Self::assemble(
            listener, store, registry, supervisor, config, auth, options,
        ))
    }

    fn assemble(
        listener: TcpListener,
        store: Arc<dyn Store>,
        registry: Registry,
        supervisor: Supervisor,
        config: ServeConfig,
        auth: Arc<Auth>,
        options: ServeOptions,
    ) -> Self {
        let router = http::app(
            registry.clone(),
            HttpConfig {
                body_limit: config.body_limit,
                max_wait: config.max_wait,
                request_timeout: config.request_timeout,
                max_streams: config.max_streams,
                site: Arc::new(http::site::Site::new(
                    config.listen.ip().to_canonical().is_loopback(),
                    config.allowed_hosts.clone(),
                )),
                traces: config.traces.is_some(),
                ..HttpConfig::default()
            },
            auth,
        );
        Self {
            listener,
            registry,
            store,
            supervisor,
            router,
            config,
            options,
        }
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Serves until `shutdown` completes, or a task the server cannot go
    /// on without ends (then the answer is an error). Then: health turns
    /// 503, parked waits answer 503 `shutting_down` at once, new
    /// connections are refused, requests in flight get `shutdown_grace`
    /// to finish and commit, and the store is closed.
    pub async fn run_until_stopped(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let registry = self.registry.clone();
        let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
        let (fatal_tx, fatal_rx) = tokio::sync::oneshot::channel::<String>();
        let supervisor = self.supervisor.clone();
        let signal = async move {
            tokio::select! {
                () = shutdown => {}
                why = supervisor.stopping() => {
                    let _ = fatal_tx.send(why);
                }
            }
            tracing::info!("shutting down: ending waits, draining requests");
            registry.shutdown();
            let _ = stopping_tx.send(());
        };
        let serve = crate::server::serve(self.listener, self.router, self.options, signal);
        let grace = self.config.shutdown_grace;
        let deadline = async move {
            if stopping_rx.await.is_ok() {
                tokio::time::sleep(grace).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            () = serve => {}
            () = deadline => {
                tracing::warn!(?grace, "requests still running after the shutdown grace; stopping anyway");
            }
        }
        let store = self.store;
        match tokio::task::spawn_blocking(move || store.close()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(error = %e, "closing the store failed"),
            Err(e) => tracing::error!(error = %e, "closing the store panicked"),
        }
        match fatal_rx.await {
            Ok(why) => Err(std::io::Error::other(format!(
                "stopped: {why}; a restart recovers from what the store holds"
            ))),
            Err(_) => Ok(()),
        }
    }
}

fn registry_config(
    config: &ServeConfig,
    metrics: Arc<Metrics>,
    supervisor: Supervisor,
) -> RegistryConfig {
    RegistryConfig {
        supervisor,
        limits: Limits::default(),
        max_waiters: config.max_waiters,
        max_allocations: config.max_allocations,
        max_dependents: config.max_dependents,
        metrics,
        timeline_events: config.timeline_events,
        event_buffer: config.event_buffer,
        event_buffer_bytes: usize::try_from(config.event_buffer_bytes).unwrap_or(usize::MAX),
        default_liveness_ttl: config.default_liveness_ttl,
        clock: crate::registry::Clock::system(),
        traces: config.traces.clone(),
    }
}

/// What a store is opened with: where it counts, and who owns its
/// long-lived tasks.
pub struct Opening {
    pub metrics: Arc<Metrics>,
    pub supervisor: Supervisor,
}

/// Opens the store the configuration names (blocking).
fn open_configured_store(
    config: &ServeConfig,
    Opening {
        metrics,
        supervisor,
    }: Opening,
) -> Result<Arc<dyn Store>, StoreError> {
    if config.in_memory {
        return Ok(Arc::new(MemoryStore::volatile()));
    }
    if config.store == crate::config::StoreKind::Etcd {
        let etcd = config.etcd.config().map_err(StoreError::Unusable)?;
        // Blocking is fine here: the store opens on a blocking thread.
        let store = tokio::runtime::Handle::current().block_on(
            crate::store::etcd::EtcdStore::connect_supervised(&etcd, supervisor),
        )?;
        tracing::info!(endpoints = ?etcd.endpoints, prefix = %etcd.prefix, "etcd store connected");
        return Ok(Arc::new(store));
    }
    let store = DiskStore::open(DiskStoreConfig {
        max_batch: usize::try_from(config.commit_batch).unwrap_or(usize::MAX),
        log_limit: config.store_log_limit,
        log_ceiling: config.store_log_ceiling,
        metrics: Some(metrics),
        supervisor,
        ..DiskStoreConfig::new(config.data_dir.clone())
    })?;
    tracing::info!(dir = %store.dir().display(), "store opened");
    Ok(Arc::new(store))
}

/// Loads every record of `store` into a registry (blocking).
fn load(
    store: Arc<dyn Store>,
    config: RegistryConfig,
) -> Result<(Arc<dyn Store>, Registry), StoreError> {
    let started = std::time::Instant::now();
    let registry = Registry::open(store.clone(), config)?;
    tracing::info!(
        allocations = registry.len(),
        last_index = registry.last_index(),
        elapsed_ms = started.elapsed().as_millis() as u64,
        "store loaded"
    );
    Ok((store, registry))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Secret;

    #[test]
    fn a_short_operator_secret_is_refused_off_loopback_only() {
        let mut config = ServeConfig::for_tests();
        config.operator_token = Some(Secret("short-but-not-32-bytes".into()));
        assert!(auth_for(&config).is_ok(), "loopback");
        config.listen = "0.0.0.0:8080".parse().unwrap();
        let Err(StartError::Config(err)) = auth_for(&config) else {
            panic!("a 22-byte operator secret was taken on 0.0.0.0");
        };
        assert!(
            err.contains("22 bytes") && err.contains("at least 32"),
            "{err}"
        );
        config.operator_token = Some(Secret("x".repeat(32)));
        assert!(auth_for(&config).is_ok());
    }
}
