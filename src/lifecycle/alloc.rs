//! One allocation's record and the operations on it: register, report,
//! restart, restore. Each operation returns the next version of the record
//! (or `None` when nothing changed); the caller persists and publishes it.

use std::{sync::Arc, time::Duration};

use super::{
    AllocId, AllocSpec, CoordState, DepState, Desired, Details, Event, Hold, IdemKey, KeySeen,
    Meet, RunState, Stage, StopReason, TaskName, TaskReport, TaskStatus, Timestamp, Why,
    coordinator::{WaitFor, evaluate, gates, is_open, waiting, waiting_on},
    deps::{Target, judge},
    orders::{Outcome, RUN, StopKind, stop_order},
};

/// Which tasks an operator restart targets (docs/lifecycle.md, Restart).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestartMode {
    /// One task, by position; it must be running and not a poststop task.
    Task(usize),
    /// Every running non-poststop task.
    Running,
    /// Every running or dead non-poststop task; resets the coordinator.
    AllTasks,
}

impl RestartMode {
    pub fn as_str(self) -> &'static str {
        match self {
            RestartMode::Task(_) => "task",
            RestartMode::Running => "running",
            RestartMode::AllTasks => "all_tasks",
        }
    }
}

/// One operation on an allocation, for `Allocation::check_step`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Report,
    Restart(RestartMode),
    Restore,
}

/// Why a restart was refused. A refused restart changes nothing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RestartError {
    #[error(
        "allocation has finished (coordinator is in poststop): nothing is left to restart; \
         register a new allocation to run the group again"
    )]
    AllocationFinished,
    #[error(
        "task \"{0}\" is not running, so it cannot be restarted alone; restart it once it \
         runs, or restart every task with {{\"all_tasks\": true}}"
    )]
    TaskNotRunning(TaskName),
}

/// Why a report, a heartbeat or a restore is refused for a task
/// (SEMANTICS, "Runs"). A refused request changes nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The task was declared lost (its agent gave no sign of life within
    /// its TTL).
    Lost { at: Timestamp },
    /// The request names a run that is not the task's current one (`None`:
    /// it has none): its agent is a leftover and must stop its process.
    Superseded { current: Option<u64> },
    /// A `running` report that does not name the task's current run, for a
    /// task already running under it: another agent runs it.
    Claimed { run: u64 },
    /// The task is `dead`, and no order since its death lets it leave.
    Dead { finished_at: Option<Timestamp> },
    /// `ready: true` for a task that declares no readiness.
    NoReadiness,
}

/// Why an operator's stop was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StopError {
    #[error(
        "the allocation has finished (its coordinator is in poststop: every other task is \
         dead and its cleanup runs or ran): nothing is left to stop; delete it, or register \
         a new allocation to run the group again"
    )]
    AllocationFinished,
}

/// The event recorded on each task told to restart.
pub const RESTART_EVENT: &str = "Restart Signaled";

/// The deadlines of an allocation that passed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overdue {
    /// A stage's deadline (`prestart`, `main` or `poststart`) passed,
    /// with the tasks the stage waited on then (positions, registration
    /// order): the allocation failed on them.
    pub stage: Option<(CoordState, Vec<usize>)>,
    /// The poststop deadline passed: these poststop tasks (pending or
    /// running then) are told to stop.
    pub poststop: Option<Vec<usize>>,
}

/// What a lost task is told.
static AGENT_LOST: Desired = Desired::Stop(StopReason::bare(StopKind::AgentLost));
/// What a poststop task still going at the poststop deadline is told.
static POSTSTOP_OVERDUE: Desired = Desired::Stop(StopReason::deadline(CoordState::Poststop));

/// `t + d`, or the end of time where that is past it (a damaged record's
/// time must not panic the server).
fn later(t: Timestamp, d: Duration) -> Timestamp {
    time::Duration::try_from(d)
        .ok()
        .and_then(|d| t.checked_add(d))
        .unwrap_or(time::PrimitiveDateTime::MAX.assume_utc())
}

/// `t - d`, or the start of time.
fn earlier(t: Timestamp, d: Duration) -> Timestamp {
    time::Duration::try_from(d)
        .ok()
        .and_then(|d| t.checked_sub(d))
        .unwrap_or(time::PrimitiveDateTime::MIN.assume_utc())
}

/// The latest sign of life the caller knows of for task `i` (`None`:
/// none since the task started), for `Allocation::tick`. A time past
/// every deadline (`UNTIL_TOLD`) says the task is alive until the caller
/// says otherwise: with replicas, whether it is comes from the
/// store (`LapsedAt`), not from a clock.
pub type SeenAt<'a> = &'a dyn Fn(usize) -> Option<Timestamp>;

/// A sign of life that lasts until the caller says otherwise (`SeenAt`).
pub const UNTIL_TOLD: Timestamp = time::PrimitiveDateTime::MAX.assume_utc();

/// Whether task `i`'s signs of life have lapsed where several replicas
/// keep them (etcd: the lease of its live key expired): `Some(t)`, the
/// latest sign of life the caller knows of, and the task is lost now,
/// whatever any clock says; `None`, not lapsed. For `Allocation::tick_lapsed`.
pub type LapsedAt<'a> = &'a dyn Fn(usize) -> Option<Timestamp>;

/// Everything known about one allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    pub id: AllocId,
    /// Shared between versions: the spec never changes after registration.
    pub spec: Arc<AllocSpec>,
    pub state: CoordState,
    /// Parallel to `spec.tasks()`.
    pub tasks: Vec<TaskStatus>,
    pub create_index: u64,
    pub modify_index: u64,
    pub created_at: Timestamp,
    pub modified_at: Timestamp,
    /// The stop order of every non-poststop task (poststop tasks always
    /// run). Sticky: the first stop order the states call for is kept,
    /// reason and all, until an all-tasks restart or a restore clears it.
    /// One value, not one per task: a record is one heap block less to
    /// copy and to free on every change.
    order: Desired,
    /// When the current state's deadline passes (`None`: none runs). An
    /// absolute time, stored: a restart neither resets nor skips it.
    pub deadline_at: Option<Timestamp>,
    /// Deadlines that passed (out of line: most allocations have none).
    overdue: Option<Arc<Overdue>>,
    /// The deadline each stage got when the coordinator first entered it
    /// since the last order (the registration, an all-tasks restart, an
    /// operator's restore), as `Deadlines::STATES`: a stage entered again
    /// (after an agent's resume moved the coordinator back) keeps its
    /// clock. `None` for an allocation without deadlines.
    clocks: Option<Arc<StageClocks>>,
    /// The last writes that made this record, oldest first (on a store
    /// several replicas write; empty on any other).
    writes: Option<Arc<Vec<WriteMark>>>,
}

/// The deadline each stage got on first entry (`Deadlines::STATES`).
pub type StageClocks = [Option<Timestamp>; 4];

/// One write of a record on a store several replicas write: an ID the
/// writer drew and the index of the record it was decided on (0: a
/// registration). Compare-and-swap lets exactly one write follow each
/// record, so a writer that lost the answer to its own finds out whether
/// that one was its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteMark {
    pub id: u64,
    pub parent: u64,
}

/// How many writes a record remembers.
pub const WRITE_MARKS: usize = 8;

impl Allocation {
    /// A new allocation, evaluated once with every task pending.
    pub fn register(id: AllocId, spec: Arc<AllocSpec>, index: u64, now: Timestamp) -> Self {
        let tasks = vec![TaskStatus::new(index); spec.tasks().len()];
        let state = evaluate(CoordState::Init, &spec, &tasks);
        let mut a = Self::from_parts(id, spec, state, tasks, None, index, index, now, now);
        a.deadline_at = a.clock(now);
        // Dependencies on other allocations start as not registered; the
        // registry judges them before the registration commits.
        for i in 0..a.tasks.len() {
            let deps = a.spec.tasks()[i]
                .depends_on
                .iter()
                .map(|_| DepState::Blocked(Why::NotRegistered))
                .collect();
            a.tasks[i].set_deps(deps);
        }
        a.judge_own();
        a.join_lines();
        a
    }

    /// A registration's tasks that are otherwise allowed arrive at their
    /// barriers, and those that want their semaphores queue, in the
    /// registration's change.
    fn join_lines(&mut self) {
        if self.spec.gathers() {
            self.keep_meets(self.modified_at);
        }
        if self.spec.acquires() {
            let before = self.clone();
            for i in self.keep_holds(&before) {
                self.tasks[i].set_hold(Some(Hold::Queued {
                    since: self.modify_index,
                    at: self.modified_at,
                }));
            }
        }
    }

    /// Judges every dependency on a task of this allocation, from the
    /// states as they are (the others keep their last verdict).
    fn judge_own(&mut self) {
        for i in 0..self.tasks.len() {
            let spec = &self.spec.tasks()[i];
            if spec.depends_on.is_empty() {
                continue;
            }
            let mut deps = self.tasks[i].deps().to_vec();
            deps.resize(spec.depends_on.len(), DepState::Blocked(Why::NotRegistered));
            for (j, d) in spec.depends_on.iter().enumerate() {
                if d.allocation.is_none() {
                    let target = match self.spec.position(d.task.as_str()) {
                        Some(t) => Target::Task(&self.tasks[t]),
                        None => Target::Missing,
                    };
                    deps[j] = judge(d.condition, target);
                }
            }
            self.tasks[i].set_deps(deps);
        }
    }

    /// Takes the registry's verdicts on the dependencies on other
    /// allocations (`verdict(task, dependency)`, asked only for those).
    /// The next version when one changed, else `None`.
    pub fn resolve(
        &self,
        verdict: &dyn Fn(usize, usize) -> DepState,
        now: Timestamp,
        next_index: impl FnOnce() -> u64,
    ) -> Option<Self> {
        let mut next = self.clone();
        next.set_verdicts(verdict);
        next.settle(self, now, false, next_index)
    }

    /// Takes the registry's verdicts without making a new version (a
    /// registration, before its first commit).
    pub fn set_verdicts(&mut self, verdict: &dyn Fn(usize, usize) -> DepState) {
        for i in 0..self.tasks.len() {
            let spec = &self.spec.tasks()[i];
            if !spec.depends_on.iter().any(|d| d.allocation.is_some()) {
                continue;
            }
            let mut deps = self.tasks[i].deps().to_vec();
            deps.resize(spec.depends_on.len(), DepState::Blocked(Why::NotRegistered));
            for (j, d) in spec.depends_on.iter().enumerate() {
                if d.allocation.is_some() {
                    deps[j] = verdict(i, j);
                }
            }
            self.tasks[i].set_deps(deps);
        }
        self.join_lines();
    }

    /// The dependencies of task `i` that do not hold: (position in its
    /// `depends_on`, verdict).
    pub fn blocked_by(&self, i: usize) -> Vec<(usize, &DepState)> {
        self.tasks[i]
            .deps()
            .iter()
            .enumerate()
            .filter(|(_, d)| !d.holds())
            .collect()
    }

    /// Sets what a stored record holds of its deadlines.
    pub fn with_deadlines(mut self, at: Option<Timestamp>, overdue: Option<Overdue>) -> Self {
        self.deadline_at = at;
        self.overdue = overdue.filter(|o| *o != Overdue::default()).map(Arc::new);
        self
    }

    /// Sets the stored stage clocks.
    pub fn with_clocks(mut self, clocks: StageClocks) -> Self {
        self.clocks = (clocks != StageClocks::default()).then(|| Arc::new(clocks));
        self
    }

    /// The deadline each stage got on first entry (none: all `None`).
    pub fn clocks(&self) -> StageClocks {
        self.clocks.as_deref().copied().unwrap_or_default()
    }

    /// The deadlines that passed, if any did.
    pub fn overdue(&self) -> Option<&Overdue> {
        self.overdue.as_deref()
    }

    /// Rebuilds a record exactly as it was stored: the coordinator state is
    /// taken as given, never re-evaluated, so recovery opens or closes no
    /// gate. `order` is the stored stop order; `None` computes it from the
    /// states (a new allocation).
    #[allow(clippy::too_many_arguments)]
    pub fn from_parts(
        id: AllocId,
        spec: Arc<AllocSpec>,
        state: CoordState,
        tasks: Vec<TaskStatus>,
        order: Option<Desired>,
        create_index: u64,
        modify_index: u64,
        created_at: Timestamp,
        modified_at: Timestamp,
    ) -> Self {
        let order = order.unwrap_or_else(|| stop_order(&spec, &tasks));
        Self {
            id,
            spec,
            state,
            tasks,
            create_index,
            modify_index,
            created_at,
            modified_at,
            order,
            deadline_at: None,
            overdue: None,
            clocks: None,
            writes: None,
        }
    }

    /// Makes every task's events kept as stored once another task's
    /// are made (a report added one): a record's histories are written
    /// back as they were read only while all of them are kept so, and
    /// one written from a mix numbers its bodies by their text while
    /// every view of it decodes the rest (`lifecycle/history.rs`).
    pub fn settle_histories(&mut self) {
        let stored = |t: &TaskStatus| t.events.is_stored();
        if self.tasks.iter().any(stored)
            && !self.tasks.iter().all(|t| stored(t) || t.events.is_empty())
        {
            for t in &mut self.tasks {
                t.events.make();
            }
        }
    }

    /// The last writes that made this record, oldest first.
    pub fn writes(&self) -> &[WriteMark] {
        self.writes.as_deref().map_or(&[], Vec::as_slice)
    }

    /// Records a write about to be sent: the record remembers the last
    /// `WRITE_MARKS`.
    pub fn mark_write(&mut self, mark: WriteMark) {
        let mut marks = self.writes().to_vec();
        if marks.len() >= WRITE_MARKS {
            marks.drain(..=marks.len() - WRITE_MARKS);
        }
        marks.push(mark);
        self.writes = Some(Arc::new(marks));
    }

    /// The record with the write marks it was stored with.
    pub fn with_writes(mut self, marks: Vec<WriteMark>) -> Self {
        self.writes = (!marks.is_empty()).then(|| Arc::new(marks));
        self
    }

    /// Replaces the index `from` with `to` wherever a change stamped it
    /// (the allocation, its creation, the tasks it touched): a change
    /// decided with a placeholder index takes the one its commit got.
    pub fn restamp(&mut self, from: u64, to: u64) {
        for index in [&mut self.create_index, &mut self.modify_index]
            .into_iter()
            .chain(self.tasks.iter_mut().map(|t| &mut t.modify_index))
        {
            if *index == from {
                *index = to;
            }
        }
        for t in &mut self.tasks {
            if t.run == Some(from) {
                t.run = Some(to);
            }
            match t.hold() {
                Some(Hold::Queued { since, at }) if since == from => {
                    t.set_hold(Some(Hold::Queued { since: to, at }));
                }
                Some(Hold::Granted { fence, at }) if fence == from => {
                    t.set_hold(Some(Hold::Granted { fence: to, at }));
                }
                _ => {}
            }
        }
    }

    /// Position of a task by name.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.spec.position(name)
    }

    pub fn task_name(&self, i: usize) -> &TaskName {
        &self.spec.tasks()[i].name
    }

    /// Whether task `i` may start: its gate is open, every dependency
    /// holds, it is not lost, its barrier opened, and it holds a slot of
    /// every semaphore it acquires.
    pub fn allowed(&self, i: usize) -> bool {
        self.otherwise_allowed(i)
            && (self.spec.tasks()[i].acquire.is_empty()
                || matches!(self.tasks[i].hold(), Some(Hold::Granted { .. })))
    }

    /// `allowed`, semaphores aside.
    fn otherwise_allowed(&self, i: usize) -> bool {
        self.open_to(i)
            && (self.spec.tasks()[i].barrier.is_none()
                || matches!(self.tasks[i].meet(), Some(Meet::Passed { .. })))
    }

    /// `allowed`, barrier and semaphores aside: its gate is open, every
    /// dependency holds, and it is not lost.
    fn open_to(&self, i: usize) -> bool {
        let t = &self.tasks[i];
        is_open(self.state, self.spec.tasks()[i].stage()) && !t.lost() && t.unblocked()
    }

    /// Whether task `i` counts among its barrier's arrived: it names one
    /// that has not decided for it, is `pending`, told to run, and
    /// allowed but for the barrier (and its semaphores, which it queues
    /// for only once past the barrier).
    pub fn arrived(&self, i: usize) -> bool {
        self.spec.tasks()[i].barrier.is_some()
            && !self.tasks[i].meet().is_some_and(Meet::decided)
            && self.tasks[i].state == RunState::Pending
            && !self.desired(i).is_stop()
            && self.open_to(i)
    }

    /// Where each member of a barrier stands after a change: a decision
    /// (opened, timed out) stays for good; otherwise it is arrived while
    /// `arrived` says so (since the change that made it so), else not.
    fn keep_meets(&mut self, now: Timestamp) {
        for i in 0..self.tasks.len() {
            if self.spec.tasks()[i].barrier.is_none() {
                continue;
            }
            let meet = self.tasks[i].meet();
            let next = match meet {
                Some(m) if m.decided() => meet,
                _ if !self.arrived(i) => None,
                Some(m) => Some(m),
                None => Some(Meet::Arrived { at: now }),
            };
            self.tasks[i].set_meet(next);
        }
    }

    /// The next version, with task `i`'s barrier decided for it: opened
    /// at `at` (`Passed`), or timed out (`Closed`, and the allocation gets
    /// the stop order "Barrier Timeout" unless one is in force). `None`
    /// when it was decided already or the task names no barrier.
    pub fn meet_decided(
        &self,
        i: usize,
        meet: Meet,
        now: Timestamp,
        next_index: impl FnOnce() -> u64,
    ) -> Option<Self> {
        let barrier = self.spec.tasks().get(i)?.barrier.as_ref()?;
        if !meet.decided() || self.tasks[i].meet().is_some_and(Meet::decided) {
            return None;
        }
        let mut next = self.clone();
        next.tasks[i].set_meet(Some(meet));
        // A finished allocation (in `poststop`) takes the verdict only.
        if matches!(meet, Meet::Closed { .. })
            && !next.order.is_stop()
            && self.state != CoordState::Poststop
        {
            next.order = Desired::Stop(StopReason::barrier(barrier.name.clone()));
        }
        next.settle(self, now, false, next_index)
    }

    /// Whether task `i` is in line for (or holds) its semaphores: it
    /// acquires some, is `pending`, told to run, and otherwise allowed.
    pub fn wants_slots(&self, i: usize) -> bool {
        !self.spec.tasks()[i].acquire.is_empty()
            && self.tasks[i].state == RunState::Pending
            && !self.desired(i).is_stop()
            && self.otherwise_allowed(i)
    }

    /// The next version, with task `i` granted its semaphores by the
    /// change it is (the change's index is the grant's fence); `None`
    /// unless the task is queued.
    pub fn grant(
        &self,
        i: usize,
        now: Timestamp,
        next_index: impl FnOnce() -> u64,
    ) -> Option<Self> {
        if !matches!(self.tasks.get(i)?.hold(), Some(Hold::Queued { .. })) {
            return None;
        }
        let index = next_index();
        let mut next = self.clone();
        next.tasks[i].set_hold(Some(Hold::Granted {
            fence: index,
            at: now,
        }));
        next.settle(self, now, false, || index)
    }

    /// The next version, with the grant of task `i` lapsed (it did not
    /// become `running` in time): it queues again, at the back. `None`
    /// unless the task holds a grant and is still `pending`.
    pub fn expire_grant(
        &self,
        i: usize,
        now: Timestamp,
        next_index: impl FnOnce() -> u64,
    ) -> Option<Self> {
        let t = self.tasks.get(i)?;
        if t.state != RunState::Pending || !matches!(t.hold(), Some(Hold::Granted { .. })) {
            return None;
        }
        let index = next_index();
        let mut next = self.clone();
        next.tasks[i].set_hold(Some(Hold::Queued {
            since: index,
            at: now,
        }));
        next.settle(self, now, false, || index)
    }

    /// Where each task that acquires semaphores stands after a change
    /// (`prev` before it): a dead task holds nothing (a loss included); a
    /// running one keeps its grant (one that started without a grant is
    /// in no line); a pending one that wants its slots keeps its grant or
    /// its place, unless it went back to `pending` (a restart: it queues
    /// again, at the back); one that no longer wants them leaves. Tasks
    /// that join a line are returned: their place is the change's index,
    /// known only once the change is.
    fn keep_holds(&mut self, prev: &Self) -> Vec<usize> {
        let mut joining = Vec::new();
        for i in 0..self.tasks.len() {
            if self.spec.tasks()[i].acquire.is_empty() {
                continue;
            }
            let hold = self.tasks[i].hold();
            let next = match self.tasks[i].state {
                RunState::Dead => None,
                RunState::Running => hold.filter(|h| matches!(h, Hold::Granted { .. })),
                RunState::Pending if !self.wants_slots(i) => None,
                RunState::Pending => {
                    let went_back = prev.tasks[i].state != RunState::Pending;
                    match hold {
                        Some(Hold::Granted { .. }) if went_back => None,
                        Some(h) => Some(h),
                        None => None,
                    }
                }
            };
            if next.is_none() && self.wants_slots(i) {
                joining.push(i);
                // Marked as changed until the index is known.
                self.tasks[i].set_hold(Some(Hold::Queued {
                    since: u64::MAX,
                    at: self.modified_at,
                }));
            } else {
                self.tasks[i].set_hold(next);
            }
        }
        joining
    }

    /// The allocation's stop order, as stored (poststop tasks ignore it).
    pub fn order(&self) -> &Desired {
        &self.order
    }

    /// How the allocation ended, once the coordinator is in `poststop`:
    /// `failed` with the failed non-poststop tasks (registration order) if
    /// any, else `succeeded`; `None` before.
    pub fn outcome(&self) -> Option<(Outcome, Vec<TaskName>)> {
        if self.state != CoordState::Poststop {
            return None;
        }
        // A stage that missed its deadline failed on the tasks it waited
        // on then.
        let overdue: &[usize] = self
            .overdue()
            .and_then(|o| o.stage.as_ref())
            .map_or(&[], |(_, tasks)| tasks);
        let timed_out = self
            .order
            .reason()
            .is_some_and(|r| r.kind == StopKind::BarrierTimeout);
        let failed: Vec<TaskName> = self
            .spec
            .tasks()
            .iter()
            .zip(&self.tasks)
            .enumerate()
            // A member fails by its barrier's timeout only when that was
            // the allocation's order: one that finished before the verdict
            // keeps the outcome its poststop tasks were given.
            .filter(|(i, (s, t))| {
                !s.is_poststop()
                    && (t.failed
                        || overdue.contains(i)
                        || (timed_out && matches!(t.meet(), Some(Meet::Closed { .. }))))
            })
            .map(|(_, (s, _))| s.name.clone())
            .collect();
        let stopped = self
            .order
            .reason()
            .is_some_and(|r| r.kind == StopKind::StoppedByOperator);
        let outcome = if stopped {
            Outcome::Stopped
        } else if failed.is_empty() {
            Outcome::Succeeded
        } else {
            Outcome::Failed
        };
        Some((outcome, failed))
    }

    /// Task `i`'s stop order: "Agent Lost" once it is lost; for a
    /// poststop task, run unless the poststop deadline told it to stop;
    /// for the others, the allocation's order.
    pub fn desired(&self, i: usize) -> &Desired {
        if self.tasks[i].lost() {
            &AGENT_LOST
        } else if self.spec.tasks()[i].is_poststop() {
            let told = self
                .overdue()
                .and_then(|o| o.poststop.as_ref())
                .is_some_and(|told| told.contains(&i));
            if told { &POSTSTOP_OVERDUE } else { &RUN }
        } else {
            &self.order
        }
    }

    /// The first of `positions` whose task is lost, with when it was
    /// declared lost: a report for it is refused.
    pub fn lost_among(
        &self,
        positions: impl IntoIterator<Item = usize>,
    ) -> Option<(usize, Timestamp)> {
        positions
            .into_iter()
            .find_map(|i| self.tasks[i].lost_at().map(|at| (i, at)))
    }

    /// Whether the restart order a stale task owes is an all-tasks one
    /// (`TaskStatus::apply_owing`): the coordinator is back in `init`,
    /// where only such an order puts it (a registration leaves it at
    /// once), until every task is `pending` again (or every one that is
    /// not a poststop task is dead). A one-task or running-tasks restart
    /// made there names tasks that owe the all-tasks one too.
    fn owes_all_tasks(&self) -> bool {
        self.state == CoordState::Init
    }

    /// Whether a report for task `i` may be applied, `run` being the run
    /// its agent names (`Taskgate-Run`), if any (SEMANTICS, "Runs"). A
    /// dead task leaves `dead` only after an order reopened it, and never
    /// once the coordinator is in `poststop`, unless it is a poststop
    /// task: no gate of its stage opens there again (a restart is refused
    /// there), so its agent would wait for good.
    pub fn check_report(
        &self,
        i: usize,
        report: &TaskReport,
        run: Option<u64>,
    ) -> Result<(), Refusal> {
        let t = &self.tasks[i];
        self.check_run(i, run)?;
        if run.is_none()
            && report.state == RunState::Running
            && t.state == RunState::Running
            && let Some(current) = t.run
        {
            return Err(Refusal::Claimed { run: current });
        }
        let finished = self.state == CoordState::Poststop && !self.spec.tasks()[i].is_poststop();
        if t.state == RunState::Dead
            && report.state != RunState::Dead
            && (!t.may_leave_dead() || finished)
        {
            return Err(Refusal::Dead {
                finished_at: t.finished_at,
            });
        }
        if report.ready == Some(true) && !self.spec.tasks()[i].readiness {
            return Err(Refusal::NoReadiness);
        }
        Ok(())
    }

    /// Whether a sign of life (a heartbeat) for task `i` naming `run`, if
    /// any, is the current run's.
    pub fn check_run(&self, i: usize, run: Option<u64>) -> Result<(), Refusal> {
        let t = &self.tasks[i];
        if let Some(at) = t.lost_at() {
            return Err(Refusal::Lost { at });
        }
        match run {
            Some(r) if t.run != Some(r) => Err(Refusal::Superseded { current: t.run }),
            _ => Ok(()),
        }
    }

    /// What the keys kept on the allocation's tasks say of `key`: a retry
    /// if one holds it with the same request, reused if one holds it with
    /// another (a key names one request, whichever task it was for).
    pub fn key_seen(&self, key: IdemKey) -> KeySeen {
        let mut seen = KeySeen::New;
        for i in 0..self.tasks.len() {
            match self.tasks[i].seen(key) {
                KeySeen::Reused => return KeySeen::Reused,
                KeySeen::Retry => seen = KeySeen::Retry,
                KeySeen::New => {}
            }
        }
        seen
    }

    /// When the deadline of the state this allocation is in now, entered
    /// `now`, passes. Poststop's bounds poststop tasks that have yet to
    /// end: with none left, nothing runs.
    fn deadline_from(&self, now: Timestamp) -> Option<Timestamp> {
        let d = self.spec.deadlines().of(self.state)?;
        if self.state == CoordState::Poststop && !self.poststop_going() {
            return None;
        }
        Some(later(now, d))
    }

    /// The deadline of the state the coordinator enters now: the one it
    /// got when it first entered it since the last order, else one from
    /// `now` (kept for a later entry).
    fn clock(&mut self, now: Timestamp) -> Option<Timestamp> {
        let at = self.deadline_from(now)?;
        let stage = super::Deadlines::STATES
            .iter()
            .position(|&s| s == self.state)?;
        let clocks = Arc::make_mut(self.clocks.get_or_insert_with(Default::default));
        Some(*clocks[stage].get_or_insert(at))
    }

    /// Whether a poststop task is still pending or running.
    fn poststop_going(&self) -> bool {
        self.spec
            .tasks()
            .iter()
            .zip(&self.tasks)
            .any(|(s, t)| s.is_poststop() && t.state != RunState::Dead)
    }

    /// The earliest time at which this allocation changes by time alone:
    /// its deadline, or a running task's TTL passing without a sign of
    /// life after `seen`. `None`: nothing is due, ever, without another
    /// change.
    pub fn wake_at(&self, seen: SeenAt<'_>, default_ttl: Option<Duration>) -> Option<Timestamp> {
        let ttls = (0..self.tasks.len()).filter_map(|i| self.ttl_ends(i, seen, default_ttl));
        self.deadline_at.into_iter().chain(ttls).min()
    }

    /// When task `i`'s TTL passes if no sign of life comes: it must be
    /// running under a TTL. Counted from its latest sign of life, or from
    /// when it started running if that is later.
    fn ttl_ends(
        &self,
        i: usize,
        seen: SeenAt<'_>,
        default_ttl: Option<Duration>,
    ) -> Option<Timestamp> {
        let t = &self.tasks[i];
        if t.state != RunState::Running {
            return None;
        }
        let ttl = self.spec.ttl(i, default_ttl)?;
        let from = match (seen(i), t.started_at) {
            (Some(a), Some(b)) => a.max(b),
            (a, b) => a.or(b)?,
        };
        Some(later(from, ttl))
    }

    /// What time alone does by `now`: a running task whose TTL passed
    /// without a sign of life is lost; a deadline that passed fires. The
    /// next version, or `None` when nothing is due.
    pub fn tick(
        &self,
        now: Timestamp,
        seen: SeenAt<'_>,
        default_ttl: Option<Duration>,
        next_index: impl FnOnce() -> u64,
    ) -> Option<Self> {
        self.tick_lapsed(now, seen, &|_| None, default_ttl, next_index)
    }

    /// `tick`, where the signs of life of some tasks are kept by a store
    /// several replicas share: a running task under a TTL whose record
    /// there has lapsed (`lapsed`) is lost now, its event naming the
    /// latest sign of life `lapsed` gives. No clock is compared for it:
    /// the store's expiry already measured the silence.
    pub fn tick_lapsed(
        &self,
        now: Timestamp,
        seen: SeenAt<'_>,
        lapsed: LapsedAt<'_>,
        default_ttl: Option<Duration>,
        next_index: impl FnOnce() -> u64,
    ) -> Option<Self> {
        let mut next = self.clone();
        let mut changed = false;
        for i in 0..self.tasks.len() {
            let gone = self.tasks[i].state == RunState::Running
                && self.spec.ttl(i, default_ttl).is_some()
                && lapsed(i).is_some();
            if gone {
                let ttl = self.spec.ttl(i, default_ttl).expect("checked above");
                let last = lapsed(i).expect("checked above");
                next.tasks[i].lose(now, ttl, last.min(now));
                changed = true;
            } else if let Some(end) = self.ttl_ends(i, seen, default_ttl)
                && end <= now
            {
                let ttl = self.spec.ttl(i, default_ttl).expect("a TTL ended");
                next.tasks[i].lose(now, ttl, earlier(end, ttl));
                changed = true;
            }
        }
        if self.deadline_at.is_some_and(|at| at <= now) {
            next.deadline_at = None;
            next.pass_deadline();
            changed = true;
        }
        if !changed {
            return None;
        }
        next.state = evaluate(next.state, &next.spec, &next.tasks);
        next.settle(self, now, false, next_index)
    }

    /// The current state's deadline passed.
    fn pass_deadline(&mut self) {
        let mut overdue = self.overdue.as_deref().cloned().unwrap_or_default();
        match self.state {
            CoordState::Prestart | CoordState::Main | CoordState::Poststart => {
                let waited: Vec<usize> = (0..self.tasks.len())
                    .filter(|&i| {
                        super::coordinator::wait_for(
                            self.state,
                            &self.spec.tasks()[i],
                            &self.tasks[i],
                        )
                        .is_some()
                    })
                    .collect();
                // A later stage's deadline passing too adds the tasks it
                // waited on; the order names the first stage that failed.
                match &mut overdue.stage {
                    Some((_, tasks)) => {
                        for i in waited {
                            if !tasks.contains(&i) {
                                tasks.push(i);
                            }
                        }
                        tasks.sort_unstable();
                    }
                    None => overdue.stage = Some((self.state, waited)),
                }
                // Sticky: an earlier order keeps its reason.
                if !self.order.is_stop() {
                    self.order = Desired::Stop(StopReason::deadline(self.state));
                }
            }
            CoordState::Poststop => {
                overdue.poststop = Some(
                    (0..self.tasks.len())
                        .filter(|&i| {
                            self.spec.tasks()[i].is_poststop()
                                && self.tasks[i].state != RunState::Dead
                        })
                        .collect(),
                );
            }
            CoordState::Init | CoordState::WaitAlloc => {}
        }
        self.overdue = Some(Arc::new(overdue));
    }

    /// The invariants of docs/lifecycle.md every settled allocation keeps; the
    /// first one broken, described. Checked by the property tests and the
    /// lifecycle fuzz target after every step.
    pub fn check_invariants(&self) -> Result<(), String> {
        // The allowed set is the gate-table row of the current state, and
        // poststop tasks are never told to stop.
        let row = gates(self.state);
        for (i, spec) in self.spec.tasks().iter().enumerate() {
            let lost = self.tasks[i].lost();
            let held = !self.tasks[i].unblocked();
            if self.allowed(i) != (row[spec.stage().column()] && !lost && !held) {
                return Err(format!("task {i}'s gate is not the gate table's"));
            }
            if lost && (self.tasks[i].state != RunState::Dead || !self.tasks[i].failed) {
                return Err(format!("lost task {i} is not dead and failed"));
            }
            let overdue_poststop = self
                .overdue()
                .and_then(|o| o.poststop.as_ref())
                .is_some_and(|told| told.contains(&i));
            if spec.is_poststop() && self.desired(i).is_stop() && !lost && !overdue_poststop {
                return Err(format!("poststop task {i} was told to stop"));
            }
        }
        // Every non-poststop task dead means poststop. (Not the converse:
        // poststop is terminal, even if a task later reports `pending`
        // against the protocol.)
        let all_dead = self
            .spec
            .tasks()
            .iter()
            .zip(&self.tasks)
            .filter(|(s, _)| !s.is_poststop())
            .all(|(_, t)| t.state == RunState::Dead);
        if all_dead && self.state != CoordState::Poststop {
            return Err(format!(
                "every task is dead but the state is {:?}",
                self.state
            ));
        }
        // The state is stable: evaluating again changes nothing.
        if evaluate(self.state, &self.spec, &self.tasks) != self.state {
            return Err(format!("{:?} is not settled", self.state));
        }
        // Something always holds a live coordinator where it is.
        if self.waiting_on().is_empty() != (self.state == CoordState::Poststop) {
            return Err(format!("waiting_on does not fit {:?}", self.state));
        }
        // No task carries an index newer than its allocation.
        if self
            .tasks
            .iter()
            .any(|t| t.modify_index > self.modify_index)
        {
            return Err("a task's index is newer than its allocation's".to_owned());
        }
        Ok(())
    }

    /// The rules of docs/lifecycle.md that hold between two versions:
    /// `next` came from `self` by `step`. The first one broken, described.
    pub fn check_step(&self, next: &Self, step: Step) -> Result<(), String> {
        // Where the step evaluated from, and whether it cleared the order.
        let (from, cleared) = match step {
            Step::Restart(RestartMode::AllTasks) => (CoordState::Init, true),
            Step::Restore => (CoordState::Prestart, true),
            Step::Report | Step::Restart(_) => (self.state, false),
        };
        // A stop order keeps its reason until cleared.
        if self.order.is_stop() && !cleared && next.order != self.order {
            return Err(format!(
                "the stop order changed from {:?} to {:?}",
                self.order, next.order
            ));
        }
        // Right after an all-tasks restart no restarted task's old state
        // counts: a stop order then has a cause no restart touched — a
        // poststop leader that ended, or only sidecars left to run (rule
        // 3 holds at once for them). Never a failed sibling: every dead
        // non-poststop task was restarted.
        if step == Step::Restart(RestartMode::AllTasks)
            && let Some(reason) = next.order.reason()
        {
            let tasks = || self.spec.tasks().iter();
            let explained = match reason.kind {
                StopKind::LeaderTaskDead => tasks().any(|s| s.leader && s.is_poststop()),
                // A restart clears deadlines that passed; a loss is never
                // the allocation's order.
                StopKind::SiblingTaskFailed
                | StopKind::DeadlineExceeded
                | StopKind::AgentLost
                | StopKind::StoppedByOperator
                | StopKind::BarrierTimeout => false,
                StopKind::MainTasksDead => tasks().all(|s| s.is_poststop() || s.is_sidecar()),
            };
            if !explained {
                return Err(format!(
                    "told to stop right after an all-tasks restart: {:?}",
                    next.order
                ));
            }
        }
        // A readiness task never lets the next stage open while it is not
        // ready.
        let passed = |state: CoordState| {
            from <= state && next.state > state && next.state != CoordState::Poststop
        };
        for (spec, t) in next.spec.tasks().iter().zip(&next.tasks) {
            if !spec.readiness {
                continue;
            }
            let held = match spec.stage() {
                Stage::PrestartSidecar => passed(CoordState::Prestart) && !t.up(true),
                Stage::Main => passed(CoordState::Main) && !t.up(true) && t.state != RunState::Dead,
                _ => false,
            };
            if held {
                return Err(format!(
                    "{:?} went on to {:?} while {} was not ready",
                    from, next.state, spec.name
                ));
            }
        }
        Ok(())
    }

    pub fn waiting_on(&self) -> Vec<TaskName> {
        waiting_on(self.state, &self.spec, &self.tasks)
    }

    /// `waiting_on` with what each task is waited on for: `dependency` for
    /// a pending task whose gate is open but whose dependencies hold it.
    pub fn waiting(&self) -> Vec<(TaskName, WaitFor)> {
        let mut out = waiting(self.state, &self.spec, &self.tasks);
        for (name, why) in &mut out {
            let i = self.position(name.as_str()).expect("a task of this spec");
            let t = &self.tasks[i];
            if t.state == RunState::Pending
                && !t.unblocked()
                && is_open(self.state, self.spec.tasks()[i].stage())
            {
                *why = WaitFor::Dependency;
            }
        }
        out
    }

    /// Applies reports (task position, report) together, then evaluates once.
    pub fn report(
        &self,
        reports: &[(usize, TaskReport)],
        now: Timestamp,
        next_index: impl FnOnce() -> u64,
    ) -> Option<Self> {
        self.apply_reports(reports, None, now, next_index)
    }

    /// Restore (an operator's): jump to `prestart`, apply the reports,
    /// evaluate; every loss and the stop order are cleared (the order is
    /// computed afresh from the restored states), the deadline's clock
    /// starts again, and a dead task the restore does not name may leave
    /// `dead` on a later report.
    pub fn restore(
        &self,
        reports: &[(usize, TaskReport)],
        now: Timestamp,
        next_index: impl FnOnce() -> u64,
    ) -> Option<Self> {
        self.apply_reports(reports, Some(CoordState::Prestart), now, next_index)
    }

    /// An agent's restore: a resume, not an order. The states are applied
    /// and the coordinator evaluated from `prestart`, but no loss and no
    /// stop order is cleared and no deadline's clock starts again (the
    /// caller refuses a report for a lost task).
    pub fn resume(
        &self,
        reports: &[(usize, TaskReport)],
        now: Timestamp,
        next_index: impl FnOnce() -> u64,
    ) -> Option<Self> {
        let mut next = self.clone();
        let all_tasks = self.owes_all_tasks();
        for (i, r) in reports {
            next.tasks[*i].apply_owing(r, now, all_tasks);
        }
        next.state = evaluate(CoordState::Prestart, &next.spec, &next.tasks);
        next.settle(self, now, false, next_index)
    }

    /// Applies reports, then evaluates from `from` (default: the current
    /// state).
    fn apply_reports(
        &self,
        reports: &[(usize, TaskReport)],
        from: Option<CoordState>,
        now: Timestamp,
        next_index: impl FnOnce() -> u64,
    ) -> Option<Self> {
        let mut next = self.clone();
        let restore = from.is_some();
        if restore {
            // A restore clears every loss: a task it names takes the
            // given state, one it does not waits for a new agent. A dead
            // task it does not name may leave `dead` again; one it names
            // `dead` may not, whatever reopened it before.
            for (i, t) in next.tasks.iter_mut().enumerate() {
                let named = reports.iter().any(|(r, _)| *r == i);
                if named {
                    t.reopened = false;
                }
                if t.lost() {
                    if named {
                        t.forget_loss();
                    } else {
                        t.revive(now);
                    }
                } else if !named && t.state == RunState::Dead {
                    t.reopened = true;
                }
            }
        }
        // An operator's restore is an order of its own, after which the
        // coordinator is no longer in `init`: its reports use up any
        // order owed.
        let all_tasks = !restore && self.owes_all_tasks();
        for (i, r) in reports {
            next.tasks[*i].apply_owing(r, now, all_tasks);
        }
        if restore {
            next.order = Desired::Run;
            next.overdue = None;
        }
        next.state = evaluate(from.unwrap_or(next.state), &next.spec, &next.tasks);
        next.settle(self, now, restore, next_index)
    }

    /// An operator's stop: the allocation gets the sticky stop order
    /// "Stopped By Operator". Every task not yet dead is told to stop
    /// (poststop tasks still run, as the cleanup), and the allocation ends
    /// `stopped`. An all-tasks restart clears it, as any order.
    pub fn stop(
        &self,
        now: Timestamp,
        next_index: impl FnOnce() -> u64,
    ) -> Result<Option<Self>, StopError> {
        if self.state == CoordState::Poststop
            || self.tasks.iter().all(|t| t.state == RunState::Dead)
        {
            return Err(StopError::AllocationFinished);
        }
        // A stop order in force stays (sticky: it names the root cause);
        // its tasks are already told to stop.
        if self.order.is_stop() {
            return Ok(None);
        }
        let mut next = self.clone();
        next.order = Desired::Stop(StopReason::bare(StopKind::StoppedByOperator));
        Ok(next.settle(self, now, false, next_index))
    }

    /// `report`, for a write that carries an idempotency key: the key is
    /// kept on every reported task if the reports change anything (a
    /// retry of a no-op is a no-op again).
    pub fn report_keyed(
        &self,
        reports: &[(usize, TaskReport)],
        key: Option<IdemKey>,
        now: Timestamp,
        next_index: impl FnOnce() -> u64,
    ) -> Option<Self> {
        let mut next = self.report(reports, now, next_index)?;
        if let Some(key) = key {
            for (i, _) in reports {
                next.tasks[*i].remember(key);
            }
        }
        Some(next)
    }

    /// An operator restart. Returns the next version (if anything changed)
    /// and the positions of the tasks told to restart.
    pub fn restart(
        &self,
        mode: RestartMode,
        reason: &str,
        now: Timestamp,
        next_index: impl FnOnce() -> u64,
    ) -> Result<(Option<Self>, Vec<usize>), RestartError> {
        if self.state == CoordState::Poststop {
            return Err(RestartError::AllocationFinished);
        }
        let eligible = |i: usize, states: &[RunState]| {
            !self.spec.tasks()[i].is_poststop() && states.contains(&self.tasks[i].state)
        };
        let chosen: Vec<usize> = match mode {
            RestartMode::Task(i) => {
                if !eligible(i, &[RunState::Running]) {
                    return Err(RestartError::TaskNotRunning(self.task_name(i).clone()));
                }
                vec![i]
            }
            RestartMode::Running => (0..self.tasks.len())
                .filter(|&i| eligible(i, &[RunState::Running]))
                .collect(),
            RestartMode::AllTasks => (0..self.tasks.len())
                .filter(|&i| eligible(i, &[RunState::Running, RunState::Dead]))
                .collect(),
        };
        let mut next = self.clone();
        for &i in &chosen {
            let t = &mut next.tasks[i];
            if t.lost() {
                // Its agent is gone: it waits, pending, for a new one.
                t.revive(now);
            }
            t.restart_generation += 1;
            // Until it reports again, its state is from before the order.
            t.stale = true;
            t.push_event(Event::new(
                RESTART_EVENT,
                now,
                reason,
                Details::from_pairs([("mode", mode.as_str())]),
            ));
        }
        if mode == RestartMode::AllTasks {
            // A lost poststop task is not restarted (poststop tasks never
            // are), but the restart clears its loss as any other's: it
            // waits, pending, for a new agent.
            for t in next.tasks.iter_mut().filter(|t| t.lost()) {
                t.revive(now);
            }
            // Evaluated at once like after any change: if every task is
            // already pending the coordinator moves on without waiting for a
            // report that might never come.
            next.state = evaluate(CoordState::Init, &next.spec, &next.tasks);
            next.order = Desired::Run;
            next.overdue = None;
        }
        let reset = mode == RestartMode::AllTasks;
        Ok((next.settle(self, now, reset, next_index), chosen))
    }

    /// Refreshes derived data, then stamps a new index on the allocation and
    /// on every task whose view changed (its status, its gate or its stop
    /// order). Returns `None` when nothing changed at all. `reset`: the
    /// coordinator was put back (an all-tasks restart, a restore), so the
    /// state it settles in is entered afresh, deadline and all.
    fn settle(
        mut self,
        prev: &Self,
        now: Timestamp,
        reset: bool,
        next_index: impl FnOnce() -> u64,
    ) -> Option<Self> {
        self.judge_own();
        if !self.order.is_stop() {
            self.order = stop_order(&self.spec, &self.tasks);
        }
        if reset {
            self.clocks = None;
        }
        if reset || self.state != prev.state {
            self.deadline_at = self.clock(now);
        } else if self.state == CoordState::Poststop && !self.poststop_going() {
            // Every poststop task ended: nothing is left to bound.
            self.deadline_at = None;
        }
        if self.spec.gathers() {
            self.keep_meets(now);
        }
        let joining = if self.spec.acquires() {
            self.keep_holds(prev)
        } else {
            Vec::new()
        };
        let touched: Vec<usize> = (0..self.tasks.len())
            .filter(|&i| {
                self.tasks[i] != prev.tasks[i]
                    || self.allowed(i) != prev.allowed(i)
                    || self.desired(i) != prev.desired(i)
            })
            .collect();
        if touched.is_empty()
            && self.state == prev.state
            && self.deadline_at == prev.deadline_at
            && self.overdue == prev.overdue
        {
            return None;
        }
        let index = next_index();
        for i in joining {
            self.tasks[i].set_hold(Some(Hold::Queued {
                since: index,
                at: now,
            }));
        }
        for i in touched {
            let (was, t) = (&prev.tasks[i], &mut self.tasks[i]);
            t.modify_index = index;
            // A run begins each time the task becomes `running`, and ends
            // when it leaves. The keys kept go with the run they were
            // written in: a retry of a report from before is judged anew
            // (a claim whose answer was lost, retried after the run
            // changed hands, is another agent's claim, not a retry).
            let run = if t.state != RunState::Running {
                None
            } else if was.state != RunState::Running || was.started_at != t.started_at {
                Some(index)
            } else {
                t.run
            };
            if run != was.run {
                t.forget_keys();
            }
            t.run = run;
        }
        self.modify_index = index;
        self.modified_at = now;
        Some(self)
    }
}

#[cfg(test)]
mod tests;
