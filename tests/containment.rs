//! `taskgate agent` contains its workload and keeps its secret, with real
//! processes: nothing the task starts outlives the task, however it left
//! the task's process group, and nothing it runs can read the agent's
//! token.

mod common;

use std::{
    path::Path,
    process::{Command, Stdio},
};

use common::{agents::*, process::Server};
use serde_json::json;

/// A task that exits on its own takes along what it left running in the
/// background, in its process group or in a session of its own; the
/// processes are gone before the agent reports the task dead.
#[test]
fn a_natural_exit_takes_the_tasks_background_processes_along() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = web_only(d);
    let cmd = format!(
        "{} {} {} {} exit 0",
        background(d, "bg"),
        escaped(d, "esc"),
        await_file(d, "bg"),
        await_file(d, "esc")
    );
    let mut web = agent(&server.base, "n1", "web", &spec, &[], &cmd);
    let bg = read_pids(&d.join("bg"), 1)[0];
    let esc = read_pids(&d.join("esc"), 1)[0];
    assert_eq!(exits(std::slice::from_mut(&mut web)), [("web", 0)]);
    assert!(!runs(bg), "the background process {bg} outlived its task");
    assert!(
        !runs(esc),
        "the process {esc} that left the group outlived its task"
    );
    let t = get(&server.base, "/v1/allocations/n1/tasks/web");
    assert_eq!(
        (t["state"].as_str(), t["failed"].as_bool()),
        (Some("dead"), Some(false)),
        "{t}"
    );
}

/// A restart order stops the whole run, also what left its process group,
/// before the next run starts.
#[test]
fn a_restart_order_takes_the_runs_escaped_processes_along() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = web_only(d);
    let cmd = format!(
        "echo $$ >> {}/leaders; {} {} wait",
        d.display(),
        background(d, "bg"),
        escaped(d, "esc")
    );
    let _web = agent(&server.base, "r1", "web", &spec, &[], &cmd);
    let bg = read_pids(&d.join("bg"), 1)[0];
    let esc = read_pids(&d.join("esc"), 1)[0];
    wait_state(&server.base, "r1", "web", "running");
    let url = format!("{}/v1/allocations/r1/restart", server.base);
    assert_eq!(curl_status("POST", &url, Some(r#"{"task": "web"}"#)), "200");
    let leaders = read_pids(&d.join("leaders"), 2);
    assert!(!runs(leaders[0]), "the first run still runs");
    assert!(
        !runs(bg),
        "the first run's background process {bg} survived the restart"
    );
    assert!(
        !runs(esc),
        "the first run's escaped process {esc} survived the restart"
    );
}

/// A process that left the group is stopped as gently as the group:
/// SIGTERM first, SIGKILL only after the kill timeout (here it takes half
/// a second to finish); also while a readiness check is in flight when the
/// run ends, whose own end must not kill it early.
#[test]
fn an_escaped_process_gets_sigterm_first() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = web_ready(d);
    let dd = d.display();
    let daemon = format!(
        "trap 'sleep 0.5; echo term >> {dd}/term; exit 0' TERM; echo $$ >> {dd}/esc; \
         while :; do sleep 0.05; done"
    );
    let cmd = format!(
        "setsid sh -c \"{daemon}\" & {} exit 0",
        await_file(d, "esc")
    );
    let mut web = agent(
        &server.base,
        "t2",
        "web",
        &spec,
        &["--ready-cmd", "sleep 1000", "--ready-interval", "30s"],
        &cmd,
    );
    let esc = read_pids(&d.join("esc"), 1)[0];
    assert_eq!(exits(std::slice::from_mut(&mut web)), [("web", 0)]);
    assert!(!runs(esc));
    assert_eq!(
        std::fs::read_to_string(d.join("term")).unwrap_or_default(),
        "term\n",
        "the escaped process was told to stop before it was killed"
    );
}

/// Deleting the allocation ends the agent and everything its task started.
#[test]
fn deleting_the_allocation_takes_escaped_processes_along() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = web_only(d);
    let cmd = format!("{} {} wait", background(d, "bg"), escaped(d, "esc"));
    let mut web = agent(&server.base, "d1", "web", &spec, &[], &cmd);
    let bg = read_pids(&d.join("bg"), 1)[0];
    let esc = read_pids(&d.join("esc"), 1)[0];
    wait_state(&server.base, "d1", "web", "running");
    let url = format!("{}/v1/allocations/d1", server.base);
    assert_eq!(curl_status("DELETE", &url, None), "204");
    exits(std::slice::from_mut(&mut web));
    assert!(
        !runs(bg),
        "the background process {bg} outlived the deletion"
    );
    assert!(
        !runs(esc),
        "the escaped process {esc} outlived the deletion"
    );
}

/// HUP, QUIT, USR1 and USR2 end the agent as TERM does: the task and all
/// it started are stopped, the task is reported dead, the agent exits 0.
#[test]
fn every_terminating_signal_stops_the_task_and_reports_it_dead() {
    let server = Server::start(&["--in-memory"]);
    for sig in ["HUP", "QUIT", "USR1", "USR2"] {
        a_signal_stops_everything(&server, sig);
    }
}

/// SIGSTKFLT and the real-time signals (here SIGRTMIN, and SIGRTMAX as its
/// number, 64, which `kill` has no name for), whose default action ends a
/// process without a word, end the agent as TERM does: no process of the
/// workload is left behind.
#[test]
fn sigstkflt_and_the_real_time_signals_leave_no_workload_process() {
    let server = Server::start(&["--in-memory"]);
    for sig in ["STKFLT", "RTMIN", "64"] {
        a_signal_stops_everything(&server, sig);
    }
}

/// Sends `sig` to an agent whose task runs with a process in the
/// background and one that left its group: the agent exits 0, none of the
/// three runs any more, and the task is reported dead.
fn a_signal_stops_everything(server: &Server, sig: &str) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = web_only(d);
    let alloc = format!("sig-{}", sig.to_lowercase());
    let cmd = format!(
        "echo $$ >> {}/leader; {} {} wait",
        d.display(),
        background(d, "bg"),
        escaped(d, "esc")
    );
    let mut web = agent(&server.base, &alloc, "web", &spec, &[], &cmd);
    let leader = read_pids(&d.join("leader"), 1)[0];
    let bg = read_pids(&d.join("bg"), 1)[0];
    let esc = read_pids(&d.join("esc"), 1)[0];
    wait_state(&server.base, &alloc, "web", "running");
    send_signal(web.child.id(), sig);
    assert_eq!(
        exits(std::slice::from_mut(&mut web)),
        [("web", 0)],
        "SIG{sig} ends the agent cleanly"
    );
    for (pid, what) in [
        (leader, "task"),
        (bg, "background process"),
        (esc, "escaped process"),
    ] {
        assert!(!runs(pid), "SIG{sig}: the {what} {pid} outlived the agent");
    }
    let t = get(&server.base, &format!("/v1/allocations/{alloc}/tasks/web"));
    assert_eq!(t["state"], "dead", "SIG{sig}: {t}");
    let last = t["events"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["type"], "Killed", "SIG{sig}: {t}");
    assert_eq!(last["message"], "the agent is stopping", "SIG{sig}: {t}");
}

/// A second signal ends the agent at once, and everything its task
/// started with it, also what ignores SIGTERM and what left the group.
#[test]
fn a_second_signal_kills_everything_the_task_started() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = web_only(d);
    let dd = d.display();
    // The leader notes SIGTERM and goes on; the others ignore it (an
    // ignored signal stays ignored across exec).
    let cmd = format!(
        "trap 'echo t >> {dd}/term' TERM; echo $$ >> {dd}/leader; \
         (trap '' TERM; exec sleep 300) & echo $! >> {dd}/bg; \
         setsid sh -c \"trap '' TERM; echo \\$\\$ >> {dd}/esc; exec sleep 300\" & {} \
         while :; do sleep 1 & wait $!; done",
        await_file(d, "esc")
    );
    let mut web = Agent {
        child: Command::new(env!("CARGO_BIN_EXE_taskgate"))
            .args([
                "agent",
                "--server",
                &server.base,
                "--alloc",
                "s2",
                "--task",
                "web",
            ])
            .arg("--register")
            .arg(&spec)
            .args(["--kill-timeout", "300s", "--", "sh", "-c", &cmd])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
        task: "web",
    };
    let pids = [
        read_pids(&d.join("leader"), 1)[0],
        read_pids(&d.join("bg"), 1)[0],
        read_pids(&d.join("esc"), 1)[0],
    ];
    wait_state(&server.base, "s2", "web", "running");
    send_signal(web.child.id(), "TERM");
    // The agent now gives the task its 300 s to stop.
    let deadline = std::time::Instant::now() + BOUND;
    while std::fs::read_to_string(d.join("term"))
        .unwrap_or_default()
        .is_empty()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the task never got SIGTERM"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    send_signal(web.child.id(), "INT");
    assert_eq!(exits(std::slice::from_mut(&mut web)), [("web", 130)]);
    for pid in pids {
        assert!(!runs(pid), "{pid} outlived the agent's second signal");
    }
}

/// A readiness command that hangs is killed with its whole process group
/// when its check times out: checks do not pile up processes.
#[test]
fn a_hanging_readiness_command_is_killed_with_its_group() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = web_ready(d);
    let probe = format!("sleep 1000 & echo $! >> {}/probes; wait", d.display());
    let _web = agent(
        &server.base,
        "p1",
        "web",
        &spec,
        &["--ready-cmd", &probe, "--ready-interval", "100ms"],
        "exec sleep 300",
    );
    // Each check ends (times out) before the next starts: once six have
    // started, the first four have ended.
    let probes = read_pids(&d.join("probes"), 6);
    for pid in &probes[..4] {
        wait_gone(*pid, "a timed-out readiness check's process");
    }
}

/// What a readiness command starts is gone once its check has ended, also
/// a daemon that left the command's process group and session (`setsid`)
/// and one whose parent exited (a double fork): checks pile up no
/// processes while the task runs on.
#[test]
fn a_readiness_commands_daemons_are_gone_after_its_check() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = web_ready(d);
    let dd = d.display();
    // Each check starts two daemons, waits until both have written their
    // pids, and answers ready.
    let probe = format!(
        "n=$(cat {dd}/daemons 2>/dev/null | wc -l); \
         setsid sh -c 'echo $$ >> {dd}/daemons; exec sleep 300' & \
         (sh -c 'echo $$ >> {dd}/daemons; exec sleep 300' &); \
         for i in $(seq 1 3000); do \
           [ $(cat {dd}/daemons | wc -l) -ge $((n + 2)) ] && exit 0; sleep 0.01; \
         done; exit 1"
    );
    let _web = agent(
        &server.base,
        "p2",
        "web",
        &spec,
        &["--ready-cmd", &probe, "--ready-interval", "500ms"],
        &format!("echo $$ > {dd}/leader; exec sleep 300"),
    );
    // Once a third check has started its daemons, the first two checks
    // have ended.
    let daemons = read_pids(&d.join("daemons"), 6);
    for pid in &daemons[..4] {
        wait_gone(*pid, "a daemon of an ended readiness check");
    }
    let leader = read_pids(&d.join("leader"), 1)[0];
    assert!(runs(leader), "the task runs on");
}

/// Where the agent may create a cgroup (cgroup v2, and root here), its task
/// runs in a cgroup of its own, with all it starts (also a process that
/// left the task's process group); the cgroup is gone once the agent has
/// stopped the task and exited.
#[test]
fn the_task_runs_in_a_cgroup_of_its_own_removed_with_the_agent() {
    let Some(mount) = cgroup2_mount() else {
        eprintln!("no cgroup v2 on this machine: the agent falls back, nothing to test");
        return;
    };
    if !rustix::process::geteuid().is_root() {
        eprintln!("not root: the agent may not create a cgroup here, nothing to test");
        return;
    }
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = web_only(d);
    let cmd = format!(
        "echo $$ >> {}/leader; {} wait",
        d.display(),
        escaped(d, "esc")
    );
    let mut web = agent(&server.base, "cg1", "web", &spec, &[], &cmd);
    let leader = read_pids(&d.join("leader"), 1)[0];
    let esc = read_pids(&d.join("esc"), 1)[0];
    let own = cgroup_of(leader);
    assert!(
        own.rsplit('/')
            .next()
            .is_some_and(|name| name.starts_with("taskgate-")),
        "the task runs in {own:?}"
    );
    assert_ne!(own, cgroup_of(std::process::id().cast_signed()));
    assert_eq!(cgroup_of(esc), own, "the escaped process is in it too");
    let path = mount.join(own.trim_start_matches('/'));
    assert!(path.join("cgroup.kill").exists(), "{}", path.display());
    wait_state(&server.base, "cg1", "web", "running");
    send_signal(web.child.id(), "TERM");
    assert_eq!(exits(std::slice::from_mut(&mut web)), [("web", 0)]);
    assert!(!runs(leader) && !runs(esc));
    assert!(!path.exists(), "{} outlived the agent", path.display());
}

/// Where cgroup v2 is mounted (the `cgroup2` line of mountinfo).
fn cgroup2_mount() -> Option<std::path::PathBuf> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .ok()?
        .lines()
        .find(|l| {
            l.split(" - ")
                .nth(1)
                .is_some_and(|f| f.starts_with("cgroup2 "))
        })
        .and_then(|l| l.split(' ').nth(4))
        .map(Into::into)
}

/// The cgroup v2 path of `pid` (its `0::` line).
fn cgroup_of(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .unwrap_or_default()
        .to_owned()
}

/// The agent's token is out of reach of what it runs: not in the
/// environment of the task or of a readiness command, and not in the
/// agent's own `/proc/<pid>/environ` or memory, which a process of the
/// same user could read (or ptrace, here with strace) if the agent were
/// dumpable. The agent and its task run as an unprivileged user here
/// (root may read any process's memory).
#[test]
fn the_workload_and_its_probe_cannot_read_the_agents_token() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    make_world_writable(d);
    let secret = "agent-secret-of-enough-length-0123456789";
    let tokens = d.join("tokens.json");
    std::fs::write(
        &tokens,
        json!({"tokens": [{"name": "agents", "role": "agent", "sha256": sha256_hex(secret)}]})
            .to_string(),
    )
    .unwrap();
    let server = Server::start(&["--in-memory", "--token-file", tokens.to_str().unwrap()]);
    let spec = web_ready(d);
    let dd = d.display();
    let probe = format!(
        "env > {dd}/probe.env.tmp; mv {dd}/probe.env.tmp {dd}/probe.env; \
         cat /proc/$PPID/environ > {dd}/probe-ppid.env 2>/dev/null; exit 0"
    );
    let workload = format!(
        "id -u > {dd}/uid; echo $PPID > {dd}/ppid; env > {dd}/env; \
         cat /proc/$PPID/environ > {dd}/ppid.env 2>/dev/null; echo $? > {dd}/ppid.code; \
         timeout 5 strace -p $PPID -o /dev/null 2> {dd}/strace.err; echo $? > {dd}/strace.code; \
         {} exit 0",
        await_file(d, "probe.env")
    );
    let mut cmd = unprivileged(env!("CARGO_BIN_EXE_taskgate"));
    cmd.args([
        "agent",
        "--server",
        &server.base,
        "--alloc",
        "s1",
        "--task",
        "web",
    ])
    .arg("--register")
    .arg(&spec)
    .args(["--ready-cmd", &probe, "--ready-interval", "50ms"])
    .args(["--", "sh", "-c", &workload])
    .env("TASKGATE_TOKEN", secret)
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    let mut a = Agent {
        child: cmd.spawn().unwrap(),
        task: "web",
    };
    let agent_pid = a.child.id();
    assert_eq!(exits(std::slice::from_mut(&mut a)), [("web", 0)]);
    let read = |name: &str| std::fs::read_to_string(d.join(name)).unwrap_or_default();
    assert_ne!(read("uid").trim(), "0", "the workload runs unprivileged");
    assert_eq!(
        read("ppid").trim(),
        agent_pid.to_string(),
        "$PPID is the agent"
    );
    assert_ne!(
        read("ppid.code").trim(),
        "0",
        "/proc/<agent>/environ was readable"
    );
    assert!(
        read("strace.err").contains("Operation not permitted"),
        "the workload may ptrace the agent (strace exited {}): {}",
        read("strace.code").trim(),
        read("strace.err")
    );
    for file in ["env", "ppid.env", "probe.env", "probe-ppid.env"] {
        let seen = read(file);
        assert!(!seen.contains(secret), "{file} holds the token");
        assert!(!seen.contains("TASKGATE_TOKEN"), "{file}: {seen}");
    }
    assert!(read("probe.env").contains("PATH="), "the probe ran");
}

/// SIGKILL leaves the agent no chance to stop its task: the task's process
/// is killed by the kernel (its parent-death signal).
#[test]
fn a_killed_agent_takes_its_tasks_process_along() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = web_only(d);
    let cmd = format!("echo $$ >> {}/leader; exec sleep 300", d.display());
    let web = agent(&server.base, "k1", "web", &spec, &[], &cmd);
    let leader = read_pids(&d.join("leader"), 1)[0];
    wait_state(&server.base, "k1", "web", "running");
    send_signal(web.child.id(), "KILL");
    wait_gone(leader, "the task of a SIGKILLed agent");
}

/// A command that cannot be started is a driver failure (exit 127), not a
/// run that failed and is restarted.
#[test]
fn a_command_that_cannot_start_is_a_driver_failure() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let spec = web_only(dir.path());
    let mut a = Agent {
        child: Command::new(env!("CARGO_BIN_EXE_taskgate"))
            .args([
                "agent",
                "--server",
                &server.base,
                "--alloc",
                "f1",
                "--task",
                "web",
            ])
            .arg("--register")
            .arg(&spec)
            .args(["--", "/nonexistent/command", "arg"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
        task: "web",
    };
    assert_eq!(exits(std::slice::from_mut(&mut a)), [("web", 127)]);
    let t = get(&server.base, "/v1/allocations/f1/tasks/web");
    assert_eq!(
        (t["state"].as_str(), t["failed"].as_bool()),
        (Some("dead"), Some(true)),
        "{t}"
    );
    assert_eq!(
        task_events(&server.base, "f1", "web"),
        ["Driver Failure"],
        "{t}"
    );
    assert_eq!(t["restarts"], 0, "{t}");
}

fn sha256_hex(secret: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(secret.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn make_world_writable(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).unwrap();
}

/// `program` run as the user nobody when the tests run as root (root may
/// read any process's environment, so the check would prove nothing).
fn unprivileged(program: &str) -> Command {
    if !rustix::process::geteuid().is_root() {
        return Command::new(program);
    }
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(program);
    cmd
}
