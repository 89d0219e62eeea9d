//! One tenant's dependency graph against everyone else, on the real binary
//! (issue 43, "Trust, third round", part 4): an agent token inside its own
//! prefix registers the audit's graph — a chain of allocations, a target
//! depending on its head, fat dependents on the target — and reports on
//! the target, while another token's allocation takes reports and
//! `/v1/health` is asked; and the limits that bound such a graph refuse
//! with the documented 429.

mod common;

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use common::{
    process::Server,
    raw::{RawAnswer, connect, read_answer, request_with},
};
use serde_json::{Value, json};
use taskgate_testkit::graph::Shape;

/// The audit's shape, scaled down to what a debug build registers in a
/// few seconds, inside the default limits (4 × 64 × 16 = 4,096
/// dependencies on the target, the default `--max-dependents`). Before the
/// judging was bounded, each report on the target cost 4 × 1,024
/// dependencies × a walk of the 256 tasks behind it, on both cores.
const SHAPE: Shape = Shape {
    chain: 4,
    chain_tasks: 60,
    target_tasks: 16,
    dependents: 4,
    dependent_tasks: 64,
};

/// The longest any request of the other tenant may take.
const BOUND: Duration = Duration::from_secs(1);

/// Each token's secret, the prefix it may act in, and its entry's own
/// `max_dependencies` if any.
const TENANT: (&str, &str) = ("tenant-secret", "evil-");
const OTHER: (&str, &str) = ("other-secret", "good-");
const BIG: (&str, &str) = ("big-secret", "big-");
const OPERATOR: &str = "operator-secret";

fn sha256(s: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A server with the tenant's, the other's and an operator's tokens, and
/// with `big` the `big-` agent token whose entry gives its own
/// `max_dependencies` (100); and `flags`.
fn server(dir: &std::path::Path, flags: &[&str], big: bool) -> Server {
    let file = dir.join("tokens.json");
    let mut tokens = json!({"tokens": [
        {"name": "tenant", "role": "agent", "sha256": sha256(TENANT.0), "alloc_prefixes": [TENANT.1]},
        {"name": "other", "role": "agent", "sha256": sha256(OTHER.0), "alloc_prefixes": [OTHER.1]},
        {"name": "ops", "role": "operator", "sha256": sha256(OPERATOR)},
    ]});
    if big {
        tokens["tokens"].as_array_mut().unwrap().push(json!(
            {"name": "big", "role": "agent", "sha256": sha256(BIG.0), "alloc_prefixes": [BIG.1],
             "max_dependencies": 100}
        ));
    }
    std::fs::write(&file, tokens.to_string()).unwrap();
    let mut args = vec!["--in-memory", "--token-file", file.to_str().unwrap()];
    args.extend_from_slice(flags);
    Server::start(&args)
}

/// One request as `secret`'s token (none for `None`), with a read timeout
/// long enough to see a stall through; the answer and how long it took.
fn send(
    addr: SocketAddr,
    secret: Option<&str>,
    method: &str,
    path: &str,
    body: &str,
) -> (RawAnswer, Duration) {
    let auth = secret.map(|s| format!("Bearer {s}"));
    let headers: Vec<(&str, &str)> = auth
        .as_deref()
        .map(|a| vec![("Authorization", a)])
        .unwrap_or_default();
    let content_type = (!body.is_empty()).then_some("application/json");
    let bytes = request_with(method, path, &headers, content_type, body.as_bytes());
    let started = Instant::now();
    let mut stream = connect(addr);
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    std::io::Write::write_all(&mut stream, &bytes).unwrap();
    let answer = read_answer(&mut stream).expect("an answer");
    (answer, started.elapsed())
}

#[track_caller]
fn expect(answer: &RawAnswer, status: u16) -> Value {
    assert_eq!(
        answer.status,
        status,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    answer.json()
}

/// Dependent allocation spec: `tasks` tasks, each with one dependency on
/// task `t0` of `target`.
fn dependent(tasks: usize, target: &str) -> String {
    let tasks: Vec<Value> = (0..tasks)
        .map(|i| {
            json!({"name": format!("t{i}"), "depends_on": [
                {"task": "t0", "allocation": target, "condition": "running"}]})
        })
        .collect();
    json!({ "tasks": tasks }).to_string()
}

/// Issue 43, part 4: while one token registers the audit's graph (scaled
/// down) and reports on its target, no report of another token's
/// allocation and no `/v1/health` takes more than a second. Before the
/// judging was bounded, each report on the target held both cores for
/// seconds, walking the chain once per dependency of every dependent.
#[test]
fn one_tenants_dependency_graph_holds_nobody_elses_report_or_health() {
    let dir = tempfile::tempdir().unwrap();
    let server = server(dir.path(), &[], false);
    let addr = server.addr();
    let five = common::five_tasks().to_string();
    let (a, _) = send(addr, Some(OTHER.0), "PUT", "/v1/allocations/good-0", &five);
    expect(&a, 201);

    let done = Arc::new(AtomicBool::new(false));
    let hostile = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut slowest = Duration::ZERO;
            for (id, spec) in SHAPE.registrations(TENANT.1) {
                let path = format!("/v1/allocations/{id}");
                let (a, took) = send(addr, Some(TENANT.0), "PUT", &path, &spec);
                assert_eq!(a.status, 201, "{id}: {}", String::from_utf8_lossy(&a.body));
                slowest = slowest.max(took);
            }
            let target = Shape::target_id(TENANT.1);
            for t in 0..4 {
                let path = format!("/v1/allocations/{target}/tasks/t{t}/state");
                let (a, took) = send(
                    addr,
                    Some(TENANT.0),
                    "PUT",
                    &path,
                    r#"{"state": "running"}"#,
                );
                expect(&a, 200);
                slowest = slowest.max(took);
            }
            done.store(true, Ordering::SeqCst);
            slowest
        })
    };

    // The other tenant, one request after another until the hostile one
    // is done (and at least a few of each).
    let (mut reports, mut checks) = (Vec::new(), Vec::new());
    let web = "/v1/allocations/good-0/tasks/web/state";
    for n in 0..100_000usize {
        if done.load(Ordering::SeqCst) && n >= 10 {
            break;
        }
        let state = if n % 2 == 0 { "running" } else { "pending" };
        let body = format!(r#"{{"state": "{state}"}}"#);
        let (a, took) = send(addr, Some(OTHER.0), "PUT", web, &body);
        expect(&a, 200);
        reports.push(took);
        let (a, took) = send(addr, None, "GET", "/v1/health", "");
        expect(&a, 200);
        checks.push(took);
    }
    let slowest_hostile = hostile.join().expect("the hostile tenant's requests");
    assert!(done.load(Ordering::SeqCst), "the hostile tenant finished");

    // The graph is held whole: every dependent task saw its four targets.
    let dep = Shape::dependent_id(TENANT.1, 0);
    let (a, _) = send(
        addr,
        Some(TENANT.0),
        "GET",
        &format!("/v1/allocations/{dep}"),
        "",
    );
    let view = expect(&a, 200);
    let blocked = view["tasks"][0]["blocked_by"].as_array().unwrap().len();
    assert_eq!(blocked, SHAPE.target_tasks - 4, "{}", view["tasks"][0]);

    let max = |v: &[Duration]| v.iter().copied().max().unwrap_or_default();
    assert!(
        max(&reports) < BOUND && max(&checks) < BOUND,
        "the other tenant waited: its slowest report {:?}, the slowest health {:?} ({} \
         each; the hostile tenant's slowest request {slowest_hostile:?})",
        max(&reports),
        max(&checks),
        reports.len()
    );
}

/// `--max-dependents`: dependencies on one allocation's tasks from other
/// allocations, together; one more is 429 `quota_exceeded`, naming the
/// target and the flag, and changes nothing; once a dependent goes, there
/// is room again.
#[test]
fn dependencies_on_one_allocation_past_max_dependents_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let server = server(dir.path(), &["--max-dependents", "32"], false);
    let addr = server.addr();
    let put = |id: &str, spec: &str| {
        send(
            addr,
            Some(OTHER.0),
            "PUT",
            &format!("/v1/allocations/{id}"),
            spec,
        )
        .0
    };
    expect(&put("good-db", r#"{"tasks": [{"name": "t0"}]}"#), 201);
    expect(&put("good-a", &dependent(20, "good-db")), 201);
    expect(&put("good-b", &dependent(12, "good-db")), 201);
    let refused = put("good-c", &dependent(1, "good-db"));
    refused.assert_problem(429, "quota_exceeded");
    let detail = refused.json()["detail"].as_str().unwrap().to_owned();
    assert!(
        detail.contains("\"good-db\"") && detail.contains("--max-dependents"),
        "{detail}"
    );
    let (a, _) = send(addr, Some(OTHER.0), "GET", "/v1/allocations/good-c", "");
    a.assert_problem(404, "allocation_not_found");
    // The same spec without the dependency is not limited.
    expect(&put("good-c", r#"{"tasks": [{"name": "t0"}]}"#), 201);
    let (a, _) = send(addr, Some(OPERATOR), "DELETE", "/v1/allocations/good-b", "");
    assert_eq!(a.status, 204, "{}", String::from_utf8_lossy(&a.body));
    expect(&put("good-d", &dependent(12, "good-db")), 201);
    // `/errors` tells what the code means.
    let (a, _) = send(addr, None, "GET", "/errors", "");
    let page = String::from_utf8_lossy(&a.body).into_owned();
    assert!(page.contains("--max-dependents"), "{page}");
}

/// `--max-dependencies-per-token`: the dependencies on other allocations
/// that the allocations within an agent token's prefixes declare
/// together; one more is 429 `quota_exceeded` naming the token. Other
/// tokens count only their own, and a token file entry's
/// `max_dependencies` overrides the flag.
#[test]
fn dependencies_past_a_tokens_limit_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let server = server(dir.path(), &["--max-dependencies-per-token", "20"], true);
    let addr = server.addr();
    let put = |token: (&str, &str), id: &str, spec: &str| {
        send(
            addr,
            Some(token.0),
            "PUT",
            &format!("/v1/allocations/{id}"),
            spec,
        )
        .0
    };
    let target = r#"{"tasks": [{"name": "t0"}]}"#;
    expect(&put(TENANT, "evil-t", target), 201);
    expect(&put(TENANT, "evil-a", &dependent(15, "evil-t")), 201);
    expect(&put(TENANT, "evil-b", &dependent(5, "evil-t")), 201);
    let refused = put(TENANT, "evil-c", &dependent(1, "evil-t"));
    refused.assert_problem(429, "quota_exceeded");
    let detail = refused.json()["detail"].as_str().unwrap().to_owned();
    assert!(
        detail.contains("\"tenant\"") && detail.contains("may declare 20 dependencies"),
        "{detail}"
    );
    // Another token's allocations are not the tenant's.
    expect(&put(OTHER, "good-t", target), 201);
    expect(&put(OTHER, "good-a", &dependent(20, "good-t")), 201);
    // A token's own entry says more.
    expect(&put(BIG, "big-t", target), 201);
    expect(&put(BIG, "big-a", &dependent(64, "big-t")), 201);
    expect(&put(BIG, "big-b", &dependent(36, "big-t")), 201);
    put(BIG, "big-c", &dependent(1, "big-t")).assert_problem(429, "quota_exceeded");
    // Deleting one makes room.
    let (a, _) = send(addr, Some(OPERATOR), "DELETE", "/v1/allocations/evil-b", "");
    assert_eq!(a.status, 204, "{}", String::from_utf8_lossy(&a.body));
    expect(&put(TENANT, "evil-c", &dependent(5, "evil-t")), 201);
}
