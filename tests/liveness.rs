//! Agents that fail, through the real binaries: a SIGKILLed agent's task
//! is declared lost and its allocation ends; a partitioned agent learns its
//! task was lost, kills its workload and exits 3; a report whose answer was
//! lost is applied once; a server with another store, or one restored from
//! an older backup, is not taken for a deletion.

mod common;

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use common::{
    agents::{
        BOUND, agent, commands, five_spec, get, runs, send_signal, wait_gone, wait_state, web_only,
    },
    process::Server,
    proxy::Proxy,
};
use serde_json::Value;

fn parse(t: &Value) -> time::OffsetDateTime {
    time::OffsetDateTime::parse(
        t.as_str().unwrap_or_else(|| panic!("a time: {t}")),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap()
}

/// Waits (bounded) until `check` holds of the allocation's view.
#[track_caller]
fn wait_alloc(base: &str, alloc: &str, what: &str, check: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + BOUND;
    loop {
        let a = get(base, &format!("/v1/allocations/{alloc}"));
        if check(&a) {
            return a;
        }
        assert!(Instant::now() < deadline, "{alloc} never {what}: {a}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn task<'a>(a: &'a Value, name: &str) -> &'a Value {
    a["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .unwrap()
}

/// Five agents, each task under a 2 s TTL; web's agent is SIGKILLed while
/// web runs. Within the TTL and a second the server declares web lost; its
/// sidecar is told to stop, poststop runs, and the allocation ends failed
/// because of web.
#[test]
fn a_sigkilled_agent_s_task_is_lost_and_its_allocation_ends_failed() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let spec = five_spec(dir.path());
    let mut agents: Vec<_> = commands(dir.path())
        .into_iter()
        .map(|(t, cmd)| {
            agent(
                &server.base,
                "k1",
                t,
                &spec,
                &["--liveness-ttl", "2s"],
                &cmd,
            )
        })
        .collect();
    wait_state(&server.base, "k1", "web", "running");
    let a = get(&server.base, "/v1/allocations/k1");
    assert_eq!(task(&a, "web")["liveness"]["ttl"], "2s", "{a}");
    let web = agents.iter_mut().find(|a| a.task == "web").unwrap();
    let killed = time::OffsetDateTime::now_utc();
    send_signal(web.child.id(), "KILL");
    let _ = web.child.wait();
    let a = wait_alloc(&server.base, "k1", "ended", |a| a["outcome"].is_string());
    assert_eq!(a["coordinator_state"], "poststop", "{a}");
    assert_eq!(a["outcome"], "failed");
    assert_eq!(a["failed_tasks"], serde_json::json!(["web"]));
    let web = task(&a, "web");
    assert_eq!(web["lost"], true);
    assert_eq!(web["stop_reason"]["type"], "Agent Lost");
    let lost_at = parse(&web["finished_at"]);
    let took = lost_at - killed;
    assert!(
        took <= time::Duration::seconds(3),
        "lost {took} after the kill: more than the TTL (2 s) and a second"
    );
    assert!(
        took >= time::Duration::milliseconds(1900),
        "lost before its TTL: {took}"
    );
    let proxy = task(&a, "proxy");
    assert_eq!(proxy["stop_reason"]["type"], "Sibling Task Failed");
    assert_eq!(proxy["stop_reason"]["task"], "web");
    // Poststop ran, and told how the allocation ended.
    wait_state(&server.base, "k1", "cleanup", "dead");
    assert_lost_once(&server.base, "k1", "web");
}

/// The allocation's timeline holds exactly one "Agent Lost" entry, for
/// `task`.
fn assert_lost_once(base: &str, id: &str, task: &str) {
    let events: Vec<Value> = get(base, &format!("/v1/allocations/{id}/events"))["events"]
        .as_array()
        .unwrap()
        .clone();
    let lost: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "Agent Lost")
        .collect();
    assert_eq!(lost.len(), 1, "{events:?}");
    assert_eq!(lost[0]["task"], task);
}

/// An agent cut off from the server: its task is declared lost; when it
/// reaches the server again it learns so, kills its workload and exits 3.
#[test]
fn a_partitioned_agent_learns_its_task_was_lost_kills_it_and_exits_121() {
    let server = Server::start(&["--in-memory"]);
    let proxy = Proxy::start(server.addr());
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let spec = web_only(dir.path());
    let mut web = agent(
        &proxy.base,
        "p1",
        "web",
        &spec,
        &["--liveness-ttl", "1s"],
        &format!("echo $$ > {d}/pid.tmp; mv {d}/pid.tmp {d}/pid; exec sleep 300"),
    );
    wait_state(&server.base, "p1", "web", "running");
    let pid: i32 = common::agents::read_pids(&dir.path().join("pid"), 1)[0];
    proxy.cut();
    wait_alloc(&server.base, "p1", "lost web", |a| {
        task(a, "web")["lost"] == true
    });
    assert!(runs(pid), "cut off, the agent does not know yet");
    proxy.heal();
    let deadline = Instant::now() + BOUND;
    let code = loop {
        if let Some(status) = web.child.try_wait().unwrap() {
            break status.code();
        }
        assert!(
            Instant::now() < deadline,
            "the agent never learned its task was lost"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(code, Some(121), "the agent of a lost task exits 121");
    wait_gone(pid, "the lost task's workload");
}

/// A report that landed but whose answer was lost is retried with the
/// same Idempotency-Key: the server applies it once (one `Started` event,
/// not two).
#[test]
fn a_report_whose_answer_was_lost_is_applied_once() {
    let server = Server::start(&["--in-memory"]);
    let proxy = Proxy::start(server.addr());
    proxy.lose_answers("\"Started\"", 1);
    let dir = tempfile::tempdir().unwrap();
    let spec = web_only(dir.path());
    let _web = agent(&proxy.base, "i1", "web", &spec, &[], "exec sleep 300");
    wait_state(&server.base, "i1", "web", "running");
    // The report of the `Started` event, applied (its answer lost).
    let deadline = Instant::now() + BOUND;
    while proxy.answered() < 1 {
        assert!(
            Instant::now() < deadline,
            "the agent never reported Started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let t = get(&server.base, "/v1/allocations/i1/tasks/web");
    // Its retry, answered by the server.
    while proxy.answered() < 2 {
        assert!(
            Instant::now() < deadline,
            "the agent never retried its report"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let t2 = get(&server.base, "/v1/allocations/i1/tasks/web");
    let started = |t: &Value| {
        t["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["type"] == "Started")
            .count()
    };
    assert_eq!(started(&t2), 1, "{t2}");
    assert_eq!(
        t2["modify_index"], t["modify_index"],
        "the retry changed nothing: {t} then {t2}"
    );
}

/// Runs an agent through `proxy` for `web_only`, its workload writing its
/// pid to `dir/pid`; returns the agent and the workload's pid once running.
fn running_agent(
    proxy: &Proxy,
    server: &str,
    dir: &std::path::Path,
    alloc: &str,
) -> (std::process::Child, i32) {
    let d = dir.display();
    let spec = web_only(dir);
    let child = Command::new(env!("CARGO_BIN_EXE_taskgate"))
        .args([
            "agent",
            "--server",
            &proxy.base,
            "--alloc",
            alloc,
            "--task",
            "web",
        ])
        .arg("--register")
        .arg(&spec)
        .args(["--kill-timeout", "2s", "--"])
        .args([
            "sh",
            "-c",
            &format!("echo $$ > {d}/pid.tmp; mv {d}/pid.tmp {d}/pid; exec sleep 300"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_state(server, alloc, "web", "running");
    let pid = common::agents::read_pids(&dir.join("pid"), 1)[0];
    (child, pid)
}

/// Reads the agent's stderr (after it was stopped) into a string.
fn stderr_of(mut child: std::process::Child) -> String {
    use std::io::Read;
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
    let mut out = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    out
}

/// The agent's server is replaced by one with another store (a wrong
/// data directory): its 404s are not a deletion. The workload keeps
/// running, the agent says why once, and carries on when its server is
/// back.
#[test]
fn a_404_from_another_store_is_not_a_deletion() {
    let server = Server::start(&["--in-memory"]);
    let stranger = Server::start(&["--in-memory"]);
    let proxy = Proxy::start(server.addr());
    let dir = tempfile::tempdir().unwrap();
    let (mut agent, pid) = running_agent(&proxy, &server.base, dir.path(), "s1");
    proxy.watch("/v1/allocations/s1");
    proxy.retarget(stranger.addr());
    let deadline = Instant::now() + BOUND;
    while proxy.seen() < 3 {
        assert!(
            Instant::now() < deadline,
            "the agent never asked the other server"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(agent.try_wait().unwrap().is_none(), "the agent went on");
    assert!(runs(pid), "the workload was not killed");
    // Its own server back: the agent goes on as if nothing happened.
    proxy.retarget(server.addr());
    let index = get(&server.base, "/v1/allocations/s1")["modify_index"].clone();
    let restart = Command::new("curl")
        .args([
            "-sf",
            "-X",
            "POST",
            &format!("{}/v1/allocations/s1/restart", server.base),
        ])
        .status()
        .unwrap();
    assert!(restart.success());
    wait_alloc(&server.base, "s1", "restarted and running again", |a| {
        a["modify_index"] != index
            && task(a, "web")["restarts"] == 1
            && task(a, "web")["state"] == "running"
    });
    wait_gone(pid, "the first run, stopped for the restart");
    let err = stderr_of(agent);
    let said = err.matches("is not taken for a deletion").count();
    assert_eq!(said, 1, "said once an episode: {err}");
    assert!(err.contains("--data-dir"), "{err}");
}

/// The agent's server comes back from an older backup of its data
/// directory (the same store, at an index before the allocation): not a
/// deletion either.
#[test]
fn a_404_from_a_store_restored_from_an_older_backup_is_not_a_deletion() {
    let data = tempfile::tempdir().unwrap();
    let backup = tempfile::tempdir().unwrap();
    let path = data.path().join("d");
    let dir_arg = path.to_str().unwrap().to_owned();
    // The backup: the data directory before the allocation existed.
    {
        let first = Server::start(&["--data-dir", &dir_arg]);
        first.terminate();
        let mut first = first;
        let _ = first.child.wait();
    }
    let copy = |from: &std::path::Path, to: &std::path::Path| {
        let _ = std::fs::remove_dir_all(to);
        let status = Command::new("cp")
            .arg("-a")
            .arg(from)
            .arg(to)
            .status()
            .unwrap();
        assert!(status.success());
    };
    copy(&path, &backup.path().join("d"));
    let server = Server::start(&["--data-dir", &dir_arg]);
    let proxy = Proxy::start(server.addr());
    let work = tempfile::tempdir().unwrap();
    let (mut agent, pid) = running_agent(&proxy, &server.base, work.path(), "b1");
    server.terminate();
    let mut server = server;
    let _ = server.child.wait();
    copy(&backup.path().join("d"), &path);
    let restored = Server::start(&["--data-dir", &dir_arg]);
    proxy.watch("/v1/allocations/b1");
    proxy.retarget(restored.addr());
    let deadline = Instant::now() + BOUND;
    while proxy.seen() < 3 {
        assert!(
            Instant::now() < deadline,
            "the agent never asked the restored server"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(agent.try_wait().unwrap().is_none(), "the agent went on");
    assert!(runs(pid), "the workload was not killed");
    let err = stderr_of(agent);
    assert!(err.contains("went back in time"), "{err}");
}

/// A deletion from the store the allocation lives in still ends the agent
/// and its workload (the rule above is no excuse to ignore real ones).
#[test]
fn a_real_deletion_still_ends_the_agent_and_its_workload() {
    let server = Server::start(&["--in-memory"]);
    let proxy = Proxy::start(server.addr());
    let dir = tempfile::tempdir().unwrap();
    let (mut agent, pid) = running_agent(&proxy, &server.base, dir.path(), "x1");
    let deleted = Command::new("curl")
        .args([
            "-sf",
            "-X",
            "DELETE",
            &format!("{}/v1/allocations/x1", server.base),
        ])
        .status()
        .unwrap();
    assert!(deleted.success());
    let deadline = Instant::now() + BOUND;
    while agent.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "the agent did not end on a deletion"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    wait_gone(pid, "the deleted allocation's workload");
}

/// `--register` with a spec the server refuses with 409
/// `dependency_cycle` is fatal (exit 2, naming the cycle), not retried
/// forever (it was: every 409 was taken for a conflict that passes).
#[test]
fn registering_a_spec_that_closes_a_cycle_exits_125() {
    let server = Server::start(&["--in-memory"]);
    let put = Command::new("curl")
        .args(["-sf", "-X", "PUT", "-H", "Content-Type: application/json", "-d"])
        .arg(r#"{"tasks":[{"name":"web","depends_on":[{"task":"db","allocation":"b","condition":"running"}]}]}"#)
        .arg(format!("{}/v1/allocations/a", server.base))
        .status()
        .unwrap();
    assert!(put.success());
    let dir = tempfile::tempdir().unwrap();
    let spec = common::agents::spec_file(
        dir.path(),
        &serde_json::json!({"tasks": [{"name": "db", "depends_on": [
            {"task": "web", "allocation": "a", "condition": "running"}]}]}),
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_taskgate"))
        .args([
            "agent",
            "--server",
            &server.base,
            "--alloc",
            "b",
            "--task",
            "db",
        ])
        .arg("--register")
        .arg(&spec)
        .args(["--", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + BOUND;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the agent kept retrying a dependency cycle"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(125), "a permanent refusal");
    let err = stderr_of(child);
    assert!(
        err.contains("dependency_cycle") && err.contains("b/db"),
        "{err}"
    );
}

/// The same over etcd, with replicas: three `taskgate serve --store etcd`
/// replicas; web's agent talks to replica B, the other agents to A and
/// C. web's agent and replica B are SIGKILLed together while web runs:
/// nobody renews web's lease any more, etcd expires it, A and C see its
/// live key go, one of them records web lost (after its grace:
/// `registry::GRACE`, the time a replica that heard the agent would have
/// to mark the run again), and the allocation ends failed because of web,
/// within the TTL, the grace and a second of the kill (the TTL is whole
/// seconds here, so etcd's lease is exactly it).
#[test]
fn over_etcd_a_sigkilled_agent_s_task_is_lost_with_the_replica_it_used() {
    if !common::etcd::available(
        "over_etcd_a_sigkilled_agent_s_task_is_lost_with_the_replica_it_used",
    ) {
        return;
    }
    let cluster = common::etcd::Cluster::start(3);
    let replica = || {
        let endpoints = cluster.endpoints().join(",");
        Server::start(&[
            "--store",
            "etcd",
            "--etcd-endpoints",
            &endpoints,
            "--etcd-prefix",
            "/k2/",
        ])
    };
    let (a, b, c) = (replica(), replica(), replica());
    let dir = tempfile::tempdir().unwrap();
    let spec = five_spec(dir.path());
    let others = [
        format!("{},{}", a.base, c.base),
        format!("{},{}", c.base, a.base),
    ];
    let mut agents: Vec<_> = commands(dir.path())
        .into_iter()
        .enumerate()
        .map(|(i, (t, cmd))| {
            let servers = if t == "web" {
                b.base.clone()
            } else {
                others[i % 2].clone()
            };
            agent(&servers, "k2", t, &spec, &["--liveness-ttl", "2s"], &cmd)
        })
        .collect();
    wait_state(&a.base, "k2", "web", "running");
    let web = agents.iter_mut().find(|a| a.task == "web").unwrap();
    let killed = time::OffsetDateTime::now_utc();
    send_signal(web.child.id(), "KILL");
    send_signal(b.child.id(), "KILL");
    let _ = web.child.wait();
    let a_view = wait_alloc(&a.base, "k2", "ended", |v| v["outcome"].is_string());
    assert_eq!(a_view["coordinator_state"], "poststop", "{a_view}");
    assert_eq!(a_view["outcome"], "failed");
    assert_eq!(a_view["failed_tasks"], serde_json::json!(["web"]));
    let web = task(&a_view, "web");
    assert_eq!(web["lost"], true);
    assert_eq!(web["stop_reason"]["type"], "Agent Lost");
    let took = parse(&web["finished_at"]) - killed;
    let grace = time::Duration::try_from(taskgate::registry::GRACE).unwrap();
    assert!(
        took <= time::Duration::seconds(3) + grace,
        "lost {took} after the kill: more than the TTL (2 s), the grace and a second"
    );
    // B renewed the lease at most a third of the TTL before it died (its
    // agent's parked query kept it renewing).
    assert!(
        took >= time::Duration::milliseconds(2000 - 700),
        "lost before its TTL: {took}"
    );
    // Poststop ran, through the replicas left, and C holds the same.
    wait_state(&a.base, "k2", "cleanup", "dead");
    let c_view = wait_alloc(&c.base, "k2", "ended on C", |v| {
        task(v, "cleanup")["state"] == "dead"
    });
    assert_eq!(task(&c_view, "web")["finished_at"], web["finished_at"]);
    assert_lost_once(&a.base, "k2", "web");
    drop(agents);
}
