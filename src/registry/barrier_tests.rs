//! Barriers through the registry (`barriers.rs`): gathering, opening
//! once and for good, refusals at registration, timeouts, members that
//! leave, restarts and deletions.

use std::{sync::Arc, time::Duration};

use super::{
    gates_tests::{LONG, config, id, name, registry, rep, report_task, settle},
    *,
};
use crate::{
    lifecycle::{
        AllocSpec, BarrierSpec, Desired, Hook, Lifecycle, Meet, RunState, StopKind, StopReason,
        TaskName, TaskSpec,
    },
    store::MemoryStore,
};

pub(super) fn barrier(size: u16, timeout: Option<u64>) -> BarrierSpec {
    BarrierSpec {
        name: name("train"),
        size,
        timeout: timeout.map(Duration::from_secs),
    }
}

/// A prestart sidecar `side` (the main gate opens once it runs) and a
/// main task `worker` at barrier `train`.
pub(super) fn spec(size: u16, timeout: Option<u64>) -> AllocSpec {
    AllocSpec::new(
        vec![
            TaskSpec {
                lifecycle: Some(Lifecycle {
                    hook: Hook::Prestart,
                    sidecar: true,
                }),
                ..TaskSpec::named(TaskName::parse("side").unwrap())
            },
            TaskSpec {
                barrier: Some(barrier(size, timeout)),
                ..TaskSpec::named(TaskName::parse("worker").unwrap())
            },
        ],
        &Limits::default(),
    )
    .unwrap()
}

/// Registers `alloc` and starts its sidecar: its worker arrives.
pub(super) async fn arrive(r: &Registry, alloc: &str, size: u16, timeout: Option<u64>) {
    r.register(id(alloc), spec(size, timeout)).await.unwrap();
    report_task(r, alloc, "side", RunState::Running).await;
}

pub(super) fn meet(r: &Registry, alloc: &str) -> Option<Meet> {
    r.get(alloc).unwrap().tasks[1].meet()
}

pub(super) async fn allowed_within(r: &Registry, alloc: &str, within: Duration) -> bool {
    r.wait_until(alloc, within, |a| a.allowed(1))
        .await
        .unwrap()
        .allowed(1)
}

pub(super) fn gathering(r: &Registry, alloc: &str) -> Option<Gathering> {
    let a = r.get(alloc).unwrap();
    r.waiting_at_barrier(&a, 1).map(|(n, g)| {
        assert_eq!(n, name("train"));
        g
    })
}

#[tokio::test(start_paused = true)]
async fn a_barrier_opens_once_size_members_arrived_and_releases_them_together_for_good() {
    let r = registry();
    for alloc in ["a", "b", "c"] {
        arrive(&r, alloc, 4, None).await;
    }
    settle(&r).await;
    for alloc in ["a", "b", "c"] {
        assert!(!r.get(alloc).unwrap().allowed(1), "{alloc} gathers");
        assert_eq!(
            gathering(&r, alloc),
            Some(Gathering::Gathering {
                arrived: 3,
                size: 4
            })
        );
    }
    // Registered, but its sidecar does not run: not arrived.
    r.register(id("d"), spec(4, None)).await.unwrap();
    settle(&r).await;
    assert_eq!(meet(&r, "d"), None);
    assert!(!r.get("a").unwrap().allowed(1), "3 of 4 arrived");
    let b = r.barrier("train").unwrap();
    assert_eq!(b.members.len(), 4);
    assert!(matches!(
        b.phase,
        BarrierPhase::Gathering { arrived: 3, .. }
    ));
    report_task(&r, "d", "side", RunState::Running).await;
    for alloc in ["a", "b", "c", "d"] {
        assert!(allowed_within(&r, alloc, LONG).await, "{alloc} released");
    }
    settle(&r).await;
    let opened = match r.barrier("train").unwrap().phase {
        BarrierPhase::Open(at) => at,
        other => panic!("open, not {other:?}"),
    };
    for alloc in ["a", "b", "c", "d"] {
        assert_eq!(meet(&r, alloc), Some(Meet::Passed { at: opened }));
        assert_eq!(gathering(&r, alloc), None);
    }
    // Open for good: a member that runs, dies and is restarted with its
    // whole allocation is not held again.
    report_task(&r, "a", "worker", RunState::Running).await;
    report_task(&r, "a", "worker", RunState::Dead).await;
    let (a, _) = r
        .restart("a", RestartTarget::AllTasks, "again")
        .await
        .unwrap();
    // Its agent restarts both tasks: the gate opens again, and so does
    // the worker's.
    let side = |state| vec![(TaskName::parse("side").unwrap(), rep(state))];
    r.report_as("a", side(RunState::Pending), None, a.tasks[0].run)
        .await
        .unwrap();
    report_task(&r, "a", "worker", RunState::Pending).await;
    let a = report_task(&r, "a", "side", RunState::Running).await;
    assert_eq!(a.tasks[1].meet(), Some(Meet::Passed { at: opened }));
    assert!(a.allowed(1), "no second gathering: {:?}", a.state);
}

#[tokio::test(start_paused = true)]
async fn members_must_agree_and_a_full_or_decided_barrier_takes_no_more() {
    let r = registry();
    arrive(&r, "a", 2, Some(60)).await;
    let refused = |e: RegistryError| e.to_string();
    let e = r.register(id("x"), spec(3, Some(60))).await.unwrap_err();
    assert!(
        matches!(&e, RegistryError::BarrierMismatch { size: 2, .. }),
        "{e}"
    );
    let e = r.register(id("x"), spec(2, Some(30))).await.unwrap_err();
    assert!(
        refused(e).contains("size 2 and timeout 1m"),
        "the barrier's terms are named"
    );
    let e = r.register(id("x"), spec(2, None)).await.unwrap_err();
    assert!(matches!(e, RegistryError::BarrierMismatch { .. }), "{e}");
    assert!(r.get("x").is_err(), "nothing registered");
    // Two members of one allocation count as two.
    let two = AllocSpec::new(
        vec![
            TaskSpec {
                barrier: Some(barrier(2, Some(60))),
                ..TaskSpec::named(TaskName::parse("w1").unwrap())
            },
            TaskSpec {
                barrier: Some(barrier(2, Some(60))),
                ..TaskSpec::named(TaskName::parse("w2").unwrap())
            },
        ],
        &Limits::default(),
    )
    .unwrap();
    let e = r.register(id("x"), two).await.unwrap_err();
    assert!(matches!(e, RegistryError::BarrierClosed { .. }), "{e}");
    arrive(&r, "b", 2, Some(60)).await;
    assert!(allowed_within(&r, "a", LONG).await);
    // Full, and open: closed wins over a mismatch.
    for (size, timeout) in [(2, Some(60)), (5, None)] {
        let e = r.register(id("x"), spec(size, timeout)).await.unwrap_err();
        assert!(matches!(e, RegistryError::BarrierClosed { .. }), "{e}");
    }
    // Deleting a member of an open barrier does not open it to others.
    r.delete("b").await.unwrap();
    let e = r.register(id("x"), spec(2, Some(60))).await.unwrap_err();
    assert!(refused(e).contains("opened or timed out"));
}

#[tokio::test(start_paused = true)]
async fn a_barrier_that_does_not_gather_in_time_stops_every_member_and_fails_them() {
    let r = registry();
    // `c` never arrives (its sidecar never runs), but is a member.
    arrive(&r, "a", 3, Some(10)).await;
    tokio::time::advance(Duration::from_secs(4)).await;
    arrive(&r, "b", 3, Some(10)).await;
    r.register(id("c"), spec(3, Some(10))).await.unwrap();
    settle(&r).await;
    // Counted from the first arrival: 6 s after b's.
    tokio::time::advance(Duration::from_secs(5)).await;
    settle(&r).await;
    assert!(!r.get("a").unwrap().order().is_stop(), "not yet");
    tokio::time::advance(Duration::from_secs(2)).await;
    let order = Desired::Stop(StopReason::barrier(name("train")));
    for alloc in ["a", "b", "c"] {
        let a = r
            .wait_until(alloc, LONG, |a| a.order().is_stop())
            .await
            .unwrap();
        assert_eq!(a.order(), &order, "{alloc}");
        assert!(matches!(a.tasks[1].meet(), Some(Meet::Closed { .. })));
        assert!(!a.allowed(1));
    }
    assert!(matches!(
        r.barrier("train").unwrap().phase,
        BarrierPhase::TimedOut(_)
    ));
    assert_eq!(gathering(&r, "a"), Some(Gathering::TimedOut { size: 3 }));
    // The members stop: the allocation fails, naming the member.
    report_task(&r, "a", "side", RunState::Dead).await;
    let a = report_task(&r, "a", "worker", RunState::Dead).await;
    let (outcome, failed) = a.outcome().unwrap();
    assert_eq!(outcome, crate::lifecycle::Outcome::Failed);
    assert_eq!(failed, [TaskName::parse("worker").unwrap()]);
    assert_eq!(a.order().reason().unwrap().kind, StopKind::BarrierTimeout);
    // Closed: no new member.
    let e = r.register(id("x"), spec(3, Some(10))).await.unwrap_err();
    assert!(matches!(e, RegistryError::BarrierClosed { .. }), "{e}");
    // An all-tasks restart clears the order, not the barrier's verdict.
    r.restart("b", RestartTarget::AllTasks, "again")
        .await
        .unwrap();
    let b = r.get("b").unwrap();
    assert!(!b.order().is_stop());
    assert!(!b.allowed(1), "a timed-out barrier never opens");
    assert_eq!(gathering(&r, "b"), Some(Gathering::TimedOut { size: 3 }));
}

#[tokio::test(start_paused = true)]
async fn a_member_whose_allowance_lapses_leaves_the_count() {
    let r = registry();
    arrive(&r, "a", 2, None).await;
    settle(&r).await;
    assert!(matches!(meet(&r, "a"), Some(Meet::Arrived { .. })));
    // Its sidecar fails: the allocation is told to stop, and `a` no
    // longer counts.
    r.report(
        "a",
        vec![(
            TaskName::parse("side").unwrap(),
            crate::lifecycle::TaskReport {
                failed: true,
                ..rep(RunState::Dead)
            },
        )],
    )
    .await
    .unwrap();
    assert_eq!(meet(&r, "a"), None);
    arrive(&r, "b", 2, None).await;
    settle(&r).await;
    assert_eq!(
        gathering(&r, "b"),
        Some(Gathering::Gathering {
            arrived: 1,
            size: 2
        }),
        "a left the count"
    );
    assert!(!r.get("b").unwrap().allowed(1));
    // A deleted member leaves the barrier: its place is free.
    r.delete("a").await.unwrap();
    arrive(&r, "c", 2, None).await;
    assert!(allowed_within(&r, "b", LONG).await);
    assert!(allowed_within(&r, "c", LONG).await);
}

#[tokio::test(start_paused = true)]
async fn an_opening_survives_a_restart_and_a_barrier_is_forgotten_with_its_members() {
    let store = Arc::new(MemoryStore::new());
    let r = Registry::open(store.clone(), config()).unwrap();
    arrive(&r, "a", 2, Some(30)).await;
    arrive(&r, "b", 2, Some(30)).await;
    assert!(allowed_within(&r, "b", LONG).await);
    settle(&r).await;
    drop(r);
    let r = Registry::open(store.clone(), config()).unwrap();
    settle(&r).await;
    assert!(r.get("a").unwrap().allowed(1) && r.get("b").unwrap().allowed(1));
    assert!(matches!(
        r.barrier("train").unwrap().phase,
        BarrierPhase::Open(_)
    ));
    // Nothing times out an open barrier.
    tokio::time::advance(Duration::from_secs(60)).await;
    settle(&r).await;
    assert!(!r.get("a").unwrap().order().is_stop());
    r.delete("a").await.unwrap();
    r.delete("b").await.unwrap();
    assert!(r.barrier("train").is_none(), "gone with its last member");
    // A new gathering under the name, on new terms.
    arrive(&r, "c", 3, None).await;
    settle(&r).await;
    assert_eq!(
        gathering(&r, "c"),
        Some(Gathering::Gathering {
            arrived: 1,
            size: 3
        })
    );
}

/// A blocking query on a barrier answers once the barrier is forgotten
/// (its last member's allocation deleted), not when its wait runs out.
#[tokio::test(start_paused = true)]
async fn a_wait_on_a_barrier_ends_when_the_barrier_is_forgotten() {
    let r = registry();
    arrive(&r, "a", 2, None).await;
    settle(&r).await;
    let index = r.barrier("train").unwrap().changed;
    let waiting = tokio::spawn({
        let r = r.clone();
        async move {
            let started = tokio::time::Instant::now();
            let answer = r.wait_barrier("train", index, LONG).await;
            (answer.is_none(), started.elapsed())
        }
    });
    tokio::task::yield_now().await;
    r.delete("a").await.unwrap();
    let (gone, waited) = waiting.await.unwrap();
    assert!(gone, "forgotten");
    assert!(waited < LONG, "answered at once, not after {waited:?}");
}

/// A member whose allocation finished before its barrier timed out (it
/// never arrived again: its agent stopped before it ran) takes the
/// verdict, and nothing else: a finished allocation's order and outcome,
/// already given to its poststop tasks, do not change.
#[tokio::test(start_paused = true)]
async fn a_timeout_leaves_a_finished_member_s_outcome_as_it_was() {
    let r = registry();
    arrive(&r, "a", 2, Some(10)).await;
    report_task(&r, "a", "worker", RunState::Dead).await;
    let done = report_task(&r, "a", "side", RunState::Dead).await;
    let before = done.outcome().expect("a finished");
    assert_eq!(before.0, crate::lifecycle::Outcome::Succeeded);
    arrive(&r, "b", 2, Some(10)).await;
    tokio::time::advance(Duration::from_secs(11)).await;
    let b = r
        .wait_until("b", LONG, |b| b.order().is_stop())
        .await
        .unwrap();
    assert_eq!(
        b.order(),
        &Desired::Stop(StopReason::barrier(name("train")))
    );
    settle(&r).await;
    let a = r.get("a").unwrap();
    assert!(matches!(a.tasks[1].meet(), Some(Meet::Closed { .. })));
    assert_eq!(a.order(), done.order());
    assert_eq!(a.outcome(), Some(before), "the outcome poststop was given");
}
