//! Tests that try to break the disk store's promises (the `Store` contract
//! in `store/mod.rs`, "Supervised tasks" in `docs/architecture.md`).

use std::{
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    time::Duration,
};

use super::{snapshot::NEXT_FILE, *};
use crate::{
    lifecycle::{AllocId, AllocSpec, Allocation, Limits, TaskName, TaskSpec},
    store::{AppendError, Change, Follower, Loaded, Op, Store, StoreError, commit},
    supervise::Supervisor,
};
use fs::sim::{self, SimFs};

fn put(n: u64) -> Op {
    let spec = AllocSpec::new(
        vec![TaskSpec::named(TaskName::parse("web").unwrap())],
        &Limits::default(),
    )
    .unwrap();
    let id = AllocId::parse(&format!("p{n}")).unwrap();
    Op::Put(Arc::new(Allocation::register(
        id,
        Arc::new(spec),
        n,
        time::OffsetDateTime::UNIX_EPOCH,
    )))
}

fn sim() -> (SimFs, PathBuf) {
    let fs = SimFs::new();
    let dir = PathBuf::from("/sim/data");
    fs.create_dir_all(&dir).unwrap();
    (fs, dir)
}

fn open(fs: &SimFs, dir: &std::path::Path, supervisor: &Supervisor, log_limit: u64) -> DiskStore {
    DiskStore::open(DiskStoreConfig {
        fs: Arc::new(fs.clone()),
        supervisor: supervisor.clone(),
        log_limit,
        retry: Duration::from_millis(5),
        ..DiskStoreConfig::new(dir.to_owned())
    })
    .unwrap()
}

/// Waits (bounded) for `check`, looking every few milliseconds.
async fn within(bound: Duration, check: impl Fn() -> bool) -> bool {
    let start = tokio::time::Instant::now();
    while start.elapsed() < bound {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    check()
}

/// The writer's thread panics after a batch is durable (in the follower
/// it hands the batch to: the case `DiskStore::open`'s comment names).
/// Its writers are answered `Closed`, which the contract calls "the store
/// was closed" and the HTTP layer answers 503 `shutting_down`, "the commit
/// was refused, not failed" (http/error.rs). Yet the change is durable and
/// present after the restart. A change told refused must not be there (or
/// the answer must say it may be).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p1_a_change_answered_closed_is_not_present_after_a_restart() {
    struct Panics;
    impl Follower for Panics {
        fn changed(&self, _: Vec<Change>, _: u64) {
            panic!("a test's panic in the follower");
        }
        fn resync(&self, _: Loaded) {}
    }
    let (fs, dir) = sim();
    let supervisor = Supervisor::new();
    let store = open(&fs, &dir, &supervisor, DEFAULT_LOG_LIMIT);
    let follower: Arc<dyn Follower> = Arc::new(Panics);
    store.follow(0, Arc::downgrade(&follower));
    let answer = commit(&store, put(1)).await;
    tokio::time::timeout(Duration::from_secs(30), supervisor.stopping())
        .await
        .expect("the server is told to stop");
    drop(store);
    let reopened = open(&fs, &dir, &Supervisor::new(), DEFAULT_LOG_LIMIT);
    let present = reopened.load().unwrap().allocations.len() == 1;
    let refused = matches!(answer, Err(AppendError::Store(StoreError::Closed)));
    assert!(
        !(refused && present),
        "the writer was answered {answer:?} (503 shutting_down: 'the commit was refused, not \
         failed'), and the change is in the store after the restart"
    );
}

/// The checkpoint thread panics while no change comes after the one that
/// started its checkpoint: it must be started again and health must name
/// it (`checkpoint_restarted`). The writer notices a dead checkpoint
/// thread only in `maintain`, after a commit (or while retrying a failure
/// it knows of), so an idle store says nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p7_a_checkpoint_thread_that_panics_on_an_idle_store_is_named_by_health() {
    let (fs, dir) = sim();
    let panicked = Arc::new(AtomicBool::new(false));
    let flag = panicked.clone();
    fs.fail_with(move |op, path| {
        let next = path.to_string_lossy().ends_with(NEXT_FILE);
        if op == sim::Op::Write && next && !flag.swap(true, Ordering::SeqCst) {
            panic!("a test's panic in the checkpoint thread");
        }
        None
    });
    let supervisor = Supervisor::new();
    // A log limit of one byte: the first commit starts a checkpoint.
    let store = open(&fs, &dir, &supervisor, 1);
    store.commit(put(1)).await.unwrap();
    assert!(
        within(Duration::from_secs(10), || panicked.load(Ordering::SeqCst)).await,
        "the checkpoint ran"
    );
    let named = within(Duration::from_secs(3), || {
        supervisor
            .problems()
            .contains(&"checkpoint_restarted".to_owned())
    })
    .await;
    assert!(
        named,
        "the checkpoint thread died 3 s ago; health says {:?}",
        supervisor.problems()
    );
    store.close().unwrap();
}

/// A checkpoint thread that panics every time, with changes coming: it is
/// started again each time, and the fifth panic in a row stops the
/// server; nothing acknowledged is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p7_a_checkpoint_thread_that_keeps_panicking_stops_the_server() {
    let (fs, dir) = sim();
    let panics = Arc::new(AtomicU32::new(0));
    let counted = panics.clone();
    fs.fail_with(move |op, path| {
        let next = path.to_string_lossy().ends_with(NEXT_FILE);
        if op == sim::Op::Write && next {
            counted.fetch_add(1, Ordering::SeqCst);
            panic!("a test's panic in the checkpoint thread");
        }
        None
    });
    let supervisor = Supervisor::new();
    let store = open(&fs, &dir, &supervisor, 1);
    let stopping = {
        let s = supervisor.clone();
        tokio::spawn(async move { s.stopping().await })
    };
    let mut n = 0;
    while !stopping.is_finished() {
        n += 1;
        assert!(
            n < 5000,
            "never stopped ({} panics)",
            panics.load(Ordering::SeqCst)
        );
        store.commit(put(n)).await.unwrap();
        if n % 8 == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let why = stopping.await.unwrap();
    assert!(why.contains("checkpoint thread panicked 5 times"), "{why}");
    assert!(
        supervisor
            .problems()
            .contains(&"checkpoint_restarted".to_owned())
    );
    let _ = store.close();
    drop(store);
    fs.heal();
    let reopened = open(&fs, &dir, &Supervisor::new(), DEFAULT_LOG_LIMIT);
    assert_eq!(
        reopened.load().unwrap().allocations.len() as u64,
        n,
        "every acknowledged change"
    );
}
