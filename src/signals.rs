//! Signals that end the server: SIGINT and SIGTERM (the agent's are in
//! `agent::signals`).

/// Completes on the first SIGINT or SIGTERM. The handlers are installed
/// when this is called, not when the future is first polled: a server that
/// has said it listens stops gracefully on a signal that comes at once,
/// instead of dying by the signal's default action. Call it inside the
/// runtime.
pub fn terminated() -> impl std::future::Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let term = signal(SignalKind::terminate());
        let int = signal(SignalKind::interrupt());
        async move {
            // Without a handler there is no such signal to wait for; the
            // other still stops the process. Ending here would stop it at
            // once.
            let wait = |s: std::io::Result<tokio::signal::unix::Signal>, name: &'static str| async move {
                match s {
                    Ok(mut s) => {
                        s.recv().await;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot listen for {name}; the other signal still stops taskgate");
                        std::future::pending::<()>().await;
                    }
                }
            };
            tokio::select! {
                () = wait(term, "SIGTERM") => {},
                () = wait(int, "SIGINT") => {},
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}
