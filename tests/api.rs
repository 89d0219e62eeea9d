//! Handler tests through the whole router with `oneshot`: every endpoint of
//! the API (openapi/openapi.json) and every error code it lists.

mod common;

use std::time::Duration;

use axum::http::StatusCode;
use axum::{body::Body, http::Request};
use common::{etcd_endpoints, five_tasks, on_etcd, test_app, test_app_with};
use serde_json::{Value, json};
use taskgate::{http::HttpConfig, registry::RegistryConfig};

// ---- register ----

#[tokio::test]
async fn register_answers_201_with_location_index_and_the_full_view() {
    let app = test_app().await;
    let a = app.register_five("a1").await;
    assert_eq!(a.header("location"), Some("/v1/allocations/a1"));
    assert_eq!(a.index(), a.body["modify_index"].as_u64().unwrap());
    assert_eq!(a.body["id"], "a1");
    assert_eq!(a.body["coordinator_state"], "prestart");
    assert_eq!(a.body["waiting_on"], json!(["init", "proxy"]));
    assert_eq!(a.body["waiting"], json!(["success", "running"]));
    assert_eq!(a.body["outcome"], json!(null));
    assert_eq!(a.body["failed_tasks"], json!([]));
    assert_eq!(a.body["create_index"], a.body["modify_index"]);
    assert!(a.body["created_at"].as_str().unwrap().ends_with('Z'));
    let names: Vec<_> = a.body["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["init", "proxy", "web", "announce", "cleanup"]);
    let init = a.task("init");
    let keys: Vec<_> = init.as_object().unwrap().keys().cloned().collect();
    let mut expected = [
        "name",
        "lifecycle",
        "leader",
        "readiness",
        "stage",
        "allowed",
        "state",
        "failed",
        "ready",
        "ready_at",
        "restarts",
        "started_at",
        "finished_at",
        "last_restart",
        "events",
        "desired",
        "stop_reason",
        "restart_generation",
        "modify_index",
        "run",
        "liveness",
        "lost",
        "last_seen",
        "depends_on",
        "blocked_by",
        "acquire",
        "grants",
        "barrier",
    ]
    .map(String::from)
    .to_vec();
    let mut keys_sorted = keys.clone();
    keys_sorted.sort();
    expected.sort();
    assert_eq!(keys_sorted, expected);
    assert_eq!(
        init["lifecycle"],
        json!({"hook": "prestart", "sidecar": false})
    );
    assert_eq!(init["stage"], "prestart_ephemeral");
    assert_eq!(init["allowed"], true);
    assert_eq!(init["state"], "pending");
    assert_eq!(init["desired"], "run");
    assert_eq!(init["stop_reason"], json!(null));
    assert_eq!(init["started_at"], json!(null));
    assert_eq!(init["run"], json!(null), "a pending task runs no run");
    assert_eq!(a.task("web")["lifecycle"], json!(null));
    assert_eq!(a.task("web")["leader"], true);
    assert_eq!(a.task("web")["allowed"], false);
    assert_eq!(a.task("proxy")["stage"], "prestart_sidecar");
}

#[tokio::test]
async fn register_is_idempotent_and_refuses_a_different_spec() {
    let app = test_app().await;
    let first = app.register_five("a1").await;
    let again = app
        .call("PUT", "/v1/allocations/a1", Some(five_tasks()))
        .await;
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(again.header("location"), None);
    assert_eq!(again.body["modify_index"], first.body["modify_index"]);
    // An explicit default is the same spec.
    let explicit = json!({"tasks": [
        {"name": "init", "lifecycle": {"hook": "prestart", "sidecar": false}, "leader": false},
        {"name": "proxy", "lifecycle": {"hook": "prestart", "sidecar": true}},
        {"name": "web", "leader": true, "lifecycle": null},
        {"name": "announce", "lifecycle": {"hook": "poststart"}},
        {"name": "cleanup", "lifecycle": {"hook": "poststop"}}
    ]});
    assert_eq!(
        app.call("PUT", "/v1/allocations/a1", Some(explicit))
            .await
            .status,
        StatusCode::OK
    );
    let other = app
        .call(
            "PUT",
            "/v1/allocations/a1",
            Some(json!({"tasks": [{"name": "web"}]})),
        )
        .await;
    other.assert_problem(409, "allocation_exists");
    assert_eq!(other.index(), first.index());
}

#[tokio::test]
async fn register_rule_breaks_are_invalid_request_with_fields() {
    let app = test_app().await;
    let a = app
        .call(
            "PUT",
            "/v1/allocations/a1",
            Some(json!({"tasks": [
                {"name": "web", "leader": true},
                {"name": "web", "leader": true},
                {"name": "post", "lifecycle": {"hook": "poststop", "sidecar": true}}
            ]})),
        )
        .await;
    a.assert_problem(400, "invalid_request");
    assert_eq!(
        a.error_fields(),
        [
            "tasks[1].name",
            "tasks[1].leader",
            "tasks[2].lifecycle.sidecar"
        ]
    );
    assert_eq!(
        a.body["errors"][0]["message"],
        "duplicate task name \"web\""
    );

    let bad_name = app
        .call(
            "PUT",
            "/v1/allocations/a1",
            Some(json!({"tasks": [{"name": "../x"}]})),
        )
        .await;
    bad_name.assert_problem(400, "invalid_request");
    assert_eq!(bad_name.error_fields(), ["tasks[0].name"]);

    let none = app
        .call("PUT", "/v1/allocations/a1", Some(json!({"tasks": []})))
        .await;
    none.assert_problem(400, "invalid_request");

    let many: Vec<_> = (0..257).map(|i| json!({"name": format!("t{i}")})).collect();
    let too_many = app
        .call("PUT", "/v1/allocations/a1", Some(json!({"tasks": many})))
        .await;
    too_many.assert_problem(400, "invalid_request");
    assert_eq!(
        app.get("/v1/allocations/a1").await.status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn bodies_that_do_not_match_the_schema_are_invalid_json_naming_the_field() {
    let app = test_app().await;
    let cases = [
        (
            r#"{"tasks": [{"name": "web", "colour": 1}]}"#,
            Some("tasks[0].colour"),
        ),
        (r#"{"tasks": [{"name": 7}]}"#, Some("tasks[0].name")),
        (
            r#"{"tasks": [{"name": "w", "lifecycle": {"hook": "prestop"}}]}"#,
            Some("tasks[0].lifecycle.hook"),
        ),
        (r#"{"tasks": [{"lifecycle": null}]}"#, Some("tasks[0]")),
        (
            r#"{"tasks": [{"name": "a", "name": "b"}]}"#,
            Some("tasks[0]"),
        ),
        (r#"{"tasks": [], "tasks": []}"#, None),
        ("not json", None),
        (r#"{"tasks": [{"name": "a"}]"#, None),
    ];
    for (body, field) in cases {
        let a = app
            .raw("PUT", "/v1/allocations/a1", Some("application/json"), body)
            .await;
        a.assert_problem(400, "invalid_json");
        if let Some(field) = field {
            assert_eq!(a.error_fields(), [field], "{body}");
        }
    }
    let prestop = app
        .raw(
            "PUT",
            "/v1/allocations/a1",
            Some("application/json"),
            r#"{"tasks": [{"name": "w", "lifecycle": {"hook": "prestop"}}]}"#,
        )
        .await;
    assert!(
        prestop.body["detail"]
            .as_str()
            .unwrap()
            .contains("prestart")
    );
}

#[tokio::test]
async fn bodies_need_a_json_content_type() {
    let app = test_app().await;
    let body = five_tasks().to_string();
    app.raw("PUT", "/v1/allocations/a1", None, body.clone())
        .await
        .assert_problem(415, "unsupported_media_type");
    app.raw(
        "PUT",
        "/v1/allocations/a1",
        Some("text/plain"),
        body.clone(),
    )
    .await
    .assert_problem(415, "unsupported_media_type");
    let ok = app
        .raw(
            "PUT",
            "/v1/allocations/a1",
            Some("application/json; charset=utf-8"),
            body,
        )
        .await;
    assert_eq!(ok.status, StatusCode::CREATED);
}

#[tokio::test]
async fn bodies_over_the_limit_are_413() {
    let app = test_app_with(
        RegistryConfig::default(),
        HttpConfig {
            body_limit: 1024,
            ..HttpConfig::default()
        },
    )
    .await;
    let big = format!(r#"{{"tasks": [{{"name": "{}"}}]}}"#, "x".repeat(2000));
    app.raw("PUT", "/v1/allocations/a1", Some("application/json"), big)
        .await
        .assert_problem(413, "payload_too_large");
    let default = test_app().await;
    let huge = format!(
        r#"{{"tasks": [{{"name": "{}"}}]}}"#,
        "x".repeat(1024 * 1024)
    );
    default
        .raw("PUT", "/v1/allocations/a1", Some("application/json"), huge)
        .await
        .assert_problem(413, "payload_too_large");
}

// ---- identifiers, routes, methods ----

#[tokio::test]
async fn bad_identifiers_in_paths_are_invalid_request() {
    let app = test_app().await;
    for uri in [
        "/v1/allocations/..",
        "/v1/allocations/a%2Fb",
        "/v1/allocations/-a",
        "/v1/allocations/a%20b",
        "/v1/allocations/a1/tasks/..",
        "/v1/allocations/%C3%A9/tasks/web",
    ] {
        let a = app.get(uri).await;
        a.assert_problem(400, "invalid_request");
        assert!(!a.error_fields().is_empty(), "{uri}");
    }
    let long = format!("/v1/allocations/{}", "a".repeat(129));
    app.get(&long).await.assert_problem(400, "invalid_request");
    let ok = format!("/v1/allocations/{}", "a".repeat(128));
    app.get(&ok)
        .await
        .assert_problem(404, "allocation_not_found");
}

/// Someone who opens the server's address in a browser lands in the web
/// view; curl sees where the API is described. Other unknown paths stay
/// problem+json 404s.
#[tokio::test]
async fn the_root_points_to_the_web_view_and_the_docs() {
    let app = test_app().await;
    for method in ["GET", "HEAD"] {
        let a = app.call(method, "/", None).await;
        assert_eq!(a.status, 307, "{method}");
        assert_eq!(a.header("location"), Some("/ui"), "{method}");
    }
    let a = app.get("/").await;
    let text = String::from_utf8_lossy(&a.raw);
    assert!(
        text.contains("/ui") && text.contains("/docs") && text.contains("/openapi.json"),
        "{text}"
    );
    app.get("/index.html")
        .await
        .assert_problem(404, "not_found");
}

#[tokio::test]
async fn unknown_routes_are_404_and_wrong_methods_405_with_allow() {
    let app = test_app().await;
    app.get("/v2/nothing")
        .await
        .assert_problem(404, "not_found");
    let a = app.call("POST", "/v1/allocations/a1", None).await;
    a.assert_problem(405, "method_not_allowed");
    let allow = a.header("allow").unwrap();
    for m in ["GET", "PUT", "DELETE"] {
        assert!(allow.contains(m), "{allow}");
    }
    app.call("DELETE", "/v1/health", None)
        .await
        .assert_problem(405, "method_not_allowed");
}

// ---- reads, query parameters, pretty ----

#[tokio::test]
async fn get_answers_with_the_index_header_and_rejects_unknown_parameters() {
    let app = test_app().await;
    let reg = app.register_five("a1").await;
    let a = app.get("/v1/allocations/a1").await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.index(), reg.index());
    assert_eq!(a.body, reg.body);

    let typo = app.get("/v1/allocations/a1?wiat=30s").await;
    typo.assert_problem(400, "invalid_request");
    assert_eq!(typo.error_fields(), ["wiat"]);
    for (q, field) in [
        ("index=-1", "index"),
        ("index=abc", "index"),
        ("index=99999999999999999999999", "index"),
        ("wait=30", "wait"),
        ("wait=-1s", "wait"),
        ("wait=soon", "wait"),
        ("index=1&index=2", "index"),
    ] {
        let a = app.get(&format!("/v1/allocations/a1?{q}")).await;
        a.assert_problem(400, "invalid_request");
        assert_eq!(a.error_fields(), [field], "{q}");
    }
    app.get("/v1/nope?x=1")
        .await
        .assert_problem(404, "not_found");
    app.get("/v1/allocations/zz")
        .await
        .assert_problem(404, "allocation_not_found");
}

#[tokio::test]
async fn pretty_indents_any_json_answer() {
    let app = test_app().await;
    app.register_five("a1").await;
    let plain = app.get("/v1/allocations/a1").await;
    assert!(!String::from_utf8_lossy(&plain.raw).contains('\n'));
    let pretty = app.get("/v1/allocations/a1?pretty").await;
    let text = String::from_utf8(pretty.raw.clone()).unwrap();
    assert!(text.starts_with("{\n  \""), "{text}");
    assert_eq!(pretty.body, plain.body);
    assert_eq!(pretty.index(), plain.index());
    let problem = app.get("/v1/allocations/zz?pretty=1").await;
    problem.assert_problem(404, "allocation_not_found");
    assert!(String::from_utf8_lossy(&problem.raw).contains("\n  \"code\""));
    let write = app.report("a1", "init", json!({"state": "running"})).await;
    assert_eq!(write.status, StatusCode::OK);
    let write_pretty = app
        .call(
            "PUT",
            "/v1/allocations/a1/tasks/init/state?pretty",
            Some(json!({"state": "dead"})),
        )
        .await;
    assert!(String::from_utf8_lossy(&write_pretty.raw).contains("\n  \"id\": \"a1\""));
}

// ---- list ----

#[tokio::test]
async fn list_filters_by_prefix_and_pages_with_a_token() {
    let app = test_app().await;
    for id in ["web-3", "db-1", "web-1", "web-2"] {
        app.register_five(id).await;
    }
    let page = app.get("/v1/allocations?prefix=web-&per_page=2").await;
    assert_eq!(page.status, StatusCode::OK);
    let ids: Vec<_> = page
        .body
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["web-1", "web-2"]);
    let item = &page.body[0];
    assert_eq!(item["coordinator_state"], "prestart");
    assert_eq!(item["task_count"], 5);
    assert!(item["modify_index"].is_u64());
    let token = page.header("x-taskgate-nexttoken").unwrap().to_owned();
    let next = app
        .get(&format!(
            "/v1/allocations?prefix=web-&per_page=2&next_token={token}"
        ))
        .await;
    assert_eq!(next.body.as_array().unwrap().len(), 1);
    assert_eq!(next.body[0]["id"], "web-3");
    assert_eq!(next.header("x-taskgate-nexttoken"), None);
    let all = app.get("/v1/allocations").await;
    assert_eq!(all.body.as_array().unwrap().len(), 4);
    assert_eq!(all.body[0]["id"], "db-1");

    // A token from elsewhere still gives a well-defined page: IDs with the
    // prefix from the later of token and prefix.
    let before = app.get("/v1/allocations?prefix=web-&next_token=db-1").await;
    assert_eq!(before.body.as_array().unwrap().len(), 3);
    assert_eq!(before.body[0]["id"], "web-1");
    let after = app.get("/v1/allocations?prefix=web-&next_token=x").await;
    assert_eq!(after.body.as_array().unwrap().len(), 0);

    for q in [
        "per_page=0",
        "per_page=1001",
        "per_page=x",
        "next_token=..",
        "prefix=web/",
        "page=2",
        "state=broken",
        "state=failed,",
        "state=",
    ] {
        app.get(&format!("/v1/allocations?{q}"))
            .await
            .assert_problem(400, "invalid_request");
    }
}

/// A listing filtered by state pages through every allocation that
/// matches, each once, while allocations are deleted and registered
/// between its pages: the one the next token names among them.
#[tokio::test]
async fn a_filtered_listing_pages_through_each_match_once_as_allocations_come_and_go() {
    let app = test_app().await;
    let fail = |id: String| {
        let app = &app;
        async move {
            app.register_five(&id).await;
            app.report(&id, "init", json!({"state": "dead", "failed": true}))
                .await;
        }
    };
    for i in 0..6 {
        fail(format!("f-{i}")).await;
        app.register_five(&format!("h-{i}")).await;
    }
    let (mut seen, mut token) = (Vec::new(), None::<String>);
    for round in 0..20 {
        let mut uri = "/v1/allocations?state=failed&per_page=2".to_owned();
        if let Some(t) = &token {
            uri.push_str(&format!("&next_token={t}"));
        }
        let page = app.get(&uri).await;
        assert_eq!(page.status, StatusCode::OK, "{}", page.body);
        for item in page.body.as_array().unwrap() {
            assert_eq!(item["trouble"][0]["kind"], "failed", "{item}");
            seen.push(item["id"].as_str().unwrap().to_owned());
        }
        token = page.header("x-taskgate-nexttoken").map(str::to_owned);
        let Some(next) = &token else { break };
        // Between pages: the allocation the token names goes, one that
        // the listing has passed and one ahead of it come.
        if round == 0 {
            let gone = app
                .call("DELETE", &format!("/v1/allocations/{next}"), None)
                .await;
            assert_eq!(gone.status, StatusCode::NO_CONTENT);
            fail("a-late".to_owned()).await;
            fail("z-late".to_owned()).await;
        }
    }
    assert!(token.is_none(), "the listing ended");
    assert_eq!(
        seen,
        ["f-0", "f-1", "f-3", "f-4", "f-5", "z-late"],
        "f-2 was deleted before its page, a-late registered behind it"
    );
}

/// What a trouble's next step tells an operator to do can be done in the
/// state it is given in: a stop it names changes the allocation, a
/// restart of every task it names is accepted, and where it says to
/// register an allocation again it says to delete it first (a held ID
/// registered with another spec is refused).
#[tokio::test(start_paused = true)]
async fn a_trouble_s_next_step_can_be_taken_where_it_is_given() {
    if on_etcd(
        "a_trouble_s_next_step_can_be_taken_where_it_is_given",
        "runs on paused time",
    ) {
        return;
    }
    let app = test_app_with(common::paused_clock(), HttpConfig::default()).await;
    let put = |id: &'static str, spec: Value| {
        let app = &app;
        async move {
            let a = app
                .call("PUT", &format!("/v1/allocations/{id}"), Some(spec))
                .await;
            assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
        }
    };
    // lost: web's agent falls silent while api runs.
    put(
        "lost-1",
        json!({"tasks": [{"name": "web", "liveness": {"ttl": "1s"}}, {"name": "api"}]}),
    )
    .await;
    app.call(
        "POST",
        "/v1/allocations/lost-1/task-states",
        Some(json!({"tasks": {"web": {"state": "running"}, "api": {"state": "running"}}})),
    )
    .await;
    // past_deadline: main may last a second.
    put(
        "late-1",
        json!({"deadlines": {"main": "1s"}, "tasks": [{"name": "web"}, {"name": "api"}]}),
    )
    .await;
    tokio::time::advance(Duration::from_secs(2)).await;
    common::settle().await;
    // failed: a prestart task fails.
    app.register_five("failed-1").await;
    app.report("failed-1", "init", json!({"state": "dead", "failed": true}))
        .await;
    // stuck: api needs db to succeed; db failed, and its allocation has
    // finished (a restart of it is refused).
    put("db-1", json!({"tasks": [{"name": "db"}]})).await;
    app.report("db-1", "db", json!({"state": "dead", "failed": true}))
        .await;
    let needs_db = json!({"tasks": [{"name": "api", "depends_on": [
        {"allocation": "db-1", "task": "db", "condition": "succeeded"}]}]});
    put("stuck-1", needs_db).await;

    for (id, kind) in [
        ("lost-1", "lost"),
        ("late-1", "past_deadline"),
        ("failed-1", "failed"),
        ("stuck-1", "stuck"),
    ] {
        let view = app.get(&format!("/v1/allocations/{id}")).await;
        let trouble = view.body["trouble"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["kind"] == kind)
            .unwrap_or_else(|| panic!("{id} shows no {kind}: {}", view.body))
            .clone();
        let step = trouble["next_step"].as_str().unwrap().to_owned();
        if step.contains("alloc stop") {
            let stopped = app
                .call("POST", &format!("/v1/allocations/{id}/stop"), None)
                .await;
            assert_eq!(stopped.status, StatusCode::OK, "{}", stopped.body);
            assert!(
                stopped.index() > view.index(),
                "{id} ({kind}): the next step names a stop that changes nothing: {step}"
            );
        }
        if step.contains("register") {
            assert!(
                step.contains("delete"),
                "{id} ({kind}): a held ID is registered again only once deleted: {step}"
            );
        }
        if step.contains("--all-tasks") && kind != "stuck" {
            let restarted = app
                .call(
                    "POST",
                    &format!("/v1/allocations/{id}/restart"),
                    Some(json!({"all_tasks": true})),
                )
                .await;
            assert_eq!(restarted.status, StatusCode::OK, "{id}: {}", restarted.body);
        }
    }
    // The stuck one's target has finished: it cannot be restarted, and
    // neither allocation can be registered again as it is.
    app.call(
        "POST",
        "/v1/allocations/db-1/restart",
        Some(json!({"all_tasks": true})),
    )
    .await
    .assert_problem(409, "allocation_finished");
    let other = json!({"tasks": [{"name": "api"}]});
    let again = app
        .call("PUT", "/v1/allocations/stuck-1", Some(other))
        .await;
    assert_eq!(again.status, StatusCode::CONFLICT, "{}", again.body);
}

// ---- delete ----

#[tokio::test]
async fn delete_answers_204_then_404() {
    let app = test_app().await;
    let reg = app.register_five("a1").await;
    let d = app.call("DELETE", "/v1/allocations/a1", None).await;
    assert_eq!(d.status, StatusCode::NO_CONTENT);
    assert!(d.raw.is_empty());
    assert!(d.index() > reg.index());
    app.get("/v1/allocations/a1")
        .await
        .assert_problem(404, "allocation_not_found");
    app.call("DELETE", "/v1/allocations/a1", None)
        .await
        .assert_problem(404, "allocation_not_found");
    // The ID can be registered again, with a newer index.
    let again = app.register_five("a1").await;
    assert!(again.index() > d.index());
}

// ---- reports ----

#[tokio::test]
async fn a_report_records_state_event_and_timestamps() {
    let app = test_app().await;
    let reg = app.register_five("a1").await;
    let a = app
        .report(
            "a1",
            "init",
            json!({"state": "running", "event": {"type": "Started", "details": {"pid": "42"}}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(a.index() > reg.index());
    let init = a.task("init");
    assert_eq!(init["state"], "running");
    assert!(init["started_at"].is_string());
    assert_eq!(init["events"][0]["type"], "Started");
    assert_eq!(init["events"][0]["message"], "");
    assert_eq!(init["events"][0]["details"], json!({"pid": "42"}));
    assert_eq!(init["modify_index"], a.body["modify_index"]);

    let d = app
        .report(
            "a1",
            "init",
            json!({"state": "dead", "failed": true, "event": {"type": "Terminated", "message": "Exit Code: 1", "time": "2026-01-02T03:04:05+01:00"}}),
        )
        .await;
    let init = d.task("init");
    assert_eq!(init["failed"], true);
    assert!(init["finished_at"].is_string());
    assert_eq!(init["events"][1]["time"], "2026-01-02T02:04:05Z");
    assert_eq!(
        d.body["coordinator_state"], "prestart",
        "a failed init holds prestart"
    );
    assert_eq!(d.task("proxy")["desired"], "stop");
    assert_eq!(
        d.task("proxy")["stop_reason"],
        json!({"type": "Sibling Task Failed", "task": "init", "stage": null})
    );
    assert_eq!(d.task("cleanup")["desired"], "run");
}

#[tokio::test]
async fn a_noop_report_changes_no_index() {
    let app = test_app().await;
    app.register_five("a1").await;
    let first = app.report("a1", "init", json!({"state": "running"})).await;
    let run = first.run("init");
    let same = app
        .report_in(
            "a1",
            "init",
            &run,
            json!({"state": "running", "failed": false}),
        )
        .await;
    assert_eq!(same.index(), first.index());
    assert_eq!(same.body, first.body);
    // Without the run it is another agent's claim, refused: no index moves.
    let claim = app.report("a1", "init", json!({"state": "running"})).await;
    claim.assert_problem(409, "task_claimed");
    assert_eq!(claim.body["run"], json!(run));
    assert_eq!(claim.index(), first.index());
}

#[tokio::test]
async fn report_errors() {
    let app = test_app().await;
    app.register_five("a1").await;
    app.report("zz", "init", json!({"state": "running"}))
        .await
        .assert_problem(404, "allocation_not_found");
    app.report("a1", "nope", json!({"state": "running"}))
        .await
        .assert_problem(404, "task_not_found");
    let bad = app.report("a1", "init", json!({"state": "sleeping"})).await;
    bad.assert_problem(400, "invalid_json");
    assert_eq!(bad.error_fields(), ["state"]);
    app.report("a1", "init", json!({"failed": true}))
        .await
        .assert_problem(400, "invalid_json");
    let long = app
        .report(
            "a1",
            "init",
            json!({"state": "running", "event": {"type": "X", "message": "m".repeat(4097)}}),
        )
        .await;
    long.assert_problem(400, "invalid_request");
    assert_eq!(long.error_fields(), ["event.message"]);
    let details: serde_json::Map<_, _> = (0..33).map(|i| (format!("k{i}"), json!("v"))).collect();
    let many = app
        .report(
            "a1",
            "init",
            json!({"state": "running", "event": {"type": "X", "details": details}}),
        )
        .await;
    assert_eq!(many.error_fields(), ["event.details"]);
    app.report(
        "a1",
        "init",
        json!({"state": "running", "event": {"type": ""}}),
    )
    .await
    .assert_problem(400, "invalid_request");
    let dup = app
        .raw(
            "PUT",
            "/v1/allocations/a1/tasks/init/state",
            Some("application/json"),
            r#"{"state": "running", "event": {"type": "X", "details": {"a": "1", "a": "2"}}}"#,
        )
        .await;
    dup.assert_problem(400, "invalid_json");
    let bad_time = app
        .report(
            "a1",
            "init",
            json!({"state": "running", "event": {"type": "X", "time": "yesterday"}}),
        )
        .await;
    bad_time.assert_problem(400, "invalid_json");
    assert_eq!(bad_time.error_fields(), ["event.time"]);
    // Nothing of the refused reports was applied.
    let a = app.get("/v1/allocations/a1").await;
    assert_eq!(a.task("init")["state"], "pending");
    assert_eq!(a.task("init")["events"], json!([]));
}

#[tokio::test]
async fn a_batch_applies_together_then_evaluates_once() {
    let app = test_app().await;
    app.register_five("a1").await;
    let a = app
        .call(
            "POST",
            "/v1/allocations/a1/task-states",
            Some(json!({"tasks": {"init": {"state": "dead"}, "proxy": {"state": "running"}}})),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.body["coordinator_state"], "main");
    assert_eq!(a.task("web")["allowed"], true);
    assert_eq!(
        a.task("init")["modify_index"],
        a.task("proxy")["modify_index"]
    );
}

#[tokio::test]
async fn a_batch_with_one_bad_entry_applies_nothing() {
    let app = test_app().await;
    let reg = app.register_five("a1").await;
    let unknown = app
        .call(
            "POST",
            "/v1/allocations/a1/task-states",
            Some(json!({"tasks": {"init": {"state": "dead"}, "ghost": {"state": "running"}}})),
        )
        .await;
    unknown.assert_problem(404, "task_not_found");
    let invalid = app
        .call(
            "POST",
            "/v1/allocations/a1/task-states",
            Some(json!({"tasks": {"init": {"state": "dead"}, "proxy": {"state": "running", "event": {"type": "x".repeat(65)}}}})),
        )
        .await;
    invalid.assert_problem(400, "invalid_request");
    assert_eq!(invalid.error_fields(), ["tasks.proxy.event.type"]);
    let wrong_type = app
        .call(
            "POST",
            "/v1/allocations/a1/task-states",
            Some(json!({"tasks": {"init": {"state": "dead"}, "proxy": {"state": 3}}})),
        )
        .await;
    wrong_type.assert_problem(400, "invalid_json");
    assert_eq!(wrong_type.error_fields(), ["tasks.proxy.state"]);
    let dup = app
        .raw(
            "POST",
            "/v1/allocations/a1/task-states",
            Some("application/json"),
            r#"{"tasks": {"init": {"state": "dead"}, "init": {"state": "running"}}}"#,
        )
        .await;
    dup.assert_problem(400, "invalid_json");
    let a = app.get("/v1/allocations/a1").await;
    assert_eq!(a.index(), reg.index(), "nothing was applied");
    assert_eq!(a.task("init")["state"], "pending");
}

// ---- start condition ----

#[tokio::test]
async fn start_condition_answers_at_once_when_allowed() {
    let app = test_app().await;
    let reg = app.register_five("a1").await;
    let a = app
        .get("/v1/allocations/a1/tasks/init/start-condition")
        .await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(
        a.body,
        json!({"alloc_id": "a1", "task": "init", "allowed": true, "desired": "run",
               "stop_reason": null,
               "coordinator_state": "prestart", "waiting_on": ["init", "proxy"],
               "outcome": null, "failed_tasks": [], "depends_on": [], "blocked_by": [],
               "grants": [],
               "state": "pending", "run": null, "create_index": reg.body["create_index"],
               "index": a.index()})
    );
}

#[tokio::test(start_paused = true)]
async fn start_condition_times_out_with_a_200_not_allowed() {
    if common::on_etcd(
        "start_condition_times_out_with_a_200_not_allowed",
        "runs on paused time",
    ) {
        return;
    }
    let app = test_app().await;
    app.register_five("a1").await;
    let started = tokio::time::Instant::now();
    let a = app
        .get("/v1/allocations/a1/tasks/web/start-condition?wait=2s")
        .await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.body["allowed"], false);
    assert_eq!(a.body["waiting_on"], json!(["init", "proxy"]));
    let waited = started.elapsed();
    assert!(waited >= Duration::from_secs(2), "{waited:?}");
    assert!(
        waited <= Duration::from_secs(2) + Duration::from_secs(2) / 16,
        "jitter is at most wait/16: {waited:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn waits_are_capped_at_the_maximum() {
    if common::on_etcd("waits_are_capped_at_the_maximum", "runs on paused time") {
        return;
    }
    let app = test_app().await;
    app.register_five("a1").await;
    let started = tokio::time::Instant::now();
    app.get("/v1/allocations/a1/tasks/web/start-condition?wait=1h")
        .await;
    let waited = started.elapsed();
    assert!(waited >= Duration::from_secs(300), "{waited:?}");
    assert!(
        waited <= Duration::from_secs(300) + Duration::from_secs(300) / 16,
        "{waited:?}"
    );
    let started = tokio::time::Instant::now();
    app.get("/v1/allocations/a1/tasks/web/start-condition")
        .await;
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(30)
            && waited <= Duration::from_secs(30) + Duration::from_secs(30) / 16,
        "default 30s: {waited:?}"
    );
}

#[tokio::test]
async fn start_condition_answers_at_once_when_told_to_stop() {
    let app = test_app().await;
    app.register_five("a1").await;
    app.report("a1", "init", json!({"state": "dead", "failed": true}))
        .await;
    let a = app
        .get("/v1/allocations/a1/tasks/web/start-condition?wait=300s")
        .await;
    assert_eq!(a.body["allowed"], false);
    assert_eq!(a.body["desired"], "stop");
}

#[tokio::test]
async fn start_condition_errors() {
    let app = test_app().await;
    app.register_five("a1").await;
    app.get("/v1/allocations/zz/tasks/web/start-condition")
        .await
        .assert_problem(404, "allocation_not_found");
    app.get("/v1/allocations/a1/tasks/nope/start-condition")
        .await
        .assert_problem(404, "task_not_found");
    let a = app
        .get("/v1/allocations/a1/tasks/web/start-condition?index=3")
        .await;
    a.assert_problem(400, "invalid_request");
    assert_eq!(a.error_fields(), ["index"]);
}

#[tokio::test]
async fn a_deletion_ends_a_parked_long_poll_with_410() {
    let app = test_app().await;
    app.register_five("a1").await;
    let waiting = {
        let router = app.router.clone();
        let app2 = common::TestApp {
            router,
            registry: app.registry.clone(),
            store: app.store.clone(),
        };
        tokio::spawn(async move {
            app2.get("/v1/allocations/a1/tasks/web/start-condition?wait=300s")
                .await
        })
    };
    app.parked(1).await;
    assert_eq!(
        app.call("DELETE", "/v1/allocations/a1", None).await.status,
        StatusCode::NO_CONTENT
    );
    waiting
        .await
        .unwrap()
        .assert_problem(410, "allocation_deleted");
    assert_eq!(app.registry.waiters(), 0);
}

#[tokio::test]
async fn the_waiter_limit_answers_503_with_retry_after() {
    let app = test_app_with(
        RegistryConfig {
            max_waiters: 0,
            ..RegistryConfig::default()
        },
        HttpConfig::default(),
    )
    .await;
    app.register_five("a1").await;
    let a = app
        .get("/v1/allocations/a1/tasks/web/start-condition?wait=5s")
        .await;
    a.assert_problem(503, "too_many_waiters");
    assert_eq!(a.header("retry-after"), Some("1"));
    // A wait that needs no parking is still answered.
    let now = app
        .get("/v1/allocations/a1/tasks/init/start-condition")
        .await;
    assert_eq!(now.status, StatusCode::OK);
}

// ---- task view and blocking queries ----

#[tokio::test]
async fn task_view_carries_its_allocation_state() {
    let app = test_app().await;
    let reg = app.register_five("a1").await;
    let t = app.get("/v1/allocations/a1/tasks/proxy").await;
    assert_eq!(t.status, StatusCode::OK);
    assert_eq!(t.index(), reg.index());
    assert_eq!(t.body["name"], "proxy");
    assert_eq!(t.body["coordinator_state"], "prestart");
    assert_eq!(t.body["alloc_modify_index"], reg.body["modify_index"]);
    assert_eq!(t.body["stage"], "prestart_sidecar");
    app.get("/v1/allocations/a1/tasks/nope")
        .await
        .assert_problem(404, "task_not_found");
}

#[tokio::test(start_paused = true)]
async fn blocking_queries_answer_at_once_for_an_old_index_and_wait_otherwise() {
    if common::on_etcd(
        "blocking_queries_answer_at_once_for_an_old_index_and_wait_otherwise",
        "runs on paused time",
    ) {
        return;
    }
    let app = test_app().await;
    let reg = app.register_five("a1").await;
    let index = reg.index();
    let now = app
        .get(&format!("/v1/allocations/a1?index={}&wait=10s", index - 1))
        .await;
    assert_eq!(now.index(), index);
    let started = tokio::time::Instant::now();
    let timed_out = app
        .get(&format!("/v1/allocations/a1?index={index}&wait=10s"))
        .await;
    assert_eq!(timed_out.status, StatusCode::OK, "a timeout is a 200");
    assert_eq!(timed_out.index(), index);
    assert!(started.elapsed() >= Duration::from_secs(10));
    let task = app
        .get(&format!(
            "/v1/allocations/a1/tasks/web?index={index}&wait=1s"
        ))
        .await;
    assert_eq!(task.status, StatusCode::OK);
    assert_eq!(task.body["modify_index"].as_u64().unwrap(), index);
}

// ---- restart ----

async fn running_five(app: &common::TestApp) {
    app.register_five("a1").await;
    app.call(
        "POST",
        "/v1/allocations/a1/task-states",
        Some(json!({"tasks": {"init": {"state": "dead"}, "proxy": {"state": "running"}, "web": {"state": "running"}}})),
    )
    .await;
}

#[tokio::test]
async fn restart_running_tasks_by_default_even_with_an_empty_body() {
    let app = test_app().await;
    running_five(&app).await;
    let before = app.get("/v1/allocations/a1").await;
    let r = app
        .raw("POST", "/v1/allocations/a1/restart", None, "")
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["restarted"], json!(["proxy", "web"]));
    assert_eq!(r.body["coordinator_state"], "poststart");
    assert!(r.body["index"].as_u64().unwrap() > before.index());
    assert_eq!(r.index(), r.body["index"].as_u64().unwrap());
    let a = app.get("/v1/allocations/a1").await;
    let web = a.task("web");
    assert_eq!(web["restart_generation"], 1);
    assert_eq!(
        web["state"], "running",
        "a restart does not change reported states"
    );
    let ev = web["events"].as_array().unwrap().last().unwrap();
    assert_eq!(ev["type"], "Restart Signaled");
    assert_eq!(ev["message"], "Restart requested through the API");
    let again = app
        .call("POST", "/v1/allocations/a1/restart", Some(json!({})))
        .await;
    assert_eq!(again.body["restarted"], json!(["proxy", "web"]));
}

#[tokio::test]
async fn restart_one_task_with_a_reason() {
    let app = test_app().await;
    running_five(&app).await;
    let r = app
        .call(
            "POST",
            "/v1/allocations/a1/restart",
            Some(json!({"task": "web", "reason": "new config"})),
        )
        .await;
    assert_eq!(r.body["restarted"], json!(["web"]));
    let a = app.get("/v1/allocations/a1").await;
    assert_eq!(a.task("proxy")["restart_generation"], 0);
    let ev = a.task("web")["events"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(ev["message"], "new config");
}

#[tokio::test]
async fn restart_all_tasks_resets_the_coordinator() {
    let app = test_app().await;
    running_five(&app).await;
    let r = app
        .call(
            "POST",
            "/v1/allocations/a1/restart",
            Some(json!({"all_tasks": true})),
        )
        .await;
    assert_eq!(r.body["restarted"], json!(["init", "proxy", "web"]));
    assert_eq!(r.body["coordinator_state"], "init");
    let a = app.get("/v1/allocations/a1").await;
    for t in a.body["tasks"].as_array().unwrap() {
        assert_eq!(t["allowed"], false, "all gates closed in init");
    }
    assert_eq!(a.body["waiting_on"], json!(["init", "proxy", "web"]));
    assert_eq!(a.task("cleanup")["restart_generation"], 0);
}

#[tokio::test]
async fn restart_errors() {
    let app = test_app().await;
    running_five(&app).await;
    let both = app
        .call(
            "POST",
            "/v1/allocations/a1/restart",
            Some(json!({"task": "web", "all_tasks": true})),
        )
        .await;
    both.assert_problem(400, "invalid_request");
    assert_eq!(both.error_fields(), ["all_tasks"]);
    app.call(
        "POST",
        "/v1/allocations/a1/restart",
        Some(json!({"task": "ghost"})),
    )
    .await
    .assert_problem(404, "task_not_found");
    let not_running = app
        .call(
            "POST",
            "/v1/allocations/a1/restart",
            Some(json!({"task": "init"})),
        )
        .await;
    not_running.assert_problem(409, "task_not_running");
    assert!(
        not_running.body["detail"]
            .as_str()
            .unwrap()
            .starts_with("task \"init\" is not running"),
        "{}",
        not_running.body
    );
    assert!(not_running.header("x-taskgate-index").is_some());
    app.call(
        "POST",
        "/v1/allocations/a1/restart",
        Some(json!({"task": "cleanup"})),
    )
    .await
    .assert_problem(409, "task_not_running");
    app.call(
        "POST",
        "/v1/allocations/a1/restart",
        Some(json!({"reason": "x".repeat(4097)})),
    )
    .await
    .assert_problem(400, "invalid_request");
    app.call(
        "POST",
        "/v1/allocations/a1/restart",
        Some(json!({"everything": true})),
    )
    .await
    .assert_problem(400, "invalid_json");
    app.raw(
        "POST",
        "/v1/allocations/a1/restart",
        Some("text/plain"),
        "{}",
    )
    .await
    .assert_problem(415, "unsupported_media_type");
    app.call("POST", "/v1/allocations/zz/restart", Some(json!({})))
        .await
        .assert_problem(404, "allocation_not_found");
    // Into poststop: every non-poststop task dead.
    app.call(
        "POST",
        "/v1/allocations/a1/task-states",
        Some(json!({"tasks": {"proxy": {"state": "dead"}, "web": {"state": "dead"}, "announce": {"state": "dead"}}})),
    )
    .await;
    let before = app.get("/v1/allocations/a1").await;
    assert_eq!(before.body["coordinator_state"], "poststop");
    for body in [json!({}), json!({"all_tasks": true})] {
        app.call("POST", "/v1/allocations/a1/restart", Some(body))
            .await
            .assert_problem(409, "allocation_finished");
    }
    let after = app.get("/v1/allocations/a1").await;
    assert_eq!(after.body, before.body, "a refused restart changes nothing");
}

// ---- restore ----

#[tokio::test]
async fn restore_jumps_to_prestart_and_evaluates() {
    let app = test_app().await;
    app.register_five("a1").await;
    let r = app
        .call(
            "POST",
            "/v1/allocations/a1/restore",
            Some(json!({"tasks": {"init": {"state": "dead"}, "proxy": {"state": "running"}, "web": {"state": "running"}}})),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.body["coordinator_state"], "poststart");
    assert_eq!(r.task("announce")["allowed"], true);
    app.call(
        "POST",
        "/v1/allocations/a1/restore",
        Some(json!({"tasks": {"ghost": {"state": "dead"}}})),
    )
    .await
    .assert_problem(404, "task_not_found");
    app.call(
        "POST",
        "/v1/allocations/zz/restore",
        Some(json!({"tasks": {}})),
    )
    .await
    .assert_problem(404, "allocation_not_found");
}

// ---- service routes ----

#[tokio::test]
async fn health_turns_503_on_shutdown() {
    let app = test_app().await;
    let ok = app.get("/v1/health").await;
    assert_eq!(ok.status, StatusCode::OK);
    if etcd_endpoints().is_some() {
        // A replica also says where its view of the store is.
        assert_eq!(ok.body["status"], "ok");
        assert_eq!(ok.body["view"]["state"], "synced");
        assert!(ok.body["view"]["index"].is_u64(), "{}", ok.body);
    } else {
        assert_eq!(ok.body, json!({"status": "ok"}));
    }
    app.registry.shutdown();
    let stopping = app.get("/v1/health").await;
    stopping.assert_problem(503, "shutting_down");
    assert_eq!(stopping.header("retry-after"), Some("1"));
}

/// A store whose health a test sets (as the disk store's changes when a
/// write, a checkpoint or a rollover fails).
struct TroubledStore(
    taskgate::store::MemoryStore,
    std::sync::Mutex<taskgate::store::StoreHealth>,
);

impl taskgate::store::Store for TroubledStore {
    fn load(&self) -> Result<taskgate::store::Loaded, taskgate::store::StoreError> {
        self.0.load()
    }

    fn follow(&self, from: u64, follower: std::sync::Weak<dyn taskgate::store::Follower>) {
        self.0.follow(from, follower)
    }

    fn append(&self, append: taskgate::store::Append) -> taskgate::store::Appended {
        self.0.append(append)
    }

    fn id(&self) -> &str {
        self.0.id()
    }

    fn health(&self) -> taskgate::store::StoreHealth {
        self.1.lock().unwrap().clone()
    }
}

/// Health and metrics follow the store: degraded (200, the problems
/// named), refusing writes (503 `store_failed`), and back; an answer never
/// carries the store's own error text.
#[tokio::test]
async fn health_and_metrics_show_the_store_s_trouble_without_its_error_text() {
    use http_body_util::BodyExt;
    use taskgate::store::StoreHealth;
    use tower::ServiceExt;
    let store = std::sync::Arc::new(TroubledStore(
        taskgate::store::MemoryStore::new(),
        std::sync::Mutex::new(StoreHealth::Ok),
    ));
    let registry =
        taskgate::registry::Registry::open(store.clone(), RegistryConfig::default()).unwrap();
    let router = taskgate::http::app(
        registry,
        HttpConfig::default(),
        std::sync::Arc::new(taskgate::http::auth::Auth::default()),
    );
    let get = |path: &'static str| {
        let router = router.clone();
        async move {
            let req = axum::http::Request::get(path)
                .body(axum::body::Body::empty())
                .unwrap();
            let res = router.oneshot(req).await.unwrap();
            let status = res.status();
            let body = res.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8(body.to_vec()).unwrap())
        }
    };
    let secret = "writing the store log failed (No space left on device)";
    let cases = [
        (StoreHealth::Ok, 200, "", 0, 0),
        (
            StoreHealth::Degraded(vec!["checkpoints_failing", "log_rollover_failing"]),
            200,
            r#"{"status":"degraded","problems":["checkpoints_failing","log_rollover_failing"]}"#,
            1,
            0,
        ),
        (
            StoreHealth::Refusing {
                code: "write_failed",
                cause: secret.into(),
            },
            503,
            "restart the server",
            0,
            1,
        ),
        (
            StoreHealth::Refusing {
                code: "log_full",
                cause: secret.into(),
            },
            503,
            "its log reached its ceiling",
            0,
            1,
        ),
        (StoreHealth::Ok, 200, r#"{"status":"ok"}"#, 0, 0),
    ];
    for (health, status, expect, degraded, refusing) in cases {
        *store.1.lock().unwrap() = health.clone();
        let (got, body) = get("/v1/health").await;
        assert_eq!(got.as_u16(), status, "{health:?}: {body}");
        assert!(body.contains(expect), "{health:?}: {body}");
        assert!(!body.contains("No space left"), "{health:?}: {body}");
        if status == 503 {
            assert!(body.contains(r#""code":"store_failed""#), "{body}");
        }
        let (_, metrics) = get("/metrics").await;
        assert!(
            metrics.contains(&format!("\ntaskgate_store_degraded {degraded}\n")),
            "{metrics}"
        );
        assert!(
            metrics.contains(&format!("\ntaskgate_store_refusing_writes {refusing}\n")),
            "{metrics}"
        );
    }
}

#[tokio::test]
async fn metrics_count_waiters() {
    let app = test_app().await;
    app.register_five("a1").await;
    let m = app.get("/metrics").await;
    assert_eq!(m.status, StatusCode::OK);
    let text = String::from_utf8(m.raw).unwrap();
    assert!(text.contains("\ntaskgate_waiters 0\n"), "{text}");
    assert!(text.contains("\ntaskgate_allocations 1\n"), "{text}");
    assert!(
        m.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
}

#[tokio::test]
async fn metrics_move_with_reports_transitions_restarts_and_requests() {
    let app = test_app().await;
    app.register_five("a1").await;
    app.call(
        "POST",
        "/v1/allocations/a1/task-states",
        Some(json!({"tasks": {"init": {"state": "dead"}, "proxy": {"state": "running"}, "web": {"state": "dead"}}})),
    )
    .await;
    app.call("POST", "/v1/allocations/a1/restart", Some(json!({})))
        .await;
    let text = String::from_utf8(app.get("/metrics").await.raw).unwrap();
    for line in [
        "taskgate_state_reports_total 3\n",
        "taskgate_coordinator_transitions_total{from=\"init\",to=\"prestart\"} 1\n",
        "taskgate_coordinator_transitions_total{from=\"prestart\",to=\"poststart\"} 1\n",
        "taskgate_restarts_total{mode=\"running\"} 1\n",
        "taskgate_stop_orders_total{reason=\"Leader Task Dead\"} 4\n",
        "taskgate_http_request_duration_seconds_count{method=\"PUT\",route=\"/v1/allocations/{alloc_id}\",status=\"201\"} 1\n",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    assert!(!text.contains("a1"), "no allocation IDs in labels");
}

/// `/metrics` is the Prometheus text format (0.0.4) with the names, types,
/// label keys and buckets dashboards rely on: every line parsed, every
/// family announced by HELP and TYPE before its samples.
#[tokio::test]
async fn metrics_parse_with_their_names_labels_and_buckets() {
    let app = test_app().await;
    app.register_five("a1").await;
    let res = app.get("/metrics").await;
    assert_eq!(
        res.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    let text = String::from_utf8(res.raw).unwrap();
    let latency = [
        "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1",
        "2.5", "5", "10", "60", "300", "+Inf",
    ];
    let batch = [
        "1", "2", "4", "8", "16", "32", "64", "128", "512", "4096", "+Inf",
    ];
    // family → (type, label keys of its samples, bucket bounds)
    type Family<'a> = (&'a str, Vec<&'a str>, Option<&'a [&'a str]>);
    let expected: std::collections::BTreeMap<&str, Family> = [
        ("taskgate_waiters", ("gauge", vec![], None)),
        ("taskgate_stream_rendered_bytes", ("gauge", vec![], None)),
        ("taskgate_timer_entries", ("gauge", vec![], None)),
        ("taskgate_allocations", ("gauge", vec![], None)),
        ("taskgate_last_index", ("gauge", vec![], None)),
        ("taskgate_connections", ("gauge", vec![], None)),
        ("taskgate_store_degraded", ("gauge", vec![], None)),
        ("taskgate_store_refusing_writes", ("gauge", vec![], None)),
        ("taskgate_store_unfolded_log_bytes", ("gauge", vec![], None)),
        (
            "taskgate_http_request_duration_seconds",
            (
                "histogram",
                vec!["method", "route", "status"],
                Some(&latency[..]),
            ),
        ),
        (
            "taskgate_coordinator_transitions_total",
            ("counter", vec!["from", "to"], None),
        ),
        ("taskgate_state_reports_total", ("counter", vec![], None)),
        ("taskgate_restarts_total", ("counter", vec!["mode"], None)),
        (
            "taskgate_stop_orders_total",
            ("counter", vec!["reason"], None),
        ),
        (
            "taskgate_store_commit_duration_seconds",
            ("histogram", vec![], Some(&latency[..])),
        ),
        (
            "taskgate_store_commit_batch_size",
            ("histogram", vec![], Some(&batch[..])),
        ),
        (
            "taskgate_store_checkpoint_duration_seconds",
            ("histogram", vec![], Some(&latency[..])),
        ),
        (
            "taskgate_store_checkpoint_records_total",
            ("counter", vec![], None),
        ),
        (
            "taskgate_store_background_failures_total",
            ("counter", vec!["operation"], None),
        ),
    ]
    .into_iter()
    .collect();

    let mut typed = std::collections::BTreeMap::new();
    let mut helped = std::collections::BTreeSet::new();
    let mut buckets: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').expect("HELP has a text");
            assert!(!help.is_empty() && !help.ends_with(".."), "{line}");
            helped.insert(name.to_owned());
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(helped.contains(name), "TYPE before HELP: {line}");
            typed.insert(name.to_owned(), kind.to_owned());
            continue;
        }
        assert!(!line.starts_with('#'), "{line}");
        // name{k="v",...} value
        let (series, value) = line.rsplit_once(' ').unwrap();
        value
            .parse::<f64>()
            .unwrap_or_else(|_| panic!("value of {line}"));
        let (name, labels) = match series.split_once('{') {
            Some((n, l)) => (n, l.strip_suffix('}').expect("labels close")),
            None => (series, ""),
        };
        let mut keys: Vec<&str> = Vec::new();
        let mut others = Vec::new();
        let mut le = None;
        for pair in labels.split("\",").filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once("=\"").expect("label key=\"value\"");
            let v = v.trim_end_matches('"');
            if k == "le" {
                le = Some(v.to_owned());
            } else {
                keys.push(k);
                others.push(pair);
            }
        }
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| expected.contains_key(f)))
            .unwrap_or(name);
        let (kind, want_keys, bounds) = expected
            .get(family)
            .unwrap_or_else(|| panic!("unexpected metric {name} in {line}"));
        assert_eq!(typed.get(family).map(String::as_str), Some(*kind), "{line}");
        assert_eq!(&keys, want_keys, "{line}");
        assert!(
            !labels.contains("a1"),
            "no allocation IDs in labels: {line}"
        );
        if name.ends_with("_bucket") {
            assert!(bounds.is_some(), "{line}");
            buckets
                .entry(format!("{family}[{}]", others.join(",")))
                .or_default()
                .push(le.expect("a bucket has le"));
        }
    }
    assert_eq!(
        typed.keys().map(String::as_str).collect::<Vec<_>>(),
        expected.keys().copied().collect::<Vec<_>>(),
        "every family, and no other"
    );
    assert!(!buckets.is_empty());
    for (series, les) in buckets {
        let family = series.split('[').next().unwrap();
        let les: Vec<&str> = les.iter().map(String::as_str).collect();
        assert_eq!(Some(&les[..]), expected[family].2, "{series}");
    }
}

#[tokio::test]
async fn request_ids_are_echoed_or_generated() {
    let app = test_app().await;
    let mine = app
        .send(
            axum::http::Request::get("/v1/health")
                .header("x-request-id", "abc-123")
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(mine.header("x-request-id"), Some("abc-123"));
    let made = app.get("/v1/health").await;
    let id = made.header("x-request-id").unwrap().to_owned();
    assert_eq!(id.len(), 32);
    assert_ne!(
        app.get("/v1/health").await.header("x-request-id"),
        Some(id.as_str())
    );
    let problem = app.get("/nowhere").await;
    assert!(problem.header("x-request-id").is_some());
}

/// How many requests `/metrics` counts under this method, route and
/// status.
async fn counted(app: &common::TestApp, method: &str, route: &str, status: u16) -> u64 {
    common::requests_counted(&app.get("/metrics").await, method, route, status)
}

/// Every answer carries the client's request ID and the store's ID, and
/// is counted once under its status, whoever gives it: the edge's own
/// refusals (a host not served, a cross-site write, a body announced over
/// the limit, a request out of time), axum's 404 fallback and bare 405, a
/// body over the limit sent without a length (refused as it is read), a
/// handler's 400.
#[tokio::test(start_paused = true)]
async fn every_answer_carries_its_request_id_and_is_counted_once() {
    if common::on_etcd(
        "every_answer_carries_its_request_id_and_is_counted_once",
        "runs on paused time and stalls the memory store's commits",
    ) {
        return;
    }
    let app = test_app_with(
        RegistryConfig::default(),
        HttpConfig {
            body_limit: 8192,
            request_timeout: Duration::from_secs(2),
            ..HttpConfig::default()
        },
    )
    .await;
    app.register_five("a1").await;
    let big = format!(r#"{{"tasks": [{{"name": "{}"}}]}}"#, "x".repeat(10_000));
    let alloc = "/v1/allocations/{alloc_id}";
    let state = "/v1/allocations/{alloc_id}/tasks/{task}/state";
    // (method, uri, headers, body, route, status, code)
    type Case<'a> = (
        &'a str,
        &'a str,
        &'a [(&'a str, &'a str)],
        Option<&'a str>,
        &'a str,
        u16,
        &'a str,
    );
    #[rustfmt::skip]
    let cases: [Case; 8] = [
        ("GET", "/v1/health", &[("host", "evil.example")], None, "/v1/health", 421, "host_not_allowed"),
        ("PUT", "/v1/allocations/a2", &[("sec-fetch-site", "cross-site")], Some("{}"), alloc, 403, "cross_site_request"),
        ("PUT", "/v1/allocations/a2", &[("content-length", "10027")], Some(&big), alloc, 413, "payload_too_large"),
        ("PUT", "/v1/allocations/a2", &[], Some(&big), alloc, 413, "payload_too_large"),
        ("GET", "/nowhere", &[], None, "unmatched", 404, "not_found"),
        ("POST", "/v1/allocations/a1", &[], None, alloc, 405, "method_not_allowed"),
        ("GET", "/v1/allocations/a1?wiat=1s", &[], None, alloc, 400, "invalid_request"),
        ("PUT", "/v1/allocations/a1/tasks/init/state", &[], Some(r#"{"state": "running"}"#), state, 503, "timeout"),
    ];
    for (n, (method, uri, headers, body, route, status, code)) in cases.into_iter().enumerate() {
        let before = counted(&app, method, route, status).await;
        let id = format!("case-{n}");
        let mut req = Request::builder()
            .method(method)
            .uri(uri)
            .header("x-request-id", &id);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        let stalls = code == "timeout";
        app.store.stall_commits(stalls);
        let a = app
            .send(
                req.body(body.map_or(Body::empty(), |b| Body::from(b.to_owned())))
                    .unwrap(),
            )
            .await;
        app.store.stall_commits(false);
        a.assert_problem(status, code);
        assert_eq!(
            a.header("x-request-id"),
            Some(id.as_str()),
            "{method} {uri}"
        );
        assert!(a.header("x-taskgate-store").is_some(), "{method} {uri}");
        assert_eq!(
            counted(&app, method, route, status).await,
            before + 1,
            "{method} {uri} is counted once under {route} {status}"
        );
    }
    let text = String::from_utf8(app.get("/metrics").await.raw).unwrap();
    assert!(!text.contains("status=\"499\""), "{text}");
}

/// A commit the store fails is the store's failure, not a bug of the
/// server: 503 `store_failed` with `Retry-After`, every time, and never
/// the store's own text.
#[tokio::test]
async fn a_failed_commit_is_a_503_store_failed_that_says_nothing_internal() {
    if common::on_etcd(
        "a_failed_commit_is_a_503_store_failed_that_says_nothing_internal",
        "injects faults into the memory store",
    ) {
        return;
    }
    let app = test_app().await;
    app.register_five("a1").await;
    app.store.fail_commits(true);
    for _ in 0..2 {
        let a = app.report("a1", "init", json!({"state": "running"})).await;
        a.assert_problem(503, "store_failed");
        assert!(a.header("retry-after").is_some(), "{:?}", a.headers);
        assert!(!String::from_utf8_lossy(&a.raw).contains("injected"));
    }
    app.store.fail_commits(false);
    let now = app.get("/v1/allocations/a1").await;
    assert_eq!(now.task("init")["state"], "pending", "memory is as it was");
}

#[tokio::test]
async fn the_served_openapi_document_is_the_committed_one() {
    let app = test_app().await;
    let served = app.get("/openapi.json").await;
    assert_eq!(served.status, StatusCode::OK);
    let committed =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/openapi/openapi.json"))
            .expect("openapi/openapi.json is committed");
    assert!(
        served.raw == committed.as_bytes(),
        "openapi/openapi.json is stale: regenerate it with `cargo run -- openapi > openapi/openapi.json`"
    );
    assert_eq!(served.body["openapi"], "3.1.0");
}

/// Tooling needs every operation named once, and the documented request
/// examples must be requests the server takes: each one is sent, in the
/// walkthrough's order, and answered with a 2xx.
#[tokio::test]
async fn operation_ids_are_unique_and_the_examples_are_accepted() {
    let app = test_app().await;
    let doc: Value = app.get("/openapi.json").await.body;
    let mut ids = Vec::new();
    for item in doc["paths"].as_object().unwrap().values() {
        for op in item.as_object().unwrap().values() {
            if let Some(id) = op.get("operationId") {
                ids.push(id.as_str().unwrap().to_owned());
            }
        }
    }
    let mut unique = ids.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(ids.len(), unique.len(), "{ids:?}");
    let example = |schema: &str| doc["components"]["schemas"][schema]["example"].clone();
    for (method, uri, schema) in [
        ("PUT", "/v1/allocations/ex1", "RegisterBody"),
        ("POST", "/v1/allocations/ex1/task-states", "BatchBody"),
        ("PUT", "/v1/allocations/ex1/tasks/web/state", "ReportBody"),
        ("POST", "/v1/allocations/ex1/restore", "BatchBody"),
        ("POST", "/v1/allocations/ex1/restart", "RestartBody"),
    ] {
        let body = example(schema);
        assert!(body.is_object(), "{schema} has an example");
        let a = app.call(method, uri, Some(body)).await;
        assert!(
            a.status.is_success(),
            "{method} {uri}: {} {}",
            a.status,
            a.body
        );
    }
}

/// Every problem's `type` leads to its code's entry on `GET /errors`, a
/// page anyone may read; the errors an operator meets first say what to do.
#[tokio::test]
async fn errors_link_to_their_code_s_page_and_say_what_to_do_next() {
    let app = test_app().await;
    let page = app.get("/errors").await;
    assert_eq!(page.status, StatusCode::OK);
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    let html = String::from_utf8(page.raw).unwrap();
    for (code, status, _) in taskgate::http::error::CODES {
        assert!(
            html.contains(&format!("id=\"{code}\"><h2><code>{code}</code> ({status})")),
            "{code} has no section"
        );
    }
    app.register_five("e1").await;
    let a = report(&app, "e1", "nope", json!({"state": "running"})).await;
    a.assert_problem(404, "task_not_found");
    let detail = a.body["detail"].as_str().unwrap();
    assert!(
        detail.contains(r#""init", "proxy", "web", "announce", "cleanup""#),
        "{detail}"
    );
    let a = app
        .call(
            "PUT",
            "/v1/allocations/e1",
            Some(json!({"tasks": [{"name": "other"}]})),
        )
        .await;
    a.assert_problem(409, "allocation_exists");
    assert!(
        a.body["detail"]
            .as_str()
            .unwrap()
            .contains("DELETE /v1/allocations/e1"),
        "{}",
        a.body
    );
    let a = app
        .call(
            "POST",
            "/v1/allocations/e1/restart",
            Some(json!({"task": "web"})),
        )
        .await;
    a.assert_problem(409, "task_not_running");
    assert!(a.body["detail"].as_str().unwrap().contains("all_tasks"));
}

#[tokio::test]
async fn the_openapi_document_names_every_error_code_of_the_contract() {
    let doc = taskgate::http::openapi::document();
    for code in [
        "invalid_json",
        "invalid_request",
        "allocation_not_found",
        "task_not_found",
        "allocation_exists",
        "task_not_running",
        "allocation_finished",
        "allocation_deleted",
        "payload_too_large",
        "unsupported_media_type",
        "too_many_waiters",
        "shutting_down",
        "internal",
        "unauthorized",
        "forbidden",
        "starting",
        "timeout",
        "jwt_keys_unavailable",
    ] {
        assert!(
            doc.contains(&format!("`{code}`")),
            "{code} is not documented"
        );
    }
}

#[tokio::test]
async fn docs_are_served_from_the_binary() {
    let app = test_app().await;
    let redirect = app.get("/docs").await;
    assert!(redirect.status.is_redirection());
    let page = app.get("/docs/").await;
    assert_eq!(page.status, StatusCode::OK);
    let html = String::from_utf8(page.raw).unwrap();
    assert!(html.contains("swagger-ui"), "{html}");
    assert!(!html.contains("https://"), "no asset from another host");
    let init = app.get("/docs/swagger-initializer.js").await;
    let js = String::from_utf8(init.raw).unwrap();
    assert!(js.contains("/openapi.json"), "{js}");
}

#[tokio::test(start_paused = true)]
async fn requests_that_do_not_wait_are_bounded_in_time() {
    if common::on_etcd(
        "requests_that_do_not_wait_are_bounded_in_time",
        "runs on paused time and injects faults into the memory store",
    ) {
        return;
    }
    let app = test_app_with(
        RegistryConfig::default(),
        HttpConfig {
            request_timeout: Duration::from_secs(2),
            ..HttpConfig::default()
        },
    )
    .await;
    app.register_five("a1").await;
    app.store.stall_commits(true);
    let started = tokio::time::Instant::now();
    let a = app.report("a1", "init", json!({"state": "running"})).await;
    a.assert_problem(503, "timeout");
    assert_eq!(a.header("retry-after"), Some("1"));
    assert_eq!(started.elapsed(), Duration::from_secs(2));
    // A long-poll is bounded by its wait, not by the request timeout.
    let started = tokio::time::Instant::now();
    let w = app
        .get("/v1/allocations/a1/tasks/web/start-condition?wait=10s")
        .await;
    assert_eq!(w.status, StatusCode::OK);
    assert!(started.elapsed() >= Duration::from_secs(10));
    // A HEAD long-poll too: it waits as the GET does.
    let started = tokio::time::Instant::now();
    let h = app
        .call(
            "HEAD",
            "/v1/allocations/a1/tasks/web/start-condition?wait=10s",
            None,
        )
        .await;
    assert_eq!(h.status, StatusCode::OK);
    assert!(started.elapsed() >= Duration::from_secs(10));
    // So is the timeline's blocking query.
    let started = tokio::time::Instant::now();
    let t = app.get("/v1/allocations/a1/events?index=1&wait=10s").await;
    assert_eq!(t.status, StatusCode::OK, "{}", t.body);
    assert!(started.elapsed() >= Duration::from_secs(10));
}

/// A request whose client goes away before its answer (here a parked
/// long-poll, dropped) is still counted, as status 499.
#[tokio::test]
async fn a_request_abandoned_by_its_client_is_counted_as_499() {
    let app = test_app().await;
    app.register_five("a1").await;
    let req = axum::http::Request::get("/v1/allocations/a1/tasks/web/start-condition?wait=60s")
        .body(axum::body::Body::empty())
        .unwrap();
    let mut poll = Box::pin(app.send(req));
    for _ in 0..10_000 {
        tokio::select! {
            biased;
            _ = &mut poll => panic!("the long-poll answered"),
            () = tokio::task::yield_now() => {}
        }
        if app.registry.waiters() == 1 {
            break;
        }
    }
    assert_eq!(app.registry.waiters(), 1);
    drop(poll);
    assert_eq!(app.registry.waiters(), 0);
    let text = String::from_utf8(app.get("/metrics").await.raw).unwrap();
    assert!(
        text.contains(
            "taskgate_http_request_duration_seconds_count{method=\"GET\",route=\"/v1/allocations/{alloc_id}/tasks/{task}/start-condition\",status=\"499\"} 1\n"
        ),
        "{text}"
    );
}

// ---- the lifecycle's second edition ----

/// Registers `id` with a prestart sidecar and a main task that both
/// declare readiness, a poststart task and a poststop task.
async fn register_ready(app: &common::TestApp, id: &str) -> common::Answer {
    let a = app
        .call(
            "PUT",
            &format!("/v1/allocations/{id}"),
            Some(json!({"tasks": [
                {"name": "db", "lifecycle": {"hook": "prestart", "sidecar": true}, "readiness": true},
                {"name": "web", "readiness": true},
                {"name": "announce", "lifecycle": {"hook": "poststart"}},
                {"name": "cleanup", "lifecycle": {"hook": "poststop"}}
            ]})),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    a
}

async fn report(app: &common::TestApp, id: &str, task: &str, body: Value) -> common::Answer {
    app.call(
        "PUT",
        &format!("/v1/allocations/{id}/tasks/{task}/state"),
        Some(body),
    )
    .await
}

#[tokio::test]
async fn readiness_holds_the_next_stage_until_the_task_is_ready() {
    let app = test_app().await;
    let a = register_ready(&app, "r1").await;
    assert_eq!(a.task("db")["readiness"], true);
    assert_eq!(a.body["waiting"], json!(["ready"]));
    // Running is not enough for a sidecar that declares readiness.
    let a = report(&app, "r1", "db", json!({"state": "running"})).await;
    assert_eq!(a.body["coordinator_state"], "prestart");
    assert_eq!(a.body["waiting_on"], json!(["db"]));
    assert_eq!(a.body["waiting"], json!(["ready"]));
    assert_eq!(a.task("web")["allowed"], false);
    // Readiness is said by the agent of the run (`Taskgate-Run`).
    let db = a.run("db");
    let a = app
        .report_in("r1", "db", &db, json!({"state": "running", "ready": true}))
        .await;
    assert_eq!(a.body["coordinator_state"], "main");
    assert_eq!(a.task("db")["ready"], true);
    assert!(a.task("db")["ready_at"].is_string());
    assert_eq!(a.task("web")["allowed"], true);
    assert_eq!(a.body["waiting"], json!(["ready"]), "web, to be ready");
    // The main task runs but is not ready: poststart stays closed.
    let a = report(&app, "r1", "web", json!({"state": "running"})).await;
    assert_eq!(a.body["coordinator_state"], "main");
    assert_eq!(a.task("announce")["allowed"], false);
    let web = a.run("web");
    // Losing readiness closes no gate.
    let a = app
        .report_in("r1", "db", &db, json!({"state": "running", "ready": false}))
        .await;
    assert_eq!(a.body["coordinator_state"], "main");
    assert_eq!(a.task("db")["ready"], false);
    let a = app
        .report_in(
            "r1",
            "web",
            &web,
            json!({"state": "running", "ready": true}),
        )
        .await;
    assert_eq!(a.body["coordinator_state"], "poststart");
    assert_eq!(a.body["waiting"], json!(["dead"]));
    // A report that changes nothing is still a no-op.
    let again = app
        .report_in("r1", "web", &web, json!({"state": "running"}))
        .await;
    assert_eq!(again.index(), a.index());
}

#[tokio::test]
async fn readiness_is_refused_where_it_has_no_meaning() {
    let app = test_app().await;
    let a = app
        .call(
            "PUT",
            "/v1/allocations/r2",
            Some(json!({"tasks": [
                {"name": "init", "lifecycle": {"hook": "prestart"}, "readiness": true},
                {"name": "web"}
            ]})),
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert_eq!(a.body["code"], "invalid_request");
    assert_eq!(
        a.body["errors"][0]["field"], "tasks[0].readiness",
        "{}",
        a.body
    );
    register_ready(&app, "r3").await;
    let a = report(&app, "r3", "db", json!({"state": "pending", "ready": true})).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert_eq!(a.body["errors"][0]["field"], "ready", "{}", a.body);
    let a = app
        .call(
            "POST",
            "/v1/allocations/r3/task-states",
            Some(json!({"tasks": {"db": {"state": "dead", "ready": true}}})),
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert_eq!(a.body["errors"][0]["field"], "tasks.db.ready", "{}", a.body);
}

#[tokio::test]
async fn the_stop_order_keeps_its_first_cause() {
    let app = test_app().await;
    app.register_five("s1").await;
    app.call(
        "POST",
        "/v1/allocations/s1/task-states",
        Some(
            json!({"tasks": {"init": {"state": "dead"}, "proxy": {"state": "running"},
                              "web": {"state": "running"}, "announce": {"state": "running"}}}),
        ),
    )
    .await;
    // The poststart task fails: every task is told why.
    let a = report(
        &app,
        "s1",
        "announce",
        json!({"state": "dead", "failed": true}),
    )
    .await;
    let failed = json!({"type": "Sibling Task Failed", "task": "announce", "stage": null});
    assert_eq!(a.task("web")["stop_reason"], failed);
    // The leader, killed for it, reports dead (not failed): the reason stays.
    let a = report(&app, "s1", "web", json!({"state": "dead"})).await;
    assert_eq!(a.task("web")["stop_reason"], failed);
    assert_eq!(a.task("proxy")["stop_reason"], failed);
    let a = report(&app, "s1", "proxy", json!({"state": "dead"})).await;
    assert_eq!(a.body["coordinator_state"], "poststop");
    assert_eq!(a.body["outcome"], "failed");
    assert_eq!(a.body["failed_tasks"], json!(["announce"]));
    let sc = app
        .get("/v1/allocations/s1/tasks/cleanup/start-condition")
        .await;
    assert_eq!(sc.body["allowed"], true);
    assert_eq!(sc.body["outcome"], "failed");
    assert_eq!(sc.body["failed_tasks"], json!(["announce"]));
}

#[tokio::test]
async fn an_all_tasks_restart_clears_the_order_and_old_states_do_not_count() {
    let app = test_app().await;
    app.register_five("s2").await;
    app.call(
        "POST",
        "/v1/allocations/s2/task-states",
        Some(
            json!({"tasks": {"init": {"state": "dead"}, "proxy": {"state": "running"},
                              "web": {"state": "dead", "failed": true}}}),
        ),
    )
    .await;
    let a = app.get("/v1/allocations/s2").await;
    assert_eq!(a.task("proxy")["desired"], "stop");
    let r = app
        .call(
            "POST",
            "/v1/allocations/s2/restart",
            Some(json!({"all_tasks": true})),
        )
        .await;
    assert_eq!(r.body["coordinator_state"], "init");
    // In init, before any task reports, nobody is told to stop because of
    // the failure from before the restart.
    let a = app.get("/v1/allocations/s2").await;
    for t in ["init", "proxy", "web"] {
        assert_eq!(a.task(t)["desired"], "run", "{t}: {}", a.body);
    }
    // A task that fails again after the restart counts at once.
    let a = report(&app, "s2", "web", json!({"state": "dead", "failed": true})).await;
    assert_eq!(
        a.task("proxy")["stop_reason"],
        json!({"type": "Sibling Task Failed", "task": "web", "stage": null})
    );
}

#[tokio::test]
async fn a_clean_end_is_succeeded_with_no_failed_tasks() {
    let app = test_app().await;
    app.register_five("o1").await;
    let a = app
        .call(
            "POST",
            "/v1/allocations/o1/task-states",
            Some(
                json!({"tasks": {"init": {"state": "dead"}, "proxy": {"state": "dead"},
                                  "web": {"state": "dead"}, "announce": {"state": "dead"}}}),
            ),
        )
        .await;
    assert_eq!(a.body["coordinator_state"], "poststop");
    assert_eq!(a.body["outcome"], "succeeded");
    assert_eq!(a.body["failed_tasks"], json!([]));
}

// ---- minimal answers ----

async fn minimal(app: &common::TestApp, method: &str, uri: &str, body: Value) -> common::Answer {
    app.send(
        axum::http::Request::builder()
            .method(method)
            .uri(uri)
            .header("content-type", "application/json")
            .header("prefer", "respond-async, return=minimal")
            .body(axum::body::Body::from(body.to_string()))
            .unwrap(),
    )
    .await
}

/// `Prefer: return=minimal` on a one-task report answers what the agent
/// acts on, and says the preference was applied; without it nothing
/// changes.
#[tokio::test]
async fn a_report_that_prefers_minimal_gets_the_small_answer() {
    let app = test_app().await;
    app.register_five("m1").await;
    let a = minimal(
        &app,
        "PUT",
        "/v1/allocations/m1/tasks/init/state",
        json!({"state": "running"}),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.header("preference-applied"), Some("return=minimal"));
    let run = a.body["run"].as_str().expect("the run the report began");
    assert_eq!(
        a.body,
        json!({"index": a.index(), "coordinator_state": "prestart", "task": "init",
               "allowed": true, "desired": "run", "stop_reason": null,
               "restart_generation": 0, "run": run})
    );
    // A stop order shows in it.
    let a = minimal(
        &app,
        "PUT",
        "/v1/allocations/m1/tasks/init/state",
        json!({"state": "dead", "failed": true}),
    )
    .await;
    assert_eq!(
        a.body["stop_reason"],
        json!({"type": "Sibling Task Failed", "task": "init", "stage": null})
    );
    assert_eq!(a.body["desired"], "stop");
    // Without the preference: the whole view, no Preference-Applied.
    let full = report(&app, "m1", "web", json!({"state": "dead"})).await;
    assert!(full.body["tasks"].is_array());
    assert_eq!(full.header("preference-applied"), None);
}

#[tokio::test]
async fn every_write_honours_return_minimal() {
    let app = test_app().await;
    let reg = minimal(&app, "PUT", "/v1/allocations/m2", five_tasks()).await;
    assert_eq!(reg.status, StatusCode::CREATED);
    assert_eq!(reg.header("location"), Some("/v1/allocations/m2"));
    assert_eq!(
        reg.body,
        json!({"index": reg.index(), "coordinator_state": "prestart"})
    );
    let batch = minimal(
        &app,
        "POST",
        "/v1/allocations/m2/task-states",
        json!({"tasks": {"init": {"state": "dead"}, "proxy": {"state": "running"}}}),
    )
    .await;
    assert_eq!(
        batch.body,
        json!({"index": batch.index(), "coordinator_state": "main"})
    );
    let restart = minimal(&app, "POST", "/v1/allocations/m2/restart", json!({})).await;
    assert_eq!(
        restart.body,
        json!({"index": restart.index(), "coordinator_state": "main"})
    );
    assert_eq!(restart.header("preference-applied"), Some("return=minimal"));
    let restore = minimal(
        &app,
        "POST",
        "/v1/allocations/m2/restore",
        json!({"tasks": {"web": {"state": "running"}}}),
    )
    .await;
    assert_eq!(restore.body["coordinator_state"], "poststart");
    assert!(restore.body.get("tasks").is_none());
    // Errors are unchanged.
    let err = minimal(
        &app,
        "PUT",
        "/v1/allocations/m2/tasks/nope/state",
        json!({"state": "running"}),
    )
    .await;
    assert_eq!(err.status, StatusCode::NOT_FOUND);
    assert_eq!(err.body["code"], "task_not_found");
    assert_eq!(err.header("preference-applied"), None);
}

// ---- the timeline ----

fn timeline_types(a: &common::Answer) -> Vec<String> {
    a.body["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let task = e["task"]
                .as_str()
                .map(|t| format!(" {t}"))
                .unwrap_or_default();
            format!("{}{task}", e["type"].as_str().unwrap())
        })
        .collect()
}

/// The server records its own decisions next to the agents' events, in
/// index order.
#[tokio::test]
async fn the_timeline_shows_the_server_s_decisions_and_the_agents_events() {
    let app = test_app().await;
    app.register_five("t1").await;
    app.call(
        "POST",
        "/v1/allocations/t1/task-states",
        Some(json!({"tasks": {"init": {"state": "dead", "event": {"type": "Terminated", "message": "Exit Code: 0"}},
                              "proxy": {"state": "running"}}})),
    )
    .await;
    let failed = report(
        &app,
        "t1",
        "web",
        json!({"state": "dead", "failed": true, "event": {"type": "Terminated", "message": "Exit Code: 3", "details": {"exit_code": "3"}}}),
    )
    .await;
    app.call(
        "POST",
        "/v1/allocations/t1/restart",
        Some(json!({"all_tasks": true, "reason": "new config"})),
    )
    .await;
    let t = app.get("/v1/allocations/t1/events").await;
    assert_eq!(t.status, StatusCode::OK);
    assert_eq!(t.body["alloc_id"], "t1");
    assert_eq!(
        timeline_types(&t),
        [
            "Registered",
            "Coordinator",
            "Terminated init",
            "Task State init",
            "Task State proxy",
            "Coordinator",
            "Terminated web",
            "Task State web",
            "Stop Order",
            "Coordinator",
            "Restart Order",
            "Coordinator"
        ],
        "{}",
        t.body
    );
    let events = t.body["events"].as_array().unwrap();
    let indexes: Vec<u64> = events
        .iter()
        .map(|e| e["index"].as_u64().unwrap())
        .collect();
    assert!(indexes.windows(2).all(|w| w[0] <= w[1]), "{indexes:?}");
    assert_eq!(
        events[1]["details"],
        json!({"from": "init", "to": "prestart"})
    );
    assert_eq!(events[6]["details"]["source"], "agent");
    assert_eq!(events[6]["details"]["exit_code"], "3");
    assert_eq!(events[7]["index"], failed.index());
    assert_eq!(
        events[8]["details"],
        json!({"reason": "Sibling Task Failed", "task": "web"})
    );
    assert_eq!(
        events[9]["details"],
        json!({"from": "main", "to": "poststart"})
    );
    assert_eq!(events[10]["details"]["mode"], "all_tasks");
    assert_eq!(events[10]["details"]["reason"], "new config");
    assert_eq!(events[10]["details"]["tasks"], "init,proxy,web");
    assert_eq!(events[11]["details"]["to"], "init");
}

#[tokio::test]
async fn the_timeline_is_a_bounded_blocking_query() {
    let app = test_app_with(
        RegistryConfig {
            timeline_events: 3,
            ..RegistryConfig::default()
        },
        HttpConfig::default(),
    )
    .await;
    let reg = app.register_five("t2").await;
    for state in ["running", "dead"] {
        report(&app, "t2", "init", json!({"state": state})).await;
    }
    let t = app.get("/v1/allocations/t2/events").await;
    assert_eq!(t.body["events"].as_array().unwrap().len(), 3, "{}", t.body);
    assert_eq!(
        timeline_types(&t),
        ["Coordinator", "Task State init", "Task State init"],
        "the newest kept"
    );
    // A blocking query from an older index answers at once with the
    // current timeline (and from the current one it parks, as the other
    // blocking queries do).
    let uri = format!("/v1/allocations/t2/events?index={}&wait=5m", reg.index());
    let waited = app.get(&uri).await;
    assert_eq!(waited.index(), t.index());
    assert_eq!(waited.body, t.body);
    app.call("DELETE", "/v1/allocations/t2", None).await;
    app.get("/v1/allocations/t2/events")
        .await
        .assert_problem(404, "allocation_not_found");
}

/// The event stream: each change once, in index order, as the writes
/// answered it; a prefix sees only its allocations.
#[tokio::test]
async fn the_event_stream_tells_each_change_once_in_index_order() {
    let app = test_app().await;
    let start = app.registry.last_index();
    let mut all = app.stream(&format!("/v1/events?index={start}")).await;
    assert_eq!(all.status, StatusCode::OK);
    assert_eq!(all.headers["content-type"], "application/x-ndjson");
    let mut only_a = app
        .stream(&format!("/v1/events?index={start}&prefix=a"))
        .await;
    assert_eq!(app.registry.waiters(), 2, "each stream counts as a waiter");

    let a1 = app.register_five("a1").await.index();
    let b1 = app.register_five("b1").await.index();
    let init = app.report("a1", "init", json!({"state": "running"})).await;
    assert_eq!(init.status, StatusCode::OK);
    let gone = app.call("DELETE", "/v1/allocations/b1", None).await;
    assert_eq!(gone.status, StatusCode::NO_CONTENT);
    let done = app
        .report("a1", "init", json!({"state": "dead", "failed": false}))
        .await;

    let expected = [
        (a1, "Allocation", "a1"),
        (b1, "Allocation", "b1"),
        (init.index(), "Allocation", "a1"),
        (gone.index(), "AllocationDeleted", "b1"),
        (done.index(), "Allocation", "a1"),
    ];
    for (index, kind, id) in expected {
        let l = all.line().await;
        assert_eq!(
            (l["index"].as_u64(), l["type"].as_str()),
            (Some(index), Some(kind)),
            "{l}"
        );
        assert_eq!(l["alloc_id"], id);
        if kind == "Allocation" {
            assert_eq!(l["allocation"]["id"], id);
            assert_eq!(l["allocation"]["modify_index"], index);
        } else {
            assert!(l.get("allocation").is_none(), "{l}");
        }
        if index == init.index() {
            // The view as committed at its index, not as it is now.
            assert_eq!(l["allocation"]["tasks"][0]["state"], "running", "{l}");
        }
    }
    for index in [a1, init.index(), done.index()] {
        let l = only_a.line().await;
        assert_eq!(
            (l["index"].as_u64(), &l["alloc_id"]),
            (Some(index), &json!("a1")),
            "{l}"
        );
    }
    drop((all, only_a));
    // A closed stream waits no more.
    common::unparked(&app.registry).await;
}

/// A reader further behind than the kept changes (`--event-buffer`) is told
/// to list again, with the index the stream goes on from.
#[tokio::test]
async fn a_stream_behind_the_kept_changes_starts_with_a_resync() {
    let app = test_app_with(
        RegistryConfig {
            event_buffer: 2,
            ..RegistryConfig::default()
        },
        HttpConfig::default(),
    )
    .await;
    let start = app.registry.last_index();
    app.register_five("a1").await;
    let mut last = 0;
    for state in ["running", "dead"] {
        last = app
            .report("a1", "init", json!({"state": state}))
            .await
            .index();
    }
    let mut behind = app.stream(&format!("/v1/events?index={start}")).await;
    let l = behind.line().await;
    assert_eq!(l, json!({"type": "Resync", "index": last}));
    // Within what is kept: no resync, just the changes.
    let mut near = app.stream(&format!("/v1/events?index={}", last - 1)).await;
    assert_eq!(near.line().await["index"], last);
    // Both go on from there.
    let next = app
        .report("a1", "proxy", json!({"state": "running"}))
        .await
        .index();
    assert_eq!(behind.line().await["index"], next);
    assert_eq!(near.line().await["index"], next);
}

/// An idle stream says it is alive every 10 s, and ends when the server
/// shuts down (the client reconnects with the last index it saw).
#[tokio::test(start_paused = true)]
async fn an_idle_stream_sends_heartbeats_and_ends_at_shutdown() {
    if common::on_etcd(
        "an_idle_stream_sends_heartbeats_and_ends_at_shutdown",
        "runs on paused time",
    ) {
        return;
    }
    let app = test_app().await;
    let started = tokio::time::Instant::now();
    let mut s = app.stream("/v1/events").await;
    assert_eq!(s.line().await, json!({"type": "Heartbeat"}));
    assert_eq!(started.elapsed(), Duration::from_secs(10));
    app.registry.shutdown();
    assert_eq!(s.next().await, None, "the stream ends");
    assert_eq!(app.registry.waiters(), 0);
    let refused = app.get("/v1/events").await;
    refused.assert_problem(503, "shutting_down");
}

/// Streams beyond `--max-streams` are refused 503 `too_many_waiters` with
/// `Retry-After` (each may hold 256 KiB ahead of a reader that stopped),
/// and a stream's place is free again once its client goes.
#[tokio::test]
async fn streams_beyond_the_limit_are_refused_until_one_closes() {
    let app = test_app_with(
        RegistryConfig::default(),
        HttpConfig {
            max_streams: 2,
            ..HttpConfig::default()
        },
    )
    .await;
    let first = app.stream("/v1/events").await;
    let second = app.stream("/v1/events").await;
    assert_eq!(
        (first.status, second.status),
        (StatusCode::OK, StatusCode::OK)
    );
    let refused = app.get("/v1/events").await;
    refused.assert_problem(503, "too_many_waiters");
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert!(
        refused.body["detail"]
            .as_str()
            .is_some_and(|d| d.contains("--max-streams")),
        "{}",
        refused.body
    );
    // Other requests are served meanwhile.
    assert_eq!(app.get("/v1/allocations").await.status, StatusCode::OK);
    drop(first);
    // The follower sees its client gone and gives the place back.
    let mut reopened = false;
    for _ in 0..1000 {
        let r = app.stream("/v1/events").await;
        if r.status == StatusCode::OK {
            reopened = true;
            break;
        }
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
        tokio::task::yield_now().await;
    }
    assert!(reopened, "a closed stream's place is given back");
    drop(second);
}

/// Writes to many allocations commit side by side and finish in any
/// order; the stream still tells them in index order, each once, none
/// missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_reach_the_stream_in_index_order() {
    let app = std::sync::Arc::new(test_app().await);
    let start = app.registry.last_index();
    let mut s = app.stream(&format!("/v1/events?index={start}")).await;
    let writers: Vec<_> = (0..8)
        .map(|w| {
            let app = app.clone();
            tokio::spawn(async move {
                let id = format!("w{w}");
                let mut indexes = vec![app.register_five(&id).await.index()];
                let mut run: Option<String> = None;
                for i in 0..25 {
                    let body = json!({"state": "running", "event": {"type": "Heartbeat", "message": format!("{i}")}});
                    // The first report starts the run; its agent names it after.
                    let r = match &run {
                        None => app.report(&id, "init", body).await,
                        Some(run) => app.report_in(&id, "init", run, body).await,
                    };
                    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
                    run.get_or_insert_with(|| r.run("init"));
                    indexes.push(r.index());
                }
                indexes
            })
        })
        .collect();
    let mut written = Vec::new();
    for w in writers {
        written.extend(w.await.unwrap());
    }
    written.sort_unstable();
    let mut streamed = Vec::new();
    while streamed.len() < written.len() {
        streamed.push(s.line().await["index"].as_u64().unwrap());
    }
    assert_eq!(streamed, written);
}

/// A listing says from which index to follow the event stream so that no
/// change is missed or taken for newer than it is; the web view's list
/// does exactly this.
#[tokio::test]
async fn a_listing_gives_the_index_to_follow_the_stream_from() {
    let app = test_app().await;
    app.register_five("a1").await;
    let listed = app.get("/v1/allocations?prefix=a").await;
    assert_eq!(listed.status, StatusCode::OK);
    let from = listed.index();
    assert_eq!(from, app.registry.last_index(), "nothing in flight");
    let mut s = app
        .stream(&format!("/v1/events?index={from}&prefix=a"))
        .await;
    let next = app
        .report("a1", "init", json!({"state": "running"}))
        .await
        .index();
    assert_eq!(
        s.line().await["index"],
        next,
        "the first change after the listing"
    );
}

/// The web view is served by the binary itself, with a policy that lets
/// the page run only its own files.
#[tokio::test]
async fn the_web_view_is_served_from_the_binary() {
    let app = test_app().await;
    for (path, kind) in [
        ("/ui", "text/html"),
        ("/ui/", "text/html"),
        ("/ui/allocations/a1", "text/html"),
        ("/ui/semaphores", "text/html"),
        ("/ui/semaphores/db-migrations", "text/html"),
        ("/ui/app.js", "text/javascript"),
        ("/ui/app.css", "text/css"),
    ] {
        let a = app.get(path).await;
        assert_eq!(a.status, StatusCode::OK, "{path}");
        assert!(
            a.header("content-type").unwrap().starts_with(kind),
            "{path}"
        );
        let policy = a.header("content-security-policy").unwrap();
        assert!(policy.contains("script-src 'self'"), "{policy}");
        assert!(!a.raw.is_empty());
    }
    let page = String::from_utf8(app.get("/ui").await.raw).unwrap();
    assert!(page.contains("/ui/app.js") && page.contains("/ui/app.css"));
    assert_eq!(app.get("/ui/nothing").await.status, StatusCode::NOT_FOUND);
}

// ---- third edition: liveness, deadlines, idempotency keys, store identity ----

/// A registration with a TTL on `web` and deadlines.
fn timed_spec() -> Value {
    json!({"tasks": [
        {"name": "init", "lifecycle": {"hook": "prestart"}},
        {"name": "web", "liveness": {"ttl": "30s"}},
    ], "deadlines": {"prestart": "10m", "poststop": "1h30m"}})
}

#[tokio::test]
async fn liveness_and_deadlines_are_registered_shown_and_validated() {
    let app = test_app().await;
    let a = app
        .call("PUT", "/v1/allocations/t1", Some(timed_spec()))
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    assert_eq!(a.task("web")["liveness"], json!({"ttl": "30s"}));
    assert_eq!(a.task("init")["liveness"], Value::Null);
    assert_eq!(a.task("web")["lost"], false);
    assert_eq!(a.task("web")["last_seen"], Value::Null);
    assert_eq!(
        a.body["deadlines"],
        json!({"prestart": "10m", "main": null, "poststart": null, "poststop": "1h30m"})
    );
    let at = time::OffsetDateTime::parse(
        a.body["deadline_at"]
            .as_str()
            .expect("prestart's deadline runs"),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    let created = time::OffsetDateTime::parse(
        a.body["created_at"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    assert_eq!(at - created, time::Duration::minutes(10));
    // The same spec again is the same allocation; another TTL is another
    // spec.
    let again = app
        .call("PUT", "/v1/allocations/t1", Some(timed_spec()))
        .await;
    assert_eq!(again.status, StatusCode::OK);
    let mut other = timed_spec();
    other["tasks"][1]["liveness"]["ttl"] = json!("31s");
    app.call("PUT", "/v1/allocations/t1", Some(other))
        .await
        .assert_problem(409, "allocation_exists");
    // Running, web has a last sign of life.
    let a = app.report("t1", "web", json!({"state": "running"})).await;
    assert!(a.task("web")["last_seen"].is_string(), "{}", a.body);

    // Out of range, not a duration, unknown fields.
    for (field, value, path) in [
        ("ttl", json!("500ms"), "tasks[1].liveness.ttl"),
        ("ttl", json!("25h"), "tasks[1].liveness.ttl"),
        ("ttl", json!("30 seconds"), "tasks[1].liveness.ttl"),
    ] {
        let mut spec = timed_spec();
        spec["tasks"][1]["liveness"][field] = value;
        let a = app.call("PUT", "/v1/allocations/bad", Some(spec)).await;
        a.assert_problem(400, "invalid_request");
        assert_eq!(a.error_fields(), [path], "{}", a.body);
    }
    let mut spec = timed_spec();
    spec["deadlines"] = json!({"main": "169h", "poststart": "0s"});
    let a = app.call("PUT", "/v1/allocations/bad", Some(spec)).await;
    a.assert_problem(400, "invalid_request");
    assert_eq!(a.error_fields(), ["deadlines.main", "deadlines.poststart"]);
    let mut spec = timed_spec();
    spec["deadlines"] = json!({"wait_alloc": "1m"});
    app.call("PUT", "/v1/allocations/bad", Some(spec))
        .await
        .assert_problem(400, "invalid_json");
    assert_eq!(app.get("/v1/allocations/bad").await.status, 404);
}

#[tokio::test(start_paused = true)]
async fn a_task_whose_agent_goes_silent_is_lost_and_its_agent_refused() {
    if on_etcd(
        "a_task_whose_agent_goes_silent_is_lost_and_its_agent_refused",
        "paused time; TTLs not enforced with the etcd store yet",
    ) {
        return;
    }
    let app = test_app_with(
        RegistryConfig {
            clock: taskgate::registry::Clock::tokio(),
            ..RegistryConfig::default()
        },
        HttpConfig::default(),
    )
    .await;
    app.call("PUT", "/v1/allocations/t1", Some(timed_spec()))
        .await;
    app.report("t1", "init", json!({"state": "dead"})).await;
    let running = app.report("t1", "web", json!({"state": "running"})).await;
    // Heartbeats: 204 with the index, no change.
    for _ in 0..3 {
        tokio::time::advance(Duration::from_secs(20)).await;
        let hb = app
            .call("PUT", "/v1/allocations/t1/tasks/web/heartbeat", None)
            .await;
        assert_eq!(hb.status, StatusCode::NO_CONTENT, "{}", hb.body);
        assert_eq!(hb.index(), running.index(), "a heartbeat writes nothing");
        assert!(hb.raw.is_empty());
    }
    app.call("PUT", "/v1/allocations/t1/tasks/nope/heartbeat", None)
        .await
        .assert_problem(404, "task_not_found");
    app.call("PUT", "/v1/allocations/zz/tasks/web/heartbeat", None)
        .await
        .assert_problem(404, "allocation_not_found");
    // Silent for a TTL: lost.
    tokio::time::advance(Duration::from_secs(31)).await;
    for _ in 0..64 {
        tokio::task::yield_now().await;
    }
    let a = app.get("/v1/allocations/t1").await;
    let web = a.task("web");
    assert_eq!(
        (&web["state"], &web["failed"], &web["lost"]),
        (&json!("dead"), &json!(true), &json!(true)),
        "{}",
        a.body
    );
    assert_eq!(web["stop_reason"]["type"], "Agent Lost");
    assert_eq!(a.body["coordinator_state"], "poststop");
    assert_eq!(a.body["outcome"], "failed");
    assert_eq!(a.body["failed_tasks"], json!(["web"]));
    let last = web["events"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["type"], "Agent Lost");
    assert_eq!(last["message"], "no sign of life for 30s");
    // Its agent, back: every write is 409 task_lost with `lost_at`; its
    // start condition says stop.
    let r = app.report("t1", "web", json!({"state": "running"})).await;
    r.assert_problem(409, "task_lost");
    assert!(r.body["lost_at"].is_string(), "{}", r.body);
    assert_eq!(r.index(), a.index());
    let batch = app
        .call(
            "POST",
            "/v1/allocations/t1/task-states",
            Some(json!({"tasks": {"web": {"state": "dead"}}})),
        )
        .await;
    batch.assert_problem(409, "task_lost");
    app.call("PUT", "/v1/allocations/t1/tasks/web/heartbeat", None)
        .await
        .assert_problem(409, "task_lost");
    let sc = app
        .get("/v1/allocations/t1/tasks/web/start-condition")
        .await;
    assert_eq!(sc.body["allowed"], false);
    assert_eq!(sc.body["desired"], "stop");
    assert_eq!(sc.body["stop_reason"]["type"], "Agent Lost");
    // The timeline has the server's entry.
    let tl = app.get("/v1/allocations/t1/events").await;
    let lost: Vec<&Value> = tl.body["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "Agent Lost")
        .collect();
    assert_eq!(lost.len(), 1, "{}", tl.body);
    assert_eq!(lost[0]["task"], "web");
    assert_eq!(lost[0]["details"]["ttl"], "30s");
    assert!(
        lost[0]["details"].get("source").is_none(),
        "the server's entry"
    );
}

#[tokio::test]
async fn a_retried_report_with_its_idempotency_key_is_applied_once() {
    let app = test_app().await;
    app.register_five("k1").await;
    let keyed = |key: &str, body: Value| {
        Request::put("/v1/allocations/k1/tasks/init/state")
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(Body::from(body.to_string()))
            .unwrap()
    };
    let started = json!({"state": "running", "event": {"type": "Started"}});
    let first = app.send(keyed("r-1", started.clone())).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.body);
    let retry = app.send(keyed("r-1", started.clone())).await;
    assert_eq!(retry.status, StatusCode::OK);
    assert_eq!(retry.index(), first.index(), "nothing applied again");
    let events = retry.task("init")["events"].as_array().unwrap().len();
    assert_eq!(events, 1, "one event, not two: {}", retry.body);
    // A quoted key is the same key.
    let quoted = app.send(keyed("\"r-1\"", started.clone())).await;
    assert_eq!(quoted.index(), first.index());
    // The same key with another request: 422.
    let other = app
        .send(keyed("r-1", json!({"state": "dead", "failed": true})))
        .await;
    other.assert_problem(422, "idempotency_key_reused");
    // Without a key, the same report again from the run's agent appends
    // its event (as before).
    let run = first.run("init");
    let plain = app.report_in("k1", "init", &run, started.clone()).await;
    assert_eq!(plain.task("init")["events"].as_array().unwrap().len(), 2);
    // Batches take keys too.
    let batch = |key: &str| {
        Request::post("/v1/allocations/k1/task-states")
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(Body::from(
                json!({"tasks": {"proxy": {"state": "running", "event": {"type": "Up"}}}})
                    .to_string(),
            ))
            .unwrap()
    };
    let b1 = app.send(batch("b-1")).await;
    let b2 = app.send(batch("b-1")).await;
    assert_eq!(b2.index(), b1.index());
    assert_eq!(b2.task("proxy")["events"].as_array().unwrap().len(), 1);
    // Keys that are not keys.
    for bad in ["", "\"\"", &"k".repeat(256)] {
        let a = app.send(keyed(bad, started.clone())).await;
        a.assert_problem(400, "invalid_request");
        assert_eq!(a.error_fields(), ["Idempotency-Key"], "{bad:?}");
    }
    let twice = Request::put("/v1/allocations/k1/tasks/init/state")
        .header("content-type", "application/json")
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .body(Body::from(started.to_string()))
        .unwrap();
    app.send(twice).await.assert_problem(400, "invalid_request");
}

/// A key names one request of the allocation: the same key and body sent
/// for another task is 422 idempotency_key_reused, not applied as new.
#[tokio::test]
async fn an_idempotency_key_reused_on_another_task_is_422() {
    let app = test_app().await;
    registered(&app, "k", json!({"tasks": [{"name": "a"}, {"name": "b"}]})).await;
    let mut answers = Vec::new();
    for t in ["a", "b"] {
        let req = Request::put(format!("/v1/allocations/k/tasks/{t}/state"))
            .header("content-type", "application/json")
            .header("idempotency-key", "same-key")
            .body(Body::from(r#"{"state": "running"}"#))
            .unwrap();
        answers.push(app.send(req).await);
    }
    assert_eq!(answers[0].status, StatusCode::OK, "{}", answers[0].body);
    answers[1].assert_problem(422, "idempotency_key_reused");
    let b = app.get("/v1/allocations/k/tasks/b").await;
    assert_eq!(b.body["state"], "pending", "b unchanged: {}", b.body);
}

#[tokio::test]
async fn every_answer_carries_the_store_s_id() {
    let app = test_app().await;
    let id = app.registry.store_id().to_owned();
    assert_eq!(id.len(), 32, "{id}");
    for uri in [
        "/v1/health",
        "/v1/allocations",
        "/v1/allocations/none",
        "/no/such/route",
    ] {
        let a = app.get(uri).await;
        assert_eq!(a.header("x-taskgate-store"), Some(id.as_str()), "{uri}");
    }
    let other = test_app().await;
    assert_ne!(other.registry.store_id(), id, "another store, another ID");
}

// ---- third edition: dependencies ----

/// Registers `id` with `spec`, asserting 201.
async fn registered(app: &common::TestApp, id: &str, spec: Value) -> common::Answer {
    let a = app
        .call("PUT", &format!("/v1/allocations/{id}"), Some(spec))
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    a
}

#[tokio::test]
async fn dependencies_are_validated_at_registration() {
    let app = test_app().await;
    let pre = |name: &str, deps: Value| json!({"name": name, "lifecycle": {"hook": "prestart"}, "depends_on": deps});
    for (tasks, field, says) in [
        (
            json!([{"name": "web", "depends_on": [{"task": "nope", "condition": "running"}]}]),
            "tasks[0].depends_on[0]",
            "no task of this allocation",
        ),
        (
            json!([{"name": "web", "depends_on": [{"task": "web", "condition": "running"}]}]),
            "tasks[0].depends_on[0]",
            "itself",
        ),
        (
            json!([pre("init", json!([{"task": "web", "condition": "running"}])), {"name": "web"}]),
            "tasks[0].depends_on[0]",
            "later stage",
        ),
        (
            json!([pre("init", json!([])), {"name": "web", "depends_on": [{"task": "init", "condition": "running"}]}]),
            "tasks[1].depends_on[0]",
            "use `succeeded`",
        ),
        (
            json!([{"name": "db"}, {"name": "web", "depends_on": [{"task": "db", "condition": "ready"}]}]),
            "tasks[1].depends_on[0]",
            "declares no readiness",
        ),
        (
            json!([{"name": "web", "depends_on": [{"task": "x", "allocation": "bad id", "condition": "dead"}]}]),
            "tasks[0].depends_on[0].allocation",
            "",
        ),
    ] {
        let a = app
            .call("PUT", "/v1/allocations/v1", Some(json!({"tasks": tasks})))
            .await;
        a.assert_problem(400, "invalid_request");
        assert_eq!(a.error_fields(), [field], "{}", a.body);
        assert!(
            a.body["errors"][0]["message"]
                .as_str()
                .unwrap()
                .contains(says),
            "{}",
            a.body
        );
    }
    let many: Vec<Value> = (0..17)
        .map(|i| json!({"task": "t", "allocation": format!("o{i}"), "condition": "dead"}))
        .collect();
    let a = app
        .call(
            "PUT",
            "/v1/allocations/v1",
            Some(json!({"tasks": [{"name": "web", "depends_on": many}]})),
        )
        .await;
    a.assert_problem(400, "invalid_request");
    assert!(
        a.body["errors"][0]["message"]
            .as_str()
            .unwrap()
            .contains("at most 16")
    );
    // An unknown condition is not JSON this route takes.
    app.call(
        "PUT",
        "/v1/allocations/v1",
        Some(json!({"tasks": [{"name": "web", "depends_on": [{"task": "x", "condition": "up"}]}]})),
    )
    .await
    .assert_problem(400, "invalid_json");
    // A cycle among its own tasks: 400 dependency_cycle, with the path.
    let a = app
        .call(
            "PUT",
            "/v1/allocations/v1",
            Some(json!({"tasks": [
                pre("a", json!([{"task": "b", "condition": "succeeded"}])),
                pre("b", json!([{"task": "a", "condition": "succeeded"}])),
                {"name": "web"},
            ]})),
        )
        .await;
    a.assert_problem(400, "dependency_cycle");
    assert_eq!(
        a.body["path"],
        json!(["v1/a", "v1/b", "v1/a"]),
        "{}",
        a.body
    );
    assert_eq!(
        app.get("/v1/allocations/v1").await.status,
        404,
        "nothing registered"
    );
}

#[tokio::test]
async fn a_cycle_through_held_allocations_is_409_with_its_path() {
    let app = test_app().await;
    registered(
        &app,
        "app",
        json!({"tasks": [{"name": "web", "depends_on": [{"task": "db", "allocation": "data", "condition": "running"}]}]}),
    )
    .await;
    let a = app
        .call(
            "PUT",
            "/v1/allocations/data",
            Some(json!({"tasks": [{"name": "db", "depends_on": [{"task": "web", "allocation": "app", "condition": "running"}]}]})),
        )
        .await;
    a.assert_problem(409, "dependency_cycle");
    assert_eq!(
        a.body["path"],
        json!(["data/db", "app/web", "data/db"]),
        "{}",
        a.body
    );
    assert_eq!(app.get("/v1/allocations/data").await.status, 404);
    // Without the cycle it registers, and the first one's dependency
    // holds once db runs.
    registered(&app, "data", json!({"tasks": [{"name": "db"}]})).await;
}

/// A `ready` dependency on a task of an allocation the server holds is
/// checked at registration: a target that declares no readiness is 400,
/// and nothing is registered.
#[tokio::test]
async fn ready_on_a_held_target_without_readiness_is_400() {
    let app = test_app().await;
    registered(&app, "db-7", json!({"tasks": [{"name": "db"}]})).await;
    let a = app
        .call(
            "PUT",
            "/v1/allocations/app",
            Some(json!({"tasks": [{"name": "web", "depends_on": [{"task": "db", "allocation": "db-7", "condition": "ready"}]}]})),
        )
        .await;
    a.assert_problem(400, "invalid_request");
    assert_eq!(a.error_fields(), ["tasks[0].depends_on[0]"], "{}", a.body);
    let says = a.body["errors"][0]["message"].as_str().unwrap();
    assert!(says.contains("declares no readiness"), "{}", a.body);
    assert_eq!(app.get("/v1/allocations/app").await.status, 404);
}

/// Runs, "what an agent may claim": a dependency on a task that a held
/// allocation does not have (a misspelling) is 400 naming the missing task
/// and the tasks it has, and nothing is registered; a target registered
/// later without that task shows `why: no_such_task`, not
/// `not_registered`.
#[tokio::test]
async fn a_dependency_on_a_task_a_held_allocation_lacks_is_400_or_no_such_task() {
    let app = test_app().await;
    registered(&app, "db-8", json!({"tasks": [{"name": "db"}]})).await;
    let on = |task: &str| {
        json!({"tasks": [{"name": "web", "depends_on": [
            {"task": task, "allocation": "db-8", "condition": "running"}]}]})
    };
    let a = app
        .call("PUT", "/v1/allocations/app-8", Some(on("dbb")))
        .await;
    a.assert_problem(400, "invalid_request");
    assert_eq!(
        a.error_fields(),
        ["tasks[0].depends_on[0].task"],
        "{}",
        a.body
    );
    let says = a.body["errors"][0]["message"].as_str().unwrap();
    assert!(
        says.contains("no task \"dbb\"") && says.contains("its tasks: db"),
        "{says}"
    );
    assert_eq!(app.get("/v1/allocations/app-8").await.status, 404);
    // The target goes away, the dependent registers (nothing to check),
    // and the target comes back without the task.
    assert_eq!(
        app.call("DELETE", "/v1/allocations/db-8", None)
            .await
            .status,
        204
    );
    registered(&app, "app-8", on("dbb")).await;
    let blocked = |a: &common::Answer| a.body["tasks"][0]["blocked_by"][0]["why"].clone();
    assert_eq!(
        blocked(&app.get("/v1/allocations/app-8").await),
        "not_registered"
    );
    registered(&app, "db-8", json!({"tasks": [{"name": "db"}]})).await;
    let view = app.get("/v1/allocations/app-8").await;
    assert_eq!(blocked(&view), "no_such_task", "{}", view.body);
}

/// A registration whose dependencies reach more than `MAX_REACH` tasks
/// through held allocations is 400, so no cycle hides behind a graph too
/// large to search; every layer within the limit registers.
#[tokio::test]
async fn a_registration_that_reaches_too_far_is_400() {
    use taskgate::registry::MAX_REACH;
    const WIDE: usize = 200;
    const DEEPEST: usize = 49;
    let app = test_app().await;
    // Layer k's tasks depend one to one on layer k + 1's: each layer
    // reaches WIDE tasks more than the one below it.
    let layer = |k: usize| {
        let tasks: Vec<Value> = (0..WIDE)
            .map(|j| {
                let deps: Vec<Value> = (k < DEEPEST)
                    .then(|| json!({"task": format!("t{j}"), "allocation": format!("l{}", k + 1), "condition": "running"}))
                    .into_iter()
                    .collect();
                json!({"name": format!("t{j}"), "depends_on": deps})
            })
            .collect();
        json!({"tasks": tasks})
    };
    let mut refused = None;
    for k in (1..=DEEPEST).rev() {
        let a = app
            .call("PUT", &format!("/v1/allocations/l{k}"), Some(layer(k)))
            .await;
        if a.status != StatusCode::CREATED {
            refused = Some((k, a));
            break;
        }
    }
    let (k, a) = refused.expect("a layer reaching past the limit is refused");
    a.assert_problem(400, "invalid_request");
    let says = a.body["errors"][0]["message"].as_str().unwrap();
    assert!(
        says.contains(&format!("more than {MAX_REACH} tasks")),
        "{}",
        a.body
    );
    assert!(
        (DEEPEST + 1 - k) * WIDE > MAX_REACH,
        "refused only past the limit"
    );
    let status = app.get(&format!("/v1/allocations/l{k}")).await.status;
    assert_eq!(status, 404, "nothing registered");
}

#[tokio::test]
async fn a_dependency_on_another_allocation_opens_a_parked_start_condition_when_it_holds() {
    let app = test_app().await;
    let a = registered(
        &app,
        "app",
        json!({"tasks": [
            {"name": "migrate", "lifecycle": {"hook": "prestart"},
             "depends_on": [{"task": "db", "allocation": "data", "condition": "ready"}]},
            {"name": "web", "depends_on": [{"task": "migrate", "condition": "succeeded"}]},
        ]}),
    )
    .await;
    let blocked = &a.task("migrate")["blocked_by"];
    assert_eq!(
        blocked,
        &json!([{"allocation": "data", "task": "db", "condition": "ready", "why": "not_registered"}])
    );
    assert_eq!(a.task("migrate")["allowed"], false);
    assert_eq!(a.body["waiting"], json!(["dependency"]), "{}", a.body);
    assert_eq!(
        a.task("web")["blocked_by"],
        json!([{"allocation": "app", "task": "migrate", "condition": "succeeded", "why": "pending"}])
    );
    // migrate's agent parks on its start condition.
    let poll = {
        let router = app.router.clone();
        tokio::spawn(async move {
            use tower::ServiceExt;
            let req = Request::get("/v1/allocations/app/tasks/migrate/start-condition?wait=60s")
                .body(Body::empty())
                .unwrap();
            let res = router.oneshot(req).await.unwrap();
            let bytes = http_body_util::BodyExt::collect(res.into_body())
                .await
                .unwrap()
                .to_bytes();
            serde_json::from_slice::<Value>(&bytes).unwrap()
        })
    };
    app.parked(1).await;
    // The database appears, runs, becomes ready: only then may migrate go.
    registered(
        &app,
        "data",
        json!({"tasks": [{"name": "db", "readiness": true}]}),
    )
    .await;
    let db = app
        .report("data", "db", json!({"state": "running"}))
        .await
        .run("db");
    wait_for(&app, "app", |a| {
        a.task("migrate")["blocked_by"][0]["why"] == "not_ready"
    })
    .await;
    assert!(!poll.is_finished(), "still waiting");
    let ready = app
        .report_in(
            "data",
            "db",
            &db,
            json!({"state": "running", "ready": true}),
        )
        .await;
    assert_eq!(ready.status, StatusCode::OK, "{}", ready.body);
    let sc = tokio::time::timeout(Duration::from_secs(30), poll)
        .await
        .expect("answered when the dependency held")
        .unwrap();
    assert_eq!(sc["allowed"], true, "{sc}");
    assert_eq!(sc["blocked_by"], json!([]));
    let tl = app.get("/v1/allocations/app/events").await;
    let deps: Vec<&Value> = tl.body["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "Dependency")
        .collect();
    let last = deps.last().expect("a Dependency entry");
    assert_eq!(last["details"]["on"], "data/db");
    assert_eq!(last["details"]["holds"], "true");
    // Deleting the target: the dependency no longer holds.
    app.call("DELETE", "/v1/allocations/data", None).await;
    wait_for(&app, "app", |a| {
        a.task("migrate")["blocked_by"][0]["why"] == "not_registered"
    })
    .await;
}

/// Follows `id` with blocking queries until `check` holds of its view
/// (bounded): a dependent's new verdict is written after its target's
/// change is answered.
async fn wait_for(
    app: &common::TestApp,
    id: &str,
    check: impl Fn(&common::Answer) -> bool,
) -> common::Answer {
    let mut a = app.get(&format!("/v1/allocations/{id}")).await;
    for _ in 0..100 {
        if check(&a) {
            return a;
        }
        a = app
            .get(&format!(
                "/v1/allocations/{id}?index={}&wait=30s",
                a.index()
            ))
            .await;
    }
    panic!("{id} never got there: {}", a.body);
}
