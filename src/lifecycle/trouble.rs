//! What needs an operator's eye in an allocation: the lists and the
//! allocation page show it (docs/operations.md, "Trouble"), and
//! `GET /v1/allocations?state=` filters by it. A pure reading of the
//! record, nothing stored.

use super::{Allocation, DepState, RunState, TaskName, Why, coordinator::is_open};

named_enum! {
    /// A kind of trouble, most severe first.
    pub enum TroubleKind ("trouble") {
        /// A task was declared lost: its agent fell silent past its TTL.
        Lost = "lost",
        /// A task ended failed (and no all-tasks restart was ordered
        /// since).
        Failed = "failed",
        /// A stage's deadline passed.
        PastDeadline = "past_deadline",
        /// A task may start but for a dependency that will not hold by
        /// itself (its target ended, failed, has no such task, or the
        /// dependencies form a cycle): someone must act.
        Stuck = "stuck",
        /// A task may start but for a dependency on another allocation
        /// that does not hold yet.
        Blocked = "blocked",
    }
}

/// One kind of trouble and the tasks it concerns (registration order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trouble {
    pub kind: TroubleKind,
    pub tasks: Vec<TaskName>,
}

named_enum! {
    /// What `GET /v1/allocations?state=` selects.
    pub enum ListState ("allocation state") {
        /// Some task is not dead yet.
        Running = "running",
        /// Every task is dead.
        Finished = "finished",
        /// Some task failed, was lost, or a stage's deadline passed.
        Failed = "failed",
        /// Some task was lost.
        Lost = "lost",
        /// Some task is held by a dependency (blocked or stuck).
        Blocked = "blocked",
    }
}

impl Allocation {
    /// Whether every task is dead: nothing more happens until an order.
    pub fn finished(&self) -> bool {
        self.tasks.iter().all(|t| t.state == RunState::Dead)
    }

    /// What is wrong, most severe first; empty when nothing is.
    pub fn troubles(&self) -> Vec<Trouble> {
        let specs = self.spec.tasks();
        let mut found: [Vec<TaskName>; TroubleKind::ALL.len()] = Default::default();
        let overdue = self.overdue();
        let late_stage = overdue.and_then(|o| o.stage.as_ref()).map(|(_, t)| t);
        let late_poststop = overdue.and_then(|o| o.poststop.as_ref());
        for (i, (s, t)) in specs.iter().zip(&self.tasks).enumerate() {
            let mut add = |kind: TroubleKind| found[kind as usize].push(s.name.clone());
            // A failure an all-tasks restart has answered (its state is
            // stale until the task reports again) is no longer trouble,
            // as it is no reason for a stop order.
            if t.lost() {
                add(TroubleKind::Lost);
            } else if t.state == RunState::Dead && t.failed && !t.stale {
                add(TroubleKind::Failed);
            }
            if late_stage.is_some_and(|l| l.contains(&i))
                || late_poststop.is_some_and(|l| l.contains(&i))
            {
                add(TroubleKind::PastDeadline);
            }
            // A task held only by its dependencies: pending, its stage open
            // and told to run.
            if t.state != RunState::Pending
                || !is_open(self.state, s.stage())
                || self.desired(i).is_stop()
            {
                continue;
            }
            let mut stuck = false;
            let mut blocked = false;
            for (j, d) in t.deps().iter().enumerate() {
                match d {
                    DepState::Holds => {}
                    DepState::Cycle(_)
                    | DepState::Blocked(Why::Dead | Why::Failed | Why::NoSuchTask) => stuck = true,
                    DepState::Blocked(_) => {
                        blocked |= s.depends_on.get(j).is_some_and(|d| d.allocation.is_some());
                    }
                }
            }
            if stuck {
                add(TroubleKind::Stuck);
            } else if blocked {
                add(TroubleKind::Blocked);
            }
        }
        // A passed deadline is shown even when it named no task.
        let late = late_stage.is_some() || late_poststop.is_some();
        let all: Vec<Trouble> = TroubleKind::ALL
            .iter()
            .zip(found)
            .filter(|(k, tasks)| !tasks.is_empty() || (**k == TroubleKind::PastDeadline && late))
            .map(|(&kind, tasks)| Trouble { kind, tasks })
            .collect();
        all
    }

    /// Whether the allocation is in `state` (`troubles` as `troubles()`
    /// gave them).
    pub fn is_in(&self, state: ListState, troubles: &[Trouble]) -> bool {
        let any = |kinds: &[TroubleKind]| troubles.iter().any(|t| kinds.contains(&t.kind));
        match state {
            ListState::Running => !self.finished(),
            ListState::Finished => self.finished(),
            ListState::Failed => any(&[
                TroubleKind::Lost,
                TroubleKind::Failed,
                TroubleKind::PastDeadline,
            ]),
            ListState::Lost => any(&[TroubleKind::Lost]),
            ListState::Blocked => any(&[TroubleKind::Stuck, TroubleKind::Blocked]),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use time::macros::datetime;

    use super::*;
    use crate::lifecycle::{
        AllocId, AllocSpec, Condition, CoordState, Dependency, Limits, Overdue, TaskSpec,
    };

    const NOW: crate::lifecycle::Timestamp = datetime!(2026-11-29 10:00 UTC);

    /// `init` (prestart), `web` (main, under a 10 s TTL), and `api` (main,
    /// depending on `db/db` running).
    fn alloc() -> Allocation {
        let task = |name: &str, hook: Option<&str>| TaskSpec {
            name: TaskName::parse(name).unwrap(),
            lifecycle: hook.map(|h| crate::lifecycle::Lifecycle {
                hook: h.parse().unwrap(),
                sidecar: false,
            }),
            leader: false,
            readiness: false,
            liveness: None,
            depends_on: Vec::new(),
            acquire: Vec::new(),
            barrier: None,
        };
        let mut web = task("web", None);
        web.liveness = Some(Duration::from_secs(10));
        let mut api = task("api", None);
        api.depends_on = vec![Dependency {
            task: TaskName::parse("db").unwrap(),
            allocation: Some(AllocId::parse("db").unwrap()),
            condition: Condition::Running,
        }];
        let spec = AllocSpec::new(
            vec![task("init", Some("prestart")), web, api],
            &Limits::default(),
        )
        .unwrap();
        Allocation::register(AllocId::parse("a1").unwrap(), Arc::new(spec), 1, NOW)
    }

    /// The next version after a batch report in the scenarios' notation
    /// (`failed`: dead and failed).
    fn report(a: &Allocation, states: &[(&str, &str)]) -> Allocation {
        let r = crate::lifecycle::scenarios::reports(a, states);
        a.report(&r, NOW, || a.modify_index + 1)
            .expect("the report changes the allocation")
    }

    fn kinds(a: &Allocation) -> Vec<(TroubleKind, Vec<&str>)> {
        a.troubles()
            .into_iter()
            .map(|t| {
                let tasks = t
                    .tasks
                    .iter()
                    .map(|n| a.task_name(a.position(n.as_str()).unwrap()).as_str())
                    .collect();
                (t.kind, tasks)
            })
            .collect()
    }

    fn states(a: &Allocation) -> Vec<ListState> {
        let t = a.troubles();
        ListState::ALL
            .iter()
            .copied()
            .filter(|&s| a.is_in(s, &t))
            .collect()
    }

    fn in_main() -> Allocation {
        report(&alloc(), &[("init", "dead")])
    }

    #[test]
    fn a_healthy_allocation_has_no_trouble_and_runs() {
        let a = alloc();
        assert_eq!(kinds(&a), vec![]);
        assert_eq!(states(&a), vec![ListState::Running]);
    }

    #[test]
    fn a_dependency_on_another_allocation_blocks_and_one_that_cannot_hold_sticks() {
        let mut a = in_main();
        assert_eq!(a.state, CoordState::Main);
        // Not judged yet: `db` is not registered.
        a.set_verdicts(&|_, _| DepState::Blocked(Why::NotRegistered));
        assert_eq!(kinds(&a), vec![(TroubleKind::Blocked, vec!["api"])]);
        assert_eq!(states(&a), vec![ListState::Running, ListState::Blocked]);
        a.set_verdicts(&|_, _| DepState::Blocked(Why::Failed));
        assert_eq!(kinds(&a), vec![(TroubleKind::Stuck, vec!["api"])]);
        assert_eq!(states(&a), vec![ListState::Running, ListState::Blocked]);
        a.set_verdicts(&|_, _| DepState::Cycle(vec!["db/db".to_owned()].into()));
        assert_eq!(kinds(&a), vec![(TroubleKind::Stuck, vec!["api"])]);
        a.set_verdicts(&|_, _| DepState::Holds);
        assert_eq!(kinds(&a), vec![]);
    }

    #[test]
    fn a_dependency_before_its_gate_opens_is_no_trouble() {
        let mut a = alloc();
        assert_eq!(a.state, CoordState::Prestart);
        a.set_verdicts(&|_, _| DepState::Blocked(Why::Failed));
        assert_eq!(kinds(&a), vec![]);
    }

    #[test]
    fn a_failed_task_fails_the_allocation_and_finishes_it_once_all_are_dead() {
        let a = report(&in_main(), &[("web", "failed")]);
        assert_eq!(kinds(&a), vec![(TroubleKind::Failed, vec!["web"])]);
        assert_eq!(states(&a), vec![ListState::Running, ListState::Failed]);
        let a = report(&a, &[("api", "dead")]);
        assert!(a.finished());
        assert_eq!(states(&a), vec![ListState::Finished, ListState::Failed]);
    }

    /// An all-tasks restart is what a failure's next step asks for: once
    /// it is ordered, the failure it answers is no longer shown (its state
    /// is stale, as the stop orders take it), and a new one is.
    #[test]
    fn a_failure_an_all_tasks_restart_answered_is_no_trouble() {
        use crate::lifecycle::RestartMode;
        let a = report(&in_main(), &[("web", "failed"), ("api", "running")]);
        assert_eq!(kinds(&a), vec![(TroubleKind::Failed, vec!["web"])]);
        let (a, _) = a
            .restart(RestartMode::AllTasks, "fixed", NOW, || a.modify_index + 1)
            .unwrap();
        let a = a.expect("the restart changes the allocation");
        assert_eq!(kinds(&a), vec![], "the restart is ordered");
        assert!(!states(&a).contains(&ListState::Failed));
        let a = report(&a, &[("web", "pending")]);
        let a = report(&a, &[("web", "failed")]);
        assert_eq!(kinds(&a), vec![(TroubleKind::Failed, vec!["web"])]);
    }

    #[test]
    fn a_lost_task_is_lost_and_failed() {
        let a = report(&in_main(), &[("web", "running")]);
        let later = NOW + Duration::from_secs(11);
        let a = a
            .tick(later, &|_| None, None, || a.modify_index + 1)
            .expect("web's TTL passed");
        assert!(a.tasks[1].lost());
        assert_eq!(kinds(&a)[0], (TroubleKind::Lost, vec!["web"]));
        assert!(
            !kinds(&a).iter().any(|(k, _)| *k == TroubleKind::Failed),
            "lost is shown once"
        );
        let s = states(&a);
        assert!(
            s.contains(&ListState::Lost) && s.contains(&ListState::Failed),
            "{s:?}"
        );
    }

    #[test]
    fn a_passed_deadline_names_the_tasks_it_waited_on() {
        let mut a = in_main();
        a.set_verdicts(&|_, _| DepState::Holds);
        let a = a.with_deadlines(
            None,
            Some(Overdue {
                stage: Some((CoordState::Main, vec![1])),
                poststop: None,
            }),
        );
        assert_eq!(kinds(&a), vec![(TroubleKind::PastDeadline, vec!["web"])]);
        assert!(states(&a).contains(&ListState::Failed));
        let a = a.with_deadlines(
            None,
            Some(Overdue {
                stage: Some((CoordState::Main, vec![])),
                poststop: None,
            }),
        );
        assert_eq!(kinds(&a), vec![(TroubleKind::PastDeadline, vec![])]);
    }
}
