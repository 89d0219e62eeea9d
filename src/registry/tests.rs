use std::{sync::Arc, time::Duration};

use super::*;
use crate::{
    lifecycle::{
        AllocSpec, CoordState, Hook, Lifecycle, RestartError, RunState, TaskName, TaskReport,
        TaskSpec,
    },
    store::{Append, Appended, Follower, MemoryStore, Op, Store, commit},
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
            depends_on: Vec::new(),
            acquire: Vec::new(),
            barrier: None,
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
        tokio::spawn(async move { r.wait_start("a1", "web", LONG, true).await })
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
        .wait_start("a1", "web", Duration::from_secs(5), true)
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
        tokio::spawn(async move { r.wait_task("x", "b", index, LONG, true).await })
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
        tokio::spawn(async move { r.wait_start("a1", "web", LONG, true).await })
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
        tokio::spawn(async move { r.wait_start("a1", "web", LONG, true).await })
    };
    parked(&r, 1).await;
    r.shutdown();
    assert!(matches!(
        waiter.await.unwrap(),
        Err(RegistryError::ShuttingDown)
    ));
    assert!(matches!(
        r.wait_start("a1", "web", LONG, true).await,
        Err(RegistryError::ShuttingDown)
    ));
    // An answer that needs no wait is still given.
    assert!(r.wait_start("a1", "init", LONG, true).await.is_ok());
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
            tokio::spawn(async move { r.wait_start("a1", "web", LONG, true).await })
        })
        .collect();
    parked(&r, 2).await;
    assert!(matches!(
        r.wait_start("a1", "web", LONG, true).await,
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
    let (page, next) = r.list("web-", None, 2, |_| true);
    let ids: Vec<_> = page.iter().map(|a| a.id.as_str()).collect();
    assert_eq!(ids, ["web-1", "web-2"]);
    let next = next.unwrap();
    assert_eq!(next.as_str(), "web-3");
    let (page, next) = r.list("web-", Some(next.as_str()), 2, |_| true);
    assert_eq!(page.len(), 1);
    assert!(next.is_none());
    let (all, _) = r.list("", None, 100, |_| true);
    assert_eq!(all.len(), 5);
}

/// A filter that keeps little among many answers after passing over
/// `MAX_SCANNED` allocations, with a next page where it stopped: no page
/// walks the whole map.
#[tokio::test]
async fn a_filtered_page_passes_over_a_bounded_number() {
    let (r, _) = registry();
    let n = super::MAX_SCANNED + 5;
    for i in 0..n {
        r.register(id(&format!("a{i:06}")), two_stage())
            .await
            .unwrap();
    }
    let wanted = |a: &Allocation| a.id.as_str() >= "a010003";
    let mut looked = 0;
    let (page, next) = r.list("", None, 100, |a| {
        looked += 1;
        wanted(a)
    });
    assert!(page.is_empty());
    assert_eq!(looked, super::MAX_SCANNED);
    let next = next.expect("a next page where it stopped");
    assert_eq!(next.as_str(), "a010000");
    let (page, next) = r.list("", Some(next.as_str()), 100, wanted);
    let ids: Vec<_> = page.iter().map(|a| a.id.as_str()).collect();
    assert_eq!(ids, ["a010003", "a010004"]);
    assert!(next.is_none());
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

/// A store whose appends wait for a permit, to stop a change mid-commit.
struct SlowStore {
    inner: Arc<MemoryStore>,
    permits: Arc<tokio::sync::Semaphore>,
    queued: std::sync::atomic::AtomicUsize,
}

impl Store for SlowStore {
    fn load(&self) -> Result<crate::store::Loaded, StoreError> {
        self.inner.load()
    }

    fn id(&self) -> &str {
        self.inner.id()
    }

    fn follow(&self, from: u64, follower: std::sync::Weak<dyn Follower>) {
        self.inner.follow(from, follower)
    }

    /// Appended once a permit comes: its index comes with the commit.
    fn append(&self, append: Append) -> Appended {
        self.queued.fetch_add(1, Ordering::SeqCst);
        let permits = self.permits.clone();
        let inner = self.inner.clone();
        let record = match &append.op {
            Op::Put(a) => Some(a.clone()),
            _ => None,
        };
        Appended {
            record,
            stamped: false,
            done: Box::pin(async move {
                permits.acquire().await.expect("open").forget();
                inner.append(append).done.await
            }),
        }
    }
}

#[tokio::test]
async fn a_client_that_goes_away_mid_commit_does_not_cancel_the_publication() {
    let store = Arc::new(SlowStore {
        inner: Arc::new(MemoryStore::new()),
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
/// another task's gate, and never reads a position taken from another
/// copy of the record.
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
                r.wait_task("x", "web", u64::MAX, Duration::ZERO, true)
                    .await
            } else {
                r.wait_start("x", "web", Duration::ZERO, true).await
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

    fn id(&self) -> &str {
        "0123456789abcdef0123456789abcdef"
    }

    fn follow(&self, _: u64, _: std::sync::Weak<dyn Follower>) {}

    fn append(&self, _: Append) -> Appended {
        unreachable!("nothing is written")
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
                ..Default::default()
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
            map.insert_handle_only(handle);
            panic!("a writer dies half-way");
        })
    };
    assert!(half.join().is_err());
    assert!(r.inner.allocs.is_poisoned());
    let (page, _) = r.list("", None, 10, |_| true);
    let ids: Vec<_> = page.iter().map(|a| a.id.to_string()).collect();
    assert_eq!(ids, ["a1"], "the creating handle is listed by nobody");
    assert!(!r.inner.allocs.is_poisoned());
    assert!(r.read_map().agrees());
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
            max_allocations: Some(3),
            max_dependencies: None,
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

mod timed {
    //! Liveness, deadlines and idempotency keys through the registry, on
    //! tokio's paused clock: time moves only when the test says.

    use super::*;
    use crate::lifecycle::{Deadlines, IdemKey, StopKind};

    mod limits;

    const TTL: Duration = Duration::from_secs(30);

    thread_local! {
        /// One clock per test (each runs on its own thread): a registry
        /// opened again reads the same time as the one before it.
        static CLOCK: std::cell::OnceCell<Clock> = const { std::cell::OnceCell::new() };
    }

    fn config() -> RegistryConfig {
        RegistryConfig {
            clock: CLOCK.with(|c| c.get_or_init(Clock::tokio).clone()),
            ..RegistryConfig::default()
        }
    }

    fn timed_registry(store: Arc<MemoryStore>) -> Registry {
        Registry::open(store, config()).unwrap()
    }

    /// `web` under a TTL, `side` a prestart sidecar without one.
    fn watched() -> AllocSpec {
        let tasks = vec![
            TaskSpec {
                lifecycle: Some(Lifecycle {
                    hook: Hook::Prestart,
                    sidecar: true,
                }),
                ..TaskSpec::named(TaskName::parse("side").unwrap())
            },
            TaskSpec {
                liveness: Some(TTL),
                ..TaskSpec::named(TaskName::parse("web").unwrap())
            },
        ];
        AllocSpec::new(tasks, &Limits::default()).unwrap()
    }

    /// Lets every task the registry started run until it parks again.
    async fn settle() {
        for _ in 0..64 {
            tokio::task::yield_now().await;
        }
    }

    async fn running(r: &Registry) {
        r.register(id("a"), watched()).await.unwrap();
        r.report("a", report("side", RunState::Running))
            .await
            .unwrap();
        r.report("a", report("web", RunState::Running))
            .await
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_task_without_a_sign_of_life_for_its_ttl_is_declared_lost_by_the_timer() {
        let r = timed_registry(Arc::new(MemoryStore::new()));
        running(&r).await;
        tokio::time::advance(TTL - Duration::from_millis(1)).await;
        settle().await;
        assert!(!r.get("a").unwrap().tasks[1].lost(), "not yet");
        tokio::time::advance(Duration::from_millis(2)).await;
        settle().await;
        let a = r.get("a").unwrap();
        assert!(a.tasks[1].lost(), "lost once its TTL passed");
        assert_eq!(a.tasks[1].state, RunState::Dead);
        let reason = a.desired(0).reason().unwrap();
        assert_eq!(
            reason.kind,
            StopKind::SiblingTaskFailed,
            "its sidecar is told to stop"
        );
        // The timeline says so, as the server's entry.
        let lost: Vec<_> = r
            .timeline(&a)
            .into_iter()
            .filter(|e| matches!(e.what, timeline::What::Lost { task: 1, .. }))
            .collect();
        assert_eq!(lost.len(), 1);
        // Its agent, back, is refused: report and heartbeat.
        let err = r
            .report("a", report("web", RunState::Running))
            .await
            .unwrap_err();
        assert!(matches!(err, RegistryError::TaskLost { .. }), "{err:?}");
        let err = r.heartbeat("a", "web").unwrap_err();
        assert!(matches!(err, RegistryError::TaskLost { .. }), "{err:?}");
        // Nothing more to look at: the heap is drained of it.
        settle().await;
        tokio::time::advance(TTL * 10).await;
        settle().await;
        assert_eq!(r.get("a").unwrap().modify_index, a.modify_index);
    }

    /// The due-time heap's driver, if it panics, is started again by the
    /// supervisor: health says `degraded` naming it, and the TTL it held
    /// still ends on time.
    #[tokio::test(start_paused = true)]
    async fn a_timer_driver_that_panics_is_started_again_and_health_names_it() {
        use axum::body::Body;
        use http_body_util::BodyExt;
        use tower::ServiceExt;

        let r = timed_registry(Arc::new(MemoryStore::new()));
        running(&r).await;
        r.inner.timers.panic_once.store(true, Ordering::SeqCst);
        // Its next turn panics: an earlier entry wakes it.
        r.inner.schedule(&r.handle("a").unwrap(), r.now());
        settle().await;
        tokio::time::advance(Duration::from_secs(1)).await;
        settle().await;
        assert!(!r.inner.timers.panic_once.load(Ordering::SeqCst), "it ran");
        let router = crate::http::app(
            r.clone(),
            crate::http::HttpConfig::default(),
            Arc::new(crate::http::auth::Auth::default()),
        );
        let health = router
            .oneshot(
                axum::http::Request::get("/v1/health")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(health.status(), 200);
        let body = health.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8(body.to_vec()).unwrap();
        assert!(
            body.contains(r#""status":"degraded""#) && body.contains(r#""timers_restarted""#),
            "{body}"
        );
        tokio::time::advance(TTL).await;
        settle().await;
        assert!(r.get("a").unwrap().tasks[1].lost(), "its TTL still ended");
    }

    #[tokio::test(start_paused = true)]
    async fn heartbeats_reports_and_parked_queries_are_signs_of_life() {
        let r = timed_registry(Arc::new(MemoryStore::new()));
        running(&r).await;
        // Heartbeats, each within the TTL, for four TTLs.
        for _ in 0..8 {
            tokio::time::advance(TTL / 2).await;
            settle().await;
            r.heartbeat("a", "web").unwrap();
        }
        assert!(!r.get("a").unwrap().tasks[1].lost());
        // A heartbeat writes nothing.
        let index = r.get("a").unwrap().modify_index;
        // A report that changes nothing is one too.
        tokio::time::advance(TTL / 2).await;
        let run = r.get("a").unwrap().tasks[1].run;
        r.report_as("a", report("web", RunState::Running), None, run)
            .await
            .unwrap();
        assert_eq!(r.get("a").unwrap().modify_index, index);
        // A parked task query counts for as long as it is parked: four
        // TTLs here.
        let waiter = {
            let r = r.clone();
            tokio::spawn(async move { r.wait_task("a", "web", index, TTL * 4, true).await })
        };
        parked(&r, 1).await;
        for _ in 0..6 {
            tokio::time::advance(TTL / 2).await;
            settle().await;
        }
        assert!(!r.get("a").unwrap().tasks[1].lost(), "alive while parked");
        // The wait times out at four TTLs.
        tokio::time::advance(TTL).await;
        waiter.await.unwrap().unwrap();
        // From the end of the wait, a full TTL.
        tokio::time::advance(TTL - Duration::from_millis(10)).await;
        settle().await;
        assert!(!r.get("a").unwrap().tasks[1].lost());
        tokio::time::advance(Duration::from_millis(20)).await;
        settle().await;
        assert!(r.get("a").unwrap().tasks[1].lost());
    }

    #[tokio::test(start_paused = true)]
    async fn a_restarted_server_gives_every_running_task_a_full_ttl() {
        let store = Arc::new(MemoryStore::new());
        {
            let r = timed_registry(store.clone());
            running(&r).await;
            // Silent for most of a TTL before the "restart".
            tokio::time::advance(TTL - Duration::from_secs(1)).await;
            settle().await;
        }
        let r = timed_registry(store);
        tokio::time::advance(TTL - Duration::from_secs(1)).await;
        settle().await;
        assert!(
            !r.get("a").unwrap().tasks[1].lost(),
            "a full TTL from the load"
        );
        tokio::time::advance(Duration::from_secs(2)).await;
        settle().await;
        assert!(r.get("a").unwrap().tasks[1].lost());
    }

    #[tokio::test(start_paused = true)]
    async fn a_default_ttl_watches_every_task_without_its_own() {
        let r = Registry::open(
            Arc::new(MemoryStore::new()),
            RegistryConfig {
                default_liveness_ttl: Some(Duration::from_secs(5)),
                ..config()
            },
        )
        .unwrap();
        r.register(id("a"), two_stage()).await.unwrap();
        r.report("a", report("init", RunState::Running))
            .await
            .unwrap();
        let a = r.get("a").unwrap();
        assert_eq!(r.ttl(&a, 0), Some(Duration::from_secs(5)));
        tokio::time::advance(Duration::from_secs(6)).await;
        settle().await;
        assert!(r.get("a").unwrap().tasks[0].lost());
    }

    #[tokio::test(start_paused = true)]
    async fn a_deadline_fires_on_time_and_one_that_passed_while_down_fires_at_load() {
        let store = Arc::new(MemoryStore::new());
        let mut deadlines = Deadlines::default();
        deadlines.set(CoordState::Prestart, Some(Duration::from_secs(60)));
        let with_deadline = |name: &str| {
            let spec = two_stage();
            AllocSpec::with_deadlines(spec.tasks().to_vec(), deadlines, &Limits::default())
                .map(|s| (id(name), s))
                .unwrap()
        };
        {
            let r = timed_registry(store.clone());
            let (i, s) = with_deadline("on-time");
            r.register(i, s).await.unwrap();
            tokio::time::advance(Duration::from_secs(59)).await;
            settle().await;
            assert!(!r.get("on-time").unwrap().order().is_stop());
            tokio::time::advance(Duration::from_secs(2)).await;
            settle().await;
            let a = r.get("on-time").unwrap();
            let reason = a.order().reason().unwrap();
            assert_eq!(
                (reason.kind, reason.stage),
                (StopKind::DeadlineExceeded, Some(CoordState::Prestart))
            );
            assert_eq!(a.deadline_at, None);
            let (i, s) = with_deadline("while-down");
            r.register(i, s).await.unwrap();
        }
        // Down for two minutes (the clock moves; no registry runs).
        tokio::time::advance(Duration::from_secs(120)).await;
        let r = timed_registry(store);
        settle().await;
        let a = r.get("while-down").unwrap();
        assert_eq!(
            a.order().reason().map(|r| r.kind),
            Some(StopKind::DeadlineExceeded),
            "fired as soon as the store was loaded"
        );
    }

    #[tokio::test]
    async fn a_retried_keyed_report_is_applied_once_even_after_a_restart() {
        let store = Arc::new(MemoryStore::new());
        let key = IdemKey { key: 7, request: 1 };
        let with_event = || {
            let mut r = report("web", RunState::Running);
            r[0].1.event = Some(crate::lifecycle::EventInput {
                kind: "Started".into(),
                time: None,
                message: String::new(),
                details: Default::default(),
            });
            r
        };
        let first = {
            let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
            r.register(id("a"), two_stage()).await.unwrap();
            let first = r.report_keyed("a", with_event(), Some(key)).await.unwrap();
            let again = r.report_keyed("a", with_event(), Some(key)).await.unwrap();
            assert_eq!(again.modify_index, first.modify_index, "applied once");
            assert_eq!(again.tasks[1].events.len(), 1, "one event");
            first
        };
        let r = Registry::open(store, RegistryConfig::default()).unwrap();
        let again = r.report_keyed("a", with_event(), Some(key)).await.unwrap();
        assert_eq!(
            again.modify_index, first.modify_index,
            "the key outlived the restart"
        );
        // The same key with another request is refused; a new key applies.
        let other = IdemKey { key: 7, request: 2 };
        let err = r
            .report_keyed("a", report("web", RunState::Dead), Some(other))
            .await
            .unwrap_err();
        assert!(matches!(err, RegistryError::KeyReused { .. }), "{err:?}");
        // A new key applies (from the agent of the run: a header-less
        // `running` would be another agent's claim).
        let run = first.tasks[1].run;
        assert!(run.is_some());
        let next = r
            .report_as("a", with_event(), Some(IdemKey { key: 8, request: 1 }), run)
            .await
            .unwrap();
        assert_eq!(next.tasks[1].events.len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn allocations_without_ttls_or_deadlines_never_enter_the_timer_heap() {
        let r = timed_registry(Arc::new(MemoryStore::new()));
        for i in 0..50 {
            let name = format!("plain-{i}");
            r.register(id(&name), two_stage()).await.unwrap();
            r.report(&name, report("init", RunState::Running))
                .await
                .unwrap();
        }
        assert_eq!(r.timer_entries(), 0);
        running(&r).await;
        assert_eq!(
            r.timer_entries(),
            1,
            "one entry for the allocation, not one per task"
        );
    }
}

mod dependencies {
    use super::*;
    use crate::lifecycle::{Condition, DepState, Dependency, Why};

    mod concurrent;

    fn depends(task: &str, alloc: &str, on: &str) -> AllocSpec {
        let t = TaskSpec {
            depends_on: vec![Dependency {
                task: TaskName::parse(on).unwrap(),
                allocation: Some(AllocId::parse(alloc).unwrap()),
                condition: Condition::Running,
            }],
            ..TaskSpec::named(TaskName::parse(task).unwrap())
        };
        AllocSpec::new(vec![t], &Limits::default()).unwrap()
    }

    /// Waits (bounded) until `check` holds of `id`'s record.
    async fn until(r: &Registry, id: &str, check: impl Fn(&Allocation) -> bool) -> Arc<Allocation> {
        for _ in 0..10_000 {
            if let Ok(a) = r.get(id)
                && check(&a)
            {
                return a;
            }
            tokio::task::yield_now().await;
        }
        panic!("{id} never got there: {:?}", r.get(id));
    }

    /// A cycle that formed anyway (here: written to the store around the
    /// registration's check, as two replicas racing would) is shown on
    /// each task on it, with its path.
    #[tokio::test]
    async fn a_cycle_that_formed_anyway_is_shown_on_each_task_with_its_path() {
        let store = Arc::new(MemoryStore::new());
        let now = ::time::OffsetDateTime::now_utc();
        for (i, (id, spec)) in [
            ("app", depends("web", "data", "db")),
            ("data", depends("db", "app", "web")),
        ]
        .into_iter()
        .enumerate()
        {
            let a = Allocation::register(
                AllocId::parse(id).unwrap(),
                Arc::new(spec),
                i as u64 + 1,
                now,
            );
            commit(&*store, Op::Put(Arc::new(a))).await.unwrap();
        }
        let r = Registry::open(store, RegistryConfig::default()).unwrap();
        let cycle = |a: &Allocation| matches!(a.tasks[0].deps().first(), Some(DepState::Cycle(_)));
        let app = until(&r, "app", cycle).await;
        let data = until(&r, "data", cycle).await;
        let DepState::Cycle(path) = &app.tasks[0].deps()[0] else {
            unreachable!()
        };
        assert_eq!(path.to_vec(), ["app/web", "data/db", "app/web"]);
        assert_eq!(data.tasks[0].deps()[0].why(), Some(Why::Cycle));
        assert!(!app.allowed(0) && !data.allowed(0));
    }

    /// Judging a dependent searches the graph for cycles once for as long
    /// as only registrations this server checked change the graph (none of
    /// them closes a cycle): a target's reports, and other dependents'
    /// registrations in between, cost no search of a dependent already
    /// searched. A record this server did not check (another replica's,
    /// here written to the store around the registry) makes the next
    /// judging search again.
    #[tokio::test]
    async fn a_dependent_is_searched_for_cycles_once_while_only_checked_registrations_change_the_graph()
     {
        let (r, store) = registry();
        r.register(id("data"), spec(&[("db", None)])).await.unwrap();
        let searches = || r.inner.judges.searches();
        let mut dependents = 0;
        for k in 0..6 {
            r.register(id(&format!("app-{k}")), depends("web", "data", "db"))
                .await
                .unwrap();
            dependents += 1;
            for state in [RunState::Running, RunState::Pending] {
                r.report("data", report("db", state)).await.unwrap();
                let why = |a: &Allocation| a.tasks[0].deps()[0].why();
                let want = (state == RunState::Pending).then_some(Why::Pending);
                until(&r, "app-0", |a| why(a) == want).await;
            }
        }
        assert_eq!(searches(), dependents, "one search per dependent");
        let now = ::time::OffsetDateTime::now_utc();
        let other =
            Allocation::register(id("app-x"), Arc::new(depends("web", "data", "db")), 1, now);
        commit(&*store, Op::Put(Arc::new(other))).await.unwrap();
        until(&r, "app-x", |_| true).await;
        r.report("data", report("db", RunState::Running))
            .await
            .unwrap();
        r.report("data", report("db", RunState::Pending))
            .await
            .unwrap();
        assert!(searches() > dependents, "searched again: {}", searches());
    }

    /// A target's change reaches its dependents' verdicts: registered,
    /// running, restarted, deleted.
    #[tokio::test]
    async fn a_target_s_changes_reach_its_dependents() {
        let (r, _) = registry();
        r.register(id("app"), depends("web", "data", "db"))
            .await
            .unwrap();
        let why = |a: &Allocation| a.tasks[0].deps()[0].why();
        assert_eq!(why(&r.get("app").unwrap()), Some(Why::NotRegistered));
        r.register(id("data"), spec(&[("db", None)])).await.unwrap();
        until(&r, "app", |a| why(a) == Some(Why::Pending)).await;
        r.report("data", report("db", RunState::Running))
            .await
            .unwrap();
        let a = until(&r, "app", |a| why(a).is_none()).await;
        assert!(a.allowed(0));
        // An all-tasks restart of the target: as good as pending.
        r.restart("data", RestartTarget::AllTasks, "again")
            .await
            .unwrap();
        until(&r, "app", |a| why(a) == Some(Why::Pending)).await;
        r.delete("data").await.unwrap();
        until(&r, "app", |a| why(a) == Some(Why::NotRegistered)).await;
    }
}

/// A disk store's start keeps every history as stored; the first report
/// after it makes every task's events, not only its own (so the record
/// is written from events alone, and views decode nothing), and the
/// record it writes reads back as the allocation; so does an order
/// (a restart of one task).
#[tokio::test]
async fn a_report_after_a_restart_makes_every_task_s_stored_events() {
    use crate::{
        lifecycle::EventInput,
        store::{DiskStore, DiskStoreConfig},
    };
    let dir = tempfile::tempdir().unwrap();
    let open = || {
        let store = DiskStore::open(DiskStoreConfig::new(dir.path().to_owned())).unwrap();
        Registry::open(Arc::new(store), RegistryConfig::default()).unwrap()
    };
    let with_event = |task: &str, state: RunState, kind: &str| {
        let mut r = report(task, state);
        r[0].1.event = Some(EventInput {
            kind: kind.to_owned(),
            time: None,
            message: String::new(),
            details: Default::default(),
        });
        r
    };
    let r = open();
    r.register(id("a1"), two_stage()).await.unwrap();
    r.report("a1", with_event("init", RunState::Running, "Started"))
        .await
        .unwrap();
    r.report("a1", with_event("init", RunState::Dead, "Terminated"))
        .await
        .unwrap();
    let before = r
        .report("a1", with_event("web", RunState::Running, "Started"))
        .await
        .unwrap();
    drop(r);
    let r = open();
    let read = r.get("a1").unwrap();
    assert!(read.tasks.iter().all(|t| t.events.is_stored()));
    assert_eq!(*read, *before);
    let run = read.tasks[1].run;
    let healthy = with_event("web", RunState::Running, "Healthy");
    let after = r.report_as("a1", healthy, None, run).await.unwrap();
    assert!(after.tasks.iter().all(|t| !t.events.is_stored()));
    assert_eq!(after.tasks[0].events, before.tasks[0].events);
    assert_eq!(after.tasks[1].events.len(), 2);
    drop(r);
    assert_eq!(*open().get("a1").unwrap(), *after);
    // An order, not a report, adding one task's event: the same.
    let r = open();
    assert!(
        r.get("a1")
            .unwrap()
            .tasks
            .iter()
            .all(|t| t.events.is_stored())
    );
    let web = TaskName::parse("web").unwrap();
    let (restarted, _) = r
        .restart("a1", RestartTarget::Task(web), "again")
        .await
        .unwrap();
    assert!(restarted.tasks.iter().all(|t| !t.events.is_stored()));
    assert_eq!(restarted.tasks[0].events, after.tasks[0].events);
    assert_eq!(restarted.tasks[1].events.len(), 3);
    drop(r);
    assert_eq!(*open().get("a1").unwrap(), *restarted);
}
