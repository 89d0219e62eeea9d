//! Dependencies: start conditions on other tasks, in this allocation or in
//! another one (docs/lifecycle.md, Dependencies).
//!
//! A task may start only while its stage's gate is open **and** every
//! dependency holds. Whether one holds is a fact about its target's
//! state: for a target in the same allocation it is recomputed with every
//! change of the record; for a target in another allocation the registry
//! judges it (it holds the other record) and hands the verdicts in
//! (`Allocation::resolve`). Either way it is kept with the record, so a
//! view, a replica and a restarted server all show the same `blocked_by`.
//!
//! ```text
//!   condition   holds when the target is       else blocked, why
//!   running     running                        pending | dead | failed
//!   ready       running and ready              not_ready | pending | dead | failed
//!   succeeded   dead, not failed               pending | running | failed
//!   dead        dead (failed or not)           pending | running
//!   (any)       -                              not_registered (no such allocation or task)
//!                                              cycle (the dependency leads back to the task)
//! ```

use std::sync::Arc;

use super::{AllocId, RunState, Stage, TaskName, TaskStatus};

named_enum! {
    /// What a dependency waits for its target to be.
    pub enum Condition ("dependency condition") {
        Running = "running",
        Ready = "ready",
        Succeeded = "succeeded",
        Dead = "dead",
    }
}

named_enum! {
    /// Why a dependency does not hold.
    pub enum Why ("blocked reason") {
        NotRegistered = "not_registered",
        Pending = "pending",
        Running = "running",
        Dead = "dead",
        Failed = "failed",
        NotReady = "not_ready",
        Cycle = "cycle",
        NoSuchTask = "no_such_task",
    }
}

/// Dependencies a task may declare.
pub const MAX_DEPENDENCIES: usize = 16;

/// One dependency of a task, as registered. `allocation` is `None` for a
/// task of the same allocation.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Dependency {
    pub task: TaskName,
    pub allocation: Option<AllocId>,
    pub condition: Condition,
}

/// Whether one dependency holds, as last judged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DepState {
    Holds,
    Blocked(Why),
    /// It leads back to its own task: `alloc/task` names along the way,
    /// from the dependent to the task that closes the cycle.
    Cycle(Arc<[String]>),
}

impl DepState {
    pub fn holds(&self) -> bool {
        matches!(self, DepState::Holds)
    }

    /// Why it does not hold (`None`: it holds).
    pub fn why(&self) -> Option<Why> {
        match self {
            DepState::Holds => None,
            DepState::Blocked(why) => Some(*why),
            DepState::Cycle(_) => Some(Why::Cycle),
        }
    }
}

/// What a dependency finds of its target.
#[derive(Clone, Copy, Debug)]
pub enum Target<'a> {
    /// No such allocation.
    Missing,
    /// The allocation is held, and has no task of that name.
    NoSuchTask,
    /// The target task's status.
    Task(&'a TaskStatus),
}

/// Whether `condition` holds for `target`, and if not, why.
pub fn judge(condition: Condition, target: Target<'_>) -> DepState {
    let t = match target {
        Target::Missing => return DepState::Blocked(Why::NotRegistered),
        Target::NoSuchTask => return DepState::Blocked(Why::NoSuchTask),
        Target::Task(t) => t,
    };
    // Told to restart and not heard from since: it is going back to
    // `pending` (an all-tasks restart makes its tasks pending), so what it
    // last said no longer holds anything open.
    if t.stale {
        return DepState::Blocked(Why::Pending);
    }
    let dead = || {
        if t.failed { Why::Failed } else { Why::Dead }
    };
    let why = match (condition, t.state) {
        (Condition::Running, RunState::Running) => return DepState::Holds,
        (Condition::Ready, RunState::Running) if t.ready => return DepState::Holds,
        (Condition::Ready, RunState::Running) => Why::NotReady,
        (Condition::Running | Condition::Ready, RunState::Pending) => Why::Pending,
        (Condition::Running | Condition::Ready, RunState::Dead) => dead(),
        (Condition::Succeeded, RunState::Dead) if !t.failed => return DepState::Holds,
        (Condition::Succeeded, RunState::Dead) => Why::Failed,
        (Condition::Dead, RunState::Dead) => return DepState::Holds,
        (Condition::Succeeded | Condition::Dead, RunState::Pending) => Why::Pending,
        (Condition::Succeeded | Condition::Dead, RunState::Running) => Why::Running,
    };
    DepState::Blocked(why)
}

/// A stage's place in the order dependencies inside an allocation must
/// follow: prestart (ephemeral and sidecar) < main < poststart < poststop.
pub fn rank(stage: Stage) -> u8 {
    match stage {
        Stage::PrestartEphemeral | Stage::PrestartSidecar => 0,
        Stage::Main => 1,
        Stage::PoststartEphemeral | Stage::PoststartSidecar => 2,
        Stage::Poststop => 3,
    }
}

/// Why a dependency inside one allocation (from a task of stage `from` on
/// one of stage `to`, which declares readiness or not) can never hold while
/// the dependent may start; `None` if it can.
pub fn never_holds(from: Stage, to: Stage, to_readiness: bool, c: Condition) -> Option<String> {
    if rank(to) > rank(from) {
        return Some(format!(
            "a {from} task cannot wait on a later stage ({to}): that gate opens only after \
             this one"
        ));
    }
    let live = matches!(c, Condition::Running | Condition::Ready);
    if live && to == Stage::PrestartEphemeral && rank(from) > 0 {
        return Some(format!(
            "a prestart task that is not a sidecar has finished before {from} opens: it is \
             never {c} then (use `succeeded`)"
        ));
    }
    if live && from == Stage::Poststop && to != Stage::Poststop {
        return Some(format!(
            "every {to} task is dead before poststop opens: it is never {c} then (use `dead` \
             or `succeeded`)"
        ));
    }
    if c == Condition::Ready && !to_readiness {
        return Some(
            "the task declares no readiness, so it is never ready (declare `readiness`, or \
             wait for `running`)"
                .to_owned(),
        );
    }
    None
}

/// A task of an allocation: a node of the dependency graph.
pub type Node = (AllocId, TaskName);

/// What a walk of the dependency graph found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Walk {
    /// No cycle within reach.
    Clear,
    /// A cycle, as the tasks along it (the first repeated at the end).
    Cycle(Vec<Node>),
    /// More than the walk's limit of tasks is reachable.
    TooFar,
}

/// The one walk of the dependency graph: depth-first from `roots`, each
/// task visited once, along the dependencies of the specs `spec_of` knows
/// (a task of an allocation it does not know leads nowhere). It ends at the
/// first cycle it finds — with `goal`, only one through it: a path back to
/// `goal`, which it then starts and ends — or once it has seen `max` tasks.
pub fn walk(
    roots: impl IntoIterator<Item = Node>,
    spec_of: impl Fn(&AllocId) -> Option<Arc<super::AllocSpec>>,
    goal: Option<&Node>,
    max: usize,
) -> Walk {
    let edges = |n: &Node| -> Vec<Node> {
        let Some(spec) = spec_of(&n.0) else {
            return Vec::new();
        };
        let Some(i) = spec.position(n.1.as_str()) else {
            return Vec::new();
        };
        spec.tasks()[i]
            .depends_on
            .iter()
            .map(|d| {
                (
                    d.allocation.clone().unwrap_or_else(|| n.0.clone()),
                    d.task.clone(),
                )
            })
            .collect()
    };
    // Grey: on the current path; black: done.
    let mut grey: Vec<Node> = Vec::new();
    let mut black: std::collections::HashSet<Node> = std::collections::HashSet::new();
    for root in roots {
        if black.contains(&root) || grey.contains(&root) {
            continue;
        }
        // (node, its dependencies, the next one to follow)
        let mut stack: Vec<(Node, Vec<Node>, usize)> = vec![(root.clone(), edges(&root), 0)];
        grey.push(root);
        while let Some((_, next, at)) = stack.last_mut() {
            let Some(n) = next.get(*at).cloned() else {
                let (done, _, _) = stack.pop().expect("not empty");
                grey.pop();
                black.insert(done);
                continue;
            };
            *at += 1;
            match goal {
                Some(g) if n == *g => {
                    let mut path = vec![g.clone()];
                    path.extend(grey.iter().cloned());
                    path.push(n);
                    path.dedup();
                    return Walk::Cycle(path);
                }
                None => {
                    if let Some(start) = grey.iter().position(|g| *g == n) {
                        let mut path = grey[start..].to_vec();
                        path.push(n);
                        return Walk::Cycle(path);
                    }
                }
                Some(_) => {}
            }
            if black.contains(&n) || grey.contains(&n) {
                continue;
            }
            if black.len() + grey.len() >= max {
                return Walk::TooFar;
            }
            let e = edges(&n);
            grey.push(n.clone());
            stack.push((n, e, 0));
        }
    }
    Walk::Clear
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(state: RunState, failed: bool, ready: bool) -> TaskStatus {
        let mut t = TaskStatus::new(1);
        t.state = state;
        t.failed = failed;
        t.ready = ready;
        t
    }

    #[test]
    fn each_condition_holds_exactly_as_the_table_says() {
        use Condition as C;
        use RunState as S;
        let cases = [
            (C::Running, status(S::Running, false, false), None),
            (
                C::Running,
                status(S::Pending, false, false),
                Some(Why::Pending),
            ),
            (C::Running, status(S::Dead, false, false), Some(Why::Dead)),
            (C::Running, status(S::Dead, true, false), Some(Why::Failed)),
            (C::Ready, status(S::Running, false, true), None),
            (
                C::Ready,
                status(S::Running, false, false),
                Some(Why::NotReady),
            ),
            (
                C::Ready,
                status(S::Pending, false, false),
                Some(Why::Pending),
            ),
            (C::Ready, status(S::Dead, true, false), Some(Why::Failed)),
            (C::Succeeded, status(S::Dead, false, false), None),
            (
                C::Succeeded,
                status(S::Dead, true, false),
                Some(Why::Failed),
            ),
            (
                C::Succeeded,
                status(S::Running, false, false),
                Some(Why::Running),
            ),
            (
                C::Succeeded,
                status(S::Pending, false, false),
                Some(Why::Pending),
            ),
            (C::Dead, status(S::Dead, true, false), None),
            (C::Dead, status(S::Dead, false, false), None),
            (
                C::Dead,
                status(S::Running, false, false),
                Some(Why::Running),
            ),
            (
                C::Dead,
                status(S::Pending, false, false),
                Some(Why::Pending),
            ),
        ];
        for (c, t, why) in cases {
            assert_eq!(judge(c, Target::Task(&t)).why(), why, "{c} on {t:?}");
        }
        for c in Condition::ALL {
            assert_eq!(judge(*c, Target::Missing).why(), Some(Why::NotRegistered));
            // A task told to restart is as good as pending.
            let mut stale = status(RunState::Running, false, true);
            stale.stale = true;
            assert_eq!(judge(*c, Target::Task(&stale)).why(), Some(Why::Pending));
        }
    }

    #[test]
    fn stage_order_and_conditions_that_can_never_hold_are_named() {
        use Stage::*;
        assert!(never_holds(Main, PrestartSidecar, false, Condition::Running).is_none());
        assert!(
            never_holds(
                PrestartEphemeral,
                PrestartEphemeral,
                false,
                Condition::Succeeded
            )
            .is_none()
        );
        assert!(never_holds(Main, Main, true, Condition::Ready).is_none());
        let later = never_holds(PrestartEphemeral, Main, false, Condition::Running).unwrap();
        assert!(later.contains("later stage"), "{later}");
        let gone = never_holds(Main, PrestartEphemeral, false, Condition::Running).unwrap();
        assert!(gone.contains("use `succeeded`"), "{gone}");
        assert!(
            never_holds(
                PrestartEphemeral,
                PrestartEphemeral,
                false,
                Condition::Running
            )
            .is_none()
        );
        let post = never_holds(Poststop, Main, false, Condition::Ready).unwrap();
        assert!(post.contains("before poststop opens"), "{post}");
        assert!(never_holds(Poststop, Main, false, Condition::Dead).is_none());
        let unready = never_holds(Main, Main, false, Condition::Ready).unwrap();
        assert!(unready.contains("declares no readiness"), "{unready}");
    }

    /// A spec of tasks `t0..`, each depending on the listed positions
    /// (`(alloc, position)` for another allocation's task).
    fn spec(deps: &[&[(Option<&str>, usize)]]) -> Arc<super::super::AllocSpec> {
        use super::super::{AllocSpec, Limits, TaskSpec};
        let tasks = deps
            .iter()
            .enumerate()
            .map(|(i, on)| TaskSpec {
                name: TaskName::parse(&format!("t{i}")).unwrap(),
                lifecycle: None,
                leader: false,
                readiness: false,
                liveness: None,
                depends_on: on
                    .iter()
                    .map(|&(alloc, j)| Dependency {
                        allocation: alloc.map(|a| AllocId::parse(a).unwrap()),
                        task: TaskName::parse(&format!("t{j}")).unwrap(),
                        condition: Condition::Dead,
                    })
                    .collect(),
            })
            .collect();
        Arc::new(AllocSpec::new(tasks, &Limits::default()).unwrap())
    }

    fn node(alloc: &str, t: usize) -> Node {
        (
            AllocId::parse(alloc).unwrap(),
            TaskName::parse(&format!("t{t}")).unwrap(),
        )
    }

    fn within(
        specs: Vec<(&str, Arc<super::super::AllocSpec>)>,
    ) -> impl Fn(&AllocId) -> Option<Arc<super::super::AllocSpec>> {
        move |id| {
            specs
                .iter()
                .find(|(a, _)| *a == id.as_str())
                .map(|(_, s)| s.clone())
        }
    }

    #[test]
    fn a_walk_finds_a_cycle_with_its_path_and_none_in_a_diamond() {
        let roots = |n| (0..n).map(|i| node("a", i)).collect::<Vec<_>>();
        let chain = spec(&[&[(None, 1)], &[(None, 2)], &[]]);
        assert_eq!(
            walk(roots(3), within(vec![("a", chain)]), None, 100),
            Walk::Clear
        );
        let ring = spec(&[&[(None, 1)], &[(None, 2)], &[(None, 0)]]);
        assert_eq!(
            walk(roots(3), within(vec![("a", ring)]), None, 100),
            Walk::Cycle(vec![node("a", 0), node("a", 1), node("a", 2), node("a", 0)])
        );
        let diamond = spec(&[&[(None, 1), (None, 2)], &[(None, 2)], &[]]);
        assert_eq!(
            walk(roots(3), within(vec![("a", diamond)]), None, 100),
            Walk::Clear
        );
    }

    #[test]
    fn a_walk_through_other_allocations_stops_at_what_it_does_not_know_and_at_its_limit() {
        // a/t0 → b/t0 → c/t0 → a/t0, with c unknown: no cycle seen.
        let a = spec(&[&[(Some("b"), 0)]]);
        let b = spec(&[&[(Some("c"), 0)]]);
        let c = spec(&[&[(Some("a"), 0)]]);
        let known = within(vec![("a", a.clone()), ("b", b.clone())]);
        assert_eq!(walk([node("a", 0)], known, None, 100), Walk::Clear);
        let all = || within(vec![("a", a.clone()), ("b", b.clone()), ("c", c.clone())]);
        assert_eq!(
            walk([node("a", 0)], all(), None, 100),
            Walk::Cycle(vec![node("a", 0), node("b", 0), node("c", 0), node("a", 0)])
        );
        assert_eq!(walk([node("a", 0)], all(), None, 2), Walk::TooFar);
        // Towards a goal: from b/t0 back to a/t0, the goal first and last.
        assert_eq!(
            walk([node("b", 0)], all(), Some(&node("a", 0)), 100),
            Walk::Cycle(vec![node("a", 0), node("b", 0), node("c", 0), node("a", 0)])
        );
        // A cycle elsewhere is not one through the goal.
        let ring = spec(&[&[(None, 1)], &[(None, 0)]]);
        let other = within(vec![("a", ring)]);
        assert_eq!(
            walk([node("a", 0)], other, Some(&node("z", 0)), 100),
            Walk::Clear
        );
    }

    #[test]
    fn wire_names_are_exact() {
        let c: Vec<_> = Condition::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(c, ["running", "ready", "succeeded", "dead"]);
        let w: Vec<_> = Why::ALL.iter().map(|w| w.as_str()).collect();
        assert_eq!(
            w,
            [
                "not_registered",
                "pending",
                "running",
                "dead",
                "failed",
                "not_ready",
                "cycle",
                "no_such_task"
            ]
        );
    }
}
