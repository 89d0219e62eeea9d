//! The minimal agent of docs/agent-protocol.md (`examples/minimal_agent.py`)
//! against the real server: a sidecar, a prestart step and a main task
//! under a TTL run in order, the sidecar is told to stop once the main
//! task is done, and the group ends successfully.

mod common;

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use common::{
    agents::{BOUND, get},
    process::Server,
};
use serde_json::json;

fn minimal_agent(base: &str, alloc: &str, task: &str, cmd: &str) -> Child {
    Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/minimal_agent.py"
        ))
        .args([base, alloc, task, "--", "sh", "-c", cmd])
        .stdout(Stdio::null())
        .spawn()
        .expect("python3 runs the minimal agent")
}

#[test]
fn the_minimal_agent_runs_a_group_in_order() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let spec = json!({"tasks": [
        {"name": "side", "lifecycle": {"hook": "prestart", "sidecar": true}},
        {"name": "init", "lifecycle": {"hook": "prestart"}},
        {"name": "web", "liveness": {"ttl": "3s"}},
    ]});
    let put = Command::new("curl")
        .args(["-sf", "-X", "PUT", "-H", "Content-Type: application/json"])
        .args(["-d", &spec.to_string()])
        .arg(format!("{}/v1/allocations/m1", server.base))
        .status()
        .unwrap();
    assert!(put.success());
    let mut agents = vec![
        minimal_agent(
            &server.base,
            "m1",
            "side",
            &format!("echo side >> {d}/log; exec sleep 300"),
        ),
        minimal_agent(&server.base, "m1", "init", &format!("echo init >> {d}/log")),
        // Longer than its TTL: its parked polls and heartbeats keep it
        // alive.
        minimal_agent(
            &server.base,
            "m1",
            "web",
            &format!("echo web >> {d}/log; sleep 4; echo web-done >> {d}/log"),
        ),
    ];
    let deadline = Instant::now() + BOUND;
    for agent in &mut agents {
        let status = loop {
            if let Some(status) = agent.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "a minimal agent did not finish");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(status.success(), "{status}");
    }
    let a = get(&server.base, "/v1/allocations/m1");
    assert_eq!(a["coordinator_state"], "poststop", "{a}");
    assert_eq!(a["outcome"], "succeeded", "{a}");
    let web = &a["tasks"][2];
    assert_eq!(web["lost"], false, "heartbeats kept it alive: {a}");
    assert_eq!(a["tasks"][0]["stop_reason"]["type"], "Main Tasks Dead");
    let log = std::fs::read_to_string(dir.path().join("log")).unwrap();
    let order: Vec<&str> = log.lines().collect();
    assert_eq!(order.last(), Some(&"web-done"));
    let web_at = order.iter().position(|l| *l == "web").unwrap();
    let init_at = order.iter().position(|l| *l == "init").unwrap();
    assert!(init_at < web_at, "prestart before main: {order:?}");
}
