//! Semaphores over HTTP (SEMANTICS "Semaphores", API "Additions of the
//! fourth edition"): the routes, the task view's `acquire`, `grants` and
//! `blocked_by` entries, and a slot passing from one allocation to the
//! next; and what an outside audit tried against them (hostile bodies and
//! names, long lists, positions, blocking reads, JWT scopes).

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
    let sha = common::sha256_hex;
    let tokens = json!({"tokens": [
        {"name": "team-a", "role": "agent", "sha256": sha("a-secret"),
         "alloc_prefixes": ["team-a-"], "semaphore_prefixes": ["team-a-"]},
        {"name": "plain", "role": "agent", "sha256": sha("plain-secret")},
        {"name": "ops-reader", "role": "reader", "sha256": sha("r-secret"),
         "semaphore_prefixes": ["team-"]},
    ]});
    let app = common::with_token_file(Default::default(), tokens, "op-secret").await;
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
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens.json");
    std::fs::write(
        &file,
        json!({"tokens": [{"name": "x", "role": "agent", "sha256": sha("x"),
                           "semaphore_prefixes": ["-bad"]}]})
        .to_string(),
    )
    .unwrap();
    let err = taskgate::http::auth::Auth::load(Some(&file), None).unwrap_err();
    assert!(err.contains("semaphore_prefixes entry \"-bad\""), "{err}");
}

// ---- from the audit: hostile inputs, positions, blocking reads, JWT scopes

async fn put_raw(app: &TestApp, uri: &str, body: &str) -> common::Answer {
    app.raw(
        "PUT",
        uri,
        Some("application/json"),
        body.as_bytes().to_vec(),
    )
    .await
}

/// API: `PUT /v1/semaphores/{name}` `{"limit": n, "grant_timeout"?}`,
/// limit 1 to 10,000, grant_timeout 1 s to 24 h, unknown fields refused,
/// names as allocation IDs. Every hostile value is a 400 naming its field
/// (or `invalid_json`), and nothing is created.
#[tokio::test]
async fn hostile_semaphore_bodies_and_names_are_refused_and_create_nothing() {
    let app = test_app().await;
    for body in [
        r#"{"limit": -1}"#,
        r#"{"limit": 2.5}"#,
        r#"{"limit": 0.0}"#,
        r#"{"limit": -0}"#,
        r#"{"limit": 1e400}"#,
        r#"{"limit": 1e5}"#,
        r#"{"limit": 4294967297}"#,
        r#"{"limit": 18446744073709551616}"#,
        r#"{"limit": "2"}"#,
        r#"{"limit": null}"#,
        r#"{"limit": true}"#,
        r#"{"limit": [2]}"#,
        r#"{}"#,
        r#"{"limit": 2, "limit": 3}"#,
        r#"{"limit": 2, "grant_timeout": "-1s"}"#,
        r#"{"limit": 2, "grant_timeout": "999s"}"#.replace("999s", "86401s").leak(),
        r#"{"limit": 2, "grant_timeout": "1e3s"}"#,
        r#"{"limit": 2, "grant_timeout": 60}"#,
        r#"{"limit": 2, "grant_timeout": "999999999999999999999h"}"#,
        r#"{"limit": 2, "grant_timeout": ""}"#,
        r#"{"limit": 2, "Limit": 3}"#,
        r#"{"limit": 2, "holders": []}"#,
        r#"[{"limit": 2}]"#,
        r#"null"#,
    ] {
        let a = put_raw(&app, "/v1/semaphores/s", body).await;
        assert_eq!(a.status, 400, "{body} → {} {}", a.status, a.body);
    }
    let long = "a".repeat(129);
    for name in [
        long.as_str(),
        "-a",
        ".a",
        "a%20b",
        "a%2Fb",
        "%C3%A9",
        "a%00",
    ] {
        let a = put_raw(&app, &format!("/v1/semaphores/{name}"), r#"{"limit": 1}"#).await;
        assert!(
            a.status == 400 || a.status == 404,
            "{name} → {} {}",
            a.status,
            a.body
        );
    }
    let listed = app.call("GET", "/v1/semaphores", None).await;
    assert_eq!(listed.body, json!([]), "nothing was created");
    // The edges that are valid.
    for (body, limit, timeout) in [
        (r#"{"limit": 1e3}"#, 1000, "1m"),
        (r#"{"limit": 10000, "grant_timeout": "24h"}"#, 10000, "24h"),
        (r#"{"limit": 1, "grant_timeout": "1s"}"#, 1, "1s"),
    ] {
        let a = put_raw(&app, "/v1/semaphores/edge", body).await;
        assert!(a.status == 200 || a.status == 201, "{body}: {}", a.body);
        assert_eq!(a.body["limit"], limit);
        assert_eq!(a.body["grant_timeout"], timeout);
    }
}

/// Hostile `acquire` lists: too many, twice the same, invalid names, non
/// strings; every one a 400 and no allocation made.
#[tokio::test]
async fn hostile_acquire_lists_are_refused() {
    let app = test_app().await;
    for acquire in [
        json!(["a", "b", "c", "d", "e"]),
        json!(["a", "a"]),
        json!(["-a"]),
        json!([""]),
        json!(["a".repeat(129)]),
        json!([1]),
        json!("a"),
        json!(null),
        json!([null]),
        json!({"a": 1}),
    ] {
        let a = register(&app, "x", acquire.clone()).await;
        assert_eq!(a.status, 400, "{acquire} → {}", a.body);
    }
    assert_eq!(app.call("GET", "/v1/allocations/x", None).await.status, 404);
}

/// A registration whose `acquire` is a long list of distinct names (what
/// fits the 1 MiB body limit) must be refused as cheaply as a list of five
/// (`at most 4`): the duplicate check compares every name with every
/// earlier one, so one request costs billions of comparisons.
#[tokio::test]
async fn a_huge_acquire_list_is_refused_at_once() {
    let app = test_app().await;
    let names: Vec<String> = (0..100_000).map(|i| format!("s{i:06}")).collect();
    let body = json!({"tasks": [
        {"name": "migrate", "lifecycle": {"hook": "prestart"}, "acquire": names},
        {"name": "web"}
    ]})
    .to_string();
    assert!(body.len() < 1024 * 1024, "within the body limit");
    let started = std::time::Instant::now();
    let a = put_raw(&app, "/v1/allocations/x", &body).await;
    let took = started.elapsed();
    assert_eq!(a.status, 400, "{}", a.body);
    assert_eq!(
        a.error_fields(),
        ["tasks[0].acquire"],
        "one error, for the list"
    );
    // A bound far above a cheap refusal (milliseconds) and far below the
    // quadratic one it replaced (72 s in a debug build).
    assert!(
        took < std::time::Duration::from_secs(10),
        "refusing one request took {took:?}"
    );
}

/// API: `blocked_by` entries `{"semaphore", "why": "queued"|"not_registered",
/// "position"?}`, one per semaphore in `acquire` order; the start
/// condition and the task view agree.
#[tokio::test]
async fn blocked_by_names_each_semaphore_with_its_position_or_its_absence() {
    let app = test_app().await;
    app.call("PUT", "/v1/semaphores/db", Some(json!({"limit": 1})))
        .await;
    register(&app, "a", json!(["db"])).await;
    let b = register(&app, "b", json!(["later", "db"])).await;
    assert_eq!(b.status, 201, "{}", b.body);
    register(&app, "c", json!(["db"])).await;
    let want = json!([
        {"semaphore": "later", "why": "not_registered"},
        {"semaphore": "db", "why": "queued", "position": 1}
    ]);
    let sc = app
        .call(
            "GET",
            "/v1/allocations/b/tasks/migrate/start-condition?wait=0s",
            None,
        )
        .await;
    assert_eq!(sc.body["blocked_by"], want, "{}", sc.body);
    let view = app.call("GET", "/v1/allocations/b", None).await;
    assert_eq!(view.task("migrate")["blocked_by"], want);
    let c = app.call("GET", "/v1/allocations/c", None).await;
    assert_eq!(
        c.task("migrate")["blocked_by"],
        json!([{"semaphore": "db", "why": "queued", "position": 1}]),
        "b waits on a semaphore that does not exist: it takes no place in db's queue"
    );
}

/// API: `GET /v1/semaphores/{name}` is a blocking query: with `index` it
/// answers when the semaphore *or its line* changes (a queued task
/// leaving), not when `wait` runs out.
#[tokio::test(start_paused = true)]
async fn a_blocking_read_of_a_semaphore_wakes_when_its_queue_moves() {
    if common::on_etcd(
        "a_blocking_read_of_a_semaphore_wakes_when_its_queue_moves",
        "it runs on tokio's paused clock",
    ) {
        return;
    }
    let app = common::test_app_with(common::paused_clock(), Default::default()).await;
    app.call("PUT", "/v1/semaphores/db", Some(json!({"limit": 1})))
        .await;
    for a in ["a", "b", "c"] {
        register(&app, a, json!(["db"])).await;
    }
    common::settle().await;
    let now = app.call("GET", "/v1/semaphores/db", None).await;
    let index = now.index();
    assert_eq!(now.body["queue"].as_array().unwrap().len(), 2);
    let started = tokio::time::Instant::now();
    let uri = format!("/v1/semaphores/db?index={index}&wait=60s");
    let (answer, deleted) = tokio::join!(app.call("GET", &uri, None), async {
        common::settle().await;
        app.call("DELETE", "/v1/allocations/b", None).await
    });
    assert!(deleted.status.is_success(), "{}", deleted.body);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(60),
        "answered only when the wait ran out"
    );
    assert!(answer.index() > index);
    let queue: Vec<&str> = answer.body["queue"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["allocation"].as_str().unwrap())
        .collect();
    assert_eq!(queue, ["c"]);
}

/// operations.md: a JWT issuer's `semaphore_prefixes` are "the semaphores
/// every token of the issuer may read and acquire (none without it)".
#[tokio::test]
async fn a_jwt_issuers_semaphore_prefixes_scope_reading_and_acquiring() {
    use ring::{
        rand::SystemRandom,
        signature::{self, EcdsaKeyPair, KeyPair},
    };
    use taskgate::http::{HttpConfig, auth::Auth, jwt::Issuers};
    let b64 = |bytes: &[u8]| {
        use base64::Engine;
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    };
    let rng = SystemRandom::new();
    let alg = &signature::ECDSA_P256_SHA256_FIXED_SIGNING;
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(alg, &rng).unwrap();
    let pair = EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), &rng).unwrap();
    let point = pair.public_key().as_ref().to_vec();
    let jwks = json!({"keys": [{"kty": "EC", "crv": "P-256", "use": "sig", "alg": "ES256",
        "kid": "k1", "x": b64(&point[1..33]), "y": b64(&point[33..])}]});
    let dir = tempfile::tempdir().unwrap();
    let jwks_file = dir.path().join("jwks.json");
    std::fs::write(&jwks_file, jwks.to_string()).unwrap();
    let issuers = json!({"issuers": [
        {"issuer": "https://a.example", "jwks_file": jwks_file, "audience": "taskgate",
         "role": "agent", "alloc_prefixes": ["team-a-"], "semaphore_prefixes": ["team-a-"]},
        {"issuer": "https://b.example", "jwks_file": jwks_file, "audience": "taskgate",
         "role": "agent", "alloc_prefixes": ["team-b-"]}
    ]});
    let file = dir.path().join("issuers.json");
    std::fs::write(&file, issuers.to_string()).unwrap();
    let mut auth = Auth::load(None, Some("op-secret")).unwrap();
    auth.set_jwt_issuers(Issuers::load(&file).unwrap());
    auth.fetch_jwt_keys().unwrap().await;
    let app = common::test_app_auth(Default::default(), HttpConfig::default(), auth).await;
    let sign = |iss: &str| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let claims = json!({"iss": iss, "aud": "taskgate", "sub": "w", "iat": t, "nbf": t,
                            "exp": t + 600});
        let head = json!({"alg": "ES256", "typ": "JWT", "kid": "k1"});
        let msg = format!(
            "{}.{}",
            b64(head.to_string().as_bytes()),
            b64(claims.to_string().as_bytes())
        );
        let sig = pair.sign(&rng, msg.as_bytes()).unwrap();
        format!("{msg}.{}", b64(sig.as_ref()))
    };
    let (ta, tb) = (sign("https://a.example"), sign("https://b.example"));
    let call = |token: String, method: &'static str, uri: String, body: Option<Value>| {
        let app = &app;
        async move {
            let auth = format!("Bearer {token}");
            app.call_with(method, &uri, &[("authorization", auth.as_str())], body)
                .await
        }
    };
    for name in ["team-a-db", "team-b-db"] {
        let made = call(
            "op-secret".into(),
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
        ta.clone(),
        "PUT",
        "/v1/allocations/team-a-1".into(),
        Some(spec("team-a-db")),
    )
    .await;
    assert_eq!(ok.status, 201, "{}", ok.body);
    call(
        ta.clone(),
        "PUT",
        "/v1/allocations/team-a-2".into(),
        Some(spec("team-b-db")),
    )
    .await
    .assert_problem(403, "forbidden");
    call(
        tb.clone(),
        "PUT",
        "/v1/allocations/team-b-1".into(),
        Some(spec("team-b-db")),
    )
    .await
    .assert_problem(403, "forbidden");
    assert_eq!(
        call(ta.clone(), "GET", "/v1/semaphores/team-a-db".into(), None)
            .await
            .status,
        200
    );
    call(ta.clone(), "GET", "/v1/semaphores/team-b-db".into(), None)
        .await
        .assert_problem(403, "forbidden");
    call(ta.clone(), "GET", "/v1/semaphores".into(), None)
        .await
        .assert_problem(403, "forbidden");
    let listed = call(
        ta.clone(),
        "GET",
        "/v1/semaphores?prefix=team-a-".into(),
        None,
    )
    .await;
    assert_eq!(listed.status, 200);
    assert_eq!(listed.body.as_array().unwrap().len(), 1);
    // A page token past the prefix shows nothing outside it.
    let sneaky = call(
        ta.clone(),
        "GET",
        "/v1/semaphores?prefix=team-a-&next_token=team-b-db".into(),
        None,
    )
    .await;
    assert_eq!(sneaky.status, 200);
    assert_eq!(sneaky.body, json!([]));
    call(tb, "GET", "/v1/semaphores/team-b-db".into(), None)
        .await
        .assert_problem(403, "forbidden");
    call(
        ta,
        "PUT",
        "/v1/semaphores/team-a-db".into(),
        Some(json!({"limit": 9})),
    )
    .await
    .assert_problem(403, "forbidden");
}
