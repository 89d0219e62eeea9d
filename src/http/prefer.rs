//! `Prefer: return=minimal` (RFC 7240) on writes: the client does not
//! read the allocation view, so the answer is the few fields an agent acts
//! on, with `Preference-Applied: return=minimal`.

use axum::{
    extract::FromRequestParts,
    http::{HeaderName, HeaderValue, StatusCode, request::Parts},
    response::Response,
};
use serde::Serialize;
use utoipa::ToSchema;

use super::{
    indexed,
    views::{AllocationView, StopReasonView},
};
use crate::lifecycle::{Allocation, CoordState, DesiredKind};

pub const PREFERENCE_APPLIED: HeaderName = HeaderName::from_static("preference-applied");
/// The request's header (a `HeaderName` made at compile time: a `&str`
/// is parsed on each use).
const PREFER: HeaderName = HeaderName::from_static("prefer");

/// Whether the request prefers a minimal answer. Never refuses a request:
/// preferences a server does not know are ignored (RFC 7240 §2).
#[derive(Clone, Copy, Debug, Default)]
pub struct Prefer {
    pub minimal: bool,
}

/// Whether one `Prefer` header value asks for `return=minimal`: a list of
/// preferences, each `token[=value]` with `;`-parameters, tokens and this
/// value compared without regard to case, the value maybe quoted.
fn asks_minimal(value: &str) -> bool {
    value.split(',').any(|pref| {
        let head = pref.split(';').next().unwrap_or_default();
        let Some((token, v)) = head.split_once('=') else {
            return false;
        };
        token.trim().eq_ignore_ascii_case("return")
            && v.trim().trim_matches('"').eq_ignore_ascii_case("minimal")
    })
}

impl<S: Send + Sync> FromRequestParts<S> for Prefer {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let minimal = parts
            .headers
            .get_all(PREFER)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .any(asks_minimal);
        Ok(Self { minimal })
    }
}

/// The minimal answer to a write (`Prefer: return=minimal`): the
/// allocation's index and coordinator state, and for a one-task report
/// what that task is told.
#[derive(Debug, Serialize, ToSchema)]
pub struct MinimalView {
    /// The allocation's `modify_index` after the write.
    pub index: u64,
    pub coordinator_state: CoordState,
    /// The reported task (one-task reports only), with its gate and orders.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allowed: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub desired: Option<DesiredKind>,
    /// Present (maybe `null`) exactly when `task` is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<Option<StopReasonView>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub restart_generation: Option<u64>,
    /// The task's current run (`null` unless `running`), present exactly
    /// when `task` is: the answer to the report that started a run names
    /// it, for the agent to send as `Taskgate-Run` from then on.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>, example = "1234")]
    pub run: Option<Option<String>>,
}

/// A write's answer: the allocation view, or the minimal answer when the
/// request prefers it.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum WriteView {
    Full(AllocationView),
    Minimal(MinimalView),
}

impl MinimalView {
    pub fn new(a: &Allocation, task: Option<usize>) -> Self {
        let mut view = Self {
            index: a.modify_index,
            coordinator_state: a.state,
            task: None,
            allowed: None,
            desired: None,
            stop_reason: None,
            restart_generation: None,
            run: None,
        };
        if let Some(i) = task {
            let desired = a.desired(i);
            view.task = Some(a.task_name(i).to_string());
            view.allowed = Some(a.allowed(i));
            view.desired = Some(desired.kind());
            view.stop_reason = Some(desired.reason().map(StopReasonView::from));
            view.restart_generation = Some(a.tasks[i].restart_generation);
            view.run = Some(a.tasks[i].run.map(|r| r.to_string()));
        }
        view
    }
}

/// The answer to a write that changed (or named) `a`: its view, or with
/// `Prefer: return=minimal` the minimal answer (`task`: the one reported).
pub fn written(
    status: StatusCode,
    a: &Allocation,
    prefer: Prefer,
    task: Option<usize>,
    live: &dyn super::views::Live,
) -> Response {
    if prefer.minimal {
        minimal(status, a.modify_index, &MinimalView::new(a, task))
    } else {
        super::allocation_answer(status, a, live)
    }
}

/// `body` as a minimal answer, with `Preference-Applied`.
pub fn minimal<T: Serialize>(status: StatusCode, index: u64, body: &T) -> Response {
    let mut res = indexed(status, index, body);
    res.headers_mut().insert(
        PREFERENCE_APPLIED,
        HeaderValue::from_static("return=minimal"),
    );
    res
}

#[cfg(test)]
mod tests {
    use super::asks_minimal;

    #[test]
    fn return_minimal_is_found_among_other_preferences() {
        for yes in [
            "return=minimal",
            "RETURN=Minimal",
            "respond-async, return=minimal",
            "wait=10, return=\"minimal\"; foo=bar",
            " return = minimal ",
        ] {
            assert!(asks_minimal(yes), "{yes:?}");
        }
        for no in [
            "",
            "return=representation",
            "return",
            "minimal",
            "handling=lenient",
            "x-return=minimal",
        ] {
            assert!(!asks_minimal(no), "{no:?}");
        }
    }
}
