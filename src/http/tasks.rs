//! `/v1/allocations/{alloc_id}/tasks/{task}`: one task's view (blocking
//! query), its state report, and the start-condition long-poll.

use axum::{
    extract::State,
    http::StatusCode,
    response::{IntoResponse, Response},
};

use crate::registry::Querier;

use super::{
    AppState,
    dto::ReportBody,
    error::{ApiError, Problem},
    extract::{ApiJson, ApiQuery, IdempotencyKey, NoParams, RunHeader, TaskPath},
    indexed,
    params::{BlockingParams, WaitParams},
    prefer::{Prefer, WriteView, written},
    views::{StartConditionView, TaskDetailView},
};

/// Whether a task query is a sign of life for the task (SEMANTICS,
/// "Runs"): from a caller that may act for it (an agent or operator token
/// covering the allocation, or any caller on a server without tokens) that
/// names the task's current run; or, naming no run, from a token that may
/// act for it. On a server without tokens a query that names no run is no
/// sign of life: a page of another site cannot keep a task alive.
fn querier(
    caller: &Option<axum::Extension<super::auth::Caller>>,
    alloc: &str,
    run: Option<u64>,
) -> Querier {
    let may_act = caller.as_ref().is_none_or(|c| c.0.0.may_act(alloc));
    match (may_act, run, caller) {
        (false, _, _) => Querier::Watcher,
        (true, Some(r), _) => Querier::Run(r),
        (true, None, Some(_)) => Querier::Agent,
        (true, None, None) => Querier::Watcher,
    }
}

/// Read one task (blocking query).
///
/// `index` compares with the task's own `modify_index`, so an agent
/// watching for restart and stop orders is woken only by changes to its
/// task (its state, its gate, its orders).
#[utoipa::path(
    get, path = "/v1/allocations/{alloc_id}/tasks/{task}", operation_id = "getTask", tag = "tasks",
    params(
        ("alloc_id" = String, Path, description = "Allocation ID", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"),
        ("task" = String, Path, description = "Task name", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"),
        ("index" = Option<u64>, Query, minimum = 0, description = "Wait for a task modify_index greater than this (0: answer at once)"),
        ("wait" = Option<String>, Query, pattern = "^([0-9]+(\\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$", description = "Longest wait, with a unit (`500ms`, `30s`, `5m`); default 30s, capped at 300s, plus up to wait/16 jitter"),
    ),
    responses(
        (status = 200, description = "The task", body = TaskDetailView,
         headers(("X-Taskgate-Index" = u64, description = "The allocation's modify_index"))),
        (status = 404, description = "`allocation_not_found` or `task_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "`allocation_deleted`: deleted while the request waited", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "`too_many_waiters`, `shutting_down`, or `starting` (the store is still loading)", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = u64, description = "Seconds to wait before retrying"))),
    )
)]
pub async fn get(
    State(s): State<AppState>,
    caller: Option<axum::Extension<super::auth::Caller>>,
    TaskPath(id, task): TaskPath,
    RunHeader(run): RunHeader,
    ApiQuery(q): ApiQuery<BlockingParams>,
) -> Result<Response, ApiError> {
    let (a, i) = if q.index == 0 {
        s.registry.look_up(id.as_str()).await?;
        let a = s.registry.get(id.as_str())?;
        let i = s.registry.task_position(&a, task.as_str())?;
        (a, i)
    } else {
        s.registry
            .wait_task(
                id.as_str(),
                task.as_str(),
                q.index,
                s.wait_time(q.wait),
                querier(&caller, id.as_str(), run),
            )
            .await?
    };
    Ok(indexed(
        StatusCode::OK,
        a.modify_index,
        &TaskDetailView::new(&a, i, &s.registry),
    ))
}

/// Report one task's state.
///
/// `started_at` is set when the task becomes running, `finished_at` when it
/// first dies; going back to `pending` counts a restart. A report that
/// changes nothing changes no index.
#[utoipa::path(
    put, path = "/v1/allocations/{alloc_id}/tasks/{task}/state", operation_id = "reportTaskState", tag = "tasks",
    params(
        ("alloc_id" = String, Path, description = "Allocation ID", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"),
        ("task" = String, Path, description = "Task name", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"),
        ("Prefer" = Option<String>, Header, description = "`return=minimal` (RFC 7240): answer only the index, the coordinator state and what this task is told (`task`, `allowed`, `desired`, `stop_reason`, `restart_generation`), with `Preference-Applied: return=minimal`"),
        ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = "^[ -~]+$", description = "1 to 255 printable ASCII characters (IETF httpapi draft). A retry with the same key and the same request, within the task's last few keyed writes, answers the record as it is and applies nothing again; the same key with another request is 422 `idempotency_key_reused`. Kept with the record: it holds across restarts and replicas."),
    ),
    request_body = ReportBody,
    responses(
        (status = 200, description = "The allocation after the report", body = WriteView,
         headers(("X-Taskgate-Index" = u64, description = "The allocation's modify_index"))),
        (status = 404, description = "`allocation_not_found` or `task_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`task_lost`: the task was declared lost (`lost_at` says when); `run_superseded`: the `Taskgate-Run` named is not the task's current run (`current_run`); either way its agent must stop its process. `task_claimed`: a `running` report not naming the current run of a task running under it (`run`, `last_seen`): another agent runs the task. `task_dead`: the task is dead and no order reopened it, or its allocation is in poststop and it is not a poststop task (`finished_at`)", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "`idempotency_key_reused`: the key came before with another request", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn report(
    State(s): State<AppState>,
    TaskPath(id, task): TaskPath,
    _: ApiQuery<NoParams>,
    prefer: Prefer,
    key: IdempotencyKey,
    RunHeader(run): RunHeader,
    ApiJson(body): ApiJson<ReportBody>,
) -> Result<Response, ApiError> {
    let report = body
        .into_report("", &s.registry.config().limits)
        .map_err(|e| ApiError::invalid("the report is not valid", e))?;
    // The request as a whole: which task, and what of it.
    let key = key.with_request(|request| {
        request.extend_from_slice(&(task.as_str().len() as u64).to_le_bytes());
        request.extend_from_slice(task.as_str().as_bytes());
        report.fingerprint_into(request);
    });
    let a = s
        .registry
        .report_as(id.as_str(), vec![(task.clone(), report)], key, run)
        .await?;
    let i = a.position(task.as_str());
    Ok(written(StatusCode::OK, &a, prefer, i, &s.registry))
}

/// May this task start? (long-poll)
///
/// Answers at once if the task is allowed or told to stop; otherwise waits
/// until one of those holds or `wait` elapses. A timeout is a 200 with
/// `allowed: false`.
#[utoipa::path(
    get, path = "/v1/allocations/{alloc_id}/tasks/{task}/start-condition", operation_id = "getStartCondition", tag = "tasks",
    params(
        ("alloc_id" = String, Path, description = "Allocation ID", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"),
        ("task" = String, Path, description = "Task name", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"),
        ("wait" = Option<String>, Query, pattern = "^([0-9]+(\\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$", description = "Longest wait, with a unit (`500ms`, `30s`, `5m`); default 30s, capped at 300s, plus up to wait/16 jitter"),
    ),
    responses(
        (status = 200, description = "The task's start condition now", body = StartConditionView,
         headers(("X-Taskgate-Index" = u64, description = "The allocation's modify_index"))),
        (status = 404, description = "`allocation_not_found` or `task_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "`allocation_deleted`: deleted while the request waited", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "`too_many_waiters`, `shutting_down`, or `starting` (the store is still loading)", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = u64, description = "Seconds to wait before retrying"))),
    )
)]
pub async fn start_condition(
    State(s): State<AppState>,
    caller: Option<axum::Extension<super::auth::Caller>>,
    TaskPath(id, task): TaskPath,
    RunHeader(run): RunHeader,
    ApiQuery(q): ApiQuery<WaitParams>,
) -> Result<Response, ApiError> {
    let querier = querier(&caller, id.as_str(), run);
    let (a, i) = s
        .registry
        .wait_start(id.as_str(), task.as_str(), s.wait_time(q.wait), querier)
        .await?;
    Ok(indexed(
        StatusCode::OK,
        a.modify_index,
        &StartConditionView::new(&a, i, &s.registry),
    ))
}

/// A sign of life for a task (no body).
///
/// For a task under a liveness TTL: its agent is alive now. Writes
/// nothing, moves no index and wakes nobody; accepted (and ignored) for a
/// task that is not running or has no TTL. With `--store etcd`, answered
/// 503 `store_unavailable` while etcd acknowledges no lease renewal (the
/// sign was heard; send it again).
#[utoipa::path(
    put, path = "/v1/allocations/{alloc_id}/tasks/{task}/heartbeat", operation_id = "heartbeatTask", tag = "tasks",
    params(
        ("alloc_id" = String, Path, description = "Allocation ID", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"),
        ("task" = String, Path, description = "Task name", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"),
    ),
    responses(
        (status = 204, description = "Taken",
         headers(("X-Taskgate-Index" = u64, description = "The allocation's modify_index"))),
        (status = 404, description = "`allocation_not_found` or `task_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`task_lost`: the task was declared lost (`lost_at` says when); `run_superseded`: the `Taskgate-Run` named is not the task's current run (`current_run`); either way its agent must stop its process", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn heartbeat(
    State(s): State<AppState>,
    TaskPath(id, task): TaskPath,
    RunHeader(run): RunHeader,
    _: ApiQuery<NoParams>,
) -> Result<Response, ApiError> {
    let a = s.registry.heartbeat_as(id.as_str(), task.as_str(), run)?;
    let mut res = StatusCode::NO_CONTENT.into_response();
    res.headers_mut().insert(
        super::INDEX_HEADER,
        axum::http::HeaderValue::from(a.modify_index),
    );
    Ok(res)
}
