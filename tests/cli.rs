//! `taskgate alloc` against a real server: its human output, its `--json`,
//! and its exit codes.

mod common;

use std::process::{Command, Output};

use common::process::Server;
use serde_json::{Value, json};

fn alloc(base: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_taskgate"))
        .args(["alloc", "--server", base])
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .expect("taskgate alloc runs")
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn send(base: &str, method: &str, path: &str, body: Value) {
    let out = Command::new("curl")
        .args(["-s", "-f", "-X", method, &format!("{base}{path}")])
        .args([
            "-H",
            "content-type: application/json",
            "-d",
            &body.to_string(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{method} {path}");
}

fn seeded() -> Server {
    let server = Server::start(&["--in-memory"]);
    send(
        &server.base,
        "PUT",
        "/v1/allocations/web-42",
        common::five_tasks(),
    );
    send(
        &server.base,
        "POST",
        "/v1/allocations/web-42/task-states",
        json!({"tasks": {"init": {"state": "dead"}, "proxy": {"state": "running"}}}),
    );
    server
}

#[test]
fn status_says_what_the_allocation_does_and_why() {
    let server = seeded();
    let o = alloc(&server.base, &["status", "web-42"]);
    assert_eq!(o.status.code(), Some(0));
    let out = text(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "ID        web-42");
    assert_eq!(lines[1], "State     main — waiting for web to be running");
    assert!(lines[2].starts_with("Modified  "), "{out}");
    assert!(
        out.contains("init      prestart_ephem.     closed  dead ok   -      run      0"),
        "{out}"
    );
    assert!(
        out.contains("web       main (leader)       open    pending   -      run      0"),
        "{out}"
    );
    assert!(out.contains("Coordinator      prestart → main"), "{out}");
    assert!(out.lines().all(|l| l.chars().count() <= 80), "{out}");
    assert!(!out.contains('\x1b'), "no color without a terminal");
    // --json carries the allocation and its timeline.
    let j: Value =
        serde_json::from_slice(&alloc(&server.base, &["status", "web-42", "--json"]).stdout)
            .unwrap();
    assert_eq!(j["allocation"]["coordinator_state"], "main");
    assert!(j["timeline"]["events"].is_array());
}

#[test]
fn list_events_and_actions_print_one_line_each() {
    let server = seeded();
    let out = text(&alloc(&server.base, &["list"]));
    assert!(out.contains("web-42"), "{out}");
    assert!(out.contains("1 running, 3 pending, 1 dead"), "{out}");
    let out = text(&alloc(&server.base, &["events", "web-42"]));
    assert!(out.lines().next().unwrap().ends_with("Registered"), "{out}");
    let o = alloc(
        &server.base,
        &["restart", "web-42", "--all-tasks", "--reason", "deploy"],
    );
    assert_eq!(o.status.code(), Some(0));
    assert!(
        text(&o).starts_with("web-42: restarted init, proxy; coordinator init"),
        "{}",
        text(&o)
    );
    let out = text(&alloc(&server.base, &["events", "web-42"]));
    assert!(out.contains("Restart Order"), "{out}");
    let o = alloc(&server.base, &["delete", "web-42"]);
    assert_eq!(text(&o), "web-42: deleted\n");
    assert_eq!(text(&alloc(&server.base, &["list"])), "no allocations\n");
}

#[test]
fn exit_codes_say_what_happened() {
    let server = seeded();
    // Refused: 1, with the code, the detail and where it is explained.
    let o = alloc(&server.base, &["restart", "web-42", "--task", "web"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("409 task_not_running"), "{err}");
    assert!(err.contains("/errors#task_not_running"), "{err}");
    let o = alloc(&server.base, &["status", "nope"]);
    assert_eq!(o.status.code(), Some(1));
    // Usage: 2.
    assert_eq!(alloc(&server.base, &["status"]).status.code(), Some(2));
    let o = alloc(
        &server.base,
        &["restore", "web-42", "--file", "/no/such/file"],
    );
    assert_eq!(o.status.code(), Some(2));
    // Unreachable: 3.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let o = alloc(&format!("http://127.0.0.1:{port}"), &["list"]);
    assert_eq!(o.status.code(), Some(3));
}
