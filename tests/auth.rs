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

fn secured(public_metrics: bool) -> TestApp {
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
    test_app_auth(RegistryConfig::default(), HttpConfig::default(), auth)
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
        ("GET", "/openapi.json".into(), None, "public"),
        ("GET", "/docs/".into(), None, "public"),
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
    let app = secured(false);
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
                assert!(a.status.is_success(), "{label}: {} {}", a.status, a.body);
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
    let app = secured(false);
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

#[tokio::test]
async fn missing_and_wrong_tokens_are_401_in_both_headers() {
    let app = secured(false);
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
    // Unknown routes are 404 for everyone: nothing is behind them.
    call(&app, None, "GET", "/nowhere", None)
        .await
        .assert_problem(404, "not_found");
}

#[tokio::test]
async fn metrics_can_be_public() {
    let app = secured(true);
    assert_eq!(call(&app, None, "GET", "/metrics", None).await.status, 200);
    call(&app, None, "GET", "/v1/allocations", None)
        .await
        .assert_problem(401, "unauthorized");
}
