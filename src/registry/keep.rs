//! Signs of life where several replicas decide (a shared store: etcd):
//! what this replica's view knows of each task's liveness keys (`Kept`),
//! and the renewals of their leases it sends for the signs of life it
//! hears (`Keeper`).
//!
//! Whichever replica hears the agent renews the run's lease; the store
//! removes the live key when the lease expires; every replica's view sees
//! that, and the lost decision is an ordinary compare-and-swap write that
//! one replica wins (`timed.rs`). No replica's memory or clock measures a
//! silence: a replica that starts, restarts or heard nothing learns it from
//! the keys.
//!
//! Renewals are bounded per task and replica. A sign of life that comes
//! (a report, a heartbeat, the start of a wait) is sent at once unless one
//! was sent in the last third of the TTL (`every`); then it is sent when
//! that third is up, never dropped: the lease must not end before a TTL
//! after the latest sign heard. While a query for the task is parked here,
//! one renewal per `every` keeps the lease up. The end of a wait is sent at
//! once (at most one per `END_GAP`): it is the last sign of life of an
//! agent that died with its connections, and its renewal is what puts the
//! lease's expiry one TTL after the death rather than up to a third of a
//! TTL later.

use std::{
    cmp::Reverse,
    collections::BinaryHeap,
    sync::{
        Arc, Mutex, PoisonError, Weak,
        atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::sync::Notify;

use super::handle::Handle;
use crate::{
    lifecycle::Timestamp,
    store::{Lease, Mark, ReplicatedStore},
};

/// The end of a wait is sent at once, but not more often than this per
/// task and replica (a client that parks and ends many short waits).
pub(crate) const END_GAP: Duration = Duration::from_millis(100);

/// Renewals of a lease whose TTL this replica does not know yet (its mark
/// not seen): at most this often.
const EVERY_UNKNOWN: Duration = Duration::from_secs(1);

const NEVER: i64 = i64::MIN;
const NOT_DUE: i64 = i64::MAX;

/// What the view holds of a task's liveness keys.
#[derive(Clone, Debug, Default)]
pub(crate) struct Keys {
    /// The run's mark, if the store holds one.
    pub mark: Option<Mark>,
    /// Whether the run's live key is there.
    pub live: bool,
    /// When this replica's view saw the live key go (its clock).
    pub gone_at: Option<Timestamp>,
}

/// One task's liveness keys as this replica's view holds them, and this
/// replica's renewals of their lease.
#[derive(Debug)]
pub(crate) struct Kept {
    /// Written by the store's follower (in revision order), read by the
    /// decisions. A std lock, held only to copy or set the keys.
    keys: Mutex<Keys>,
    /// The live key's lease (0: no live key): what a sign of life renews.
    lease: AtomicI64,
    /// A third of the run's TTL, in milliseconds.
    every_ms: AtomicU64,
    /// When this replica last sent a renewal (the keeper's clock,
    /// nanoseconds; `NEVER`).
    sent: AtomicI64,
    /// A sign of life came that no renewal sent since covers.
    want: AtomicBool,
    /// When the keeper looks at the task next (`NOT_DUE`: it does not).
    due: AtomicI64,
    /// This replica is writing a mark for the run (`timed.rs`).
    pub(crate) marking: AtomicBool,
}

impl Default for Kept {
    fn default() -> Self {
        Self {
            keys: Mutex::default(),
            lease: AtomicI64::new(0),
            every_ms: AtomicU64::new(EVERY_UNKNOWN.as_millis() as u64),
            sent: AtomicI64::new(NEVER),
            want: AtomicBool::new(false),
            due: AtomicI64::new(NOT_DUE),
            marking: AtomicBool::new(false),
        }
    }
}

impl Kept {
    /// A copy of the keys as the view holds them.
    pub(crate) fn keys(&self) -> Keys {
        self.keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The store wrote (`Some`) or removed the run's mark.
    pub(crate) fn set_mark(&self, mark: Option<Mark>) {
        if let Some(m) = &mark {
            let every = (m.ttl / 3).max(Duration::from_millis(1));
            self.every_ms
                .store(every.as_millis() as u64, Ordering::Relaxed);
        }
        self.keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .mark = mark;
    }

    /// The store wrote the live key under `lease` (`Some`), or it went at
    /// `now`. True when it was written.
    pub(crate) fn set_live(&self, lease: Option<Lease>, now: Timestamp) -> bool {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        keys.live = lease.is_some();
        keys.gone_at = if lease.is_some() { None } else { Some(now) };
        drop(keys);
        // A new lease has had no renewal from here yet.
        self.sent.store(NEVER, Ordering::SeqCst);
        self.lease.store(lease.unwrap_or(0), Ordering::SeqCst);
        lease.is_some()
    }

    /// The view lists everything again: the keys it does not list are
    /// gone (at `now`, if the live key was there).
    pub(crate) fn forget(&self, now: Timestamp) {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        if keys.live {
            keys.gone_at = Some(now);
        }
        keys.live = false;
        keys.mark = None;
        drop(keys);
        self.lease.store(0, Ordering::SeqCst);
    }

    fn every(&self) -> i64 {
        let ms = self.every_ms.load(Ordering::Relaxed);
        i64::try_from(ms.saturating_mul(1_000_000)).unwrap_or(i64::MAX)
    }
}

/// Why the keeper is told about a task.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Sign {
    /// A sign of life came: a report, a heartbeat, the start of a wait.
    Came,
    /// A parked query for the task ended.
    Ended,
}

/// A moment at which the keeper looks at one task.
struct Due {
    at: i64,
    handle: Weak<Handle>,
    task: usize,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.at.cmp(&other.at)
    }
}

/// This replica's renewals: when each task's next one is due.
pub(crate) struct Keeper {
    /// The keeper's clock starts here (tokio's: paused in tests).
    base: tokio::time::Instant,
    /// A std lock, held to push or pop, never across an `.await`.
    heap: Mutex<BinaryHeap<Reverse<Due>>>,
    /// Woken when an entry earlier than the earliest is pushed.
    earlier: Notify,
    /// Whether the task that drives the heap runs.
    pub(crate) driving: AtomicBool,
    /// The registry was dropped.
    closed: AtomicBool,
}

impl Default for Keeper {
    fn default() -> Self {
        Self {
            base: tokio::time::Instant::now(),
            heap: Mutex::default(),
            earlier: Notify::new(),
            driving: AtomicBool::new(false),
            closed: AtomicBool::new(false),
        }
    }
}

impl Keeper {
    fn now(&self) -> i64 {
        i64::try_from(self.base.elapsed().as_nanos()).unwrap_or(i64::MAX)
    }

    /// A sign of life for task `i` heard here: a renewal now, or when the
    /// bound allows.
    pub(crate) fn sign(
        &self,
        store: &dyn ReplicatedStore,
        handle: &Arc<Handle>,
        i: usize,
        sign: Sign,
    ) {
        let Some(life) = handle.lives().life(i) else {
            return;
        };
        let k = &life.kept;
        if k.lease.load(Ordering::SeqCst) == 0 {
            // No live key seen yet (the view lags behind the write that
            // made the task running): sent once it is.
            k.want.store(true, Ordering::SeqCst);
            return;
        }
        let gap = match sign {
            Sign::Came => k.every(),
            Sign::Ended => k.every().min(END_GAP.as_nanos() as i64),
        };
        k.want.store(true, Ordering::SeqCst);
        let sent = k.sent.load(Ordering::SeqCst);
        let now = self.now();
        if sent == NEVER || now.saturating_sub(sent) >= gap {
            self.send(store, handle, i);
        } else {
            self.schedule(handle, i, sent.saturating_add(gap));
        }
    }

    /// The view saw task `i`'s live key written: renewed at once if a
    /// query for it is parked here or a sign of life waited for it.
    pub(crate) fn lease_known(&self, store: &dyn ReplicatedStore, handle: &Arc<Handle>, i: usize) {
        let Some(life) = handle.lives().life(i) else {
            return;
        };
        if life.is_parked() || life.kept.want.load(Ordering::SeqCst) {
            self.send(store, handle, i);
        }
    }

    /// Sends a renewal of task `i`'s lease now (if it has one and a sign
    /// of life or a parked query wants it), and schedules the next while a
    /// query is parked.
    fn send(&self, store: &dyn ReplicatedStore, handle: &Arc<Handle>, i: usize) {
        let Some(life) = handle.lives().life(i) else {
            return;
        };
        let k = &life.kept;
        let lease = k.lease.load(Ordering::SeqCst);
        if lease == 0 {
            return;
        }
        let wanted = k.want.swap(false, Ordering::SeqCst);
        let parked = life.is_parked();
        if !wanted && !parked {
            return;
        }
        let now = self.now();
        k.sent.store(now, Ordering::SeqCst);
        store.keep_alive(lease);
        if parked {
            self.schedule(handle, i, now.saturating_add(k.every()));
        }
    }

    /// Looks at task `i` again at `at`, unless it is due as early already.
    fn schedule(&self, handle: &Arc<Handle>, i: usize, at: i64) {
        let Some(life) = handle.lives().life(i) else {
            return;
        };
        if life.kept.due.fetch_min(at, Ordering::SeqCst) <= at {
            return;
        }
        let mut heap = self.heap.lock().unwrap_or_else(PoisonError::into_inner);
        let earliest = heap.peek().is_none_or(|Reverse(d)| at < d.at);
        heap.push(Reverse(Due {
            at,
            handle: Arc::downgrade(handle),
            task: i,
        }));
        drop(heap);
        if earliest {
            self.earlier.notify_one();
        }
    }

    /// Sends what is due by now; the time of the next entry.
    fn run_due(&self, store: &dyn ReplicatedStore) -> Option<i64> {
        loop {
            let now = self.now();
            let due = {
                let mut heap = self.heap.lock().unwrap_or_else(PoisonError::into_inner);
                match heap.peek() {
                    Some(Reverse(d)) if d.at <= now => heap.pop().map(|Reverse(d)| d),
                    Some(Reverse(d)) => return Some(d.at),
                    None => return None,
                }
            };
            let due = due?;
            let Some(handle) = due.handle.upgrade() else {
                continue;
            };
            let Some(life) = handle.lives().life(due.task) else {
                continue;
            };
            let k = &life.kept;
            // Current only if the task still waits for this moment.
            if k.due
                .compare_exchange(due.at, NOT_DUE, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
            {
                continue;
            }
            let sent = k.sent.load(Ordering::SeqCst);
            let every = k.every();
            let refresh = life.is_parked() && now.saturating_sub(sent) >= every;
            if k.want.load(Ordering::SeqCst) || refresh {
                k.want.store(true, Ordering::SeqCst);
                self.send(store, &handle, due.task);
            } else if life.is_parked() {
                self.schedule(&handle, due.task, sent.saturating_add(every));
            }
        }
    }

    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.earlier.notify_one();
    }

    /// Renews leases as they come due, until the registry is dropped.
    pub(crate) async fn drive(me: Weak<super::Inner>, keeper: Arc<Keeper>) {
        loop {
            let earlier = keeper.earlier.notified();
            let mut earlier = std::pin::pin!(earlier);
            earlier.as_mut().enable();
            let next = {
                let Some(inner) = me.upgrade() else { return };
                if keeper.closed.load(Ordering::SeqCst) {
                    return;
                }
                let Some(store) = inner.store.replicated() else {
                    return;
                };
                keeper.run_due(store)
            };
            match next {
                Some(at) => {
                    let wait = Duration::from_nanos(u64::try_from(at - keeper.now()).unwrap_or(0));
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = earlier => {}
                    }
                }
                None => earlier.await,
            }
        }
    }
}
