//! The task's processes, and everything they start. A command runs in a
//! process group of its own; the agent is a child subreaper (set in
//! `agent::run`), so a process that leaves the group (`setsid`) or whose
//! parent dies (a double fork) is re-parented to the agent instead of to
//! init. Stopping a task, however its run ends, stops all of it: SIGTERM
//! to the group and to every stray, SIGKILL after the kill timeout, and
//! each stray reaped.
//!
//! A *stray* is a child of the agent that tokio does not wait for: with
//! the agent a subreaper, every orphan of the workload (and of a readiness
//! command) ends up as one, whatever group, session or name it took, while
//! the agent's own children (the task's first process, a running readiness
//! command) are registered in `OWNED`. That is why strays are found by
//! parenthood rather than by group, session or command line, which a
//! process can change. Parenthood is read from `/proc/<pid>/stat` of every
//! process, not from `/proc/self/task/*/children`, which exists only on
//! kernels built with `CONFIG_PROC_CHILDREN` (not this project's CI
//! machines). Where the task runs in a cgroup of its own (`cgroup.rs`),
//! its processes are also signalled through it, SIGKILL to all at once.
//! Not contained either way: what the task asks another process to start
//! (a service manager, `at`, ssh to localhost), which runs outside it.

use std::{
    collections::BTreeSet,
    os::unix::process::ExitStatusExt,
    process::ExitStatus,
    sync::{
        Mutex, MutexGuard, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use rustix::process::{Pid, Signal, WaitOptions};

use super::cgroup::Cgroup;
use serde_json::{Value, json};
use tokio::time::Instant;

/// How long SIGKILLed processes may take to vanish before the agent gives
/// up on them (one stuck in an uninterruptible sleep can take forever).
const KILLED_WITHIN: Duration = Duration::from_secs(10);

/// How often a stop looks again without a SIGCHLD: a group member whose
/// parent is another member ends without one reaching the agent.
const LOOK_AGAIN: Duration = Duration::from_millis(100);

/// Pids of the agent's children that tokio spawned and waits for: the
/// task's first process, a running readiness command. Sweeps and the
/// reaper leave them alone, since reaping one here would take its exit
/// status from tokio. Held around a spawn and its insertion, and around a
/// scan of the children and the reaping it leads to, so that no scan sees
/// a child between its fork and its registration; never across an await.
static OWNED: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());

/// Set once the agent is a child subreaper: only then is every child it
/// did not start an orphan of its workload. Elsewhere (the library's own
/// tests, whose process runs other tests' children) strays are nobody's
/// business.
static SUBREAPER: AtomicBool = AtomicBool::new(false);

/// Makes this process the child subreaper of everything it starts, and
/// strays its business.
pub fn become_subreaper() -> std::io::Result<()> {
    rustix::process::set_child_subreaper(Some(rustix::process::getpid()))?;
    SUBREAPER.store(true, Ordering::Relaxed);
    Ok(())
}

fn owned() -> MutexGuard<'static, BTreeSet<i32>> {
    OWNED.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Variables that carry (or point at) a taskgate secret: nothing the agent
/// runs sees them, so the workload cannot act in the agent's name.
pub const SECRET_ENV: [&str; 3] = [
    "TASKGATE_TOKEN",
    "TASKGATE_TOKEN_FILE",
    "TASKGATE_OPERATOR_TOKEN",
];

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

/// A command started in a process group of its own: the task, or one
/// readiness check.
///
/// Its group ID is its first process's pid, which the kernel does not give
/// to another process while that process is unreaped or any process is in
/// the group; after that, only once the pid numbers wrap around.
pub struct Child {
    child: tokio::process::Child,
    pid: i32,
    /// Whether dropping it kills the strays too: the task's, not a
    /// readiness check's, which the runtime may drop while the task is
    /// being stopped more gently.
    owns_strays: bool,
    /// How the first process ended, once tokio reaped it.
    exit: Option<Exit>,
    /// Set once a stop has seen nothing of the command left: its group ID
    /// may then belong to someone else and is never signalled again.
    done: bool,
    /// The task's cgroup, where it runs in one: all it started is in it,
    /// and is ended with it.
    cgroup: Option<Cgroup>,
}

/// Starts the task's command `cmd` in a process group of its own, with
/// `env` added to the agent's environment less its secrets; `cgroup` is
/// the one `cmd` moves into before it runs the task, if any.
pub fn spawn(
    cmd: tokio::process::Command,
    env: &[(&str, String)],
    cgroup: Option<Cgroup>,
) -> std::io::Result<Child> {
    let mut child = start(cmd, env, true)?;
    child.cgroup = cgroup;
    Ok(child)
}

/// Starts a readiness command as `spawn` starts the task's.
pub fn spawn_check(cmd: tokio::process::Command) -> std::io::Result<Child> {
    start(cmd, &[], false)
}

fn start(
    mut cmd: tokio::process::Command,
    env: &[(&str, String)],
    owns_strays: bool,
) -> std::io::Result<Child> {
    cmd.process_group(0).kill_on_drop(true);
    for name in SECRET_ENV {
        cmd.env_remove(name);
    }
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    let mut owned = owned();
    let child = cmd.spawn()?;
    let pid = child
        .id()
        .and_then(|p| i32::try_from(p).ok())
        .ok_or_else(|| std::io::Error::other("the command ended before it had a pid"))?;
    owned.insert(pid);
    Ok(Child {
        child,
        pid,
        owns_strays,
        exit: None,
        done: false,
        cgroup: None,
    })
}

/// A task the agent lets go of without stopping it (an error path, a
/// panic) takes its whole process group and every stray with it, not only
/// its first process: nothing of the workload outlives the agent that ran
/// it.
impl Drop for Child {
    fn drop(&mut self) {
        if !self.done {
            signal_group(self.pid, Signal::KILL);
            if let Some(cgroup) = &self.cgroup {
                cgroup.kill();
            }
            if self.owns_strays {
                for stray in reap_strays() {
                    stray.signal(Signal::KILL);
                }
            }
        }
        // Refused while the killed processes are still in it: the agent's
        // last sweep removes it then.
        if let Some(cgroup) = &self.cgroup {
            cgroup.remove();
        }
        owned().remove(&self.pid);
    }
}

impl Child {
    pub fn pid(&self) -> u32 {
        self.pid.unsigned_abs()
    }

    /// Waits for the first process to end (cancel-safe).
    pub async fn wait(&mut self) -> Exit {
        if let Some(exit) = self.exit {
            return exit;
        }
        let exit = Exit(self.child.wait().await.ok());
        self.reaped(exit);
        exit
    }

    fn reaped(&mut self, exit: Exit) {
        self.exit = Some(exit);
        owned().remove(&self.pid);
    }

    /// Stops everything the command started, whether its first process
    /// still runs or has ended: SIGTERM to its process group, to every
    /// stray and to every process in its cgroup, SIGKILL to what is left
    /// after `grace` (the whole cgroup at once, with `cgroup.kill`).
    /// Returns how the first process ended once nothing is left (and its
    /// cgroup is removed), or after SIGKILL could not end everything
    /// within `KILLED_WITHIN` (logged).
    pub async fn stop(&mut self, grace: Duration) -> Exit {
        // Listening before the first look: no end between a look and the
        // wait that follows it goes unnoticed.
        let mut wake = Wakeup::new();
        let mut sent = BTreeSet::new();
        if !self.done {
            signal_group(self.pid, Signal::TERM);
        }
        let soft = Instant::now() + grace;
        let mut left = self.left(&mut sent, Signal::TERM);
        while left && Instant::now() < soft {
            wake.until(soft).await;
            left = self.left(&mut sent, Signal::TERM);
        }
        let hard = Instant::now() + KILLED_WITHIN;
        sent.clear();
        while left {
            // Again each time: a process still in the group may fork.
            signal_group(self.pid, Signal::KILL);
            if let Some(cgroup) = &self.cgroup {
                cgroup.kill();
            }
            left = self.left(&mut sent, Signal::KILL);
            if !left {
                break;
            }
            if Instant::now() >= hard {
                tracing::warn!(
                    pid = self.pid,
                    strays = ?reap_strays().iter().map(|s| s.pid).collect::<Vec<_>>(),
                    cgroup = ?self.cgroup.as_ref().map(|c| (c.path().to_owned(), c.pids())),
                    "processes of the command survived SIGKILL for {KILLED_WITHIN:?}; leaving them"
                );
                return self.exit.unwrap_or(Exit(None));
            }
            wake.until(hard).await;
        }
        self.done = true;
        if let Some(cgroup) = &self.cgroup {
            cgroup.remove();
        }
        self.exit.unwrap_or(Exit(None))
    }

    /// Asks the command to end (SIGTERM to its process group), and kills
    /// the group if its first process has not ended within `within`;
    /// returns how that process ended. What left the group is not looked
    /// for: a readiness check's reaper ends what its command started.
    pub async fn end(&mut self, within: Duration) -> Exit {
        if !self.done {
            signal_group(self.pid, Signal::TERM);
        }
        match tokio::time::timeout(within, self.wait()).await {
            Ok(exit) => exit,
            Err(_) => self.kill_now().await,
        }
    }

    /// Ends the command at once: SIGKILL to its process group, and its
    /// first process reaped. What left the group is for the task's stop.
    pub async fn kill_now(&mut self) -> Exit {
        if !self.done {
            signal_group(self.pid, Signal::KILL);
        }
        let exit = self.wait().await;
        self.done = true;
        exit
    }

    /// Whether anything of the command is left. Reaps the first process
    /// and the strays that have ended, and sends `sig` to each stray and
    /// each process of its cgroup not sent it yet (`sent`).
    fn left(&mut self, sent: &mut BTreeSet<i32>, sig: Signal) -> bool {
        if self.exit.is_none()
            && let Ok(Some(status)) = self.child.try_wait()
        {
            self.reaped(Exit(Some(status)));
        }
        let strays = reap_strays();
        for stray in &strays {
            if sent.insert(stray.pid) {
                stray.signal(sig);
            }
        }
        let mut in_cgroup = false;
        if let Some(cgroup) = &self.cgroup {
            for pid in cgroup.pids() {
                if sent.insert(pid)
                    && let Some(pid) = Pid::from_raw(pid)
                {
                    let _ = rustix::process::kill_process(pid, sig);
                }
            }
            in_cgroup = cgroup.populated();
        }
        self.exit.is_none()
            || !strays.is_empty()
            || in_cgroup
            || (!self.done && group_exists(self.pid))
    }
}

/// Sends `sig` to the process group `pgid`. Never to the group of init (1),
/// which `kill(-1)` would make every process the agent may signal.
fn signal_group(pgid: i32, sig: Signal) {
    if pgid > 1
        && let Some(pgid) = Pid::from_raw(pgid)
    {
        let _ = rustix::process::kill_process_group(pgid, sig);
    }
}

/// SIGKILL to the process group `pgid` (a readiness command's).
pub fn kill_group(pgid: i32) {
    signal_group(pgid, Signal::KILL);
}

/// Whether any process (a zombie included) is in the group `pgid`.
fn group_exists(pgid: i32) -> bool {
    match Pid::from_raw(pgid) {
        Some(pgid) if pgid.as_raw_nonzero().get() > 1 => {
            // EPERM: there is a member, of another user (a setuid program).
            !matches!(
                rustix::process::test_kill_process_group(pgid),
                Err(rustix::io::Errno::SRCH)
            )
        }
        _ => false,
    }
}

/// The agent's way out on a second signal: SIGKILL to the process group
/// `pgid` (0: none), to the task's cgroup (if any), and to every child of
/// the agent, strays and its own, again until none of them runs (bounded
/// by `KILLED_WITHIN`). Again, because a process whose parent was killed
/// with the group becomes the agent's child only once that parent has
/// died.
pub async fn kill_everything(pgid: u32, cgroup: Option<Cgroup>) {
    let pgid = i32::try_from(pgid).unwrap_or(0);
    let me = rustix::process::getpid().as_raw_nonzero().get();
    let mut wake = Wakeup::new();
    let hard = Instant::now() + KILLED_WITHIN;
    loop {
        signal_group(pgid, Signal::KILL);
        if let Some(cgroup) = &cgroup {
            cgroup.kill();
        }
        let running: Vec<Stat> = processes()
            .filter(|p| !p.zombie && (p.ppid == me || (pgid > 1 && p.pgid == pgid)))
            .collect();
        let in_cgroup = cgroup.as_ref().is_some_and(Cgroup::populated);
        if (running.is_empty() && !in_cgroup) || Instant::now() >= hard {
            return;
        }
        for p in running.iter().filter(|p| p.ppid == me) {
            p.proc().signal(Signal::KILL);
        }
        reap_strays();
        wake.until(hard).await;
    }
}

/// Kills the strays left (SIGKILL) and reaps them, bounded by
/// `KILLED_WITHIN`: the agent's last act, so that nothing it was given to
/// run outlives it.
pub async fn sweep() {
    let mut wake = Wakeup::new();
    let hard = Instant::now() + KILLED_WITHIN;
    loop {
        let strays = reap_strays();
        if strays.is_empty() {
            return;
        }
        if Instant::now() >= hard {
            tracing::warn!(strays = ?strays.iter().map(|s| s.pid).collect::<Vec<_>>(),
                "processes the task started survived SIGKILL; leaving them");
            return;
        }
        for stray in &strays {
            stray.signal(Signal::KILL);
        }
        wake.until(hard).await;
    }
}

/// Reaps, on every SIGCHLD, the strays that have ended, so that a workload
/// that keeps leaving short-lived orphans does not fill the process table
/// with zombies while its task runs. At most one look per `pause`: a look
/// reads every process's `stat`.
pub async fn reap_forever(pause: Duration) {
    let Ok(mut chld) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child()) else {
        return;
    };
    while chld.recv().await.is_some() {
        reap_strays();
        tokio::time::sleep(pause).await;
    }
}

/// A child of the agent, as `/proc/<pid>/stat` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Proc {
    pid: i32,
    pgid: i32,
}

impl Proc {
    /// Sends `sig` to the process, and to its group if it leads one (a
    /// daemon's children stay in its group). A child of the agent cannot
    /// lead the agent's own group, and its pid (so its group ID) cannot
    /// be reused until the agent reaps it.
    fn signal(self, sig: Signal) {
        if let Some(pid) = Pid::from_raw(self.pid) {
            let _ = rustix::process::kill_process(pid, sig);
        }
        if self.pgid == self.pid {
            signal_group(self.pgid, sig);
        }
    }
}

/// The strays still running after reaping those that have ended.
fn reap_strays() -> Vec<Proc> {
    if !SUBREAPER.load(Ordering::Relaxed) {
        return Vec::new();
    }
    let owned = owned();
    children()
        .into_iter()
        .filter(|c| !owned.contains(&c.pid))
        .filter(|c| {
            let Some(pid) = Pid::from_raw(c.pid) else {
                return false;
            };
            // ECHILD: not (any more) a child of the agent.
            matches!(
                rustix::process::waitpid(Some(pid), WaitOptions::NOHANG),
                Ok(None)
            )
        })
        .collect()
}

/// Every child of the agent (zombies included).
fn children() -> Vec<Proc> {
    let me = rustix::process::getpid().as_raw_nonzero().get();
    processes()
        .filter(|p| p.ppid == me)
        .map(|p| p.proc())
        .collect()
}

/// A process as its `/proc/<pid>/stat` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stat {
    pid: i32,
    ppid: i32,
    pgid: i32,
    zombie: bool,
}

impl Stat {
    fn proc(self) -> Proc {
        Proc {
            pid: self.pid,
            pgid: self.pgid,
        }
    }
}

/// Every process this one can see.
fn processes() -> impl Iterator<Item = Stat> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| {
            stat(
                pid,
                &std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?,
            )
        })
}

/// Whether `pid` is a process that still runs (not gone, not a zombie).
pub fn runs(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|line| stat(pid, &line))
        .is_some_and(|s| !s.zombie)
}

/// Reads a `/proc/<pid>/stat` line: `pid (comm) state ppid pgrp ...`,
/// where `comm` may hold spaces and parentheses, so the fields are counted
/// from its last `)`.
fn stat(pid: i32, line: &str) -> Option<Stat> {
    let mut fields = line.rsplit_once(')')?.1.split_whitespace();
    let state = fields.next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgid = fields.next()?.parse().ok()?;
    Some(Stat {
        pid,
        ppid,
        pgid,
        zombie: state == "Z" || state == "X",
    })
}

/// Wakes a stop loop on SIGCHLD, at the latest after `LOOK_AGAIN`.
struct Wakeup(Option<tokio::signal::unix::Signal>);

impl Wakeup {
    fn new() -> Self {
        Self(tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child()).ok())
    }

    async fn until(&mut self, deadline: Instant) {
        let at = deadline.min(Instant::now() + LOOK_AGAIN);
        match &mut self.0 {
            Some(chld) => {
                tokio::select! {
                    _ = chld.recv() => {}
                    () = tokio::time::sleep_until(at) => {}
                }
            }
            None => tokio::time::sleep_until(at).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: String) -> Child {
        let mut cmd = tokio::process::Command::new("sh");
        cmd.args(["-c", &script]);
        spawn(cmd, &[], None).unwrap()
    }

    async fn read_pid(file: &std::path::Path) -> i32 {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(text) = std::fs::read_to_string(file) {
                break text.trim().parse().unwrap();
            }
            assert!(std::time::Instant::now() < deadline, "the script never ran");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
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
        let child = sh(script);
        let grandchild = read_pid(&file).await;
        assert!(runs(grandchild));
        drop(child);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while runs(grandchild) {
            assert!(
                std::time::Instant::now() < deadline,
                "the task's second process outlived it"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A stop after the first process has ended still stops what it left
    /// in its group, and says how the first process ended.
    #[tokio::test]
    async fn a_stop_after_the_first_process_ended_stops_its_group() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("background");
        let script = format!(
            "sleep 300 & echo $! > {}.tmp; mv {0}.tmp {0}; exit 3",
            file.display()
        );
        let mut child = sh(script);
        let background = read_pid(&file).await;
        assert_eq!(child.wait().await.code(), 3);
        assert!(
            runs(background),
            "the background process outlives its leader"
        );
        assert_eq!(child.stop(Duration::from_secs(5)).await.code(), 3);
        assert!(!runs(background), "stopped with the task");
    }

    #[test]
    fn stat_lines_are_read_past_any_command_name() {
        let read = |line| stat(42, line).map(|s| (s.ppid, s.pgid, s.zombie));
        assert_eq!(read("42 (sh) S 7 42 42 0 -1"), Some((7, 42, false)));
        assert_eq!(
            read("42 (a) b) (c) Z 8 9 9 0"),
            Some((8, 9, true)),
            "a name with spaces and parentheses"
        );
        assert_eq!(read("42 (x"), None);
    }

    /// The scan finds the agent's children, its own (registered) ones too.
    #[tokio::test]
    async fn the_scan_finds_this_processs_children() {
        let mut child = sh("exec sleep 300".into());
        let pid = child.pid;
        assert!(children().iter().any(|c| c.pid == pid && c.pgid == pid));
        child.kill_now().await;
        assert!(children().iter().all(|c| c.pid != pid), "reaped");
    }
}
