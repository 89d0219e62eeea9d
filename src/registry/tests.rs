use std::{sync::Arc, time::Duration};

use super::*;
use crate::store::Store;
use crate::{
    lifecycle::{CoordState, Hook, Lifecycle, RunState, TaskSpec},
    store::MemoryStore,
};
use std::sync::atomic::Ordering;

fn spec(tasks: &[(&str, Option<Hook>)]) -> AllocSpec {
    let tasks = tasks
        .iter()
        .map(|(name, hook)| TaskSpec {
            name: TaskName::parse(name).unwrap(),
            lifecycle: hook.map(|hook| Lifecycle {
                hook,
                sidecar: false,
            }),
            leader: false,
            readiness: false,
            liveness: None,
        })
        .collect();
    AllocSpec::new(tasks, &Limits::default()).unwrap()
}

fn two_stage() -> AllocSpec {
    spec(&[("init", Some(Hook::Prestart)), ("web", None)])
}

fn id(s: &str) -> AllocId {
    AllocId::parse(s).unwrap()
}

fn report(task: &str, state: RunState) -> Vec<(TaskName, TaskReport)> {
    vec![(
        TaskName::parse(task).unwrap(),
        TaskReport {
            state,
            failed: false,
            event: None,
            ready: None,
        },
    )]
}

fn registry() -> (Registry, Arc<MemoryStore>) {
    let store = Arc::new(MemoryStore::new());
    let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
    (r, store)
}

const LONG: Duration = Duration::from_secs(60);

/// Yields until `n` requests are parked; bounded, so a bug fails the test
/// instead of hanging it.
async fn parked(r: &Registry, n: usize) {
    for _ in 0..10_000 {
        if r.waiters() >= n {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("{n} waiters never parked (have {})", r.waiters());
}

#[tokio::test]
async fn register_is_idempotent_and_refuses_a_different_spec() {
    let (r, _) = registry();
    let (a, created) = r.register(id("a1"), two_stage()).await.unwrap();
    assert!(created);
    assert_eq!(a.state, CoordState::Prestart);
    let (again, created) = r.register(id("a1"), two_stage()).await.unwrap();
    assert!(!created);
    assert_eq!(
        again.modify_index, a.modify_index,
        "a retry changes nothing"
    );
    let err = r
        .register(id("a1"), spec(&[("web", None)]))
        .await
        .unwrap_err();
    assert!(matches!(err, RegistryError::AllocationExists { .. }));
}

#[tokio::test]
async fn concurrent_registrations_of_one_id_create_it_once() {
    let (r, _) = registry();
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let r = r.clone();
            tokio::spawn(async move { r.register(id("same"), two_stage()).await.unwrap().1 })
        })
        .collect();
    let mut created = 0;
    for t in tasks {
        created += usize::from(t.await.unwrap());
    }
    assert_eq!(created, 1);
    assert_eq!(r.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_parked_waiter_is_answered_by_the_change_it_waits_for() {
    let (r, _) = registry();
    r.register(id("a1"), two_stage()).await.unwrap();
    let waiter = {
        let r = r.clone();
        tokio::spawn(async move { r.wait_start("a1", "web", LONG).await })
    };
    // Let the waiter park, then check it is parked rather than answered.
    parked(&r, 1).await;
    assert!(!waiter.is_finished());
    r.report("a1", report("init", RunState::Dead))
        .await
        .unwrap();
    let (a, i) = waiter.await.unwrap().unwrap();
    assert!(a.allowed(i));
    assert_eq!(a.state, CoordState::Main);
    assert_eq!(r.waiters(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_timed_out_wait_answers_with_the_current_record() {
    let (r, _) = registry();
    r.register(id("a1"), two_stage()).await.unwrap();
    let started = tokio::time::Instant::now();
    let (a, i) = r
        .wait_start("a1", "web", Duration::from_secs(5))
        .await
        .unwrap();
    assert!(!a.allowed(i));
    assert_eq!(started.elapsed(), Duration::from_secs(5));
}

#[tokio::test(start_paused = true)]
async fn blocking_query_wakes_only_on_a_newer_index() {
    let (r, _) = registry();
    let (a, _) = r.register(id("a1"), two_stage()).await.unwrap();
    // A stale index answers at once.
    let now = r.wait_alloc("a1", a.modify_index - 1, LONG).await.unwrap();
    assert_eq!(now.modify_index, a.modify_index);
    let waiter = {
        let r = r.clone();
        let index = a.modify_index;
        tokio::spawn(async move { r.wait_alloc("a1", index, LONG).await })
    };
    parked(&r, 1).await;
    // A no-op report changes no index and wakes nobody.
    r.report("a1", report("init", RunState::Pending))
        .await
        .unwrap();
    tokio::task::yield_now().await;
    assert!(!waiter.is_finished());
    r.report("a1", report("init", RunState::Running))
        .await
        .unwrap();
    let woke = waiter.await.unwrap().unwrap();
    assert!(woke.modify_index > a.modify_index);
}

#[tokio::test(start_paused = true)]
async fn a_task_query_ignores_changes_to_other_tasks() {
    let (r, _) = registry();
    let s = spec(&[("a", None), ("b", None)]);
    let (a, _) = r.register(id("x"), s).await.unwrap();
    let waiter = {
        let r = r.clone();
        let index = a.modify_index;
        tokio::spawn(async move { r.wait_task("x", "b", index, LONG).await })
    };
    parked(&r, 1).await;
    r.report("x", report("a", RunState::Running)).await.unwrap();
    tokio::task::yield_now().await;
    assert!(!waiter.is_finished(), "a change to task a does not wake b");
    r.report("x", report("b", RunState::Running)).await.unwrap();
    let (woke, i) = waiter.await.unwrap().unwrap();
    assert_eq!(woke.tasks[i].state, RunState::Running);
}

#[tokio::test(start_paused = true)]
async fn deletion_ends_waits_with_deleted() {
    let (r, _) = registry();
    r.register(id("a1"), two_stage()).await.unwrap();
    let waiter = {
        let r = r.clone();
        tokio::spawn(async move { r.wait_start("a1", "web", LONG).await })
    };
    parked(&r, 1).await;
    r.delete("a1").await.unwrap();
    assert!(matches!(
        waiter.await.unwrap(),
        Err(RegistryError::Deleted(_))
    ));
    assert!(matches!(
        r.get("a1"),
        Err(RegistryError::AllocationNotFound(_))
    ));
}

#[tokio::test(start_paused = true)]
async fn shutdown_ends_waits_and_refuses_new_ones() {
    let (r, _) = registry();
    r.register(id("a1"), two_stage()).await.unwrap();
    let waiter = {
        let r = r.clone();
        tokio::spawn(async move { r.wait_start("a1", "web", LONG).await })
    };
    parked(&r, 1).await;
    r.shutdown();
    assert!(matches!(
        waiter.await.unwrap(),
        Err(RegistryError::ShuttingDown)
    ));
    assert!(matches!(
        r.wait_start("a1", "web", LONG).await,
        Err(RegistryError::ShuttingDown)
    ));
    // An answer that needs no wait is still given.
    assert!(r.wait_start("a1", "init", LONG).await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn the_waiter_limit_refuses_the_one_too_many_and_abandoned_waits_are_uncounted() {
    let store = Arc::new(MemoryStore::new());
    let config = RegistryConfig {
        max_waiters: 2,
        ..RegistryConfig::default()
    };
    let r = Registry::open(store, config).unwrap();
    r.register(id("a1"), two_stage()).await.unwrap();
    let waits: Vec<_> = (0..2)
        .map(|_| {
            let r = r.clone();
            tokio::spawn(async move { r.wait_start("a1", "web", LONG).await })
        })
        .collect();
    parked(&r, 2).await;
    assert!(matches!(
        r.wait_start("a1", "web", LONG).await,
        Err(RegistryError::TooManyWaiters)
    ));
    assert_eq!(r.waiters(), 2, "a refused wait is not counted");
    for p in waits {
        p.abort();
        let _ = p.await;
    }
    assert_eq!(r.waiters(), 0);
}

#[tokio::test]
async fn a_failed_commit_changes_nothing_and_the_next_write_starts_clean() {
    let (r, store) = registry();
    let (before, _) = r.register(id("a1"), two_stage()).await.unwrap();
    store.fail_commits(true);
    let err = r
        .report("a1", report("init", RunState::Dead))
        .await
        .unwrap_err();
    assert!(matches!(err, RegistryError::Store(_)));
    assert_eq!(*r.get("a1").unwrap(), *before);
    assert!(r.register(id("b"), two_stage()).await.is_err());
    assert!(
        r.get("b").is_err(),
        "a failed registration leaves no allocation"
    );
    store.fail_commits(false);
    let after = r
        .report("a1", report("init", RunState::Dead))
        .await
        .unwrap();
    assert_eq!(after.state, CoordState::Main);
    assert!(after.modify_index > before.modify_index);
}

#[tokio::test]
async fn reopening_the_store_restores_records_exactly_and_indexes_go_on() {
    let (r, store) = registry();
    r.register(id("a1"), two_stage()).await.unwrap();
    r.register(id("gone"), two_stage()).await.unwrap();
    let a = r
        .report("a1", report("init", RunState::Dead))
        .await
        .unwrap();
    r.delete("gone").await.unwrap();
    let last = r.last_index();
    assert!(last > a.modify_index, "the deletion took an index");

    let reopened = Registry::open(store, RegistryConfig::default()).unwrap();
    assert_eq!(*reopened.get("a1").unwrap(), *a);
    assert!(reopened.get("gone").is_err());
    assert_eq!(reopened.last_index(), last);
    let (b, _) = reopened.register(id("b"), two_stage()).await.unwrap();
    assert!(b.modify_index > last);
}

#[tokio::test]
async fn listing_pages_through_a_prefix_in_id_order() {
    let (r, _) = registry();
    for name in ["web-3", "db-1", "web-1", "web-2", "webby"] {
        r.register(id(name), two_stage()).await.unwrap();
    }
    let (page, next) = r.list("web-", None, 2);
    let ids: Vec<_> = page.iter().map(|a| a.id.as_str()).collect();
    assert_eq!(ids, ["web-1", "web-2"]);
    let next = next.unwrap();
    assert_eq!(next.as_str(), "web-3");
    let (page, next) = r.list("web-", Some(next.as_str()), 2);
    assert_eq!(page.len(), 1);
    assert!(next.is_none());
    let (all, _) = r.list("", None, 100);
    assert_eq!(all.len(), 5);
}

#[tokio::test]
async fn restart_errors_carry_the_current_index() {
    let (r, _) = registry();
    let (a, _) = r.register(id("a1"), two_stage()).await.unwrap();
    let err = r
        .restart(
            "a1",
            RestartTarget::Task(TaskName::parse("web").unwrap()),
            "",
        )
        .await
        .unwrap_err();
    match err {
        RegistryError::RestartRefused { error, index } => {
            assert_eq!(
                error,
                RestartError::TaskNotRunning(TaskName::parse("web").unwrap())
            );
            assert_eq!(index, a.modify_index);
        }
        other => panic!("unexpected {other:?}"),
    }
    let err = r
        .restart(
            "a1",
            RestartTarget::Task(TaskName::parse("nope").unwrap()),
            "",
        )
        .await
        .unwrap_err();
    assert!(matches!(err, RegistryError::TaskNotFound { .. }));
}

/// A store whose commits wait for a permit, to stop a change mid-commit.
struct SlowStore {
    inner: MemoryStore,
    permits: Arc<tokio::sync::Semaphore>,
    queued: std::sync::atomic::AtomicUsize,
}

impl Store for SlowStore {
    fn load(&self) -> Result<crate::store::Loaded, StoreError> {
        self.inner.load()
    }

    fn commit(&self, op: Op) -> crate::store::Commit {
        self.queued.fetch_add(1, Ordering::SeqCst);
        let permits = self.permits.clone();
        let done = self.inner.commit(op);
        Box::pin(async move {
            permits.acquire().await.expect("open").forget();
            done.await
        })
    }
}

#[tokio::test]
async fn a_client_that_goes_away_mid_commit_does_not_cancel_the_publication() {
    let store = Arc::new(SlowStore {
        inner: MemoryStore::new(),
        permits: Arc::new(tokio::sync::Semaphore::new(1)),
        queued: std::sync::atomic::AtomicUsize::new(0),
    });
    let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
    r.register(id("a1"), two_stage()).await.unwrap();
    let request = {
        let r = r.clone();
        tokio::spawn(async move { r.report("a1", report("init", RunState::Dead)).await })
    };
    for _ in 0..10_000 {
        if store.queued.load(Ordering::SeqCst) == 2 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(
        store.queued.load(Ordering::SeqCst),
        2,
        "the report reached the store"
    );
    request.abort();
    assert!(request.await.unwrap_err().is_cancelled());
    store.permits.add_permits(1);
    let mut published = false;
    for _ in 0..10_000 {
        if r.get("a1").unwrap().state == CoordState::Main {
            published = true;
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(published, "the committed change was published");
    // ... and counted: the report, and the transition it made.
    let mut counted = false;
    for _ in 0..10_000 {
        let text = r.metrics().render(Default::default());
        if text.contains("taskgate_state_reports_total 1\n")
            && text.contains("{from=\"prestart\",to=\"main\"} 1\n")
        {
            counted = true;
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(counted, "{}", r.metrics().render(Default::default()));
}

/// A long-poll resolves its task by name in the very record it reads: with
/// the allocation deleted and registered again with other tasks in
/// between, it answers about the task it was asked about (or 404), never
/// another task's gate, and never indexes past the tasks (the old code
/// took the position from one copy and read it in another: a panic after
/// ~1,400 tries).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_polls_answer_about_their_own_task_while_the_allocation_is_replaced() {
    let (r, _) = registry();
    let short = spec(&[("web", None)]);
    let long = spec(&[("a", None), ("b", None), ("c", None), ("web", None)]);
    r.register(id("x"), long.clone()).await.unwrap();
    let churn = {
        let r = r.clone();
        tokio::spawn(async move {
            for round in 0..20_000 {
                r.delete("x").await.unwrap();
                let s = if round % 2 == 0 {
                    short.clone()
                } else {
                    long.clone()
                };
                r.register(id("x"), s).await.unwrap();
            }
        })
    };
    let mut answered = 0;
    while !churn.is_finished() {
        for poll in [0, 1] {
            let got = if poll == 0 {
                r.wait_task("x", "web", u64::MAX, Duration::ZERO).await
            } else {
                r.wait_start("x", "web", Duration::ZERO).await
            };
            match got {
                Ok((a, i)) => {
                    assert_eq!(a.spec.tasks()[i].name.as_str(), "web");
                    answered += 1;
                }
                Err(RegistryError::AllocationNotFound(_) | RegistryError::Deleted(_)) => {}
                Err(e) => panic!("{e}"),
            }
        }
    }
    churn.await.unwrap();
    assert!(answered > 0);
}

/// A store that loads whatever a test gives it.
struct Preloaded(std::sync::Mutex<Option<crate::store::Loaded>>);

impl Store for Preloaded {
    fn load(&self) -> Result<crate::store::Loaded, StoreError> {
        Ok(self.0.lock().unwrap().take().unwrap_or_default())
    }

    fn commit(&self, _: Op) -> crate::store::Commit {
        Box::pin(async { Ok(()) })
    }
}

/// A loaded index past the API's range (damage, or an edit) refuses the
/// start instead of counting on and wrapping to 0.
#[test]
fn an_index_past_the_range_refuses_the_start() {
    for (last, ok) in [
        (MAX_INDEX - 5, true),
        (MAX_INDEX + 1, false),
        (u64::MAX - 1, false),
    ] {
        let store = Arc::new(Preloaded(std::sync::Mutex::new(Some(
            crate::store::Loaded {
                allocations: Vec::new(),
                last_index: last,
            },
        ))));
        match Registry::open(store, RegistryConfig::default()) {
            Ok(r) => {
                assert!(ok, "{last} was taken");
                assert_eq!(r.last_index(), last);
            }
            Err(e) => {
                assert!(!ok, "{last}: {e}");
                assert!(e.to_string().contains("past the largest index"), "{e}");
            }
        }
    }
}

/// A writer that panics between the map's two structures leaves them
/// disagreeing; the next user of the map rebuilds the ID index from the
/// handles, so listing and lookups agree again.
#[tokio::test]
async fn a_panic_while_the_map_is_written_leaves_it_whole_for_the_next_user() {
    let (r, _) = registry();
    r.register(id("a1"), two_stage()).await.unwrap();
    let half = {
        let r = r.clone();
        std::thread::spawn(move || {
            let mut map = r.write_map();
            let handle = Arc::new(handle::Handle::creating(&id("a0")));
            // Into one structure only, then a panic.
            map.by_id.insert(ByHandleId(handle));
            panic!("a writer dies half-way");
        })
    };
    assert!(half.join().is_err());
    assert!(r.inner.allocs.is_poisoned());
    let (page, _) = r.list("", None, 10);
    let ids: Vec<_> = page.iter().map(|a| a.id.to_string()).collect();
    assert_eq!(ids, ["a1"], "the creating handle is listed by nobody");
    assert!(!r.inner.allocs.is_poisoned());
    assert_eq!(r.read_map().ids.len(), r.read_map().by_id.len());
    r.register(id("a2"), two_stage()).await.unwrap();
    assert_eq!(r.len(), 3);
}

/// A token's allocation quota counts each of its allocations once, also
/// when one of its prefixes lies inside another (or is given twice).
#[tokio::test]
async fn a_quota_counts_each_allocation_once_across_overlapping_prefixes() {
    let (r, _) = registry();
    let prefixes = ["web-".to_owned(), "web-eu-".to_owned(), "web-".to_owned()];
    let quota = || {
        Some(Quota {
            name: "team",
            prefixes: &prefixes,
            max: 3,
        })
    };
    for id_ in ["web-eu-1", "web-eu-2", "web-us-1"] {
        r.register_within(id(id_), two_stage(), quota())
            .await
            .unwrap();
    }
    let err = r
        .register_within(id("web-us-2"), two_stage(), quota())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("holds 3"), "{err}");
}
