//! Response bodies, built from committed records.

use serde::Serialize;
use time::OffsetDateTime;
use utoipa::ToSchema;

use crate::{
    lifecycle::{
        Allocation, Condition, CoordState, Deadlines, DepState, DesiredKind, Details, Event,
        Events, Hook, Outcome, RunState, Stage, StopKind, Timestamp, Trouble, TroubleKind, WaitFor,
        Why,
    },
    registry::{Gathering, Waiting},
    units::{Shown, format_duration},
};

/// What a view shows beyond the record: the liveness the server runs a
/// task under (its own TTL or the server's default) and the latest sign
/// of life it knows of. The registry knows both; a record alone knows
/// only the task's own TTL (`RecordOnly`). Read once per view (`of`),
/// not once per task.
pub trait Live {
    fn of(&self, a: &Allocation) -> Liveness;
}

/// The liveness of one allocation's tasks, as one view shows them, and
/// where its queued tasks stand in their semaphores' lines.
pub struct Liveness {
    default_ttl: Option<std::time::Duration>,
    signs: Option<crate::registry::Signs>,
    /// By task (empty: no task is queued, or no registry to ask).
    lines: Vec<Vec<(crate::lifecycle::SemName, Waiting)>>,
    /// By task: why it waits at its barrier (empty: none does).
    barriers: Vec<Option<(crate::lifecycle::SemName, Gathering)>>,
}

impl Liveness {
    /// The TTL task `i` runs under; `None` when none.
    pub fn ttl(&self, a: &Allocation, i: usize) -> Option<std::time::Duration> {
        a.spec.ttl(i, self.default_ttl)
    }

    /// The latest sign of life known of task `i`, for a task under a TTL.
    pub fn last_seen(&self, a: &Allocation, i: usize) -> Option<Timestamp> {
        self.ttl(a, i)?;
        self.signs.as_ref()?.last_seen(i)
    }

    /// Why task `i` waits on its semaphores (none while it holds them or
    /// is in no line).
    pub fn waiting(&self, i: usize) -> &[(crate::lifecycle::SemName, Waiting)] {
        self.lines.get(i).map_or(&[], Vec::as_slice)
    }
}

/// The barrier entry of a task's `blocked_by`, while it waits at one.
pub fn barrier_blocking(live: &Liveness, i: usize) -> Option<BarrierBlockedView> {
    let (name, g) = live.barriers.get(i)?.as_ref()?;
    Some(match *g {
        Gathering::Gathering { arrived, size } => BarrierBlockedView {
            barrier: name.to_string(),
            why: BarrierWhy::Gathering,
            arrived: Some(arrived),
            size,
        },
        Gathering::TimedOut { size } => BarrierBlockedView {
            barrier: name.to_string(),
            why: BarrierWhy::TimedOut,
            arrived: None,
            size,
        },
    })
}

/// The semaphore entries of a task's `blocked_by`.
pub fn semaphores_blocking(live: &Liveness, i: usize) -> Vec<SemaphoreBlockedView> {
    live.waiting(i)
        .iter()
        .map(|(name, why)| match why {
            Waiting::Queued { position } => SemaphoreBlockedView {
                semaphore: name.to_string(),
                why: SemaphoreWhy::Queued,
                position: Some(*position),
            },
            Waiting::NotRegistered => SemaphoreBlockedView {
                semaphore: name.to_string(),
                why: SemaphoreWhy::NotRegistered,
                position: None,
            },
        })
        .collect()
}

/// The grants task `i` holds, one per semaphore (all with its grant's
/// fence).
pub fn grants(a: &Allocation, i: usize) -> Vec<GrantView> {
    let Some(fence) = a.tasks[i].fence() else {
        return Vec::new();
    };
    a.spec.tasks()[i]
        .acquire
        .iter()
        .map(|s| GrantView {
            semaphore: s.to_string(),
            fence,
        })
        .collect()
}

impl Live for crate::registry::Registry {
    fn of(&self, a: &Allocation) -> Liveness {
        let lines = if a.spec.acquires() {
            (0..a.tasks.len())
                .map(|i| self.waiting_on_semaphores(a, i))
                .collect()
        } else {
            Vec::new()
        };
        let barriers = if a.spec.gathers() {
            (0..a.tasks.len())
                .map(|i| self.waiting_at_barrier(a, i))
                .collect()
        } else {
            Vec::new()
        };
        Liveness {
            default_ttl: self.default_liveness_ttl(),
            signs: self.signs(a),
            lines,
            barriers,
        }
    }
}

/// A record read without a server (`taskgate dump`): the task's own TTL,
/// no signs of life.
pub struct RecordOnly;

impl Live for RecordOnly {
    fn of(&self, _: &Allocation) -> Liveness {
        Liveness {
            default_ttl: None,
            signs: None,
            lines: Vec::new(),
            barriers: Vec::new(),
        }
    }
}

/// An allocation with every task.
#[derive(Debug, Serialize, ToSchema)]
pub struct AllocationView {
    #[schema(example = "a1")]
    pub id: String,
    pub coordinator_state: CoordState,
    /// Tasks (registration order) whose state holds the coordinator where it is.
    pub waiting_on: Vec<String>,
    /// What each task of `waiting_on` is waited on for (same order).
    pub waiting: Vec<WaitFor>,
    /// Once the coordinator is in `poststop`: `failed` if a non-poststop
    /// task failed, else `succeeded`; `null` before.
    pub outcome: Option<Outcome>,
    /// The failed non-poststop tasks (registration order); empty until
    /// `poststop`.
    pub failed_tasks: Vec<String>,
    pub create_index: u64,
    pub modify_index: u64,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    pub modified_at: OffsetDateTime,
    /// The stage deadlines as registered; `null` when none.
    pub deadlines: Option<DeadlinesView>,
    /// When the deadline of the current state passes (for `poststop`: of
    /// the poststop tasks still going); `null` when none runs.
    #[serde(with = "time::serde::rfc3339::option")]
    pub deadline_at: Option<OffsetDateTime>,
    /// What needs an operator's eye, most severe first; empty when
    /// nothing does.
    pub trouble: Vec<TroubleView>,
    /// In registration order.
    pub tasks: Vec<TaskView>,
}

/// One kind of trouble, the tasks it concerns, and what to do.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"kind": "lost", "tasks": ["web"],
    "message": "web was declared lost: no sign of life from the agent within the TTL",
    "next_step": "Find out why the agent fell silent (its host, its network); the other tasks are told to stop already. To run the group again, restart every task (`taskgate alloc restart a1 --all-tasks`)"}))]
pub struct TroubleView {
    pub kind: TroubleKind,
    /// The tasks it concerns (registration order).
    pub tasks: Vec<String>,
    /// What is wrong, in a sentence.
    pub message: String,
    /// What an operator can do about it: commands name this allocation.
    pub next_step: String,
}

impl TroubleView {
    pub fn all(a: &Allocation, troubles: &[Trouble]) -> Vec<Self> {
        troubles.iter().map(|t| Self::new(a, t)).collect()
    }

    fn new(a: &Allocation, t: &Trouble) -> Self {
        let tasks = t.tasks.iter().map(ToString::to_string).collect::<Vec<_>>();
        let (one, many) = (tasks.len() == 1, tasks.join(", "));
        let was = if one { "was" } else { "were" };
        // A finished allocation (poststop) restarts no task: the group
        // runs again only as a new registration.
        let ended = a.state == CoordState::Poststop;
        let again = |restart: &'static str, anew: &'static str| if ended { anew } else { restart };
        let (message, next_step) = match t.kind {
            TroubleKind::Lost => (
                format!(
                    "{many} {was} declared lost: no sign of life from the agent within the TTL"
                ),
                // A lost task is a failed one: its siblings are told to
                // stop already (an operator's stop would change nothing).
                again(
                    "Find out why the agent fell silent (its host, its network); the other tasks \
                     are told to stop already. To run the group again, restart every task \
                     (`taskgate alloc restart ID --all-tasks`)",
                    "Find out why the agent fell silent (its host, its network); to run the group \
                     again, delete the allocation and register it anew",
                ),
            ),
            TroubleKind::Failed => (
                format!("{many} ended failed"),
                again(
                    "Read the task's events for why (`taskgate alloc status ID`); once the cause \
                     is fixed, restart every task (`taskgate alloc restart ID --all-tasks`)",
                    "Read the task's events for why (`taskgate alloc status ID`); once the cause \
                     is fixed, delete the allocation and register it anew",
                ),
            ),
            TroubleKind::PastDeadline => (
                past_deadlines(a),
                // A restart keeps the spec: a longer deadline takes a new
                // registration, so the allocation is deleted first.
                again(
                    "See what the stage waited on in the timeline and fix the slow task, then \
                     restart every task (`taskgate alloc restart ID --all-tasks`); for a longer \
                     deadline, delete the allocation and register it anew with one",
                    "See what the stage waited on in the timeline and fix the slow task; to run \
                     the group again, delete the allocation and register it anew (with a longer \
                     deadline if it needs one)",
                ),
            ),
            TroubleKind::Stuck => (
                format!(
                    "{many} may start but for a dependency that will not hold by itself \
                     (see its blocked_by)"
                ),
                // A finished allocation refuses restarts, and a held ID
                // takes no other spec.
                "Restart the allocation it depends on (`taskgate alloc restart` on it, with \
                 `--all-tasks`); if that one has finished, lacks the task or closes a cycle, \
                 delete it and register it again as it should be, or delete this one and \
                 register it without that dependency",
            ),
            TroubleKind::Blocked => (
                format!(
                    "{many} {} for a dependency on another allocation (see its blocked_by)",
                    if one { "waits" } else { "wait" }
                ),
                "Nothing, if the other allocation is on its way; else see why it does not get \
                 there (`taskgate alloc status` on it)",
            ),
        };
        Self {
            kind: t.kind,
            tasks,
            message,
            // The commands name this allocation (IDs need no quoting).
            next_step: next_step
                .replace(" ID ", &format!(" {} ", a.id))
                .replace(" ID`", &format!(" {}`", a.id)),
        }
    }
}

/// What passed of `a`'s deadlines, with the tasks each named: a stage's
/// (the tasks it waited on) and the poststop one's (the poststop tasks
/// still going then), as `Allocation::overdue` keeps them.
fn past_deadlines(a: &Allocation) -> String {
    let names = |tasks: &[usize]| {
        let names: Vec<&str> = tasks.iter().map(|&i| a.task_name(i).as_str()).collect();
        names.join(", ")
    };
    let overdue = a.overdue();
    let mut said = Vec::new();
    if let Some((stage, tasks)) = overdue.and_then(|o| o.stage.as_ref()) {
        said.push(if tasks.is_empty() {
            format!("the {stage} deadline passed")
        } else {
            format!(
                "the {stage} deadline passed while it waited on {}",
                names(tasks)
            )
        });
    }
    if let Some(tasks) = overdue.and_then(|o| o.poststop.as_ref()) {
        said.push(if tasks.is_empty() {
            "the poststop deadline passed".to_owned()
        } else {
            format!("the poststop deadline passed before {} ended", names(tasks))
        });
    }
    said.join("; ")
}

/// Stage deadlines, as durations (`10m`); each `null` when not set.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"prestart": "10m", "main": "5m", "poststart": null, "poststop": "10m"}))]
pub struct DeadlinesView {
    #[schema(value_type = Option<String>)]
    #[serde(serialize_with = "shown_or_null")]
    pub prestart: Option<Shown>,
    #[schema(value_type = Option<String>)]
    #[serde(serialize_with = "shown_or_null")]
    pub main: Option<Shown>,
    #[schema(value_type = Option<String>)]
    #[serde(serialize_with = "shown_or_null")]
    pub poststart: Option<Shown>,
    #[schema(value_type = Option<String>)]
    #[serde(serialize_with = "shown_or_null")]
    pub poststop: Option<Shown>,
}

/// A duration as text (`30s`), written without a `String` of its own.
pub(crate) fn shown<S: serde::Serializer>(d: &Shown, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(d)
}

fn shown_or_null<S: serde::Serializer>(d: &Option<Shown>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.collect_str(d),
        None => s.serialize_none(),
    }
}

impl DeadlinesView {
    fn new(d: &Deadlines) -> Option<Self> {
        let show = |s| d.of(s).map(Shown);
        (!d.is_empty()).then(|| Self {
            prestart: show(CoordState::Prestart),
            main: show(CoordState::Main),
            poststart: show(CoordState::Poststart),
            poststop: show(CoordState::Poststop),
        })
    }
}

/// A task's liveness: the TTL it runs under.
#[derive(Debug, Serialize, ToSchema)]
pub struct LivenessView {
    /// Its own, or the server's `--default-liveness-ttl`.
    #[schema(value_type = String, example = "30s")]
    #[serde(serialize_with = "shown")]
    pub ttl: Shown,
}

/// A task's lifecycle block as registered.
#[derive(Debug, Serialize, ToSchema)]
pub struct LifecycleView {
    pub hook: Hook,
    pub sidecar: bool,
}

/// One task: its spec, its gate, its reported state and its orders.
#[derive(Debug, Serialize, ToSchema)]
pub struct TaskView {
    pub name: String,
    /// `null` for a main task.
    pub lifecycle: Option<LifecycleView>,
    pub leader: bool,
    /// The task reports readiness; the next stage waits for it.
    pub readiness: bool,
    pub stage: Stage,
    /// Whether the task's gate is open: it may start.
    pub allowed: bool,
    pub state: RunState,
    pub failed: bool,
    /// The task said it is ready (only ever while `running`).
    pub ready: bool,
    /// The last time the task became ready.
    #[serde(with = "time::serde::rfc3339::option")]
    pub ready_at: Option<OffsetDateTime>,
    pub restarts: u64,
    #[serde(with = "time::serde::rfc3339::option")]
    pub started_at: Option<OffsetDateTime>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub finished_at: Option<OffsetDateTime>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub last_restart: Option<OffsetDateTime>,
    /// At most 10, oldest first.
    #[schema(value_type = Vec<EventView>)]
    #[serde(serialize_with = "event_views")]
    pub events: Events,
    pub desired: DesiredKind,
    /// Set when `desired` is `stop`.
    pub stop_reason: Option<StopReasonView>,
    /// Restart orders given to this task; only goes up.
    pub restart_generation: u64,
    pub modify_index: u64,
    /// The task's current run, while it is `running` (else `null`): an
    /// opaque ID, never reused, that its agent sends back in the
    /// `Taskgate-Run` header with every later report, heartbeat and query.
    #[schema(example = "1234")]
    pub run: Option<String>,
    /// The TTL the task runs under; `null` when none.
    pub liveness: Option<LivenessView>,
    /// Declared lost: its agent gave no sign of life within its TTL while
    /// it ran. Dead and failed for good, until an all-tasks restart or a
    /// restore.
    pub lost: bool,
    /// The latest sign of life the answering server knows of, for a task
    /// under a TTL (with replicas it may lag; the decision never relies on
    /// it).
    #[serde(with = "time::serde::rfc3339::option")]
    pub last_seen: Option<OffsetDateTime>,
    /// Start conditions on other tasks, as registered.
    pub depends_on: Vec<DependencyView>,
    /// The dependencies that do not hold now, and the semaphores the task
    /// waits for (empty when nothing holds it back but its gate).
    pub blocked_by: Vec<Blocked>,
    /// The semaphores it acquires, as registered.
    #[schema(example = json!(["db-migrations"]))]
    pub acquire: Vec<String>,
    /// Its slots, while it holds them: one per semaphore, each with the
    /// grant's fence.
    pub grants: Vec<GrantView>,
    /// The barrier it starts together at, as registered; `null` when none.
    pub barrier: Option<BarrierSpecView>,
}

/// A task's barrier as registered.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"name": "train-42", "size": 4, "timeout": "10m"}))]
pub struct BarrierSpecView {
    pub name: String,
    pub size: u16,
    /// `null`: it may gather for ever.
    #[schema(value_type = Option<String>, example = "10m")]
    #[serde(serialize_with = "shown_opt")]
    pub timeout: Option<std::time::Duration>,
}

impl BarrierSpecView {
    pub fn of(b: &crate::lifecycle::BarrierSpec) -> Self {
        Self {
            name: b.name.to_string(),
            size: b.size,
            timeout: b.timeout,
        }
    }
}

pub fn shown_opt<S: serde::Serializer>(
    d: &Option<std::time::Duration>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.collect_str(&Shown(*d)),
        None => s.serialize_none(),
    }
}

/// A barrier a task waits at.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"barrier": "train-42", "why": "gathering", "arrived": 3, "size": 4}))]
pub struct BarrierBlockedView {
    pub barrier: String,
    pub why: BarrierWhy,
    /// For `why: gathering`: how many of its members are each otherwise
    /// allowed now (it opens at `size`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arrived: Option<usize>,
    pub size: u16,
}

/// `gathering`: fewer than `size` members are otherwise allowed at once;
/// `timed_out`: its timeout passed before it opened, and it never will
/// (a new barrier name is a new gathering).
#[derive(Clone, Copy, Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum BarrierWhy {
    Gathering,
    TimedOut,
}

impl BarrierWhy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gathering => "gathering",
            Self::TimedOut => "timed_out",
        }
    }
}

/// A slot of a semaphore a task holds.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"semaphore": "db-migrations", "fence": 1042}))]
pub struct GrantView {
    pub semaphore: String,
    /// Grows with every grant of the semaphore and is never reused: the
    /// workload can pass it to what the semaphore protects, which refuses
    /// a fence lower than one it has seen.
    pub fence: u64,
}

/// Why a task does not start yet: a dependency that does not hold, or a
/// semaphore it waits for.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum Blocked {
    Dependency(BlockedView),
    Semaphore(SemaphoreBlockedView),
    Barrier(BarrierBlockedView),
}

/// A semaphore a task waits for.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"semaphore": "db-migrations", "why": "queued", "position": 3}))]
pub struct SemaphoreBlockedView {
    pub semaphore: String,
    pub why: SemaphoreWhy,
    /// For `why: queued`: its place in the queue (1 is first in line).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub position: Option<usize>,
}

/// `queued`: in the semaphore's queue; `not_registered`: no semaphore of
/// that name exists (an operator creates it with `PUT /v1/semaphores/{name}`).
#[derive(Clone, Copy, Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SemaphoreWhy {
    Queued,
    NotRegistered,
}

impl SemaphoreWhy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::NotRegistered => "not_registered",
        }
    }
}

/// A dependency as registered.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"task": "db", "allocation": "db-7", "condition": "ready"}))]
pub struct DependencyView {
    pub task: String,
    /// `null` for a task of this allocation.
    pub allocation: Option<String>,
    pub condition: Condition,
}

/// A dependency that does not hold, and why.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"allocation": "db-7", "task": "db", "condition": "ready", "why": "not_ready"}))]
pub struct BlockedView {
    /// The target's allocation (this one's ID for a task of this one).
    pub allocation: String,
    pub task: String,
    pub condition: Condition,
    pub why: Why,
    /// For `why: cycle`: the cycle, as `alloc/task` steps from this task
    /// back to it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<Vec<String>>,
}

/// A task's dependencies as registered, and what holds it back (its
/// dependencies that do not hold, then the semaphores it waits for).
fn dependencies(a: &Allocation, i: usize, live: &Liveness) -> (Vec<DependencyView>, Vec<Blocked>) {
    let spec = &a.spec.tasks()[i];
    let depends_on = spec
        .depends_on
        .iter()
        .map(|d| DependencyView {
            task: d.task.to_string(),
            allocation: d.allocation.as_ref().map(ToString::to_string),
            condition: d.condition,
        })
        .collect();
    let blocked_by = a
        .blocked_by(i)
        .into_iter()
        .filter_map(|(j, state)| {
            let d = spec.depends_on.get(j)?;
            Some(BlockedView {
                allocation: d.allocation.as_ref().unwrap_or(&a.id).to_string(),
                task: d.task.to_string(),
                condition: d.condition,
                why: state.why()?,
                path: match state {
                    DepState::Cycle(path) => Some(path.to_vec()),
                    DepState::Holds | DepState::Blocked(_) => None,
                },
            })
        })
        .map(Blocked::Dependency)
        .chain(
            semaphores_blocking(live, i)
                .into_iter()
                .map(Blocked::Semaphore),
        )
        .chain(barrier_blocking(live, i).map(Blocked::Barrier))
        .collect();
    (depends_on, blocked_by)
}

/// A recorded task event.
// Borrowed from the record when a view is written: a task view holds the
// history (shared with the record, not copied) and writes each event as
// one of these.
#[derive(Debug, Serialize, ToSchema)]
pub struct EventView<'a> {
    #[serde(rename = "type")]
    pub kind: &'a str,
    #[serde(with = "time::serde::rfc3339")]
    pub time: OffsetDateTime,
    pub message: &'a str,
    #[schema(value_type = std::collections::BTreeMap<String, String>)]
    pub details: &'a Details,
}

impl<'a> From<&'a Event> for EventView<'a> {
    fn from(e: &'a Event) -> Self {
        Self {
            kind: &e.kind,
            time: e.time(),
            message: &e.message,
            details: &e.details,
        }
    }
}

fn event_views<S: serde::Serializer>(events: &Events, s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(events.all().iter().map(EventView::from))
}

/// Why a task is told to stop.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"type": "Deadline Exceeded", "task": null, "stage": "prestart"}))]
pub struct StopReasonView {
    #[serde(rename = "type")]
    pub kind: StopKind,
    /// The failed task, for "Sibling Task Failed"; else `null`.
    pub task: Option<String>,
    /// The state whose deadline passed, for "Deadline Exceeded"; else
    /// `null`.
    pub stage: Option<CoordState>,
    /// The barrier that timed out, for "Barrier Timeout" (absent for the
    /// other reasons).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub barrier: Option<String>,
}

/// `GET .../tasks/{task}`: the task view with its allocation's state.
#[derive(Debug, Serialize, ToSchema)]
pub struct TaskDetailView {
    #[serde(flatten)]
    pub task: TaskView,
    pub coordinator_state: CoordState,
    pub alloc_modify_index: u64,
}

/// The answer to "may I start?".
#[derive(Debug, Serialize, ToSchema)]
pub struct StartConditionView {
    pub alloc_id: String,
    pub task: String,
    pub allowed: bool,
    pub desired: DesiredKind,
    /// Set when `desired` is `stop` ("Agent Lost" for a lost task).
    pub stop_reason: Option<StopReasonView>,
    pub coordinator_state: CoordState,
    pub waiting_on: Vec<String>,
    /// As in the allocation view: how the allocation ended, for poststop
    /// tasks.
    pub outcome: Option<Outcome>,
    pub failed_tasks: Vec<String>,
    /// The task's dependencies, as registered.
    pub depends_on: Vec<DependencyView>,
    /// The dependencies that do not hold now and the semaphores the task
    /// waits for: while any is listed the task may not start.
    pub blocked_by: Vec<Blocked>,
    /// Its semaphores' slots, while it holds them (the fences to pass on
    /// to what they protect).
    pub grants: Vec<GrantView>,
    /// The task's state, and its current run while it is `running` (else
    /// `null`): what an agent that restarts finds.
    pub state: RunState,
    #[schema(example = "1234")]
    pub run: Option<String>,
    /// The allocation's `create_index`: an agent tells its own
    /// registration from a new one under the same ID by it.
    pub create_index: u64,
    /// The allocation's `modify_index`.
    pub index: u64,
}

/// The answer to a restart.
#[derive(Debug, Serialize, ToSchema)]
pub struct RestartView {
    /// Tasks told to restart, in registration order.
    pub restarted: Vec<String>,
    pub coordinator_state: CoordState,
    pub index: u64,
}

/// One allocation in a listing: enough for a line of `taskgate alloc
/// list` (and the web view's list) without reading each allocation.
#[derive(Debug, Serialize, ToSchema)]
pub struct ListItem {
    pub id: String,
    pub coordinator_state: CoordState,
    pub modify_index: u64,
    #[serde(with = "time::serde::rfc3339")]
    pub modified_at: OffsetDateTime,
    pub task_count: usize,
    /// How many of its tasks are in each state.
    pub task_states: TaskStateCounts,
    /// As in the allocation view: the tasks (registration order) whose
    /// state holds the coordinator where it is.
    pub waiting_on: Vec<String>,
    /// Every task is dead: nothing more happens until an order.
    pub finished: bool,
    /// As in the allocation view: what needs an operator's eye, most
    /// severe first.
    pub trouble: Vec<TroubleView>,
}

/// Tasks by state.
#[derive(Debug, Default, Serialize, ToSchema)]
pub struct TaskStateCounts {
    pub pending: usize,
    pub running: usize,
    pub dead: usize,
}

/// `GET /v1/health`.
#[derive(Debug, Serialize, ToSchema)]
pub struct HealthView {
    /// `ok`, or `degraded` while the store takes writes but its
    /// background work fails.
    #[schema(example = "ok")]
    pub status: &'static str,
    /// While `degraded`: `checkpoints_failing`, `log_rollover_failing`,
    /// `records_unreadable`, and `<task>_restarted` for a long-lived task
    /// (`timers`, `follower`, `keep_alive`, `checkpoint`) that panicked and
    /// was started again in the last five minutes.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
    /// With `records_unreadable` (a replica on etcd): the allocations whose
    /// records this build cannot read, in ID order (at most 100). Their
    /// requests are answered 503 `store_failed`; every other allocation is
    /// served.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unreadable: Vec<String>,
    /// A replica on etcd: the index its view has reached (every change up
    /// to it is applied here), `synced` while its watch is open. While it
    /// is not, health is 503 `store_unavailable`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub view: Option<ReplicaView>,
}

/// How far a replica's view of etcd has got.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReplicaView {
    #[schema(example = "synced")]
    pub state: &'static str,
    pub index: u64,
}

impl From<&crate::lifecycle::StopReason> for StopReasonView {
    fn from(r: &crate::lifecycle::StopReason) -> Self {
        Self {
            kind: r.kind,
            task: r.task.as_ref().map(ToString::to_string),
            stage: r.stage,
            barrier: r.barrier.as_ref().map(ToString::to_string),
        }
    }
}

impl TaskView {
    pub fn new(a: &Allocation, i: usize, live: &Liveness) -> Self {
        let spec = &a.spec.tasks()[i];
        let t = &a.tasks[i];
        let desired = a.desired(i);
        let (depends_on, blocked_by) = dependencies(a, i, live);
        Self {
            name: spec.name.to_string(),
            lifecycle: spec.lifecycle.map(|l| LifecycleView {
                hook: l.hook,
                sidecar: l.sidecar,
            }),
            leader: spec.leader,
            readiness: spec.readiness,
            stage: spec.stage(),
            allowed: a.allowed(i),
            state: t.state,
            failed: t.failed,
            ready: t.ready,
            ready_at: t.ready_at,
            restarts: t.restarts,
            started_at: t.started_at,
            finished_at: t.finished_at,
            last_restart: t.last_restart,
            events: t.events.clone(),
            desired: desired.kind(),
            stop_reason: desired.reason().map(StopReasonView::from),
            restart_generation: t.restart_generation,
            modify_index: t.modify_index,
            run: t.run.map(|r| r.to_string()),
            liveness: live.ttl(a, i).map(|ttl| LivenessView { ttl: Shown(ttl) }),
            lost: t.lost(),
            last_seen: live.last_seen(a, i),
            depends_on,
            blocked_by,
            acquire: spec.acquire.iter().map(ToString::to_string).collect(),
            grants: grants(a, i),
            barrier: spec.barrier.as_ref().map(BarrierSpecView::of),
        }
    }
}

fn names(a: &Allocation) -> Vec<String> {
    a.waiting_on().iter().map(ToString::to_string).collect()
}

/// `outcome` and `failed_tasks`.
fn outcome(a: &Allocation) -> (Option<Outcome>, Vec<String>) {
    match a.outcome() {
        Some((outcome, failed)) => (
            Some(outcome),
            failed.iter().map(ToString::to_string).collect(),
        ),
        None => (None, Vec::new()),
    }
}

impl AllocationView {
    pub fn new(a: &Allocation, live: &dyn Live) -> Self {
        let live = live.of(a);
        let (waiting_on, waiting) = a
            .waiting()
            .into_iter()
            .map(|(name, why)| (name.to_string(), why))
            .unzip();
        let (outcome, failed_tasks) = outcome(a);
        Self {
            id: a.id.to_string(),
            coordinator_state: a.state,
            waiting_on,
            waiting,
            outcome,
            failed_tasks,
            create_index: a.create_index,
            modify_index: a.modify_index,
            created_at: a.created_at,
            modified_at: a.modified_at,
            deadlines: DeadlinesView::new(a.spec.deadlines()),
            deadline_at: a.deadline_at,
            trouble: TroubleView::all(a, &a.troubles()),
            tasks: (0..a.tasks.len())
                .map(|i| TaskView::new(a, i, &live))
                .collect(),
        }
    }
}

impl TaskDetailView {
    pub fn new(a: &Allocation, i: usize, live: &dyn Live) -> Self {
        Self {
            task: TaskView::new(a, i, &live.of(a)),
            coordinator_state: a.state,
            alloc_modify_index: a.modify_index,
        }
    }
}

impl StartConditionView {
    pub fn new(a: &Allocation, i: usize, live: &dyn Live) -> Self {
        let (outcome, failed_tasks) = outcome(a);
        let (depends_on, blocked_by) = dependencies(a, i, &live.of(a));
        Self {
            alloc_id: a.id.to_string(),
            task: a.task_name(i).to_string(),
            allowed: a.allowed(i),
            desired: a.desired(i).kind(),
            stop_reason: a.desired(i).reason().map(StopReasonView::from),
            coordinator_state: a.state,
            waiting_on: names(a),
            outcome,
            failed_tasks,
            depends_on,
            blocked_by,
            state: a.tasks[i].state,
            run: a.tasks[i].run.map(|r| r.to_string()),
            create_index: a.create_index,
            index: a.modify_index,
            grants: grants(a, i),
        }
    }
}

impl ListItem {
    /// `troubles` as `a.troubles()` gave them.
    pub fn new(a: &Allocation, troubles: &[Trouble]) -> Self {
        let mut task_states = TaskStateCounts::default();
        for t in &a.tasks {
            match t.state {
                RunState::Pending => task_states.pending += 1,
                RunState::Running => task_states.running += 1,
                RunState::Dead => task_states.dead += 1,
            }
        }
        Self {
            id: a.id.to_string(),
            coordinator_state: a.state,
            modify_index: a.modify_index,
            modified_at: a.modified_at,
            task_count: a.tasks.len(),
            task_states,
            waiting_on: names(a),
            finished: a.finished(),
            trouble: TroubleView::all(a, troubles),
        }
    }
}

/// `GET /v1/allocations/{alloc_id}/events`: the allocation's timeline.
#[derive(Debug, Serialize, ToSchema)]
pub struct TimelineView {
    pub alloc_id: String,
    /// Oldest first: the last `--timeline-events` (default 64).
    pub events: Vec<TimelineEventView>,
}

/// One entry of a timeline: a decision of the server (`Registered`,
/// `Coordinator`, `Task State`, `Stop Order`, `Restart Order`, `Restored`)
/// or an agent's event (its own type, `"source": "agent"` in `details`).
#[derive(Debug, Serialize, ToSchema)]
pub struct TimelineEventView {
    /// The index of the change that made it.
    pub index: u64,
    #[serde(with = "time::serde::rfc3339")]
    pub time: OffsetDateTime,
    #[serde(rename = "type")]
    pub kind: String,
    /// The task it concerns, if one.
    pub task: Option<String>,
    pub message: String,
    #[schema(value_type = std::collections::BTreeMap<String, String>)]
    pub details: std::collections::BTreeMap<String, String>,
}

impl TimelineView {
    pub fn new(a: &Allocation, entries: &[crate::registry::timeline::Entry]) -> Self {
        use crate::registry::timeline::{SlotChange, What};
        let name = |i: u16| {
            a.spec
                .tasks()
                .get(usize::from(i))
                .map(|t| t.name.to_string())
        };
        let events = entries
            .iter()
            .map(|e| {
                let mut details = std::collections::BTreeMap::new();
                let (kind, task, message) = match &e.what {
                    What::Registered => (
                        "Registered".to_owned(),
                        None,
                        format!("registered with {} tasks", a.tasks.len()),
                    ),
                    What::Coordinator { from, to } => {
                        details.insert("from".to_owned(), from.to_string());
                        details.insert("to".to_owned(), to.to_string());
                        ("Coordinator".to_owned(), None, format!("{from} → {to}"))
                    }
                    What::TaskState {
                        task,
                        state,
                        failed,
                        ready,
                    } => {
                        details.insert("state".to_owned(), state.to_string());
                        details.insert("failed".to_owned(), failed.to_string());
                        details.insert("ready".to_owned(), ready.to_string());
                        let how = match (state, failed, ready) {
                            (RunState::Dead, true, _) => "dead (failed)".to_owned(),
                            (RunState::Running, _, true) => "running (ready)".to_owned(),
                            _ => state.to_string(),
                        };
                        ("Task State".to_owned(), name(*task), how)
                    }
                    What::StopOrder {
                        reason,
                        named,
                        stage,
                    } => {
                        details.insert("reason".to_owned(), reason.to_string());
                        // "Barrier Timeout" names the member whose barrier
                        // timed out: the barrier is what it names.
                        let barrier = named
                            .filter(|_| *reason == StopKind::BarrierTimeout)
                            .and_then(|t| a.spec.tasks().get(usize::from(t))?.barrier.as_ref());
                        let named = match barrier {
                            Some(b) => {
                                details.insert("barrier".to_owned(), b.name.to_string());
                                Some(b.name.to_string())
                            }
                            None => named.and_then(name),
                        };
                        if let (Some(t), None) = (&named, barrier) {
                            details.insert("task".to_owned(), t.clone());
                        }
                        if let Some(stage) = stage {
                            details.insert("stage".to_owned(), stage.to_string());
                        }
                        let message = match (&named, stage) {
                            (Some(t), _) => format!("every task is told to stop: {reason} ({t})"),
                            (None, Some(s)) => {
                                format!("every task is told to stop: {reason} ({s})")
                            }
                            (None, None) => format!("every task is told to stop: {reason}"),
                        };
                        ("Stop Order".to_owned(), None, message)
                    }
                    What::Lost { task, event } => {
                        for (k, v) in event.details.iter() {
                            details.insert(k.to_owned(), v.to_owned());
                        }
                        (
                            event.kind.to_string(),
                            name(*task),
                            event.message.to_string(),
                        )
                    }
                    What::Dependency { task, dep, holds } => {
                        let spec = a.spec.tasks().get(usize::from(*task));
                        let d = spec.and_then(|s| s.depends_on.get(usize::from(*dep)));
                        let on = d.map_or(String::new(), |d| {
                            format!("{}/{}", d.allocation.as_ref().unwrap_or(&a.id), d.task)
                        });
                        let condition = d.map_or(String::new(), |d| d.condition.to_string());
                        let who = name(*task).unwrap_or_default();
                        details.insert("task".to_owned(), who.clone());
                        details.insert("on".to_owned(), on.clone());
                        details.insert("condition".to_owned(), condition.clone());
                        details.insert("holds".to_owned(), holds.to_string());
                        let message = if *holds {
                            format!("{who} may start: {on} is {condition}")
                        } else {
                            format!("{who} waits for {on} to be {condition}")
                        };
                        ("Dependency".to_owned(), name(*task), message)
                    }
                    What::DeadlineExceeded { stage } => {
                        details.insert("stage".to_owned(), stage.to_string());
                        let deadline = a
                            .spec
                            .deadlines()
                            .of(*stage)
                            .map(format_duration)
                            .unwrap_or_default();
                        let message = if *stage == CoordState::Poststop {
                            format!("poststop tasks still going after {deadline} are told to stop")
                        } else {
                            format!("{stage} did not finish within {deadline}")
                        };
                        details.insert("deadline".to_owned(), deadline);
                        ("Deadline Exceeded".to_owned(), None, message)
                    }
                    What::RestartOrder(r) => {
                        let event = &r.event;
                        let names: Vec<String> = r.tasks.iter().filter_map(|&i| name(i)).collect();
                        details.insert("tasks".to_owned(), names.join(","));
                        if let Some(mode) = event.details.get("mode") {
                            details.insert("mode".to_owned(), mode.to_owned());
                        }
                        details.insert("reason".to_owned(), event.message.to_string());
                        (
                            "Restart Order".to_owned(),
                            None,
                            format!("told to restart: {}", names.join(", ")),
                        )
                    }
                    What::Slot { task, sem, change } => {
                        let semaphore = a
                            .spec
                            .tasks()
                            .get(usize::from(*task))
                            .and_then(|t| t.acquire.get(usize::from(*sem)))
                            .map_or_else(String::new, ToString::to_string);
                        let who = name(*task).unwrap_or_default();
                        details.insert("semaphore".to_owned(), semaphore.clone());
                        let (kind, message) = match change {
                            SlotChange::Acquired => {
                                let fence = e.index;
                                details.insert("fence".to_owned(), fence.to_string());
                                (
                                    "Acquired",
                                    format!("{who} holds a slot of {semaphore} (fence {fence})"),
                                )
                            }
                            SlotChange::Released(why) => {
                                details.insert("why".to_owned(), why.as_str().to_owned());
                                (
                                    "Released",
                                    format!("{who} gave back its slot of {semaphore} ({})", why.as_str()),
                                )
                            }
                            SlotChange::GrantExpired => (
                                "Grant Expired",
                                format!(
                                    "{who} did not start within {semaphore}'s grant timeout: back in the queue"
                                ),
                            ),
                        };
                        (kind.to_owned(), name(*task), message)
                    }
                    What::Barrier { task, opened } => {
                        let who = name(*task).unwrap_or_default();
                        let b = a.spec.tasks().get(usize::from(*task)).and_then(|t| t.barrier.as_ref());
                        let (barrier, size) = b.map_or((String::new(), 0), |b| (b.name.to_string(), b.size));
                        details.insert("barrier".to_owned(), barrier.clone());
                        details.insert("size".to_owned(), size.to_string());
                        if *opened {
                            (
                                "Barrier Open".to_owned(),
                                name(*task),
                                format!("{who} starts together with the {size} members of {barrier}"),
                            )
                        } else {
                            let timeout = b.and_then(|b| b.timeout).map(format_duration).unwrap_or_default();
                            details.insert("timeout".to_owned(), timeout.clone());
                            (
                                "Barrier Timeout".to_owned(),
                                name(*task),
                                format!("{barrier} did not gather its {size} members within {timeout}: {who} will not start"),
                            )
                        }
                    }
                    What::Restored => (
                        "Restored".to_owned(),
                        None,
                        "the coordinator was restored from known task states".to_owned(),
                    ),
                    What::Agent { task, event } => {
                        for (k, v) in event.details.iter() {
                            details.insert(k.to_owned(), v.to_owned());
                        }
                        details.insert("source".to_owned(), "agent".to_owned());
                        (
                            event.kind.to_string(),
                            name(*task),
                            event.message.to_string(),
                        )
                    }
                };
                TimelineEventView {
                    index: e.index,
                    time: e.time(),
                    kind,
                    task,
                    message,
                    details,
                }
            })
            .collect();
        Self {
            alloc_id: a.id.to_string(),
            events,
        }
    }
}

/// One line of `GET /v1/events` (newline-delimited JSON).
#[derive(Debug, Serialize, ToSchema)]
#[serde(tag = "type")]
pub enum StreamLine {
    /// The allocation as committed at `index` (registered or changed).
    Allocation {
        index: u64,
        alloc_id: String,
        allocation: Box<AllocationView>,
    },
    /// The allocation was deleted at `index`.
    AllocationDeleted { index: u64, alloc_id: String },
    /// The asked index is older than the changes the server keeps (or the
    /// server has restarted since): list again, then go on from this line's
    /// `index` (the stream itself goes on from there).
    Resync { index: u64 },
    /// Sent after 10 s without another line.
    Heartbeat,
}

impl StreamLine {
    pub fn change(e: &crate::registry::feed::Event, live: &dyn Live) -> Self {
        let alloc_id = e.alloc_id.to_string();
        match &e.allocation {
            Some(a) => Self::Allocation {
                index: e.index,
                alloc_id,
                allocation: Box::new(AllocationView::new(a, live)),
            },
            None => Self::AllocationDeleted {
                index: e.index,
                alloc_id,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{
        http::dto::RegisterBody,
        lifecycle::{AllocId, Limits, Overdue},
    };

    /// A past deadline names each deadline that passed with its own
    /// tasks, whatever the stop order is: the tasks a poststop deadline
    /// told to stop are not what an earlier stage waited on.
    #[test]
    fn a_past_deadline_says_which_deadline_passed_on_which_tasks() {
        let id = AllocId::parse("a1").unwrap();
        let body: RegisterBody = serde_json::from_str(
            r#"{"tasks": [{"name": "web"}, {"name": "cleanup", "lifecycle": {"hook": "poststop"}}],
                "deadlines": {"main": "1m", "poststop": "1m"}}"#,
        )
        .unwrap();
        let spec = Arc::new(body.into_spec(&Limits::default(), &id).unwrap());
        let a = Allocation::register(id, spec, 1, OffsetDateTime::UNIX_EPOCH);
        let late = |stage, poststop| {
            let a = a
                .clone()
                .with_deadlines(None, Some(Overdue { stage, poststop }));
            let shown = TroubleView::all(&a, &a.troubles());
            assert_eq!(shown.len(), 1, "{shown:?}");
            assert_eq!(shown[0].kind, TroubleKind::PastDeadline);
            shown[0].message.clone()
        };
        assert_eq!(
            late(Some((CoordState::Main, vec![0])), Some(vec![1])),
            "the main deadline passed while it waited on web; \
             the poststop deadline passed before cleanup ended"
        );
        // No stop order names the stage here (the allocation runs): the
        // stage comes from what passed.
        assert_eq!(
            late(Some((CoordState::Main, vec![0])), None),
            "the main deadline passed while it waited on web"
        );
        assert_eq!(
            late(None, Some(vec![1])),
            "the poststop deadline passed before cleanup ended"
        );
    }
}
