//! The timers at their limits: the heap holds entries only for what
//! allocations still wait for, under churn and crash loops, and a stored
//! time at the end of the calendar saturates instead of panicking the load.

use super::*;
use crate::lifecycle::{Desired, TaskStatus};

/// Main under a deadline of a week: its entry is far off for the whole test.
fn week_long_main() -> Deadlines {
    let mut d = Deadlines::default();
    d.set(CoordState::Main, Some(Duration::from_secs(7 * 24 * 3600)));
    d
}

fn task(name: &str, liveness: Option<Duration>) -> TaskSpec {
    TaskSpec {
        liveness,
        ..TaskSpec::named(TaskName::parse(name).unwrap())
    }
}

/// Allocations registered and deleted under a far deadline leave the heap
/// no entry each: it stays within a constant bound.
#[tokio::test(start_paused = true)]
async fn deleted_allocations_leave_the_timer_heap() {
    let r = timed_registry(Arc::new(MemoryStore::new()));
    let timed = AllocSpec::with_deadlines(
        vec![task("web", None)],
        week_long_main(),
        &Limits::default(),
    )
    .unwrap();
    for _ in 0..5_000 {
        r.register(id("churn"), timed.clone()).await.unwrap();
        r.delete("churn").await.unwrap();
    }
    assert_eq!(r.len(), 0);
    assert!(
        r.timer_entries() <= 1_024,
        "{} heap entries for no allocation",
        r.timer_entries()
    );
}

/// A task crash-looping under a short TTL beside a far deadline does not
/// grow the heap by an entry each time it stops running.
#[tokio::test(start_paused = true)]
async fn a_crash_looping_task_does_not_grow_the_timer_heap() {
    let r = timed_registry(Arc::new(MemoryStore::new()));
    let tasks = vec![
        task("flaky", Some(Duration::from_secs(1))),
        task("web", None),
    ];
    let s = AllocSpec::with_deadlines(tasks, week_long_main(), &Limits::default()).unwrap();
    r.register(id("a"), s).await.unwrap();
    for _ in 0..3_000 {
        r.report("a", report("flaky", RunState::Running))
            .await
            .unwrap();
        r.report("a", report("flaky", RunState::Pending))
            .await
            .unwrap();
        // Past the TTL, with every timer due by then handled: the paused
        // clock moves only once every task waits.
        tokio::time::sleep(Duration::from_millis(1_100)).await;
    }
    assert_eq!(r.get("a").unwrap().state, CoordState::Main, "main runs");
    assert!(
        r.timer_entries() <= 1_024,
        "{} heap entries for one allocation",
        r.timer_entries()
    );
}

/// A stored running task under a TTL, started at the last second the
/// calendar holds, does not panic the load: the end of its TTL saturates.
#[test]
fn a_start_at_the_end_of_time_does_not_panic_the_load() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let s = AllocSpec::new(vec![task("web", Some(TTL))], &Limits::default()).unwrap();
    let status = TaskStatus {
        state: RunState::Running,
        started_at: Some(::time::macros::datetime!(9999-12-31 23:59:59 UTC)),
        ..TaskStatus::new(1)
    };
    let now = ::time::OffsetDateTime::now_utc();
    let a = Allocation::from_parts(
        id("a"),
        Arc::new(s),
        CoordState::WaitAlloc,
        vec![status],
        Some(Desired::Run),
        1,
        1,
        now,
        now,
    );
    let store = Arc::new(Preloaded(std::sync::Mutex::new(Some(
        crate::store::Loaded {
            allocations: vec![a],
            last_index: 1,
            ..Default::default()
        },
    ))));
    let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rt.block_on(async { Registry::open(store, RegistryConfig::default()).map(|_| ()) })
    }));
    assert!(
        opened.is_ok(),
        "a record the decoder takes panicked the load"
    );
}
