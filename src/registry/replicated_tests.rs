//! The write path on a store other replicas write too, against a store in
//! memory whose follower is handed changes only when the test says
//! (`Held`): a view that lags behind what the store acknowledged, without
//! timing.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex, Weak},
};

use super::{lives::GRACE, *};
use crate::{
    lifecycle::{AllocSpec, RunState, Semaphore, TaskName, TaskReport, TaskSpec, Timestamp},
    store::{
        Append, AppendError, Appended, Change, Follower, Lease, Leases, LiveOp, Liveness, Loaded,
        Op, QuorumRead, Store, StoreError, Unreadable,
    },
};

mod promise;

type Pending<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

#[derive(Default)]
struct State {
    /// The records, by ID: the revision that wrote each.
    records: BTreeMap<String, (u64, Allocation)>,
    revision: u64,
    /// Every committed change, with its index (the revision that made it).
    held: Vec<(u64, Change)>,
    /// Each replica's follower, and how many of `held` it was handed.
    followers: Vec<(Weak<dyn Follower>, usize)>,
    unreadable: BTreeMap<String, Unreadable>,
    /// Live keys by (allocation, task): their lease.
    live: BTreeMap<(String, String), Lease>,
    /// Leases granted so far.
    leases: Lease,
    /// Every renewal asked for, in order.
    renewals: Vec<Lease>,
    /// Renewals go unacknowledged (`Leases::renewing` is false).
    unrenewed: bool,
    /// Changes refused because a live key they needed gone was there.
    refused_live: usize,
    /// The semaphores, by name: the revision that wrote each.
    semaphores: BTreeMap<String, (u64, Arc<Semaphore>)>,
    /// Grants refused because a semaphore they were decided on moved.
    refused_grants: usize,
    /// The next marks refused, each by a change of the record that lands
    /// just before it (another replica's write).
    racing: usize,
    /// Marks wait (in flight) while this holds.
    stalled: bool,
}

impl State {
    /// Keeps a committed change, at the current revision.
    fn hold(&mut self, change: Change) {
        self.held.push((self.revision, change));
    }

    /// Whether a live key of `id` that `ops` need absent is there (as
    /// etcd's compare: a run declared lost, or marked again, only while
    /// its live key is gone).
    fn live_present(&self, id: &AllocId, ops: &[LiveOp], starts: bool) -> bool {
        ops.iter().any(|op| {
            let task = match op {
                LiveOp::End { task, lapsed: true } => task,
                LiveOp::Start { task, .. } if starts => task,
                _ => return false,
            };
            self.live.contains_key(&(id.to_string(), task.to_string()))
        })
    }

    /// `Leases::mark`, as etcd's transaction: applied only while the
    /// record is at `expect` and the live keys it writes are gone.
    fn mark(&mut self, id: &AllocId, expect: u64, live: Vec<LiveOp>) -> Result<u64, AppendError> {
        if self.racing > 0
            && let Some((_, mut a)) = self.records.get(id.as_str()).cloned()
        {
            self.racing -= 1;
            self.revision += 1;
            let seen = self.revision;
            a.modify_index = seen;
            self.records.insert(id.to_string(), (seen, a.clone()));
            self.hold(Change::Put(Arc::new(a)));
            return Err(AppendError::Conflict { seen });
        }
        let now = self.records.get(id.as_str()).map_or(0, |r| r.0);
        if now != expect {
            return Err(AppendError::Conflict { seen: now });
        }
        if self.live_present(id, &live, true) {
            return Err(AppendError::Conflict {
                seen: self.revision,
            });
        }
        self.revision += 1;
        self.apply_live(id, live);
        Ok(self.revision)
    }

    /// Applies liveness ops on `id`'s keys, holding the changes.
    fn apply_live(&mut self, id: &AllocId, ops: Vec<LiveOp>) {
        for op in ops {
            let change = match op {
                LiveOp::Start { task, mark } => {
                    self.live
                        .insert((id.to_string(), task.to_string()), mark.lease);
                    vec![
                        Liveness::Live {
                            id: id.clone(),
                            task: task.clone(),
                            lease: Some(mark.lease),
                        },
                        Liveness::Mark {
                            id: id.clone(),
                            task,
                            mark: Some(mark),
                        },
                    ]
                }
                LiveOp::End { task, .. } => {
                    self.live.remove(&(id.to_string(), task.to_string()));
                    vec![
                        Liveness::Live {
                            id: id.clone(),
                            task: task.clone(),
                            lease: None,
                        },
                        Liveness::Mark {
                            id: id.clone(),
                            task,
                            mark: None,
                        },
                    ]
                }
            };
            for c in change {
                self.hold(Change::Liveness(c));
            }
        }
    }
}

#[derive(Default)]
struct Held(Arc<Mutex<State>>);

impl Held {
    /// Hands every held change to every follower.
    fn deliver(&self) {
        let (n, revision) = {
            let s = self.0.lock().unwrap();
            (s.followers.len(), s.revision)
        };
        for f in 0..n {
            self.deliver_to(f, revision);
        }
    }

    /// Hands follower `f` (in the order they followed) the changes up to
    /// index `upto` it was not handed yet: a replica whose view lags.
    fn deliver_to(&self, f: usize, upto: u64) {
        let (changes, follower) = {
            let mut s = self.0.lock().unwrap();
            let from = s.followers[f].1;
            let to = from
                + s.held[from..]
                    .iter()
                    .take_while(|(i, _)| *i <= upto)
                    .count();
            s.followers[f].1 = to;
            let changes: Vec<Change> = s.held[from..to].iter().map(|(_, c)| c.clone()).collect();
            (changes, s.followers[f].0.clone())
        };
        if let Some(f) = follower.upgrade() {
            f.changed(changes, upto);
        }
    }
}

impl Store for Held {
    fn load(&self) -> Result<Loaded, StoreError> {
        Ok(Loaded::default())
    }

    fn id(&self) -> &str {
        "held"
    }

    fn shared(&self) -> bool {
        true
    }

    fn follow(&self, _: u64, follower: Weak<dyn Follower>) {
        let mut s = self.0.lock().unwrap();
        let delivered = s.held.len();
        s.followers.push((follower, delivered));
    }

    fn append(&self, append: Append) -> Appended {
        let Append {
            op,
            expect,
            live,
            grants,
        } = append;
        let record = match &op {
            Op::Put(a) => Some(a.clone()),
            _ => None,
        };
        let mut s = self.0.lock().unwrap();
        let (id, now) = match &op {
            Op::Put(_) | Op::Delete(_) => {
                let id = op.alloc_id().unwrap().to_string();
                let now = s.records.get(&id).map(|r| r.0);
                (id.clone(), now.or(s.unreadable.get(&id).map(|u| u.index)))
            }
            Op::PutSemaphore(sem) => (
                String::new(),
                s.semaphores.get(sem.name.as_str()).map(|r| r.0),
            ),
            Op::DeleteSemaphore(name) => {
                (String::new(), s.semaphores.get(name.as_str()).map(|r| r.0))
            }
        };
        // As etcd's compare of each granted semaphore's key.
        let moved = grants
            .iter()
            .any(|g| s.semaphores.get(g.name.as_str()).map(|r| r.0) != Some(g.modify_index));
        if moved && now.unwrap_or(0) == expect {
            s.refused_grants += 1;
        }
        let done: Pending<Result<u64, AppendError>> = if now.unwrap_or(0) != expect || moved {
            let seen = if moved {
                s.revision
            } else {
                now.unwrap_or(s.revision)
            };
            Box::pin(async move { Err(AppendError::Conflict { seen }) })
        } else if op
            .alloc_id()
            .is_some_and(|id| s.live_present(id, &live, false))
        {
            s.refused_live += 1;
            let seen = s.revision;
            Box::pin(async move { Err(AppendError::Conflict { seen }) })
        } else {
            s.revision += 1;
            let index = s.revision;
            s.unreadable.remove(&id);
            for g in grants {
                let mut g = Arc::unwrap_or_clone(g);
                g.modify_index = index;
                let g = Arc::new(g);
                s.semaphores.insert(g.name.to_string(), (index, g.clone()));
                s.hold(Change::PutSemaphore(g));
            }
            match op {
                Op::Put(a) => {
                    let mut a = Arc::unwrap_or_clone(a);
                    let placeholder = a.modify_index;
                    a.restamp(placeholder, index);
                    s.records.insert(id, (index, a.clone()));
                    let alloc = a.id.clone();
                    s.hold(Change::Put(Arc::new(a)));
                    s.apply_live(&alloc, live);
                }
                Op::Delete(alloc) => {
                    s.records.remove(&id);
                    s.hold(Change::Delete { id: alloc, index });
                }
                Op::PutSemaphore(sem) => {
                    let mut sem = Arc::unwrap_or_clone(sem);
                    let placeholder = sem.modify_index;
                    sem.restamp(placeholder, index);
                    let sem = Arc::new(sem);
                    s.semaphores
                        .insert(sem.name.to_string(), (index, sem.clone()));
                    s.hold(Change::PutSemaphore(sem));
                }
                Op::DeleteSemaphore(name) => {
                    s.semaphores.remove(name.as_str());
                    s.hold(Change::DeleteSemaphore { name, index });
                }
            }
            Box::pin(async move { Ok(index) })
        };
        Appended {
            record,
            stamped: false,
            done,
        }
    }

    fn quorum_read(&self, id: &AllocId) -> Option<QuorumRead> {
        let found = self.0.lock().unwrap().records.get(id.as_str()).map(|r| r.0);
        Some(Box::pin(async move { Ok(found) }))
    }

    fn leases(&self) -> Option<Arc<dyn Leases>> {
        Some(Arc::new(HeldLeases(self.0.clone())))
    }

    fn unreadable(&self, id: &str) -> Option<Unreadable> {
        self.0.lock().unwrap().unreadable.get(id).cloned()
    }

    fn unreadable_ids(&self) -> Vec<String> {
        self.0.lock().unwrap().unreadable.keys().cloned().collect()
    }
}

/// `Held`'s leases.
struct HeldLeases(Arc<Mutex<State>>);

impl Leases for HeldLeases {
    fn grant(&self, _: std::time::Duration) -> Pending<Result<Lease, StoreError>> {
        let mut s = self.0.lock().unwrap();
        s.leases += 1;
        let lease = s.leases;
        Box::pin(async move { Ok(lease) })
    }

    fn mark(
        &self,
        id: &AllocId,
        expect: u64,
        live: Vec<LiveOp>,
    ) -> Pending<Result<u64, AppendError>> {
        let state = self.0.clone();
        let id = id.clone();
        let mark = move || state.lock().unwrap().mark(&id, expect, live);
        if !self.0.lock().unwrap().stalled {
            let done = mark();
            return Box::pin(async move { done });
        }
        let state = self.0.clone();
        Box::pin(async move {
            while state.lock().unwrap().stalled {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            mark()
        })
    }

    fn keep_alive(&self, lease: Lease) {
        self.0.lock().unwrap().renewals.push(lease);
    }

    fn renewing(&self) -> bool {
        !self.0.lock().unwrap().unrenewed
    }
}

fn web() -> AllocSpec {
    AllocSpec::new(
        vec![TaskSpec::named(TaskName::parse("web").unwrap())],
        &Limits::default(),
    )
    .unwrap()
}

fn running() -> Vec<(TaskName, TaskReport)> {
    vec![(
        TaskName::parse("web").unwrap(),
        TaskReport {
            state: RunState::Running,
            failed: false,
            event: None,
            ready: None,
        },
    )]
}

/// A replica on a `Held` store, its wall clock on tokio's (paused).
fn open() -> (Arc<Held>, Registry) {
    let store = Arc::new(Held::default());
    let config = RegistryConfig {
        clock: super::clock::Clock::tokio(),
        ..RegistryConfig::default()
    };
    let registry = Registry::open(store.clone(), config).unwrap();
    (store, registry)
}

/// A registration acknowledged while this replica's view has not reached
/// it is never answered 404 (which an agent takes for a deletion): the
/// store's quorum is asked, and the answer is 503 while the view is
/// behind, the allocation once it caught up.
#[tokio::test(start_paused = true)]
async fn an_acknowledged_registration_is_never_404_on_a_lagging_view() {
    let (store, r) = open();
    let (made, created) = r
        .register(AllocId::parse("a1").unwrap(), web())
        .await
        .unwrap();
    assert!(created);
    assert!(r.get("a1").is_err(), "the view has not reached it");

    let read = r.look_up("a1").await.unwrap_err();
    assert!(
        matches!(&read, RegistryError::Behind { index, view: 0, .. } if *index == made.modify_index),
        "{read:?}"
    );
    let write = r.report("a1", running()).await.unwrap_err();
    assert!(matches!(write, RegistryError::Behind { .. }), "{write:?}");
    let wait = r
        .wait_alloc("a1", 0, std::time::Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(matches!(wait, RegistryError::Behind { .. }), "{wait:?}");

    // An allocation the store does not hold is still 404.
    assert!(matches!(
        r.look_up("nothing").await,
        Ok(()) if r.get("nothing").is_err()
    ));

    store.deliver();
    r.look_up("a1").await.unwrap();
    assert_eq!(r.get("a1").unwrap().modify_index, made.modify_index);
    let reported = {
        let r = r.clone();
        let store = store.clone();
        let sent = tokio::spawn(async move { r.report("a1", running()).await });
        // The report waits for its own change to reach the view.
        tokio::task::yield_now().await;
        store.deliver();
        sent.await.unwrap().unwrap()
    };
    assert_eq!(reported.tasks[0].state, RunState::Running);
}

/// A record this build cannot read: its requests are 503 `store_failed` at
/// once, health names it, the others are served, and DELETE removes it.
#[tokio::test(start_paused = true)]
async fn an_unreadable_record_is_refused_named_and_deletable() {
    let (store, r) = open();
    for id in ["bad", "good"] {
        let registering = {
            let r = r.clone();
            tokio::spawn(async move { r.register(AllocId::parse(id).unwrap(), web()).await })
        };
        tokio::task::yield_now().await;
        store.deliver();
        registering.await.unwrap().unwrap();
    }
    {
        // Another build writes the record in a version this one cannot
        // read: the store's revision moves, the view gets no change.
        let mut s = store.0.lock().unwrap();
        s.records.remove("bad").unwrap();
        s.revision += 1;
        let index = s.revision;
        s.unreadable.insert(
            "bad".into(),
            Unreadable {
                why: "unknown record version 99".into(),
                index,
            },
        );
    }
    store.deliver();
    assert_eq!(r.unreadable(100), ["bad"]);
    let refused = r.report("bad", running()).await.unwrap_err();
    assert!(
        matches!(&refused, RegistryError::Unreadable { why, .. } if why.contains("version 99")),
        "{refused:?}"
    );
    assert!(matches!(
        r.look_up("bad").await,
        Err(RegistryError::Unreadable { .. })
    ));
    let good = {
        let r = r.clone();
        let sent = tokio::spawn(async move { r.report("good", running()).await });
        tokio::task::yield_now().await;
        store.deliver();
        sent.await.unwrap().unwrap()
    };
    assert_eq!(good.tasks[0].state, RunState::Running);

    let deleting = {
        let r = r.clone();
        tokio::spawn(async move { r.delete("bad").await })
    };
    tokio::task::yield_now().await;
    store.deliver();
    deleting.await.unwrap().unwrap();
    assert!(r.unreadable(100).is_empty());
    r.look_up("bad").await.unwrap();
    assert!(matches!(
        r.get("bad"),
        Err(RegistryError::AllocationNotFound(_))
    ));
}

// ---- liveness over a store with leases (`lives.rs`) ----

const TTL: std::time::Duration = std::time::Duration::from_secs(30);

/// `web` under a 30 s TTL.
fn timed_web() -> AllocSpec {
    let mut web = TaskSpec::named(TaskName::parse("web").unwrap());
    web.liveness = Some(TTL);
    AllocSpec::new(vec![web], &Limits::default()).unwrap()
}

/// Runs `f` on `r` while the store hands its changes to the view.
async fn delivered<T: Send + 'static>(
    store: &Arc<Held>,
    f: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    let task = tokio::spawn(f);
    loop {
        tokio::task::yield_now().await;
        store.deliver();
        if task.is_finished() {
            return task.await.unwrap();
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

fn renewals(store: &Held) -> Vec<Lease> {
    store.0.lock().unwrap().renewals.clone()
}

/// A running task under a TTL, on a view that holds its liveness keys.
async fn timed_running(store: &Arc<Held>, r: &Registry) {
    let rr = r.clone();
    delivered(store, async move {
        rr.register(AllocId::parse("t1").unwrap(), timed_web())
            .await
            .unwrap()
    })
    .await;
    let rr = r.clone();
    delivered(
        store,
        async move { rr.report("t1", running()).await.unwrap() },
    )
    .await;
    let s = store.0.lock().unwrap();
    assert_eq!(
        s.live.get(&("t1".to_string(), "web".to_string())),
        Some(&1),
        "the write that made web running wrote its live key under a new lease"
    );
}

/// With a shared store, time alone never declares a task lost (its clock
/// is the store's lease); the live key going is what does, at once and in
/// one change, and the change removes the run's keys.
#[tokio::test(start_paused = true)]
async fn a_task_is_lost_when_its_live_key_goes_not_by_this_replica_s_clock() {
    let (store, r) = open();
    timed_running(&store, &r).await;
    tokio::time::sleep(TTL * 10).await;
    store.deliver();
    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    assert!(
        !r.get("t1").unwrap().tasks[0].lost(),
        "ten TTLs of silence here"
    );

    // The lease expires: the store removes the live key.
    lease_ends(&store);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    while !r.get("t1").unwrap().tasks[0].lost() {
        assert!(tokio::time::Instant::now() < deadline, "never lost");
        store.deliver();
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    let a = r.get("t1").unwrap();
    let lost = (a.tasks[0].events.all().iter())
        .filter(|e| e.kind == crate::lifecycle::LOST_EVENT)
        .count();
    assert_eq!(lost, 1);
    // The run's keys went with the decision (its mark included).
    store.deliver();
    let handle = r.handle("t1").unwrap();
    assert!(handle.lives().life(0).unwrap().kept.keys().mark.is_none());
}

/// Signs of life renew the run's lease, at most once a third of the TTL
/// each (the one that comes too soon is sent when that third is up, never
/// dropped); a parked query keeps renewing it; the end of a wait is sent
/// at once.
#[tokio::test(start_paused = true)]
async fn signs_of_life_renew_the_lease_within_a_bound() {
    let (store, r) = open();
    timed_running(&store, &r).await;
    let third = TTL / 3;
    r.heartbeat("t1", "web").unwrap();
    assert_eq!(renewals(&store), [1], "the first at once");
    for _ in 0..50 {
        r.heartbeat("t1", "web").unwrap();
    }
    assert_eq!(renewals(&store).len(), 1, "the others wait for the third");
    tokio::time::sleep(third + std::time::Duration::from_millis(1)).await;
    assert_eq!(renewals(&store).len(), 2, "sent when the third was up");
    tokio::time::sleep(TTL).await;
    assert_eq!(renewals(&store).len(), 2, "nothing more without a sign");

    // A parked query: one renewal a third while it waits.
    let rr = r.clone();
    let index = r.get("t1").unwrap().modify_index;
    let parked = tokio::spawn(async move { rr.wait_task("t1", "web", index, TTL * 2, true).await });
    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    assert_eq!(renewals(&store).len(), 3, "its start");
    tokio::time::sleep(TTL * 2 - std::time::Duration::from_millis(100)).await;
    let during = renewals(&store).len();
    assert!(
        (8..=9).contains(&during),
        "{during} renewals in two TTLs parked"
    );
    parked.await.unwrap().unwrap();
    // The end of the wait, at once though the last was less than a third
    // ago.
    assert_eq!(renewals(&store).len(), during + 1);
    assert!(renewals(&store).iter().all(|&l| l == 1));
}

/// Another replica ends `t1`'s run of web and starts a new one under a
/// new lease, in two changes this view has not seen yet; the new lease.
fn another_run(store: &Held, started: Timestamp) -> Lease {
    let mut s = store.0.lock().unwrap();
    let (_, current) = s.records.get("t1").unwrap().clone();
    let id = current.id.clone();
    let web = TaskName::parse("web").unwrap();
    let mut next = current;
    for (state, live) in [
        (RunState::Pending, None),
        (RunState::Running, Some(started)),
    ] {
        s.revision += 1;
        let index = s.revision;
        next.tasks[0].state = state;
        next.tasks[0].modify_index = index;
        next.modify_index = index;
        let ops = match live {
            None => vec![LiveOp::End {
                task: web.clone(),
                lapsed: false,
            }],
            Some(started) => {
                next.tasks[0].started_at = Some(started);
                s.leases += 1;
                vec![LiveOp::Start {
                    task: web.clone(),
                    mark: crate::store::Mark {
                        run: super::clock::nanos(started),
                        ttl: TTL,
                        lease: s.leases,
                    },
                }]
            }
        };
        s.records.insert("t1".into(), (index, next.clone()));
        s.hold(Change::Put(Arc::new(next.clone())));
        s.apply_live(&id, ops);
    }
    s.leases
}

/// A sign of life heard while this replica's view still holds the run
/// that another replica has since ended and started again renews the old
/// run's lease, which nobody needs: once the view sees the new run's live
/// key, its lease is renewed for that sign too, so the new lease runs a
/// TTL after the agent's sign, not after it was granted.
#[tokio::test(start_paused = true)]
async fn a_sign_heard_on_a_view_behind_a_new_run_renews_the_new_run_s_lease() {
    let (store, r) = open();
    timed_running(&store, &r).await;
    // Past the bound: the next sign is sent at once.
    tokio::time::sleep(TTL).await;
    let before = renewals(&store).len();
    let lease = another_run(&store, r.now());
    // The agent of the new run, heard here on a view a step behind.
    r.heartbeat("t1", "web").unwrap();
    assert_eq!(renewals(&store)[before..], [1], "the lease this view knows");
    store.deliver();
    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    let handle = r.handle("t1").unwrap();
    assert!(handle.lives().life(0).unwrap().kept.keys().live);
    assert_eq!(
        renewals(&store)[before..],
        [1, lease],
        "the new run's lease renewed for the sign heard after it began"
    );
}

/// A stored mark whose TTL is too long for the calendar (damage, or a
/// hostile write to the prefix) panics nothing: when its live key goes,
/// the task is lost as any other.
#[tokio::test(start_paused = true)]
async fn a_mark_with_a_ttl_past_the_calendar_panics_nothing() {
    let (store, r) = open();
    timed_running(&store, &r).await;
    // Silent since the report that began the run for longer than any TTL
    // (a stored one past the range counts as the longest).
    tokio::time::sleep(crate::lifecycle::TTL_RANGE.1 + std::time::Duration::from_secs(1)).await;
    {
        let mut s = store.0.lock().unwrap();
        let (_, a) = s.records.get("t1").unwrap().clone();
        let run = super::clock::nanos(a.tasks[0].started_at.unwrap());
        let (id, task) = (a.id.clone(), TaskName::parse("web").unwrap());
        s.revision += 1;
        s.hold(Change::Liveness(Liveness::Mark {
            id: id.clone(),
            task: task.clone(),
            mark: Some(crate::store::Mark {
                run,
                ttl: std::time::Duration::MAX,
                lease: 1,
            }),
        }));
        // Its lease expires.
        s.live.clear();
        s.revision += 1;
        s.hold(Change::Liveness(Liveness::Live {
            id,
            task,
            lease: None,
        }));
    }
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    while !r.get("t1").unwrap().tasks[0].lost() {
        assert!(tokio::time::Instant::now() < deadline, "never lost");
        store.deliver();
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// The store ends `t1`'s web lease: its live key goes (as etcd's expiry,
/// or a revocation, does).
fn lease_ends(store: &Held) {
    let mut s = store.0.lock().unwrap();
    s.live.clear();
    s.revision += 1;
    s.hold(Change::Liveness(Liveness::Live {
        id: AllocId::parse("t1").unwrap(),
        task: TaskName::parse("web").unwrap(),
        lease: None,
    }));
}

/// Hands the held changes over and lets the registry run for `span` of
/// (paused) time, a millisecond at a time.
async fn run_for(store: &Held, span: std::time::Duration) {
    let until = tokio::time::Instant::now() + span;
    while tokio::time::Instant::now() < until {
        store.deliver();
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    store.deliver();
}

/// web's live key in the store: its lease.
fn live_lease(store: &Held) -> Option<Lease> {
    let s = store.0.lock().unwrap();
    s.live.get(&("t1".to_string(), "web".to_string())).copied()
}

/// A lease that ends while this replica heard the run's agent within its
/// TTL (etcd ended it early: a leader resumed from a pause, a quorum lost
/// for longer than the TTL) does not make the task lost: the replica
/// marks the same run again under a new lease, and renews that one.
#[tokio::test(start_paused = true)]
async fn a_lease_that_ends_while_its_agent_is_heard_here_is_marked_again() {
    let (store, r) = open();
    timed_running(&store, &r).await;
    tokio::time::sleep(TTL / 2).await;
    r.heartbeat("t1", "web").unwrap();
    let heard = r.get("t1").unwrap().modify_index;
    lease_ends(&store);
    run_for(&store, GRACE * 3).await;
    let a = r.get("t1").unwrap();
    assert!(!a.tasks[0].lost(), "lost while its agent was heard");
    assert_eq!(a.modify_index, heard, "the record did not change");
    let new = live_lease(&store).expect("the run's live key written again");
    assert_ne!(new, 1, "under a new lease");
    let handle = r.handle("t1").unwrap();
    let keys = handle.lives().life(0).unwrap().kept.keys();
    assert!(keys.live);
    assert_eq!(keys.mark.map(|m| (m.lease, m.ttl)), Some((new, TTL)));
    assert_eq!(
        renewals(&store).last(),
        Some(&new),
        "the sign heard renews the new lease"
    );
    // Silent from here: the new lease ends a TTL later, and nothing was
    // heard within it: lost, once.
    tokio::time::sleep(TTL).await;
    lease_ends(&store);
    run_for(&store, GRACE * 3).await;
    let a = r.get("t1").unwrap();
    assert!(a.tasks[0].lost());
    let lost = a.tasks[0]
        .events
        .all()
        .iter()
        .filter(|e| e.kind == crate::lifecycle::LOST_EVENT)
        .count();
    assert_eq!(lost, 1);
}

/// A sign of life that comes after this replica's view saw the run's live
/// key go, when it had heard nothing of the run within the TTL, marks the
/// run again at once: the other replicas, which heard nothing either,
/// declare the run lost `GRACE` after they saw the key go, and a 204 to
/// this sign promises a TTL (found by the history tier: a task declared
/// lost 0.47 s after a heartbeat answered 204).
#[tokio::test(start_paused = true)]
async fn a_sign_heard_after_the_live_key_went_marks_the_run_again_within_the_grace() {
    let (store, r) = open();
    timed_running(&store, &r).await;
    tokio::time::sleep(TTL * 2).await;
    lease_ends(&store);
    run_for(&store, GRACE / 4).await;
    assert_eq!(live_lease(&store), None, "nothing heard: not marked again");
    // Heard, not acknowledged until the run is marked again (see
    // `promise::a_heartbeat_answered_while_the_live_key_is_gone_is_not_followed_by_a_loss`).
    let answer = r.heartbeat("t1", "web").map(|_| ());
    assert!(
        matches!(answer, Err(RegistryError::LeaseEnded { .. })),
        "{answer:?}"
    );
    run_for(&store, GRACE / 4).await;
    let new = live_lease(&store).expect("marked again before the others' grace is over");
    assert_ne!(new, 1, "under a new lease");
    assert_eq!(
        renewals(&store).last(),
        Some(&new),
        "and the sign renews it"
    );
    r.heartbeat("t1", "web").unwrap();
    run_for(&store, GRACE * 3).await;
    assert!(!r.get("t1").unwrap().tasks[0].lost());
}

/// A replica that heard nothing of a run waits `GRACE` after its live key
/// went before it declares the run lost; a replica that heard the agent
/// and marked the run again meanwhile wins, even where this replica's
/// view has not seen that yet: the lost decision is written only while
/// the live key is still gone.
#[tokio::test(start_paused = true)]
async fn a_lost_decision_waits_its_grace_and_loses_to_a_run_marked_again() {
    let (store, r) = open();
    timed_running(&store, &r).await;
    tokio::time::sleep(TTL * 2).await;
    lease_ends(&store);
    run_for(&store, GRACE - std::time::Duration::from_millis(50)).await;
    assert!(!r.get("t1").unwrap().tasks[0].lost(), "within its grace");
    // Another replica, which heard the agent, marks the run again; this
    // view does not see it before its grace is over.
    {
        let mut s = store.0.lock().unwrap();
        let (_, a) = s.records.get("t1").unwrap().clone();
        let run = super::clock::nanos(a.tasks[0].started_at.unwrap());
        s.leases += 1;
        let lease = s.leases;
        s.revision += 1;
        s.apply_live(
            &a.id,
            vec![LiveOp::Start {
                task: TaskName::parse("web").unwrap(),
                mark: crate::store::Mark {
                    run,
                    ttl: TTL,
                    lease,
                },
            }],
        );
    }
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    {
        // Its decision was tried, and refused: the live key is there.
        let s = store.0.lock().unwrap();
        assert_eq!(s.refused_live, 1);
        assert!(!s.records.get("t1").unwrap().1.tasks[0].lost());
    }
    // Once the view holds the run marked again, it stays running.
    run_for(&store, GRACE * 3).await;
    assert!(!r.get("t1").unwrap().tasks[0].lost());
    let handle = r.handle("t1").unwrap();
    assert!(handle.lives().life(0).unwrap().kept.keys().live);
}

/// A heartbeat that comes while etcd acknowledges no lease renewal is
/// heard (its renewal queued) and answered 503 `store_unavailable`: no
/// lease carries it for now. Taken again once renewals are.
#[tokio::test(start_paused = true)]
async fn a_heartbeat_is_unavailable_while_renewals_are_unacknowledged() {
    let (store, r) = open();
    timed_running(&store, &r).await;
    r.heartbeat("t1", "web").unwrap();
    store.0.lock().unwrap().unrenewed = true;
    tokio::time::sleep(TTL).await;
    let before = renewals(&store).len();
    let refused = r.heartbeat("t1", "web").unwrap_err();
    assert!(
        matches!(refused, RegistryError::Unrenewed { .. }),
        "{refused:?}"
    );
    assert_eq!(renewals(&store).len(), before + 1, "its renewal still sent");
    store.0.lock().unwrap().unrenewed = false;
    r.heartbeat("t1", "web").unwrap();
}

/// A grant decided on a replica's view that lags a change of the
/// semaphore is refused by the store (`Append::grants`), and decided again
/// on the newer view: here B saw a holder end while the limit was 2, but
/// not that A lowered it to 1 right after; its grant of the next task would
/// make two holders of a semaphore of limit 1.
#[tokio::test(start_paused = true)]
async fn a_grant_decided_on_a_view_that_missed_a_lower_limit_is_refused() {
    use crate::lifecycle::{Hold, SemName};
    let store = Arc::new(Held::default());
    let config = || RegistryConfig {
        clock: super::clock::Clock::tokio(),
        ..RegistryConfig::default()
    };
    let a = Registry::open(store.clone(), config()).unwrap();
    let b = Registry::open(store.clone(), config()).unwrap();
    fn db() -> SemName {
        SemName::parse("db").unwrap()
    }
    let job = || {
        AllocSpec::new(
            vec![TaskSpec {
                acquire: vec![db()],
                ..TaskSpec::named(TaskName::parse("web").unwrap())
            }],
            &Limits::default(),
        )
        .unwrap()
    };
    {
        let a = a.clone();
        let made = tokio::spawn(async move {
            a.put_semaphore(db(), 2, std::time::Duration::from_secs(600))
                .await
                .unwrap();
            for id in ["h", "t1", "t2"] {
                a.register(AllocId::parse(id).unwrap(), job())
                    .await
                    .unwrap();
            }
        });
        while !made.is_finished() {
            run_for(&store, std::time::Duration::from_millis(1)).await;
        }
    }
    let fence = |r: &Registry, id: &str| r.get(id).unwrap().tasks[0].fence();
    for _ in 0..1_000 {
        if fence(&a, "t1").is_some() && fence(&b, "t1").is_some() {
            break;
        }
        run_for(&store, std::time::Duration::from_millis(1)).await;
    }
    assert!(
        fence(&a, "h").is_some() && fence(&a, "t1").is_some(),
        "two holders of 2"
    );
    assert!(matches!(
        a.get("t2").unwrap().tasks[0].hold(),
        Some(Hold::Queued { .. })
    ));
    // h runs and ends, and A lowers the limit to 1: both committed, and
    // neither seen by either replica yet.
    let revision = |store: &Held| store.0.lock().unwrap().revision;
    let before = revision(&store);
    let ending = {
        let a = a.clone();
        tokio::spawn(async move {
            a.report("h", running()).await.unwrap();
        })
    };
    while revision(&store) == before {
        tokio::task::yield_now().await;
    }
    store.deliver();
    while !ending.is_finished() {
        tokio::task::yield_now().await;
    }
    let dead = {
        let a = a.clone();
        tokio::spawn(async move {
            let mut r = running();
            r[0].1.state = RunState::Dead;
            a.report("h", r).await.unwrap();
        })
    };
    let before = revision(&store);
    while revision(&store) == before {
        tokio::task::yield_now().await;
    }
    let h_dead = revision(&store);
    let lowered = {
        let a = a.clone();
        tokio::spawn(async move {
            a.put_semaphore(db(), 1, std::time::Duration::from_secs(600))
                .await
                .unwrap();
        })
    };
    while revision(&store) == h_dead {
        tokio::task::yield_now().await;
    }
    // B sees h end, not the lower limit: its judge grants t2.
    store.deliver_to(1, h_dead);
    let decided = |store: &Held| {
        let s = store.0.lock().unwrap();
        let t2 = s.records.get("t2").and_then(|r| r.1.tasks[0].fence());
        s.refused_grants > 0 || t2.is_some()
    };
    for _ in 0..10_000 {
        if decided(&store) {
            break;
        }
        tokio::task::yield_now().await;
    }
    // Every replica sees everything, and settles.
    while !(dead.is_finished() && lowered.is_finished()) {
        run_for(&store, std::time::Duration::from_millis(1)).await;
    }
    run_for(&store, std::time::Duration::from_millis(50)).await;
    for r in [&a, &b] {
        assert_eq!(fence(r, "t2"), None, "limit 1, and t1 holds it");
        assert_eq!(
            r.semaphore("db").unwrap().holders.len(),
            1,
            "one holder of a semaphore of limit 1"
        );
    }
    assert!(
        store.0.lock().unwrap().refused_grants > 0,
        "the stale grant was refused"
    );
}
