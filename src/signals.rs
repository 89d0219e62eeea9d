//! Signals that end taskgate: SIGINT and SIGTERM for the server, every
//! terminating signal for the agent.

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

/// The signals that end `taskgate agent` cleanly (its task stopped and
/// reported dead): every signal whose default action ends a process and
/// that a process may handle, but for the faults a program raises on
/// itself (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT, SIGSYS, SIGTRAP) and
/// SIGPIPE, which Rust programs ignore. Left to their default action, any
/// of these would end the agent without a word and orphan its workload.
#[cfg(unix)]
const AGENT_SIGNALS: [(rustix::process::Signal, &str); 13] = {
    use rustix::process::Signal;
    [
        (Signal::HUP, "SIGHUP"),
        (Signal::INT, "SIGINT"),
        (Signal::QUIT, "SIGQUIT"),
        (Signal::TERM, "SIGTERM"),
        (Signal::USR1, "SIGUSR1"),
        (Signal::USR2, "SIGUSR2"),
        (Signal::ALARM, "SIGALRM"),
        (Signal::VTALARM, "SIGVTALRM"),
        (Signal::PROF, "SIGPROF"),
        (Signal::XCPU, "SIGXCPU"),
        (Signal::XFSZ, "SIGXFSZ"),
        (Signal::IO, "SIGIO"),
        (Signal::POWER, "SIGPWR"),
    ]
};

/// The agent's handlers of every terminating signal, installed when made.
#[cfg(unix)]
pub struct Terminating(Vec<(tokio::signal::unix::Signal, &'static str)>);

#[cfg(unix)]
impl Terminating {
    /// Installs the handlers now (a signal that comes before would end
    /// the process). A signal whose handler cannot be installed keeps its
    /// default action, and is named in the log.
    pub fn listen() -> Self {
        use tokio::signal::unix::{SignalKind, signal};
        let mut handlers = Vec::new();
        for (sig, name) in AGENT_SIGNALS {
            match signal(SignalKind::from_raw(sig.as_raw())) {
                Ok(handler) => handlers.push((handler, name)),
                Err(e) => tracing::warn!(signal = name, error = %e, "cannot handle the signal"),
            }
        }
        Self(handlers)
    }

    /// The next terminating signal's name.
    pub async fn recv(&mut self) -> &'static str {
        std::future::poll_fn(|cx| {
            for (handler, name) in &mut self.0 {
                if handler.poll_recv(cx).is_ready() {
                    return std::task::Poll::Ready(*name);
                }
            }
            std::task::Poll::Pending
        })
        .await
    }
}
