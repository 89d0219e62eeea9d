//! Audit of the semaphores (SEMANTICS "Fourth edition", "Semaphores";
//! docs/lifecycle.md "Semaphores"): each test names the promise it holds
//! the code to (each of the four found broken failed before its fix).

use std::{sync::Arc, time::Duration};

use super::{
    timeline::{Release, SlotChange},
    *,
};
use crate::{
    lifecycle::{AllocSpec, Condition, Dependency, Hold, Hook, RunState, TaskName},
    store::MemoryStore,
};

use super::gates_tests::{
    LONG, config, granted, granted_within, holders, id, name, queue, registry, report, report_task,
    settle, slots, spec, spec_with_other, task,
};

// ---------------------------------------------------------------------
// Grant timeouts

/// SEMANTICS: a slot is held until "it was granted and did not become
/// `running` within `grant_timeout`"; lifecycle.md: "within the shortest
/// `grant_timeout` of its semaphores". An operator who lowers the timeout
/// of a semaphore (1 h to 5 s) while a grant is outstanding expects the
/// stalled holder to give way within about 5 s, not an hour later.
#[tokio::test(start_paused = true)]
async fn a_lowered_grant_timeout_applies_to_an_outstanding_grant() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(3600))
        .await
        .unwrap();
    for a in ["a", "b"] {
        r.register(id(a), spec(&["db"])).await.unwrap();
    }
    granted(&r, "a").await;
    settle(&r).await;
    r.put_semaphore(name("db"), 1, Duration::from_secs(5))
        .await
        .unwrap();
    // a never starts. Within 2 minutes its grant (granted over 5 s ago)
    // must have lapsed and b be granted.
    let b = granted_within(&r, "b", Duration::from_secs(120)).await;
    assert!(
        b.is_some(),
        "b still waits 2 min after the timeout was lowered to 5 s; a holds: {:?}, \
         a's slot changes: {:?}",
        holders(&r, "db"),
        slots(&r, "a")
    );
}

/// Raising the timeout while a grant is outstanding: the old (shorter)
/// one does not fire.
#[tokio::test(start_paused = true)]
async fn a_raised_grant_timeout_keeps_an_outstanding_grant() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(5))
        .await
        .unwrap();
    for a in ["a", "b"] {
        r.register(id(a), spec(&["db"])).await.unwrap();
    }
    let fence = granted(&r, "a").await;
    r.put_semaphore(name("db"), 1, Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(
        granted_within(&r, "b", Duration::from_secs(600)).await,
        None,
        "b waits: a's grant has an hour"
    );
    assert_eq!(r.get("a").unwrap().tasks[0].fence(), Some(fence));
}

/// lifecycle.md: "the shortest `grant_timeout` of its semaphores".
#[tokio::test(start_paused = true)]
async fn the_shortest_grant_timeout_of_several_semaphores_applies() {
    let r = registry();
    r.put_semaphore(name("slow"), 1, Duration::from_secs(3600))
        .await
        .unwrap();
    r.put_semaphore(name("fast"), 1, Duration::from_secs(10))
        .await
        .unwrap();
    r.register(id("a"), spec(&["slow", "fast"])).await.unwrap();
    r.register(id("b"), spec(&["fast", "slow"])).await.unwrap();
    granted(&r, "a").await;
    assert!(
        granted_within(&r, "b", Duration::from_secs(60))
            .await
            .is_some(),
        "a's grant lapses after 10 s"
    );
    assert_eq!(
        slots(&r, "a")
            .iter()
            .filter(|s| s.1 == SlotChange::GrantExpired)
            .count(),
        2,
        "one Grant Expired per semaphore: {:?}",
        slots(&r, "a")
    );
}

/// SEMANTICS: "Deleting a semaphore ... revokes nothing". A task granted a
/// semaphore whose grant_timeout is 1 h, and not started yet, keeps its
/// grant for that hour even if the semaphore is deleted meanwhile.
#[tokio::test(start_paused = true)]
async fn deleting_a_semaphore_does_not_cut_an_outstanding_grants_timeout() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(3600))
        .await
        .unwrap();
    r.register(id("a"), spec_with_other(&["db"])).await.unwrap();
    let fence = granted(&r, "a").await;
    r.delete_semaphore(&name("db")).await.unwrap();
    // Any change of the allocation (here its other prestart task starts)
    // schedules its next look.
    report_task(&r, "a", "other", RunState::Running).await;
    let a = r
        .wait_until("a", Duration::from_secs(300), |a| {
            a.tasks[0].fence().is_none()
        })
        .await
        .unwrap();
    assert_eq!(
        a.tasks[0].fence(),
        Some(fence),
        "5 min after the deletion, well within the semaphore's 1 h grant timeout, the grant \
         was taken back (slot changes {:?}); the task now waits on {:?}",
        slots(&r, "a"),
        r.waiting_on_semaphores(&a, 0)
    );
}

/// A restart of the registry while a grant is outstanding: the lapse
/// still fires, when it was due (not earlier, not never).
#[tokio::test(start_paused = true)]
async fn a_grant_outstanding_over_a_restart_still_lapses_on_time() {
    let store = Arc::new(MemoryStore::new());
    let cfg = config();
    let r = Registry::open(store.clone(), cfg.clone()).unwrap();
    r.put_semaphore(name("db"), 1, Duration::from_secs(300))
        .await
        .unwrap();
    for a in ["a", "b"] {
        r.register(id(a), spec(&["db"])).await.unwrap();
    }
    let fence = granted(&r, "a").await;
    settle(&r).await;
    drop(r);
    tokio::time::advance(Duration::from_secs(60)).await;
    let r = Registry::open(store, cfg).unwrap();
    settle(&r).await;
    assert_eq!(
        granted_within(&r, "b", Duration::from_secs(180)).await,
        None,
        "4 min after the grant: not due yet"
    );
    assert_eq!(r.get("a").unwrap().tasks[0].fence(), Some(fence));
    let b = granted_within(&r, "b", Duration::from_secs(120)).await;
    assert!(b.is_some(), "past 5 min the grant lapsed and b's turn came");
    assert_eq!(
        slots(&r, "a"),
        [(
            r.get("a").unwrap().tasks[0]
                .hold()
                .map(|h| match h {
                    Hold::Queued { since, .. } => since,
                    Hold::Granted { fence, .. } => fence,
                })
                .unwrap(),
            SlotChange::GrantExpired
        )],
        "a fresh timeline after the restart: one Grant Expired"
    );
}

// ---------------------------------------------------------------------
// Restarts of the registry

/// lifecycle.md: "they survive a restart, and the queues are rebuilt from
/// the records": a registry that starts with a free slot and a queued
/// task grants it without any new change.
#[tokio::test(start_paused = true)]
async fn a_restart_with_a_free_slot_and_a_queued_task_grants_without_a_new_change() {
    let store = Arc::new(MemoryStore::new());
    let cfg = config();
    let r = Registry::open(store.clone(), cfg.clone()).unwrap();
    r.put_semaphore(name("db"), 1, Duration::from_secs(300))
        .await
        .unwrap();
    for a in ["a", "b"] {
        r.register(id(a), spec(&["db"])).await.unwrap();
    }
    granted(&r, "a").await;
    settle(&r).await;
    let def = r.semaphore("db").unwrap().semaphore;
    drop(r);
    // While no registry runs, the limit is raised in the store.
    let mut raised = (*def).clone();
    raised.limit = 2;
    crate::store::commit(
        store.as_ref(),
        crate::store::Op::PutSemaphore(Arc::new(raised)),
    )
    .await
    .unwrap();
    let r = Registry::open(store, cfg).unwrap();
    assert!(
        granted_within(&r, "b", Duration::from_secs(10))
            .await
            .is_some(),
        "b is granted at start"
    );
}

// ---------------------------------------------------------------------
// Releases: operator stop, TTL loss, restart, dependency, deletion

/// API "Operator stop": pending tasks are told to stop. A granted task
/// not yet started gives its slot back (`Released`, `not_allowed`), once;
/// a queued one leaves the queue; the next in line is granted.
#[tokio::test(start_paused = true)]
async fn an_operator_stop_releases_a_granted_task_and_takes_a_queued_one_out_of_line() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(3600))
        .await
        .unwrap();
    for a in ["a", "b", "c"] {
        r.register(id(a), spec(&["db"])).await.unwrap();
    }
    let fence_a = granted(&r, "a").await;
    settle(&r).await;
    assert_eq!(queue(&r, "db"), ["b", "c"]);
    // b is queued: stopped, it leaves the line.
    r.stop("b").await.unwrap();
    settle(&r).await;
    assert_eq!(queue(&r, "db"), ["c"]);
    assert!(r.get("b").unwrap().tasks[0].hold().is_none());
    assert_eq!(slots(&r, "b"), [], "b never held a slot");
    // a is granted, not started: stopped, its slot goes to c.
    let stopped = r.stop("a").await.unwrap();
    assert!(!stopped.allowed(0));
    let fence_c = granted(&r, "c").await;
    assert!(fence_c > fence_a);
    assert_eq!(
        slots(&r, "a"),
        [
            (fence_a, SlotChange::Acquired),
            (
                stopped.modify_index,
                SlotChange::Released(Release::NotAllowed)
            )
        ]
    );
    settle(&r).await;
    assert_eq!(holders(&r, "db"), ["c"]);
    assert!(queue(&r, "db").is_empty());
}

/// An operator stop of a *running* holder revokes nothing: it holds until
/// it is dead.
#[tokio::test(start_paused = true)]
async fn an_operator_stop_of_a_running_holder_keeps_the_slot_until_it_is_dead() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(3600))
        .await
        .unwrap();
    for a in ["a", "b"] {
        r.register(id(a), spec(&["db"])).await.unwrap();
    }
    granted(&r, "a").await;
    report(&r, "a", RunState::Running).await;
    r.stop("a").await.unwrap();
    settle(&r).await;
    assert_eq!(holders(&r, "db"), ["a"]);
    assert_eq!(granted_within(&r, "b", Duration::from_secs(5)).await, None);
    let dead = report(&r, "a", RunState::Dead).await;
    granted(&r, "b").await;
    assert_eq!(
        slots(&r, "a").last().copied(),
        Some((dead.modify_index, SlotChange::Released(Release::Dead)))
    );
}

/// A holder whose agent goes silent past its TTL is lost: its slot is
/// released (`lost`), once, and passes on.
#[tokio::test(start_paused = true)]
async fn a_lost_holder_gives_its_slot_back_once() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(3600))
        .await
        .unwrap();
    let with_ttl = |sems: &[&str]| {
        let mut migrate = task("migrate", Some(Hook::Prestart), sems);
        migrate.liveness = Some(Duration::from_secs(10));
        AllocSpec::new(vec![migrate, task("web", None, &[])], &Limits::default()).unwrap()
    };
    for a in ["a", "b"] {
        r.register(id(a), with_ttl(&["db"])).await.unwrap();
    }
    let fence_a = granted(&r, "a").await;
    report(&r, "a", RunState::Running).await;
    let lost = r
        .wait_until("a", LONG, |a| a.tasks[0].lost())
        .await
        .unwrap();
    assert!(lost.tasks[0].lost(), "a is lost after its TTL");
    granted(&r, "b").await;
    assert_eq!(
        slots(&r, "a"),
        [
            (fence_a, SlotChange::Acquired),
            (lost.modify_index, SlotChange::Released(Release::Lost))
        ]
    );
    settle(&r).await;
    assert_eq!(holders(&r, "db"), ["b"]);
}

/// A restart (running → pending) releases the slot (`restarted`) and the
/// task queues again *at the back*, behind tasks that queued before.
#[tokio::test(start_paused = true)]
async fn a_restarted_holder_queues_again_at_the_back() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(3600))
        .await
        .unwrap();
    for a in ["a", "b", "c"] {
        r.register(id(a), spec(&["db"])).await.unwrap();
    }
    let fence_a = granted(&r, "a").await;
    report(&r, "a", RunState::Running).await;
    r.restart(
        "a",
        RestartTarget::Task(TaskName::parse("migrate").unwrap()),
        "test",
    )
    .await
    .unwrap();
    let back = report(&r, "a", RunState::Pending).await;
    granted(&r, "b").await;
    settle(&r).await;
    assert_eq!(queue(&r, "db"), ["c", "a"], "a behind c");
    let a = r.get("a").unwrap();
    assert_eq!(
        r.waiting_on_semaphores(&a, 0),
        [(name("db"), Waiting::Queued { position: 2 })]
    );
    assert_eq!(
        slots(&r, "a"),
        [
            (fence_a, SlotChange::Acquired),
            (back.modify_index, SlotChange::Released(Release::Restarted))
        ]
    );
}

/// A dependency on another allocation that stops holding: while queued,
/// the task leaves the line (no timeline entry: it held nothing); while
/// granted and not started, it gives the slot back (`not_allowed`); when
/// the dependency holds again it queues at the back.
#[tokio::test(start_paused = true)]
async fn a_dependency_that_lapses_takes_a_task_out_of_line_and_back_in_at_the_back() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(3600))
        .await
        .unwrap();
    let dep_spec = AllocSpec::new(vec![task("svc", None, &[])], &Limits::default()).unwrap();
    r.register(id("dep"), dep_spec).await.unwrap();
    report_task(&r, "dep", "svc", RunState::Running).await;
    let dependent = |sems: &[&str]| {
        let mut migrate = task("migrate", Some(Hook::Prestart), sems);
        migrate.depends_on = vec![Dependency {
            task: TaskName::parse("svc").unwrap(),
            allocation: Some(id("dep")),
            condition: Condition::Running,
        }];
        AllocSpec::new(vec![migrate, task("web", None, &[])], &Limits::default()).unwrap()
    };
    r.register(id("a"), dependent(&["db"])).await.unwrap();
    r.register(id("b"), dependent(&["db"])).await.unwrap();
    r.register(id("c"), spec(&["db"])).await.unwrap();
    let fence_a = granted(&r, "a").await;
    settle(&r).await;
    assert_eq!(queue(&r, "db"), ["b", "c"]);
    // The dependency stops holding.
    report_task(&r, "dep", "svc", RunState::Pending).await;
    let c = granted(&r, "c").await;
    assert!(c > fence_a);
    settle(&r).await;
    assert!(queue(&r, "db").is_empty(), "b left the line");
    let a = r.get("a").unwrap();
    assert!(a.tasks[0].hold().is_none());
    let released: Vec<_> = slots(&r, "a");
    assert_eq!(released.len(), 2, "{released:?}");
    assert_eq!(released[1].1, SlotChange::Released(Release::NotAllowed));
    assert_eq!(slots(&r, "b"), []);
    // It holds again: both queue again, in the order they became allowed
    // again (the same change: by allocation ID).
    report_task(&r, "dep", "svc", RunState::Running).await;
    settle(&r).await;
    assert_eq!(queue(&r, "db"), ["a", "b"]);
}

/// An allocation deleted while holding frees the slot; while queued, it
/// leaves the line; registered again under the same ID, it queues at the
/// back and its new grant's fence is new.
#[tokio::test(start_paused = true)]
async fn a_deleted_allocation_frees_its_slot_and_its_place_and_comes_back_at_the_back() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(3600))
        .await
        .unwrap();
    for a in ["a", "b", "c"] {
        r.register(id(a), spec(&["db"])).await.unwrap();
    }
    let fence_a = granted(&r, "a").await;
    r.delete("b").await.unwrap();
    settle(&r).await;
    assert_eq!(queue(&r, "db"), ["c"]);
    r.delete("a").await.unwrap();
    let fence_c = granted(&r, "c").await;
    r.register(id("a"), spec(&["db"])).await.unwrap();
    r.register(id("b"), spec(&["db"])).await.unwrap();
    settle(&r).await;
    assert_eq!(holders(&r, "db"), ["c"]);
    assert_eq!(queue(&r, "db"), ["a", "b"]);
    report_task(&r, "c", "migrate", RunState::Running).await;
    report_task(&r, "c", "migrate", RunState::Dead).await;
    let again = granted(&r, "a").await;
    assert!(again > fence_c && fence_c > fence_a);
    assert_eq!(slots(&r, "a"), [(again, SlotChange::Acquired)]);
}

// ---------------------------------------------------------------------
// Order: FIFO and all-or-none with overlapping sets

/// Overlapping acquire sets: x, y, z of limit 1. In line: p(x,y), q(y,z),
/// s(z), t(x). y is held by `hold`. p waits for y; q waits for y (behind
/// p); s is first in z... but q is before s in z, so s waits; t is behind
/// p in x, so t waits. Nobody is granted a partial set, nobody passes.
#[tokio::test(start_paused = true)]
async fn overlapping_sets_are_granted_whole_and_in_one_order() {
    let r = registry();
    for s in ["x", "y", "z"] {
        r.put_semaphore(name(s), 1, Duration::from_secs(3600))
            .await
            .unwrap();
    }
    r.register(id("hold"), spec(&["y"])).await.unwrap();
    granted(&r, "hold").await;
    r.register(id("p"), spec(&["x", "y"])).await.unwrap();
    r.register(id("q"), spec(&["y", "z"])).await.unwrap();
    r.register(id("s"), spec(&["z"])).await.unwrap();
    r.register(id("t"), spec(&["x"])).await.unwrap();
    settle(&r).await;
    for s in ["x", "z"] {
        assert!(holders(&r, s).is_empty(), "{s}: {:?}", holders(&r, s));
    }
    let t = r.get("t").unwrap();
    assert_eq!(
        r.waiting_on_semaphores(&t, 0),
        [(name("x"), Waiting::Queued { position: 2 })]
    );
    let s = r.get("s").unwrap();
    assert_eq!(
        r.waiting_on_semaphores(&s, 0),
        [(name("z"), Waiting::Queued { position: 2 })]
    );
    // y freed: p takes x and y at once; q still waits for y (and holds no
    // z); s is behind q in z; t is behind p, which now holds x.
    report(&r, "hold", RunState::Running).await;
    report(&r, "hold", RunState::Dead).await;
    let fp = granted(&r, "p").await;
    settle(&r).await;
    assert_eq!(holders(&r, "x"), ["p"]);
    assert_eq!(holders(&r, "y"), ["p"]);
    assert!(holders(&r, "z").is_empty());
    // p done: y to q (with z), x to t. s waits for z.
    report(&r, "p", RunState::Running).await;
    report(&r, "p", RunState::Dead).await;
    let fq = granted(&r, "q").await;
    let ft = granted(&r, "t").await;
    settle(&r).await;
    assert!(fq > fp && ft > fp);
    assert_eq!(holders(&r, "z"), ["q"]);
    assert!(r.get("s").unwrap().tasks[0].fence().is_none());
    report(&r, "q", RunState::Running).await;
    report(&r, "q", RunState::Dead).await;
    granted(&r, "s").await;
}

// ---------------------------------------------------------------------
// Running without a grant

/// lifecycle.md: "A task that reports `running` without a grant (an
/// agent that did not ask) holds nothing and is in no queue".
#[tokio::test(start_paused = true)]
async fn a_task_running_without_a_grant_holds_nothing_and_leaves_the_line() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(3600))
        .await
        .unwrap();
    for a in ["a", "b", "c"] {
        r.register(id(a), spec(&["db"])).await.unwrap();
    }
    granted(&r, "a").await;
    let b = report(&r, "b", RunState::Running).await;
    assert!(b.tasks[0].hold().is_none());
    assert!(!b.allowed(0));
    settle(&r).await;
    assert_eq!(holders(&r, "db"), ["a"]);
    assert_eq!(queue(&r, "db"), ["c"]);
    report(&r, "b", RunState::Dead).await;
    assert_eq!(slots(&r, "b"), []);
    report(&r, "a", RunState::Running).await;
    report(&r, "a", RunState::Dead).await;
    granted(&r, "c").await;
}

// ---------------------------------------------------------------------
// Fences on the disk store

/// SEMANTICS: a fence "grows with every grant of that semaphore and is
/// never reused" — also across restarts of the disk store, when the last
/// changes before the restart were deletions (of the holder, of the
/// semaphore), and after checkpoints (a tiny log limit folds the log into
/// snapshots).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_on_the_disk_store_only_grow_across_restarts_and_deletions() {
    use crate::store::{DiskStore, DiskStoreConfig};
    let dir = tempfile::tempdir().unwrap();
    // The directory's lock is let go once the last task holding the
    // previous registry ends: a bounded number of tries.
    let open = async |log_limit: u64| {
        for _ in 0..500 {
            match DiskStore::open(DiskStoreConfig {
                log_limit,
                ..DiskStoreConfig::new(dir.path().to_owned())
            }) {
                Ok(store) => {
                    return Registry::open(Arc::new(store), RegistryConfig::default()).unwrap();
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
        panic!("the data directory stayed locked");
    };
    let mut seen: Vec<u64> = Vec::new();
    let mut last_index = 0;
    for round in 0..4u32 {
        let r = open(if round % 2 == 0 { 1 } else { 1 << 20 }).await;
        assert!(
            r.last_index() >= last_index,
            "round {round}: the index went back from {last_index} to {}",
            r.last_index()
        );
        r.put_semaphore(name("db"), 1, Duration::from_secs(3600))
            .await
            .unwrap();
        for a in ["a", "b"] {
            r.register(id(a), spec(&["db"])).await.unwrap();
        }
        let fa = granted(&r, "a").await;
        report(&r, "a", RunState::Running).await;
        report(&r, "a", RunState::Dead).await;
        let fb = granted(&r, "b").await;
        seen.extend([fa, fb]);
        // The last changes: deletions.
        r.delete("a").await.unwrap();
        r.delete("b").await.unwrap();
        r.delete_semaphore(&name("db")).await.unwrap();
        last_index = r.last_index();
        assert!(fb < last_index);
        drop(r);
    }
    let mut sorted = seen.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted, seen, "fences grew and were never reused: {seen:?}");
}

// ---------------------------------------------------------------------
// A head of line that can never be granted

/// SEMANTICS: "a later task never jumps ahead of an earlier one (no
/// starvation...)"; "Deleting a semaphore blocks *its* waiters visibly
/// (`why: not_registered`)". A task at the head of `db`'s line that also
/// names a semaphore that does not exist (a typo, or one deleted) can never
/// be granted; by the literal rule it stays within the first free places
/// of `db`, so every later task of `db` waits for ever, though `db` has a
/// free slot, and sees only `queued, position 2`, nothing naming the
/// missing semaphore. One tenant's typo stalls a shared semaphore for all.
/// Fixed: a task waiting on a semaphore that does not exist takes no place
/// in its other queues until it exists (then it is back in its old place).
#[tokio::test(start_paused = true)]
async fn a_head_of_line_waiting_on_a_missing_semaphore_does_not_starve_a_free_one() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(3600))
        .await
        .unwrap();
    r.register(id("typo"), spec(&["db", "dbb"])).await.unwrap();
    r.register(id("b"), spec(&["db"])).await.unwrap();
    settle(&r).await;
    let typo = r.get("typo").unwrap();
    assert_eq!(
        r.waiting_on_semaphores(&typo, 0),
        [
            (name("db"), Waiting::Queued { position: 1 }),
            (name("dbb"), Waiting::NotRegistered)
        ],
        "the task that cannot be granted says why"
    );
    let b = r.get("b").unwrap();
    let waiting = r.waiting_on_semaphores(&b, 0);
    assert!(
        granted_within(&r, "b", Duration::from_secs(3600))
            .await
            .is_some(),
        "b waits an hour for a free slot of db, shown only as {waiting:?}"
    );
}

/// A grant whose timeout passed while the registry was down lapses as
/// soon as it starts again, and the next in line is granted.
#[tokio::test(start_paused = true)]
async fn a_grant_that_lapsed_while_the_registry_was_down_lapses_at_start() {
    let store = Arc::new(MemoryStore::new());
    let cfg = config();
    let r = Registry::open(store.clone(), cfg.clone()).unwrap();
    r.put_semaphore(name("db"), 1, Duration::from_secs(300))
        .await
        .unwrap();
    for a in ["a", "b"] {
        r.register(id(a), spec(&["db"])).await.unwrap();
    }
    granted(&r, "a").await;
    settle(&r).await;
    drop(r);
    tokio::time::advance(Duration::from_secs(600)).await;
    let r = Registry::open(store, cfg).unwrap();
    assert!(
        granted_within(&r, "b", Duration::from_secs(5))
            .await
            .is_some()
    );
    assert_eq!(
        slots(&r, "a").iter().map(|s| s.1).collect::<Vec<_>>(),
        [SlotChange::GrantExpired]
    );
}

/// A lone task whose grants keep lapsing: each grant has a new, larger
/// fence, and the timeline records each Acquired and each Grant Expired
/// exactly once, in turn.
#[tokio::test(start_paused = true)]
async fn lapse_after_lapse_each_entry_is_recorded_once_with_a_new_fence() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(5))
        .await
        .unwrap();
    r.register(id("a"), spec(&["db"])).await.unwrap();
    let mut fences = vec![granted(&r, "a").await];
    for _ in 0..3 {
        let last = *fences.last().unwrap();
        let a = r
            .wait_until("a", LONG, |a| a.tasks[0].fence().is_some_and(|f| f != last))
            .await
            .unwrap();
        fences.push(a.tasks[0].fence().unwrap());
    }
    assert!(fences.windows(2).all(|w| w[0] < w[1]), "{fences:?}");
    let kinds: Vec<SlotChange> = slots(&r, "a").iter().map(|s| s.1).collect();
    let want: Vec<SlotChange> = (0..3)
        .flat_map(|_| [SlotChange::Acquired, SlotChange::GrantExpired])
        .chain([SlotChange::Acquired])
        .collect();
    assert_eq!(kinds, want);
    let acquired: Vec<u64> = slots(&r, "a")
        .iter()
        .filter(|s| s.1 == SlotChange::Acquired)
        .map(|s| s.0)
        .collect();
    assert_eq!(acquired, fences, "each Acquired at its grant's fence");
}

/// Deleted and created again: the waiters keep their order (and the
/// holder its slot, counted against the new limit).
#[tokio::test(start_paused = true)]
async fn a_semaphore_created_again_serves_its_waiters_in_their_old_order() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(3600))
        .await
        .unwrap();
    for a in ["a", "b", "c", "d"] {
        r.register(id(a), spec(&["db"])).await.unwrap();
    }
    granted(&r, "a").await;
    r.delete_semaphore(&name("db")).await.unwrap();
    r.register(id("e"), spec(&["db"])).await.unwrap();
    r.put_semaphore(name("db"), 3, Duration::from_secs(3600))
        .await
        .unwrap();
    granted(&r, "b").await;
    granted(&r, "c").await;
    settle(&r).await;
    assert_eq!(holders(&r, "db"), ["a", "b", "c"]);
    assert_eq!(queue(&r, "db"), ["d", "e"]);
}

/// API "Operator stop": poststop tasks still run after the stop ("they are
/// the cleanup the operator wants"): one that acquires a semaphore queues
/// and is granted like any other, though its allocation is stopped.
#[tokio::test(start_paused = true)]
async fn a_poststop_task_of_a_stopped_allocation_still_queues_and_is_granted() {
    let r = registry();
    r.put_semaphore(name("db"), 1, Duration::from_secs(3600))
        .await
        .unwrap();
    let cleanup = AllocSpec::new(
        vec![
            task("web", None, &[]),
            task("cleanup", Some(Hook::Poststop), &["db"]),
        ],
        &Limits::default(),
    )
    .unwrap();
    r.register(id("holder"), spec(&["db"])).await.unwrap();
    granted(&r, "holder").await;
    r.register(id("a"), cleanup).await.unwrap();
    report_task(&r, "a", "web", RunState::Running).await;
    r.stop("a").await.unwrap();
    report_task(&r, "a", "web", RunState::Dead).await;
    settle(&r).await;
    assert_eq!(queue(&r, "db"), ["a"], "cleanup waits for the slot");
    report(&r, "holder", RunState::Running).await;
    report(&r, "holder", RunState::Dead).await;
    let a = r
        .wait_until("a", LONG, |a| a.tasks[1].fence().is_some())
        .await
        .unwrap();
    assert!(a.allowed(1), "cleanup may run");
}
