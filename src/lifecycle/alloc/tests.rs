use time::macros::datetime;

use super::*;
use crate::lifecycle::{Limits, RunState, TaskName, TaskSpec};

/// A change decided with a placeholder index takes its commit's index
/// wherever it stamped one, and nowhere else.
#[test]
fn restamping_replaces_the_placeholder_and_only_it() {
    let now = datetime!(2026-11-24 10:00 UTC);
    let tasks = ["a", "b"].map(|n| TaskSpec::named(TaskName::parse(n).unwrap()));
    let spec = Arc::new(AllocSpec::new(tasks.to_vec(), &Limits::default()).unwrap());
    let mut a = Allocation::register(AllocId::parse("x").unwrap(), spec, 1, now);
    a.restamp(1, 40);
    assert_eq!((a.create_index, a.modify_index), (40, 40));
    assert!(a.tasks.iter().all(|t| t.modify_index == 40));
    let running = TaskReport {
        state: RunState::Running,
        failed: false,
        event: None,
        ready: None,
    };
    let mut next = a.report(&[(1, running)], now, || 41).expect("a change");
    next.restamp(41, 97);
    assert_eq!((next.create_index, next.modify_index), (40, 97));
    assert_eq!(next.tasks[0].modify_index, 40, "untouched");
    assert_eq!(
        next.tasks[1].modify_index, 97,
        "the task the change touched"
    );
}

mod third_edition {
    use std::time::Duration;

    use time::macros::datetime;

    use super::super::*;
    use crate::lifecycle::{
        Deadlines, Hook, LOST_EVENT, Lifecycle, Limits, Outcome, RunState, StopKind, TaskName,
        TaskSpec,
    };

    const T0: Timestamp = datetime!(2026-11-25 10:00 UTC);
    const TTL: Duration = Duration::from_secs(30);

    fn at(secs: u64) -> Timestamp {
        T0 + Duration::from_secs(secs)
    }

    fn task(name: &str, hook: Option<(Hook, bool)>, ttl: Option<Duration>) -> TaskSpec {
        TaskSpec {
            lifecycle: hook.map(|(hook, sidecar)| Lifecycle { hook, sidecar }),
            liveness: ttl,
            ..TaskSpec::named(TaskName::parse(name).unwrap())
        }
    }

    fn alloc(tasks: Vec<TaskSpec>, deadlines: Deadlines) -> Allocation {
        let spec = AllocSpec::with_deadlines(tasks, deadlines, &Limits::default()).unwrap();
        Allocation::register(AllocId::parse("a").unwrap(), Arc::new(spec), 1, T0)
    }

    fn report(state: RunState, failed: bool) -> TaskReport {
        TaskReport {
            state,
            failed,
            ready: None,
            event: None,
        }
    }

    /// Applies reports at `now`, with the next index.
    fn step(a: &Allocation, reports: &[(usize, RunState)], now: Timestamp) -> Allocation {
        let reports: Vec<_> = reports
            .iter()
            .map(|&(i, s)| (i, report(s, false)))
            .collect();
        let index = a.modify_index + 1;
        a.report(&reports, now, || index).expect("a change")
    }

    fn no_sign(_: usize) -> Option<Timestamp> {
        None
    }

    /// web (TTL) and a prestart sidecar proxy, web running since T0.
    fn running() -> Allocation {
        let a = alloc(
            vec![
                task("proxy", Some((Hook::Prestart, true)), None),
                task("web", None, Some(TTL)),
            ],
            Deadlines::default(),
        );
        let a = step(&a, &[(0, RunState::Running)], T0);
        step(&a, &[(1, RunState::Running)], T0)
    }

    #[test]
    fn a_running_task_without_a_sign_of_life_for_its_ttl_is_lost_as_one_change() {
        let a = running();
        assert_eq!(a.wake_at(&no_sign, None), Some(at(30)));
        assert!(a.tick(at(29), &no_sign, None, || 99).is_none(), "not yet");
        let lost = a.tick(at(30), &no_sign, None, || 99).expect("lost");
        let web = &lost.tasks[1];
        assert_eq!(
            (web.state, web.failed, web.lost_at()),
            (RunState::Dead, true, Some(at(30)))
        );
        assert_eq!(web.finished_at, Some(at(30)));
        let event = web.events.last().unwrap();
        assert_eq!(event.kind, LOST_EVENT);
        assert_eq!(event.message, "no sign of life for 30s");
        assert_eq!(event.details.get("ttl"), Some("30s"));
        assert_eq!(event.details.get("last_seen"), Some("2026-11-25T10:00:00Z"));
        // From there the rules apply unchanged: a failed task.
        assert_eq!(lost.modify_index, 99);
        assert_eq!(web.modify_index, 99);
        let sibling = lost.desired(0).reason().unwrap();
        assert_eq!(sibling.kind, StopKind::SiblingTaskFailed);
        assert_eq!(sibling.task.as_ref().unwrap().as_str(), "web");
        // Its own order says why, and it may not start.
        assert_eq!(lost.desired(1).reason().unwrap().kind, StopKind::AgentLost);
        assert!(!lost.allowed(1));
        lost.check_invariants().unwrap();
        // Once the sidecar is dead, poststop: failed, naming web.
        let done = step(&lost, &[(0, RunState::Dead)], at(31));
        assert_eq!(done.state, CoordState::Poststop);
        let (outcome, failed) = done.outcome().unwrap();
        assert_eq!(outcome, Outcome::Failed);
        assert_eq!(failed, [TaskName::parse("web").unwrap()]);
        // Nothing is due any more.
        assert_eq!(done.wake_at(&no_sign, None), None);
    }

    #[test]
    fn a_sign_of_life_moves_the_end_and_only_running_tasks_are_watched() {
        let a = running();
        let seen = |i: usize| (i == 1).then_some(at(20));
        assert_eq!(a.wake_at(&seen, None), Some(at(50)));
        assert!(a.tick(at(49), &seen, None, || 9).is_none());
        assert!(a.tick(at(50), &seen, None, || 9).is_some());
        // A sign of life from before the task started counts from its
        // start: the clock starts when it becomes running.
        let early = |_: usize| Some(T0 - Duration::from_secs(100));
        assert_eq!(a.wake_at(&early, None), Some(at(30)));
        // Pending and dead tasks are never lost.
        let fresh = alloc(vec![task("web", None, Some(TTL))], Deadlines::default());
        assert_eq!(fresh.wake_at(&no_sign, None), None);
        assert!(fresh.tick(at(3600), &no_sign, None, || 9).is_none());
        let dead = step(
            &step(&fresh, &[(0, RunState::Running)], T0),
            &[(0, RunState::Dead)],
            T0,
        );
        assert!(dead.tick(at(3600), &no_sign, None, || 9).is_none());
    }

    #[test]
    fn the_server_default_ttl_applies_to_tasks_without_their_own() {
        let a = running();
        // proxy has no TTL of its own: the default watches it; web
        // keeps its own.
        let default = Some(Duration::from_secs(10));
        assert_eq!(a.wake_at(&no_sign, default), Some(at(10)));
        let lost = a.tick(at(10), &no_sign, default, || 9).unwrap();
        assert!(lost.tasks[0].lost() && !lost.tasks[1].lost());
    }

    #[test]
    fn a_task_whose_signs_of_life_lapsed_in_the_store_is_lost_now_whatever_the_clock() {
        let a = running();
        // Alive until told: nothing due by time alone.
        let alive = |_: usize| Some(UNTIL_TOLD);
        assert_eq!(a.wake_at(&alive, None), Some(UNTIL_TOLD));
        assert!(a.tick(at(3600), &alive, None, || 9).is_none());
        // web's lease expired: lost at once, even before its start
        // plus its TTL by this clock (a replica whose clock is behind
        // the one that started it).
        let lapsed = |i: usize| (i == 1).then_some(at(3));
        let lost = a
            .tick_lapsed(at(10), &alive, &lapsed, None, || 9)
            .expect("lost");
        let web = &lost.tasks[1];
        assert_eq!(web.lost_at(), Some(at(10)));
        let event = web.events.last().unwrap();
        assert_eq!(event.kind, LOST_EVENT);
        assert_eq!(event.details.get("last_seen"), Some("2026-11-25T10:00:03Z"));
        assert!(!lost.tasks[0].lost(), "a task with no TTL never lapses");
        lost.check_invariants().unwrap();
        // Only a running task under a TTL: once dead, nothing.
        assert!(
            lost.tick_lapsed(at(11), &alive, &lapsed, None, || 10)
                .is_none()
        );
    }

    #[test]
    fn a_lost_task_takes_no_report_until_a_restart_or_a_restore_revives_it() {
        let lost = running().tick(at(30), &no_sign, None, || 9).unwrap();
        assert_eq!(lost.lost_among([0, 1]), Some((1, at(30))));
        assert_eq!(lost.lost_among([0]), None);
        let mut t = lost.tasks[1].clone();
        t.apply(&report(RunState::Running, false), at(40));
        assert_eq!(t, lost.tasks[1], "a lost task's status takes no report");

        // An all-tasks restart: pending again, waiting for a new agent.
        let (restarted, chosen) = lost
            .restart(RestartMode::AllTasks, "", at(40), || 10)
            .unwrap();
        let restarted = restarted.unwrap();
        assert_eq!(chosen, [0, 1]);
        let web = &restarted.tasks[1];
        assert!(!web.lost());
        assert_eq!(
            (web.state, web.failed, web.restarts),
            (RunState::Pending, false, 1)
        );
        assert!(restarted.extra_is_trimmed(1));
        assert_eq!(restarted.order(), &Desired::Run);
        restarted.check_invariants().unwrap();

        // A restore: a task it names takes the state given; one it does
        // not name waits for a new agent.
        let restored = lost
            .restore(&[(1, report(RunState::Running, false))], at(40), || 10)
            .unwrap();
        assert!(!restored.tasks[1].lost());
        assert_eq!(restored.tasks[1].state, RunState::Running);
        let two_lost = running().tick(at(30), &no_sign, Some(TTL), || 9).unwrap();
        assert!(two_lost.tasks[0].lost() && two_lost.tasks[1].lost());
        let restored = two_lost
            .restore(&[(1, report(RunState::Running, false))], at(40), || 10)
            .unwrap();
        assert_eq!(restored.tasks[0].state, RunState::Pending);
        assert!(!restored.tasks[0].lost());
        restored.check_invariants().unwrap();
    }

    fn deadlines(pairs: &[(CoordState, u64)]) -> Deadlines {
        let mut d = Deadlines::default();
        for &(s, secs) in pairs {
            d.set(s, Some(Duration::from_secs(secs)));
        }
        d
    }

    #[test]
    fn a_stage_deadline_runs_from_entering_its_state_and_fails_the_allocation() {
        let a = alloc(
            vec![
                task("init", Some((Hook::Prestart, false)), None),
                task("proxy", Some((Hook::Prestart, true)), None),
                task("web", None, None),
            ],
            deadlines(&[(CoordState::Prestart, 60), (CoordState::Main, 120)]),
        );
        assert_eq!(a.state, CoordState::Prestart);
        assert_eq!(a.deadline_at, Some(at(60)));
        // Entering main starts main's deadline from then.
        let a = step(&a, &[(0, RunState::Dead), (1, RunState::Running)], at(10));
        assert_eq!(a.state, CoordState::Main);
        assert_eq!(a.deadline_at, Some(at(130)));
        assert_eq!(a.wake_at(&no_sign, None), Some(at(130)));
        // A change within the state keeps it.
        let with_event = TaskReport {
            event: Some(crate::lifecycle::EventInput {
                kind: "Note".into(),
                time: None,
                message: String::new(),
                details: Default::default(),
            }),
            ..report(RunState::Running, false)
        };
        let same = a.report(&[(1, with_event)], at(20), || 40).unwrap();
        assert_eq!(same.deadline_at, Some(at(130)));
        assert!(a.tick(at(129), &no_sign, None, || 50).is_none());
        let over = a.tick(at(130), &no_sign, None, || 50).unwrap();
        assert_eq!(over.deadline_at, None);
        let reason = over.order().reason().unwrap();
        assert_eq!(
            (reason.kind, reason.stage),
            (StopKind::DeadlineExceeded, Some(CoordState::Main))
        );
        assert_eq!(
            over.overdue().unwrap().stage,
            Some((CoordState::Main, vec![2]))
        );
        over.check_invariants().unwrap();
        // Told to stop, the sidecar and web die; the outcome names
        // what main waited on.
        let done = step(&over, &[(1, RunState::Dead), (2, RunState::Dead)], at(131));
        assert_eq!(done.state, CoordState::Poststop);
        let (outcome, failed) = done.outcome().unwrap();
        assert_eq!(outcome, Outcome::Failed);
        assert_eq!(failed, [TaskName::parse("web").unwrap()]);
        assert_eq!(done.order(), over.order(), "sticky");
    }

    #[test]
    fn a_deadline_never_replaces_an_earlier_order() {
        let a = alloc(
            vec![
                task("init", Some((Hook::Prestart, false)), None),
                task("proxy", Some((Hook::Prestart, true)), None),
                task("web", None, None),
            ],
            deadlines(&[(CoordState::Prestart, 60)]),
        );
        let failed = a
            .report(&[(0, report(RunState::Dead, true))], at(1), || 2)
            .unwrap();
        let reason = failed.order().clone();
        assert_eq!(reason.reason().unwrap().kind, StopKind::SiblingTaskFailed);
        // The sidecar never dies: prestart's deadline passes anyway.
        let over = failed.tick(at(60), &no_sign, None, || 3).unwrap();
        assert_eq!(over.order(), &reason);
        assert_eq!(
            over.overdue().unwrap().stage,
            Some((CoordState::Prestart, vec![0, 1]))
        );
    }

    /// A later stage's deadline keeps the first deadline's order and
    /// what it failed: the outcome's failed tasks still name the
    /// prestart sidecar that was never ready in time.
    #[test]
    fn a_later_deadline_keeps_the_failed_tasks_of_the_first() {
        let side = TaskSpec {
            readiness: true,
            ..task("side", Some((Hook::Prestart, true)), None)
        };
        let a = alloc(
            vec![side, task("web", None, None)],
            deadlines(&[(CoordState::Prestart, 10), (CoordState::Main, 10)]),
        );
        let a = step(&a, &[(0, RunState::Running)], at(1));
        // Prestart's deadline: side is running but was never ready.
        let a = a.tick(at(10), &no_sign, None, || 3).unwrap();
        assert_eq!(
            a.order().reason().unwrap().stage,
            Some(CoordState::Prestart)
        );
        // Ready just after: main opens, and its deadline passes too.
        let ready = TaskReport {
            ready: Some(true),
            ..report(RunState::Running, false)
        };
        let a = a.report(&[(0, ready)], at(11), || 4).unwrap();
        assert_eq!(a.state, CoordState::Main);
        let a = a.tick(at(21), &no_sign, None, || 5).unwrap();
        let done = step(&a, &[(0, RunState::Dead), (1, RunState::Dead)], at(22));
        let (_, failed) = done.outcome().unwrap();
        assert_eq!(
            done.order().reason().unwrap().stage,
            Some(CoordState::Prestart),
            "the order names prestart"
        );
        assert!(
            failed.contains(&TaskName::parse("side").unwrap()),
            "prestart failed on side, yet failed_tasks = {failed:?}"
        );
    }

    #[test]
    fn the_poststop_deadline_tells_unfinished_poststop_tasks_to_stop() {
        let a = alloc(
            vec![
                task("web", None, None),
                task("upload", Some((Hook::Poststop, false)), None),
                task("clean", Some((Hook::Poststop, false)), None),
            ],
            deadlines(&[(CoordState::Poststop, 60)]),
        );
        assert_eq!(a.deadline_at, None, "main has none");
        let a = step(&a, &[(0, RunState::Dead)], at(10));
        assert_eq!(a.state, CoordState::Poststop);
        assert_eq!(a.deadline_at, Some(at(70)));
        let a = step(&a, &[(1, RunState::Running), (2, RunState::Dead)], at(20));
        let over = a.tick(at(70), &no_sign, None, || 40).unwrap();
        assert_eq!(over.overdue().unwrap().poststop, Some(vec![1]));
        let told = over.desired(1).reason().unwrap();
        assert_eq!(
            (told.kind, told.stage),
            (StopKind::DeadlineExceeded, Some(CoordState::Poststop))
        );
        assert_eq!(over.desired(2), &Desired::Run, "clean had ended");
        assert_eq!(over.tasks[1].modify_index, 40);
        assert_eq!(over.tasks[2].modify_index, a.tasks[2].modify_index);
        assert_eq!(
            over.outcome().unwrap().0,
            Outcome::Succeeded,
            "nothing else changes"
        );
        over.check_invariants().unwrap();
        // Once every poststop task ended, nothing is bounded any more.
        let b = step(&a, &[(1, RunState::Dead)], at(30));
        assert_eq!(b.deadline_at, None);
    }

    #[test]
    fn an_all_tasks_restart_clears_passed_deadlines_and_starts_them_again() {
        let a = alloc(
            vec![task("web", None, None)],
            deadlines(&[(CoordState::Main, 60)]),
        );
        let a = step(&a, &[(0, RunState::Running)], T0);
        // web is running: main moved on, so no deadline runs.
        assert_eq!(a.state, CoordState::WaitAlloc);
        assert_eq!(a.deadline_at, None);
        let b = alloc(
            vec![task("web", None, None)],
            deadlines(&[(CoordState::Main, 60)]),
        );
        let over = b.tick(at(60), &no_sign, None, || 5).unwrap();
        let (restarted, _) = over
            .restart(RestartMode::AllTasks, "again", at(100), || 6)
            .unwrap();
        let restarted = restarted.unwrap();
        assert_eq!(restarted.order(), &Desired::Run);
        assert!(restarted.overdue().is_none());
        assert_eq!(restarted.state, CoordState::Main);
        assert_eq!(restarted.deadline_at, Some(at(160)), "from the restart");
        restarted.check_invariants().unwrap();
    }

    impl Allocation {
        /// Whether task `i` holds no out-of-line part.
        fn extra_is_trimmed(&self, i: usize) -> bool {
            self.tasks[i].extra.is_none()
        }
    }
}

mod dependencies {
    use time::macros::datetime;

    use super::super::*;
    use crate::lifecycle::{
        Condition, Dependency, Hook, Lifecycle, Limits, RunState, TaskName, TaskSpec,
    };

    const T0: Timestamp = datetime!(2026-11-25 10:00 UTC);

    fn dep(task: &str, alloc: Option<&str>, condition: Condition) -> Dependency {
        Dependency {
            task: TaskName::parse(task).unwrap(),
            allocation: alloc.map(|a| AllocId::parse(a).unwrap()),
            condition,
        }
    }

    fn task(name: &str, hook: Option<(Hook, bool)>, deps: Vec<Dependency>) -> TaskSpec {
        TaskSpec {
            lifecycle: hook.map(|(hook, sidecar)| Lifecycle { hook, sidecar }),
            depends_on: deps,
            ..TaskSpec::named(TaskName::parse(name).unwrap())
        }
    }

    fn alloc(tasks: Vec<TaskSpec>) -> Allocation {
        let spec = AllocSpec::new(tasks, &Limits::default()).unwrap();
        Allocation::register(AllocId::parse("app").unwrap(), Arc::new(spec), 1, T0)
    }

    fn step(a: &Allocation, i: usize, state: RunState) -> Allocation {
        let r = TaskReport {
            state,
            failed: false,
            ready: None,
            event: None,
        };
        let index = a.modify_index + 1;
        a.report(&[(i, r)], T0, || index).expect("a change")
    }

    #[test]
    fn steps_inside_a_stage_run_one_after_the_other() {
        let pre = Some((Hook::Prestart, false));
        let a = alloc(vec![
            task("migrate", pre, vec![]),
            task(
                "seed",
                pre,
                vec![dep("migrate", None, Condition::Succeeded)],
            ),
            task("warm", pre, vec![dep("seed", None, Condition::Succeeded)]),
            task("web", None, vec![]),
        ]);
        assert_eq!(a.state, CoordState::Prestart);
        let allowed = |a: &Allocation| (0..4).map(|i| a.allowed(i)).collect::<Vec<_>>();
        assert_eq!(allowed(&a), [true, false, false, false]);
        let why: Vec<_> = a
            .waiting()
            .into_iter()
            .map(|(n, w)| (n.to_string(), w))
            .collect();
        assert_eq!(
            why,
            [
                ("migrate".to_owned(), WaitFor::Success),
                ("seed".to_owned(), WaitFor::Dependency),
                ("warm".to_owned(), WaitFor::Dependency),
            ]
        );
        let blocked = a.blocked_by(1);
        assert_eq!(blocked.len(), 1);
        assert_eq!(blocked[0].1.why(), Some(Why::Pending));
        let a = step(&a, 0, RunState::Running);
        assert_eq!(a.blocked_by(1)[0].1.why(), Some(Why::Running));
        let a = step(&a, 0, RunState::Dead);
        // Gates are level-triggered: migrate's stays open while
        // prestart lasts.
        assert_eq!(allowed(&a), [true, true, false, false]);
        assert_eq!(
            a.tasks[1].modify_index, a.modify_index,
            "its gate opened: a change of its"
        );
        let a = step(&step(&a, 1, RunState::Running), 1, RunState::Dead);
        assert_eq!(allowed(&a), [true, true, true, false]);
        let a = step(&step(&a, 2, RunState::Running), 2, RunState::Dead);
        assert_eq!(
            a.state,
            CoordState::Main,
            "the stage is done only when all are"
        );
        a.check_invariants().unwrap();
    }

    #[test]
    fn a_dependency_that_stops_holding_closes_future_starts_but_stops_nothing() {
        let side = Some((Hook::Prestart, true));
        let a = alloc(vec![
            task("db", side, vec![]),
            task("web", None, vec![dep("db", None, Condition::Running)]),
        ]);
        let a = step(&a, 0, RunState::Running);
        assert_eq!(a.state, CoordState::Main);
        assert!(a.allowed(1));
        let a = step(&a, 1, RunState::Running);
        // db goes back to pending (its agent restarts it): web may not
        // start again, but keeps running, told nothing.
        let a = step(&a, 0, RunState::Pending);
        assert!(!a.allowed(1));
        assert_eq!(a.tasks[1].state, RunState::Running);
        assert_eq!(a.desired(1), &Desired::Run);
        assert_eq!(
            a.state,
            CoordState::WaitAlloc,
            "transitions do not look at dependencies"
        );
    }

    #[test]
    fn another_allocation_s_verdicts_come_from_outside_and_make_a_new_version() {
        let a = alloc(vec![task(
            "web",
            None,
            vec![dep("db", Some("db-7"), Condition::Ready)],
        )]);
        assert_eq!(a.blocked_by(0)[0].1.why(), Some(Why::NotRegistered));
        assert!(!a.allowed(0));
        assert_eq!(a.waiting()[0].1, WaitFor::Dependency);
        let none = a.resolve(&|_, _| DepState::Blocked(Why::NotRegistered), T0, || 9);
        assert!(none.is_none(), "the same verdict is no change");
        let b = a.resolve(&|_, _| DepState::Holds, T0, || 9).unwrap();
        assert!(b.allowed(0));
        assert_eq!((b.modify_index, b.tasks[0].modify_index), (9, 9));
        assert_eq!(b.waiting()[0].1, WaitFor::Running);
        b.check_invariants().unwrap();
    }
}

/// The rules of a task's place with its semaphores (SEMANTICS, "Semaphores").
mod semaphores {
    use time::macros::datetime;

    use super::super::*;
    use crate::lifecycle::{Hook, Lifecycle, Limits, SemName, TaskName, TaskSpec};

    const T0: Timestamp = datetime!(2026-11-29 10:00 UTC);

    /// `migrate` (prestart, acquires `db`) and `web` (main).
    fn alloc() -> Allocation {
        let migrate = TaskSpec {
            lifecycle: Some(Lifecycle {
                hook: Hook::Prestart,
                sidecar: false,
            }),
            acquire: vec![SemName::parse("db").unwrap()],
            ..TaskSpec::named(TaskName::parse("migrate").unwrap())
        };
        let web = TaskSpec::named(TaskName::parse("web").unwrap());
        let spec = AllocSpec::new(vec![migrate, web], &Limits::default()).unwrap();
        Allocation::register(AllocId::parse("a").unwrap(), Arc::new(spec), 5, T0)
    }

    fn report(a: &Allocation, i: usize, state: RunState) -> Allocation {
        let r = TaskReport {
            state,
            failed: false,
            event: None,
            ready: None,
        };
        let index = a.modify_index + 1;
        a.report(&[(i, r)], T0, || index).expect("a change")
    }

    #[test]
    fn a_task_whose_gate_opens_queues_and_waits_for_its_grant() {
        let a = alloc();
        assert_eq!(a.tasks[0].hold(), Some(Hold::Queued { since: 5, at: T0 }));
        assert!(!a.allowed(0), "queued, not granted");
        let g = a.grant(0, T0, || 6).expect("a change");
        assert_eq!(g.tasks[0].hold(), Some(Hold::Granted { fence: 6, at: T0 }));
        assert!(g.allowed(0));
        assert_eq!(g.modify_index, 6);
        assert!(g.grant(0, T0, || 7).is_none(), "granted once");
    }

    #[test]
    fn dying_frees_the_slot_and_a_restart_queues_at_the_back() {
        let g = alloc().grant(0, T0, || 6).unwrap();
        let running = report(&g, 0, RunState::Running);
        assert_eq!(running.tasks[0].fence(), Some(6), "held while running");
        let dead = report(&running, 0, RunState::Dead);
        assert_eq!(dead.tasks[0].hold(), None, "dead holds nothing");
        let ordered = running
            .restart(RestartMode::Running, "test", T0, || 20)
            .expect("a restart")
            .0
            .expect("a change");
        assert_eq!(ordered.tasks[0].fence(), Some(6), "held until it stops");
        let restarted = report(&ordered, 0, RunState::Pending);
        assert_eq!(
            restarted.tasks[0].hold(),
            Some(Hold::Queued { since: 21, at: T0 }),
            "back to pending: in line again, behind everyone queued before"
        );
    }

    #[test]
    fn a_lapsed_grant_goes_to_the_back_and_a_stop_order_leaves_the_line() {
        let g = alloc().grant(0, T0, || 6).unwrap();
        let expired = g.expire_grant(0, T0, || 9).expect("a change");
        assert_eq!(
            expired.tasks[0].hold(),
            Some(Hold::Queued { since: 9, at: T0 })
        );
        assert!(expired.expire_grant(0, T0, || 10).is_none());
        let running = report(&g, 0, RunState::Running);
        assert!(
            running.expire_grant(0, T0, || 10).is_none(),
            "it started in time"
        );
        // `web` fails: the allocation is told to stop, and the prestart
        // task waiting for its slot leaves the line.
        let a = alloc();
        let failed = TaskReport {
            state: RunState::Dead,
            failed: true,
            event: None,
            ready: None,
        };
        let stopped = a.report(&[(1, failed)], T0, || 6).unwrap();
        assert!(stopped.desired(0).is_stop());
        assert_eq!(stopped.tasks[0].hold(), None);
    }

    #[test]
    fn the_placeholder_index_of_a_place_or_a_fence_is_restamped() {
        let mut a = alloc();
        a.restamp(5, 50);
        assert_eq!(a.tasks[0].hold(), Some(Hold::Queued { since: 50, at: T0 }));
        let mut g = a.grant(0, T0, || 51).unwrap();
        g.restamp(51, 70);
        assert_eq!(g.tasks[0].fence(), Some(70));
    }
}
