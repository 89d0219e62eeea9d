//! `/v1/barriers/{name}`: tasks of several allocations that start
//! together (docs/lifecycle.md, "Barriers"). A barrier exists while tasks
//! name it; readers see its members and whether it gathers, opened or
//! timed out.

use axum::{extract::State, http::StatusCode, response::Response};
use serde::Serialize;
use utoipa::ToSchema;

use super::{
    AppState,
    error::{ApiError, Problem},
    extract::{ApiQuery, SemaphorePath},
    indexed,
    params::BlockingParams,
};
use crate::{
    lifecycle::Meet,
    registry::{BarrierPhase, BarrierState},
};

/// A barrier and its members.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({
    "name": "train-42", "size": 4, "timeout": "10m",
    "members": [
        {"allocation": "train-1", "task": "worker", "arrived_at": "2026-11-29T10:00:00Z", "standing": "arrived"},
        {"allocation": "train-2", "task": "worker", "arrived_at": null, "standing": "absent"}],
    "state": "gathering", "arrived": 1, "opened_at": null, "modify_index": 1050}))]
pub struct BarrierView {
    pub name: String,
    /// How many members open it, together.
    pub size: u16,
    /// How long it may gather, from the earliest arrival among the
    /// members counted now (`arrived_at`); `null`: for ever.
    #[schema(value_type = Option<String>, example = "10m")]
    #[serde(serialize_with = "super::views::shown_opt")]
    pub timeout: Option<std::time::Duration>,
    /// The tasks that name it, in registration order.
    pub members: Vec<MemberView>,
    pub state: BarrierStateKind,
    /// How many members are each otherwise allowed now (while it gathers).
    pub arrived: usize,
    /// When it opened; `null` unless `state` is `open`.
    #[serde(with = "time::serde::rfc3339::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub opened_at: Option<time::OffsetDateTime>,
    /// The index of the last change of a member (a blocking query's
    /// `index`).
    pub modify_index: u64,
}

/// `gathering`: fewer than `size` members are otherwise allowed at once;
/// `open`: it opened, for good; `timed_out`: its timeout passed first,
/// and its members' allocations were told to stop.
#[derive(Clone, Copy, Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum BarrierStateKind {
    Gathering,
    Open,
    TimedOut,
}

/// A member of a barrier.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"allocation": "train-1", "task": "worker", "arrived_at": "2026-11-29T10:00:00Z", "standing": "arrived"}))]
pub struct MemberView {
    pub allocation: String,
    pub task: String,
    /// Since when it counts among the arrived (otherwise allowed); `null`
    /// when it does not (now, or any more: once the barrier decided).
    #[serde(with = "time::serde::rfc3339::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub arrived_at: Option<time::OffsetDateTime>,
    pub standing: Standing,
}

/// Where a member stands: `absent` (not otherwise allowed: its gate,
/// a dependency or a stop order holds it), `arrived`, `passed` (the
/// barrier opened for it) or `timed_out`.
#[derive(Clone, Copy, Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Standing {
    Absent,
    Arrived,
    Passed,
    TimedOut,
}

fn view(s: &AppState, b: BarrierState) -> BarrierView {
    let members = b
        .members
        .iter()
        .map(|(id, i, meet)| {
            let task = s
                .registry
                .get(id.as_str())
                .ok()
                .and_then(|a| a.spec.tasks().get(*i).map(|t| t.name.to_string()))
                .unwrap_or_default();
            let (arrived_at, standing) = match meet {
                None => (None, Standing::Absent),
                Some(Meet::Arrived { at }) => (Some(*at), Standing::Arrived),
                Some(Meet::Passed { .. }) => (None, Standing::Passed),
                Some(Meet::Closed { .. }) => (None, Standing::TimedOut),
            };
            MemberView {
                allocation: id.to_string(),
                task,
                arrived_at,
                standing,
            }
        })
        .collect();
    let (state, arrived, opened_at) = match b.phase {
        BarrierPhase::Gathering { arrived, .. } => (BarrierStateKind::Gathering, arrived, None),
        BarrierPhase::Open(at) => (BarrierStateKind::Open, 0, Some(at)),
        BarrierPhase::TimedOut(_) => (BarrierStateKind::TimedOut, 0, None),
    };
    BarrierView {
        name: b.name.to_string(),
        size: b.size,
        timeout: b.timeout,
        members,
        state,
        arrived,
        opened_at,
        modify_index: b.changed,
    }
}

/// Read a barrier: its members and its state (blocking query).
///
/// A barrier exists while tasks of registered allocations name it. With
/// `index=N` the answer waits until a member changes past N, or `wait`
/// elapses; a barrier forgotten meanwhile answers 404 at once.
#[utoipa::path(
    get, path = "/v1/barriers/{name}", operation_id = "getBarrier", tag = "barriers",
    params(
        ("name" = String, Path, description = "Barrier name", min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"),
        ("index" = Option<u64>, Query, minimum = 0, description = "Wait for a modify_index greater than this (0: answer at once)"),
        ("wait" = Option<String>, Query, pattern = "^([0-9]+(\\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$", description = "Longest wait, with a unit; default 30s, capped at 300s"),
    ),
    responses(
        (status = 200, description = "The barrier", body = BarrierView,
         headers(("X-Taskgate-Index" = u64, description = "The barrier's modify_index"))),
        (status = 404, description = "`barrier_not_found`", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn get(
    State(s): State<AppState>,
    SemaphorePath(name): SemaphorePath,
    ApiQuery(q): ApiQuery<BlockingParams>,
) -> Result<Response, ApiError> {
    let not_found = || {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "barrier_not_found",
            format!("no registered task names barrier {:?}", name.as_str()),
        )
    };
    // Answers at once with `index` 0 (or past it), or once it is gone.
    let state = s
        .registry
        .wait_barrier(name.as_str(), q.index, s.wait_time(q.wait))
        .await
        .ok_or_else(not_found)?;
    let v = view(&s, state);
    Ok(indexed(StatusCode::OK, v.modify_index, &v))
}
