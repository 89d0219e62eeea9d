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

pub fn five_spec(dir: &Path) -> PathBuf {
    spec_file(dir, &super::five_tasks())
}

/// Starts `taskgate agent` for one task, killed on drop.
pub struct Agent {
    pub child: Child,
    pub task: &'static str,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
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
