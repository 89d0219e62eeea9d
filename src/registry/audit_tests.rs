//! Tests that try to break the promises of `docs/architecture.md` ("The
//! write path", "Supervised tasks"), `store/mod.rs` (the `Store` contract)
//! and `write.rs`: what a fault, a client that goes away, or a racing
//! writer would break.
//!
//! Most tests run against `Gate`, a store that stamps its appends at once
//! (as the disk store does) and commits them only when the test says, so
//! every interleaving is chosen by the test, not by timing.

use std::{
    collections::{BTreeMap, VecDeque},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use tokio::sync::{Semaphore, oneshot};

use super::*;
use crate::{
    lifecycle::{
        AllocSpec, Condition, Dependency, IdemKey, Limits, RunState, TaskName, TaskReport, TaskSpec,
    },
    store::{
        Admitted, Append, AppendError, Appended, Change, DiskStore, DiskStoreConfig, Follower,
        Loaded, Op, Store, StoreError, StoreHealth,
        fs::{Fs, sim},
    },
};

// ---------------------------------------------------------------------
// The gated store.
// ---------------------------------------------------------------------

type Ack = oneshot::Sender<Result<u64, AppendError>>;

/// Appends are stamped with the next index at once and wait, in index
/// order, until the test commits them (or `auto` is set: then each append
/// commits at once, as the memory store does). A committed change is
/// handed to the follower before its writer is told. With `fail_stop`
/// (the disk store's contract) a failed commit closes the store: later
/// appends fail and admission is refused. Without it (etcd: a refused
/// transaction does not close anything), later appends go on.
struct Gate {
    state: Mutex<GateState>,
    auto: AtomicBool,
    fail_stop: bool,
    /// Admission places (as the disk store's commit queue).
    places: Arc<Semaphore>,
    capacity: usize,
}

#[derive(Default)]
struct GateState {
    queue: VecDeque<(Change, u64, Ack)>,
    last: u64,
    /// Committed records by ID, and the last index committed.
    durable: BTreeMap<AllocId, Arc<Allocation>>,
    durable_last: u64,
    /// Every index handed to the follower, in the order handed.
    delivered: Vec<u64>,
    failed: bool,
    follower: Option<Weak<dyn Follower>>,
}

const PLACES: usize = 1024;

impl Gate {
    fn new() -> Arc<Self> {
        Self::with(true)
    }

    fn with(fail_stop: bool) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::default(),
            auto: AtomicBool::new(true),
            fail_stop,
            places: Arc::new(Semaphore::new(PLACES)),
            capacity: PLACES,
        })
    }

    /// A store holding what this one made durable: a restart.
    fn restarted(&self) -> Arc<Self> {
        let s = self.state.lock().unwrap();
        let g = Self::with(self.fail_stop);
        {
            let mut n = g.state.lock().unwrap();
            n.durable = s.durable.clone();
            n.durable_last = s.durable_last;
            n.last = s.durable_last;
        }
        g
    }

    fn auto(&self, on: bool) {
        self.auto.store(on, Ordering::SeqCst);
        if on {
            self.commit_all(true);
        }
    }

    fn queued(&self) -> usize {
        self.state.lock().unwrap().queue.len()
    }

    fn free_places(&self) -> usize {
        self.places.available_permits()
    }

    fn durable(&self, id: &str) -> Option<Arc<Allocation>> {
        self.state
            .lock()
            .unwrap()
            .durable
            .get(&AllocId::parse(id).unwrap())
            .cloned()
    }

    fn durable_last(&self) -> u64 {
        self.state.lock().unwrap().durable_last
    }

    fn delivered(&self) -> Vec<u64> {
        self.state.lock().unwrap().delivered.clone()
    }

    fn commit_all(&self, ok: bool) {
        self.commit(usize::MAX, ok);
    }

    /// Commits the oldest `n` queued appends as one group: durable and
    /// handed to the follower, or all failed.
    fn commit(&self, n: usize, ok: bool) {
        let held = self.commit_holding(n, ok, &[]);
        assert!(held.is_empty());
    }

    /// `commit`, telling the writers of the indexes in `hold` only when
    /// the test releases them (`release`): a store tells the writers of a
    /// group in any order, at any time after the follower was handed it.
    fn commit_holding(&self, n: usize, ok: bool, hold: &[u64]) -> Vec<Told> {
        let mut s = self.state.lock().unwrap();
        let n = n.min(s.queue.len());
        let group: Vec<_> = s.queue.drain(..n).collect();
        if group.is_empty() {
            return Vec::new();
        }
        let ok = ok && !(self.fail_stop && s.failed);
        if !ok {
            s.failed = true;
        }
        let mut changes = Vec::new();
        let mut told = Vec::new();
        let mut last = 0;
        for (change, index, ack) in group {
            if ok {
                match &change {
                    Change::Put(a) => {
                        s.durable.insert(a.id.clone(), a.clone());
                    }
                    Change::Delete { id, .. } => {
                        s.durable.remove(id);
                    }
                    Change::Liveness(_)
                    | Change::PutSemaphore(_)
                    | Change::DeleteSemaphore { .. } => {}
                }
                s.durable_last = index;
                s.delivered.push(index);
                last = index;
                changes.push(change);
                told.push((ack, Ok(index)));
            } else {
                let e = StoreError::Io("the test failed this commit".into());
                told.push((ack, Err::<u64, _>(AppendError::Store(e))));
            }
        }
        let follower = s.follower.clone();
        drop(s);
        if let (true, Some(f)) = (ok, follower.and_then(|f| f.upgrade())) {
            f.changed(changes, last);
        }
        let mut held = Vec::new();
        for (ack, result) in told {
            if result.as_ref().is_ok_and(|i| hold.contains(i)) {
                held.push((ack, result));
            } else {
                let _ = ack.send(result);
            }
        }
        held
    }

    fn release(held: Vec<Told>) {
        for (ack, result) in held {
            let _ = ack.send(result);
        }
    }
}

/// A writer's answer a test holds back.
type Told = (Ack, Result<u64, AppendError>);

impl Store for Gate {
    fn load(&self) -> Result<Loaded, StoreError> {
        let s = self.state.lock().unwrap();
        Ok(Loaded {
            allocations: s.durable.values().map(|a| (**a).clone()).collect(),
            last_index: s.durable_last,
            ..Default::default()
        })
    }

    fn id(&self) -> &str {
        "gate"
    }

    fn follow(&self, from: u64, follower: Weak<dyn Follower>) {
        let mut s = self.state.lock().unwrap();
        s.last = s.last.max(from);
        s.follower = Some(follower);
    }

    fn admit(&self) -> Result<Admitted, StoreError> {
        if self.fail_stop && self.state.lock().unwrap().failed {
            return Err(StoreError::Io("a commit failed before".into()));
        }
        match self.places.clone().try_acquire_owned() {
            Ok(p) => Ok(Admitted::of(p)),
            Err(_) => Err(StoreError::Unavailable("full".into())),
        }
    }

    fn append(&self, append: Append) -> Appended {
        let (ack, wait) = oneshot::channel();
        let mut s = self.state.lock().unwrap();
        let index = s.last + 1;
        let (change, record) = match append.op {
            Op::Put(mut a) => {
                let placeholder = a.modify_index;
                Arc::make_mut(&mut a).restamp(placeholder, index);
                (Change::Put(a.clone()), Some(a))
            }
            Op::Delete(id) => (Change::Delete { id, index }, None),
            Op::PutSemaphore(mut sem) => {
                let placeholder = sem.modify_index;
                Arc::make_mut(&mut sem).restamp(placeholder, index);
                (Change::PutSemaphore(sem), None)
            }
            Op::DeleteSemaphore(name) => (Change::DeleteSemaphore { name, index }, None),
        };
        if self.fail_stop && s.failed {
            let _ = ack.send(Err(AppendError::Store(StoreError::Closed)));
        } else {
            s.last = index;
            s.queue.push_back((change, index, ack));
        }
        drop(s);
        if self.auto.load(Ordering::SeqCst) {
            self.commit_all(true);
        }
        Appended {
            record,
            stamped: true,
            done: Box::pin(async move { wait.await.unwrap_or(Err(StoreError::Closed.into())) }),
        }
    }
}

// ---------------------------------------------------------------------
// Helpers.
// ---------------------------------------------------------------------

fn id(s: &str) -> AllocId {
    AllocId::parse(s).unwrap()
}

fn name(s: &str) -> TaskName {
    TaskName::parse(s).unwrap()
}

fn one_task(task: &str) -> AllocSpec {
    AllocSpec::new(vec![TaskSpec::named(name(task))], &Limits::default()).unwrap()
}

/// One task `web` watched under `ttl`.
fn watched(ttl: Duration) -> AllocSpec {
    let t = TaskSpec {
        liveness: Some(ttl),
        ..TaskSpec::named(name("web"))
    };
    AllocSpec::new(vec![t], &Limits::default()).unwrap()
}

/// Task `task` of the new allocation depends on `alloc`/`on` running.
fn depends(task: &str, alloc: &str, on: &str) -> AllocSpec {
    let t = TaskSpec {
        depends_on: vec![Dependency {
            task: name(on),
            allocation: Some(id(alloc)),
            condition: Condition::Running,
        }],
        ..TaskSpec::named(name(task))
    };
    AllocSpec::new(vec![t], &Limits::default()).unwrap()
}

fn report(task: &str, state: RunState) -> Vec<(TaskName, TaskReport)> {
    vec![(
        name(task),
        TaskReport {
            state,
            failed: false,
            ready: None,
            event: None,
        },
    )]
}

/// A report that always changes the record: it carries an event.
fn noted(task: &str, state: RunState, message: &str) -> Vec<(TaskName, TaskReport)> {
    let mut r = report(task, state);
    r[0].1.event = Some(crate::lifecycle::EventInput {
        kind: "Note".into(),
        time: None,
        message: message.into(),
        details: Default::default(),
    });
    r
}

fn config() -> RegistryConfig {
    RegistryConfig {
        clock: Clock::tokio(),
        ..RegistryConfig::default()
    }
}

fn open(store: Arc<dyn Store>) -> Registry {
    Registry::open(store, config()).unwrap()
}

/// Lets every ready task run until it parks again.
async fn settle() {
    for _ in 0..64 {
        tokio::task::yield_now().await;
    }
}

/// Yields until `check` holds (bounded: a bug fails instead of hanging).
async fn until(what: &str, check: impl Fn() -> bool) {
    for _ in 0..20_000 {
        if check() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("never happened: {what}");
}

/// Whether the allocation's write path is free: no pending version, the
/// write lock free.
fn unwedged(r: &Registry, alloc: &str) -> Result<(), String> {
    let h = r.handle(alloc).map_err(|e| e.to_string())?;
    if h.pending().is_some() {
        return Err(format!("{alloc}: a pending version was never cleared"));
    }
    match h.try_lock_write() {
        Some(g) => drop(g),
        None => return Err(format!("{alloc}: the write lock was never given back")),
    }
    Ok(())
}

fn sim_store(fs: &sim::SimFs, dir: &Path, supervisor: &crate::supervise::Supervisor) -> DiskStore {
    sim_store_batched(fs, dir, supervisor, 4096)
}

fn sim_store_batched(
    fs: &sim::SimFs,
    dir: &Path,
    supervisor: &crate::supervise::Supervisor,
    max_batch: usize,
) -> DiskStore {
    DiskStore::open(DiskStoreConfig {
        fs: Arc::new(fs.clone()),
        supervisor: supervisor.clone(),
        max_batch,
        ..DiskStoreConfig::new(dir.to_owned())
    })
    .unwrap()
}

fn sim_dir(fs: &sim::SimFs) -> PathBuf {
    let dir = PathBuf::from("/sim/data");
    fs.create_dir_all(&dir).unwrap();
    dir
}

fn is_log(path: &Path) -> bool {
    path.to_string_lossy().contains("taskgate.wal.")
}

// ---------------------------------------------------------------------
// Promise 1: no client ever sees a state a crash could take back.
// ---------------------------------------------------------------------

/// A report whose `Idempotency-Key` was used by another report that is
/// appended but not yet durable: refusing it (`KeyReused`) tells the
/// client about a change the store may never hold. Here that change then
/// fails to commit: the refusal was about nothing.
#[tokio::test]
async fn p1_a_key_reused_refusal_is_never_decided_on_a_change_that_then_fails() {
    let gate = Gate::new();
    let r = open(gate.clone());
    r.register(id("a"), one_task("web")).await.unwrap();
    gate.auto(false);

    let key = |request| Some(IdemKey { key: 7, request });
    let first = {
        let r = r.clone();
        tokio::spawn(async move {
            r.report_keyed("a", report("web", RunState::Running), key(1))
                .await
        })
    };
    settle().await;
    assert_eq!(
        gate.queued(),
        1,
        "the first report is appended, not durable"
    );
    let second = {
        let r = r.clone();
        tokio::spawn(async move {
            r.report_keyed("a", report("web", RunState::Pending), key(2))
                .await
        })
    };
    settle().await;
    let answered_early = second.is_finished();
    // The first report's commit fails: the key was never used.
    gate.commit(1, false);
    assert!(first.await.unwrap().is_err());
    let answer = second.await.unwrap();
    assert!(
        gate.durable("a").unwrap().modify_index == 1,
        "the store holds only the registration"
    );
    assert!(
        !matches!(answer, Err(RegistryError::KeyReused { .. })),
        "the second report was refused for reusing a key whose only use never committed \
         (answered before that commit was decided: {answered_early}): {answer:?}"
    );
}

/// The same with time: the timer declares a task lost (appended, not yet
/// durable), the task's agent reports, and is told `TaskLost` ("stop its
/// process") about a change that then fails to commit. After a restart
/// the task is not lost: the agent was told something the store never
/// held.
#[tokio::test(start_paused = true)]
async fn p1_an_agent_is_never_told_lost_by_a_change_that_then_fails() {
    const TTL: Duration = Duration::from_secs(30);
    let gate = Gate::new();
    let r = open(gate.clone());
    r.register(id("a"), watched(TTL)).await.unwrap();
    r.report("a", report("web", RunState::Running))
        .await
        .unwrap();
    gate.auto(false);
    tokio::time::advance(TTL + Duration::from_secs(1)).await;
    settle().await;
    assert_eq!(
        gate.queued(),
        1,
        "the timer appended the loss, not durable yet"
    );

    let agent = {
        let r = r.clone();
        tokio::spawn(async move { r.report("a", report("web", RunState::Running)).await })
    };
    settle().await;
    let answered_early = agent.is_finished();
    gate.commit(1, false);
    let answer = agent.await.unwrap();

    let restarted = open(gate.restarted());
    let lost_after_restart = restarted.get("a").unwrap().tasks[0].lost();
    assert!(!lost_after_restart, "the store never held the loss");
    assert!(
        !matches!(answer, Err(RegistryError::TaskLost { .. })),
        "the agent was told its task was lost (answered before the loss was durable: \
         {answered_early}), yet the store never held that: {answer:?}"
    );
}

// ---------------------------------------------------------------------
// Promise 2: the follower and the event stream.
// ---------------------------------------------------------------------

/// Many writers at once on a disk store (registrations, reports,
/// deletions, re-registrations over a few IDs): the stream hands every
/// index exactly once, in order, with no gap, and after a restart a
/// reader at the old frontier gets the next change, never one it has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2_the_stream_tells_every_index_once_in_order_through_concurrent_writes_and_a_restart() {
    let fs = sim::SimFs::new();
    let dir = sim_dir(&fs);
    let sup = crate::supervise::Supervisor::new();
    let r = open(Arc::new(sim_store(&fs, &dir, &sup)));
    let mut sub = r.subscribe(0, String::new()).unwrap();

    let mut writers = tokio::task::JoinSet::new();
    for w in 0..16u64 {
        let r = r.clone();
        writers.spawn(async move {
            for n in 0..20u64 {
                let alloc = format!("x{}", (w + n) % 5);
                let _ = match (w + n) % 4 {
                    0 => r.register(id(&alloc), one_task("web")).await.map(|_| ()),
                    1 | 2 => r
                        .report(&alloc, report("web", RunState::Running))
                        .await
                        .map(|_| ()),
                    _ => r.delete(&alloc).await.map(|_| ()),
                };
            }
        });
    }
    while let Some(w) = writers.join_next().await {
        w.unwrap();
    }
    let last = r.last_index();
    assert!(last > 20, "writes happened: {last}");
    let mut told = Vec::new();
    while sub.index() < last {
        let next = tokio::time::timeout(Duration::from_secs(10), sub.next(1000))
            .await
            .expect("the stream reaches the view's index")
            .unwrap();
        match next {
            feed::Next::Changes(events) => told.extend(events.iter().map(|e| e.index)),
            feed::Next::Resync(i) => panic!("resync at {i} after {told:?}"),
        }
    }
    let expected: Vec<u64> = (1..=last).collect();
    assert_eq!(told, expected, "every index once, in order");
    let frontier = r.stream_index();
    r.inner.store.close().unwrap();
    drop((sub, r));

    let r = open(Arc::new(sim_store(&fs, &dir, &sup)));
    assert_eq!(
        r.last_index(),
        frontier,
        "a restart goes on from the frontier"
    );
    let mut sub = r.subscribe(frontier, String::new()).unwrap();
    r.register(id("after"), one_task("web")).await.unwrap();
    match sub.next(10).await.unwrap() {
        feed::Next::Changes(events) => {
            assert_eq!(events[0].index, frontier + 1);
            assert_eq!(events[0].alloc_id.as_str(), "after");
        }
        feed::Next::Resync(i) => panic!("resync at {i}"),
    }
}

/// Pipelined writers on the gated store, commits in groups of varying
/// size: the follower is handed each index once, in order, and the stream
/// tells exactly those.
#[tokio::test]
async fn p2_the_follower_is_handed_each_committed_index_once_in_order_with_group_commits() {
    let gate = Gate::new();
    let r = open(gate.clone());
    for a in ["a", "b", "c"] {
        r.register(id(a), one_task("web")).await.unwrap();
    }
    gate.auto(false);
    let mut sub = r.subscribe(0, String::new()).unwrap();
    let mut writers = Vec::new();
    for n in 0..60usize {
        let r = r.clone();
        let alloc = ["a", "b", "c"][n % 3];
        let state = if n % 2 == 0 {
            RunState::Running
        } else {
            RunState::Pending
        };
        writers.push(tokio::spawn(async move {
            r.report(alloc, report("web", state)).await
        }));
        if n % 7 == 0 {
            settle().await;
            gate.commit(n % 5 + 1, true);
        }
    }
    while writers.iter().any(|w| !w.is_finished()) {
        settle().await;
        gate.commit(3, true);
    }
    for w in writers {
        w.await.unwrap().unwrap();
    }
    let delivered = gate.delivered();
    let expected: Vec<u64> = (1..=gate.durable_last()).collect();
    assert_eq!(delivered, expected);
    let mut told = Vec::new();
    while let Ok(Ok(next)) = tokio::time::timeout(Duration::ZERO, sub.next(1000)).await {
        match next {
            feed::Next::Changes(events) => told.extend(events.iter().map(|e| e.index)),
            feed::Next::Resync(i) => panic!("resync at {i}"),
        }
    }
    assert_eq!(told, expected);
}

// ---------------------------------------------------------------------
// Promise 3: a client that goes away.
// ---------------------------------------------------------------------

/// Clients that go away at each point of a write (waiting for the lock,
/// appended and waiting for the commit, parked on a pending version with
/// a no-op decision, a registration mid-commit, a deletion mid-commit):
/// every change appended is published, and nothing is left wedged.
#[tokio::test]
async fn p3_clients_that_go_away_mid_write_leave_nothing_wedged_and_lose_no_publication() {
    let gate = Gate::new();
    let r = open(gate.clone());
    r.register(id("a"), one_task("web")).await.unwrap();
    gate.auto(false);

    // 1. Appended, waiting for its commit: dropped.
    let w = {
        let r = r.clone();
        tokio::spawn(async move { r.report("a", report("web", RunState::Running)).await })
    };
    settle().await;
    assert_eq!(gate.queued(), 1);
    w.abort();
    settle().await;
    // 2. A no-op write on the pending version: parked in `holds`, dropped.
    let noop = {
        let r = r.clone();
        tokio::spawn(async move { r.report("a", report("web", RunState::Running)).await })
    };
    settle().await;
    assert_eq!(
        gate.queued(),
        1,
        "decided on the pending version: no change"
    );
    noop.abort();
    // 3. A deletion appended (holding the lock until published) and a
    // writer waiting for that lock: both dropped.
    let del = {
        let r = r.clone();
        tokio::spawn(async move { r.delete("a").await })
    };
    settle().await;
    assert_eq!(gate.queued(), 2);
    let waiting = {
        let r = r.clone();
        tokio::spawn(async move { r.report("a", report("web", RunState::Pending)).await })
    };
    settle().await;
    del.abort();
    waiting.abort();
    settle().await;
    gate.commit_all(true);
    settle().await;
    assert!(r.get("a").is_err(), "the deletion was published");
    assert!(gate.durable("a").is_none());
    // 4. A registration mid-commit: dropped; it is published all the same.
    let reg = {
        let r = r.clone();
        tokio::spawn(async move { r.register(id("a"), one_task("web")).await })
    };
    settle().await;
    assert_eq!(gate.queued(), 1);
    reg.abort();
    settle().await;
    gate.commit_all(true);
    settle().await;
    let a = r.get("a").expect("the registration was published");
    assert_eq!(Some(&a), gate.durable("a").as_ref());
    unwedged(&r, "a").unwrap();
    assert_eq!(
        gate.free_places(),
        gate.capacity,
        "every admission place returned"
    );
    assert_eq!(r.len(), 1);
    // And the allocation takes writes again.
    gate.auto(true);
    r.report("a", report("web", RunState::Running))
        .await
        .unwrap();
    unwedged(&r, "a").unwrap();
}

/// A registration whose client goes away while its commit is in flight,
/// on a store that refuses a transaction without closing (etcd): the
/// commit fails, and the `Creating` handle the registration inserted
/// must go (it is removed only by the client's own future,
/// `register_once` → `forget_creating`). Left behind, it counts against
/// `--max-allocations` and every token's quota forever.
#[tokio::test]
async fn p3_a_registration_whose_client_left_and_whose_commit_failed_leaves_no_phantom() {
    let gate = Gate::with(false);
    let r = Registry::open(
        gate.clone(),
        RegistryConfig {
            max_allocations: 1,
            ..config()
        },
    )
    .unwrap();
    gate.auto(false);
    let reg = {
        let r = r.clone();
        tokio::spawn(async move { r.register(id("ghost"), one_task("web")).await })
    };
    settle().await;
    assert_eq!(gate.queued(), 1);
    reg.abort();
    settle().await;
    gate.commit(1, false);
    settle().await;
    gate.auto(true);
    assert!(r.get("ghost").is_err(), "never registered");
    assert_eq!(r.len(), 0, "no allocation exists, yet the map counts one");
    r.register(id("real"), one_task("web"))
        .await
        .expect("the server holds no allocation: one fits under a limit of 1");
}

// ---------------------------------------------------------------------
// Promise 4: pipelined writers and a failed commit (fail-stop).
// ---------------------------------------------------------------------

/// 40 writers on one allocation (and 10 on another) at once on the disk
/// store (batches of at most 8), whose log write fails after two
/// commits: every writer told yes is durable; every writer decided on
/// the failed change fails; the view never passes the last durable index;
/// the store refuses admission and health says `write_failed`; after a
/// power loss the store holds exactly what was acknowledged, nothing after
/// the failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p4_pipelined_writers_and_a_failed_disk_write_fail_stop() {
    let fs = sim::SimFs::new();
    let dir = sim_dir(&fs);
    let sup = crate::supervise::Supervisor::new();
    let r = open(Arc::new(sim_store_batched(&fs, &dir, &sup, 8)));
    r.register(id("a"), one_task("web")).await.unwrap();
    r.register(id("b"), one_task("web")).await.unwrap();
    let syncs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = syncs.clone();
    // The first commit's sync waits until the test lets it go (so the
    // other changes queue up behind it); two commits go through; then
    // every write to the log fails (a failed batch leaves nothing in the
    // file: what survives is exactly what was synced).
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let wait = Mutex::new(wait);
    fs.fail_with(move |op, path| {
        if !is_log(path) {
            return None;
        }
        match op {
            sim::Op::SyncData => {
                if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                    let _ = wait.lock().unwrap().recv_timeout(Duration::from_secs(30));
                }
                None
            }
            sim::Op::Write if counted.load(Ordering::SeqCst) >= 2 => {
                Some(std::io::Error::from_raw_os_error(28))
            }
            _ => None,
        }
    });
    let mut writers = tokio::task::JoinSet::new();
    for n in 0..50usize {
        let r = r.clone();
        let alloc = if n % 5 == 4 { "b" } else { "a" };
        // Pending, with a note each: a change every time (a second
        // header-less `running` would be `task_claimed`).
        let state = RunState::Pending;
        writers.spawn(async move {
            (
                alloc,
                r.report(alloc, noted("web", state, &n.to_string())).await,
            )
        });
    }
    // All 50 appended (pipelined: each decided on the one before).
    let appended = || {
        ["a", "b"]
            .iter()
            .filter_map(|a| r.handle(a).ok()?.pending())
            .map(|p| p.record.modify_index)
            .max()
            == Some(52)
    };
    // Bounded by time, not by turns: on a loaded machine the writers'
    // threads may get few turns in 10,000 yields (it failed so).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !appended() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(appended(), "every writer appended");
    go.send(()).unwrap();
    let mut ok: BTreeMap<&str, Vec<Arc<Allocation>>> = BTreeMap::new();
    let mut failed = 0;
    while let Some(w) = writers.join_next().await {
        match w.unwrap() {
            (alloc, Ok(a)) => ok.entry(alloc).or_default().push(a),
            (_, Err(RegistryError::Store(StoreError::Io(_)))) => failed += 1,
            (_, Err(e)) => panic!("an unexpected answer: {e:?}"),
        }
    }
    let acknowledged: usize = ok.values().map(Vec::len).sum();
    assert!(
        acknowledged > 0 && failed > 0,
        "{acknowledged} acknowledged, {failed} failed"
    );
    assert_eq!(acknowledged + failed, 50);
    let newest_ok = ok.values().flatten().map(|a| a.modify_index).max().unwrap();
    assert_eq!(
        newest_ok,
        2 + acknowledged as u64,
        "the acknowledged changes are the first ones, every one before the failure"
    );
    assert_eq!(
        r.last_index(),
        newest_ok,
        "the view never passes the last durable index"
    );
    assert_eq!(r.stream_index(), newest_ok);
    assert!(matches!(
        r.store_health(),
        StoreHealth::Refusing {
            code: "write_failed",
            ..
        }
    ));
    assert!(
        r.inner.store.admit().is_err(),
        "admission refused (fail-stop)"
    );
    assert!(
        r.report("b", noted("web", RunState::Running, "late"))
            .await
            .is_err()
    );
    for alloc in ["a", "b"] {
        unwedged(&r, alloc).unwrap();
    }
    let seen: BTreeMap<&str, Arc<Allocation>> = ["a", "b"]
        .map(|a| (a, r.get(a).unwrap()))
        .into_iter()
        .collect();
    let _ = r.inner.store.close();
    drop(r);
    fs.heal();
    // A power loss: only what was made durable survives.
    fs.crash_now(1);
    let fs = sim::SimFs::from_image(&fs.image().unwrap());
    let r = open(Arc::new(sim_store(&fs, &dir, &sup)));
    assert_eq!(r.last_index(), newest_ok, "exactly what was acknowledged");
    for alloc in ["a", "b"] {
        let now = r.get(alloc).unwrap();
        for a in ok.get(alloc).into_iter().flatten() {
            assert!(now.modify_index >= a.modify_index);
        }
        assert_eq!(
            now, seen[alloc],
            "{alloc}: what readers saw is what survived"
        );
    }
}

/// The same on the gated store, checked step by step: a writer decided on
/// a version whose commit fails fails too, even when its own commit comes
/// in a later group; nothing is taken after the failure.
#[tokio::test]
async fn p4_writers_decided_on_a_failed_change_fail_and_nothing_after_it_is_taken() {
    let gate = Gate::new();
    let r = open(gate.clone());
    r.register(id("a"), one_task("web")).await.unwrap();
    gate.auto(false);
    let mut writers = Vec::new();
    for n in 0..8usize {
        let r = r.clone();
        let state = if n % 2 == 0 {
            RunState::Running
        } else {
            RunState::Pending
        };
        writers.push(tokio::spawn(async move {
            r.report("a", report("web", state)).await
        }));
        settle().await;
    }
    assert_eq!(gate.queued(), 8, "all pipelined");
    gate.commit(2, true);
    gate.commit(1, false);
    settle().await;
    gate.commit_all(true);
    settle().await;
    let answers: Vec<_> = futures_join(writers).await;
    assert!(answers[0].is_ok() && answers[1].is_ok());
    for (n, a) in answers.iter().enumerate().skip(2) {
        assert!(
            a.is_err(),
            "writer {n} was decided on the failed change: {a:?}"
        );
    }
    assert_eq!(gate.durable_last(), 3, "nothing after the failure");
    assert_eq!(r.get("a").unwrap().modify_index, 3);
    assert!(
        r.report("a", report("web", RunState::Pending))
            .await
            .is_err()
    );
    unwedged(&r, "a").unwrap();
}

async fn futures_join<T>(handles: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

// ---------------------------------------------------------------------
// Promise 5: registration, deletion and re-registration racing.
// ---------------------------------------------------------------------

/// On two threads: registrations of one ID with two specs, deletions,
/// reports and parked waiters, racing. No panic; the map and the store
/// agree; every waiter ends once everything is deleted; the limit counts
/// each allocation once (with everything deleted, a limit of 2 takes two
/// new ones).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p5_register_delete_reregister_report_and_wait_race_on_one_id() {
    let store = Arc::new(crate::store::MemoryStore::new());
    let r = Registry::open(
        store.clone(),
        RegistryConfig {
            max_allocations: 2,
            ..RegistryConfig::default()
        },
    )
    .unwrap();
    let waiters = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..12u64 {
        let (r, waiters) = (r.clone(), waiters.clone());
        tasks.spawn(async move {
            for n in 0..40u64 {
                let alloc = if (w + n) % 3 == 0 { "y" } else { "x" };
                match (w * 7 + n) % 6 {
                    0 => {
                        let _ = r.register(id(alloc), one_task("web")).await;
                    }
                    1 => {
                        let _ = r.register(id(alloc), one_task("db")).await;
                    }
                    2 => {
                        let _ = r.delete(alloc).await;
                    }
                    3 => {
                        let _ = r.report(alloc, report("web", RunState::Running)).await;
                    }
                    4 => {
                        // A waiter for a change that never comes: only a
                        // deletion (or a shutdown) ends it.
                        let r = r.clone();
                        waiters.lock().unwrap().push(tokio::spawn(async move {
                            r.wait_alloc(alloc, u64::MAX - 1, Duration::from_secs(3600))
                                .await
                        }));
                    }
                    _ => {
                        let _ = r.report(alloc, report("db", RunState::Running)).await;
                    }
                }
            }
        });
    }
    let all = async {
        while let Some(t) = tasks.join_next().await {
            t.expect("no panic");
        }
    };
    tokio::time::timeout(Duration::from_secs(120), all)
        .await
        .expect("every request ends");
    let loaded = store.load().unwrap();
    let in_store: Vec<String> = loaded
        .allocations
        .iter()
        .map(|a| a.id.to_string())
        .collect();
    let (listed, _) = r.list("", None, 100, |_| true);
    let in_view: Vec<String> = listed.iter().map(|a| a.id.to_string()).collect();
    assert_eq!(in_view, in_store, "the view and the store agree");
    assert_eq!(r.len(), in_store.len(), "no handle but the live ones");
    for a in &loaded.allocations {
        assert_eq!(*r.get(a.id.as_str()).unwrap(), *a);
        unwedged(&r, a.id.as_str()).unwrap();
    }
    for a in &in_store {
        r.delete(a).await.unwrap();
    }
    assert_eq!(r.len(), 0);
    // Every waiter ends: each was parked on a handle since deleted.
    let waiters = std::mem::take(&mut *waiters.lock().unwrap());
    assert!(!waiters.is_empty());
    let ended = async {
        for w in waiters {
            let answer = w.await.expect("no panic");
            assert!(
                matches!(
                    answer,
                    Err(RegistryError::Deleted(_) | RegistryError::AllocationNotFound(_))
                ),
                "{answer:?}"
            );
        }
    };
    tokio::time::timeout(Duration::from_secs(30), ended)
        .await
        .expect("no waiter left hanging");
    assert_eq!(r.waiters(), 0);
    r.register(id("p"), one_task("web")).await.unwrap();
    r.register(id("q"), one_task("web")).await.unwrap();
}

/// Sets up the race behind the next two tests: a report appended
/// (pending, index 2), a deletion decided on it (index 3, holding the
/// lock until published), and a third writer waiting for the lock. Both
/// commit together; the report's writer is told last (a store tells a
/// group in any order). Returns the third writer's task.
async fn deleted_while_a_report_is_untold<T: Send + 'static>(
    gate: &Arc<Gate>,
    r: &Registry,
    third: impl std::future::Future<Output = T> + Send + 'static,
) -> (tokio::task::JoinHandle<T>, Result<u64, RegistryError>, u64) {
    r.register(id("a"), one_task("web")).await.unwrap();
    gate.auto(false);
    let report = {
        let r = r.clone();
        tokio::spawn(async move { r.report("a", report("web", RunState::Running)).await })
    };
    settle().await;
    let del = {
        let r = r.clone();
        tokio::spawn(async move { r.delete("a").await })
    };
    settle().await;
    assert_eq!(
        gate.queued(),
        2,
        "the report, then the deletion decided on it"
    );
    let third = tokio::spawn(third);
    settle().await;
    let held = gate.commit_holding(2, true, &[2]);
    settle().await;
    let deleted = del.await.unwrap();
    assert!(r.get("a").is_err(), "the deletion is published");
    let deleted_at = r.last_index();
    Gate::release(held);
    gate.auto(true);
    settle().await;
    report.await.unwrap().unwrap();
    (third, deleted, deleted_at)
}

/// A report waiting for the lock while the allocation is deleted must
/// find it deleted. `lock_live` takes the handle's pending version before
/// its slot; the pending version of a report published *before* the
/// deletion stays set until that report's writer is told (its commit
/// task clears it), and a deletion never replaces it. A writer that gets
/// the lock in between decides on the version before the deletion, and
/// its change brings the deleted allocation back.
#[tokio::test]
async fn p5_a_deletion_is_final_a_report_racing_it_does_not_resurrect_the_allocation() {
    let gate = Gate::new();
    let r = open(gate.clone());
    let racer = {
        let r = r.clone();
        async move { r.report("a", noted("web", RunState::Pending, "late")).await }
    };
    let (third, deleted, deleted_at) = deleted_while_a_report_is_untold(&gate, &r, racer).await;
    assert_eq!(deleted.unwrap(), deleted_at);
    let answer = third.await.unwrap();
    let now = r.get("a");
    assert!(
        now.is_err() && gate.durable("a").is_none(),
        "deleted at index {deleted_at}, the allocation is back: {:?} (the late report was \
         answered {:?})",
        now.map(|a| a.modify_index),
        answer.map(|a| a.modify_index)
    );
    assert!(
        matches!(
            answer,
            Err(RegistryError::AllocationNotFound(_) | RegistryError::Deleted(_))
        ),
        "{answer:?}"
    );
}

/// The same race with a second deletion: it must answer not found. It is
/// decided on the stale pending version, committed (a second deletion of
/// a deleted allocation, told success), and the follower, which finds no
/// handle for it, publishes no event: the stream skips its index.
#[tokio::test]
async fn p2_p5_a_second_deletion_is_refused_and_the_stream_skips_no_index() {
    let gate = Gate::new();
    let r = open(gate.clone());
    let mut sub = r.subscribe(0, String::new()).unwrap();
    let racer = {
        let r = r.clone();
        async move { r.delete("a").await }
    };
    let (third, _, _) = deleted_while_a_report_is_untold(&gate, &r, racer).await;
    let second = third.await.unwrap();
    let mut told = Vec::new();
    while let Ok(Ok(next)) = tokio::time::timeout(Duration::ZERO, sub.next(100)).await {
        match next {
            feed::Next::Changes(events) => told.extend(events.iter().map(|e| e.index)),
            feed::Next::Resync(i) => panic!("resync at {i}"),
        }
    }
    let expected: Vec<u64> = (1..=gate.durable_last()).collect();
    assert_eq!(
        told, expected,
        "the stream skipped a committed index (the second deletion answered {second:?})"
    );
    assert!(
        matches!(second, Err(RegistryError::AllocationNotFound(_))),
        "a second deletion of a deleted allocation: {second:?}"
    );
}

// ---------------------------------------------------------------------
// Promise 6: dependencies.
// ---------------------------------------------------------------------

/// A target changes while a dependent's registration is in flight (its
/// verdict decided on the target's old version); the target's change is
/// published first, before the dependent is in the reverse index. The
/// registration then judges the dependent again (`register_within` →
/// `resolve`) — but in the client's future: a client that goes away the
/// moment its commit is done leaves the verdict stale until the target
/// changes again.
#[tokio::test]
async fn p6_a_dependent_whose_registering_client_left_still_follows_its_target() {
    let gate = Gate::new();
    let r = open(gate.clone());
    r.register(id("data"), one_task("db")).await.unwrap();
    gate.auto(false);
    let target = {
        let r = r.clone();
        tokio::spawn(async move { r.report("data", report("db", RunState::Running)).await })
    };
    settle().await;
    let reg = {
        let r = r.clone();
        tokio::spawn(async move { r.register(id("app"), depends("web", "data", "db")).await })
    };
    settle().await;
    assert_eq!(
        gate.queued(),
        2,
        "the target's change, then the registration"
    );
    gate.commit(1, true);
    settle().await;
    gate.commit(1, true);
    // The client goes away now: its commit is done, its answer not sent.
    reg.abort();
    settle().await;
    target.await.unwrap().unwrap();
    gate.auto(true);
    let running = |a: &Allocation| a.tasks[0].state == RunState::Running;
    assert!(running(&r.get("data").unwrap()));
    let holds = || {
        r.get("app")
            .is_ok_and(|a| a.tasks[0].deps().first().is_some_and(|d| d.holds()))
    };
    for _ in 0..20_000 {
        if holds() {
            break;
        }
        tokio::task::yield_now().await;
    }
    let app = r.get("app").unwrap();
    assert!(
        holds(),
        "data/db is running, yet app's dependency on it says {:?}",
        app.tasks[0].deps()
    );
}

/// The control: the same interleaving with the client staying: its
/// answer comes with the verdict judged again.
#[tokio::test]
async fn p6_a_dependent_registered_while_its_target_changed_follows_it_client_staying() {
    let gate = Gate::new();
    let r = open(gate.clone());
    r.register(id("data"), one_task("db")).await.unwrap();
    gate.auto(false);
    let target = {
        let r = r.clone();
        tokio::spawn(async move { r.report("data", report("db", RunState::Running)).await })
    };
    settle().await;
    let reg = {
        let r = r.clone();
        tokio::spawn(async move { r.register(id("app"), depends("web", "data", "db")).await })
    };
    settle().await;
    gate.commit(1, true);
    settle().await;
    gate.commit(1, true);
    gate.auto(true);
    let (app, new) = reg.await.unwrap().unwrap();
    target.await.unwrap().unwrap();
    assert!(new);
    assert!(
        app.tasks[0].deps()[0].holds(),
        "answered with the verdict judged again: {:?}",
        app.tasks[0].deps()
    );
}

/// A target's writer answers only once its dependents were judged, even
/// when the dependent's new verdict waits for a commit of its own: the
/// writer is held until then, and when it answers the dependent's verdict
/// is published.
#[tokio::test]
async fn p6_a_target_s_writer_answers_after_its_dependents_new_verdicts_are_published() {
    let gate = Gate::new();
    let r = open(gate.clone());
    r.register(id("data"), one_task("db")).await.unwrap();
    r.register(id("app"), depends("web", "data", "db"))
        .await
        .unwrap();
    assert!(!r.get("app").unwrap().tasks[0].deps()[0].holds());
    gate.auto(false);
    // The dependent has a write of its own in flight.
    let own = {
        let r = r.clone();
        tokio::spawn(async move {
            r.report("app", noted("web", RunState::Pending, "own"))
                .await
        })
    };
    let writer = {
        let r = r.clone();
        tokio::spawn(async move { r.report("data", report("db", RunState::Running)).await })
    };
    settle().await;
    assert_eq!(gate.queued(), 2);
    gate.commit_all(true);
    settle().await;
    assert!(
        !writer.is_finished(),
        "the target's writer answered before the dependent's new verdict was committed"
    );
    gate.commit_all(true);
    until("the target's writer answers", || writer.is_finished()).await;
    writer.await.unwrap().unwrap();
    assert!(
        r.get("app").unwrap().tasks[0].deps()[0].holds(),
        "the answer came after the dependent was judged"
    );
    own.await.unwrap().unwrap();
    gate.auto(true);
}

// ---------------------------------------------------------------------
// Promise 7: supervised tasks.
// ---------------------------------------------------------------------

/// The timer driver panics while it has looks in hand (taken from the
/// heap, spawned into its `JoinSet`, not yet run): it is started again
/// and health names it, but every allocation whose moment had come must
/// still be looked at. 300 TTLs end at once: the driver takes 256, then
/// the rest, and waits for room among its looks; it panics on its next
/// turn.
#[tokio::test(start_paused = true)]
async fn p7_a_timer_driver_that_panics_loses_no_due_look() {
    const TTL: Duration = Duration::from_secs(30);
    const N: usize = 300;
    let gate = Gate::new();
    let r = open(gate.clone());
    for n in 0..N {
        let a = format!("a{n:03}");
        r.register(id(&a), watched(TTL)).await.unwrap();
        r.report(&a, report("web", RunState::Running))
            .await
            .unwrap();
    }
    gate.auto(false);
    tokio::time::advance(TTL + Duration::from_millis(1)).await;
    // The driver holds 256 looks, whose writes wait for their commits,
    // and has taken the other 44 from the heap, waiting for room.
    until("the first 256 looks appended", || gate.queued() == 256).await;
    settle().await;
    assert_eq!(
        gate.queued(),
        256,
        "no room among the looks: the driver waits"
    );
    r.inner.timers.panic_once.store(true, Ordering::SeqCst);
    gate.auto(true);
    settle().await;
    assert!(
        !r.inner.timers.panic_once.load(Ordering::SeqCst),
        "the driver panicked"
    );
    // Started again after its first wait (100 ms); health names it.
    tokio::time::advance(Duration::from_secs(1)).await;
    settle().await;
    assert!(
        r.config()
            .supervisor
            .problems()
            .contains(&"timers_restarted".to_owned())
    );
    for _ in 0..10 {
        tokio::time::advance(TTL).await;
        settle().await;
    }
    let not_lost: Vec<String> = (0..N)
        .map(|n| format!("a{n:03}"))
        .filter(|a| !r.get(a).unwrap().tasks[0].lost())
        .collect();
    assert!(
        not_lost.is_empty(),
        "{} tasks stayed running long past their TTL (e.g. {:?})",
        not_lost.len(),
        &not_lost[..not_lost.len().min(5)]
    );
}

/// After `Store::close` (the server stopping, past its grace), an append
/// must fail with `Closed` (the trait's contract: "Later appends fail with
/// `Closed`"), and the write answer 503 `shutting_down`. The disk store
/// answers a closed append with `record: None`; the write path expects a
/// record for every put and panics.
#[tokio::test]
async fn p7_a_write_after_the_disk_store_closed_answers_closed_without_a_panic() {
    let fs = sim::SimFs::new();
    let dir = sim_dir(&fs);
    let sup = crate::supervise::Supervisor::new();
    let r = open(Arc::new(sim_store(&fs, &dir, &sup)));
    r.register(id("a"), one_task("web")).await.unwrap();
    r.inner.store.close().unwrap();
    let report = {
        let r = r.clone();
        tokio::spawn(async move { r.report("a", report("web", RunState::Running)).await })
    };
    let answer = report.await;
    assert!(
        answer
            .as_ref()
            .is_ok_and(|a| matches!(a, Err(RegistryError::Store(StoreError::Closed)))),
        "a report after close: {answer:?}"
    );
    let register = {
        let r = r.clone();
        tokio::spawn(async move { r.register(id("b"), one_task("web")).await })
    };
    let answer = register.await;
    assert!(answer.is_ok(), "a registration after close panicked");
    assert_eq!(
        r.len(),
        1,
        "no handle left behind by a registration that failed"
    );
}

/// The disk writer's thread panics (here: in the file system, during a
/// commit's `fdatasync`): the server is told to stop, the write in flight
/// fails, and the writes that come during the shutdown grace are answered
/// (503), not a panic in the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p7_after_the_disk_writer_panics_the_server_stops_and_writes_are_answered() {
    let fs = sim::SimFs::new();
    let dir = sim_dir(&fs);
    let sup = crate::supervise::Supervisor::new();
    let r = Registry::open(
        Arc::new(sim_store(&fs, &dir, &sup)),
        RegistryConfig {
            supervisor: sup.clone(),
            ..config()
        },
    )
    .unwrap();
    r.register(id("a"), one_task("web")).await.unwrap();
    let armed = Arc::new(AtomicBool::new(true));
    let arm = armed.clone();
    fs.fail_with(move |op, path| {
        if op == sim::Op::SyncData && is_log(path) && arm.swap(false, Ordering::SeqCst) {
            panic!("a test's panic on the writer thread");
        }
        None
    });
    let first = r.report("a", report("web", RunState::Running)).await;
    assert!(first.is_err(), "{first:?}");
    let why = tokio::time::timeout(Duration::from_secs(30), sup.stopping())
        .await
        .expect("the server is told to stop");
    assert_eq!(why, "the task `store_writer` panicked");
    assert!(sup.problems().contains(&"task_ended".to_owned()));
    unwedged(&r, "a").unwrap();
    // A request during the grace (one that changes the record).
    let later = {
        let r = r.clone();
        tokio::spawn(async move { r.report("a", report("web", RunState::Running)).await })
    };
    let answer = later.await;
    assert!(
        answer.as_ref().is_ok_and(|a| a.is_err()),
        "a write after the writer died: {answer:?}"
    );
}
