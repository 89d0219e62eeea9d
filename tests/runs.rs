//! Runs (SEMANTICS "Fourth edition", "Runs" and "Operator stop"), through
//! the HTTP API: each rule, and the refusal that keeps it.

mod common;

use axum::http::StatusCode;
use common::{Answer, TestApp, test_app};
use serde_json::{Value, json};
use taskgate::{http::HttpConfig, registry::RegistryConfig};

async fn with_run(
    app: &TestApp,
    method: &str,
    uri: &str,
    run: &str,
    body: Option<Value>,
) -> Answer {
    app.call_with(method, uri, &[("taskgate-run", run)], body)
        .await
}

async fn heartbeat(app: &TestApp, id: &str, task: &str, run: &str) -> Answer {
    let uri = format!("/v1/allocations/{id}/tasks/{task}/heartbeat");
    with_run(app, "PUT", &uri, run, None).await
}

/// One task, `web`.
async fn web_only(app: &TestApp, id: &str) {
    let a = app
        .call(
            "PUT",
            &format!("/v1/allocations/{id}"),
            Some(json!({"tasks": [{"name": "web"}]})),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
}

/// A run begins each time a task becomes `running`: the answer to that
/// report and the task view name it, it is gone when the task leaves
/// `running`, and the next run has another ID.
#[tokio::test]
async fn a_run_begins_with_running_is_shown_and_ends_when_the_task_leaves_it() {
    let app = test_app().await;
    web_only(&app, "r1").await;
    let a = app.report("r1", "web", json!({"state": "running"})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let first = a.run("web");
    let view = app.get("/v1/allocations/r1/tasks/web").await;
    assert_eq!(view.body["run"], first.as_str());
    // The agent of the run reports again under it: a retry, no change.
    let again = app
        .report_in("r1", "web", &first, json!({"state": "running"}))
        .await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.body);
    assert_eq!(again.index(), a.index(), "a retry changes nothing");
    let pending = app
        .report_in("r1", "web", &first, json!({"state": "pending"}))
        .await;
    assert_eq!(pending.task("web")["run"], Value::Null);
    let second = app
        .report("r1", "web", json!({"state": "running"}))
        .await
        .run("web");
    assert_ne!(second, first, "a run's ID is never reused");
}

/// A report or heartbeat naming a run that is not the task's current one
/// is 409 `run_superseded` with the current run (or `null`): after a new
/// run began, and after the allocation was deleted and registered again
/// (the ID is not reused across the two registrations).
#[tokio::test]
async fn an_old_run_is_superseded_also_across_a_new_registration() {
    let app = test_app().await;
    web_only(&app, "r2").await;
    let old = app
        .report("r2", "web", json!({"state": "running"}))
        .await
        .run("web");
    app.report_in("r2", "web", &old, json!({"state": "pending"}))
        .await;
    let new = app
        .report("r2", "web", json!({"state": "running"}))
        .await
        .run("web");
    let a = app
        .report_in("r2", "web", &old, json!({"state": "dead"}))
        .await;
    a.assert_problem(409, "run_superseded");
    assert_eq!(a.body["current_run"], new.as_str(), "{}", a.body);
    let h = heartbeat(&app, "r2", "web", &old).await;
    h.assert_problem(409, "run_superseded");
    assert_eq!(
        heartbeat(&app, "r2", "web", &new).await.status,
        StatusCode::NO_CONTENT
    );
    let view = app.get("/v1/allocations/r2/tasks/web").await;
    assert_eq!(
        view.body["state"], "running",
        "nothing changed: {}",
        view.body
    );

    // Deleted and registered again under the same ID: the old agent's run
    // names nothing of the new allocation.
    assert_eq!(
        app.call("DELETE", "/v1/allocations/r2", None).await.status,
        StatusCode::NO_CONTENT
    );
    web_only(&app, "r2").await;
    let a = app
        .report_in("r2", "web", &new, json!({"state": "dead"}))
        .await;
    a.assert_problem(409, "run_superseded");
    assert_eq!(a.body["current_run"], Value::Null, "{}", a.body);
    heartbeat(&app, "r2", "web", &new)
        .await
        .assert_problem(409, "run_superseded");
    let fresh = app
        .report("r2", "web", json!({"state": "running"}))
        .await
        .run("web");
    assert!(fresh != new && fresh != old, "{fresh} reused");
    let a = app
        .report_in("r2", "web", &new, json!({"state": "running"}))
        .await;
    a.assert_problem(409, "run_superseded");
    assert_eq!(a.body["current_run"], fresh.as_str());
}

/// One agent per run: a `running` report that names no run, for a task
/// running under one, is 409 `task_claimed` naming the run and its last
/// sign of life, and changes nothing.
#[tokio::test]
async fn a_second_running_report_without_the_run_is_task_claimed() {
    let app = test_app().await;
    web_only(&app, "r3").await;
    let run = app
        .report("r3", "web", json!({"state": "running"}))
        .await
        .run("web");
    let before = app.get("/v1/allocations/r3").await;
    let a = app.report("r3", "web", json!({"state": "running"})).await;
    a.assert_problem(409, "task_claimed");
    assert_eq!(a.body["run"], run.as_str(), "{}", a.body);
    assert!(
        a.body.as_object().unwrap().contains_key("last_seen"),
        "{}",
        a.body
    );
    let batch = app
        .call(
            "POST",
            "/v1/allocations/r3/task-states",
            Some(json!({"tasks": {"web": {"state": "running"}}})),
        )
        .await;
    batch.assert_problem(409, "task_claimed");
    assert_eq!(app.get("/v1/allocations/r3").await.index(), before.index());
    // A report that is not `running` is judged as before (curl).
    let a = app.report("r3", "web", json!({"state": "dead"})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
}

/// `dead` is final until an order: leaving it is 409 `task_dead` (with
/// `finished_at`) until an all-tasks restart or an operator's restore;
/// a one-task restart never names a dead task.
#[tokio::test]
async fn a_dead_task_stays_dead_until_an_all_tasks_restart_or_a_restore() {
    let app = test_app().await;
    app.register_five("r4").await;
    app.report("r4", "init", json!({"state": "running"})).await;
    app.report("r4", "init", json!({"state": "dead"})).await;
    for state in ["pending", "running"] {
        let a = app.report("r4", "init", json!({"state": state})).await;
        a.assert_problem(409, "task_dead");
        assert!(a.body["finished_at"].is_string(), "{}", a.body);
    }
    let a = app
        .call(
            "POST",
            "/v1/allocations/r4/restart",
            Some(json!({"task": "init"})),
        )
        .await;
    a.assert_problem(409, "task_not_running");
    restart(&app, "r4", json!({"all_tasks": true})).await;
    let a = app.report("r4", "init", json!({"state": "pending"})).await;
    assert_eq!(
        a.status,
        StatusCode::OK,
        "reopened by the order: {}",
        a.body
    );
    // Dead again; an operator's restore that does not name it reopens it.
    app.report("r4", "init", json!({"state": "dead"})).await;
    app.report("r4", "init", json!({"state": "running"}))
        .await
        .assert_problem(409, "task_dead");
    let a = app
        .call(
            "POST",
            "/v1/allocations/r4/restore",
            Some(json!({"tasks": {"proxy": {"state": "pending"}}})),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let a = app.report("r4", "init", json!({"state": "running"})).await;
    assert_eq!(
        a.status,
        StatusCode::OK,
        "reopened by the restore: {}",
        a.body
    );
}

/// The five tasks of `id` in `poststart`: init done, proxy, web and
/// announce running.
async fn five_in_poststart(app: &TestApp, id: &str) {
    app.register_five(id).await;
    for (task, state) in [
        ("init", "running"),
        ("init", "dead"),
        ("proxy", "running"),
        ("web", "running"),
        ("announce", "running"),
    ] {
        let a = app.report(id, task, json!({"state": state})).await;
        assert_eq!(a.status, StatusCode::OK, "{task} {state}: {}", a.body);
    }
    let view = app.get(&format!("/v1/allocations/{id}")).await.body;
    assert_eq!(view["coordinator_state"], "poststart", "{view}");
}

/// An all-tasks restart is not used up by a `dead` report that its agent
/// sent before it heard of the order: the second of the two reports of
/// one end (`Terminated`, then `Not Restarting`) landing after the order,
/// or the end of a task that was running when the order was made. Each
/// agent's `pending` after it is taken, and the coordinator leaves
/// `init`. (The allocation stuck in `init` for good, each agent waiting
/// for an order that had come: `tests/agent.rs`'s all-tasks restart
/// found it, under load.)
#[tokio::test]
async fn a_dead_report_sent_before_its_agent_heard_of_an_all_tasks_restart_does_not_use_it_up() {
    let app = test_app().await;
    five_in_poststart(&app, "r9").await;
    let exited =
        json!({"state": "dead", "event": {"type": "Terminated", "message": "Exit Code: 0"}});
    app.report("r9", "announce", exited.clone()).await;
    restart(&app, "r9", json!({"all_tasks": true})).await;
    // Sent before the agents heard of the order.
    let not_restarting = json!({"state": "dead",
        "event": {"type": "Not Restarting", "message": "the task completed"}});
    for (task, report) in [("announce", not_restarting), ("proxy", exited)] {
        let a = app.report("r9", task, report).await;
        assert_eq!(a.status, StatusCode::OK, "{task}: {}", a.body);
    }
    let view = app.get("/v1/allocations/r9").await.body;
    assert_eq!(view["coordinator_state"], "init", "{view}");
    let desired: Vec<&Value> = view["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| &t["desired"])
        .collect();
    assert!(desired.iter().all(|d| *d == "run"), "{view}");
    // The agents heard of it: each runs its task again.
    for task in ["init", "proxy", "web", "announce"] {
        let a = app.report("r9", task, json!({"state": "pending"})).await;
        assert_eq!(a.status, StatusCode::OK, "{task}: {}", a.body);
    }
    let view = app.get("/v1/allocations/r9").await.body;
    assert_eq!(view["coordinator_state"], "prestart", "{view}");
}

/// A restart order of `id` (`{"all_tasks": true}`, `{"task": ...}`, `{}`).
async fn restart(app: &TestApp, id: &str, body: Value) {
    let a = app
        .call("POST", &format!("/v1/allocations/{id}/restart"), Some(body))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
}

/// A failure reported while an all-tasks restart is owed to the task
/// counts ("Stale states do not count") and is final: the others are told
/// to stop, and the task stays dead and failed, the root cause. Here the
/// order lands between web's two reports of a failed end (`Terminated`,
/// then `Not Restarting`). (Let out of `dead`, web was told to stop before
/// it started, and its agent's report of that, dead and not failed, lost
/// the failure: the allocation ended `succeeded`, stopped by "Sibling Task
/// Failed" naming a task that had not failed.)
#[tokio::test]
async fn a_failure_reported_while_an_all_tasks_restart_is_owed_is_final() {
    let app = test_app().await;
    five_in_poststart(&app, "r10").await;
    let failed = |kind: &str| {
        json!({"state": "dead", "failed": true,
               "event": {"type": kind, "message": "Exit Code: 1"}})
    };
    app.report("r10", "web", failed("Terminated")).await;
    restart(&app, "r10", json!({"all_tasks": true})).await;
    let a = app.report("r10", "web", failed("Not Restarting")).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let sibling_failed = json!({"type": "Sibling Task Failed", "task": "web", "stage": null});
    assert_eq!(a.task("proxy")["stop_reason"], sibling_failed, "{}", a.body);
    // Each agent hears of the order. web's finds its task dead.
    let a = app.report("r10", "web", json!({"state": "pending"})).await;
    a.assert_problem(409, "task_dead");
    // The tasks still running are killed.
    let killed = json!({"state": "dead", "event": {"type": "Killed", "message": "stop"}});
    for task in ["announce", "proxy"] {
        let a = app.report("r10", task, killed.clone()).await;
        assert_eq!(a.status, StatusCode::OK, "{task}: {}", a.body);
    }
    let view = app.get("/v1/allocations/r10").await.body;
    assert_eq!(view["coordinator_state"], "poststop", "{view}");
    assert_eq!(view["outcome"], "failed", "{view}");
    assert_eq!(view["failed_tasks"], json!(["web"]), "{view}");
}

/// A one-task or running-tasks restart names running tasks only: a death
/// reported after it counts and uses it up, so the task stays dead (its
/// agent, hearing of the order, finds it dead).
#[tokio::test]
async fn a_task_that_dies_after_a_one_task_or_running_tasks_restart_stays_dead() {
    let app = test_app().await;
    let spec = json!({"tasks": [{"name": "web"}, {"name": "worker"}, {"name": "batch"}]});
    let a = app.call("PUT", "/v1/allocations/r11", Some(spec)).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    for task in ["web", "worker", "batch"] {
        app.report("r11", task, json!({"state": "running"})).await;
    }
    let exited =
        json!({"state": "dead", "event": {"type": "Terminated", "message": "Exit Code: 0"}});
    for (task, order) in [("worker", json!({"task": "worker"})), ("batch", json!({}))] {
        restart(&app, "r11", order).await;
        let a = app.report("r11", task, exited.clone()).await;
        assert_eq!(a.status, StatusCode::OK, "{task}: {}", a.body);
        let a = app.report("r11", task, json!({"state": "pending"})).await;
        a.assert_problem(409, "task_dead");
    }
}

/// An operator's restore is an order of its own: a task it names `dead`
/// stays dead, though an all-tasks restart was owed to it (only the dead
/// tasks it does not name may leave `dead`).
#[tokio::test]
async fn a_task_an_operators_restore_names_dead_stays_dead() {
    let app = test_app().await;
    app.register_five("r14").await;
    for task in ["init", "proxy", "web"] {
        app.report("r14", task, json!({"state": "running"})).await;
    }
    app.report("r14", "init", json!({"state": "dead"})).await;
    restart(&app, "r14", json!({"all_tasks": true})).await;
    let a = app
        .call(
            "POST",
            "/v1/allocations/r14/restore",
            Some(json!({"tasks": {"web": {"state": "dead"}, "proxy": {"state": "running"}}})),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let a = app.report("r14", "web", json!({"state": "pending"})).await;
    a.assert_problem(409, "task_dead");
    let a = app.report("r14", "init", json!({"state": "pending"})).await;
    assert_eq!(a.status, StatusCode::OK, "init, not named: {}", a.body);
    // Dead again; a restore that does not name it reopens it, the next
    // one names it dead.
    app.report("r14", "init", json!({"state": "dead"})).await;
    for tasks in [
        json!({"proxy": {"state": "running"}}),
        json!({"init": {"state": "dead"}}),
    ] {
        let a = app
            .call(
                "POST",
                "/v1/allocations/r14/restore",
                Some(json!({"tasks": tasks})),
            )
            .await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    }
    let a = app.report("r14", "init", json!({"state": "pending"})).await;
    a.assert_problem(409, "task_dead");
}

/// Once the coordinator is in `poststop` no task but a poststop one leaves
/// `dead`: no gate of its stage opens there again, and a restart is
/// refused. Here the all-tasks restart lands as web's run ends, so every
/// task but the poststop one is dead; then an operator's restore that
/// names only the cleanup (a dead task it does not name is reopened)
/// finishes the allocation at once. (Taken, web's `pending` left it
/// waiting for good at a gate that never opens.)
#[tokio::test]
async fn no_task_but_a_poststop_one_leaves_dead_in_poststop() {
    let app = test_app().await;
    let spec = json!({"tasks": [{"name": "web"},
        {"name": "cleanup", "lifecycle": {"hook": "poststop"}}]});
    let a = app.call("PUT", "/v1/allocations/r12", Some(spec)).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    app.report("r12", "web", json!({"state": "running"})).await;
    restart(&app, "r12", json!({"all_tasks": true})).await;
    app.report("r12", "web", json!({"state": "dead"})).await;
    let view = app.get("/v1/allocations/r12").await.body;
    assert_eq!(view["coordinator_state"], "poststop", "{view}");
    let a = app.report("r12", "web", json!({"state": "pending"})).await;
    a.assert_problem(409, "task_dead");
    for state in ["running", "dead"] {
        let a = app.report("r12", "cleanup", json!({"state": state})).await;
        assert_eq!(a.status, StatusCode::OK, "cleanup {state}: {}", a.body);
    }
    let a = app
        .call(
            "POST",
            "/v1/allocations/r12/restore",
            Some(json!({"tasks": {"cleanup": {"state": "pending"}}})),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.body["coordinator_state"], "poststop", "{}", a.body);
    let a = app.report("r12", "web", json!({"state": "pending"})).await;
    a.assert_problem(409, "task_dead");
    let a = app
        .report("r12", "cleanup", json!({"state": "running"}))
        .await;
    assert_eq!(
        a.status,
        StatusCode::OK,
        "the cleanup runs again: {}",
        a.body
    );
}

/// `ready: true` for a task that declares no readiness is 400, from a
/// report, a batch and a restore alike.
#[tokio::test]
async fn ready_without_readiness_is_400_everywhere() {
    let app = test_app().await;
    web_only(&app, "r5").await;
    let ready = json!({"state": "running", "ready": true});
    app.report("r5", "web", ready.clone())
        .await
        .assert_problem(400, "invalid_request");
    for path in ["task-states", "restore"] {
        let a = app
            .call(
                "POST",
                &format!("/v1/allocations/r5/{path}"),
                Some(json!({"tasks": {"web": ready}})),
            )
            .await;
        a.assert_problem(400, "invalid_request");
    }
    assert_eq!(
        app.get("/v1/allocations/r5/tasks/web").await.body["state"],
        "pending"
    );
}

/// The start-condition answer carries the task's state, its run and the
/// allocation's `create_index`, which moves with a new registration.
#[tokio::test]
async fn the_start_condition_names_state_run_and_registration() {
    let app = test_app().await;
    web_only(&app, "r6").await;
    let uri = "/v1/allocations/r6/tasks/web/start-condition";
    let sc = app.get(uri).await;
    assert_eq!(
        (sc.body["state"].clone(), sc.body["run"].clone()),
        (json!("pending"), Value::Null)
    );
    let created = sc.body["create_index"].as_u64().expect("create_index");
    let run = app
        .report("r6", "web", json!({"state": "running"}))
        .await
        .run("web");
    let sc = app.get(uri).await;
    assert_eq!(sc.body["state"], "running");
    assert_eq!(sc.body["run"], run.as_str());
    assert_eq!(
        sc.body["create_index"], created,
        "a report is no new registration"
    );
    app.call("DELETE", "/v1/allocations/r6", None).await;
    web_only(&app, "r6").await;
    let again = app.get(uri).await.body["create_index"].as_u64().unwrap();
    assert!(again > created, "{again} after {created}");
}

async fn as_who(
    app: &TestApp,
    token: &str,
    method: &str,
    uri: &str,
    body: Option<Value>,
) -> Answer {
    let bearer = format!("Bearer {token}");
    app.call_with(method, uri, &[("authorization", &bearer)], body)
        .await
}

/// An agent's restore is a resume: it sets states but clears no stop
/// order (the answer says `desired: stop`) and reopens no dead task; an
/// operator's restore clears the order. Stopping is the operator's: an
/// agent's token is 403.
#[tokio::test]
async fn an_agent_s_restore_is_a_resume_and_only_an_operator_stops() {
    let app = common::with_tokens(RegistryConfig::default()).await;
    let (agent, op) = (common::AGENT, common::OPERATOR);
    let five = common::five_tasks();
    assert_eq!(
        as_who(&app, agent, "PUT", "/v1/allocations/r7", Some(five))
            .await
            .status,
        StatusCode::CREATED
    );
    let a = as_who(&app, agent, "POST", "/v1/allocations/r7/stop", None).await;
    a.assert_problem(403, "forbidden");
    // init fails: a stop order ("Sibling Task Failed") is in force.
    let a = as_who(
        &app,
        agent,
        "POST",
        "/v1/allocations/r7/task-states",
        Some(json!({"tasks": {"init": {"state": "dead", "failed": true}}})),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let restore = json!({"tasks": {"proxy": {"state": "running"}}});
    let a = as_who(
        &app,
        agent,
        "POST",
        "/v1/allocations/r7/restore",
        Some(restore),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.task("proxy")["state"], "running");
    assert_eq!(
        a.task("proxy")["desired"],
        "stop",
        "the order stands: {}",
        a.body
    );
    // The dead task stays dead for the agent.
    let a = as_who(
        &app,
        agent,
        "POST",
        "/v1/allocations/r7/restore",
        Some(json!({"tasks": {"init": {"state": "pending"}}})),
    )
    .await;
    a.assert_problem(409, "task_dead");
    // The operator's restore is an order: the dead task may go back,
    // and the stop is cleared (computed afresh from the states restored).
    let restore = json!({"tasks": {"init": {"state": "pending"}, "proxy": {"state": "running"}}});
    let a = as_who(
        &app,
        op,
        "POST",
        "/v1/allocations/r7/restore",
        Some(restore),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.task("proxy")["desired"], "run", "{}", a.body);
}

/// The operator's stop: every task not yet dead is told to stop, poststop
/// runs, the outcome is `stopped`, the timeline says who; stopping a
/// finished allocation is 409 `allocation_finished`; an all-tasks restart
/// clears the order.
#[tokio::test]
async fn an_operator_stop_ends_the_allocation_stopped_and_a_restart_clears_it() {
    let app = test_app().await;
    app.register_five("r8").await;
    app.report("r8", "init", json!({"state": "dead"})).await;
    app.report("r8", "proxy", json!({"state": "running"})).await;
    let a = app.call("POST", "/v1/allocations/r8/stop", None).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    for t in ["proxy", "web", "announce"] {
        assert_eq!(a.task(t)["desired"], "stop", "{t}: {}", a.body);
        assert_eq!(
            a.task(t)["stop_reason"]["type"],
            "Stopped By Operator",
            "{}",
            a.body
        );
    }
    assert_eq!(
        a.task("cleanup")["desired"],
        "run",
        "poststop is the cleanup"
    );
    let timeline = app.get("/v1/allocations/r8/events").await;
    assert!(
        timeline
            .raw
            .windows(19)
            .any(|w| w == b"Stopped By Operator"),
        "{}",
        timeline.body
    );
    let dead = json!({"tasks": {"proxy": {"state": "dead"}, "web": {"state": "dead"}, "announce": {"state": "dead"}}});
    app.call("POST", "/v1/allocations/r8/task-states", Some(dead))
        .await;
    let a = app.get("/v1/allocations/r8").await;
    assert_eq!(a.body["coordinator_state"], "poststop", "{}", a.body);
    assert_eq!(a.task("cleanup")["allowed"], true);
    app.report("r8", "cleanup", json!({"state": "dead"})).await;
    let a = app.get("/v1/allocations/r8").await;
    assert_eq!(a.body["outcome"], "stopped", "{}", a.body);
    let again = app.call("POST", "/v1/allocations/r8/stop", None).await;
    again.assert_problem(409, "allocation_finished");
    // Stopped, then restarted before it ended: the order is cleared.
    app.register_five("r9").await;
    app.report("r9", "proxy", json!({"state": "running"})).await;
    app.call("POST", "/v1/allocations/r9/stop", None).await;
    restart(&app, "r9", json!({"all_tasks": true})).await;
    let a = app.get("/v1/allocations/r9").await;
    assert_eq!(
        a.task("proxy")["desired"],
        "run",
        "the order is cleared: {}",
        a.body
    );
}

/// Signs of life belong to a run: on a server without tokens, a
/// start-condition query naming no run (a page of another site polling it
/// as an `<img>`) keeps nothing alive; one naming the current run does.
#[tokio::test(start_paused = true)]
async fn only_a_query_naming_the_current_run_is_a_sign_of_life_without_tokens() {
    if common::on_etcd("signs of life per run", "it runs on tokio's paused clock") {
        return;
    }
    let app = common::test_app_with(common::paused_clock(), HttpConfig::default()).await;
    let spec = json!({"tasks": [{"name": "web", "liveness": {"ttl": "10s"}}]});
    for id in ["anon", "named"] {
        let a = app
            .call("PUT", &format!("/v1/allocations/{id}"), Some(spec.clone()))
            .await;
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    }
    app.report("anon", "web", json!({"state": "running"})).await;
    let run = app
        .report("named", "web", json!({"state": "running"}))
        .await
        .run("web");
    for _ in 0..4 {
        tokio::time::advance(std::time::Duration::from_secs(4)).await;
        common::settle().await;
        let q = app
            .get("/v1/allocations/anon/tasks/web/start-condition")
            .await;
        assert_eq!(q.status, StatusCode::OK);
        let uri = "/v1/allocations/named/tasks/web/start-condition";
        let q = with_run(&app, "GET", uri, &run, None).await;
        assert_eq!(q.status, StatusCode::OK, "{}", q.body);
    }
    let anon = app.get("/v1/allocations/anon/tasks/web").await;
    assert_eq!(
        anon.body["lost"], true,
        "no sign of life for 16 s: {}",
        anon.body
    );
    let named = app.get("/v1/allocations/named/tasks/web").await;
    assert_eq!(named.body["lost"], false, "{}", named.body);
    assert_eq!(named.body["state"], "running");
}
