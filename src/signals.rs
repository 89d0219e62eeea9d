//! SIGINT and SIGTERM, for the server and the agent.

/// Completes on the first SIGINT or SIGTERM.
pub async fn terminated() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            // Without a handler there is no Ctrl-C to wait for; SIGTERM
            // still stops the process. Ending here would stop it at once.
            tracing::warn!(error = %e, "cannot listen for Ctrl-C; SIGTERM still stops taskgate");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}
