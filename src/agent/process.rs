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

/// Variables that carry (or point at) a taskgate secret: the command the
/// agent runs never sees them, so the workload cannot act in the agent's
/// name.
pub const SECRET_ENV: [&str; 3] = [
    "TASKGATE_TOKEN",
    "TASKGATE_TOKEN_FILE",
    "TASKGATE_OPERATOR_TOKEN",
];

/// Starts `command` in a process group of its own, with `env` added to
/// the agent's environment (less its secrets).
pub fn spawn(command: &[String], env: &[(&str, String)]) -> std::io::Result<Child> {
    let (program, args) = command
        .split_first()
        .ok_or_else(|| std::io::Error::other("no command given"))?;
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args).process_group(0).kill_on_drop(true);
    for name in SECRET_ENV {
        cmd.env_remove(name);
    }
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    let child = cmd.spawn()?;
    let pid = child.id().unwrap_or(0);
    Ok(Child { child, pid })
}

/// SIGKILL to the process group `pid` leads (the agent's way out on a
/// second signal).
pub fn kill_group(pid: u32) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
    }
}

/// A task the agent lets go of without stopping it (an error path, a
/// panic) takes its whole process group with it, not only its first
/// process: nothing of the workload outlives the agent that ran it.
impl Drop for Child {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.signal_group(Signal::SIGKILL);
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `pid` is still a process that runs (not gone, not a zombie).
    fn runs(pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit(')')
                    .next()
                    .map(|rest| rest.trim_start().to_owned())
            })
            .is_some_and(|rest| !rest.starts_with('Z') && !rest.starts_with('X'))
    }

    /// A task dropped while it runs (the agent's error paths) takes its
    /// whole process group along, not only its first process.
    #[tokio::test]
    async fn a_dropped_task_takes_its_process_group_along() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("grandchild");
        let script = format!(
            "sleep 300 & echo $! > {}.tmp; mv {0}.tmp {0}; wait",
            file.display()
        );
        let child = spawn(&["sh".into(), "-c".into(), script], &[]).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let grandchild: i32 = loop {
            if let Ok(text) = std::fs::read_to_string(&file) {
                break text.trim().parse().unwrap();
            }
            assert!(std::time::Instant::now() < deadline, "the script never ran");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        assert!(runs(grandchild));
        drop(child);
        while runs(grandchild) {
            assert!(
                std::time::Instant::now() < deadline,
                "the task's second process outlived it"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}
