//! The task's process: spawned in its own process group, so a stop kills
//! everything it started; SIGTERM first, SIGKILL after the kill timeout.

use std::{os::unix::process::ExitStatusExt, process::ExitStatus, time::Duration};

use nix::{
    sys::signal::{Signal, killpg},
    unistd::Pid,
};
use serde_json::{Value, json};

pub struct Child {
    child: tokio::process::Child,
    pid: u32,
}

/// How the process ended.
#[derive(Debug, Clone, Copy)]
pub struct Exit(Option<ExitStatus>);

impl Exit {
    pub fn success(&self) -> bool {
        self.0.is_some_and(|s| s.success())
    }

    /// A shell-style exit code: the code, or 128 + the signal.
    pub fn code(&self) -> i32 {
        match self.0 {
            Some(s) => s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0)),
            None => 1,
        }
    }

    pub fn describe(&self) -> String {
        match self.0 {
            Some(s) => match (s.code(), s.signal()) {
                (Some(c), _) => format!("Exit Code: {c}"),
                (None, Some(sig)) => format!("Signal: {sig}"),
                (None, None) => "exited".to_owned(),
            },
            None => "could not be waited for".to_owned(),
        }
    }

    pub fn details(&self) -> Value {
        match self.0 {
            Some(s) => match (s.code(), s.signal()) {
                (Some(c), _) => json!({"exit_code": c.to_string()}),
                (None, Some(sig)) => json!({"signal": sig.to_string()}),
                (None, None) => json!({}),
            },
            None => json!({}),
        }
    }
}

pub fn spawn(command: &[String]) -> std::io::Result<Child> {
    let (program, args) = command
        .split_first()
        .ok_or_else(|| std::io::Error::other("no command given"))?;
    let child = tokio::process::Command::new(program)
        .args(args)
        .process_group(0)
        .kill_on_drop(true)
        .spawn()?;
    let pid = child.id().unwrap_or(0);
    Ok(Child { child, pid })
}

impl Child {
    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub async fn wait(&mut self) -> Exit {
        Exit(self.child.wait().await.ok())
    }

    fn signal_group(&self, signal: Signal) {
        if let Ok(pid) = i32::try_from(self.pid) {
            let _ = killpg(Pid::from_raw(pid), signal);
        }
    }

    /// SIGTERM to the process group; SIGKILL if it is still there after
    /// `timeout`.
    pub async fn kill(&mut self, timeout: Duration) -> Exit {
        self.signal_group(Signal::SIGTERM);
        match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(status) => Exit(status.ok()),
            Err(_) => {
                self.signal_group(Signal::SIGKILL);
                Exit(self.child.wait().await.ok())
            }
        }
    }
}
