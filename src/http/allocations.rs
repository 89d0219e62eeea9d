//! `/v1/allocations` and `/v1/allocations/{alloc_id}`: register, status,
//! list, deregister, batch reports, restart and restore. Each handler
//! parses, makes one registry call, and renders.

use std::sync::Arc;

use axum::{
    extract::State,
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};

use super::{
    AppState, NEXT_TOKEN_HEADER,
    dto::{BatchBody, RegisterBody, RestartBody},
    error::{ApiError, Problem},
    extract::{AllocPath, ApiJson, ApiJsonOrEmpty, ApiQuery, IdempotencyKey, NoParams, RunHeader},
    indexed,
    params::{BlockingParams, ListParams},
    prefer::{MinimalView, Prefer, WriteView, minimal, written},
    views::{AllocationView, ListItem, RestartView, TimelineView},
};
use crate::{
    lifecycle::{AllocId, Allocation, FieldError, TaskName},
    registry::{RegistryError, RestartTarget},
};

/// The reason recorded when a restart request gives none.
pub const DEFAULT_RESTART_REASON: &str = "Restart requested through the API";

/// Register an allocation.
///
/// A new allocation is evaluated at once with every task `pending`.
/// Registering the same spec again is an idempotent success (200).
#[utoipa::path(
    put, path = "/v1/allocations/{alloc_id}", operation_id = "registerAllocation", tag = "allocations",
    params(("alloc_id" = String, Path, description = "Allocation ID", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"),
           ("Prefer" = Option<String>, Header, description = "`return=minimal` (RFC 7240): answer only the index and the coordinator state (and for a one-task report what the task is told), with `Preference-Applied: return=minimal`")),
    request_body = RegisterBody,
    responses(
        (status = 201, description = "Registered", body = WriteView,
         headers(("Location" = String, description = "Path of the new allocation"),
                 ("X-Taskgate-Index" = u64, description = "The allocation's modify_index"))),
        (status = 200, description = "Already registered with the same spec", body = WriteView,
         headers(("X-Taskgate-Index" = u64, description = "The allocation's modify_index"))),
        (status = 409, description = "`allocation_exists`: registered with a different spec; `dependency_cycle`: the dependencies close a cycle through other allocations; `barrier_mismatch`: a task's barrier has members of another size or timeout; `barrier_closed`: a task's barrier opened, timed out or has its `size` members",
         body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "`quota_exceeded`: the server's allocation limit (`--max-allocations`) or the token's (`max_allocations` in the token file) is reached, or the dependencies on other allocations would pass a target's limit (`--max-dependents`) or the token's (`max_dependencies`, `--max-dependencies-per-token`)",
         body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn register(
    State(s): State<AppState>,
    caller: Option<axum::Extension<super::auth::Caller>>,
    AllocPath(id): AllocPath,
    _: ApiQuery<NoParams>,
    prefer: Prefer,
    ApiJson(body): ApiJson<RegisterBody>,
) -> Result<Response, ApiError> {
    let spec = body
        .into_spec(&s.registry.config().limits, &id)
        .map_err(|e| ApiError::invalid("the allocation spec is not valid", e))?;
    // A dependency reads its target's state: a token may declare one only
    // on allocations it may read.
    if let Some(token) = caller.as_ref().map(|c| &c.0.0) {
        let outside = spec
            .tasks()
            .iter()
            .flat_map(|t| t.depends_on.iter())
            .filter_map(|d| d.allocation.as_ref())
            .find(|target| !token.may_read(target.as_str()));
        if let Some(target) = outside {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!(
                    "token {:?} may not read allocation {:?}, so it may not depend on it (its \
                     prefixes are {:?})",
                    token.name,
                    target.as_str(),
                    token.alloc_prefixes
                ),
            ));
        }
    }
    // A task that acquires a semaphore holds it against other tenants'
    // tasks, and a barrier member can close a barrier to them: a token
    // may name only the semaphores and barriers within its
    // `semaphore_prefixes`.
    if let Some(token) = caller.as_ref().map(|c| &c.0.0) {
        let outside = spec
            .tasks()
            .iter()
            .flat_map(|t| {
                let sems = t.acquire.iter().map(|n| ("acquire semaphore", n));
                sems.chain(t.barrier.iter().map(|b| ("meet at barrier", &b.name)))
            })
            .find(|(_, name)| !token.may_use_semaphore(name.as_str()));
        if let Some((what, name)) = outside {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!(
                    "token {:?} may not {what} {:?}: it is outside its \
                     semaphore_prefixes {:?}",
                    token.name,
                    name.as_str(),
                    token.semaphore_prefixes
                ),
            ));
        }
    }
    let quota = caller.as_ref().and_then(|c| c.0.0.quota());
    let (a, created) = match s.registry.register_within(id, spec, quota).await {
        // A cycle through held allocations may pass through ones this
        // token may not read: their IDs are not shown to it.
        Err(RegistryError::DependencyCycle { path, held: true }) => {
            let path = match caller.as_ref().map(|c| &c.0.0) {
                Some(token) => path
                    .into_iter()
                    .map(|step| {
                        let alloc = step.rsplit_once('/').map_or(step.as_str(), |(a, _)| a);
                        if token.may_read(alloc) {
                            step
                        } else {
                            HIDDEN_STEP.to_owned()
                        }
                    })
                    .collect(),
                None => path,
            };
            return Err(RegistryError::DependencyCycle { path, held: true }.into());
        }
        other => other?,
    };
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let mut res = written(status, &a, prefer, None, &s.registry);
    if created {
        let location = format!("/v1/allocations/{}", a.id);
        if let Ok(v) = HeaderValue::from_str(&location) {
            res.headers_mut().insert(header::LOCATION, v);
        }
    }
    Ok(res)
}

/// A step of a dependency cycle's path in an allocation the caller's token
/// may not read.
pub const HIDDEN_STEP: &str = "(an allocation outside this token's prefixes)";

/// Read an allocation (blocking query).
///
/// With `index=N` the answer waits until the allocation's `modify_index`
/// is greater than N or `wait` elapses; either way it is a 200 with the
/// current value.
#[utoipa::path(
    get, path = "/v1/allocations/{alloc_id}", operation_id = "getAllocation", tag = "allocations",
    params(
        ("alloc_id" = String, Path, description = "Allocation ID", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"),
        ("index" = Option<u64>, Query, minimum = 0, description = "Wait for a modify_index greater than this (0: answer at once)"),
        ("wait" = Option<String>, Query, pattern = "^([0-9]+(\\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$", description = "Longest wait, with a unit (`500ms`, `30s`, `5m`); default 30s, capped at 300s, plus up to wait/16 jitter"),
    ),
    responses(
        (status = 200, description = "The allocation", body = AllocationView,
         headers(("X-Taskgate-Index" = u64, description = "The allocation's modify_index"))),
        (status = 404, description = "`allocation_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "`allocation_deleted`: deleted while the request waited", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "`too_many_waiters`, `shutting_down`, or `starting` (the store is still loading)", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = u64, description = "Seconds to wait before retrying"))),
    )
)]
pub async fn get(
    State(s): State<AppState>,
    AllocPath(id): AllocPath,
    ApiQuery(q): ApiQuery<BlockingParams>,
) -> Result<Response, ApiError> {
    let a = current_or_newer(&s, &id, q).await?;
    Ok(super::allocation_answer(StatusCode::OK, &a, &s.registry))
}

/// The allocation now, or with `index` > 0 once its `modify_index` passes
/// it (or `wait` elapses): what every blocking query on an allocation
/// reads.
async fn current_or_newer(
    s: &AppState,
    id: &AllocId,
    q: BlockingParams,
) -> Result<Arc<Allocation>, ApiError> {
    s.registry.look_up(id.as_str()).await?;
    Ok(if q.index == 0 {
        s.registry.get(id.as_str())?
    } else {
        s.registry
            .wait_alloc(id.as_str(), q.index, s.wait_time(q.wait))
            .await?
    })
}

/// The allocation's timeline (blocking query).
///
/// The server's decisions — registration, coordinator transitions, task
/// state changes, stop and restart orders, restores — next to the agents'
/// events, oldest first, the last `--timeline-events` (default 64). Kept
/// in memory: a restarted server starts each timeline afresh.
#[utoipa::path(
    get, path = "/v1/allocations/{alloc_id}/events", operation_id = "getAllocationTimeline", tag = "allocations",
    params(
        ("alloc_id" = String, Path, description = "Allocation ID", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"),
        ("index" = Option<u64>, Query, minimum = 0, description = "Wait for a modify_index greater than this (0: answer at once)"),
        ("wait" = Option<String>, Query, pattern = "^([0-9]+(\\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$", description = "Longest wait, with a unit (`500ms`, `30s`, `5m`); default 30s, capped at 300s, plus up to wait/16 jitter"),
    ),
    responses(
        (status = 200, description = "The timeline", body = TimelineView,
         headers(("X-Taskgate-Index" = u64, description = "The allocation's modify_index"))),
        (status = 404, description = "`allocation_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "`allocation_deleted`: deleted while the request waited", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "`too_many_waiters`, `shutting_down`, or `starting` (the store is still loading)", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = u64, description = "Seconds to wait before retrying"))),
    )
)]
pub async fn timeline(
    State(s): State<AppState>,
    AllocPath(id): AllocPath,
    ApiQuery(q): ApiQuery<BlockingParams>,
) -> Result<Response, ApiError> {
    let a = current_or_newer(&s, &id, q).await?;
    let entries = s.registry.timeline(&a);
    Ok(indexed(
        StatusCode::OK,
        a.modify_index,
        &TimelineView::new(&a, &entries),
    ))
}

/// List allocations.
///
/// IDs in sorted order, filtered by prefix and state, paged with
/// `per_page` and the token from `X-Taskgate-NextToken`.
#[utoipa::path(
    get, path = "/v1/allocations", operation_id = "listAllocations", tag = "allocations",
    params(
        ("prefix" = Option<String>, Query, description = "Only IDs starting with this"),
        ("per_page" = Option<usize>, Query, minimum = 1, maximum = 1000, description = "1 to 1000, default 100"),
        ("next_token" = Option<String>, Query, min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$", description = "The X-Taskgate-NextToken of the previous page"),
        ("state" = Option<String>, Query, example = "failed,lost", pattern = "^(running|finished|failed|lost|blocked)(,(running|finished|failed|lost|blocked))*$", description = "Only allocations in one of these, comma-separated: `running`, `finished`, `failed`, `lost`, `blocked` (the `ListState` values). A filtered page passes over at most 10,000 allocations left out: it may be short, or empty, and still have a next page."),
    ),
    responses(
        (status = 200, description = "One page of allocations", body = Vec<ListItem>,
         headers(("X-Taskgate-NextToken" = String, description = "Present when there are more: pass it as next_token"),
                 ("X-Taskgate-Index" = u64, description = "Every change up to this index is in the listing: follow the event stream (`GET /v1/events?index=`) from it"))),
    )
)]
pub async fn list(
    State(s): State<AppState>,
    ApiQuery(q): ApiQuery<ListParams>,
) -> Result<Response, ApiError> {
    // Read before the listing: every change up to it is in what follows.
    let index = s.registry.stream_index();
    // Each allocation's troubles are read once: to filter, then to show.
    let mut troubles = Vec::new();
    let (page, next) = s.registry.list(
        &q.prefix,
        q.next_token.as_ref().map(|t| t.as_str()),
        q.per_page,
        |a| {
            let t = a.troubles();
            let keep = q.state.is_empty() || q.state.iter().any(|&s| a.is_in(s, &t));
            if keep {
                troubles.push(t);
            }
            keep
        },
    );
    let items: Vec<ListItem> = page
        .iter()
        .zip(&troubles)
        .map(|(a, t)| ListItem::new(a, t))
        .collect();
    let mut res = super::indexed(StatusCode::OK, index, &items);
    if let Some(next) = next.and_then(|n| HeaderValue::from_str(n.as_str()).ok()) {
        res.headers_mut().insert(NEXT_TOKEN_HEADER, next);
    }
    Ok(res)
}

/// Deregister an allocation. Requests waiting on it end with 410.
#[utoipa::path(
    delete, path = "/v1/allocations/{alloc_id}", operation_id = "deleteAllocation", tag = "allocations",
    params(("alloc_id" = String, Path, description = "Allocation ID", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$")),
    responses(
        (status = 204, description = "Deleted",
         headers(("X-Taskgate-Index" = u64, description = "The index of the deletion"))),
        (status = 404, description = "`allocation_not_found`", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn delete(
    State(s): State<AppState>,
    AllocPath(id): AllocPath,
    _: ApiQuery<NoParams>,
) -> Result<Response, ApiError> {
    let index = s.registry.delete(id.as_str()).await?;
    let mut res = StatusCode::NO_CONTENT.into_response();
    res.headers_mut()
        .insert(super::INDEX_HEADER, HeaderValue::from(index));
    Ok(res)
}

/// Report several tasks at once.
///
/// All reports are applied together, then the coordinator evaluates once.
/// An unknown task or an invalid value rejects the whole request.
#[utoipa::path(
    post, path = "/v1/allocations/{alloc_id}/task-states", operation_id = "reportTaskStates", tag = "tasks",
    params(("alloc_id" = String, Path, description = "Allocation ID", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"),
           ("Prefer" = Option<String>, Header, description = "`return=minimal` (RFC 7240): answer only the index and the coordinator state (and for a one-task report what the task is told), with `Preference-Applied: return=minimal`"),
           ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = "^[ -~]+$", description = "1 to 255 printable ASCII characters (IETF httpapi draft). A retry with the same key and the same request, within the task's last few keyed writes, answers the record as it is and applies nothing again; the same key with another request is 422 `idempotency_key_reused`. Kept with the record: it holds across restarts and replicas.")),
    request_body = BatchBody,
    responses(
        (status = 200, description = "The allocation after the reports", body = WriteView,
         headers(("X-Taskgate-Index" = u64, description = "The allocation's modify_index"))),
        (status = 404, description = "`allocation_not_found` or `task_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`task_lost`: a named task was declared lost (`lost_at` says when); its agent must stop its process. `run_superseded`, `task_claimed`, `task_dead`: as for a one-task report (the problem names the task)", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "`idempotency_key_reused`: the key came before with another request", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn report_batch(
    State(s): State<AppState>,
    AllocPath(id): AllocPath,
    _: ApiQuery<NoParams>,
    prefer: Prefer,
    key: IdempotencyKey,
    RunHeader(run): RunHeader,
    ApiJson(body): ApiJson<BatchBody>,
) -> Result<Response, ApiError> {
    let reports = batch(&s, body)?;
    let key = key.with_request(|request| {
        for (name, r) in &reports {
            request.extend_from_slice(&(name.as_str().len() as u64).to_le_bytes());
            request.extend_from_slice(name.as_str().as_bytes());
            r.fingerprint_into(request);
        }
    });
    let a = s.registry.report_as(id.as_str(), reports, key, run).await?;
    Ok(written(StatusCode::OK, &a, prefer, None, &s.registry))
}

/// The reports of a batch body, checked against the limits.
fn batch(
    s: &AppState,
    body: BatchBody,
) -> Result<Vec<(TaskName, crate::lifecycle::TaskReport)>, ApiError> {
    body.into_reports(&s.registry.config().limits)
        .map_err(|e| ApiError::invalid("a task report is not valid", e))
}

/// Restore a coordinator from known task states.
///
/// Puts the coordinator in `prestart`, applies the states as reports, and
/// evaluates until stable. For an owner that lost its coordinator.
#[utoipa::path(
    post, path = "/v1/allocations/{alloc_id}/restore", operation_id = "restoreAllocation", tag = "allocations",
    params(("alloc_id" = String, Path, description = "Allocation ID", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"),
           ("Prefer" = Option<String>, Header, description = "`return=minimal` (RFC 7240): answer only the index and the coordinator state (and for a one-task report what the task is told), with `Preference-Applied: return=minimal`")),
    request_body = BatchBody,
    responses(
        (status = 200, description = "The restored allocation", body = WriteView,
         headers(("X-Taskgate-Index" = u64, description = "The allocation's modify_index"))),
        (status = 404, description = "`allocation_not_found` or `task_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "An agent's restore (a resume, SEMANTICS \"Runs\") only: `task_lost` for a named task that was declared lost, `task_dead` for a dead task no order reopened (or any but a poststop task once the allocation is in poststop)", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn restore(
    State(s): State<AppState>,
    caller: Option<axum::Extension<super::auth::Caller>>,
    AllocPath(id): AllocPath,
    _: ApiQuery<NoParams>,
    prefer: Prefer,
    ApiJson(body): ApiJson<BatchBody>,
) -> Result<Response, ApiError> {
    let reports = batch(&s, body)?;
    // An agent's restore is a resume; an operator's (or any caller's on a
    // server without tokens) an order.
    let agent = caller
        .as_ref()
        .is_some_and(|c| c.0.0.role == super::auth::Role::Agent);
    let a = if agent {
        s.registry.resume(id.as_str(), reports).await?
    } else {
        s.registry.restore(id.as_str(), reports).await?
    };
    Ok(written(StatusCode::OK, &a, prefer, None, &s.registry))
}

/// Stop the allocation (operator; no body).
///
/// Gives the allocation the sticky stop order "Stopped By Operator": every
/// task not yet dead is told to stop (a pending task reports `dead`
/// without starting), the coordinator reaches `poststop` as usual and the
/// poststop tasks run, as the cleanup; the allocation ends with outcome
/// `stopped`. A stop order already in force (its root cause) stays, and
/// the request changes nothing. An all-tasks restart clears the order, as
/// it clears any.
#[utoipa::path(
    post, path = "/v1/allocations/{alloc_id}/stop", operation_id = "stopAllocation", tag = "allocations",
    params(("alloc_id" = String, Path, description = "Allocation ID", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"),
           ("Prefer" = Option<String>, Header, description = "`return=minimal` (RFC 7240): answer only the index and the coordinator state, with `Preference-Applied: return=minimal`")),
    responses(
        (status = 200, description = "The allocation after the order", body = WriteView,
         headers(("X-Taskgate-Index" = u64, description = "The allocation's modify_index"))),
        (status = 404, description = "`allocation_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`allocation_finished`: the coordinator is in `poststop` (every task but the cleanup is dead), nothing is left to stop", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn stop(
    State(s): State<AppState>,
    AllocPath(id): AllocPath,
    _: ApiQuery<NoParams>,
    prefer: Prefer,
) -> Result<Response, ApiError> {
    let a = s.registry.stop(id.as_str()).await?;
    Ok(written(StatusCode::OK, &a, prefer, None, &s.registry))
}

/// Restart tasks.
///
/// `{}` restarts every running task, `{"task": "web"}` one running task,
/// `{"all_tasks": true}` every running or dead task and resets the
/// coordinator to `init`. Poststop tasks never restart. A restart records
/// an order (`restart_generation` + 1 and a "Restart Signaled" event); it
/// does not change reported states.
#[utoipa::path(
    post, path = "/v1/allocations/{alloc_id}/restart", operation_id = "restartAllocation", tag = "allocations",
    params(("alloc_id" = String, Path, description = "Allocation ID", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"),
           ("Prefer" = Option<String>, Header, description = "`return=minimal` (RFC 7240): answer only the index and the coordinator state (and for a one-task report what the task is told), with `Preference-Applied: return=minimal`")),
    request_body(content = RestartBody, description = "May be empty, meaning `{}`"),
    responses(
        (status = 200, description = "The tasks told to restart; with `Prefer: return=minimal` only the index and the coordinator state", body = RestartView,
         headers(("X-Taskgate-Index" = u64, description = "The allocation's modify_index"))),
        (status = 404, description = "`allocation_not_found` or `task_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`task_not_running` or `allocation_finished`", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn restart(
    State(s): State<AppState>,
    AllocPath(id): AllocPath,
    _: ApiQuery<NoParams>,
    prefer: Prefer,
    ApiJsonOrEmpty(body): ApiJsonOrEmpty<RestartBody>,
) -> Result<Response, ApiError> {
    let limits = s.registry.config().limits;
    let mut errors = Vec::new();
    let target = match (body.task, body.all_tasks) {
        (Some(_), true) => {
            errors.push(FieldError::new(
                "all_tasks",
                "give either `task` or `all_tasks`, not both",
            ));
            None
        }
        (Some(task), false) => match TaskName::parse(&task) {
            Ok(name) => Some(RestartTarget::Task(name)),
            Err(e) => {
                errors.push(FieldError::new("task", format!("{task:?} {e}")));
                None
            }
        },
        (None, true) => Some(RestartTarget::AllTasks),
        (None, false) => Some(RestartTarget::Running),
    };
    let reason = body
        .reason
        .unwrap_or_else(|| DEFAULT_RESTART_REASON.to_owned());
    if reason.len() > limits.max_event_message {
        errors.push(FieldError::new(
            "reason",
            format!("must be at most {} bytes", limits.max_event_message),
        ));
    }
    let Some(target) = target.filter(|_| errors.is_empty()) else {
        return Err(ApiError::invalid(
            "the restart request is not valid",
            errors,
        ));
    };
    let (a, restarted) = s.registry.restart(id.as_str(), target, &reason).await?;
    if prefer.minimal {
        return Ok(minimal(
            StatusCode::OK,
            a.modify_index,
            &MinimalView::new(&a, None),
        ));
    }
    let view = RestartView {
        restarted: restarted.iter().map(ToString::to_string).collect(),
        coordinator_state: a.state,
        index: a.modify_index,
    };
    Ok(indexed(StatusCode::OK, a.modify_index, &view))
}
