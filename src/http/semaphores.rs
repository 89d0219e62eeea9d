//! `/v1/semaphores`: at most N tasks at once, across allocations
//! (docs/lifecycle.md, "Semaphores"). Operators create, change and delete
//! them; readers see each one's holders and queue.

use axum::{
    extract::State,
    http::{HeaderValue, StatusCode},
    response::{IntoResponse, Response},
};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{
    AppState, NEXT_TOKEN_HEADER,
    error::{ApiError, Problem},
    extract::{ApiJson, ApiQuery, NoParams, SemaphorePath},
    indexed,
    params::{BlockingParams, ListParams},
};
use crate::{
    lifecycle::{DEFAULT_GRANT_TIMEOUT, FieldError, GRANT_TIMEOUT_RANGE, LIMIT_RANGE},
    registry::SemaphoreState,
    units::{Shown, format_duration},
};

/// `PUT /v1/semaphores/{name}`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"limit": 2, "grant_timeout": "5m"}))]
pub struct SemaphoreBody {
    /// How many tasks may hold it at once: 1 to 10,000. Raised, the tasks
    /// first in line are granted at once; lowered, no holder loses its
    /// slot (no grant is made until fewer hold it than the limit).
    #[schema(value_type = u64, minimum = 1, maximum = 10000)]
    pub limit: serde_json::Number,
    /// How long a granted task may take to become `running` (1s to 24h,
    /// with a unit; default 1m): past it the grant lapses and the task
    /// goes to the back of the queue.
    #[serde(default)]
    #[schema(example = "1m", pattern = "^([0-9]+(\\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$")]
    pub grant_timeout: Option<String>,
}

/// A semaphore, its holders and its queue.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({
    "name": "db-migrations", "limit": 2, "grant_timeout": "1m",
    "holders": [{"allocation": "app-3", "task": "migrate", "run": "1043", "fence": 1040,
                 "since": "2026-11-29T10:00:00Z"}],
    "queue": [{"allocation": "app-4", "task": "migrate", "since": "2026-11-29T09:59:58Z"}],
    "next_fence": 1051, "modify_index": 1050}))]
pub struct SemaphoreView {
    pub name: String,
    pub limit: u32,
    #[schema(value_type = String, example = "1m")]
    #[serde(serialize_with = "super::views::shown")]
    pub grant_timeout: Shown,
    /// The tasks that hold a slot, by fence.
    pub holders: Vec<HolderView>,
    /// The tasks waiting for a slot, first in line first.
    pub queue: Vec<QueuedView>,
    /// The next grant's fence is at least this (fences are the store's
    /// indexes of the grants: they grow and are never reused).
    pub next_fence: u64,
    /// The index of the last change of the semaphore or its line (a
    /// blocking query's `index`).
    pub modify_index: u64,
}

/// A task holding a slot.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"allocation": "app-3", "task": "migrate", "run": "1043", "fence": 1040,
                          "since": "2026-11-29T10:00:00Z"}))]
pub struct HolderView {
    pub allocation: String,
    pub task: String,
    /// Its current run, once it is `running` (granted and not started
    /// yet: `null`).
    pub run: Option<String>,
    pub fence: u64,
    /// When it was granted.
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub since: time::OffsetDateTime,
}

/// A task in the queue.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"allocation": "app-4", "task": "migrate", "since": "2026-11-29T09:59:58Z"}))]
pub struct QueuedView {
    pub allocation: String,
    pub task: String,
    /// When it joined the queue (became otherwise allowed).
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub since: time::OffsetDateTime,
}

fn view(s: &AppState, state: SemaphoreState) -> SemaphoreView {
    let r = &s.registry;
    let task = |id: &crate::lifecycle::AllocId, i: usize| {
        let a = r.get(id.as_str()).ok();
        let name = a
            .as_ref()
            .and_then(|a| a.spec.tasks().get(i))
            .map_or_else(String::new, |t| t.name.to_string());
        (a, name)
    };
    let holders = state
        .holders
        .iter()
        .map(|(id, i, h)| {
            let (a, name) = task(id, *i);
            HolderView {
                allocation: id.to_string(),
                task: name,
                run: a
                    .and_then(|a| a.tasks.get(*i).and_then(|t| t.run))
                    .map(|r| r.to_string()),
                fence: h.fence,
                since: h.since,
            }
        })
        .collect();
    let queue = state
        .queue
        .iter()
        .map(|(_, id, i)| {
            let (a, name) = task(id, *i);
            let since = a
                .and_then(|a| match a.tasks.get(*i)?.hold()? {
                    crate::lifecycle::Hold::Queued { at, .. } => Some(at),
                    crate::lifecycle::Hold::Granted { .. } => None,
                })
                .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
            QueuedView {
                allocation: id.to_string(),
                task: name,
                since,
            }
        })
        .collect();
    SemaphoreView {
        name: state.semaphore.name.to_string(),
        limit: state.semaphore.limit,
        grant_timeout: Shown(state.semaphore.grant_timeout),
        holders,
        queue,
        next_fence: r.last_index() + 1,
        modify_index: state.changed,
    }
}

/// Create or change a semaphore (operator).
///
/// `limit` bounds how many tasks hold it at once, across allocations;
/// tasks name it in `acquire`. Changing a limit revokes nothing.
#[utoipa::path(
    put, path = "/v1/semaphores/{name}", operation_id = "putSemaphore", tag = "semaphores",
    params(("name" = String, Path, description = "Semaphore name (as an allocation ID)", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$")),
    request_body = SemaphoreBody,
    responses(
        (status = 201, description = "Created", body = SemaphoreView,
         headers(("X-Taskgate-Index" = u64, description = "The semaphore's modify_index"))),
        (status = 200, description = "Changed (or already so)", body = SemaphoreView,
         headers(("X-Taskgate-Index" = u64, description = "The semaphore's modify_index"))),
        (status = 400, description = "`invalid_request`: a limit or grant_timeout out of range", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn put(
    State(s): State<AppState>,
    SemaphorePath(name): SemaphorePath,
    _: ApiQuery<NoParams>,
    ApiJson(body): ApiJson<SemaphoreBody>,
) -> Result<Response, ApiError> {
    let mut errors = Vec::new();
    let (min, max) = LIMIT_RANGE;
    let limit = match super::dto::whole(&body.limit).and_then(|n| u32::try_from(n).ok()) {
        Some(n) if (min..=max).contains(&n) => n,
        _ => {
            errors.push(FieldError::new(
                "limit",
                format!("must be {min} to {max}, got {}", body.limit),
            ));
            min
        }
    };
    let grant_timeout = match body.grant_timeout.as_deref() {
        None => DEFAULT_GRANT_TIMEOUT,
        Some(text) => match crate::units::parse_duration(text) {
            Ok(d) if d >= GRANT_TIMEOUT_RANGE.0 && d <= GRANT_TIMEOUT_RANGE.1 => d,
            Ok(d) => {
                errors.push(FieldError::new(
                    "grant_timeout",
                    format!(
                        "must be {} to {}, got {}",
                        format_duration(GRANT_TIMEOUT_RANGE.0),
                        format_duration(GRANT_TIMEOUT_RANGE.1),
                        format_duration(d)
                    ),
                ));
                DEFAULT_GRANT_TIMEOUT
            }
            Err(e) => {
                errors.push(FieldError::new("grant_timeout", e));
                DEFAULT_GRANT_TIMEOUT
            }
        },
    };
    if !errors.is_empty() {
        return Err(ApiError::invalid("invalid semaphore", errors));
    }
    let (_, created) = s
        .registry
        .put_semaphore(name.clone(), limit, grant_timeout)
        .await?;
    let state = s.registry.semaphore(name.as_str()).ok_or_else(|| {
        ApiError::from(crate::registry::RegistryError::SemaphoreNotFound(
            name.to_string(),
        ))
    })?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let v = view(&s, state);
    Ok(indexed(status, v.modify_index, &v))
}

/// Read a semaphore: its holders and its queue (blocking query).
///
/// With `index=N` the answer waits until the semaphore or its line changes
/// past N, or `wait` elapses; a semaphore deleted meanwhile answers 404 at
/// once.
#[utoipa::path(
    get, path = "/v1/semaphores/{name}", operation_id = "getSemaphore", tag = "semaphores",
    params(
        ("name" = String, Path, description = "Semaphore name", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"),
        ("index" = Option<u64>, Query, minimum = 0, description = "Wait for a modify_index greater than this (0: answer at once)"),
        ("wait" = Option<String>, Query, pattern = "^([0-9]+(\\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$", description = "Longest wait, with a unit; default 30s, capped at 300s"),
    ),
    responses(
        (status = 200, description = "The semaphore", body = SemaphoreView,
         headers(("X-Taskgate-Index" = u64, description = "The semaphore's modify_index"))),
        (status = 404, description = "`semaphore_not_found`", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn get(
    State(s): State<AppState>,
    SemaphorePath(name): SemaphorePath,
    ApiQuery(q): ApiQuery<BlockingParams>,
) -> Result<Response, ApiError> {
    let not_found = || {
        ApiError::from(crate::registry::RegistryError::SemaphoreNotFound(
            name.to_string(),
        ))
    };
    // Answers at once with `index` 0 (or past it), or once it is gone.
    let state = s
        .registry
        .wait_semaphore(name.as_str(), q.index, s.wait_time(q.wait))
        .await
        .ok_or_else(not_found)?;
    let v = view(&s, state);
    Ok(indexed(StatusCode::OK, v.modify_index, &v))
}

/// List semaphores, by name, paged as allocations are.
#[utoipa::path(
    get, path = "/v1/semaphores", operation_id = "listSemaphores", tag = "semaphores",
    params(
        ("prefix" = Option<String>, Query, pattern = "^([A-Za-z0-9][A-Za-z0-9._-]*)?$", description = "Only names starting with this"),
        ("per_page" = Option<usize>, Query, minimum = 1, maximum = 1000, description = "1 to 1000, default 100"),
        ("next_token" = Option<String>, Query, min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$", description = "The X-Taskgate-NextToken of the previous page"),
    ),
    responses(
        (status = 200, description = "One page of semaphores", body = Vec<SemaphoreView>,
         headers(("X-Taskgate-NextToken" = String, description = "Present when there are more: pass it as next_token"))),
    )
)]
pub async fn list(
    State(s): State<AppState>,
    ApiQuery(q): ApiQuery<ListParams>,
) -> Result<Response, ApiError> {
    if !q.state.is_empty() {
        return Err(ApiError::invalid(
            "invalid query",
            vec![FieldError::new(
                "state",
                "filters allocations only; semaphores are listed by name",
            )],
        ));
    }
    let start = q
        .next_token
        .as_ref()
        .map_or(q.prefix.as_str(), |t| t.as_str().max(q.prefix.as_str()));
    let mut page: Vec<SemaphoreState> = s
        .registry
        .semaphores(start, q.per_page + 1)
        .into_iter()
        .filter(|st| st.semaphore.name.as_str().starts_with(q.prefix.as_str()))
        .collect();
    let next = (page.len() > q.per_page).then(|| page.pop()).flatten();
    let items: Vec<SemaphoreView> = page.into_iter().map(|st| view(&s, st)).collect();
    let mut res = indexed(StatusCode::OK, s.registry.last_index(), &items);
    if let Some(next) = next.and_then(|n| HeaderValue::from_str(n.semaphore.name.as_str()).ok()) {
        res.headers_mut().insert(NEXT_TOKEN_HEADER, next);
    }
    Ok(res)
}

/// Delete a semaphore (operator). Its holders keep their slots; its
/// waiters wait, visibly (`why: not_registered`), until it is created
/// again.
#[utoipa::path(
    delete, path = "/v1/semaphores/{name}", operation_id = "deleteSemaphore", tag = "semaphores",
    params(("name" = String, Path, description = "Semaphore name", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "`semaphore_not_found`", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn delete(
    State(s): State<AppState>,
    SemaphorePath(name): SemaphorePath,
    _: ApiQuery<NoParams>,
) -> Result<Response, ApiError> {
    s.registry.delete_semaphore(&name).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
