//! The authorization matrix: every route × every role, scoped agent
//! tokens, missing and wrong tokens.

mod common;

use axum::{
    body::Body,
    http::{Request, header},
};
use common::{Answer, TestApp, five_tasks, test_app_auth};
use serde_json::{Value, json};
use taskgate::{http::HttpConfig, http::auth::Auth, registry::RegistryConfig};

fn hex_sha256(secret: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(secret.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

async fn secured(public_metrics: bool) -> TestApp {
    secured_with(RegistryConfig::default(), public_metrics).await
}

async fn secured_with(registry: RegistryConfig, public_metrics: bool) -> TestApp {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens.json");
    let tokens = json!({"tokens": [
        {"name": "agent-all", "role": "agent", "sha256": hex_sha256("agent-secret")},
        {"name": "agent-web", "role": "agent", "sha256": hex_sha256("web-secret"), "alloc_prefixes": ["web-"]},
        {"name": "reader", "role": "reader", "sha256": hex_sha256("reader-secret")},
    ]});
    std::fs::write(&file, tokens.to_string()).unwrap();
    let mut auth = Auth::load(Some(&file), Some("operator-secret")).unwrap();
    auth.public_metrics = public_metrics;
    test_app_auth(registry, HttpConfig::default(), auth).await
}

async fn call(
    app: &TestApp,
    token: Option<&str>,
    method: &str,
    uri: &str,
    body: Option<Value>,
) -> Answer {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let body = match body {
        Some(v) => {
            req = req.header(header::CONTENT_TYPE, "application/json");
            Body::from(v.to_string())
        }
        None => Body::empty(),
    };
    app.send(req.body(body).unwrap()).await
}

/// Every route, with a request that succeeds for a role allowed to make it.
fn routes(id: &str) -> Vec<(&'static str, String, Option<Value>, &'static str)> {
    // (method, uri, body, least role: "public", "token", "reader", "agent", "operator")
    vec![
        ("GET", "/v1/health".into(), None, "public"),
        ("GET", "/".into(), None, "public"),
        ("GET", "/openapi.json".into(), None, "public"),
        ("GET", "/docs/".into(), None, "public"),
        ("GET", "/ui".into(), None, "public"),
        ("GET", format!("/ui/allocations/{id}"), None, "public"),
        ("GET", "/ui/app.js".into(), None, "public"),
        ("GET", "/metrics".into(), None, "token"),
        (
            "GET",
            format!("/v1/allocations?prefix={id}"),
            None,
            "reader",
        ),
        ("GET", format!("/v1/allocations/{id}"), None, "reader"),
        (
            "GET",
            format!("/v1/allocations/{id}/tasks/init"),
            None,
            "reader",
        ),
        (
            "GET",
            format!("/v1/allocations/{id}/tasks/init/start-condition"),
            None,
            "reader",
        ),
        (
            "PUT",
            format!("/v1/allocations/{id}"),
            Some(five_tasks()),
            "agent",
        ),
        (
            "PUT",
            format!("/v1/allocations/{id}/tasks/init/state"),
            Some(json!({"state": "running"})),
            "agent",
        ),
        (
            "POST",
            format!("/v1/allocations/{id}/task-states"),
            Some(json!({"tasks": {"proxy": {"state": "running"}}})),
            "agent",
        ),
        (
            "POST",
            format!("/v1/allocations/{id}/restore"),
            Some(json!({"tasks": {}})),
            "agent",
        ),
        (
            "POST",
            format!("/v1/allocations/{id}/restart"),
            Some(json!({})),
            "operator",
        ),
        ("DELETE", format!("/v1/allocations/{id}"), None, "operator"),
    ]
}

fn rank(role: &str) -> u8 {
    match role {
        "public" => 0,
        "token" => 1,
        "reader" => 2,
        "agent" => 3,
        "operator" => 4,
        other => panic!("{other}"),
    }
}

#[tokio::test]
async fn every_route_against_every_role() {
    let app = secured(false).await;
    let roles = [
        (None, 0u8),
        (Some("reader-secret"), 2),
        (Some("agent-secret"), 3),
        (Some("operator-secret"), 4),
    ];
    for (token, level) in roles {
        // A fresh allocation per role, registered by the operator, so each
        // role's requests start from the same state.
        let id = format!("web-{level}");
        let reg = call(
            &app,
            Some("operator-secret"),
            "PUT",
            &format!("/v1/allocations/{id}"),
            Some(five_tasks()),
        )
        .await;
        assert_eq!(reg.status, 201);
        for (method, uri, body, least) in routes(&id) {
            let need = rank(least);
            let a = call(&app, token, method, &uri, body).await;
            let label = format!("{token:?} {method} {uri}");
            if need == 0 || (need == 1 && level >= 1) || (need >= 2 && level >= need) {
                // `/` answers with a redirect to the web view.
                assert!(
                    a.status.is_success() || a.status.is_redirection(),
                    "{label}: {} {}",
                    a.status,
                    a.body
                );
            } else if level == 0 {
                a.assert_problem(401, "unauthorized");
                assert_eq!(
                    a.header("www-authenticate"),
                    Some("Bearer realm=\"taskgate\""),
                    "{label}"
                );
            } else {
                a.assert_problem(403, "forbidden");
            }
        }
    }
}

#[tokio::test]
async fn a_scoped_agent_token_only_touches_its_prefixes() {
    let app = secured(false).await;
    for id in ["web-1", "db-1"] {
        call(
            &app,
            Some("operator-secret"),
            "PUT",
            &format!("/v1/allocations/{id}"),
            Some(five_tasks()),
        )
        .await;
    }
    let t = Some("web-secret");
    for (method, uri, body, least) in routes("web-1") {
        if least == "operator" || least == "public" {
            continue;
        }
        let a = call(&app, t, method, &uri, body).await;
        assert!(
            a.status.is_success(),
            "{method} {uri}: {} {}",
            a.status,
            a.body
        );
    }
    for (method, uri, body, least) in routes("db-1") {
        if least == "public" || least == "token" {
            continue;
        }
        let a = call(&app, t, method, &uri, body).await;
        a.assert_problem(403, "forbidden");
    }
    call(&app, t, "GET", "/v1/allocations", None)
        .await
        .assert_problem(403, "forbidden");
    call(&app, t, "GET", "/v1/allocations?prefix=db", None)
        .await
        .assert_problem(403, "forbidden");
    assert!(
        call(&app, t, "GET", "/v1/allocations?prefix=web-", None)
            .await
            .status
            .is_success()
    );
    // The scope is checked on the ID the handler uses, percent-decoded:
    // `%77eb-1` is `web-1`, `%64b-1` is `db-1`.
    let a = call(&app, t, "GET", "/v1/allocations/%77eb-1", None).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.body["id"], "web-1");
    call(&app, t, "GET", "/v1/allocations/%64b-1", None)
        .await
        .assert_problem(403, "forbidden");
}

/// A cycle through held allocations is answered with its path, but a step
/// in an allocation the registering token may not read is not named to it
/// (the operator sees the whole path).
#[tokio::test]
async fn a_cycle_s_path_names_no_allocation_the_token_may_not_read() {
    let app = secured(false).await;
    let op = Some("operator-secret");
    let dep = |task: &str, alloc: &str, target: &str| {
        json!({"tasks": [{"name": task,
            "depends_on": [{"task": target, "allocation": alloc, "condition": "running"}]}]})
    };
    let a = call(
        &app,
        op,
        "PUT",
        "/v1/allocations/other-1",
        Some(dep("t", "web-2", "w")),
    )
    .await;
    assert_eq!(a.status, 201, "{}", a.body);
    let a = call(
        &app,
        op,
        "PUT",
        "/v1/allocations/web-3",
        Some(dep("a", "other-1", "t")),
    )
    .await;
    assert_eq!(a.status, 201, "{}", a.body);
    let closing = dep("w", "web-3", "a");
    let a = call(
        &app,
        Some("web-secret"),
        "PUT",
        "/v1/allocations/web-2",
        Some(closing.clone()),
    )
    .await;
    a.assert_problem(409, "dependency_cycle");
    assert_eq!(
        a.body["path"],
        json!(["web-2/w", "web-3/a", taskgate::http::HIDDEN_STEP, "web-2/w"]),
        "{}",
        a.body
    );
    assert!(!a.body.to_string().contains("other-1"), "{}", a.body);
    let a = call(&app, op, "PUT", "/v1/allocations/web-2", Some(closing)).await;
    a.assert_problem(409, "dependency_cycle");
    assert_eq!(
        a.body["path"],
        json!(["web-2/w", "web-3/a", "other-1/t", "web-2/w"]),
        "{}",
        a.body
    );
}

/// A dependency reads its target: a token may declare one only on
/// allocations it may read (403 otherwise, nothing registered).
#[tokio::test]
async fn a_dependency_needs_a_token_that_may_read_its_target() {
    let app = secured(false).await;
    let spec = |target: &str| {
        json!({"tasks": [{"name": "web",
            "depends_on": [{"task": "db", "allocation": target, "condition": "running"}]}]})
    };
    let t = Some("web-secret");
    let a = call(&app, t, "PUT", "/v1/allocations/web-1", Some(spec("db-1"))).await;
    a.assert_problem(403, "forbidden");
    assert!(
        a.body["detail"].as_str().unwrap().contains("\"db-1\""),
        "{}",
        a.body
    );
    assert_eq!(
        call(
            &app,
            Some("operator-secret"),
            "GET",
            "/v1/allocations/web-1",
            None
        )
        .await
        .status,
        404
    );
    let a = call(
        &app,
        t,
        "PUT",
        "/v1/allocations/web-1",
        Some(spec("web-db")),
    )
    .await;
    assert_eq!(a.status, 201, "{}", a.body);
    // A token for every ID may depend on any.
    let a = call(
        &app,
        Some("agent-secret"),
        "PUT",
        "/v1/allocations/x-1",
        Some(spec("db-1")),
    )
    .await;
    assert_eq!(a.status, 201, "{}", a.body);
}

#[tokio::test]
async fn missing_and_wrong_tokens_are_401_in_both_headers() {
    let app = secured(false).await;
    call(&app, None, "GET", "/v1/allocations", None)
        .await
        .assert_problem(401, "unauthorized");
    call(&app, Some("guess"), "GET", "/v1/allocations", None)
        .await
        .assert_problem(401, "unauthorized");
    let via_header = app
        .send(
            Request::get("/v1/allocations")
                .header("x-taskgate-token", "reader-secret")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(via_header.status, 200);
    let basic = app
        .send(
            Request::get("/v1/allocations")
                .header(header::AUTHORIZATION, "Basic cmVhZGVyLXNlY3JldA==")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    basic.assert_problem(401, "unauthorized");
    // Another scheme in Authorization (a proxy's) does not hide the token
    // in X-Taskgate-Token.
    let both = app
        .send(
            Request::get("/v1/allocations")
                .header(header::AUTHORIZATION, "Basic cHJveHk6cGFzcw==")
                .header("x-taskgate-token", "reader-secret")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(both.status, 200, "{}", both.body);
    // A token sent under another scheme is said to be under the wrong
    // scheme, not missing.
    let token_scheme = app
        .send(
            Request::get("/v1/allocations")
                .header(header::AUTHORIZATION, "Token reader-secret")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    token_scheme.assert_problem(401, "unauthorized");
    let detail = token_scheme.body["detail"].as_str().unwrap();
    assert!(
        detail.contains("\"Token\"") && detail.contains("Bearer"),
        "{detail}"
    );
    assert!(!detail.contains("required"), "{detail}");
    let basic_detail = basic.body["detail"].as_str().unwrap();
    assert!(basic_detail.contains("\"Basic\""), "{basic_detail}");
    // With no Authorization header at all, a token is said to be missing.
    let none = call(&app, None, "GET", "/v1/allocations", None).await;
    assert!(
        none.body["detail"]
            .as_str()
            .unwrap()
            .contains("a token is required"),
        "{}",
        none.body
    );
    // Unknown routes are 404 for everyone: nothing is behind them.
    call(&app, None, "GET", "/nowhere", None)
        .await
        .assert_problem(404, "not_found");
}

#[tokio::test]
async fn metrics_can_be_public() {
    let app = secured(true).await;
    assert_eq!(call(&app, None, "GET", "/metrics", None).await.status, 200);
    call(&app, None, "GET", "/v1/allocations", None)
        .await
        .assert_problem(401, "unauthorized");
}

/// Quotas: one token's waits and registrations are bounded by its own
/// limits (429 `quota_exceeded`), so another tenant is still served; the
/// server's allocation limit holds for everyone; an idempotent
/// re-registration counts against nothing.
#[tokio::test]
async fn one_token_cannot_take_every_wait_or_register_without_limit() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens.json");
    let tokens = json!({"tokens": [
        {"name": "team-a", "role": "agent", "sha256": hex_sha256("a-secret"),
         "alloc_prefixes": ["a-"], "max_waiters": 2, "max_allocations": 2},
        {"name": "team-b", "role": "agent", "sha256": hex_sha256("b-secret"),
         "alloc_prefixes": ["b-"]},
    ]});
    std::fs::write(&file, tokens.to_string()).unwrap();
    let auth = Auth::load(Some(&file), Some("operator-secret")).unwrap();
    let app = std::sync::Arc::new(
        test_app_auth(
            RegistryConfig {
                max_allocations: 4,
                ..RegistryConfig::default()
            },
            HttpConfig::default(),
            auth,
        )
        .await,
    );
    let put = |t: &'static str, id: &'static str| {
        let app = app.clone();
        async move {
            call(
                &app,
                Some(t),
                "PUT",
                &format!("/v1/allocations/{id}"),
                Some(five_tasks()),
            )
            .await
        }
    };
    assert_eq!(put("a-secret", "a-1").await.status, 201);
    assert_eq!(put("a-secret", "a-2").await.status, 201);
    let over = put("a-secret", "a-3").await;
    over.assert_problem(429, "quota_exceeded");
    assert!(
        over.body["detail"].as_str().unwrap().contains("team-a"),
        "{}",
        over.body
    );
    assert_eq!(put("a-secret", "a-1").await.status, 200, "idempotent");
    assert_eq!(put("b-secret", "b-1").await.status, 201);
    assert_eq!(put("b-secret", "b-2").await.status, 201);
    let full = put("b-secret", "b-3").await;
    full.assert_problem(429, "quota_exceeded");
    assert!(
        full.body["detail"]
            .as_str()
            .unwrap()
            .contains("--max-allocations")
    );

    // Two long-polls of team-a park; its third is refused at once, with
    // Retry-After; team-b's is still taken.
    let poll = |t: &'static str, id: &'static str| {
        let app = app.clone();
        tokio::spawn(async move {
            call(
                &app,
                Some(t),
                "GET",
                &format!("/v1/allocations/{id}/tasks/web/start-condition?wait=60s"),
                None,
            )
            .await
        })
    };
    let parked = [poll("a-secret", "a-1"), poll("a-secret", "a-2")];
    for _ in 0..10_000 {
        if app.registry.waiters() >= 2 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(app.registry.waiters(), 2);
    let third = poll("a-secret", "a-1").await.unwrap();
    third.assert_problem(429, "quota_exceeded");
    assert!(third.headers.contains_key("retry-after"));
    let other = poll("b-secret", "b-1");
    for _ in 0..10_000 {
        if app.registry.waiters() >= 3 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(app.registry.waiters(), 3, "team-b's wait was taken");
    app.registry.shutdown();
    for p in parked.into_iter().chain([other]) {
        p.await.unwrap().assert_problem(503, "shutting_down");
    }
}

/// The event stream follows the list's rules (a scoped token names a
/// prefix within its scopes) and holds one of its token's waits while it
/// is open.
#[tokio::test]
async fn the_event_stream_follows_the_token_rules() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens.json");
    let tokens = json!({"tokens": [
        {"name": "reader", "role": "reader", "sha256": hex_sha256("reader-secret")},
        {"name": "team-a", "role": "agent", "sha256": hex_sha256("a-secret"),
         "alloc_prefixes": ["a-"], "max_waiters": 1},
    ]});
    std::fs::write(&file, tokens.to_string()).unwrap();
    let auth = Auth::load(Some(&file), None).unwrap();
    let app = test_app_auth(RegistryConfig::default(), HttpConfig::default(), auth).await;
    let open = |token: Option<&'static str>, uri: &'static str| {
        let mut req = Request::get(uri);
        if let Some(t) = token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        app.stream_req(req.body(Body::empty()).unwrap())
    };
    assert_eq!(open(None, "/v1/events").await.status, 401);
    let reader = open(Some("reader-secret"), "/v1/events").await;
    assert_eq!(reader.status, 200);
    for uri in ["/v1/events", "/v1/events?prefix=b-", "/v1/events?prefix=a"] {
        let refused = call(&app, Some("a-secret"), "GET", uri, None).await;
        refused.assert_problem(403, "forbidden");
        assert!(
            refused.body["detail"]
                .as_str()
                .unwrap()
                .contains("follow events with a `prefix` within"),
            "{}",
            refused.body
        );
    }
    let first = open(Some("a-secret"), "/v1/events?prefix=a-1").await;
    assert_eq!(first.status, 200);
    let second = call(&app, Some("a-secret"), "GET", "/v1/events?prefix=a-", None).await;
    second.assert_problem(429, "quota_exceeded");
    assert!(second.header("retry-after").is_some());
    // Closing the first gives its wait back at once.
    drop(first);
    let again = open(Some("a-secret"), "/v1/events?prefix=a-").await;
    assert_eq!(again.status, 200);
    drop((reader, again));
}

/// Only a request that parks holds one of its token's waits (issue 32):
/// with every wait of a token taken by open streams, its plain GETs of
/// the waiting routes, a blocking query and a start-condition that answer
/// at once are still served; and a HEAD long-poll that parks holds a wait
/// as a GET does.
#[tokio::test]
async fn only_parked_requests_hold_a_token_s_waits() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens.json");
    let tokens = json!({"tokens": [
        {"name": "team-a", "role": "agent", "sha256": hex_sha256("a-secret"),
         "alloc_prefixes": ["a-"], "max_waiters": 3},
    ]});
    std::fs::write(&file, tokens.to_string()).unwrap();
    let auth = Auth::load(Some(&file), None).unwrap();
    let app = std::sync::Arc::new(
        test_app_auth(RegistryConfig::default(), HttpConfig::default(), auth).await,
    );
    let a = call(
        &app,
        Some("a-secret"),
        "PUT",
        "/v1/allocations/a-1",
        Some(five_tasks()),
    )
    .await;
    assert_eq!(a.status, 201, "{}", a.body);
    let index = a.index();
    let mut streams = Vec::new();
    for _ in 0..3 {
        let req = Request::get("/v1/events?prefix=a-")
            .header(header::AUTHORIZATION, "Bearer a-secret")
            .body(Body::empty())
            .unwrap();
        let s = app.stream_req(req).await;
        assert_eq!(s.status, 200);
        streams.push(s);
    }
    app.parked(3).await;
    let at_once = [
        "/v1/allocations/a-1".to_owned(),
        "/v1/allocations/a-1/events".to_owned(),
        "/v1/allocations/a-1/tasks/web".to_owned(),
        format!("/v1/allocations/a-1?index={}", index - 1),
        format!(
            "/v1/allocations/a-1/tasks/init?index={}&wait=60s",
            index - 1
        ),
        "/v1/allocations/a-1/tasks/init/start-condition?wait=60s".to_owned(),
    ];
    for uri in &at_once {
        for method in ["GET", "HEAD"] {
            let a = call(&app, Some("a-secret"), method, uri, None).await;
            assert_eq!(a.status, 200, "{method} {uri}: {}", a.body);
        }
    }
    let stream = app
        .stream_req(
            Request::get("/v1/events?prefix=a-")
                .header(header::AUTHORIZATION, "Bearer a-secret")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(stream.status, 429, "a fourth stream is a fourth wait");

    // One stream closes; a HEAD long-poll takes its wait, so a GET
    // long-poll has none left.
    streams.pop();
    common::unparked_to(&app.registry, 2).await;
    let poll = |method: &'static str| {
        let app = app.clone();
        tokio::spawn(async move {
            call(
                &app,
                Some("a-secret"),
                method,
                "/v1/allocations/a-1/tasks/web/start-condition?wait=60s",
                None,
            )
            .await
        })
    };
    let head = poll("HEAD");
    app.parked(3).await;
    let get = poll("GET").await.unwrap();
    get.assert_problem(429, "quota_exceeded");
    assert!(get.header("retry-after").is_some());
    app.registry.shutdown();
    assert_eq!(head.await.unwrap().status, 503);
    drop(streams);
}

/// How many requests `/metrics` counts under this method, route and
/// status.
async fn counted(app: &TestApp, method: &str, route: &str, status: u16) -> u64 {
    common::requests_counted(
        &call(app, Some("operator-secret"), "GET", "/metrics", None).await,
        method,
        route,
        status,
    )
}

/// The edge's refusals of a token (401, 403, 429 for a token with no
/// wait left) carry the request's ID and are each counted once; a parked
/// long-poll whose client goes away gives its token's wait back at once
/// (the next one parks, not 429) and is counted once, as 499.
#[tokio::test]
async fn refusals_carry_their_request_id_and_an_abandoned_poll_gives_its_wait_back() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens.json");
    let tokens = json!({"tokens": [
        {"name": "team-a", "role": "agent", "sha256": hex_sha256("a-secret"),
         "alloc_prefixes": ["a-"], "max_waiters": 1},
    ]});
    std::fs::write(&file, tokens.to_string()).unwrap();
    let auth = Auth::load(Some(&file), Some("operator-secret")).unwrap();
    let app = test_app_auth(RegistryConfig::default(), HttpConfig::default(), auth).await;
    let a = call(
        &app,
        Some("a-secret"),
        "PUT",
        "/v1/allocations/a-1",
        Some(five_tasks()),
    )
    .await;
    assert_eq!(a.status, 201, "{}", a.body);
    let poll_uri = "/v1/allocations/a-1/tasks/web/start-condition?wait=60s";
    let poll_route = "/v1/allocations/{alloc_id}/tasks/{task}/start-condition";
    let request = |token: Option<&str>, uri: &str, id: &str| {
        let mut req = Request::get(uri).header("x-request-id", id);
        if let Some(t) = token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        req.body(Body::empty()).unwrap()
    };
    // Polls a request until it parks (bounded), and hands its future back.
    let parked = |req| {
        let app = &app;
        async move {
            let mut poll = Box::pin(app.send(req));
            for _ in 0..10_000 {
                tokio::select! {
                    biased;
                    a = &mut poll => panic!("the long-poll answered {} {}", a.status, a.body),
                    () = tokio::task::yield_now() => {}
                }
                if app.registry.waiters() == 1 {
                    return poll;
                }
            }
            panic!("the long-poll never parked");
        }
    };

    let alloc = "/v1/allocations/{alloc_id}";
    for (token, uri, route, status, code) in [
        (None, "/v1/allocations/a-1", alloc, 401, "unauthorized"),
        (
            Some("a-secret"),
            "/v1/allocations/b-1",
            alloc,
            403,
            "forbidden",
        ),
    ] {
        let before = counted(&app, "GET", route, status).await;
        let a = app.send(request(token, uri, code)).await;
        a.assert_problem(status, code);
        assert_eq!(a.header("x-request-id"), Some(code));
        assert_eq!(
            counted(&app, "GET", route, status).await,
            before + 1,
            "{code}"
        );
    }

    let first = parked(request(Some("a-secret"), poll_uri, "first")).await;
    let over = app.send(request(Some("a-secret"), poll_uri, "over")).await;
    over.assert_problem(429, "quota_exceeded");
    assert_eq!(over.header("x-request-id"), Some("over"));
    assert_eq!(counted(&app, "GET", poll_route, 429).await, 1);

    // The first poll's client goes away: its wait is the token's again.
    drop(first);
    assert_eq!(app.registry.waiters(), 0);
    assert_eq!(counted(&app, "GET", poll_route, 499).await, 1);
    let again = parked(request(Some("a-secret"), poll_uri, "again")).await;
    app.registry.shutdown();
    let again = again.await;
    again.assert_problem(503, "shutting_down");
    assert_eq!(again.header("x-request-id"), Some("again"));
    assert_eq!(counted(&app, "GET", poll_route, 503).await, 1);
    assert_eq!(counted(&app, "GET", poll_route, 499).await, 1);
}

/// Only a caller that may act for a task keeps it alive by long-polling
/// it: with its agent gone, a task a reader token watches is declared lost
/// once its TTL passes, while one an agent token watches stays alive.
#[tokio::test(start_paused = true)]
async fn a_reader_watching_a_task_does_not_keep_it_alive() {
    if common::on_etcd(
        "a_reader_watching_a_task_does_not_keep_it_alive",
        "runs on paused time",
    ) {
        return;
    }
    let config = RegistryConfig {
        clock: taskgate::registry::Clock::tokio(),
        ..RegistryConfig::default()
    };
    let app = std::sync::Arc::new(secured_with(config, false).await);
    let op = Some("operator-secret");
    let spec = json!({"tasks": [{"name": "web", "liveness": {"ttl": "1s"}}]});
    for alloc in ["watched", "agent-watched"] {
        let uri = format!("/v1/allocations/{alloc}");
        let a = call(&app, op, "PUT", &uri, Some(spec.clone())).await;
        assert_eq!(a.status, 201, "{}", a.body);
        let running = Some(json!({"state": "running"}));
        let a = call(&app, op, "PUT", &format!("{uri}/tasks/web/state"), running).await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    // The agents are gone from here on. A reader may not give a sign of
    // life itself.
    let uri = "/v1/allocations/watched/tasks/web/heartbeat";
    let hb = call(&app, Some("reader-secret"), "PUT", uri, None).await;
    assert_eq!(hb.status, 403);
    let watch = |token: &'static str, alloc: &'static str| {
        let app = app.clone();
        tokio::spawn(async move {
            let uri = format!("/v1/allocations/{alloc}/tasks/web?index=999999&wait=2s");
            for _ in 0..100 {
                if call(&app, Some(token), "GET", &uri, None).await.status != 200 {
                    return;
                }
            }
        })
    };
    let reader = watch("reader-secret", "watched");
    let agent = watch("agent-secret", "agent-watched");
    // Five TTLs on the paused clock: it moves only once every task waits.
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    let watched = call(&app, op, "GET", "/v1/allocations/watched/tasks/web", None).await;
    let uri = "/v1/allocations/agent-watched/tasks/web";
    let by_agent = call(&app, op, "GET", uri, None).await;
    reader.abort();
    agent.abort();
    assert_eq!(
        watched.body["lost"], true,
        "only a reader watched it for five TTLs: {}",
        watched.body
    );
    assert_eq!(
        by_agent.body["lost"], false,
        "its agent token's long-polls keep it alive: {}",
        by_agent.body
    );
}

/// A token does not make a cross-site write acceptable (a page of another
/// site may hold one the user pasted into it, and the server sends no
/// CORS headers that would let it send one anyway): the refusal comes
/// before the token is looked at, with or without one. The same write
/// from the server's own page is judged by its token as usual.
#[tokio::test]
async fn cross_site_writes_are_refused_whatever_the_token() {
    let app = secured(false).await;
    let write = |token: Option<&'static str>, origin: &'static str| {
        let mut req = Request::post("/v1/allocations/x1/restart")
            .header(header::HOST, "localhost:8080")
            .header(header::ORIGIN, origin);
        if let Some(t) = token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        app.send(req.body(Body::empty()).unwrap())
    };
    for token in [None, Some("operator-secret"), Some("reader-secret")] {
        write(token, "http://evil.example")
            .await
            .assert_problem(403, "cross_site_request");
    }
    write(None, "http://localhost:8080")
        .await
        .assert_problem(401, "unauthorized");
    write(Some("reader-secret"), "http://localhost:8080")
        .await
        .assert_problem(403, "forbidden");
    write(Some("operator-secret"), "http://localhost:8080")
        .await
        .assert_problem(404, "allocation_not_found");
}
