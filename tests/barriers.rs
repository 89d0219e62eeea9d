//! Barriers over HTTP (SEMANTICS "Barriers", API "Additions of the fourth
//! edition"): the task spec's `barrier`, `GET /v1/barriers/{name}`, the
//! `blocked_by` entry, parked start conditions released together, the
//! refusals at registration and a timeout's stop order.

mod common;

use common::{TestApp, test_app};
use serde_json::{Value, json};

/// Allocation `id` with one main task `worker` at `barrier`.
async fn register(app: &TestApp, id: &str, barrier: Value) -> common::Answer {
    app.call(
        "PUT",
        &format!("/v1/allocations/{id}"),
        Some(json!({"tasks": [{"name": "worker", "barrier": barrier}]})),
    )
    .await
}

fn train(size: u64) -> Value {
    json!({"name": "train-42", "size": size, "timeout": "10m"})
}

async fn start_condition(app: &TestApp, id: &str, query: &str) -> common::Answer {
    app.call(
        "GET",
        &format!("/v1/allocations/{id}/tasks/worker/start-condition{query}"),
        None,
    )
    .await
}

/// Reads barrier `name` (blocking reads, bounded) until `done` holds.
async fn barrier_until(app: &TestApp, name: &str, done: impl Fn(&Value) -> bool) -> common::Answer {
    let mut index = 0;
    for _ in 0..20 {
        let b = app
            .call(
                "GET",
                &format!("/v1/barriers/{name}?index={index}&wait=30s"),
                None,
            )
            .await;
        assert_eq!(b.status, 200, "{}", b.body);
        if done(&b.body) {
            return b;
        }
        index = b.index();
    }
    panic!("barrier {name} never came to what the test waits for");
}

#[tokio::test]
async fn four_members_gather_and_their_parked_polls_are_released_together() {
    let app = test_app().await;
    for id in ["train-1", "train-2", "train-3"] {
        let r = register(&app, id, train(4)).await;
        assert_eq!(r.status, 201, "{}", r.body);
        assert_eq!(
            r.body["tasks"][0]["barrier"],
            json!({"name": "train-42", "size": 4, "timeout": "10m"})
        );
    }
    let b = app.call("GET", "/v1/barriers/train-42", None).await;
    assert_eq!(b.status, 200, "{}", b.body);
    assert_eq!(b.body["state"], "gathering");
    assert_eq!(b.body["arrived"], 3);
    assert_eq!(b.body["size"], 4);
    assert_eq!(b.body["timeout"], "10m");
    assert_eq!(b.body["opened_at"], Value::Null);
    let members: Vec<(&str, &str)> = b.body["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            assert!(m["arrived_at"].is_string(), "{m}");
            (
                m["allocation"].as_str().unwrap(),
                m["standing"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        members,
        [
            ("train-1", "arrived"),
            ("train-2", "arrived"),
            ("train-3", "arrived")
        ]
    );
    let sc = app
        .call("GET", "/v1/allocations/train-2/tasks/worker", None)
        .await;
    assert_eq!(sc.body["allowed"], false);
    assert_eq!(
        sc.body["blocked_by"],
        json!([{"barrier": "train-42", "why": "gathering", "arrived": 3, "size": 4}])
    );
    // Every member parks its poll; the fourth registration opens the
    // barrier and answers them all.
    let q = "?wait=60s";
    let (a1, a2, a3, last) = tokio::join!(
        start_condition(&app, "train-1", q),
        start_condition(&app, "train-2", q),
        start_condition(&app, "train-3", q),
        async {
            common::settle().await;
            register(&app, "train-4", train(4)).await
        }
    );
    assert_eq!(last.status, 201, "{}", last.body);
    for a in [a1, a2, a3] {
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(a.body["allowed"], true, "{}", a.body);
        assert_eq!(a.body["blocked_by"], json!([]));
    }
    // The fourth member follows the decision by a write of its own: the
    // barrier's blocking read sees it.
    let b = barrier_until(&app, "train-42", |b| {
        b["members"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["standing"] == "passed")
    })
    .await;
    assert_eq!(b.body["state"], "open", "{}", b.body);
    assert!(b.body["opened_at"].is_string());
    assert!(
        b.body["members"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["standing"] == "passed" && m["arrived_at"].is_null()),
        "{}",
        b.body
    );
    let tl = app
        .call("GET", "/v1/allocations/train-1/events", None)
        .await;
    let opened: Vec<&Value> = tl.body["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "Barrier Open")
        .collect();
    assert_eq!(opened.len(), 1, "{}", tl.body);
    assert_eq!(opened[0]["details"]["barrier"], "train-42");
    assert_eq!(opened[0]["task"], "worker");
}

#[tokio::test]
async fn members_that_disagree_or_come_too_late_are_refused_with_their_codes() {
    let app = test_app().await;
    assert_eq!(register(&app, "a", train(2)).await.status, 201);
    let other_size = register(&app, "x", train(3)).await;
    assert_eq!(other_size.status, 409, "{}", other_size.body);
    assert_eq!(other_size.body["code"], "barrier_mismatch");
    assert!(
        other_size.body["detail"]
            .as_str()
            .unwrap()
            .contains("size 2 and timeout 10m"),
        "{}",
        other_size.body
    );
    let no_timeout = register(&app, "x", json!({"name": "train-42", "size": 2})).await;
    assert_eq!(no_timeout.body["code"], "barrier_mismatch");
    assert_eq!(register(&app, "b", train(2)).await.status, 201);
    // Full and open: closed, which wins over a mismatch.
    for barrier in [train(2), train(5)] {
        let late = register(&app, "x", barrier).await;
        assert_eq!(late.status, 409, "{}", late.body);
        assert_eq!(late.body["code"], "barrier_closed");
    }
    let gone = app.call("GET", "/v1/allocations/x", None).await;
    assert_eq!(gone.status, 404, "nothing was registered");
    let missing = app.call("GET", "/v1/barriers/nobody-names-it", None).await;
    assert_eq!(missing.status, 404);
    assert_eq!(missing.body["code"], "barrier_not_found");
    // Each on `/errors` (whose every code has its section: tests/api.rs).
    for code in ["barrier_closed", "barrier_mismatch", "barrier_not_found"] {
        let entry = taskgate::http::error::CODES.iter().find(|c| c.0 == code);
        assert!(entry.is_some_and(|c| c.1 == 404 || c.1 == 409), "{code}");
    }
}

#[tokio::test]
async fn a_barrier_out_of_range_or_misspelled_is_refused_naming_its_field() {
    let app = test_app().await;
    for (barrier, field) in [
        (json!({"name": "t", "size": 1}), "tasks[0].barrier.size"),
        (json!({"name": "t", "size": 1001}), "tasks[0].barrier.size"),
        (json!({"name": "t", "size": 70000}), "tasks[0].barrier.size"),
        (json!({"name": "t", "size": 2.5}), "tasks[0].barrier.size"),
        (json!({"name": "t", "size": -2}), "tasks[0].barrier.size"),
        (
            json!({"name": "t", "size": 2, "timeout": "0s"}),
            "tasks[0].barrier.timeout",
        ),
        (
            json!({"name": "t", "size": 2, "timeout": "8d"}),
            "tasks[0].barrier.timeout",
        ),
        (
            json!({"name": "t", "size": 2, "timeout": "soon"}),
            "tasks[0].barrier.timeout",
        ),
        (json!({"name": "-t", "size": 2}), "tasks[0].barrier.name"),
    ] {
        let r = register(&app, "x", barrier.clone()).await;
        assert_eq!(r.status, 400, "{barrier}: {}", r.body);
        assert_eq!(r.body["code"], "invalid_request", "{barrier}: {}", r.body);
        assert_eq!(r.body["errors"][0]["field"], field, "{barrier}: {}", r.body);
    }
    // JSON has one kind of number: `4.0` is the size 4 (the schema says
    // `integer`, which it is). Refused before as not a u64.
    let r = register(&app, "whole", json!({"name": "w", "size": 4.0})).await;
    assert_eq!(r.status, 201, "{}", r.body);
    let view = app.call("GET", "/v1/barriers/w", None).await;
    assert_eq!(view.body["size"], 4, "{}", view.body);
    // A poststop task is the cleanup, which no stop order reaches: it
    // meets at no barrier (a timeout would hold it for ever).
    let r = app
        .call(
            "PUT",
            "/v1/allocations/x",
            Some(json!({"tasks": [
                {"name": "web"},
                {"name": "clean", "lifecycle": {"hook": "poststop"}, "barrier": {"name": "t", "size": 2}}
            ]})),
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(
        r.body["errors"][0]["field"], "tasks[1].barrier",
        "{}",
        r.body
    );
    for barrier in [
        json!({"name": "t", "size": 2, "members": 3}),
        json!({"name": "t"}),
        json!({"name": "t", "size": "2"}),
        json!(["t", 2]),
    ] {
        let r = register(&app, "x", barrier.clone()).await;
        assert_eq!(r.status, 400, "{barrier}: {}", r.body);
        assert_eq!(r.body["code"], "invalid_json", "{barrier}: {}", r.body);
    }
    assert_eq!(
        app.call("GET", "/v1/barriers/t", None).await.status,
        404,
        "no refused registration made a member"
    );
}

#[tokio::test(start_paused = true)]
async fn a_barrier_that_does_not_gather_in_time_stops_and_fails_its_members() {
    if common::on_etcd(
        "a_barrier_that_does_not_gather_in_time_stops_and_fails_its_members",
        "it runs on tokio's paused clock",
    ) {
        return;
    }
    let app = common::test_app_with(common::paused_clock(), Default::default()).await;
    let barrier = json!({"name": "train-7", "size": 3, "timeout": "30s"});
    for id in ["a", "b"] {
        assert_eq!(register(&app, id, barrier.clone()).await.status, 201);
    }
    common::settle().await;
    let (told, ()) = tokio::join!(start_condition(&app, "a", "?wait=5m"), async {
        common::settle().await;
        tokio::time::advance(std::time::Duration::from_secs(31)).await;
    });
    assert_eq!(told.body["desired"], "stop", "{}", told.body);
    assert_eq!(
        told.body["stop_reason"],
        json!({"type": "Barrier Timeout", "task": null, "stage": null, "barrier": "train-7"})
    );
    assert_eq!(
        told.body["blocked_by"],
        json!([{"barrier": "train-7", "why": "timed_out", "size": 3}])
    );
    let b = app.call("GET", "/v1/barriers/train-7", None).await;
    assert_eq!(b.body["state"], "timed_out");
    // The worker never ran: its agent reports it dead; the allocation
    // fails, naming it.
    let dead = app
        .call(
            "PUT",
            "/v1/allocations/b/tasks/worker/state",
            Some(json!({"state": "dead"})),
        )
        .await;
    assert_eq!(dead.status, 200, "{}", dead.body);
    assert_eq!(dead.body["outcome"], "failed", "{}", dead.body);
    assert_eq!(
        dead.body["failed_tasks"],
        json!(["worker"]),
        "{}",
        dead.body
    );
    let tl = app.call("GET", "/v1/allocations/b/events", None).await;
    let types: Vec<&str> = tl.body["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert!(types.contains(&"Barrier Timeout"), "{types:?}");
    let late = register(&app, "c", barrier).await;
    assert_eq!(late.body["code"], "barrier_closed");
}

#[tokio::test]
async fn tokens_join_and_read_only_the_barriers_within_their_prefixes() {
    let tokens = json!({"tokens": [
        {"name": "team-a", "role": "agent", "sha256": common::sha256_hex("a-secret"),
         "semaphore_prefixes": ["team-a-"]},
    ]});
    let app = common::with_token_file(Default::default(), tokens, "op-secret").await;
    let call = |method: &'static str, uri: &'static str, body: Option<Value>| {
        app.call_with(method, uri, &[("authorization", "Bearer a-secret")], body)
    };
    let spec = |b: &str| json!({"tasks": [{"name": "worker", "barrier": {"name": b, "size": 2}}]});
    let ok = call("PUT", "/v1/allocations/a-1", Some(spec("team-a-train"))).await;
    assert_eq!(ok.status, 201, "{}", ok.body);
    // Another team's barrier: joining it could close it to that team.
    let out = call("PUT", "/v1/allocations/a-2", Some(spec("team-b-train"))).await;
    assert_eq!(out.status, 403, "{}", out.body);
    assert!(
        out.body["detail"]
            .as_str()
            .unwrap()
            .contains("may not meet at barrier \"team-b-train\""),
        "{}",
        out.body
    );
    assert_eq!(
        call("GET", "/v1/barriers/team-a-train", None).await.status,
        200
    );
    assert_eq!(
        call("GET", "/v1/barriers/team-b-train", None).await.status,
        403
    );
}
