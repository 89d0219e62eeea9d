//! `taskgate alloc`, `taskgate semaphore` and `taskgate barrier` against
//! a real server: their human output, their `--json`, their exit codes,
//! `events --follow` across a late registration and a server restart, a
//! semaphore's holders and queue and a barrier's members as `semaphore
//! status`, `barrier status` and `alloc status` show them; and every
//! command's help.

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

/// GET requests the server counted on `route` (its metrics).
fn gets_on(base: &str, route: &str) -> u64 {
    let out = Command::new("curl")
        .args(["-s", "-f", &format!("{base}/metrics")])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let label = format!("method=\"GET\",route=\"{route}\",");
    text.lines()
        .filter(|l| l.starts_with("taskgate_http_request_duration_seconds_count{"))
        .filter(|l| l.contains(&label))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum()
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

/// A failed allocation is shown failed: in the list's trouble column,
/// under `--state failed` and not `--state running` once it ended, and
/// with what to do in `status`.
#[test]
fn the_list_shows_a_failed_allocation_as_failed_and_filters_by_state() {
    let server = seeded();
    send(
        &server.base,
        "PUT",
        "/v1/allocations/bad-1",
        common::five_tasks(),
    );
    // init fails: every other task is told to stop; they end, poststop
    // runs and ends.
    send(
        &server.base,
        "POST",
        "/v1/allocations/bad-1/task-states",
        json!({"tasks": {"init": {"state": "dead", "failed": true}, "proxy": {"state": "dead"},
            "web": {"state": "dead"}, "announce": {"state": "dead"}}}),
    );
    send(
        &server.base,
        "PUT",
        "/v1/allocations/bad-1/tasks/cleanup/state",
        json!({"state": "dead"}),
    );
    let out = text(&alloc(&server.base, &["list"]));
    let line = |id: &str| {
        out.lines()
            .find(|l| l.starts_with(id))
            .unwrap_or_else(|| panic!("{id} in {out}"))
            .to_owned()
    };
    assert!(out.lines().next().unwrap().contains("Trouble"), "{out}");
    let cells = |id: &str| -> Vec<String> {
        let line = line(id);
        line.split_whitespace().take(3).map(str::to_owned).collect()
    };
    assert_eq!(cells("bad-1"), ["bad-1", "finished", "failed"], "{out}");
    assert_eq!(cells("web-42"), ["web-42", "main", "-"], "{out}");
    assert!(out.lines().all(|l| l.chars().count() <= 80), "{out}");
    let only = |state: &str| -> Vec<String> {
        let o = alloc(&server.base, &["list", "--state", state]);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        text(&o)
            .lines()
            .skip(1)
            .map(|l| l.split(' ').next().unwrap().to_owned())
            .collect()
    };
    assert_eq!(only("failed"), ["bad-1"]);
    assert_eq!(only("finished"), ["bad-1"]);
    assert_eq!(only("running"), ["web-42"]);
    assert_eq!(only("lost,blocked"), Vec::<String>::new());
    assert_eq!(only("failed,running"), ["bad-1", "web-42"]);
    let o = alloc(&server.base, &["list", "--state", "broken"]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "an unknown state is a usage error"
    );
    let out = text(&alloc(&server.base, &["status", "bad-1"]));
    assert!(out.contains("Trouble   failed: init ended failed"), "{out}");
    assert!(out.contains("→ Read the task's events"), "{out}");
    // Its commands name this allocation, ready to paste.
    assert!(out.contains("`taskgate alloc status bad-1`"), "{out}");
    assert!(
        out.contains("delete the allocation and register it anew"),
        "{out}"
    );
    assert!(out.lines().all(|l| l.chars().count() <= 80), "{out}");
    assert!(!text(&alloc(&server.base, &["status", "web-42"])).contains("Trouble"));
    let j: Value = serde_json::from_slice(
        &alloc(&server.base, &["list", "--json", "--state", "failed"]).stdout,
    )
    .unwrap();
    assert_eq!(j[0]["trouble"][0]["kind"], "failed");
    assert_eq!(j[0]["trouble"][0]["tasks"], json!(["init"]));
    assert_eq!(j[0]["finished"], true);
}

/// The longest ID and task name an allocation may have (128 characters
/// each) keep `list` and `status` within 80 columns, their Trouble lines
/// included.
#[test]
fn list_and_status_keep_to_80_columns_with_the_longest_names() {
    let server = Server::start(&["--in-memory"]);
    let (id, task) = ("a".repeat(128), "t".repeat(128));
    let path = format!("/v1/allocations/{id}");
    send(
        &server.base,
        "PUT",
        &path,
        json!({"tasks": [{"name": task}, {"name": "web"}]}),
    );
    send(
        &server.base,
        "POST",
        &format!("{path}/task-states"),
        json!({"tasks": {task.as_str(): {"state": "dead", "failed": true}}}),
    );
    for args in [vec!["list"], vec!["status", id.as_str()]] {
        let o = alloc(&server.base, &args);
        assert_eq!(o.status.code(), Some(0), "{args:?}");
        let out = text(&o);
        assert!(out.contains("failed"), "{args:?}: {out}");
        let wide: Vec<&str> = out.lines().filter(|l| l.chars().count() > 80).collect();
        assert!(wide.is_empty(), "{args:?}: wider than 80: {wide:#?}");
    }
}

/// `alloc list` reads the listing and nothing else: one request per
/// page, not one per allocation.
#[test]
fn list_reads_one_listing_not_each_allocation() {
    let server = seeded();
    for id in ["web-43", "web-44"] {
        send(
            &server.base,
            "PUT",
            &format!("/v1/allocations/{id}"),
            common::five_tasks(),
        );
    }
    let o = alloc(&server.base, &["list"]);
    assert_eq!(o.status.code(), Some(0));
    let out = text(&o);
    assert_eq!(out.lines().count(), 4, "{out}");
    assert!(out.contains("web-44"), "{out}");
    assert!(
        out.lines().any(|l| l.starts_with("web-43")
            && l.contains("5 pending")
            && l.ends_with("init, proxy")),
        "{out}"
    );
    assert_eq!(gets_on(&server.base, "/v1/allocations"), 1);
    assert_eq!(gets_on(&server.base, "/v1/allocations/{alloc_id}"), 0);
    let j: Value =
        serde_json::from_slice(&alloc(&server.base, &["list", "--json"]).stdout).unwrap();
    assert_eq!(j[0]["id"], "web-42");
    assert_eq!(
        j[0]["task_states"],
        json!({"pending": 3, "running": 1, "dead": 1})
    );
}

/// Every argument of every command (and subcommand) has a help line, and
/// `serve`'s flags are grouped under headings.
#[test]
fn every_argument_has_help_and_serve_is_grouped() {
    use clap::CommandFactory;
    fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
        for arg in cmd.get_arguments() {
            let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
            if help.trim().is_empty() || help.contains('\n') {
                missing.push(format!("{path} {}", arg.get_id()));
            }
        }
        for sub in cmd.get_subcommands() {
            walk(sub, &format!("{path} {}", sub.get_name()), missing);
        }
    }
    let mut cli = taskgate::cli::Cli::command();
    cli.build();
    let mut missing = Vec::new();
    walk(&cli, "taskgate", &mut missing);
    assert!(missing.is_empty(), "no one-line help: {missing:#?}");

    let serve = cli.find_subcommand("serve").unwrap();
    let headings = [
        "Listening",
        "Storage",
        "Replicas (--store etcd)",
        "Security",
        "Limits",
        "Time",
        "Logging",
    ];
    for arg in serve.get_arguments() {
        if ["help", "version"].contains(&arg.get_id().as_str()) {
            continue;
        }
        let heading = arg.get_help_heading();
        assert!(
            heading.is_some_and(|h| headings.contains(&h)),
            "serve --{}: heading {heading:?}",
            arg.get_id()
        );
    }
    let help = String::from_utf8(
        Command::new(env!("CARGO_BIN_EXE_taskgate"))
            .args(["serve", "--help"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    for h in headings {
        assert!(help.contains(&format!("{h}:")), "{h} in:\n{help}");
    }
}

/// A line of a child's output stream, read on a thread of its own so the
/// test waits for it with a bound.
fn lines_of(r: impl std::io::Read + Send + 'static) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(r).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Waits (bounded) for a line containing `what`; returns it.
#[track_caller]
fn expect_line(rx: &std::sync::mpsc::Receiver<String>, what: &str) -> String {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let left = until.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains(what) => return line,
            Ok(_) => {}
            Err(e) => panic!("no line with {what:?}: {e}"),
        }
    }
}

/// `events --follow` on an allocation not registered yet waits for it,
/// and follows it across a restart of the server (on the same data
/// directory and port), saying once on stderr each time it waits.
#[test]
fn events_follow_waits_for_the_allocation_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap().to_owned();
    let server = Server::start(&["--data-dir", &data]);
    let base = server.base.clone();
    let addr = server.addr().to_string();
    let mut follower = Command::new(env!("CARGO_BIN_EXE_taskgate"))
        .args(["alloc", "--server", &base, "events", "late-1", "--follow"])
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = lines_of(follower.stdout.take().unwrap());
    let err = lines_of(follower.stderr.take().unwrap());
    expect_line(&err, "late-1 is not registered yet; waiting for it");
    send(&base, "PUT", "/v1/allocations/late-1", common::five_tasks());
    expect_line(&out, "Registered");

    let (exit, _) = server.stop();
    assert!(exit.success());
    expect_line(&err, "retrying until it answers");
    let server = Server::start(&["--data-dir", &data, "--listen", &addr]);
    send(
        &server.base,
        "PUT",
        "/v1/allocations/late-1/tasks/init/state",
        json!({"state": "running"}),
    );
    expect_line(&out, "Task State running");
    // Still following: nothing made it exit.
    assert!(follower.try_wait().unwrap().is_none());
    follower.kill().unwrap();
    follower.wait().unwrap();
    // Each wait was said once, not once per try.
    drop(server);
    let said: Vec<String> = err.try_iter().collect();
    assert!(
        said.iter().all(|l| !l.contains("not registered yet")),
        "said once: {said:#?}"
    );
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

/// Store flags that contradict each other stop `serve` before it starts,
/// with exit 2, naming both (`--in-memory --store etcd` used to start in
/// memory without a word), whether given as flags or variables.
#[test]
fn conflicting_store_flags_exit_2_naming_both() {
    let serve = |args: &[&str], env: &[(&str, &str)]| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_taskgate"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(args)
            .env_remove("TASKGATE_IN_MEMORY")
            .env_remove("TASKGATE_STORE")
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("taskgate serve runs");
        // One that started serving instead would never exit: ended after
        // a while, and the test fails on its exit status.
        let pid = child.id();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let guard = std::thread::spawn(move || {
            if rx.recv_timeout(std::time::Duration::from_secs(30)).is_err() {
                let _ = Command::new("kill").arg(pid.to_string()).status();
            }
        });
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        let status = child.wait().unwrap();
        let _ = tx.send(());
        guard.join().unwrap();
        (status, err)
    };
    for (args, env, names) in [
        (
            &["--in-memory", "--store", "etcd"][..],
            &[][..],
            ["--in-memory", "--store"],
        ),
        (
            &["--in-memory"],
            &[("TASKGATE_STORE", "etcd")],
            ["--in-memory", "--store"],
        ),
        (
            &["--in-memory", "--etcd-endpoints", "http://127.0.0.1:1"],
            &[],
            ["--in-memory", "--etcd-endpoints"],
        ),
    ] {
        let (status, err) = serve(args, env);
        assert_eq!(status.code(), Some(2), "{args:?} {env:?}: {err}");
        for name in names {
            assert!(err.contains(name), "{args:?}: names {name}: {err}");
        }
    }
}

// ------------------------------------------------------------ semaphores

fn semaphore(base: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_taskgate"))
        .args(["semaphore", "--server", base])
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .expect("taskgate semaphore runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Many requests through one curl (one connection): `(method, path, body)`.
fn send_many(base: &str, requests: &[(&str, String, Value)]) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("requests");
    let blocks: Vec<String> = requests
        .iter()
        .map(|(method, path, body)| {
            let body = body.to_string().replace('\\', "\\\\").replace('"', "\\\"");
            format!(
                "url = \"{base}{path}\"\nrequest = \"{method}\"\n\
                 header = \"content-type: application/json\"\ndata = \"{body}\"\n\
                 output = \"/dev/null\"\nwrite-out = \"%{{http_code}}\\n\"\n"
            )
        })
        .collect();
    let text = blocks.join("next\n");
    std::fs::write(&config, text).unwrap();
    let out = Command::new("curl")
        .args(["-s", "-K"])
        .arg(&config)
        .output()
        .unwrap();
    let codes = String::from_utf8_lossy(&out.stdout).into_owned();
    let answered: Vec<&str> = codes.lines().collect();
    assert_eq!(answered.len(), requests.len(), "{codes}");
    assert!(answered.iter().all(|c| c.starts_with('2')), "{codes}");
}

/// An allocation whose prestart task `migrate` acquires `names`.
fn acquiring(id: &str, names: &[&str]) -> (&'static str, String, Value) {
    (
        "PUT",
        format!("/v1/allocations/{id}"),
        json!({"tasks": [
            {"name": "migrate", "lifecycle": {"hook": "prestart"}, "acquire": names},
            {"name": "web"}
        ]}),
    )
}

/// Waits (bounded, each wait a blocking query) until `id`'s `migrate`
/// holds its semaphores.
fn granted(base: &str, id: &str) -> Value {
    for _ in 0..10 {
        let out = Command::new("curl")
            .args(["-s", "-f"])
            .arg(format!(
                "{base}/v1/allocations/{id}/tasks/migrate/start-condition?wait=10s"
            ))
            .output()
            .unwrap();
        let answer: Value = serde_json::from_slice(&out.stdout).unwrap();
        if answer["allowed"] == true {
            return answer;
        }
    }
    panic!("{id} was never granted");
}

#[test]
fn semaphore_set_says_whether_it_created_or_changed_and_keeps_the_grant_timeout() {
    let server = Server::start(&["--in-memory"]);
    let base = server.base.as_str();
    let o = semaphore(base, &["set", "db", "--limit", "1"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(
        text(&o),
        "db: created: limit 1, grant timeout 1m; 0 held, 0 queued\n"
    );
    let o = semaphore(
        base,
        &["set", "db", "--limit", "1", "--grant-timeout", "5m"],
    );
    assert_eq!(
        text(&o),
        "db: changed: limit 1, grant timeout 1m → 5m; 0 held, 0 queued\n"
    );
    // The limit alone: the grant timeout stays as it was set.
    let o = semaphore(base, &["set", "db", "--limit", "2"]);
    assert_eq!(
        text(&o),
        "db: changed: limit 1 → 2, grant timeout 5m; 0 held, 0 queued\n"
    );
    let o = semaphore(base, &["set", "db", "--limit", "2"]);
    assert_eq!(
        text(&o),
        "db: unchanged: limit 2, grant timeout 5m; 0 held, 0 queued\n"
    );
    // Out of range: the server's refusal, naming the field.
    let o = semaphore(base, &["set", "db", "--limit", "0"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("400 invalid_request"), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("limit: must be 1 to 10000, got 0"),
        "{}",
        stderr(&o)
    );
    let o = semaphore(
        base,
        &["set", "db", "--limit", "2", "--grant-timeout", "2d"],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("grant_timeout: "), "{}", stderr(&o));
    // Not a number, or no limit: usage.
    assert_eq!(
        semaphore(base, &["set", "db", "--limit", "two"])
            .status
            .code(),
        Some(2)
    );
    assert_eq!(semaphore(base, &["set", "db"]).status.code(), Some(2));
    let j: Value =
        serde_json::from_slice(&semaphore(base, &["set", "db", "--limit", "3", "--json"]).stdout)
            .unwrap();
    assert_eq!(j["limit"], 3);
    assert_eq!(j["grant_timeout"], "5m");
}

#[test]
fn semaphore_status_list_and_alloc_status_show_holders_and_the_queue_in_order() {
    let server = Server::start(&["--in-memory"]);
    let base = server.base.as_str();
    assert_eq!(
        semaphore(base, &["set", "db", "--limit", "1"])
            .status
            .code(),
        Some(0)
    );
    send_many(
        base,
        &[
            acquiring("app-1", &["db"]),
            acquiring("app-2", &["db"]),
            acquiring("app-3", &["db"]),
        ],
    );
    let fence = granted(base, "app-1")["grants"][0]["fence"]
        .as_u64()
        .unwrap();

    let o = semaphore(base, &["status", "db"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = text(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "Name           db", "{out}");
    assert_eq!(lines[1], "Limit          1: 1 held, 2 queued", "{out}");
    assert_eq!(lines[2], "Grant timeout  1m", "{out}");
    assert!(lines[3].starts_with("Next fence     at least "), "{out}");
    let row = |first: &str| -> Vec<String> {
        out.lines()
            .find(|l| l.split_whitespace().next() == Some(first))
            .unwrap_or_else(|| panic!("a row of {first} in {out}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    // Granted, not started: no run yet.
    let holder = row("app-1");
    assert_eq!(holder[..4], ["app-1", "migrate", "-", &fence.to_string()]);
    assert_eq!(row("1")[..3], ["1", "app-2", "migrate"], "{out}");
    assert_eq!(row("2")[..3], ["2", "app-3", "migrate"], "{out}");
    assert!(
        out.find("app-2").unwrap() < out.find("app-3").unwrap(),
        "{out}"
    );
    assert!(out.lines().all(|l| l.chars().count() <= 80), "{out}");
    let j: Value =
        serde_json::from_slice(&semaphore(base, &["status", "db", "--json"]).stdout).unwrap();
    assert_eq!(j["holders"][0]["allocation"], "app-1");
    assert_eq!(j["queue"][1]["allocation"], "app-3");

    let out = text(&semaphore(base, &["list"]));
    let lines: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        lines,
        [
            vec!["Name", "Limit", "Held", "Queued", "Grant", "timeout"],
            vec!["db", "1", "1", "2", "1m"]
        ],
        "{out}"
    );

    // Each allocation's status says how its task stands.
    let standing = |id: &str| -> String {
        let out = text(&alloc(base, &["status", id]));
        let at = out
            .find("\nSemaphores\n")
            .unwrap_or_else(|| panic!("{out}"));
        out[at..].lines().nth(2).unwrap().to_owned()
    };
    assert_eq!(
        standing("app-1"),
        format!("migrate   db                    held, fence {fence}")
    );
    assert_eq!(
        standing("app-2"),
        "migrate   db                    queued, position 1"
    );
    assert_eq!(
        standing("app-3"),
        "migrate   db                    queued, position 2"
    );
    // The semaphore is not repeated under "Blocked by".
    assert!(!text(&alloc(base, &["status", "app-3"])).contains("Blocked by"));

    // The holder ends: the next in line holds it, with a higher fence.
    send(
        base,
        "PUT",
        "/v1/allocations/app-1/tasks/migrate/state",
        json!({"state": "dead"}),
    );
    let next = granted(base, "app-2")["grants"][0]["fence"]
        .as_u64()
        .unwrap();
    assert!(next > fence);
    let out = text(&semaphore(base, &["status", "db"]));
    assert!(out.contains("Limit          1: 1 held, 1 queued"), "{out}");
    assert!(out.contains("\n1  app-3 "), "{out}");
}

#[test]
fn a_missing_semaphore_is_named_and_delete_says_what_becomes_of_its_tasks() {
    let server = Server::start(&["--in-memory"]);
    let base = server.base.as_str();
    for args in [&["status", "nope"][..], &["delete", "nope"]] {
        let o = semaphore(base, args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let err = stderr(&o);
        assert!(
            err.contains("404 semaphore_not_found: semaphore \"nope\" not found"),
            "{err}"
        );
        assert!(err.contains("/errors#semaphore_not_found"), "{err}");
        assert!(
            err.contains("`taskgate semaphore list` shows the semaphores there are"),
            "{err}"
        );
    }
    assert_eq!(text(&semaphore(base, &["list"])), "no semaphores\n");

    // A task acquiring a semaphore nobody created waits for it, visibly.
    send_many(base, &[acquiring("app-1", &["later"])]);
    let out = text(&alloc(base, &["status", "app-1"]));
    assert!(
        out.contains(
            "\nSemaphores\nmigrate   later                 \
             not registered (`semaphore set` creates it)\n"
        ),
        "{out}"
    );
    semaphore(base, &["set", "later", "--limit", "1"]);
    granted(base, "app-1");
    send_many(base, &[acquiring("app-2", &["later"])]);
    let o = semaphore(base, &["delete", "later"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(
        text(&o),
        "later: deleted; its 1 holder keeps its slot until it ends; \
         the 1 task waiting for it waits until it is created again\n"
    );
    assert_eq!(text(&semaphore(base, &["list"])), "no semaphores\n");
    let o = semaphore(base, &["delete", "later"]);
    assert_eq!(o.status.code(), Some(1), "deleted already");
    assert!(stderr(&o).contains("semaphore_not_found"), "{}", stderr(&o));
    // Unreachable: 3.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let o = semaphore(&format!("http://127.0.0.1:{port}"), &["list"]);
    assert_eq!(o.status.code(), Some(3));
    assert!(
        stderr(&o).contains("cannot reach the server"),
        "{}",
        stderr(&o)
    );
}

/// `list` pages through every semaphore (1,001: two pages of the
/// listing), and `status` of a long queue shows its first 20.
#[test]
fn semaphore_list_pages_through_all_and_status_bounds_a_long_queue() {
    let server = Server::start(&["--in-memory"]);
    let base = server.base.as_str();
    let made: Vec<(&str, String, Value)> = (0..=1000)
        .map(|i| {
            (
                "PUT",
                format!("/v1/semaphores/s-{i:04}"),
                json!({"limit": 1}),
            )
        })
        .collect();
    send_many(base, &made);
    let o = semaphore(base, &["list"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = text(&o);
    assert_eq!(out.lines().count(), 1002, "a header and 1,001 lines");
    assert!(out.lines().last().unwrap().starts_with("s-1000 "), "{out}");
    assert_eq!(gets_on(base, "/v1/semaphores"), 2);
    let out = text(&semaphore(base, &["list", "--prefix", "s-100"]));
    assert_eq!(out.lines().count(), 2, "{out}");

    let queue: Vec<(&str, String, Value)> = (1..=25)
        .map(|i| {
            let (m, p, b) = acquiring(&format!("q-{i:02}"), &["s-0000"]);
            (m, p, b)
        })
        .collect();
    send_many(base, &queue);
    granted(base, "q-01");
    let out = text(&semaphore(base, &["status", "s-0000"]));
    assert!(out.contains("Limit          1: 1 held, 24 queued"), "{out}");
    assert!(out.contains("\n20  q-21 "), "{out}");
    assert!(!out.contains("q-22"), "{out}");
    assert!(
        out.ends_with("… and 4 more in line (--json lists every one)\n"),
        "{out}"
    );
    let j: Value =
        serde_json::from_slice(&semaphore(base, &["status", "s-0000", "--json"]).stdout).unwrap();
    assert_eq!(j["queue"].as_array().unwrap().len(), 24);
}

// -------------------------------------------------------------- barriers

fn barrier(base: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_taskgate"))
        .args(["barrier", "--server", base])
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .expect("taskgate barrier runs")
}

/// An allocation whose main task `worker` is at barrier `name` (with a
/// prestart sidecar `side`: the worker arrives once `side` runs).
fn gathering_at(id: &str, name: &str, size: u16, timeout: &str) -> (&'static str, String, Value) {
    (
        "PUT",
        format!("/v1/allocations/{id}"),
        json!({"tasks": [
            {"name": "side", "lifecycle": {"hook": "prestart", "sidecar": true}},
            {"name": "worker", "barrier": {"name": name, "size": size, "timeout": timeout}}
        ]}),
    )
}

/// `id`'s sidecar runs: its worker arrives at its barrier.
fn arrive(base: &str, id: &str) {
    send(
        base,
        "PUT",
        &format!("/v1/allocations/{id}/tasks/side/state"),
        json!({"state": "running"}),
    );
}

/// Waits (bounded, each wait a blocking query) until barrier `name` is
/// in `state` with `arrived` arrived; the barrier. `curl`: more of its
/// arguments (a token's header).
fn barrier_until(base: &str, name: &str, state: &str, arrived: u64, curl: &[&str]) -> Value {
    let mut index = 0;
    for _ in 0..10 {
        let out = Command::new("curl")
            .args(["-s", "-f"])
            .args(curl)
            .arg(format!("{base}/v1/barriers/{name}?index={index}&wait=10s"))
            .output()
            .unwrap();
        let b: Value = serde_json::from_slice(&out.stdout).unwrap();
        if b["state"] == state && b["arrived"] == arrived {
            return b;
        }
        index = b["modify_index"].as_u64().unwrap();
    }
    panic!("barrier {name} never came to {state} with {arrived} arrived");
}

/// The line under "Barriers" in `alloc status ID` (of its one task at a
/// barrier).
fn barrier_line(base: &str, id: &str, extra: &[&str]) -> String {
    let mut args = vec!["status", id];
    args.extend_from_slice(extra);
    let out = text(&alloc(base, &args));
    let at = out.find("\nBarriers\n").unwrap_or_else(|| panic!("{out}"));
    out[at..].lines().nth(2).unwrap().to_owned()
}

#[test]
fn barrier_status_and_alloc_status_show_members_gathering_then_released() {
    let server = Server::start(&["--in-memory"]);
    let base = server.base.as_str();
    send_many(
        base,
        &[
            gathering_at("train-1", "train-42", 3, "10m"),
            gathering_at("train-2", "train-42", 3, "10m"),
            gathering_at("train-3", "train-42", 3, "10m"),
        ],
    );
    arrive(base, "train-1");
    arrive(base, "train-2");
    barrier_until(base, "train-42", "gathering", 2, &[]);

    let o = barrier(base, &["status", "train-42"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = text(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "Name      train-42", "{out}");
    assert_eq!(lines[1], "State     gathering: 2 of 3 arrived", "{out}");
    assert_eq!(lines[2], "Size      3: 3 registered", "{out}");
    assert!(
        lines[3].starts_with("Timeout   10m from the first arrival: times out in 9m"),
        "{out}"
    );
    assert_eq!(lines[4], "Opened    -", "{out}");
    let row = |first: &str| -> Vec<String> {
        out.lines()
            .find(|l| l.split_whitespace().next() == Some(first))
            .unwrap_or_else(|| panic!("a row of {first} in {out}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(row("train-1")[..3], ["train-1", "worker", "arrived"]);
    assert_eq!(row("train-2")[..3], ["train-2", "worker", "arrived"]);
    assert_eq!(row("train-3"), ["train-3", "worker", "not", "arrived", "-"]);
    assert!(out.lines().all(|l| l.chars().count() <= 80), "{out}");
    let j: Value =
        serde_json::from_slice(&barrier(base, &["status", "train-42", "--json"]).stdout).unwrap();
    assert_eq!(j["arrived"], 2);
    assert_eq!(j["members"][2]["standing"], "absent");

    // Each member's allocation says where its worker stands, and the
    // barrier is not said again under "Blocked by".
    assert_eq!(
        barrier_line(base, "train-1", &[]),
        "worker    train-42              gathering: 2 of 3 arrived"
    );
    assert_eq!(
        barrier_line(base, "train-3", &[]),
        "worker    train-42              not arrived yet (2 of 3 have)"
    );
    assert!(!text(&alloc(base, &["status", "train-1"])).contains("Blocked by"));

    // The third arrives: all three are released together, for good.
    arrive(base, "train-3");
    let b = barrier_until(base, "train-42", "open", 0, &[]);
    let out = text(&barrier(base, &["status", "train-42"]));
    assert!(
        out.contains("\nState     open: its members were released together\n"),
        "{out}"
    );
    let opened = b["opened_at"].as_str().unwrap();
    assert!(
        out.contains(&format!(" ago ({} UTC)\n", opened[..19].replace('T', " "))),
        "{out}"
    );
    for id in ["train-1", "train-2", "train-3"] {
        assert!(
            out.contains(&format!("\n{id}     worker  passed    -\n")),
            "{out}"
        );
    }
    // A member restarted with its whole allocation is held by its gate,
    // not by the barrier again: still passed.
    send(
        base,
        "POST",
        "/v1/allocations/train-1/restart",
        json!({"all_tasks": true}),
    );
    let view = Command::new("curl")
        .args([
            "-s",
            "-f",
            &format!("{base}/v1/allocations/train-1/tasks/worker"),
        ])
        .output()
        .unwrap();
    let view: Value = serde_json::from_slice(&view.stdout).unwrap();
    assert_eq!(view["allowed"], false, "its gate closed: {view}");
    assert_eq!(view["blocked_by"], json!([]), "{view}");
    assert_eq!(
        barrier_line(base, "train-1", &[]),
        "worker    train-42              passed (all 3 released together)"
    );
}

#[test]
fn a_timed_out_barrier_is_said_with_its_stop_order_and_a_missing_one_is_named() {
    let server = Server::start(&["--in-memory"]);
    let base = server.base.as_str();
    send_many(
        base,
        &[
            gathering_at("x-1", "short", 3, "1s"),
            gathering_at("x-2", "short", 3, "1s"),
        ],
    );
    arrive(base, "x-1");
    barrier_until(base, "short", "timed_out", 0, &[]);
    let out = text(&barrier(base, &["status", "short"]));
    assert!(
        out.contains(
            "\nState     timed out: its members' allocations were told to stop\n\
             Size      3: 2 registered\nTimeout   1s from the first arrival\nOpened    -\n"
        ),
        "{out}"
    );
    assert!(
        out.contains("\nx-2         worker  timed out  -\n"),
        "{out}"
    );
    // Both members, the one that never arrived too, are told to stop.
    for id in ["x-1", "x-2"] {
        let out = text(&alloc(base, &["status", id]));
        assert!(
            out.contains("\nStop order: Barrier Timeout (short)\n"),
            "{id}: {out}"
        );
        assert!(
            out.contains(
                "\nBarriers\nworker    short                 \
                 timed out before 3 arrived: it will not start\n"
            ),
            "{id}: {out}"
        );
    }

    let o = barrier(base, &["status", "nope"]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains("404 barrier_not_found: no registered task names barrier \"nope\""),
        "{err}"
    );
    assert!(err.contains("/errors#barrier_not_found"), "{err}");
    assert!(
        err.contains("`taskgate alloc status ID` shows a task's barrier"),
        "{err}"
    );
    assert_eq!(barrier(base, &["status"]).status.code(), Some(2), "usage");
}

/// A reader whose token does not cover the barrier: `barrier status` is
/// refused, and `alloc status` says what the allocation's view says.
#[test]
fn without_a_right_to_the_barrier_alloc_status_says_what_the_view_says() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens.json");
    let sha256 = |s: &str| -> String {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(s.as_bytes());
        digest.iter().map(|b| format!("{b:02x}")).collect()
    };
    std::fs::write(
        &tokens,
        json!({"tokens": [{"name": "reader", "role": "reader", "sha256": sha256("reader-secret")}]})
            .to_string(),
    )
    .unwrap();
    let server = Server::start_env(
        &["--in-memory", "--token-file", tokens.to_str().unwrap()],
        &[("TASKGATE_OPERATOR_TOKEN", "operator-secret")],
    );
    let base = server.base.as_str();
    let operator = ["--token", "operator-secret"];
    let reader = ["--token", "reader-secret"];
    for id in ["r-1", "r-2"] {
        let (_, path, body) = gathering_at(id, "locked", 3, "10m");
        let o = Command::new("curl")
            .args(["-s", "-f", "-X", "PUT", &format!("{base}{path}")])
            .args([
                "-H",
                "content-type: application/json",
                "-d",
                &body.to_string(),
            ])
            .args(["-H", "authorization: Bearer operator-secret"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{id}");
    }
    let o = Command::new("curl")
        .args(["-s", "-f", "-X", "PUT"])
        .arg(format!("{base}/v1/allocations/r-1/tasks/side/state"))
        .args([
            "-H",
            "content-type: application/json",
            "-d",
            r#"{"state": "running"}"#,
        ])
        .args(["-H", "authorization: Bearer operator-secret"])
        .output()
        .unwrap();
    assert!(o.status.success());
    let auth = ["-H", "authorization: Bearer operator-secret"];
    barrier_until(base, "locked", "gathering", 1, &auth);
    let o = barrier(base, &["status", "locked", reader[0], reader[1]]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("403 "), "{}", stderr(&o));
    assert_eq!(
        barrier_line(base, "r-1", &operator),
        "worker    locked                gathering: 1 of 3 arrived"
    );
    assert_eq!(
        barrier_line(base, "r-1", &reader),
        "worker    locked                gathering: 1 of 3 arrived"
    );
    // Not held by it, and its gate closed: the view cannot tell whether
    // it passed or has not arrived; the barrier, read by the operator, can.
    assert_eq!(
        barrier_line(base, "r-2", &reader),
        "worker    locked                not waiting at it now (size 3)"
    );
    assert_eq!(
        barrier_line(base, "r-2", &operator),
        "worker    locked                not arrived yet (1 of 3 have)"
    );
}
