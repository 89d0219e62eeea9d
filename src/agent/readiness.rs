//! Readiness probes: how the agent learns that its running task is ready
//! (`--ready-cmd`, `--ready-http`, `--ready-tcp`). A probe runs every
//! `--ready-interval` while the task runs; each check is bounded by that
//! interval, so a hung check reads as "not ready", never as a stall.
//!
//! A readiness command runs as the task's command does: in a process group
//! of its own, without the agent's secrets in its environment, started so
//! that it dies with the agent; and under a reaper of its own (`agent-exec
//! --reap`, a child subreaper), so that when its check ends, in time or
//! not, all it started is gone, also a daemon that left its group: checks
//! leave no process behind.

use std::{
    sync::{
        Arc,
        atomic::{AtomicI32, Ordering},
    },
    time::Duration,
};

use tokio::sync::mpsc;

use super::{launch::Launch, process};

/// How long a check's reaper, told to end, may take to end what the check
/// started before it is killed.
const REAPED_WITHIN: Duration = Duration::from_secs(5);

/// One way to ask whether the task is ready.
#[derive(Debug, Clone)]
pub enum Probe {
    /// A shell command (`sh -c`); exit 0 is ready.
    Cmd(String, Launch),
    /// A URL; any 2xx answer is ready.
    Http(reqwest::Client, String),
    /// `host:port`; an accepted connection is ready.
    Tcp(String),
}

impl Probe {
    /// The probe the flags ask for, if any (clap keeps them exclusive).
    pub fn from_flags(
        cmd: Option<&str>,
        http: Option<&str>,
        tcp: Option<&str>,
        launch: Launch,
    ) -> Result<Option<Self>, String> {
        if let Some(c) = cmd {
            return Ok(Some(Probe::Cmd(c.to_owned(), launch)));
        }
        if let Some(url) = http {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(format!(
                    "--ready-http {url:?}: the URL must start with http:// or https://"
                ));
            }
            let _ = rustls::crypto::ring::default_provider().install_default();
            let client = reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .map_err(|e| format!("--ready-http: {e}"))?;
            return Ok(Some(Probe::Http(client, url.to_owned())));
        }
        if let Some(addr) = tcp {
            if !addr.contains(':') {
                return Err(format!("--ready-tcp {addr:?}: expected HOST:PORT"));
            }
            return Ok(Some(Probe::Tcp(addr.to_owned())));
        }
        Ok(None)
    }

    /// One check, at most `within` long. A command's process group is
    /// published in `group` while it runs.
    pub async fn check(&self, within: Duration, group: &AtomicI32) -> bool {
        use tokio::time::timeout;
        match self {
            Probe::Cmd(script, launch) => run_command(script, *launch, within, group).await,
            Probe::Http(client, url) => timeout(within, client.get(url).send())
                .await
                .is_ok_and(|r| r.is_ok_and(|r| r.status().is_success())),
            Probe::Tcp(addr) => timeout(within, tokio::net::TcpStream::connect(addr.as_str()))
                .await
                .is_ok_and(|r| r.is_ok()),
        }
    }

    /// Checks every `interval` from now on, sending each answer; ends when
    /// the receiver is dropped.
    pub fn spawn(self, interval: Duration) -> ProbeTask {
        let (tx, rx) = mpsc::channel(1);
        let group = Arc::new(AtomicI32::new(0));
        let running = group.clone();
        let handle = tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let ready = self.check(interval, &running).await;
                if tx.send(ready).await.is_err() {
                    return;
                }
            }
        });
        ProbeTask { rx, handle, group }
    }
}

/// Runs a readiness command for at most `within`; true if it exited 0.
/// It runs under a reaper of its own (`agent-exec --reap`), which ends all
/// the command started when the command ends, and is told to (SIGTERM)
/// when the check runs out of time; the reaper's process group is in
/// `group` while it may still be running.
async fn run_command(script: &str, launch: Launch, within: Duration, group: &AtomicI32) -> bool {
    let argv = ["sh".to_owned(), "-c".to_owned(), script.to_owned()];
    let Ok(mut cmd) = launch.check(&argv) else {
        return false;
    };
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let Ok(mut child) = process::spawn_check(cmd) else {
        return false;
    };
    group.store(child.pid().cast_signed(), Ordering::Relaxed);
    let exit = tokio::time::timeout(within, child.wait()).await;
    if exit.is_err() {
        child.end(REAPED_WITHIN).await;
    }
    group.store(0, Ordering::Relaxed);
    child.kill_now().await;
    exit.is_ok_and(|e| e.success())
}

/// A running probe; stopped when dropped, its running command's process
/// group killed at once (the check itself ends only when the runtime next
/// gets to it).
pub struct ProbeTask {
    pub rx: mpsc::Receiver<bool>,
    handle: tokio::task::JoinHandle<()>,
    /// The process group of the readiness command running now (0: none).
    group: Arc<AtomicI32>,
}

impl Drop for ProbeTask {
    fn drop(&mut self) {
        self.handle.abort();
        let group = self.group.swap(0, Ordering::Relaxed);
        if group > 1 {
            process::kill_group(group);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn each_kind_of_probe_answers_what_it_finds() {
        let cmd = |script: &str| Probe::Cmd(script.into(), Launch::Direct);
        let (yes, no, hung) = (cmd("exit 0"), cmd("exit 3"), cmd("sleep 30"));
        let within = Duration::from_secs(5);
        let group = AtomicI32::new(0);
        assert!(yes.check(within, &group).await);
        assert!(!no.check(within, &group).await);
        assert!(
            !hung.check(Duration::from_millis(50), &group).await,
            "bounded"
        );
        assert_eq!(group.load(Ordering::Relaxed), 0, "nothing left running");

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let open = Probe::Tcp(listener.local_addr().unwrap().to_string());
        assert!(open.check(within, &group).await);
        let closed_addr = listener.local_addr().unwrap().to_string();
        drop(listener);
        assert!(!Probe::Tcp(closed_addr).check(within, &group).await);
    }

    #[test]
    fn flags_are_checked_before_anything_runs() {
        let direct = Launch::Direct;
        assert!(
            Probe::from_flags(None, None, None, direct)
                .unwrap()
                .is_none()
        );
        let err = Probe::from_flags(None, Some("localhost:80/health"), None, direct).unwrap_err();
        assert!(err.contains("http://"), "{err}");
        let err = Probe::from_flags(None, None, Some("localhost"), direct).unwrap_err();
        assert!(err.contains("HOST:PORT"), "{err}");
        assert!(matches!(
            Probe::from_flags(Some("true"), None, None, direct),
            Ok(Some(Probe::Cmd(..)))
        ));
    }
}
