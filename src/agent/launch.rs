//! How the agent starts a command (the task's, a readiness command's) so
//! that the command dies with the agent, even with an agent killed by
//! SIGKILL.
//!
//! Linux sends a process its parent-death signal (`PR_SET_PDEATHSIG`) when
//! its parent ends, however it ends; the process must set it on itself,
//! between fork and exec. Doing that from the agent takes a `pre_exec`
//! hook, which is `unsafe` (forbidden in this workspace), and no kept
//! library does it for us: process-wrap 10 offers process groups,
//! sessions, a reset signal mask and kill-on-drop, not this (and would
//! bring in nix). So the agent starts its own binary instead, as the
//! hidden `taskgate agent-exec`, which sets the signal on itself and execs
//! the command in its place: same pid, same process group; the signal
//! survives the exec (Linux clears it only on exec of a set-user-ID,
//! set-group-ID or capability-holding program). The cost is one exec of
//! the taskgate binary per start.
//!
//! The signal follows the *thread* that forked, not the process: the agent
//! runs on a single-threaded runtime (`main.rs`), so that thread lives as
//! long as the agent.

use std::{io, os::unix::process::CommandExt, path::Path};

use rustix::process::Signal;

/// The agent's own binary, even if its file was replaced or removed since
/// it started.
const SELF: &str = "/proc/self/exe";

/// How a command is started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launch {
    /// The command itself, without a parent-death signal: where there is
    /// no `/proc/self/exe` to start the agent's binary from, and in the
    /// library's own tests, whose binary has no `agent-exec`.
    Direct,
    /// Through `taskgate agent-exec`, which sets SIGKILL as the command's
    /// parent-death signal.
    DiesWithAgent,
}

impl Launch {
    /// How the agent starts commands here: so that they die with it, if
    /// it can.
    pub fn for_agent() -> Self {
        if std::path::Path::new(SELF).exists() {
            return Launch::DiesWithAgent;
        }
        tracing::warn!(
            "no {SELF} (is /proc mounted?): the task's process will not be killed by the \
             kernel if the agent is, and processes that leave its group will not be found"
        );
        Launch::Direct
    }

    /// A command that runs `argv`.
    pub fn command(self, argv: &[String]) -> io::Result<tokio::process::Command> {
        self.make(argv, false, None)
    }

    /// A command that runs the task's `argv`, in the cgroup `cgroup` if
    /// there is one (`agent-exec` moves itself into it before it execs
    /// the task, so that nothing of the task runs outside it).
    pub fn task(
        self,
        argv: &[String],
        cgroup: Option<&Path>,
    ) -> io::Result<tokio::process::Command> {
        self.make(argv, false, cgroup)
    }

    /// A command that runs `argv` for a readiness check: through
    /// `agent-exec --reap`, which ends all `argv` started once it has
    /// ended, or on SIGTERM (directly where the agent cannot start its own
    /// binary).
    pub fn check(self, argv: &[String]) -> io::Result<tokio::process::Command> {
        self.make(argv, true, None)
    }

    fn make(
        self,
        argv: &[String],
        reap: bool,
        cgroup: Option<&Path>,
    ) -> io::Result<tokio::process::Command> {
        let program = argv
            .first()
            .ok_or_else(|| io::Error::other("no command given"))?;
        match self {
            Launch::Direct => {
                let mut cmd = tokio::process::Command::new(program);
                cmd.args(&argv[1..]);
                Ok(cmd)
            }
            Launch::DiesWithAgent => {
                // agent-exec could report a failed exec only by an exit
                // code the command might exit with too: a program that
                // cannot be found or run is caught here, as a direct spawn
                // would catch it.
                runnable(program)?;
                let mut cmd = tokio::process::Command::new(SELF);
                cmd.args(["agent-exec", "--parent"])
                    .arg(rustix::process::getpid().as_raw_nonzero().to_string());
                if reap {
                    cmd.arg("--reap");
                }
                if let Some(cgroup) = cgroup {
                    cmd.arg("--cgroup").arg(cgroup);
                }
                cmd.arg("--").args(argv);
                Ok(cmd)
            }
        }
    }
}

/// Whether `program` names an executable file, looked up in `PATH` as
/// exec looks it up when it has no `/`: `NotFound` if there is no such
/// file, `PermissionDenied` if there is one that cannot be run (as exec
/// fails with ENOENT and EACCES).
fn runnable(program: &str) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let candidates: Vec<std::path::PathBuf> = if program.contains('/') {
        vec![program.into()]
    } else {
        // Unset, exec's search path is the C library's default.
        let path = std::env::var_os("PATH").unwrap_or_else(|| "/bin:/usr/bin".into());
        std::env::split_paths(&path)
            .map(|dir| dir.join(program))
            .collect()
    };
    let mut unrunnable = None;
    for candidate in candidates {
        match candidate.metadata() {
            Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => return Ok(()),
            Ok(_) => {
                unrunnable.get_or_insert(candidate);
            }
            Err(_) => {}
        }
    }
    Err(match unrunnable {
        Some(found) => io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("{program:?}: {} is not an executable file", found.display()),
        ),
        None => io::Error::new(
            io::ErrorKind::NotFound,
            format!("{program:?}: no such file (PATH is searched for a name without '/')"),
        ),
    })
}

/// `taskgate agent-exec`: how `taskgate agent` starts a command.
#[derive(Debug, Clone, clap::Args)]
pub struct ExecArgs {
    /// The agent's pid: if the parent is another process by now, the agent
    /// is gone and the command does not start.
    #[arg(long)]
    pub parent: i32,
    /// Run the command as a child, a child subreaper of it, and end all it
    /// started (SIGKILL) once it has ended or on SIGTERM; exit with its
    /// code (128 + 15 after SIGTERM). For readiness checks.
    #[arg(long)]
    pub reap: bool,
    /// Move into this cgroup (its directory) before running the command.
    #[arg(long)]
    pub cgroup: Option<std::path::PathBuf>,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, num_args = 1..)]
    pub command: Vec<String>,
}

/// Sets SIGKILL as this process's parent-death signal and execs the
/// command; returns only if that fails, with a shell's exit code.
pub fn exec(args: &ExecArgs) -> u8 {
    // Without it the command only loses the signal, not its containment
    // by the agent: worth running still.
    let _ = rustix::process::set_parent_process_death_signal(Some(Signal::KILL));
    // The agent may have ended between its fork and the line above: no
    // signal would come, and nobody would stop the command.
    let parent = rustix::process::getppid().map(|p| p.as_raw_nonzero().get());
    if parent != Some(args.parent) {
        eprintln!(
            "taskgate agent-exec: the agent (pid {}) is gone",
            args.parent
        );
        return 1;
    }
    let Some((program, rest)) = args.command.split_first() else {
        return 127;
    };
    if let Some(cgroup) = &args.cgroup {
        // Before the task runs: all it starts is born in the cgroup.
        let me = rustix::process::getpid().as_raw_nonzero().get();
        if let Err(e) = std::fs::write(cgroup.join("cgroup.procs"), me.to_string()) {
            // Without it the task is still contained by its process group
            // and the agent's subreaper: worth running still.
            eprintln!(
                "taskgate agent: cannot move the task into its cgroup {}: {e}; it runs \
                 without one",
                cgroup.display()
            );
        }
    }
    if args.reap {
        return reap(&args.command);
    }
    let error = std::process::Command::new(program).args(rest).exec();
    eprintln!("taskgate agent: cannot run {program:?}: {error}");
    if error.kind() == io::ErrorKind::NotFound {
        127
    } else {
        126
    }
}

/// `agent-exec --reap`: runs `argv` and ends all it started. The reaper is
/// the child subreaper of the command, so a process the command leaves
/// behind (a daemon that called `setsid`, the child of a double fork) is
/// re-parented to it, not to the agent, and ended with the check: a
/// readiness check that starts a daemon leaves nothing once it has ended.
/// The command runs through `agent-exec` in its turn, so that it dies if
/// the reaper is killed.
fn reap(argv: &[String]) -> u8 {
    use tokio::signal::unix::{SignalKind, signal};
    // Without it the command's orphans go to the agent, which ends them
    // with the task: worth running still.
    let _ = super::process::become_subreaper();
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return 126;
    };
    runtime.block_on(async {
        let mut terminate = signal(SignalKind::terminate()).ok();
        let spawned = Launch::DiesWithAgent
            .command(argv)
            .and_then(super::process::spawn_check);
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                eprintln!("taskgate agent: cannot run {argv:?}: {e}");
                return if e.kind() == io::ErrorKind::NotFound {
                    127
                } else {
                    126
                };
            }
        };
        let told = async {
            match terminate.as_mut() {
                Some(t) => t.recv().await,
                None => std::future::pending().await,
            }
        };
        let code = tokio::select! {
            exit = child.wait() => exit.code(),
            _ = told => 128 + Signal::TERM.as_raw(),
        };
        // All it started, in its group or not, at once: a check has no
        // grace period.
        child.stop(std::time::Duration::ZERO).await;
        u8::try_from(code).unwrap_or(1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_program_is_looked_up_as_exec_would() {
        assert!(runnable("sh").is_ok(), "found in PATH");
        assert!(runnable("/bin/sh").is_ok());
        let err = runnable("no-such-program-of-taskgate").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        assert!(err.to_string().contains("no-such-program-of-taskgate"));
        let err = runnable("/nonexistent/sh").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        let err = runnable("/tmp").unwrap_err();
        assert_eq!(
            err.kind(),
            io::ErrorKind::PermissionDenied,
            "a directory is not a program"
        );
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("plain");
        std::fs::write(&plain, "#!/bin/sh\n").unwrap();
        let err = runnable(plain.to_str().unwrap()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");
    }
}
