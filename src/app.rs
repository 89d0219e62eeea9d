//! The application: open the store, rebuild the registry, bind, serve
//! until a shutdown future completes, then drain.

use std::{future::Future, net::SocketAddr, sync::Arc};

use tokio::net::TcpListener;

use crate::{
    config::ServeConfig,
    http::{self, HttpConfig},
    lifecycle::Limits,
    registry::{Registry, RegistryConfig},
    store::{MemoryStore, Store},
};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot load the store: {0}")]
    Store(#[from] crate::store::StoreError),
    #[error("{0}")]
    Config(String),
}

pub struct Application {
    listener: TcpListener,
    registry: Registry,
    router: axum::Router,
    config: ServeConfig,
}

impl Application {
    /// Loads every record, then binds. The listener takes work only once
    /// the store is loaded, so health is never 200 before that.
    pub async fn build(config: ServeConfig) -> Result<Self, StartError> {
        let store: Arc<dyn Store> = if config.in_memory {
            Arc::new(MemoryStore::new())
        } else {
            return Err(StartError::Config(
                "no disk store is built into this version yet: pass --in-memory \
                 (TASKGATE_IN_MEMORY=true)"
                    .into(),
            ));
        };
        Self::with_store(config, store).await
    }

    /// As `build`, with a given store (tests share one across restarts).
    pub async fn with_store(
        config: ServeConfig,
        store: Arc<dyn Store>,
    ) -> Result<Self, StartError> {
        let registry = Registry::open(
            store,
            RegistryConfig {
                limits: Limits::default(),
                max_waiters: config.max_waiters,
            },
        )?;
        let router = http::app(
            registry.clone(),
            HttpConfig {
                body_limit: config.body_limit,
                max_wait: config.max_wait,
                ..HttpConfig::default()
            },
        );
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| StartError::Bind {
                    addr: config.listen,
                    source,
                })?;
        Ok(Self {
            listener,
            registry,
            router,
            config,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Serves until `shutdown` completes. Then: health turns 503, parked
    /// waits answer 503 `shutting_down` at once, new connections are
    /// refused, and requests in flight get `shutdown_grace` to finish.
    pub async fn run_until_stopped(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let registry = self.registry.clone();
        let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
        let signal = async move {
            shutdown.await;
            tracing::info!("shutting down: ending waits, draining requests");
            registry.shutdown();
            let _ = stopping_tx.send(());
        };
        let serve = axum::serve(self.listener, self.router).with_graceful_shutdown(signal);
        let grace = self.config.shutdown_grace;
        let deadline = async move {
            if stopping_rx.await.is_ok() {
                tokio::time::sleep(grace).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            res = serve => res,
            () = deadline => {
                tracing::warn!(?grace, "requests still running after the shutdown grace; stopping anyway");
                Ok(())
            }
        }
    }
}
