//! Readiness probes: how the agent learns that its running task is ready
//! (`--ready-cmd`, `--ready-http`, `--ready-tcp`). A probe runs every
//! `--ready-interval` while the task runs; each check is bounded by that
//! interval, so a hung check reads as "not ready", never as a stall.

use std::time::Duration;

use tokio::sync::mpsc;

/// One way to ask whether the task is ready.
#[derive(Debug, Clone)]
pub enum Probe {
    /// A shell command (`sh -c`); exit 0 is ready.
    Cmd(String),
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
    ) -> Result<Option<Self>, String> {
        if let Some(c) = cmd {
            return Ok(Some(Probe::Cmd(c.to_owned())));
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

    /// One check, at most `within` long.
    pub async fn check(&self, within: Duration) -> bool {
        let check = async {
            match self {
                Probe::Cmd(c) => tokio::process::Command::new("sh")
                    .args(["-c", c])
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .kill_on_drop(true)
                    .status()
                    .await
                    .is_ok_and(|s| s.success()),
                Probe::Http(client, url) => client
                    .get(url)
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success()),
                Probe::Tcp(addr) => tokio::net::TcpStream::connect(addr.as_str()).await.is_ok(),
            }
        };
        tokio::time::timeout(within, check).await.unwrap_or(false)
    }

    /// Checks every `interval` from now on, sending each answer; ends when
    /// the receiver is dropped.
    pub fn spawn(self, interval: Duration) -> ProbeTask {
        let (tx, rx) = mpsc::channel(1);
        let handle = tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let ready = self.check(interval).await;
                if tx.send(ready).await.is_err() {
                    return;
                }
            }
        });
        ProbeTask { rx, handle }
    }
}

/// A running probe; stopped when dropped.
pub struct ProbeTask {
    pub rx: mpsc::Receiver<bool>,
    handle: tokio::task::JoinHandle<()>,
}

impl Drop for ProbeTask {
    fn drop(&mut self) {
        self.handle.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn each_kind_of_probe_answers_what_it_finds() {
        let yes = Probe::Cmd("exit 0".into());
        let no = Probe::Cmd("exit 3".into());
        let hung = Probe::Cmd("sleep 30".into());
        let within = Duration::from_secs(5);
        assert!(yes.check(within).await);
        assert!(!no.check(within).await);
        assert!(!hung.check(Duration::from_millis(50)).await, "bounded");

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let open = Probe::Tcp(listener.local_addr().unwrap().to_string());
        assert!(open.check(within).await);
        let closed_addr = listener.local_addr().unwrap().to_string();
        drop(listener);
        assert!(!Probe::Tcp(closed_addr).check(within).await);
    }

    #[test]
    fn flags_are_checked_before_anything_runs() {
        assert!(Probe::from_flags(None, None, None).unwrap().is_none());
        let err = Probe::from_flags(None, Some("localhost:80/health"), None).unwrap_err();
        assert!(err.contains("http://"), "{err}");
        let err = Probe::from_flags(None, None, Some("localhost")).unwrap_err();
        assert!(err.contains("HOST:PORT"), "{err}");
        assert!(matches!(
            Probe::from_flags(Some("true"), None, None),
            Ok(Some(Probe::Cmd(_)))
        ));
    }
}
