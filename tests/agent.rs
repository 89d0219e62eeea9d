//! `taskgate agent` end to end, with real processes: one agent per task,
//! each running a small shell command that appends to a shared log.

mod common;

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use common::{agents::*, process::Server};
use serde_json::{Value, json};

/// How the agents of the five-task allocation end when it has run to its
/// end: the sidecar (proxy) is stopped by an order (122), the others exit
/// with their task's code.
const FIVE_ENDED: [(&str, i32); 5] = [
    ("init", 0),
    ("proxy", 122),
    ("web", 0),
    ("announce", 0),
    ("cleanup", 0),
];

#[test]
fn the_five_task_allocation_runs_in_nomads_order_and_every_agent_exits() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let mut agents = start_five(&server.base, dir.path(), "a1");
    wait_log(dir.path(), "announce", 1);
    std::fs::write(dir.path().join("finish"), "").unwrap();
    let codes = exits(&mut agents);
    assert_eq!(
        codes, FIVE_ENDED,
        "the sidecar's agent ends stopped by an order, the others with their task's code"
    );

    let log = log_lines(dir.path());
    assert!(
        pos(&log, "init-done") < pos(&log, "web-start"),
        "prestart finished before main began: {log:?}"
    );
    // A gate opens when a task is reported running, which can be before its
    // shell writes to the log: for the sidecar and poststart, compare the
    // server's start times.
    assert!(
        started_at(&server.base, "a1", "proxy") < started_at(&server.base, "a1", "web"),
        "main after the prestart sidecar was running"
    );
    assert!(
        started_at(&server.base, "a1", "web") < started_at(&server.base, "a1", "announce"),
        "poststart after main was running"
    );
    assert_eq!(
        log.last().map(String::as_str),
        Some("cleanup"),
        "poststop last: {log:?}"
    );

    let proxy = task_events(&server.base, "a1", "proxy");
    assert!(
        proxy.ends_with(&["Killing".to_owned(), "Killed".to_owned()]),
        "sidecar stopped by a stop order: {proxy:?}"
    );
    let web = task_events(&server.base, "a1", "web");
    assert!(
        web.contains(&"Started".to_owned()) && web.contains(&"Terminated".to_owned()),
        "{web:?}"
    );
    assert_eq!(
        get(&server.base, "/v1/allocations/a1")["coordinator_state"],
        "poststop"
    );
}

#[test]
fn an_all_tasks_restart_replays_the_order() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let mut agents = start_five(&server.base, dir.path(), "a2");
    wait_log(dir.path(), "announce", 1);
    let answer = restart_all_tasks(&server.base, "a2");
    assert_eq!(
        answer["restarted"],
        json!(["init", "proxy", "web", "announce"]),
        "{answer}"
    );

    wait_log(dir.path(), "announce", 2);
    std::fs::write(dir.path().join("finish"), "").unwrap();
    let codes = exits(&mut agents);
    assert_eq!(codes, FIVE_ENDED);

    let log = log_lines(dir.path());
    let nth = |what: &str, n: usize| {
        log.iter()
            .enumerate()
            .filter(|(_, l)| *l == what)
            .nth(n)
            .map(|(i, _)| i)
            .unwrap_or_else(|| panic!("{what:?} #{n} missing: {log:?}"))
    };
    assert!(
        nth("init-start", 1) > nth("announce", 0),
        "the replay starts after the restart: {log:?}"
    );
    assert!(
        nth("init-done", 1) < nth("web-start", 1),
        "prestart again before main: {log:?}"
    );
    assert!(
        started_at(&server.base, "a2", "web") < started_at(&server.base, "a2", "announce"),
        "poststart again after main was running"
    );
    assert_eq!(log.iter().filter(|l| *l == "cleanup").count(), 1, "{log:?}");
    assert_eq!(log.last().map(String::as_str), Some("cleanup"), "{log:?}");
}

#[test]
fn a_failing_prestart_stops_its_siblings_and_runs_poststop() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let spec = five_spec(dir.path());
    let d = dir.path().display();
    let mut agents = vec![
        agent(
            &server.base,
            "a3",
            "init",
            &spec,
            &["--restart-attempts", "0"],
            &format!(
                // Fails once the sidecar runs, so the sidecar is killed rather
                // than stopped before it starts.
                "for i in $(seq 1 600); do grep -q proxy-start {d}/log 2>/dev/null && break; sleep 0.05; done; \
             echo init-failed >> {d}/log; exit 3"
            ),
        ),
        agent(
            &server.base,
            "a3",
            "proxy",
            &spec,
            &[],
            &format!("echo proxy-start >> {d}/log; exec sleep 300"),
        ),
        agent(
            &server.base,
            "a3",
            "web",
            &spec,
            &[],
            &format!("echo web-start >> {d}/log"),
        ),
        agent(
            &server.base,
            "a3",
            "announce",
            &spec,
            &[],
            &format!("echo announce >> {d}/log"),
        ),
        agent(
            &server.base,
            "a3",
            "cleanup",
            &spec,
            &[],
            &format!("echo cleanup $TASKGATE_ALLOC_OUTCOME $TASKGATE_FAILED_TASKS >> {d}/log"),
        ),
    ];
    let codes = exits(&mut agents);
    assert_eq!(
        codes[0],
        ("init", 3),
        "the agent exits with the task's code: {codes:?}"
    );
    assert_eq!(
        codes[1..],
        [
            ("proxy", 122),
            ("web", 122),
            ("announce", 122),
            ("cleanup", 0)
        ],
        "the tasks told to stop, running or not, end their agents with 122"
    );
    let log = log_lines(dir.path());
    assert!(
        !log.contains(&"web-start".to_owned()),
        "main never started: {log:?}"
    );
    assert!(!log.contains(&"announce".to_owned()), "{log:?}");
    assert_eq!(
        log.last().map(String::as_str),
        Some("cleanup failed init"),
        "the poststop task learns the outcome: {log:?}"
    );
    // web was told to stop before it started and reported dead without
    // running; the sidecar was killed for the failed sibling.
    let web = get(&server.base, "/v1/allocations/a3/tasks/web");
    assert_eq!(web["state"], "dead");
    let web_events: Vec<_> = web["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(web_events, ["Not Restarting"], "never started: {web}");
    let proxy = get(&server.base, "/v1/allocations/a3/tasks/proxy");
    let killing = proxy["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["type"] == "Killing")
        .unwrap_or_else(|| panic!("the sidecar was not killed: {proxy}"));
    // The order names the failed sibling; but web, the leader, is stopped
    // by the same order and reports `dead` without having run, and from then
    // on the first stop-order rule of docs/lifecycle.md (a leader dead without failing) names the
    // leader instead. Which of the two the sidecar's agent saw depends on
    // which agent acted first.
    // The stop order keeps its first cause: web, stopped by it, reporting
    // `dead` does not turn it into "Leader Task Dead".
    assert_eq!(killing["message"], "Sibling Task Failed", "{proxy}");
    assert_eq!(web["stop_reason"]["type"], "Sibling Task Failed", "{web}");
    let init = task_events(&server.base, "a3", "init");
    assert!(
        init.ends_with(&["Terminated".to_owned(), "Not Restarting".to_owned()]),
        "{init:?}"
    );
}

#[test]
fn a_server_killed_and_restarted_mid_run_loses_no_report() {
    let data = tempfile::tempdir().unwrap();
    let data_dir = data.path().to_str().unwrap().to_owned();
    let mut server = Server::start(&["--data-dir", &data_dir]);
    let base = server.base.clone();
    let port = base.rsplit(':').next().unwrap().to_owned();
    let dir = tempfile::tempdir().unwrap();
    let spec = spec_file(
        dir.path(),
        &json!({"tasks": [{"name": "init", "lifecycle": {"hook": "prestart"}}, {"name": "web"}]}),
    );
    let d = dir.path().display();
    let mut agents = vec![
        agent(
            &base,
            "a4",
            "init",
            &spec,
            &[],
            &format!("echo init >> {d}/log"),
        ),
        agent(
            &base,
            "a4",
            "web",
            &spec,
            &[],
            &format!(
                "echo web-start >> {d}/log; for i in $(seq 1 600); do [ -f {d}/finish ] && break; sleep 0.05; done; echo web-done >> {d}/log; exit 4"
            ),
        ),
    ];
    wait_log(dir.path(), "web-start", 1);
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    // The task ends while the server is down: its agent keeps retrying.
    std::fs::write(dir.path().join("finish"), "").unwrap();
    wait_log(dir.path(), "web-done", 1);
    let server = Server::start(&[
        "--data-dir",
        &data_dir,
        "--listen",
        &format!("127.0.0.1:{port}"),
    ]);
    assert_eq!(server.base, base);
    let codes = exits(&mut agents);
    assert_eq!(codes, [("init", 0), ("web", 4)], "{codes:?}");
    let web = get(&base, "/v1/allocations/a4/tasks/web");
    assert_eq!(web["state"], "dead");
    assert_eq!(web["failed"], true);
    let events: Vec<_> = web["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert!(events.contains(&"Terminated"), "{events:?}");
    assert_eq!(
        get(&base, "/v1/allocations/a4")["coordinator_state"],
        "poststop"
    );
}

#[test]
fn sigterm_to_an_agent_stops_its_task_and_reports_it_dead() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let spec = web_only(dir.path());
    let d = dir.path().display();
    let mut web = agent(
        &server.base,
        "a5",
        "web",
        &spec,
        &[],
        &format!("echo web-start >> {d}/log; exec sleep 300"),
    );
    wait_log(dir.path(), "web-start", 1);
    let deadline = Instant::now() + BOUND;
    while get(&server.base, "/v1/allocations/a5/tasks/web")["state"] != "running" {
        assert!(Instant::now() < deadline, "web never reported running");
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = Command::new("kill")
        .args(["-TERM", &web.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let codes = exits(std::slice::from_mut(&mut web));
    assert_eq!(codes, [("web", 0)]);
    let t = get(&server.base, "/v1/allocations/a5/tasks/web");
    assert_eq!(t["state"], "dead");
    let last = t["events"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["type"], "Killed");
    assert_eq!(last["message"], "the agent is stopping");
}

#[test]
fn a_failed_task_is_restarted_by_its_policy_and_then_reported_by_how_it_ended() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let spec = web_only(dir.path());
    let d = dir.path().display();
    // Fails the first time, succeeds the second.
    let cmd =
        format!("echo run >> {d}/log; if [ -f {d}/ran ]; then exit 0; fi; touch {d}/ran; exit 7");
    let mut web = agent(
        &server.base,
        "a6",
        "web",
        &spec,
        &["--restart-attempts", "1"],
        &cmd,
    );
    let codes = exits(std::slice::from_mut(&mut web));
    assert_eq!(codes, [("web", 0)], "the exit code of the last run");
    assert_eq!(log_lines(dir.path()), ["run", "run"]);
    let t = get(&server.base, "/v1/allocations/a6/tasks/web");
    assert_eq!(t["state"], "dead");
    assert_eq!(t["failed"], false);
    assert_eq!(t["restarts"], 1);
    let events: Vec<_> = t["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        events,
        [
            "Started",
            "Terminated",
            "Restarting",
            "Started",
            "Terminated",
            "Not Restarting"
        ],
        "{t}"
    );
    assert_eq!(t["events"][1]["details"]["exit_code"], "7");
}

/// A restart order that lands after the task's run ended but before its
/// agent reported how (here: while the agent stops what the run left
/// behind), when the restart policy runs the task again: the agent's
/// `pending` answers the order, so the next run is not killed for it
/// once more. (The agent had not marked the order seen: its next run was
/// stopped at once, "told to restart", and a third one started.)
#[test]
fn a_restart_order_answered_by_the_policys_restart_does_not_stop_the_next_run() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let spec = web_only(dir.path());
    let d = dir.path().display();
    // The first run leaves a process that ignores SIGTERM until `release`
    // exists (the agent waits for it before it reports), and fails; the
    // others wait for `finish`.
    let cmd = format!(
        "echo $$ >> {d}/runs; if [ $(wc -l < {d}/runs) -eq 1 ]; then \
         (trap '' TERM; touch {d}/held; \
         for i in $(seq 1 600); do [ -f {d}/release ] && break; sleep 0.05; done) & \
         for i in $(seq 1 600); do [ -f {d}/held ] && break; sleep 0.01; done; exit 1; fi; \
         for i in $(seq 1 600); do [ -f {d}/finish ] && break; sleep 0.05; done"
    );
    let flags = task_flags(
        &server.base,
        "a17",
        "web",
        &spec,
        &["--restart-delay", "0s", "--kill-timeout", "30s"],
    );
    let mut child = agent_with_stderr(&flags, &cmd);
    let lines = stderr_lines(&mut child);
    wait_lines(&lines, "the first run's end", |l| {
        l.iter().any(|l| l.contains("exited"))
    });
    // The server still has the task running: the order names it.
    let answer = restart_all_tasks(&server.base, "a17");
    assert_eq!(answer["restarted"], json!(["web"]), "{answer}");
    std::fs::write(dir.path().join("release"), "").unwrap();
    read_pids(&dir.path().join("runs"), 2);
    // The last run's agent waits on its task: nothing came since.
    wait_parked(&server.base, 1);
    std::fs::write(dir.path().join("finish"), "").unwrap();
    let mut web = [Agent { child, task: "web" }];
    assert_eq!(exits(&mut web), [("web", 0)]);
    let log = lines.lock().unwrap().join("\n");
    let t = get(&server.base, "/v1/allocations/a17/tasks/web");
    assert_eq!(t["restarts"], 1, "the policy's restart only: {t}\n{log}");
    assert!(!log.contains("told to restart"), "{log}");
}

#[test]
fn deleting_the_allocation_ends_the_agent_and_its_task() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let spec = web_only(dir.path());
    let d = dir.path().display();
    let mut web = agent(
        &server.base,
        "a7",
        "web",
        &spec,
        &[],
        &format!("echo $$ > {d}/pid; echo web-start >> {d}/log; exec sleep 300"),
    );
    wait_log(dir.path(), "web-start", 1);
    let pid = std::fs::read_to_string(dir.path().join("pid"))
        .unwrap()
        .trim()
        .to_owned();
    let url = format!("{}/v1/allocations/a7", server.base);
    assert_eq!(curl_status("DELETE", &url, None), "204");
    let codes = exits(std::slice::from_mut(&mut web));
    assert_eq!(codes, [("web", 123)], "deleted while it ran");
    let alive = Command::new("kill")
        .args(["-0", &pid])
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(!alive.success(), "the task's process {pid} was stopped");
}

/// The command never sees a taskgate secret: not the agent's token, nor one
/// meant for a server, nor where a token file is; `--token-file` keeps the
/// secret out of every environment.
#[test]
fn the_workload_never_sees_the_agents_secret() {
    let dir = tempfile::tempdir().unwrap();
    let secret = "agent-secret-of-enough-length-0123456789";
    let hash: String = {
        use sha2::Digest;
        sha2::Sha256::digest(secret.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    };
    let tokens = dir.path().join("tokens.json");
    std::fs::write(
        &tokens,
        json!({"tokens": [{"name": "agents", "role": "agent", "sha256": hash}]}).to_string(),
    )
    .unwrap();
    let server = Server::start(&["--in-memory", "--token-file", tokens.to_str().unwrap()]);
    let spec = web_only(dir.path());
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{secret}\n")).unwrap();
    let d = dir.path().display();
    for (alloc, how) in [("env-1", "env"), ("env-2", "file")] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_taskgate"));
        cmd.args([
            "agent",
            "--server",
            &server.base,
            "--alloc",
            alloc,
            "--task",
            "web",
        ])
        .arg("--register")
        .arg(&spec)
        .env("TASKGATE_OPERATOR_TOKEN", "an-operator-secret")
        .args(["--", "sh", "-c", &format!("env > {d}/{alloc}.env")])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        if how == "env" {
            cmd.env("TASKGATE_TOKEN", secret);
        } else {
            cmd.env("TASKGATE_TOKEN_FILE", &token_file);
        }
        let mut a = Agent {
            child: cmd.spawn().unwrap(),
            task: "web",
        };
        assert_eq!(exits(std::slice::from_mut(&mut a)), [("web", 0)], "{how}");
        let seen = std::fs::read_to_string(dir.path().join(format!("{alloc}.env"))).unwrap();
        assert!(seen.contains("PATH="), "{seen}");
        for leak in [
            secret,
            "an-operator-secret",
            "TASKGATE_TOKEN",
            "TASKGATE_OPERATOR_TOKEN",
        ] {
            assert!(!seen.contains(leak), "{how}: the workload saw {leak}");
        }
        let out = Command::new("curl")
            .args(["-s", "-H", &format!("Authorization: Bearer {secret}")])
            .arg(format!("{}/v1/allocations/{alloc}/tasks/web", server.base))
            .output()
            .unwrap();
        let state: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            state["state"], "dead",
            "{how}: the agent's reports were taken"
        );
    }
}

/// The token file is read again before each request: a token replaced in
/// it while the task runs (Kubernetes renews a pod's projected
/// service-account token before it expires) is the one the agent sends from
/// then on, with no restart of the agent or its task.
#[test]
fn a_token_replaced_in_the_token_file_is_sent_from_then_on() {
    let dir = tempfile::tempdir().unwrap();
    let secrets = [
        ("first", "the-first-agent-secret-0123456789abcdef"),
        ("second", "the-second-agent-secret-0123456789abcdef"),
    ];
    let tokens: Vec<Value> = secrets
        .iter()
        .map(|(name, secret)| {
            use sha2::Digest;
            let hash: String = sha2::Sha256::digest(secret.as_bytes())
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            json!({"name": name, "role": "agent", "sha256": hash})
        })
        .collect();
    let token_list = dir.path().join("tokens.json");
    std::fs::write(&token_list, json!({"tokens": tokens}).to_string()).unwrap();
    let server = Server::start(&["--in-memory", "--token-file", token_list.to_str().unwrap()]);
    let spec = web_only(dir.path());
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{}\n", secrets[0].1)).unwrap();
    let d = dir.path().display();
    // The task says it runs, then waits (bounded) for the test's go.
    let child = Command::new(env!("CARGO_BIN_EXE_taskgate"))
        .args(["agent", "--server", &server.base, "--alloc", "rot-1"])
        .args(["--task", "web", "--register"])
        .arg(&spec)
        .env("TASKGATE_TOKEN_FILE", &token_file)
        .args(["--", "sh", "-c"])
        .arg(format!(
            "echo running >> {d}/log; {} exit 0",
            await_file(dir.path(), "go")
        ))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut web = Agent { child, task: "web" };
    wait_log(dir.path(), "running", 1);
    // Replaced as the kubelet does: written beside it, renamed over it.
    let next = dir.path().join("token.next");
    std::fs::write(&next, format!("{}\n", secrets[1].1)).unwrap();
    std::fs::rename(&next, &token_file).unwrap();
    std::fs::write(dir.path().join("go"), "go").unwrap();
    assert_eq!(exits(std::slice::from_mut(&mut web)), [("web", 0)]);
    let (_, log) = server.stop();
    let writes_by = |name: &str| {
        log.iter()
            .filter(|l| l.contains("write by token") && l.contains(&format!("token={name}")))
            .count()
    };
    assert!(
        writes_by("first") > 0,
        "the first token registered: {log:#?}"
    );
    assert!(
        writes_by("second") > 0,
        "the task's end was reported with the token that replaced the first: {log:#?}"
    );
}

/// A main task waits for its sidecar's readiness probe, not only for the
/// sidecar to run: the sidecar (a real server) opens its port a while
/// after it starts, and main must not start before the port takes
/// connections.
#[test]
fn main_starts_only_once_the_sidecar_s_port_accepts_connections() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let spec = spec_file(
        dir.path(),
        &json!({"tasks": [
            {"name": "db", "lifecycle": {"hook": "prestart", "sidecar": true}, "readiness": true},
            {"name": "web", "leader": true}
        ]}),
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let bin = env!("CARGO_BIN_EXE_taskgate");
    let addr = format!("127.0.0.1:{port}");
    let mut agents = vec![
        // The sidecar: a taskgate server that starts listening half a
        // second after it starts (its own start-up time, not the test's
        // synchronization).
        agent(
            &server.base,
            "r1",
            "db",
            &spec,
            &["--ready-tcp", &addr, "--ready-interval", "50ms"],
            &format!(
                "echo db-start >> {d}/log; sleep 0.5; exec {bin} serve --in-memory --listen {addr}"
            ),
        ),
        // Main asks the sidecar's port at once when it starts.
        agent(
            &server.base,
            "r1",
            "web",
            &spec,
            &[],
            &format!(
                "if {bin} health --server http://{addr} --timeout 1s >/dev/null 2>&1; \
                 then echo web-port-open >> {d}/log; else echo web-too-early >> {d}/log; fi"
            ),
        ),
    ];
    let codes = exits(&mut agents);
    assert_eq!(codes, [("db", 122), ("web", 0)], "the sidecar is stopped");
    assert_eq!(log_lines(dir.path()), ["db-start", "web-port-open"]);
    let db = task_events(&server.base, "r1", "db");
    assert!(db.contains(&"Ready".to_owned()), "{db:?}");
    let t = get(&server.base, "/v1/allocations/r1/tasks/db");
    assert!(t["ready_at"].is_string(), "{t}");
}

/// An agent whose task declares readiness but that was given no probe
/// refuses to start, and says which flag to give.
#[test]
fn a_readiness_task_without_a_probe_is_refused() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let spec = spec_file(
        dir.path(),
        &json!({"tasks": [{"name": "web", "readiness": true}]}),
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_taskgate"))
        .args([
            "agent",
            "--server",
            &server.base,
            "--alloc",
            "r2",
            "--task",
            "web",
        ])
        .arg("--register")
        .arg(&spec)
        .args(["--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--ready-cmd"), "{stderr}");
    let t = get(&server.base, "/v1/allocations/r2/tasks/web");
    assert_eq!(t["state"], "pending", "the task never ran: {t}");
}

/// When the restart policy gives up on a task it would restart — here
/// after successful exits under --restart-on-success — the task is dead
/// and failed, as Nomad marks it.
#[test]
fn a_task_the_policy_gives_up_on_is_failed() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let spec = web_only(dir.path());
    let d = dir.path().display();
    let mut web = agent(
        &server.base,
        "g1",
        "web",
        &spec,
        &["--restart-attempts", "1", "--restart-on-success"],
        &format!("echo run >> {d}/log"),
    );
    let codes = exits(std::slice::from_mut(&mut web));
    assert_eq!(codes, [("web", 0)]);
    assert_eq!(log_lines(dir.path()), ["run", "run"]);
    let t = get(&server.base, "/v1/allocations/g1/tasks/web");
    assert_eq!(t["state"], "dead");
    assert_eq!(t["failed"], true, "{t}");
    let a = get(&server.base, "/v1/allocations/g1");
    assert_eq!(a["outcome"], "failed");
}

/// A task not ready within --ready-timeout is killed and handled as a
/// failure by its restart policy: with no attempts left it is dead and
/// failed.
#[test]
fn a_task_not_ready_in_time_is_killed_as_a_failure() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let spec = spec_file(
        dir.path(),
        &json!({"tasks": [{"name": "web", "readiness": true}]}),
    );
    let mut web = agent(
        &server.base,
        "t1",
        "web",
        &spec,
        &[
            "--ready-cmd",
            "exit 1",
            "--ready-interval",
            "50ms",
            "--ready-timeout",
            "300ms",
            "--restart-attempts",
            "0",
        ],
        &format!("echo run >> {d}/log; exec sleep 300"),
    );
    let codes = exits(std::slice::from_mut(&mut web));
    assert_eq!(codes, [("web", 124)], "not ready in time, not run again");
    assert_eq!(log_lines(dir.path()), ["run"]);
    let t = get(&server.base, "/v1/allocations/t1/tasks/web");
    assert_eq!(t["state"], "dead");
    assert_eq!(t["failed"], true, "{t}");
    let events = task_events(&server.base, "t1", "web");
    assert!(
        events.ends_with(&[
            "Killing".to_owned(),
            "Readiness Timeout".to_owned(),
            "Not Restarting".to_owned()
        ]),
        "{events:?}"
    );
}

/// Runs `taskgate agent ARGS -- sh -c CMD` with its stderr kept.
fn agent_with_stderr(args: &[&str], cmd: &str) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_taskgate"))
        .arg("agent")
        .args(args)
        .args(["--", "sh", "-c", cmd])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits (bounded) for `child` to exit: its code and its stderr.
fn ended(mut child: std::process::Child) -> (Option<i32>, String) {
    let deadline = Instant::now() + BOUND;
    while child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the agent did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Whether a process of this pid still exists.
fn alive(pid: &str) -> bool {
    Command::new("kill")
        .args(["-0", pid])
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success()
}

/// Starts web under an agent, waits until it reports running, then kills
/// the server: what the agent does next happens with nobody to report to.
fn running_then_server_gone(extra: &[&str]) -> (std::process::Child, String, tempfile::TempDir) {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let spec = web_only(dir.path());
    let d = dir.path().display();
    let mut args = vec!["--server", &server.base, "--alloc", "s1", "--task", "web"];
    let spec_arg = spec.to_str().unwrap().to_owned();
    args.extend(["--register", &spec_arg]);
    args.extend(extra);
    let child = agent_with_stderr(&args, &format!("echo $$ > {d}/pid; exec sleep 300"));
    let deadline = Instant::now() + BOUND;
    while get(&server.base, "/v1/allocations/s1/tasks/web")["state"] != "running" {
        assert!(Instant::now() < deadline, "web never reported running");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(server);
    // Reported running when started: the shell may write its pid a moment
    // later.
    let pid = loop {
        match std::fs::read_to_string(dir.path().join("pid")) {
            Ok(pid) if pid.ends_with('\n') => break pid.trim().to_owned(),
            _ => {
                assert!(Instant::now() < deadline, "the task never wrote its pid");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    };
    (child, pid, dir)
}

fn signal(child: &std::process::Child, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// SIGTERM while the server is unreachable: the task is stopped at once,
/// the agent tries to report for --shutdown-timeout and exits with the
/// code for "could not reach the server", saying so.
#[test]
fn sigterm_with_the_server_gone_stops_the_task_and_exits_120_after_the_shutdown_timeout() {
    let (agent, pid, _dir) = running_then_server_gone(&["--shutdown-timeout", "1s"]);
    assert!(alive(&pid));
    signal(&agent, "-TERM");
    let (code, stderr) = ended(agent);
    assert_eq!(code, Some(120), "{stderr}");
    assert!(stderr.contains("--shutdown-timeout"), "{stderr}");
    assert!(!alive(&pid), "the task was stopped");
}

/// A second signal exits at once, whatever the shutdown timeout.
#[test]
fn a_second_signal_exits_at_once() {
    let (agent, pid, _dir) = running_then_server_gone(&["--shutdown-timeout", "300s"]);
    signal(&agent, "-TERM");
    // The agent is now trying to report; a second signal ends it.
    let deadline = Instant::now() + BOUND;
    while alive(&pid) {
        assert!(Instant::now() < deadline, "the task was never stopped");
        std::thread::sleep(Duration::from_millis(20));
    }
    signal(&agent, "-INT");
    let (code, stderr) = ended(agent);
    assert_eq!(code, Some(130), "{stderr}");
    assert!(stderr.contains("second signal"), "{stderr}");
}

/// An --alloc the server does not know is a configuration error (125), not
/// "deleted": a supervisor must not read a typo as success.
#[test]
fn an_unknown_allocation_is_an_error_that_names_the_fix() {
    let server = Server::start(&["--in-memory"]);
    let agent = agent_with_stderr(
        &[
            "--server",
            &server.base,
            "--alloc",
            "no-such",
            "--task",
            "web",
        ],
        "true",
    );
    let (code, stderr) = ended(agent);
    assert_eq!(code, Some(125), "{stderr}");
    assert!(stderr.contains("--register"), "{stderr}");
    assert!(stderr.contains("no-such"), "{stderr}");
}

/// A token the server refuses names the flags that give one (exit 125).
#[test]
fn a_refused_token_names_the_flag_to_fix() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens.json");
    std::fs::write(
        &tokens,
        json!({"tokens": [{"name": "agents", "role": "agent",
                           "sha256": "00".repeat(32)}]})
        .to_string(),
    )
    .unwrap();
    let server = Server::start(&["--in-memory", "--token-file", tokens.to_str().unwrap()]);
    let spec = web_only(dir.path());
    let agent = agent_with_stderr(
        &[
            "--server",
            &server.base,
            "--alloc",
            "t1",
            "--task",
            "web",
            "--register",
            spec.to_str().unwrap(),
            "--token",
            "a-wrong-token-of-enough-length-0123456789",
        ],
        "true",
    );
    let (code, stderr) = ended(agent);
    assert_eq!(code, Some(125), "{stderr}");
    assert!(stderr.contains("401"), "{stderr}");
    assert!(stderr.contains("--token"), "{stderr}");
    assert!(
        stderr.contains("process list"),
        "a token on the command line is warned about: {stderr}"
    );
}

/// --ready-timeout bounds the first readiness only: a task that was ready
/// and loses it is reported not ready, never killed for it.
#[test]
fn losing_readiness_after_the_timeout_is_reported_not_killed() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let spec = spec_file(
        dir.path(),
        &json!({"tasks": [{"name": "web", "readiness": true}]}),
    );
    let probe = format!("test -f {d}/ready");
    // Ready for a second, then not, past the timeout; then it ends well.
    let mut web = agent(
        &server.base,
        "l1",
        "web",
        &spec,
        &[
            "--ready-cmd",
            &probe,
            "--ready-interval",
            "50ms",
            "--ready-timeout",
            "1500ms",
            "--restart-attempts",
            "0",
        ],
        &format!("touch {d}/ready; sleep 1; rm {d}/ready; sleep 1; echo done >> {d}/log"),
    );
    let codes = exits(std::slice::from_mut(&mut web));
    assert_eq!(codes, [("web", 0)]);
    assert_eq!(log_lines(dir.path()), ["done"], "it ran to its end");
    let events = task_events(&server.base, "l1", "web");
    assert!(events.contains(&"Ready".to_owned()), "{events:?}");
    assert!(events.contains(&"Not Ready".to_owned()), "{events:?}");
    assert!(
        !events.contains(&"Readiness Timeout".to_owned()),
        "{events:?}"
    );
    let t = get(&server.base, "/v1/allocations/l1/tasks/web");
    assert_eq!(t["failed"], false, "{t}");
}

/// A TCP proxy to `to` that counts the connections it accepts.
struct CountingProxy {
    base: String,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl CountingProxy {
    fn start(to: std::net::SocketAddr) -> Self {
        use std::{
            net::{Shutdown, TcpListener, TcpStream},
            sync::{Arc, atomic::AtomicUsize, atomic::Ordering},
        };
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                count.fetch_add(1, Ordering::SeqCst);
                let Ok(server) = TcpStream::connect(to) else {
                    continue;
                };
                let pipe = |mut from: TcpStream, mut into: TcpStream| {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut into);
                        let _ = into.shutdown(Shutdown::Write);
                    });
                };
                pipe(client.try_clone().unwrap(), server.try_clone().unwrap());
                pipe(server, client);
            }
        });
        Self { base, accepted }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// The readiness probe's answers do not cut the agent's long-poll on its
/// task: while a task runs and its probe answers every 50 ms, the agent
/// opens no new connection to the server.
#[test]
fn readiness_checks_do_not_cut_the_long_poll() {
    let server = Server::start(&["--in-memory"]);
    let proxy = CountingProxy::start(server.addr());
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let spec = web_ready(dir.path());
    let checks = dir.path().join("checks");
    let probe = format!("echo $$ >> {d}/checks");
    let _web = agent(
        &proxy.base,
        "lp1",
        "web",
        &spec,
        &["--ready-cmd", &probe, "--ready-interval", "50ms"],
        "exec sleep 300",
    );
    let deadline = Instant::now() + BOUND;
    while !get(&server.base, "/v1/allocations/lp1/tasks/web")["ready_at"].is_string() {
        assert!(Instant::now() < deadline, "web never reported ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = read_pids(&checks, 1).len();
    let opened = proxy.accepted();
    read_pids(&checks, before + 30);
    let new = proxy.accepted() - opened;
    assert!(
        new <= 1,
        "{new} connections opened during 30 readiness checks of a task that only runs"
    );
}

/// Reads a child's stderr into lines as they come, in a thread.
fn stderr_lines(child: &mut std::process::Child) -> std::sync::Arc<std::sync::Mutex<Vec<String>>> {
    use std::io::BufRead;
    let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let stderr = child.stderr.take().expect("stderr is piped");
    let into = lines.clone();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            into.lock().unwrap().push(line);
        }
    });
    lines
}

/// Waits (bounded) until `lines` satisfy `done`.
#[track_caller]
fn wait_lines(
    lines: &std::sync::Mutex<Vec<String>>,
    what: &str,
    done: impl Fn(&[String]) -> bool,
) -> Vec<String> {
    let deadline = Instant::now() + BOUND;
    loop {
        let now = lines.lock().unwrap().clone();
        if done(&now) {
            return now;
        }
        assert!(Instant::now() < deadline, "never {what}: {now:#?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `retry_in=1.2s` (a Debug-printed duration) in a log line, in ms.
fn retry_in_ms(line: &str) -> Option<f64> {
    let value = line.split("retry_in=").nth(1)?.split_whitespace().next()?;
    let (number, unit) = value.split_at(value.find(|c: char| c.is_alphabetic() || c == 'µ')?);
    let n: f64 = number.parse().ok()?;
    Some(match unit {
        "s" => n * 1000.0,
        "ms" => n,
        "µs" => n / 1000.0,
        "ns" => n / 1_000_000.0,
        _ => return None,
    })
}

/// With the server gone, the agent's retries of its long-poll back off
/// (20 ms doubling) however often the readiness probe answers: the wait
/// between two tries reaches half a second, which a backoff restarted at
/// every 50 ms check never does.
#[test]
fn the_backoff_keeps_growing_while_the_probe_answers() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let spec = web_ready(dir.path());
    let mut child = agent_with_stderr(
        &[
            "--server",
            &server.base,
            "--alloc",
            "bo1",
            "--task",
            "web",
            "--register",
            spec.to_str().unwrap(),
            "--ready-cmd",
            "true",
            "--ready-interval",
            "50ms",
            "--log",
            "info,taskgate=debug",
        ],
        "exec sleep 300",
    );
    let lines = stderr_lines(&mut child);
    let _agent = Agent { child, task: "web" };
    let deadline = Instant::now() + BOUND;
    while !get(&server.base, "/v1/allocations/bo1/tasks/web")["ready_at"].is_string() {
        assert!(Instant::now() < deadline, "web never reported ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(server);
    // The long-poll's retries; or, when a probe check overran its 50 ms on
    // a loaded machine and readiness flipped, the report of it, which
    // then holds the agent (its retries back off the same way).
    wait_lines(&lines, "backed off to 500 ms", |lines| {
        lines
            .iter()
            .filter(|l| {
                (l.contains("tasks/web?index=")
                    || l.contains("PUT /v1/allocations/bo1/tasks/web/state"))
                    && l.contains("retrying")
            })
            .any(|l| retry_in_ms(l).is_some_and(|ms| ms >= 500.0))
    });
}

/// When the server does not answer the agent says, once, what to check;
/// here an https URL given for a plain-HTTP server, which never answers:
/// its retries (debug lines) add no warning.
#[test]
fn repeated_connection_failures_say_once_what_to_check() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let spec = web_only(dir.path());
    let url = server.base.replace("http://", "https://");
    let mut child = agent_with_stderr(
        &[
            "--server",
            &url,
            "--alloc",
            "h1",
            "--task",
            "web",
            "--register",
            spec.to_str().unwrap(),
            "--log",
            "info,taskgate=debug",
        ],
        "true",
    );
    let lines = stderr_lines(&mut child);
    let _agent = Agent { child, task: "web" };
    let is_hint = |l: &String| l.contains("WARN") && l.contains("stopped answering");
    let seen = wait_lines(&lines, "said what to check", |lines| {
        lines.iter().any(is_hint)
    });
    let hint = seen.iter().find(|l| is_hint(l)).unwrap().clone();
    for what in [url.as_str(), "TLS", "http://", "--ca-cert", "running"] {
        assert!(hint.contains(what), "the hint names {what}: {hint}");
    }
    let retries = |lines: &[String]| lines.iter().filter(|l| l.contains("retrying")).count();
    let so_far = retries(&seen);
    let seen = wait_lines(&lines, "retried thrice more", |lines| {
        retries(lines) >= so_far + 3
    });
    assert_eq!(
        seen.iter().filter(|l| l.contains("WARN")).count(),
        1,
        "one warning for the outage: {seen:#?}"
    );
}

/// `--register` with a spec other than the one the allocation was
/// registered with is a configuration error (exit 125) that names what
/// differs.
#[test]
fn registering_a_different_spec_exits_125_naming_the_difference() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let stored = json!({"tasks": [
        {"name": "init", "lifecycle": {"hook": "prestart"}},
        {"name": "web", "leader": true},
        {"name": "gone"}
    ]});
    let url = format!("{}/v1/allocations/x1", server.base);
    assert_eq!(curl_status("PUT", &url, Some(&stored.to_string())), "201");
    let spec = spec_file(
        dir.path(),
        &json!({"tasks": [
            {"name": "init", "lifecycle": {"hook": "prestart", "sidecar": true}},
            {"name": "web", "leader": true},
            {"name": "extra", "lifecycle": {"hook": "poststop"}}
        ]}),
    );
    let child = agent_with_stderr(
        &[
            "--server",
            &server.base,
            "--alloc",
            "x1",
            "--task",
            "web",
            "--register",
            spec.to_str().unwrap(),
        ],
        "true",
    );
    let (code, stderr) = ended(child);
    assert_eq!(code, Some(125), "{stderr}");
    for what in ["x1", "init", "sidecar", "extra", "gone", "spec.json"] {
        assert!(stderr.contains(what), "names {what}: {stderr}");
    }
    let t = get(&server.base, "/v1/allocations/x1/tasks/web");
    assert_eq!(t["state"], "pending", "nothing ran: {t}");
}

/// How many requests the server holds parked (`taskgate_waiters`).
fn parked(base: &str) -> u64 {
    let out = Command::new("curl")
        .args(["-s", &format!("{base}/metrics")])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("taskgate_waiters "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// Waits (bounded) until the server holds `n` requests parked.
#[track_caller]
fn wait_parked(base: &str, n: u64) {
    let deadline = Instant::now() + BOUND;
    while parked(base) < n {
        assert!(Instant::now() < deadline, "{n} requests never parked");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `--server BASE --alloc ALLOC --task web --register SPEC`, then `extra`.
fn web_flags<'a>(
    base: &'a str,
    alloc: &'a str,
    spec: &'a std::path::Path,
    extra: &[&'a str],
) -> Vec<&'a str> {
    task_flags(base, alloc, "web", spec, extra)
}

/// `--server BASE --alloc ALLOC --task TASK --register SPEC`, then `extra`.
fn task_flags<'a>(
    base: &'a str,
    alloc: &'a str,
    task: &'a str,
    spec: &'a std::path::Path,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let spec = spec.to_str().unwrap();
    let mut flags = vec!["--server", base, "--alloc", alloc, "--task", task];
    flags.extend(["--register", spec]);
    flags.extend(extra);
    flags
}

/// An agent stopped while its task waits at a closed gate reports nothing:
/// the task stays `pending`, without an event, and the allocation is not
/// decided by the agent's shutdown (here the leader's: reporting it dead
/// would end the allocation). The agent exits 0 and says so.
#[test]
fn an_agent_stopped_at_a_closed_gate_reports_nothing_and_exits_0() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let spec = spec_file(
        dir.path(),
        &json!({"tasks": [
            {"name": "init", "lifecycle": {"hook": "prestart"}},
            {"name": "web", "leader": true}
        ]}),
    );
    let child = agent_with_stderr(
        &web_flags(&server.base, "g1", &spec, &[]),
        &format!("echo ran >> {d}/log"),
    );
    // The agent's start-condition query is parked: it waits at the gate.
    wait_parked(&server.base, 1);
    signal(&child, "-TERM");
    let (code, stderr) = ended(child);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(
        stderr
            .lines()
            .filter(|l| l.contains("before its task ran"))
            .count(),
        1,
        "one line says it: {stderr}"
    );
    let web = get(&server.base, "/v1/allocations/g1/tasks/web");
    assert_eq!(web["state"], "pending", "{web}");
    assert_eq!(web["events"], json!([]), "nothing reported: {web}");
    let a = get(&server.base, "/v1/allocations/g1");
    assert_eq!(a["coordinator_state"], "prestart", "{a}");
    assert_eq!(a["outcome"], Value::Null, "{a}");
    assert!(log_lines(dir.path()).is_empty(), "the command never ran");
}

/// A request the agent waits on never holds up what it must do at once.
/// With the server stopped (SIGSTOP) while each agent's heartbeat waits for
/// its answer, SIGTERM ends one agent's workload within --kill-timeout, and
/// the other's workload, which exits, is noticed well within the ten
/// seconds its heartbeat may take (a third of the 30 s TTL).
#[test]
fn a_stopped_server_holds_up_neither_sigterm_nor_a_workloads_exit() {
    use common::proxy::Proxy;
    let server = Server::start(&["--in-memory"]);
    let proxy = Proxy::start(server.addr());
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let spec = web_only(dir.path());
    let extra = ["--liveness-ttl", "30s", "--kill-timeout", "5s"];
    let term = agent_with_stderr(
        &web_flags(&proxy.base, "hs-term", &spec, &extra),
        &format!("echo $$ > {d}/pid.tmp; mv {d}/pid.tmp {d}/pid; exec sleep 300"),
    );
    let term = Agent {
        child: term,
        task: "web",
    };
    let mut exit = agent_with_stderr(
        &web_flags(&proxy.base, "hs-exit", &spec, &extra),
        &format!("for i in $(seq 1 6000); do [ -e {d}/finish ] && exit 0; sleep 0.02; done"),
    );
    let exit_lines = stderr_lines(&mut exit);
    let _exit = Agent {
        child: exit,
        task: "web",
    };
    wait_state(&server.base, "hs-term", "web", "running");
    wait_state(&server.base, "hs-exit", "web", "running");
    let pid = read_pids(&dir.path().join("pid"), 1)[0];
    send_signal(server.child.id(), "STOP");
    proxy.watch("/heartbeat");
    // Both first heartbeats (a third of the TTL after the start) are on
    // their way to the stopped server, and wait.
    let deadline = Instant::now() + BOUND;
    while proxy.seen() < 2 {
        assert!(Instant::now() < deadline, "no heartbeats were sent");
        std::thread::sleep(Duration::from_millis(20));
    }
    let signalled = Instant::now();
    send_signal(term.child.id(), "TERM");
    std::fs::write(dir.path().join("finish"), "").unwrap();
    while runs(pid) {
        assert!(
            signalled.elapsed() < Duration::from_secs(5),
            "the workload still runs past --kill-timeout after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let lines = wait_lines(&exit_lines, "noticed the exit", |lines| {
        lines.iter().any(|l| l.contains(" exited"))
    });
    assert!(
        signalled.elapsed() < Duration::from_secs(5),
        "the exit was noticed only after {:?}: {lines:#?}",
        signalled.elapsed()
    );
    send_signal(server.child.id(), "CONT");
}

/// The exit codes `taskgate agent --help` lists are those of the table in
/// docs/agent-protocol.md.
#[test]
fn the_help_lists_the_exit_codes_of_the_documented_table() {
    let out = Command::new(env!("CARGO_BIN_EXE_taskgate"))
        .args(["agent", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/agent-protocol.md"
    ))
    .unwrap();
    let section = doc
        .split("\n## Exit codes")
        .nth(1)
        .expect("the protocol page has an exit code table");
    let table: Vec<&str> = section
        .split("\n## ")
        .next()
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix("| `")?.split('`').next())
        .collect();
    assert!(table.len() >= 8, "{table:?}");
    let listed: Vec<&str> = help
        .split("Exit codes")
        .nth(1)
        .expect("the help has an exit code table")
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .collect();
    assert_eq!(listed, table, "{help}");
}

/// A task stopped by an order of the server (here: its leader finished)
/// ends its agent with the code for "stopped by an order", not with the
/// code its process happened to exit with.
#[test]
fn an_agent_whose_task_is_stopped_by_an_order_exits_122() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let spec = spec_file(
        dir.path(),
        &json!({"tasks": [{"name": "web", "leader": true}, {"name": "side"}]}),
    );
    let side = agent(&server.base, "o1", "side", &spec, &[], "exec sleep 300");
    let web = agent(
        &server.base,
        "o1",
        "web",
        &spec,
        &[],
        &format!("for i in $(seq 1 3000); do [ -e {d}/finish ] && exit 0; sleep 0.02; done"),
    );
    wait_state(&server.base, "o1", "side", "running");
    wait_state(&server.base, "o1", "web", "running");
    std::fs::write(dir.path().join("finish"), "").unwrap();
    let mut agents = [web, side];
    assert_eq!(exits(&mut agents), [("web", 0), ("side", 122)]);
    let side = task_events(&server.base, "o1", "side");
    assert!(
        side.ends_with(&["Killing".to_owned(), "Killed".to_owned()]),
        "{side:?}"
    );
}

/// A command that is not there exits 127, one that is there but cannot be
/// run 126, and the log names it; the task is reported a driver failure.
#[test]
fn a_command_that_cannot_run_is_named_and_exits_127_or_126() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let spec = web_only(dir.path());
    let plain = dir.path().join("not-executable");
    std::fs::write(&plain, "#!/bin/sh\nexit 0\n").unwrap();
    let plain = plain.to_str().unwrap().to_owned();
    for (alloc, program, code) in [
        ("m1", "/nonexistent/program-of-taskgate", 127),
        ("m2", plain.as_str(), 126),
    ] {
        let child = Command::new(env!("CARGO_BIN_EXE_taskgate"))
            .arg("agent")
            .args(web_flags(
                &server.base,
                alloc,
                &spec,
                &["--", program, "arg"],
            ))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (exit, stderr) = ended(child);
        assert_eq!(exit, Some(code), "{program}: {stderr}");
        assert!(
            stderr
                .lines()
                .any(|l| l.contains("ERROR") && l.contains(program)),
            "the log names {program}: {stderr}"
        );
        assert_eq!(
            task_events(&server.base, alloc, "web"),
            ["Driver Failure"],
            "{program}"
        );
    }
}

/// `--token-file` on the command line is warned about as `--token` is: the
/// file's path shows in every user's process list, and a workload of the
/// same user that finds the file may read it.
#[test]
fn a_token_file_named_on_the_command_line_is_warned_about() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let spec = web_only(dir.path());
    let token = dir.path().join("token");
    std::fs::write(&token, "a-token-of-enough-length-0123456789\n").unwrap();
    let token = token.to_str().unwrap();
    let child = agent_with_stderr(
        &web_flags(&server.base, "tf1", &spec, &["--token-file", token]),
        "true",
    );
    let (code, stderr) = ended(child);
    assert_eq!(code, Some(0), "{stderr}");
    let warning = stderr
        .lines()
        .find(|l| l.contains("WARN") && l.contains("--token-file"))
        .unwrap_or_else(|| panic!("no warning about --token-file: {stderr}"));
    for what in ["process list", "TASKGATE_TOKEN_FILE"] {
        assert!(warning.contains(what), "names {what}: {warning}");
    }
}

/// An outage is one warning when the server stops answering, with what to
/// check, and one line when it answers again (here to a heartbeat, a third
/// of the TTL after the last): not a line per retry.
#[test]
fn an_outage_is_one_warning_and_one_line_when_it_ends() {
    use common::proxy::Proxy;
    let server = Server::start(&["--in-memory"]);
    let proxy = Proxy::start(server.addr());
    let dir = tempfile::tempdir().unwrap();
    let spec = web_only(dir.path());
    let extra = ["--liveness-ttl", "10s", "--log", "info,taskgate=debug"];
    let mut child = Command::new(env!("CARGO_BIN_EXE_taskgate"))
        .arg("agent")
        .args(web_flags(&proxy.base, "o2", &spec, &extra))
        .args(["--", "sleep", "300"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = stderr_lines(&mut child);
    let _agent = Agent { child, task: "web" };
    wait_state(&server.base, "o2", "web", "running");
    proxy.cut();
    let retries = |lines: &[String]| lines.iter().filter(|l| l.contains("retrying")).count();
    wait_lines(&lines, "retried six times", |lines| retries(lines) >= 6);
    proxy.heal();
    let is_back = |l: &String| l.contains("INFO") && l.contains("answers again");
    let seen = wait_lines(&lines, "said the server is back", |lines| {
        lines.iter().any(is_back)
    });
    let warnings: Vec<&String> = seen.iter().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warnings.len(), 1, "one warning for the outage: {seen:#?}");
    for what in [proxy.base.as_str(), "running", "--ca-cert"] {
        assert!(warnings[0].contains(what), "names {what}: {}", warnings[0]);
    }
    assert_eq!(seen.iter().filter(|l| is_back(l)).count(), 1, "{seen:#?}");
}

/// An agent that never reached the server, told to stop, has nothing to
/// stop and nothing to report: it exits 0 at once, saying so, instead of
/// trying to report for --shutdown-timeout.
#[test]
fn an_agent_that_never_reached_the_server_stops_at_once_and_exits_0() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = agent_with_stderr(
        &[
            "--server",
            &format!("http://127.0.0.1:{port}"),
            "--alloc",
            "n1",
            "--task",
            "web",
            "--shutdown-timeout",
            "30s",
        ],
        "true",
    );
    let lines = stderr_lines(&mut child);
    let mut agent = Agent { child, task: "web" };
    wait_lines(&lines, "tried the server", |lines| {
        lines.iter().any(|l| l.contains("stopped answering"))
    });
    let signalled = Instant::now();
    signal(&agent.child, "-TERM");
    let deadline = signalled + BOUND;
    let status = loop {
        if let Some(status) = agent.child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the agent did not exit");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        signalled.elapsed() < Duration::from_secs(10),
        "it waited {:?}, as if for --shutdown-timeout",
        signalled.elapsed()
    );
    let said = wait_lines(&lines, "said why", |lines| {
        lines.iter().any(|l| l.contains("before its task ran"))
    });
    assert_eq!(status.code(), Some(0), "{said:#?}");
}

/// `agent` with the agent's stderr kept, line by line.
fn agent_logged(
    base: &str,
    alloc: &str,
    task: &'static str,
    spec: &std::path::Path,
    cmd: &str,
) -> (Agent, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    let mut child = agent_with_stderr(
        &task_flags(base, alloc, task, spec, &["--kill-timeout", "2s"]),
        cmd,
    );
    let lines = stderr_lines(&mut child);
    (Agent { child, task }, lines)
}

/// A command that appends its pid to `dir/runs`, then waits (bounded) for
/// `dir/finish`.
fn counted_run(dir: &std::path::Path) -> String {
    let d = dir.display();
    format!(
        "echo $$ >> {d}/runs; for i in $(seq 1 600); do [ -f {d}/finish ] && break; \
         sleep 0.05; done"
    )
}

/// Runs: a second agent for a task another agent runs starts no second
/// copy. It says it waits, and once the first run has ended (the task is
/// dead) it runs nothing, waits for the allocation's end and exits 122.
#[test]
fn a_second_agent_for_a_running_task_waits_and_never_starts_a_copy() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let spec = web_only(dir.path());
    let (first, _) = agent_logged(&server.base, "r1", "web", &spec, &counted_run(dir.path()));
    read_pids(&dir.path().join("runs"), 1);
    let (second, lines) = agent_logged(&server.base, "r1", "web", &spec, &counted_run(dir.path()));
    wait_lines(&lines, "the second agent waiting", |l| {
        l.iter().any(|l| l.contains("another agent runs the task"))
    });
    std::fs::write(dir.path().join("finish"), "").unwrap();
    let mut agents = [first, second];
    let codes = exits(&mut agents);
    assert_eq!(codes, [("web", 0), ("web", 122)]);
    let runs = std::fs::read_to_string(dir.path().join("runs")).unwrap();
    assert_eq!(runs.lines().count(), 1, "one run only: {runs}");
    let a = get(&server.base, "/v1/allocations/r1");
    assert_eq!(a["outcome"], "succeeded", "{a}");
    let seen = lines.lock().unwrap().join("\n");
    assert!(
        seen.contains("task_dead") || seen.contains("is dead"),
        "{seen}"
    );
}

/// Runs: an agent restarted after its prestart task finished does not
/// revive it (the third edition's agent reported `pending` and the
/// allocation stuck in `prestart` for good): it runs nothing, the
/// allocation goes on to its end, and the agent exits 122 there.
#[test]
fn a_restarted_agent_does_not_revive_a_finished_prestart_task() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let spec = spec_file(
        dir.path(),
        &json!({"tasks": [
            {"name": "init", "lifecycle": {"hook": "prestart"}},
            {"name": "web"}
        ]}),
    );
    let init_cmd = format!("echo init >> {d}/log");
    let mut init = agent(&server.base, "r2", "init", &spec, &[], &init_cmd);
    let web = agent(
        &server.base,
        "r2",
        "web",
        &spec,
        &[],
        &counted_run(dir.path()),
    );
    read_pids(&dir.path().join("runs"), 1);
    wait_state(&server.base, "r2", "init", "dead");
    // The init agent again, as after a reboot: the first one (waiting for
    // the allocation's end) dies without a word.
    init.child.kill().unwrap();
    init.child.wait().unwrap();
    let (again, lines) = agent_logged(&server.base, "r2", "init", &spec, &init_cmd);
    wait_lines(&lines, "the agent finding its task dead", |l| {
        l.iter().any(|l| l.contains("not running the task"))
    });
    let a = get(&server.base, "/v1/allocations/r2");
    assert_eq!(a["coordinator_state"], "wait_alloc", "{a:#}");
    assert_eq!(a["tasks"][0]["state"], "dead", "init stays dead: {a:#}");
    std::fs::write(dir.path().join("finish"), "").unwrap();
    let mut agents = [web, again];
    assert_eq!(exits(&mut agents), [("web", 0), ("init", 122)]);
    assert_eq!(log_lines(dir.path()), ["init"], "init ran once");
    let a = get(&server.base, "/v1/allocations/r2");
    assert_eq!(a["outcome"], "succeeded", "{a}");
}

/// Runs: an agent whose run an operator replaced (a restore that made
/// the task `pending`) stops its process, reports nothing more (the task
/// stays as the operator left it) and exits 122.
#[test]
fn an_agent_whose_run_was_replaced_stops_its_process_and_exits_122() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let spec = web_only(dir.path());
    let (web, lines) = agent_logged(&server.base, "r3", "web", &spec, &counted_run(dir.path()));
    let pid = read_pids(&dir.path().join("runs"), 1)[0];
    let run = wait_state(&server.base, "r3", "web", "running")["run"].clone();
    assert!(run.is_string(), "{run}");
    let out = Command::new("curl")
        .args([
            "-s",
            "-X",
            "POST",
            "-H",
            "content-type: application/json",
            "-d",
            r#"{"tasks": {"web": {"state": "pending"}}}"#,
            &format!("{}/v1/allocations/r3/restore", server.base),
        ])
        .output()
        .unwrap();
    let restored: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(restored["tasks"][0]["run"], Value::Null, "{restored}");
    let mut agents = [web];
    assert_eq!(exits(&mut agents), [("web", 122)]);
    wait_gone(pid, "the replaced run's process");
    let t = get(&server.base, "/v1/allocations/r3/tasks/web");
    assert_eq!(t["state"], "pending", "nothing reported after: {t}");
    let seen = lines.lock().unwrap().join("\n");
    assert!(seen.contains("no longer has this agent's run"), "{seen}");
}

/// Runs: an agent cut off (frozen, SIGSTOP) while its allocation was
/// deleted and registered again under the same ID does not adopt the new
/// one: once it runs again it stops its old workload and exits (123
/// deleted, or 122 if it first hears of its run being superseded), and
/// the new allocation's task is left as it was: pending, with no run.
#[test]
fn an_agent_cut_off_across_a_new_registration_stops_its_old_workload() {
    let server = Server::start(&["--in-memory"]);
    let dir = tempfile::tempdir().unwrap();
    let spec = web_only(dir.path());
    let (mut web, _lines) =
        agent_logged(&server.base, "r4", "web", &spec, &counted_run(dir.path()));
    let pid = read_pids(&dir.path().join("runs"), 1)[0];
    wait_state(&server.base, "r4", "web", "running");
    signal(&web.child, "-STOP");
    let url = format!("{}/v1/allocations/r4", server.base);
    assert_eq!(curl_status("DELETE", &url, None), "204");
    let spec_body = std::fs::read_to_string(&spec).unwrap();
    assert_eq!(curl_status("PUT", &url, Some(&spec_body)), "201");
    signal(&web.child, "-CONT");
    let code = exits(std::slice::from_mut(&mut web))[0].1;
    assert!(code == 123 || code == 122, "exit {code}");
    wait_gone(pid, "the old registration's workload");
    let t = get(&server.base, "/v1/allocations/r4/tasks/web");
    assert_eq!(t["state"], "pending", "the new task is untouched: {t}");
    assert_eq!(t["run"], Value::Null, "{t}");
    let runs = std::fs::read_to_string(dir.path().join("runs")).unwrap();
    assert_eq!(runs.lines().count(), 1, "no second start: {runs}");
}
