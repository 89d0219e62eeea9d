//! `taskgate health`: probes a running server's `/v1/health`, for container
//! health checks in images without curl. Exit 0 when it answers 200.

use std::{path::PathBuf, time::Duration};

use clap::Args;

use crate::client::Endpoint;

#[derive(Debug, Clone, Args)]
pub struct HealthConfig {
    /// The server's base URL (`http://host:port` or `https://host:port`).
    #[arg(long, env = "TASKGATE_SERVER", default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// PEM CA certificate(s) to trust for an `https` server.
    #[arg(long, env = "TASKGATE_CA_CERT")]
    pub ca_cert: Option<PathBuf>,
    /// Give up after this long.
    #[arg(long, default_value = "5s", value_parser = crate::units::parse_duration)]
    pub timeout: Duration,
}

/// Returns true when the server is healthy; says why not on stderr.
pub async fn run(config: HealthConfig) -> bool {
    let answer = match Endpoint::new(&config.server, config.ca_cert.as_deref()) {
        Ok(e) => {
            e.request("GET", "/v1/health", None, None, &[], config.timeout)
                .await
        }
        Err(e) => Err(e),
    };
    match answer {
        Ok((200, _)) => true,
        Ok((status, _)) => {
            eprintln!("taskgate health: {} answered {status}", config.server);
            false
        }
        Err(e) => {
            eprintln!("taskgate health: {e}");
            false
        }
    }
}
