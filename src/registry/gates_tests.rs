//! Semaphores through the registry (`gates.rs`): grants, releases, the
//! order, limits, lapses and deletions, on one server and on replicas.

use std::{sync::Arc, time::Duration};

use super::{
    timeline::{Release, SlotChange},
    *,
};
use crate::{
    lifecycle::{
        AllocSpec, Hold, Hook, Lifecycle, RunState, SemName, TaskName, TaskReport, TaskSpec,
    },
    store::MemoryStore,
};

pub(super) const LONG: Duration = Duration::from_secs(60);

pub(super) fn name(s: &str) -> SemName {
    SemName::parse(s).unwrap()
}

pub(super) fn id(s: &str) -> AllocId {
    AllocId::parse(s).unwrap()
}

pub(super) fn task(n: &str, hook: Option<Hook>, sems: &[&str]) -> TaskSpec {
    TaskSpec {
        lifecycle: hook.map(|hook| Lifecycle {
            hook,
            sidecar: false,
        }),
        acquire: sems.iter().map(|s| name(s)).collect(),
        ..TaskSpec::named(TaskName::parse(n).unwrap())
    }
}

/// One prestart task `migrate` acquiring `sems`, and a main task `web`.
pub(super) fn spec(sems: &[&str]) -> AllocSpec {
    AllocSpec::new(
        vec![
            task("migrate", Some(Hook::Prestart), sems),
            task("web", None, &[]),
        ],
        &Limits::default(),
    )
    .unwrap()
}

/// `spec`, with a second prestart task `other` that acquires nothing.
pub(super) fn spec_with_other(sems: &[&str]) -> AllocSpec {
    AllocSpec::new(
        vec![
            task("migrate", Some(Hook::Prestart), sems),
            task("other", Some(Hook::Prestart), &[]),
            task("web", None, &[]),
        ],
        &Limits::default(),
    )
    .unwrap()
}

/// On tokio's clock (paused in these tests), so that a grant timeout
/// passes when the test's time does.
pub(super) fn config() -> RegistryConfig {
    RegistryConfig {
        clock: Clock::tokio(),
        ..RegistryConfig::default()
    }
}

pub(super) fn registry() -> Registry {
    Registry::open(Arc::new(MemoryStore::new()), config()).unwrap()
}

pub(super) fn rep(state: RunState) -> TaskReport {
    TaskReport {
        state,
        failed: false,
        event: None,
        ready: None,
    }
}

pub(super) async fn report_task(
    r: &Registry,
    alloc: &str,
    t: &str,
    state: RunState,
) -> Arc<Allocation> {
    r.report(alloc, vec![(TaskName::parse(t).unwrap(), rep(state))])
        .await
        .unwrap()
}

pub(super) async fn report(r: &Registry, alloc: &str, state: RunState) -> Arc<Allocation> {
    report_task(r, alloc, "migrate", state).await
}

/// Waits (bounded by `within`) until `migrate` of `alloc` is granted; its
/// fence, or `None` if it was not granted in time.
pub(super) async fn granted_within(r: &Registry, alloc: &str, within: Duration) -> Option<u64> {
    let a = r
        .wait_until(alloc, within, |a| a.tasks[0].fence().is_some())
        .await
        .unwrap();
    a.tasks[0].fence()
}

pub(super) async fn granted(r: &Registry, alloc: &str) -> u64 {
    granted_within(r, alloc, LONG)
        .await
        .unwrap_or_else(|| panic!("{alloc} was never granted"))
}

pub(super) fn holders(r: &Registry, sem: &str) -> Vec<String> {
    r.semaphore(sem)
        .unwrap()
        .holders
        .iter()
        .map(|(id, _, _)| id.to_string())
        .collect()
}

pub(super) fn queue(r: &Registry, sem: &str) -> Vec<String> {
    r.semaphore(sem)
        .unwrap()
        .queue
        .iter()
        .map(|(_, id, _)| id.to_string())
        .collect()
}

/// The slot changes on `alloc`'s timeline, oldest first, with their indexes.
pub(super) fn slots(r: &Registry, alloc: &str) -> Vec<(u64, SlotChange)> {
    let a = r.get(alloc).unwrap();
    r.timeline(&a)
        .iter()
        .filter_map(|e| match &e.what {
            timeline::What::Slot { change, .. } => Some((e.index, *change)),
            _ => None,
        })
        .collect()
}

/// Waits (bounded) until the judge has nothing left to do.
pub(super) async fn settle(r: &Registry) {
    tokio::time::timeout(LONG, r.gates_idle())
        .await
        .expect("the judge settles");
}

#[tokio::test(start_paused = true)]
async fn a_slot_goes_to_the_first_in_line_and_passes_on_when_its_holder_dies() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(60))
        .await
        .unwrap();
    for id in ["a", "b", "c"] {
        r.register(AllocId::parse(id).unwrap(), spec(&["db"]))
            .await
            .unwrap();
    }
    let fence_a = granted(&r, "a").await;
    settle(&r).await;
    assert_eq!(holders(&r, "db"), ["a"]);
    let b = r.get("b").unwrap();
    assert!(!b.allowed(0), "b waits");
    assert_eq!(
        r.waiting_on_semaphores(&b, 0),
        [(name("db"), Waiting::Queued { position: 1 })],
        "a holds (and left the queue); b is first in line, c second"
    );
    let c = r.get("c").unwrap();
    assert_eq!(
        r.waiting_on_semaphores(&c, 0),
        [(name("db"), Waiting::Queued { position: 2 })]
    );
    report(&r, "a", RunState::Running).await;
    let dead = report(&r, "a", RunState::Dead).await;
    let fence_b = granted(&r, "b").await;
    assert!(fence_b > fence_a, "fences only grow");
    assert_eq!(
        slots(&r, "a"),
        [
            (fence_a, SlotChange::Acquired),
            (dead.modify_index, SlotChange::Released(Release::Dead))
        ],
        "the timeline says when the slot came and went"
    );
    assert_eq!(
        slots(&r, "b"),
        [(fence_b, SlotChange::Acquired)],
        "at its fence"
    );
    settle(&r).await;
    assert_eq!(holders(&r, "db"), ["b"], "c still waits");
    assert!(r.get("c").unwrap().tasks[0].fence().is_none());
}

#[tokio::test(start_paused = true)]
async fn raising_the_limit_grants_at_once_and_lowering_it_revokes_nothing() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(60))
        .await
        .unwrap();
    for id in ["a", "b", "c", "d"] {
        r.register(AllocId::parse(id).unwrap(), spec(&["db"]))
            .await
            .unwrap();
    }
    granted(&r, "a").await;
    r.put_semaphore(name("db"), 3, Duration::from_secs(60))
        .await
        .unwrap();
    granted(&r, "b").await;
    granted(&r, "c").await;
    settle(&r).await;
    assert_eq!(holders(&r, "db"), ["a", "b", "c"]);
    r.put_semaphore(name("db"), 1, Duration::from_secs(60))
        .await
        .unwrap();
    report(&r, "a", RunState::Running).await;
    report(&r, "a", RunState::Dead).await;
    settle(&r).await;
    assert_eq!(holders(&r, "db"), ["b", "c"], "no new grant over the limit");
    assert!(r.get("d").unwrap().tasks[0].fence().is_none());
}

#[tokio::test(start_paused = true)]
async fn a_task_is_granted_all_of_its_semaphores_or_none_and_nobody_passes_it() {
    let r = registry();
    for s in ["x", "y"] {
        r.put_semaphore(name(s), 1, Duration::from_secs(60))
            .await
            .unwrap();
    }
    // `hold` takes y; `both` (x and y) waits for y; `x-only` comes after
    // `both` and must not pass it, though x is free.
    r.register(AllocId::parse("hold").unwrap(), spec(&["y"]))
        .await
        .unwrap();
    granted(&r, "hold").await;
    r.register(AllocId::parse("both").unwrap(), spec(&["x", "y"]))
        .await
        .unwrap();
    r.register(AllocId::parse("x-only").unwrap(), spec(&["x"]))
        .await
        .unwrap();
    settle(&r).await;
    assert!(
        holders(&r, "x").is_empty(),
        "no partial hold of x by `both`"
    );
    assert!(
        r.get("x-only").unwrap().tasks[0].fence().is_none(),
        "a later task never jumps ahead"
    );
    report(&r, "hold", RunState::Running).await;
    report(&r, "hold", RunState::Dead).await;
    granted(&r, "both").await;
    settle(&r).await;
    assert_eq!(holders(&r, "x"), ["both"]);
    assert_eq!(holders(&r, "y"), ["both"]);
}

#[tokio::test(start_paused = true)]
async fn a_grant_not_taken_up_in_time_goes_to_the_back() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(5))
        .await
        .unwrap();
    for id in ["a", "b"] {
        r.register(AllocId::parse(id).unwrap(), spec(&["db"]))
            .await
            .unwrap();
    }
    granted(&r, "a").await;
    // a never starts: after 5 s its grant lapses and b's turn comes.
    granted(&r, "b").await;
    let a = r.get("a").unwrap();
    assert_eq!(
        slots(&r, "a").last().map(|s| s.1),
        Some(SlotChange::GrantExpired)
    );
    assert!(
        matches!(a.tasks[0].hold(), Some(Hold::Queued { .. })),
        "a queues again: {:?}",
        a.tasks[0].hold()
    );
    assert_eq!(
        r.waiting_on_semaphores(&a, 0),
        [(name("db"), Waiting::Queued { position: 1 })]
    );
}

#[tokio::test(start_paused = true)]
async fn a_deleted_semaphore_blocks_its_waiters_visibly_and_revokes_nothing() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(60))
        .await
        .unwrap();
    for id in ["a", "b"] {
        r.register(AllocId::parse(id).unwrap(), spec(&["db"]))
            .await
            .unwrap();
    }
    granted(&r, "a").await;
    r.delete_semaphore(&name("db")).await.unwrap();
    assert!(r.get("a").unwrap().allowed(0), "the holder keeps its slot");
    let b = r.get("b").unwrap();
    assert_eq!(
        r.waiting_on_semaphores(&b, 0),
        [(name("db"), Waiting::NotRegistered)]
    );
    assert!(matches!(
        r.delete_semaphore(&name("db")).await,
        Err(RegistryError::SemaphoreNotFound(_))
    ));
    // Created again: the line is still there, and the holder still counts.
    r.put_semaphore(name("db"), 1, Duration::from_secs(60))
        .await
        .unwrap();
    settle(&r).await;
    assert_eq!(holders(&r, "db"), ["a"]);
    assert!(r.get("b").unwrap().tasks[0].fence().is_none());
    r.delete("a").await.unwrap();
    granted(&r, "b").await;
}

#[tokio::test(start_paused = true)]
async fn grants_survive_a_restart_and_the_line_is_rebuilt_from_the_records() {
    let store = Arc::new(MemoryStore::new());
    let r = Registry::open(store.clone(), config()).unwrap();
    r.put_semaphore(name("db"), 1, Duration::from_secs(60))
        .await
        .unwrap();
    for id in ["a", "b"] {
        r.register(AllocId::parse(id).unwrap(), spec(&["db"]))
            .await
            .unwrap();
    }
    let fence = granted(&r, "a").await;
    settle(&r).await;
    drop(r);
    let r = Registry::open(store, config()).unwrap();
    settle(&r).await;
    assert_eq!(r.get("a").unwrap().tasks[0].fence(), Some(fence));
    assert_eq!(holders(&r, "db"), ["a"]);
    assert_eq!(r.semaphore("db").unwrap().queue.len(), 1, "b still waits");
    report(&r, "a", RunState::Running).await;
    report(&r, "a", RunState::Dead).await;
    assert!(granted(&r, "b").await > fence);
}

/// A semaphore deleted while a task waits on it and another: that task
/// stops taking a place in the other's queue at once, and the task behind
/// it there is granted (without waiting for another change of the line).
#[tokio::test(start_paused = true)]
async fn deleting_a_semaphore_lets_the_waiters_behind_its_waiter_through_at_once() {
    let r = registry();
    for s in ["db", "other"] {
        r.put_semaphore(name(s), 1, Duration::from_secs(60))
            .await
            .unwrap();
    }
    r.register(AllocId::parse("h").unwrap(), spec(&["other"]))
        .await
        .unwrap();
    granted(&r, "h").await;
    // `both` heads db's queue and waits for `other`; `b` waits behind it.
    r.register(AllocId::parse("both").unwrap(), spec(&["db", "other"]))
        .await
        .unwrap();
    r.register(AllocId::parse("b").unwrap(), spec(&["db"]))
        .await
        .unwrap();
    settle(&r).await;
    assert!(
        holders(&r, "db").is_empty(),
        "b waits behind both (one order)"
    );
    r.delete_semaphore(&name("other")).await.unwrap();
    granted(&r, "b").await;
    settle(&r).await;
    assert_eq!(holders(&r, "db"), ["b"]);
}

#[tokio::test(start_paused = true)]
async fn a_shortened_grant_timeout_lapses_a_grant_already_past_it() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(60))
        .await
        .unwrap();
    for id in ["a", "b"] {
        r.register(AllocId::parse(id).unwrap(), spec(&["db"]))
            .await
            .unwrap();
    }
    granted(&r, "a").await;
    tokio::time::advance(Duration::from_secs(10)).await;
    // a has not started for 10 s, past the new 5 s: its grant lapses now,
    // not 60 s after it was made (as it would after a restart of the
    // server, which schedules it with the timeout as it is).
    r.put_semaphore(name("db"), 1, Duration::from_secs(5))
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(1), granted(&r, "b"))
        .await
        .expect("b is granted once a's grant lapsed");
    let a = r.get("a").unwrap();
    assert!(
        matches!(a.tasks[0].hold(), Some(Hold::Queued { .. })),
        "a queues again: {:?}",
        a.tasks[0].hold()
    );
}

/// A blocking query on a semaphore answers once the semaphore is deleted
/// (none waiting on it, so its line goes with it), not when its wait
/// runs out.
#[tokio::test(start_paused = true)]
async fn a_wait_on_a_semaphore_ends_when_it_is_deleted() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(60))
        .await
        .unwrap();
    settle(&r).await;
    let index = r.semaphore("db").unwrap().changed;
    let waiting = tokio::spawn({
        let r = r.clone();
        async move {
            let started = tokio::time::Instant::now();
            let answer = r.wait_semaphore("db", index, LONG).await;
            (answer.is_none(), started.elapsed())
        }
    });
    tokio::task::yield_now().await;
    r.delete_semaphore(&name("db")).await.unwrap();
    let (gone, waited) = waiting.await.unwrap();
    assert!(gone, "deleted");
    assert!(waited < LONG, "answered at once, not after {waited:?}");
}
