//! `taskgate agent` processes for the end-to-end tests: one agent per
//! task, each running a small shell command that appends to a shared log.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::{Value, json};

pub const BOUND: Duration = Duration::from_secs(60);

/// `spec` written to `dir/spec.json`, for the agents' `--register`.
pub fn spec_file(dir: &Path, spec: &Value) -> PathBuf {
    let path = dir.join("spec.json");
    std::fs::write(&path, spec.to_string()).unwrap();
    path
}

/// A spec of one main task, `web`.
pub fn web_only(dir: &Path) -> PathBuf {
    spec_file(dir, &json!({"tasks": [{"name": "web"}]}))
}

/// One task, `web`, that declares readiness (for agents given a probe).
pub fn web_ready(dir: &Path) -> PathBuf {
    spec_file(dir, &json!({"tasks": [{"name": "web", "readiness": true}]}))
}

pub fn five_spec(dir: &Path) -> PathBuf {
    spec_file(dir, &super::five_tasks())
}

/// Starts `taskgate agent` for one task, stopped on drop.
pub struct Agent {
    pub child: Child,
    pub task: &'static str,
}

/// An agent still running at the end of a test is stopped as an operator
/// would stop it, so that it stops what its task started (SIGKILL would
/// leave that running): SIGTERM; a second SIGTERM if it is still trying
/// to report (its server may be gone); SIGKILL last. Bounded.
impl Drop for Agent {
    fn drop(&mut self) {
        use rustix::process::{Pid, Signal, kill_process};
        let pid = Pid::from_raw(self.child.id().cast_signed());
        for sig in [Signal::TERM, Signal::TERM, Signal::KILL] {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            if let Some(pid) = pid {
                let _ = kill_process(pid, sig);
            }
            let deadline = Instant::now() + Duration::from_secs(2);
            while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let _ = self.child.wait();
    }
}

pub fn agent(
    base: &str,
    alloc: &str,
    task: &'static str,
    spec: &Path,
    extra: &[&str],
    cmd: &str,
) -> Agent {
    let child = Command::new(env!("CARGO_BIN_EXE_taskgate"))
        .args(["agent", "--server", base, "--alloc", alloc, "--task", task])
        .arg("--register")
        .arg(spec)
        .args(["--restart-delay", "50ms", "--kill-timeout", "2s"])
        .args(extra)
        .args(["--", "sh", "-c", cmd])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the agent starts");
    Agent { child, task }
}

/// Waits (bounded) for every agent to exit; returns task → exit code.
pub fn exits(agents: &mut [Agent]) -> Vec<(&'static str, i32)> {
    let deadline = Instant::now() + BOUND;
    let mut out = Vec::new();
    for a in agents.iter_mut() {
        loop {
            if let Some(status) = a.child.try_wait().unwrap() {
                out.push((a.task, status.code().unwrap_or(-1)));
                break;
            }
            assert!(
                Instant::now() < deadline,
                "agent {} did not exit on its own",
                a.task
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    out
}

pub fn log_lines(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("log"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

pub fn pos(lines: &[String], what: &str) -> usize {
    lines
        .iter()
        .position(|l| l == what)
        .unwrap_or_else(|| panic!("{what:?} not in {lines:?}"))
}

/// Waits (bounded) until the log holds `n` lines equal to `what`.
pub fn wait_log(dir: &Path, what: &str, n: usize) {
    let deadline = Instant::now() + BOUND;
    while log_lines(dir).iter().filter(|l| *l == what).count() < n {
        assert!(
            Instant::now() < deadline,
            "{what:?} ×{n} never logged: {:?}",
            log_lines(dir)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn get(base: &str, path: &str) -> Value {
    let out = Command::new("curl")
        .args(["-s", &format!("{base}{path}")])
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap()
}

/// When the server last saw the task start.
pub fn started_at(base: &str, alloc: &str, task: &str) -> time::OffsetDateTime {
    let t = get(base, &format!("/v1/allocations/{alloc}/tasks/{task}"));
    time::OffsetDateTime::parse(
        t["started_at"].as_str().expect("started"),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap()
}

pub fn task_events(base: &str, alloc: &str, task: &str) -> Vec<String> {
    get(base, &format!("/v1/allocations/{alloc}/tasks/{task}"))["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap().to_owned())
        .collect()
}

/// Commands of the five-task example: init writes a file web reads, the
/// sidecar stays up, poststart and poststop append to the log. web runs
/// until the test creates `finish` (bounded: 30 s).
pub fn commands(dir: &Path) -> [(&'static str, String); 5] {
    let d = dir.display();
    [
        (
            "init",
            format!(
                "echo init-start >> {d}/log; echo ready > {d}/ready; echo init-done >> {d}/log"
            ),
        ),
        (
            "proxy",
            format!("echo proxy-start >> {d}/log; exec sleep 300"),
        ),
        (
            "web",
            format!(
                "test -f {d}/ready || exit 9; echo web-start >> {d}/log; \
                 for i in $(seq 1 600); do [ -f {d}/finish ] && break; sleep 0.05; done; \
                 rm -f {d}/finish; echo web-done >> {d}/log"
            ),
        ),
        ("announce", format!("echo announce >> {d}/log")),
        ("cleanup", format!("echo cleanup >> {d}/log")),
    ]
}

pub fn start_five(base: &str, dir: &Path, alloc: &str) -> Vec<Agent> {
    let spec = five_spec(dir);
    commands(dir)
        .into_iter()
        .map(|(task, cmd)| agent(base, alloc, task, &spec, &[], &cmd))
        .collect()
}

/// An operator's all-tasks restart of `alloc`, sent with curl: its answer.
pub fn restart_all_tasks(base: &str, alloc: &str) -> Value {
    let out = Command::new("curl")
        .args(["-s", "-X", "POST", "-H", "Content-Type: application/json"])
        .args(["-d", r#"{"all_tasks": true}"#])
        .arg(format!("{base}/v1/allocations/{alloc}/restart"))
        .output()
        .expect("curl runs");
    serde_json::from_slice(&out.stdout).expect("the answer is JSON")
}

/// The HTTP status of `METHOD url` sent with curl (as an operator types
/// it), with a JSON body if any.
pub fn curl_status(method: &str, url: &str, json: Option<&str>) -> String {
    let mut curl = Command::new("curl");
    curl.args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", method]);
    if let Some(body) = json {
        curl.args(["-H", "Content-Type: application/json", "-d", body]);
    }
    let out = curl.arg(url).output().expect("curl runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub use taskgate::agent::runs;

/// Waits (bounded) until `pid` no longer runs.
#[track_caller]
pub fn wait_gone(pid: i32, what: &str) {
    let deadline = Instant::now() + BOUND;
    while runs(pid) {
        assert!(
            Instant::now() < deadline,
            "{what} (pid {pid}) still runs after {BOUND:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The pids in `path`, one a line, once it has at least `n` of them
/// (bounded wait). Writers append whole lines.
#[track_caller]
pub fn read_pids(path: &Path, n: usize) -> Vec<i32> {
    let deadline = Instant::now() + BOUND;
    loop {
        let pids: Vec<i32> = std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        if pids.len() >= n {
            return pids;
        }
        assert!(
            Instant::now() < deadline,
            "{} never held {n} pids: {pids:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits (bounded) until the server shows `task` of `alloc` in `state`.
#[track_caller]
pub fn wait_state(base: &str, alloc: &str, task: &str, state: &str) -> Value {
    let deadline = Instant::now() + BOUND;
    loop {
        let t = get(base, &format!("/v1/allocations/{alloc}/tasks/{task}"));
        if t["state"] == state {
            return t;
        }
        assert!(
            Instant::now() < deadline,
            "{alloc}/{task} never {state}: {t}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `sig` (`HUP`, `KILL`, ...) to `pid`.
#[track_caller]
pub fn send_signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{sig} {pid}");
}

/// A shell fragment that starts `sleep 300` in the background, in the
/// task's process group, and appends its pid to `dir/name`.
pub fn background(dir: &Path, name: &str) -> String {
    format!("sleep 300 & echo $! >> {}/{name};", dir.display())
}

/// A shell fragment that starts `sleep 300` in a session (and process
/// group) of its own, the way a daemon leaves its parent's group, and
/// appends its pid to `dir/name`.
pub fn escaped(dir: &Path, name: &str) -> String {
    format!(
        "setsid sh -c 'echo $$ >> {}/{name}; exec sleep 300' &",
        dir.display()
    )
}

/// A shell fragment that waits (bounded: 30 s) until `dir/name` is not
/// empty, so a script goes on only once what it started has written there.
pub fn await_file(dir: &Path, name: &str) -> String {
    format!(
        "for i in $(seq 1 3000); do [ -s {}/{name} ] && break; sleep 0.01; done;",
        dir.display()
    )
}
