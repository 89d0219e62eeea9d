//! The minimal agent of docs/agent-protocol.md (`examples/minimal_agent.py`)
//! against the real server: a sidecar, a prestart step and a main task
//! under a TTL run in order, the sidecar is told to stop once the main
//! task is done, and the group ends successfully; and an operator's
//! restore that ends its run stops it.

mod common;

use std::process::{Command, Stdio};

use common::{
    agents::{Agent, curl_status, exits, get, read_pids, wait_gone, wait_state},
    process::Server,
};
use serde_json::json;

/// The minimal agent for `task`, stopped on drop if it is still running.
fn minimal_agent(base: &str, alloc: &str, task: &'static str, cmd: &str) -> Agent {
    let child = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/minimal_agent.py"
        ))
        .args([base, alloc, task, "--", "sh", "-c", cmd])
        .stdout(Stdio::null())
        .spawn()
        .expect("python3 runs the minimal agent");
    Agent { child, task }
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
    for (task, code) in exits(&mut agents) {
        assert_eq!(code, 0, "the minimal agent of {task}");
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

/// An operator's restore that sets the running task `pending` ends its run:
/// the minimal agent sees its run superseded, kills its workload and exits
/// without reporting more, so the task stays as the restore left it.
#[test]
fn the_minimal_agent_stops_when_its_run_is_superseded() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let pids = dir.path().join("pids");
    let url = format!("{}/v1/allocations/s1", server.base);
    let spec = json!({"tasks": [{"name": "web"}]}).to_string();
    assert_eq!(curl_status("PUT", &url, Some(&spec)), "201");
    let mut agent = [minimal_agent(
        &server.base,
        "s1",
        "web",
        &format!("echo $$ >> {}; exec sleep 300", pids.display()),
    )];
    let workload = read_pids(&pids, 1)[0];
    let before = wait_state(&server.base, "s1", "web", "running");
    assert!(before["run"].is_string(), "{before}");
    let restore = json!({"tasks": {"web": {"state": "pending"}}}).to_string();
    assert_eq!(
        curl_status("POST", &format!("{url}/restore"), Some(&restore)),
        "200"
    );
    let code = exits(&mut agent)[0].1;
    assert_eq!(code, 1, "a leftover says why and exits 1");
    wait_gone(workload, "the workload of a superseded run");
    let web = get(&server.base, "/v1/allocations/s1/tasks/web");
    assert_eq!(web["state"], "pending", "nothing reported since: {web}");
    assert_eq!(web["run"], json!(null), "{web}");
}
