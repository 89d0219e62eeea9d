//! Stop orders: what the allocation runner would kill, as a pure function
//! of the reported task states.

use super::{AllocSpec, CoordState, RunState, TaskName, TaskStatus};

named_enum! {
    /// Why a task is told to stop.
    pub enum StopKind ("stop reason") {
        LeaderTaskDead = "Leader Task Dead",
        SiblingTaskFailed = "Sibling Task Failed",
        MainTasksDead = "Main Tasks Dead",
        /// A stage's deadline passed (the allocation's order, or a
        /// poststop task's own).
        DeadlineExceeded = "Deadline Exceeded",
        /// The task's own order once it was declared lost: its agent
        /// gave no sign of life within its TTL.
        AgentLost = "Agent Lost",
        /// An operator stopped the allocation (`POST .../stop`).
        StoppedByOperator = "Stopped By Operator",
        /// A barrier of one of the allocation's tasks did not gather in
        /// time (`barrier` names it).
        BarrierTimeout = "Barrier Timeout",
    }
}

named_enum! {
    /// How the allocation ended, for its poststop tasks.
    pub enum Outcome ("outcome") {
        Succeeded = "succeeded",
        Failed = "failed",
        /// An operator stopped it.
        Stopped = "stopped",
    }
}

named_enum! {
    /// What a task should be doing, by name.
    pub enum DesiredKind ("desired status") {
        Run = "run",
        Stop = "stop",
    }
}

/// A stop order's reason; `task` names the failed sibling, if any;
/// `stage` the state whose deadline passed ("Deadline Exceeded");
/// `barrier` the barrier that timed out ("Barrier Timeout").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StopReason {
    pub kind: StopKind,
    pub task: Option<TaskName>,
    pub stage: Option<CoordState>,
    pub barrier: Option<super::SemName>,
}

impl StopReason {
    /// A reason that names nothing.
    pub const fn bare(kind: StopKind) -> Self {
        Self {
            kind,
            task: None,
            stage: None,
            barrier: None,
        }
    }

    /// "Deadline Exceeded" in `stage`.
    pub const fn deadline(stage: CoordState) -> Self {
        Self {
            kind: StopKind::DeadlineExceeded,
            task: None,
            stage: Some(stage),
            barrier: None,
        }
    }

    /// "Barrier Timeout" of barrier `name`.
    pub fn barrier(name: super::SemName) -> Self {
        Self {
            barrier: Some(name),
            ..Self::bare(StopKind::BarrierTimeout)
        }
    }
}

/// What a task should be doing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Desired {
    Run,
    Stop(StopReason),
}

impl Desired {
    pub fn is_stop(&self) -> bool {
        matches!(self, Desired::Stop(_))
    }

    pub fn kind(&self) -> DesiredKind {
        match self {
            Desired::Run => DesiredKind::Run,
            Desired::Stop(_) => DesiredKind::Stop,
        }
    }

    pub fn reason(&self) -> Option<&StopReason> {
        match self {
            Desired::Run => None,
            Desired::Stop(r) => Some(r),
        }
    }
}

/// What a poststop task is always told.
pub static RUN: Desired = Desired::Run;

/// The desired status of every task, in registration order. Poststop tasks
/// always run; the others all follow `stop_order`.
pub fn desired_states(spec: &AllocSpec, status: &[TaskStatus]) -> Vec<Desired> {
    let order = stop_order(spec, status);
    spec.tasks()
        .iter()
        .map(|s| {
            if s.is_poststop() {
                Desired::Run
            } else {
                order.clone()
            }
        })
        .collect()
}

/// The order the current states call for: the first rule that holds
/// decides — a successful dead leader, then a failed sibling, then "only
/// sidecars left alive" — else run. Only states reported since a task's
/// latest restart order count (a stale state is as if not known). The
/// allocation keeps the first stop order this gives (`Allocation`).
pub fn stop_order(spec: &AllocSpec, status: &[TaskStatus]) -> Desired {
    let tasks = || spec.tasks().iter().zip(status);
    let non_poststop = || tasks().filter(|(s, _)| !s.is_poststop());
    let dead = |t: &TaskStatus| t.state == RunState::Dead && !t.stale;

    let leader_done = tasks().any(|(s, t)| s.leader && dead(t) && !t.failed);
    let failed = non_poststop()
        .find(|(_, t)| dead(t) && t.failed)
        .map(|(s, _)| s.name.clone());
    let main_tasks_dead = tasks().any(|(s, _)| s.is_sidecar())
        && non_poststop()
            .filter(|(s, _)| !s.is_sidecar())
            .all(|(_, t)| dead(t));

    if leader_done {
        Desired::Stop(StopReason::bare(StopKind::LeaderTaskDead))
    } else if let Some(task) = failed {
        Desired::Stop(StopReason {
            task: Some(task),
            ..StopReason::bare(StopKind::SiblingTaskFailed)
        })
    } else if main_tasks_dead {
        Desired::Stop(StopReason::bare(StopKind::MainTasksDead))
    } else {
        Desired::Run
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifecycle::{Hook, Limits, spec::tests::task};

    fn spec(tasks: Vec<crate::lifecycle::TaskSpec>) -> AllocSpec {
        AllocSpec::new(tasks, &Limits::default()).unwrap()
    }

    fn st(state: RunState, failed: bool) -> TaskStatus {
        let mut t = TaskStatus::new(1);
        t.state = state;
        t.failed = failed;
        t
    }

    use RunState::*;

    #[test]
    fn a_successful_leader_stops_every_non_poststop_task() {
        let mut web = task("web", None);
        web.leader = true;
        let s = spec(vec![
            web,
            task("log", Some((Hook::Poststart, true))),
            task("clean", Some((Hook::Poststop, false))),
        ]);
        let d = desired_states(
            &s,
            &[st(Dead, false), st(Running, false), st(Pending, false)],
        );
        let leader = Desired::Stop(StopReason::bare(StopKind::LeaderTaskDead));
        assert_eq!(d, [leader.clone(), leader, Desired::Run]);
    }

    #[test]
    fn a_failed_leader_is_a_failed_sibling_not_a_dead_leader() {
        let mut web = task("web", None);
        web.leader = true;
        let s = spec(vec![web, task("side", Some((Hook::Prestart, true)))]);
        let d = desired_states(&s, &[st(Dead, true), st(Running, false)]);
        assert_eq!(
            d[1],
            Desired::Stop(StopReason {
                task: Some(TaskName::parse("web").unwrap()),
                ..StopReason::bare(StopKind::SiblingTaskFailed)
            })
        );
    }

    #[test]
    fn the_first_failed_task_in_registration_order_is_named() {
        let s = spec(vec![
            task("a", None),
            task("b", None),
            task("c", None),
            task("post", Some((Hook::Poststop, false))),
        ]);
        let d = desired_states(
            &s,
            &[
                st(Running, false),
                st(Dead, true),
                st(Dead, true),
                st(Dead, true),
            ],
        );
        let reason = d[0].reason().unwrap();
        assert_eq!(reason.kind.as_str(), "Sibling Task Failed");
        assert_eq!(reason.task.as_ref().unwrap().as_str(), "b");
        assert_eq!(d[3], Desired::Run, "poststop tasks always run");
    }

    #[test]
    fn a_failed_poststop_task_stops_nobody() {
        let s = spec(vec![
            task("a", None),
            task("post", Some((Hook::Poststop, false))),
        ]);
        let d = desired_states(&s, &[st(Running, false), st(Dead, true)]);
        assert_eq!(d, [Desired::Run, Desired::Run]);
    }

    #[test]
    fn sidecars_stop_when_every_other_task_is_dead() {
        let s = spec(vec![
            task("init", Some((Hook::Prestart, false))),
            task("proxy", Some((Hook::Prestart, true))),
            task("web", None),
        ]);
        let d = desired_states(
            &s,
            &[st(Dead, false), st(Running, false), st(Running, false)],
        );
        assert!(d.iter().all(|d| *d == Desired::Run));
        let d = desired_states(&s, &[st(Dead, false), st(Running, false), st(Dead, false)]);
        assert_eq!(d[1].reason().unwrap().kind, StopKind::MainTasksDead);
    }

    #[test]
    fn an_allocation_of_only_sidecars_is_told_to_stop_at_once() {
        let s = spec(vec![task("proxy", Some((Hook::Prestart, true)))]);
        let d = desired_states(&s, &[st(Pending, false)]);
        assert_eq!(d[0].reason().unwrap().kind, StopKind::MainTasksDead);
    }

    #[test]
    fn without_sidecars_nothing_stops_on_main_death() {
        let s = spec(vec![task("a", None), task("b", None)]);
        let d = desired_states(&s, &[st(Dead, false), st(Running, false)]);
        assert_eq!(d, [Desired::Run, Desired::Run]);
    }

    #[test]
    fn stale_states_do_not_count() {
        let mut web = task("web", None);
        web.leader = true;
        let s = spec(vec![
            task("init", Some((Hook::Prestart, false))),
            task("proxy", Some((Hook::Prestart, true))),
            web,
        ]);
        let stale = |state, failed| {
            let mut t = st(state, failed);
            t.stale = true;
            t
        };
        // Each rule's trigger, stale: nothing stops.
        for states in [
            [st(Dead, false), st(Running, false), stale(Dead, false)],
            [stale(Dead, true), st(Running, false), st(Running, false)],
            [stale(Dead, false), st(Running, false), st(Dead, true)],
        ] {
            let d = stop_order(&s, &states);
            let fresh_failed = states.iter().any(|t| !t.stale && t.failed);
            if fresh_failed {
                assert_eq!(d.reason().unwrap().kind, StopKind::SiblingTaskFailed);
                assert_eq!(d.reason().unwrap().task.as_ref().unwrap().as_str(), "web");
            } else {
                assert_eq!(d, Desired::Run, "{states:?}");
            }
        }
        // Reported again, the same states count.
        let d = stop_order(&s, &[st(Dead, false), st(Running, false), st(Dead, false)]);
        assert_eq!(d.reason().unwrap().kind, StopKind::LeaderTaskDead);
    }

    #[test]
    fn stop_reason_names_are_exact() {
        let names: Vec<_> = StopKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "Leader Task Dead",
                "Sibling Task Failed",
                "Main Tasks Dead",
                "Deadline Exceeded",
                "Agent Lost",
                "Stopped By Operator",
                "Barrier Timeout"
            ]
        );
    }
}
