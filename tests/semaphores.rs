//! Semaphores over HTTP (SEMANTICS "Semaphores", API "Additions of the
//! fourth edition"): the routes, the task view's `acquire`, `grants` and
//! `blocked_by` entries, and a slot passing from one allocation to the
//! next.

mod common;

use common::{TestApp, test_app};
use serde_json::{Value, json};

async fn register(app: &TestApp, id: &str, acquire: Value) -> common::Answer {
    app.call(
        "PUT",
        &format!("/v1/allocations/{id}"),
        Some(json!({"tasks": [
            {"name": "migrate", "lifecycle": {"hook": "prestart"}, "acquire": acquire},
            {"name": "web"}
        ]})),
    )
    .await
}

/// The start condition; with `wait`, parked until the task is allowed
/// (or told to stop) or the wait ends.
async fn start_condition(app: &TestApp, id: &str, wait: &str) -> common::Answer {
    app.call(
        "GET",
        &format!("/v1/allocations/{id}/tasks/migrate/start-condition?wait={wait}"),
        None,
    )
    .await
}

async fn state(app: &TestApp, id: &str, state: &str, run: Option<&str>) -> common::Answer {
    let headers: Vec<(&str, &str)> = run.map(|r| ("taskgate-run", r)).into_iter().collect();
    app.call_with(
        "PUT",
        &format!("/v1/allocations/{id}/tasks/migrate/state"),
        &headers,
        Some(json!({"state": state})),
    )
    .await
}

/// Polls the start condition until `allowed` (bounded by its own wait).
async fn allowed(app: &TestApp, id: &str) -> Value {
    for _ in 0..20 {
        let a = start_condition(app, id, "30s").await;
        assert_eq!(a.status, 200, "{}", a.body);
        if a.body["allowed"] == true {
            return a.body;
        }
    }
    panic!("{id} was never allowed");
}

#[tokio::test]
async fn a_slot_passes_from_allocation_to_allocation_in_order() {
    let app = test_app().await;
    let made = app
        .call(
            "PUT",
            "/v1/semaphores/db-migrations",
            Some(json!({"limit": 1})),
        )
        .await;
    assert_eq!(made.status, 201, "{}", made.body);
    assert_eq!(made.body["limit"], 1);
    assert_eq!(made.body["grant_timeout"], "1m");
    let again = app
        .call(
            "PUT",
            "/v1/semaphores/db-migrations",
            Some(json!({"limit": 1})),
        )
        .await;
    assert_eq!(again.status, 200, "the same again is no creation");

    for id in ["app-1", "app-2", "app-3"] {
        let a = register(&app, id, json!(["db-migrations"])).await;
        assert_eq!(a.status, 201, "{}", a.body);
        assert_eq!(a.task("migrate")["acquire"], json!(["db-migrations"]));
    }
    let first = allowed(&app, "app-1").await;
    let fence = first["grants"][0]["fence"].as_u64().unwrap();
    assert_eq!(
        first["grants"],
        json!([{"semaphore": "db-migrations", "fence": fence}])
    );
    assert_eq!(first["blocked_by"], json!([]));

    let second = start_condition(&app, "app-2", "0s").await;
    assert_eq!(second.body["allowed"], false);
    assert_eq!(second.body["grants"], json!([]));
    assert_eq!(
        second.body["blocked_by"],
        json!([{"semaphore": "db-migrations", "why": "queued", "position": 1}])
    );
    let third = app.call("GET", "/v1/allocations/app-3", None).await;
    assert_eq!(
        third.task("migrate")["blocked_by"],
        json!([{"semaphore": "db-migrations", "why": "queued", "position": 2}])
    );

    let sem = app.call("GET", "/v1/semaphores/db-migrations", None).await;
    assert_eq!(sem.status, 200);
    assert_eq!(sem.body["holders"][0]["allocation"], "app-1");
    assert_eq!(sem.body["holders"][0]["fence"], fence);
    assert_eq!(
        sem.body["holders"][0]["run"],
        Value::Null,
        "granted, not started"
    );
    let queue: Vec<&str> = sem.body["queue"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["allocation"].as_str().unwrap())
        .collect();
    assert_eq!(queue, ["app-2", "app-3"]);
    assert!(sem.body["next_fence"].as_u64().unwrap() > fence);

    let running = state(&app, "app-1", "running", None).await;
    let run = running.run("migrate");
    state(&app, "app-1", "dead", Some(&run)).await;
    let timeline = app.call("GET", "/v1/allocations/app-1/events", None).await;
    let slots: Vec<(Value, Value)> = timeline.body["events"]
        .as_array()
        .unwrap_or_else(|| panic!("{}", timeline.body))
        .iter()
        .filter(|e| e["type"] == "Acquired" || e["type"] == "Released")
        .map(|e| (e["type"].clone(), e["details"].clone()))
        .collect();
    assert_eq!(
        slots,
        [
            (
                json!("Acquired"),
                json!({"semaphore": "db-migrations", "fence": fence.to_string()})
            ),
            (
                json!("Released"),
                json!({"semaphore": "db-migrations", "why": "dead"})
            ),
        ]
    );
    let next = allowed(&app, "app-2").await;
    assert!(
        next["grants"][0]["fence"].as_u64().unwrap() > fence,
        "fences grow"
    );
    let third = start_condition(&app, "app-3", "0s").await;
    assert_eq!(third.body["allowed"], false);
    assert_eq!(third.body["blocked_by"][0]["position"], 1);
}

#[tokio::test]
async fn semaphore_routes_refuse_what_is_wrong_and_name_it() {
    let app = test_app().await;
    for (body, field) in [
        (json!({"limit": 0}), "limit"),
        (json!({"limit": 10001}), "limit"),
        (json!({"limit": 2, "grant_timeout": "0s"}), "grant_timeout"),
        (json!({"limit": 2, "grant_timeout": "25h"}), "grant_timeout"),
        (
            json!({"limit": 2, "grant_timeout": "soon"}),
            "grant_timeout",
        ),
    ] {
        let a = app
            .call("PUT", "/v1/semaphores/s", Some(body.clone()))
            .await;
        a.assert_problem(400, "invalid_request");
        assert_eq!(a.error_fields(), [field], "{body}");
    }
    let a = app
        .call(
            "PUT",
            "/v1/semaphores/s",
            Some(json!({"limit": 2, "size": 3})),
        )
        .await;
    assert_eq!(a.status, 400, "unknown field: {}", a.body);
    app.call("GET", "/v1/semaphores/none", None)
        .await
        .assert_problem(404, "semaphore_not_found");
    app.call("DELETE", "/v1/semaphores/none", None)
        .await
        .assert_problem(404, "semaphore_not_found");
    app.call("PUT", "/v1/semaphores/-bad", Some(json!({"limit": 1})))
        .await
        .assert_problem(400, "invalid_request");
    let too_many = register(&app, "x", json!(["a", "b", "c", "d", "e"])).await;
    too_many.assert_problem(400, "invalid_request");
    assert_eq!(too_many.error_fields(), ["tasks[0].acquire"]);
    let twice = register(&app, "x", json!(["a", "a"])).await;
    assert_eq!(twice.error_fields(), ["tasks[0].acquire[1]"]);
}

#[tokio::test]
async fn a_missing_semaphore_blocks_visibly_and_listing_pages_by_name() {
    let app = test_app().await;
    register(&app, "app-1", json!(["later"])).await;
    let a = start_condition(&app, "app-1", "0s").await;
    assert_eq!(
        a.body["blocked_by"],
        json!([{"semaphore": "later", "why": "not_registered"}])
    );
    for name in ["a", "b", "later"] {
        app.call(
            "PUT",
            &format!("/v1/semaphores/{name}"),
            Some(json!({"limit": 5})),
        )
        .await;
    }
    allowed(&app, "app-1").await;
    let page = app.call("GET", "/v1/semaphores?per_page=2", None).await;
    let names: Vec<&str> = page
        .body
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["a", "b"]);
    let next = page.header("x-taskgate-nexttoken").unwrap().to_owned();
    let rest = app
        .call(
            "GET",
            &format!("/v1/semaphores?per_page=2&next_token={next}"),
            None,
        )
        .await;
    assert_eq!(rest.body[0]["name"], "later");
    assert_eq!(rest.body[0]["holders"][0]["allocation"], "app-1");
    assert!(rest.header("x-taskgate-nexttoken").is_none());
    let deleted = app.call("DELETE", "/v1/semaphores/later", None).await;
    assert_eq!(deleted.status, 204);
    let a = app.call("GET", "/v1/allocations/app-1", None).await;
    assert_eq!(
        a.task("migrate")["allowed"],
        true,
        "a holder keeps its slot"
    );
}

/// `semaphore_prefixes` (API "Semaphores"): a token reads and acquires only
/// the semaphores within them (none without them); an operator's, every
/// one; a token's `alloc_prefixes` do not cover semaphores.
#[tokio::test]
async fn tokens_read_and_acquire_only_the_semaphores_within_their_prefixes() {
    use taskgate::http::{HttpConfig, auth::Auth};
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens.json");
    let sha = |s: &str| {
        use sha2::Digest;
        sha2::Sha256::digest(s.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    let tokens = json!({"tokens": [
        {"name": "team-a", "role": "agent", "sha256": sha("a-secret"),
         "alloc_prefixes": ["team-a-"], "semaphore_prefixes": ["team-a-"]},
        {"name": "plain", "role": "agent", "sha256": sha("plain-secret")},
        {"name": "ops-reader", "role": "reader", "sha256": sha("r-secret"),
         "semaphore_prefixes": ["team-"]},
    ]});
    std::fs::write(&file, tokens.to_string()).unwrap();
    let auth = Auth::load(Some(&file), Some("op-secret")).unwrap();
    let app = common::test_app_auth(Default::default(), HttpConfig::default(), auth).await;
    let as_ = |secret: &'static str| [("authorization", format!("Bearer {secret}"))];
    let call = |secret: &'static str, method: &'static str, uri: String, body: Option<Value>| {
        let app = &app;
        async move {
            let h = as_(secret);
            let headers: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
            app.call_with(method, &uri, &headers, body).await
        }
    };
    for name in ["team-a-db", "team-b-db"] {
        let made = call(
            "op-secret",
            "PUT",
            format!("/v1/semaphores/{name}"),
            Some(json!({"limit": 1})),
        )
        .await;
        assert_eq!(made.status, 201, "{}", made.body);
    }
    let spec = |sem: &str| {
        json!({"tasks": [{"name": "migrate", "lifecycle": {"hook": "prestart"}, "acquire": [sem]},
                         {"name": "web"}]})
    };
    let ok = call(
        "a-secret",
        "PUT",
        "/v1/allocations/team-a-1".into(),
        Some(spec("team-a-db")),
    )
    .await;
    assert_eq!(ok.status, 201, "{}", ok.body);
    let other = call(
        "a-secret",
        "PUT",
        "/v1/allocations/team-a-2".into(),
        Some(spec("team-b-db")),
    )
    .await;
    other.assert_problem(403, "forbidden");
    assert!(
        other.body["detail"].as_str().unwrap().contains("team-b-db"),
        "{}",
        other.body
    );
    let none = call(
        "plain-secret",
        "PUT",
        "/v1/allocations/p-1".into(),
        Some(spec("team-a-db")),
    )
    .await;
    none.assert_problem(403, "forbidden");

    // Reading: within the prefixes only; alloc_prefixes give none.
    assert_eq!(
        call("a-secret", "GET", "/v1/semaphores/team-a-db".into(), None)
            .await
            .status,
        200
    );
    call("a-secret", "GET", "/v1/semaphores/team-b-db".into(), None)
        .await
        .assert_problem(403, "forbidden");
    call("plain-secret", "GET", "/v1/semaphores".into(), None)
        .await
        .assert_problem(403, "forbidden");
    let listed = call(
        "r-secret",
        "GET",
        "/v1/semaphores?prefix=team-".into(),
        None,
    )
    .await;
    assert_eq!(listed.status, 200);
    assert_eq!(listed.body.as_array().unwrap().len(), 2);
    call("r-secret", "GET", "/v1/semaphores".into(), None)
        .await
        .assert_problem(403, "forbidden");
    // Changes are the operator's.
    call(
        "a-secret",
        "PUT",
        "/v1/semaphores/team-a-db".into(),
        Some(json!({"limit": 5})),
    )
    .await
    .assert_problem(403, "forbidden");
    call(
        "r-secret",
        "DELETE",
        "/v1/semaphores/team-a-db".into(),
        None,
    )
    .await
    .assert_problem(403, "forbidden");
    assert_eq!(
        call("op-secret", "GET", "/v1/semaphores".into(), None)
            .await
            .status,
        200
    );
    // A token file's prefix must read as the start of a name.
    std::fs::write(
        &file,
        json!({"tokens": [{"name": "x", "role": "agent", "sha256": sha("x"),
                           "semaphore_prefixes": ["-bad"]}]})
        .to_string(),
    )
    .unwrap();
    let err = Auth::load(Some(&file), None).unwrap_err();
    assert!(err.contains("semaphore_prefixes entry \"-bad\""), "{err}");
}
