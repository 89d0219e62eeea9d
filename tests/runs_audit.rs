//! Audit of the "Runs" and "Operator stop" promises (SEMANTICS, fourth
//! edition; docs/lifecycle.md), through the HTTP API: each test tries to
//! break one promise. The breaks found are fixed; the two known gaps left
//! are `#[ignore]`d with the reason.

mod common;

use std::time::Duration;

use axum::{
    body::Body,
    http::{Request, StatusCode, header},
};
use common::{
    AGENT, Answer, OPERATOR, READER, TestApp, paused_clock, settle, test_app, with_tokens,
};
use serde_json::{Value, json};
use taskgate::http::HttpConfig;

/// A request with any headers and a JSON body (if any).
async fn send(
    app: &TestApp,
    method: &str,
    uri: &str,
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> Answer {
    app.call_with(method, uri, headers, body).await
}

fn state_uri(id: &str, task: &str) -> String {
    format!("/v1/allocations/{id}/tasks/{task}/state")
}

fn heartbeat_uri(id: &str, task: &str) -> String {
    format!("/v1/allocations/{id}/tasks/{task}/heartbeat")
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

async fn register(app: &TestApp, id: &str, spec: Value, token: Option<&str>) {
    let auth = token.map(bearer);
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    let a = send(
        app,
        "PUT",
        &format!("/v1/allocations/{id}"),
        &headers,
        Some(spec),
    )
    .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
}

async fn web_only(app: &TestApp, id: &str) {
    register(app, id, json!({"tasks": [{"name": "web"}]}), None).await;
}

async fn advance(secs: u64) {
    tokio::time::advance(Duration::from_secs(secs)).await;
    settle().await;
}

// ---------------------------------------------------------------------
// Idempotency keys and runs
// ---------------------------------------------------------------------

/// Promise: "A `running` report that does not name the current run, for a
/// task already `running` under a run that is not lost, is refused 409
/// `task_claimed`" and "One agent per run ... A second agent therefore
/// never starts a second copy".
///
/// Attack: agent A's keyed claim lands (run R1) but its answer is lost. An
/// operator's restore ends R1, agent B claims the task (R2). A retries its
/// claim with the same key: the key is checked before the run, so the
/// retry is a 200 whose answer names R2, which A (`src/agent/api.rs`,
/// `report`) adopts as its own run: two agents, one run.
#[tokio::test]
async fn keyed_retry_of_a_claim_after_the_run_changed_hands_is_not_a_retry() {
    let app = test_app().await;
    web_only(&app, "k1").await;
    let running = json!({"state": "running"});
    let uri = state_uri("k1", "web");
    let a = send(
        &app,
        "PUT",
        &uri,
        &[("idempotency-key", "claim-A")],
        Some(running.clone()),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let r1 = a.run("web");
    // The operator ends the run (A never heard of it); B claims the task.
    let a = app
        .call(
            "POST",
            "/v1/allocations/k1/restore",
            Some(json!({"tasks": {"web": {"state": "pending"}}})),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let a = send(
        &app,
        "PUT",
        &uri,
        &[("idempotency-key", "claim-B")],
        Some(running.clone()),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let r2 = a.run("web");
    assert_ne!(r1, r2);
    // A's retry of its claim.
    let retry = send(
        &app,
        "PUT",
        &uri,
        &[("idempotency-key", "claim-A")],
        Some(running),
    )
    .await;
    assert!(
        !(retry.status == StatusCode::OK && retry.task("web")["run"] == r2.as_str()),
        "A's retry was answered 200 naming B's run {r2}: {}",
        retry.body
    );
    retry.assert_problem(409, "task_claimed");
}

/// Promise: "A report or heartbeat that names a run that is not the task's
/// current run is refused 409 `run_superseded` ... it must stop its
/// process."
///
/// Attack: A, under R1, reports its `Started` event with a key; it lands
/// but the answer is lost. R1 is replaced (an operator's restore, then B's
/// run R2). A retries with the same key and header R1: a 200 (the key is
/// seen first), not `run_superseded`, so A keeps its process running (and
/// the answer names R2, which A adopts).
#[tokio::test]
async fn keyed_retry_naming_a_superseded_run_is_run_superseded() {
    let app = test_app().await;
    web_only(&app, "k2").await;
    let uri = state_uri("k2", "web");
    let r1 = app
        .report("k2", "web", json!({"state": "running"}))
        .await
        .run("web");
    let started = json!({"state": "running", "event": {"type": "Started", "message": "pid 42"}});
    let a = send(
        &app,
        "PUT",
        &uri,
        &[("taskgate-run", &r1), ("idempotency-key", "started-A")],
        Some(started.clone()),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    app.call(
        "POST",
        "/v1/allocations/k2/restore",
        Some(json!({"tasks": {"web": {"state": "pending"}}})),
    )
    .await;
    let r2 = app
        .report("k2", "web", json!({"state": "running"}))
        .await
        .run("web");
    let retry = send(
        &app,
        "PUT",
        &uri,
        &[("taskgate-run", &r1), ("idempotency-key", "started-A")],
        Some(started),
    )
    .await;
    retry.assert_problem(409, "run_superseded");
    assert_eq!(retry.body["current_run"], r2.as_str(), "{}", retry.body);
}

/// Promise (idempotency keys + runs): a keyed `running` report retried
/// with no header after the first landed is a retry (200, nothing
/// changes, the same run), not `task_claimed`.
#[tokio::test]
async fn keyed_running_retry_without_header_after_it_landed_is_a_retry() {
    let app = test_app().await;
    web_only(&app, "k3").await;
    let uri = state_uri("k3", "web");
    let running = json!({"state": "running"});
    let first = send(
        &app,
        "PUT",
        &uri,
        &[("idempotency-key", "c1")],
        Some(running.clone()),
    )
    .await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.body);
    let retry = send(
        &app,
        "PUT",
        &uri,
        &[("idempotency-key", "c1")],
        Some(running.clone()),
    )
    .await;
    assert_eq!(retry.status, StatusCode::OK, "{}", retry.body);
    assert_eq!(retry.run("web"), first.run("web"));
    assert_eq!(retry.index(), first.index(), "nothing applied again");
    // The same key with another request is still 422.
    let other = send(
        &app,
        "PUT",
        &uri,
        &[("idempotency-key", "c1")],
        Some(json!({"state": "dead"})),
    )
    .await;
    other.assert_problem(422, "idempotency_key_reused");
    // A new key, no header: a second agent.
    let second = send(
        &app,
        "PUT",
        &uri,
        &[("idempotency-key", "c2")],
        Some(running),
    )
    .await;
    second.assert_problem(409, "task_claimed");
}

// ---------------------------------------------------------------------
// Batches
// ---------------------------------------------------------------------

/// Promise: a batch naming a run is refused `run_superseded` unless it is
/// every named task's current run, and one refused entry rejects them all;
/// a header-less batch `running` for a running task is `task_claimed`.
#[tokio::test]
async fn batches_with_and_without_a_run_are_judged_per_task_and_all_or_nothing() {
    let app = test_app().await;
    app.register_five("b1").await;
    let batch = "/v1/allocations/b1/task-states";
    let a = app
        .call(
            "POST",
            batch,
            Some(json!({"tasks": {"init": {"state": "running"}, "proxy": {"state": "running"}}})),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let (init, proxy) = (a.run("init"), a.run("proxy"));
    // (Two tasks that began in one change share the run ID.)
    assert_eq!(init, proxy, "one change, one index: {}", a.body);
    let before = app.get("/v1/allocations/b1").await.index();
    // A header naming proxy's run, for proxy and web (pending, no run).
    let a = send(
        &app,
        "POST",
        batch,
        &[("taskgate-run", &proxy)],
        Some(json!({"tasks": {"proxy": {"state": "pending"}, "web": {"state": "running"}}})),
    )
    .await;
    a.assert_problem(409, "run_superseded");
    assert_eq!(
        app.get("/v1/allocations/b1").await.index(),
        before,
        "nothing applied"
    );
    // Header-less: one entry claims a running task; all refused.
    let a = app
        .call(
            "POST",
            batch,
            Some(json!({"tasks": {"web": {"state": "running"}, "proxy": {"state": "running"}}})),
        )
        .await;
    a.assert_problem(409, "task_claimed");
    assert_eq!(
        app.get("/v1/allocations/b1").await.index(),
        before,
        "nothing applied"
    );
    // The run of both, in one batch: taken.
    let a = send(
        &app,
        "POST",
        batch,
        &[("taskgate-run", &init)],
        Some(json!({"tasks": {"init": {"state": "dead"}, "proxy": {"state": "running"}}})),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.task("init")["state"], "dead");
}

/// Promise: a keyed batch retried after it landed applies nothing again;
/// a keyed batch that was refused (`task_claimed`) keeps no key (a retry
/// is refused again, not taken as a retry).
#[tokio::test]
async fn a_keyed_batch_refused_for_a_claim_stays_refused_on_retry() {
    let app = test_app().await;
    app.register_five("b2").await;
    let batch = "/v1/allocations/b2/task-states";
    app.report("b2", "proxy", json!({"state": "running"})).await;
    let body = json!({"tasks": {"init": {"state": "running"}, "proxy": {"state": "running"}}});
    for _ in 0..2 {
        let a = send(
            &app,
            "POST",
            batch,
            &[("idempotency-key", "bk")],
            Some(body.clone()),
        )
        .await;
        a.assert_problem(409, "task_claimed");
    }
    assert_eq!(
        app.get("/v1/allocations/b2/tasks/init").await.body["state"],
        "pending"
    );
}

// ---------------------------------------------------------------------
// Malformed headers, run IDs never reused
// ---------------------------------------------------------------------

/// Promise: a header that names a run that is not the task's current one
/// is 409 `run_superseded`; the code calls a value that is not a number
/// one that names no run. Empty, non-numeric, negative and huge values:
/// 409 `run_superseded`, nothing changes; two headers: 400.
#[tokio::test]
async fn malformed_run_headers_are_run_superseded_and_change_nothing() {
    let app = test_app().await;
    web_only(&app, "m1").await;
    let run = app
        .report("m1", "web", json!({"state": "running"}))
        .await
        .run("web");
    let before = app.get("/v1/allocations/m1").await.index();
    let huge = "184467440737095516160000";
    for bad in ["", "abc", "-1", huge, "0", "1.0", " "] {
        let a = send(
            &app,
            "PUT",
            &state_uri("m1", "web"),
            &[("taskgate-run", bad)],
            Some(json!({"state": "dead"})),
        )
        .await;
        a.assert_problem(409, "run_superseded");
        assert_eq!(a.body["current_run"], run.as_str(), "{bad:?}: {}", a.body);
        let h = send(
            &app,
            "PUT",
            &heartbeat_uri("m1", "web"),
            &[("taskgate-run", bad)],
            None,
        )
        .await;
        h.assert_problem(409, "run_superseded");
    }
    let req = Request::put(state_uri("m1", "web"))
        .header(header::CONTENT_TYPE, "application/json")
        .header("taskgate-run", run.as_str())
        .header("taskgate-run", run.as_str())
        .body(Body::from(json!({"state": "dead"}).to_string()))
        .unwrap();
    let two = app.send(req).await;
    two.assert_problem(400, "invalid_request");
    assert_eq!(app.get("/v1/allocations/m1").await.index(), before);
    let view = app.get("/v1/allocations/m1/tasks/web").await;
    assert_eq!(view.body["state"], "running");
    // (Observation: "+<run>" and " <run> " are taken as the run itself:
    // the value is parsed as a number, not compared as an opaque string.)
    let plus = send(
        &app,
        "PUT",
        &heartbeat_uri("m1", "web"),
        &[("taskgate-run", &format!("+{run}"))],
        None,
    )
    .await;
    eprintln!("heartbeat with \"+{run}\": {}", plus.status);
}

/// Promise: a run ID is "never reused", also across a deletion and a new
/// registration under the same ID (tests/runs.rs) — and across restarts.
/// A server on the memory store (`serve --in-memory`) keeps nothing across
/// a restart; its indexes (run IDs, `create_index`) must still not come
/// back, or an agent left over from the first process could take the
/// second's task for its own.
#[test]
#[ignore = "known gap: --in-memory keeps nothing across a restart, and its indexes (run IDs, create_index) start again with it"]
fn a_run_id_is_not_given_again_after_an_in_memory_restart() {
    let mut seen = Vec::new();
    for _ in 0..2 {
        let server = common::process::Server::start(&["--in-memory"]);
        let curl = |args: &[&str]| {
            let out = std::process::Command::new("curl")
                .args(["-s", "-H", "Content-Type: application/json"])
                .args(args)
                .output()
                .unwrap();
            serde_json::from_slice::<Value>(&out.stdout).unwrap()
        };
        let url = format!("{}/v1/allocations/re", server.base);
        let a = curl(&["-X", "PUT", "-d", r#"{"tasks": [{"name": "web"}]}"#, &url]);
        let created = a["create_index"].clone();
        let a = curl(&[
            "-X",
            "PUT",
            "-d",
            r#"{"state": "running"}"#,
            &format!("{url}/tasks/web/state"),
        ]);
        seen.push((created, a["tasks"][0]["run"].clone()));
    }
    assert!(seen[0].1.is_string(), "{seen:?}");
    assert_ne!(seen[0].0, seen[1].0, "create_index given twice: {seen:?}");
    assert_ne!(seen[0].1, seen[1].1, "run given twice: {seen:?}");
}

// ---------------------------------------------------------------------
// Lost tasks, restore
// ---------------------------------------------------------------------

/// Promises: a lost task's agent that comes back is refused 409
/// `task_lost` (reports and heartbeats, also naming its old run); an
/// agent's restore naming a lost task is 409 `task_lost` and one not
/// naming it clears no loss; after an all-tasks restart the old run is
/// `run_superseded` with `current_run: null`.
#[tokio::test(start_paused = true)]
async fn a_lost_task_s_old_run_is_task_lost_then_superseded_after_a_restart() {
    if common::on_etcd("lost", "paused clock") {
        return;
    }
    let app = with_tokens(paused_clock()).await;
    let agent = bearer(AGENT);
    let auth = [("authorization", agent.as_str())];
    let spec = json!({"tasks": [
        {"name": "web", "liveness": {"ttl": "10s"}},
        {"name": "side", "lifecycle": {"hook": "prestart", "sidecar": true}}]});
    register(&app, "l1", spec, Some(AGENT)).await;
    let a = send(
        &app,
        "PUT",
        &state_uri("l1", "side"),
        &auth,
        Some(json!({"state": "running"})),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let a = send(
        &app,
        "PUT",
        &state_uri("l1", "web"),
        &auth,
        Some(json!({"state": "running"})),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let run = a.run("web");
    advance(11).await;
    advance(1).await;
    let view = send(&app, "GET", "/v1/allocations/l1/tasks/web", &auth, None).await;
    assert_eq!(view.body["lost"], true, "{}", view.body);
    let with_run = [
        ("authorization", agent.as_str()),
        ("taskgate-run", run.as_str()),
    ];
    let h = send(&app, "PUT", &heartbeat_uri("l1", "web"), &with_run, None).await;
    h.assert_problem(409, "task_lost");
    assert!(h.body["lost_at"].is_string(), "{}", h.body);
    let r = send(
        &app,
        "PUT",
        &state_uri("l1", "web"),
        &with_run,
        Some(json!({"state": "dead"})),
    )
    .await;
    r.assert_problem(409, "task_lost");
    let r = send(
        &app,
        "PUT",
        &state_uri("l1", "web"),
        &auth,
        Some(json!({"state": "running"})),
    )
    .await;
    r.assert_problem(409, "task_lost");
    // An agent's restore: naming it is task_lost; not naming it keeps it lost.
    let restore = "/v1/allocations/l1/restore";
    let a = send(
        &app,
        "POST",
        restore,
        &auth,
        Some(json!({"tasks": {"web": {"state": "running"}}})),
    )
    .await;
    a.assert_problem(409, "task_lost");
    let a = send(
        &app,
        "POST",
        restore,
        &auth,
        Some(json!({"tasks": {"side": {"state": "running"}}})),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.task("web")["lost"], true, "{}", a.body);
    assert_eq!(a.task("web")["desired"], "stop", "{}", a.body);
    // The operator's all-tasks restart clears the loss: the old run is a leftover.
    let op = bearer(OPERATOR);
    let a = send(
        &app,
        "POST",
        "/v1/allocations/l1/restart",
        &[("authorization", op.as_str())],
        Some(json!({"all_tasks": true})),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let h = send(&app, "PUT", &heartbeat_uri("l1", "web"), &with_run, None).await;
    h.assert_problem(409, "run_superseded");
    assert_eq!(h.body["current_run"], Value::Null, "{}", h.body);
    let r = send(
        &app,
        "PUT",
        &state_uri("l1", "web"),
        &with_run,
        Some(json!({"state": "running"})),
    )
    .await;
    r.assert_problem(409, "run_superseded");
    // A new agent's claim starts a new run.
    let a = send(
        &app,
        "PUT",
        &state_uri("l1", "web"),
        &auth,
        Some(json!({"state": "running"})),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_ne!(a.run("web"), run);
}

/// Promise: "An agent's restore ... does not restart a deadline's clock
/// (the deadline keeps counting from when the coordinator first entered
/// the state)".
///
/// Attack: the coordinator has been in `main` (deadline 60 s) for 40 s. An
/// agent's restore sets the prestart sidecar `pending`: the coordinator,
/// evaluated from `prestart`, goes back to `prestart`; the sidecar reports
/// `running` and `main` is entered again, with a fresh 60 s.
#[tokio::test(start_paused = true)]
async fn an_agent_s_restore_does_not_restart_the_deadline_s_clock() {
    if common::on_etcd("deadline", "paused clock") {
        return;
    }
    let app = with_tokens(paused_clock()).await;
    let agent = bearer(AGENT);
    let auth = [("authorization", agent.as_str())];
    let spec = json!({"tasks": [
        {"name": "side", "lifecycle": {"hook": "prestart", "sidecar": true}},
        {"name": "web"}], "deadlines": {"main": "60s"}});
    register(&app, "d1", spec, Some(AGENT)).await;
    let a = send(
        &app,
        "PUT",
        &state_uri("d1", "side"),
        &auth,
        Some(json!({"state": "running"})),
    )
    .await;
    assert_eq!(a.body["coordinator_state"], "main", "{}", a.body);
    let view = send(&app, "GET", "/v1/allocations/d1", &auth, None).await;
    let first = view.body["deadline_at"].clone();
    assert!(first.is_string(), "{}", view.body);
    advance(40).await;
    let a = send(
        &app,
        "POST",
        "/v1/allocations/d1/restore",
        &auth,
        Some(json!({"tasks": {"side": {"state": "pending"}}})),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    eprintln!(
        "after the agent's restore: {} {}",
        a.body["coordinator_state"], a.body["deadline_at"]
    );
    let a = send(
        &app,
        "PUT",
        &state_uri("d1", "side"),
        &auth,
        Some(json!({"state": "running"})),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let view = send(&app, "GET", "/v1/allocations/d1", &auth, None).await;
    assert_eq!(view.body["coordinator_state"], "main", "{}", view.body);
    assert_eq!(
        view.body["deadline_at"], first,
        "the main deadline moved: {}",
        view.body
    );
    // And so it passes when it was due (60 s after main was first entered).
    advance(25).await;
    let view = send(&app, "GET", "/v1/allocations/d1", &auth, None).await;
    assert_eq!(
        view.body["tasks"][1]["stop_reason"]["type"], "Deadline Exceeded",
        "{}",
        view.body
    );
}

// ---------------------------------------------------------------------
// Signs of life
// ---------------------------------------------------------------------

/// Promises: "Signs of life belong to a run" and "it waits, visibly,
/// until the first run ends or is lost"; `task_claimed` "names the run
/// and its last sign of life".
///
/// Attack (no tokens): A claims the task (TTL 10 s) and dies. B, a second
/// agent, claims again every 4 s (no header: it has no run) and is
/// refused `task_claimed` each time. Each refused claim is counted as a
/// sign of life (`signs_of_life` runs before the decision): A's run never
/// gets lost, so B waits forever; and the problem's `last_seen` is B's
/// own request, not A's last sign.
#[tokio::test(start_paused = true)]
async fn a_refused_claim_is_no_sign_of_life_for_the_run_it_was_refused_by() {
    if common::on_etcd("claims", "paused clock") {
        return;
    }
    let app = common::test_app_with(paused_clock(), HttpConfig::default()).await;
    register(
        &app,
        "s1",
        json!({"tasks": [{"name": "web", "liveness": {"ttl": "10s"}}]}),
        None,
    )
    .await;
    let a = app.report("s1", "web", json!({"state": "running"})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let a_seen = app.get("/v1/allocations/s1/tasks/web").await.body["last_seen"].clone();
    let mut seen = Vec::new();
    for _ in 0..4 {
        advance(4).await;
        let b = app.report("s1", "web", json!({"state": "running"})).await;
        if b.body["code"] == "task_lost" {
            // A's run is lost: B now waits for an order.
            break;
        }
        b.assert_problem(409, "task_claimed");
        seen.push(b.body["last_seen"].clone());
    }
    let view = app.get("/v1/allocations/s1/tasks/web").await;
    eprintln!(
        "lost after 16 s: {}; task_claimed last_seen: {seen:?}; A's: {a_seen}",
        view.body["lost"]
    );
    assert_eq!(
        seen.first(),
        Some(&a_seen),
        "task_claimed's last_seen is the claimer's own request, not A's last sign ({a_seen}): {seen:?}"
    );
    assert_eq!(
        view.body["lost"], true,
        "A gave no sign for 16 s, TTL 10 s; B's refused claims kept A's run alive: {}",
        view.body
    );
}

/// Same promise with tokens: B, an agent token with no run, waits on the
/// start condition (as `taskgate agent` does after `task_claimed`). A
/// header-less query with a token is a sign of life by the letter of the
/// doc ("or, for agents that send no run, when it is authenticated with a
/// token"), so the waiting second agent keeps the dead first run alive,
/// and "it waits until the first run ends or is lost" never comes.
#[tokio::test(start_paused = true)]
#[ignore = "known gap: the documented rule for agents that name no run (a token query is a sign of life); taskgate agent waits through the allocation view instead"]
async fn a_second_agent_waiting_with_a_token_does_not_keep_the_first_run_alive() {
    if common::on_etcd("claims", "paused clock") {
        return;
    }
    let app = with_tokens(paused_clock()).await;
    let agent = bearer(AGENT);
    let auth = [("authorization", agent.as_str())];
    register(
        &app,
        "s2",
        json!({"tasks": [{"name": "web", "liveness": {"ttl": "10s"}}]}),
        Some(AGENT),
    )
    .await;
    let a = send(
        &app,
        "PUT",
        &state_uri("s2", "web"),
        &auth,
        Some(json!({"state": "running"})),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    for _ in 0..4 {
        advance(4).await;
        let q = send(
            &app,
            "GET",
            "/v1/allocations/s2/tasks/web/start-condition",
            &auth,
            None,
        )
        .await;
        assert_eq!(q.status, StatusCode::OK, "{}", q.body);
    }
    let view = send(&app, "GET", "/v1/allocations/s2/tasks/web", &auth, None).await;
    assert_eq!(view.body["lost"], true, "{}", view.body);
}

/// Promises: "A query counts as a sign of life only when it names the
/// task's current run"; a reader's dashboard keeps no task alive (also
/// when it sends the run it can read on the task view); heartbeats of a
/// superseded run are refused and keep nothing alive.
#[tokio::test(start_paused = true)]
async fn wrong_runs_readers_and_superseded_heartbeats_keep_nothing_alive() {
    if common::on_etcd("signs", "paused clock") {
        return;
    }
    let app = with_tokens(paused_clock()).await;
    let agent = bearer(AGENT);
    let reader = bearer(READER);
    let auth = [("authorization", agent.as_str())];
    let spec = json!({"tasks": [{"name": "web", "liveness": {"ttl": "10s"}}]});
    for id in ["w1", "w2", "w3"] {
        register(&app, id, spec.clone(), Some(AGENT)).await;
    }
    let mut runs = Vec::new();
    for id in ["w1", "w2", "w3"] {
        let a = send(
            &app,
            "PUT",
            &state_uri(id, "web"),
            &auth,
            Some(json!({"state": "running"})),
        )
        .await;
        runs.push(a.run("web"));
    }
    // w3: its run is replaced by another (the old agent keeps beating).
    let w3_old = runs[2].clone();
    let op = bearer(OPERATOR);
    send(
        &app,
        "POST",
        "/v1/allocations/w3/restore",
        &[("authorization", op.as_str())],
        Some(json!({"tasks": {"web": {"state": "pending"}}})),
    )
    .await;
    let a = send(
        &app,
        "PUT",
        &state_uri("w3", "web"),
        &auth,
        Some(json!({"state": "running"})),
    )
    .await;
    assert_ne!(a.run("web"), w3_old);
    for _ in 0..4 {
        advance(4).await;
        // w1: an agent token naming a wrong run.
        let q = send(
            &app,
            "GET",
            "/v1/allocations/w1/tasks/web/start-condition",
            &[("authorization", agent.as_str()), ("taskgate-run", "1")],
            None,
        )
        .await;
        eprintln!("w1 query with a wrong run: {}", q.status);
        // w2: a reader, with and without the current run.
        let q = send(
            &app,
            "GET",
            "/v1/allocations/w2/tasks/web/start-condition",
            &[("authorization", reader.as_str())],
            None,
        )
        .await;
        assert_eq!(q.status, StatusCode::OK, "{}", q.body);
        let q = send(
            &app,
            "GET",
            "/v1/allocations/w2/tasks/web/start-condition",
            &[
                ("authorization", reader.as_str()),
                ("taskgate-run", runs[1].as_str()),
            ],
            None,
        )
        .await;
        assert_eq!(q.status, StatusCode::OK, "{}", q.body);
        // w3: the superseded run's heartbeats and queries.
        // (Refused run_superseded; task_lost once the new run, silent, is lost.)
        let h = send(
            &app,
            "PUT",
            &heartbeat_uri("w3", "web"),
            &[
                ("authorization", agent.as_str()),
                ("taskgate-run", w3_old.as_str()),
            ],
            None,
        )
        .await;
        assert_eq!(h.status, StatusCode::CONFLICT, "{}", h.body);
        assert!(
            h.body["code"] == "run_superseded" || h.body["code"] == "task_lost",
            "{}",
            h.body
        );
        let q = send(
            &app,
            "GET",
            "/v1/allocations/w3/tasks/web/start-condition",
            &[
                ("authorization", agent.as_str()),
                ("taskgate-run", w3_old.as_str()),
            ],
            None,
        )
        .await;
        assert_eq!(q.status, StatusCode::OK);
    }
    for id in ["w1", "w2", "w3"] {
        let view = send(
            &app,
            "GET",
            &format!("/v1/allocations/{id}/tasks/web"),
            &auth,
            None,
        )
        .await;
        assert_eq!(view.body["lost"], true, "{id}: {}", view.body);
    }
}

// ---------------------------------------------------------------------
// Operator stop
// ---------------------------------------------------------------------

/// Promise: "The order is one per allocation and **sticky**: the first
/// rule that holds sets the reason ... the operator and the agents see the
/// root cause", and `outcome` `failed` with `failed_tasks` when a task
/// failed.
///
/// Attack: init failed (order "Sibling Task Failed"), then the operator
/// stops the allocation: the order is replaced by "Stopped By Operator"
/// and the outcome becomes `stopped`; the root cause is gone from the
/// stop reason.
#[tokio::test]
async fn an_operator_stop_does_not_replace_an_earlier_order() {
    let app = test_app().await;
    app.register_five("o1").await;
    app.report("o1", "proxy", json!({"state": "running"})).await;
    let a = app
        .report("o1", "init", json!({"state": "dead", "failed": true}))
        .await;
    assert_eq!(
        a.task("proxy")["stop_reason"]["type"],
        "Sibling Task Failed",
        "{}",
        a.body
    );
    let a = app.call("POST", "/v1/allocations/o1/stop", None).await;
    eprintln!(
        "stop after a failure: {} {}",
        a.status,
        a.task("proxy")["stop_reason"]
    );
    let dead = json!({"tasks": {"proxy": {"state": "dead"}, "web": {"state": "dead"}, "announce": {"state": "dead"}}});
    app.call("POST", "/v1/allocations/o1/task-states", Some(dead))
        .await;
    let a = app.get("/v1/allocations/o1").await;
    assert_eq!(a.body["coordinator_state"], "poststop", "{}", a.body);
    assert_eq!(
        a.task("proxy")["stop_reason"]["type"],
        "Sibling Task Failed",
        "{}",
        a.body
    );
    assert_eq!(a.body["outcome"], "failed", "{}", a.body);
}

/// Promise: "Stopping an allocation whose tasks are all dead is 409
/// `allocation_finished`" / "a restart of an allocation in `poststop` is
/// 409 `allocation_finished` and changes nothing"; the outcome handed to
/// the poststop tasks (`TASKGATE_ALLOC_OUTCOME`) is the allocation's.
///
/// Attack: the allocation succeeded and is in `poststop`, its cleanup
/// task running (it read `outcome: succeeded`). The operator stops it:
/// 200, and the outcome becomes `stopped` although nothing was stopped.
#[tokio::test]
async fn a_stop_in_poststop_does_not_rewrite_the_outcome() {
    let app = test_app().await;
    let spec =
        json!({"tasks": [{"name": "web"}, {"name": "cleanup", "lifecycle": {"hook": "poststop"}}]});
    register(&app, "o2", spec, None).await;
    app.report("o2", "web", json!({"state": "running"})).await;
    app.report("o2", "web", json!({"state": "dead"})).await;
    let sc = app
        .get("/v1/allocations/o2/tasks/cleanup/start-condition")
        .await;
    assert_eq!(sc.body["outcome"], "succeeded", "{}", sc.body);
    app.report("o2", "cleanup", json!({"state": "running"}))
        .await;
    let stop = app.call("POST", "/v1/allocations/o2/stop", None).await;
    stop.assert_problem(409, "allocation_finished");
    let a = app.get("/v1/allocations/o2").await;
    assert_eq!(a.task("cleanup")["desired"], "run");
    assert_eq!(
        a.body["outcome"], "succeeded",
        "the stop ({}) rewrote the outcome: {}",
        stop.status, a.body
    );
}

/// Promises: an all-tasks restart clears the operator's stop, and the
/// allocation then ends `succeeded`; reports racing a stop are judged on
/// the state the stop left (a pending task's claim after the stop is
/// taken or refused, never lost; the answer says `desired: stop`).
#[tokio::test]
async fn a_restart_after_a_stop_ends_succeeded_and_reports_after_a_stop_see_it() {
    let app = test_app().await;
    app.register_five("o3").await;
    let proxy = app
        .report("o3", "proxy", json!({"state": "running"}))
        .await
        .run("proxy");
    let a = app.call("POST", "/v1/allocations/o3/stop", None).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    // A claim that raced the stop and came second sees the order.
    let a = app.report("o3", "init", json!({"state": "running"})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.task("init")["desired"], "stop", "{}", a.body);
    let init = a.run("init");
    // Stop again: the same order, no new version.
    let again = app.call("POST", "/v1/allocations/o3/stop", None).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.body);
    assert_eq!(again.index(), a.index(), "a second stop changes nothing");
    let a = app
        .call(
            "POST",
            "/v1/allocations/o3/restart",
            Some(json!({"all_tasks": true})),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let a = app.get("/v1/allocations/o3").await;
    assert_eq!(a.task("proxy")["desired"], "run", "{}", a.body);
    // The agents follow the order, then the allocation runs to its end.
    app.report_in("o3", "proxy", &proxy, json!({"state": "pending"}))
        .await;
    app.report_in("o3", "init", &init, json!({"state": "dead"}))
        .await;
    let proxy = app
        .report("o3", "proxy", json!({"state": "running"}))
        .await
        .run("proxy");
    let web = app
        .report("o3", "web", json!({"state": "running"}))
        .await
        .run("web");
    app.report("o3", "announce", json!({"state": "dead"})).await;
    app.report_in("o3", "web", &web, json!({"state": "dead"}))
        .await;
    app.report_in("o3", "proxy", &proxy, json!({"state": "dead"}))
        .await;
    let a = app.get("/v1/allocations/o3").await;
    assert_eq!(a.body["coordinator_state"], "poststop", "{}", a.body);
    assert_eq!(a.body["outcome"], "succeeded", "{}", a.body);
}
