//! The real binary: `taskgate health`, graceful shutdown with parked
//! long-polls, transparent huge pages off by default, and `taskgate dump`.

mod common;

use std::time::Duration;

use common::{
    five_tasks,
    process::{Server, health},
};
use serde_json::Value;

const BOUND: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_answers_parked_waits_with_503_and_exits_0() {
    let server = Server::start(&["--in-memory"]);
    let base = server.base.clone();
    assert!(
        tokio::task::spawn_blocking({
            let base = base.clone();
            move || health(&base)
        })
        .await
        .unwrap(),
        "taskgate health exits 0 on a healthy server"
    );

    let http = common::http();
    let reg = http
        .put(format!("{base}/v1/allocations/a1"))
        .json(&five_tasks())
        .send()
        .await
        .unwrap();
    assert_eq!(reg.status(), 201);
    let waits: Vec<_> = (0..3)
        .map(|_| {
            let http = http.clone();
            let url = format!("{base}/v1/allocations/a1/tasks/web/start-condition?wait=300s");
            tokio::spawn(async move { http.get(url).send().await })
        })
        .collect();
    // Parked: the gauge says so.
    let mut parked = false;
    for _ in 0..2_000 {
        let m = http
            .get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if m.contains("\ntaskgate_waiters 3\n") {
            parked = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(parked, "three long-polls parked");

    let asked = std::time::Instant::now();
    server.terminate();
    for w in waits {
        let res = tokio::time::timeout(BOUND, w)
            .await
            .expect("answered")
            .unwrap()
            .unwrap();
        assert_eq!(res.status(), 503);
        let body: Value = res.json().await.unwrap();
        assert_eq!(body["code"], "shutting_down");
    }
    let (exit, lines) = tokio::task::spawn_blocking(move || server.wait_logs())
        .await
        .unwrap();
    assert!(exit.success(), "exit code 0, got {exit:?}");
    // Answering parked waits 503 `shutting_down` is the shutdown working
    // as designed: no warning for any of them.
    let stopping = lines
        .iter()
        .position(|l| l.contains("shutting down"))
        .expect("the server logs that it shuts down");
    let warned: Vec<&String> = lines[stopping..]
        .iter()
        .filter(|l| l.contains(" WARN "))
        .collect();
    assert!(warned.is_empty(), "{warned:#?}");
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "stopped within the grace: {:?}",
        asked.elapsed()
    );
    assert!(
        !tokio::task::spawn_blocking(move || health(&base))
            .await
            .unwrap(),
        "health fails once stopped"
    );
}

/// The kernel's view of the server process: whether transparent huge pages
/// may back its memory (`THP_enabled` in /proc/PID/status).
fn thp_enabled(server: &Server) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{}/status", server.child.id())).unwrap();
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("THP_enabled:"))
        .expect("a kernel that reports THP_enabled");
    line.trim() == "1"
}

#[test]
fn transparent_huge_pages_are_off_unless_asked_for() {
    let server = Server::start(&["--in-memory"]);
    assert!(
        !thp_enabled(&server),
        "huge pages would make untouched connection buffers resident"
    );
    let server = Server::start(&["--in-memory", "--transparent-huge-pages"]);
    assert!(thp_enabled(&server));
}

/// `taskgate dump` on a server's data directory: refused while the server
/// runs, every allocation as one JSON line once it has stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dump_reads_a_stopped_servers_directory_and_refuses_a_running_one() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap().to_owned();
    let mut server = Server::start(&["--data-dir", &data]);
    let http = common::http();
    for id in ["b1", "a1"] {
        let reg = http
            .put(format!("{}/v1/allocations/{id}", server.base))
            .json(&five_tasks())
            .send()
            .await
            .unwrap();
        assert_eq!(reg.status(), 201);
    }
    let dump = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_taskgate"))
            .args(["dump", "--data-dir", &data])
            .output()
            .unwrap()
    };
    let running = dump();
    assert!(!running.status.success());
    let stderr = String::from_utf8_lossy(&running.stderr);
    assert!(stderr.contains("in use by a running taskgate"), "{stderr}");

    server.terminate();
    assert!(server.child.wait().unwrap().success());
    let stopped = dump();
    assert!(stopped.status.success(), "{stopped:?}");
    let ids: Vec<String> = String::from_utf8(stopped.stdout)
        .unwrap()
        .lines()
        .map(|line| {
            let v: Value = serde_json::from_str(line).unwrap();
            assert_eq!(v["coordinator_state"], "prestart");
            v["id"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(ids, ["a1", "b1"]);
}

/// A stream of the real server, read line by line.
struct NdJson {
    res: reqwest::Response,
    buf: Vec<u8>,
}

impl NdJson {
    async fn open(base: &str, query: &str) -> Self {
        let res = common::http()
            .get(format!("{base}/v1/events?{query}"))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        Self {
            res,
            buf: Vec::new(),
        }
    }

    /// The next line, or `None` once the stream ended.
    async fn next(&mut self) -> Option<Value> {
        loop {
            if let Some(line) = common::take_line(&mut self.buf) {
                return Some(line);
            }
            let chunk = tokio::time::timeout(BOUND, self.res.chunk())
                .await
                .expect("a line in time");
            // A connection cut by the server's exit ends the stream too.
            match chunk {
                Ok(Some(c)) => self.buf.extend_from_slice(&c),
                Ok(None) | Err(_) => return None,
            }
        }
    }
}

async fn put(base: &str, path: &str, body: Value) -> u64 {
    let res = common::http()
        .put(format!("{base}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(res.status().is_success(), "{}", res.status());
    res.headers()["x-taskgate-index"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// The event stream across a restart of the server on its data directory:
/// a reader that saw everything resumes with its last index and misses
/// nothing; one from before what the new process holds is told to resync
/// (the changes in between are not kept across a restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_stream_resumes_or_resyncs_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    let server = Server::start(&["--data-dir", data]);
    let base = server.base.clone();
    let mut s = NdJson::open(&base, "index=0").await;
    let i1 = put(&base, "/v1/allocations/a1", five_tasks()).await;
    let state = serde_json::json!({"state": "running"});
    let i2 = put(&base, "/v1/allocations/a1/tasks/init/state", state.clone()).await;
    for i in [i1, i2] {
        assert_eq!(s.next().await.unwrap()["index"], i);
    }
    server.terminate();
    assert_eq!(s.next().await, None, "the stream ends with the server");
    drop(server);

    let server = Server::start(&["--data-dir", data]);
    let base = server.base.clone();
    let mut resumed = NdJson::open(&base, &format!("index={i2}")).await;
    let mut older = NdJson::open(&base, &format!("index={i1}")).await;
    let i3 = put(&base, "/v1/allocations/a1/tasks/proxy/state", state).await;
    let l = resumed.next().await.unwrap();
    assert_eq!(
        (l["type"].as_str(), l["index"].as_u64()),
        (Some("Allocation"), Some(i3))
    );
    assert_eq!(l["allocation"]["tasks"][1]["state"], "running");
    assert_eq!(
        older.next().await.unwrap(),
        serde_json::json!({"type": "Resync", "index": i2})
    );
    assert_eq!(older.next().await.unwrap()["index"], i3);
}

fn warnings(lines: &[String]) -> Vec<&String> {
    lines.iter().filter(|l| l.contains(" WARN ")).collect()
}

/// A start with the defaults (on loopback, no tokens) and a stop log no
/// warning, also where the open-files limit is below the default
/// connection limit (the default is lowered to fit, said at info).
#[test]
fn a_default_start_and_stop_warn_of_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    let server = Server::start_with_open_files(1024, &["--data-dir", data]);
    let (exit, lines) = server.stop();
    assert!(exit.success(), "{exit:?}");
    assert!(warnings(&lines).is_empty(), "{:#?}", warnings(&lines));
    assert!(
        lines
            .iter()
            .any(|l| l.contains(" INFO ") && l.contains("896 connections at once")),
        "the lowered limit is said: {lines:#?}"
    );
}

/// Asking for more connections than the open-files limit allows is the
/// operator's to fix: one warning, naming the flag.
#[test]
fn more_connections_than_the_open_files_limit_is_one_warning() {
    let server = Server::start_with_open_files(1024, &["--in-memory", "--max-connections", "5000"]);
    let (exit, lines) = server.stop();
    assert!(exit.success(), "{exit:?}");
    let warned = warnings(&lines);
    assert_eq!(warned.len(), 1, "{warned:#?}");
    assert!(
        warned[0].contains("--max-connections") && warned[0].contains("using=896"),
        "{}",
        warned[0]
    );
}

/// `--listen :PORT` with no tokens on a port another process holds: both
/// problems are said, the address first (whether tokens are needed
/// depends on it), instead of the token refusal alone.
#[test]
fn a_busy_port_and_missing_tokens_are_both_said_address_first() {
    // Held on loopback: Linux refuses the wildcard address on a port that
    // a socket listens on.
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_taskgate"))
        .args(["serve", "--in-memory", "--listen", &format!(":{port}")])
        .env_remove("TASKGATE_OPERATOR_TOKEN")
        .env_remove("TASKGATE_TOKEN_FILE")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let address = err
        .find(&format!("cannot listen on 0.0.0.0:{port}"))
        .unwrap_or_else(|| panic!("the busy port is said: {err}"));
    let tokens = err
        .find("without authentication")
        .unwrap_or_else(|| panic!("the missing tokens are said: {err}"));
    assert!(address < tokens, "the address first: {err}");
    assert!(err.contains("another process listens"), "{err}");
    drop(held);
}

/// An operator secret as a Kubernetes Secret made from a file hands it
/// over (`openssl rand -hex 32 > operator.token`, then `secretKeyRef`):
/// with the file's newline. The operator presents it without one
/// (`TASKGATE_TOKEN="$(cat operator.token)"`, and no header value keeps
/// one), and is let in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_secret_with_its_file_s_newline_lets_the_operator_in() {
    let secret = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    let server = Server::start_env(
        &["--in-memory"],
        &[("TASKGATE_OPERATOR_TOKEN", &format!("{secret}\n"))],
    );
    let reg = common::http()
        .put(format!("{}/v1/allocations/a1", server.base))
        .bearer_auth(secret)
        .json(&five_tasks())
        .send()
        .await
        .unwrap();
    assert_eq!(reg.status(), 201, "{}", reg.text().await.unwrap());
}

/// The same secret, with its newline, given to `taskgate alloc` (as
/// `TASKGATE_TOKEN=$TASKGATE_OPERATOR_TOKEN` inside the server's pod
/// does): sent without it, not refused as a header it cannot make.
#[test]
fn a_token_with_a_newline_is_sent_without_it() {
    let secret = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    let with_newline = format!("{secret}\n");
    let server = Server::start_env(
        &["--in-memory"],
        &[("TASKGATE_OPERATOR_TOKEN", &with_newline)],
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_taskgate"))
        .args(["alloc", "--server", &server.base, "list"])
        .env("TASKGATE_TOKEN", &with_newline)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
