//! Time in the registry: its clock, every allocation's next moment to be
//! looked at (one heap for all of them), and the signs of life of tasks
//! under a TTL.
//!
//! `lifecycle/` decides what time does (`Allocation::tick`) and says when
//! it must be asked again (`Allocation::wake_at`); this module only keeps
//! those moments and wakes on the earliest. One task drives the heap,
//! however many allocations it holds: a million allocations with TTLs are
//! a million heap entries, not a million timers.
//!
//! An entry is never moved later. A sign of life (a heartbeat, a report,
//! a parked query) only stores a time in its task's slot; when the entry
//! comes due the allocation is asked again, finds its tasks alive, and is
//! put back at the new moment. So a heartbeat costs an atomic store, and
//! an allocation costs one heap operation per TTL at most.
//!
//! With a store several replicas share, a task's silence is measured by
//! the store, not here: each slot also holds what this replica's view
//! knows of the task's liveness keys and its own renewals of their lease
//! (`keep.rs`).

use std::{
    cmp::Reverse,
    collections::BinaryHeap,
    sync::{
        Arc, Mutex, OnceLock, PoisonError, Weak,
        atomic::{AtomicI64, AtomicU32, Ordering},
    },
    time::Duration,
};

use time::OffsetDateTime;
use tokio::sync::Notify;

use super::handle::Handle;
use crate::lifecycle::Timestamp;

/// Where the registry reads the time. Tests run it on tokio's clock, which
/// `tokio::time::pause` stops and `advance` moves; the server reads the
/// system's.
#[derive(Clone)]
pub struct Clock(ClockKind);

#[derive(Clone)]
enum ClockKind {
    System,
    /// The wall time at `base`, moved on by tokio's clock since.
    Tokio {
        wall: OffsetDateTime,
        base: tokio::time::Instant,
    },
}

impl Clock {
    pub fn system() -> Self {
        Self(ClockKind::System)
    }

    /// Wall time that follows tokio's clock (for tests with paused time).
    pub fn tokio() -> Self {
        Self(ClockKind::Tokio {
            wall: OffsetDateTime::now_utc(),
            base: tokio::time::Instant::now(),
        })
    }

    pub fn now(&self) -> Timestamp {
        match &self.0 {
            ClockKind::System => OffsetDateTime::now_utc(),
            ClockKind::Tokio { wall, base } => *wall + base.elapsed(),
        }
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::system()
    }
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            ClockKind::System => f.write_str("Clock::system"),
            ClockKind::Tokio { .. } => f.write_str("Clock::tokio"),
        }
    }
}

/// A time as the nanoseconds since the Unix epoch that fit an `i64`
/// (until the year 2262), saturating.
pub(crate) fn nanos(t: Timestamp) -> i64 {
    i64::try_from(t.unix_timestamp_nanos()).unwrap_or(if t.year() < 1970 {
        i64::MIN + 1
    } else {
        i64::MAX - 1
    })
}

fn from_nanos(n: i64) -> Timestamp {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(n)).unwrap_or(OffsetDateTime::UNIX_EPOCH)
}

/// Nothing scheduled; no sign of life known.
const NONE: i64 = i64::MAX;
const NEVER_SEEN: i64 = i64::MIN;

/// One task's signs of life.
#[derive(Debug)]
pub(crate) struct Life {
    /// The latest sign of life (nanoseconds, `NEVER_SEEN`: none).
    seen: AtomicI64,
    /// Queries for the task parked now: each one is a sign of life for as
    /// long as it waits.
    parked: AtomicU32,
    /// With a store several replicas share: its liveness keys and this
    /// replica's renewals (`keep.rs`).
    pub(crate) kept: super::keep::Kept,
}

/// The signs of life of an allocation's tasks, made for allocations whose
/// tasks run under a TTL (the others pay the empty cell, no block).
#[derive(Debug, Default)]
pub(crate) struct Lives(OnceLock<Arc<[Life]>>);

impl Lives {
    /// The table for `tasks` tasks, made on first use with every task's
    /// last sign of life at `since` (`None`: never).
    fn table(&self, tasks: usize, since: Option<Timestamp>) -> &Arc<[Life]> {
        self.0.get_or_init(|| {
            let seen = since.map_or(NEVER_SEEN, nanos);
            (0..tasks)
                .map(|_| Life {
                    seen: AtomicI64::new(seen),
                    parked: AtomicU32::new(0),
                    kept: super::keep::Kept::default(),
                })
                .collect()
        })
    }

    /// Every task alive at `now` (a server that just loaded its store
    /// gives every running task a full TTL).
    pub(crate) fn init_at(&self, tasks: usize, now: Timestamp) {
        self.table(tasks, Some(now));
    }

    /// Whether the table was made (the allocation runs tasks under a TTL,
    /// or the store keeps liveness keys for it).
    pub(crate) fn made(&self) -> bool {
        self.0.get().is_some()
    }

    /// Task `i`'s slot, if the table was made.
    pub(crate) fn life(&self, i: usize) -> Option<&Life> {
        self.0.get()?.get(i)
    }

    /// Task `i`'s slot, the table made for `tasks` tasks if it was not.
    pub(crate) fn life_made(&self, tasks: usize, i: usize) -> Option<&Life> {
        self.table(tasks, None).get(i)
    }

    /// Every slot (none if the table was not made).
    pub(crate) fn all(&self) -> &[Life] {
        self.0.get().map_or(&[], |t| t)
    }

    /// A sign of life for task `i` at `now`.
    pub(crate) fn touch(&self, tasks: usize, i: usize, now: Timestamp) {
        if let Some(life) = self.table(tasks, None).get(i) {
            life.seen.fetch_max(nanos(now), Ordering::Relaxed);
        }
    }

    /// The latest sign of life of task `i` as of `now` (a parked query is
    /// one now).
    pub(crate) fn seen(&self, i: usize, now: Timestamp) -> Option<Timestamp> {
        let life = self.0.get()?.get(i)?;
        if life.parked.load(Ordering::Relaxed) > 0 {
            return Some(now);
        }
        match life.seen.load(Ordering::Relaxed) {
            NEVER_SEEN => None,
            n => Some(from_nanos(n)),
        }
    }

    /// Counts a query for task `i` parked while the guard lives; its end
    /// is a sign of life too, after which `ended` runs (a replica renews
    /// the task's lease then).
    pub(crate) fn park(
        &self,
        tasks: usize,
        i: usize,
        clock: Clock,
        ended: Option<Box<dyn FnOnce() + Send>>,
    ) -> ParkedLife {
        let table = self.table(tasks, None).clone();
        if let Some(life) = table.get(i) {
            life.parked.fetch_add(1, Ordering::Relaxed);
        }
        ParkedLife {
            table,
            i,
            clock,
            ended,
        }
    }
}

impl Life {
    /// Whether a query for the task is parked now.
    pub(crate) fn is_parked(&self) -> bool {
        self.parked.load(Ordering::Relaxed) > 0
    }

    /// The latest sign of life stored (a parked query not counted as one
    /// now).
    pub(crate) fn last_seen(&self) -> Option<Timestamp> {
        match self.seen.load(Ordering::Relaxed) {
            NEVER_SEEN => None,
            n => Some(from_nanos(n)),
        }
    }
}

/// A query parked for a task (see `Lives::park`).
pub(crate) struct ParkedLife {
    table: Arc<[Life]>,
    i: usize,
    clock: Clock,
    ended: Option<Box<dyn FnOnce() + Send>>,
}

impl Drop for ParkedLife {
    fn drop(&mut self) {
        if let Some(life) = self.table.get(self.i) {
            // The end of the wait is its last moment of life: stored
            // before the count drops, so no moment reads neither.
            life.seen
                .fetch_max(nanos(self.clock.now()), Ordering::Relaxed);
            life.parked.fetch_sub(1, Ordering::Relaxed);
        }
        if let Some(ended) = self.ended.take() {
            ended();
        }
    }
}

/// A heap entry: look at `handle` at `at`.
struct Entry {
    at: i64,
    handle: Weak<Handle>,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.at.cmp(&other.at)
    }
}

/// Every allocation's next moment, earliest first.
#[derive(Default)]
pub(crate) struct Timers {
    /// A std lock: held to push or pop, never across an `.await`.
    heap: Mutex<Heap>,
    /// Woken when an entry earlier than the earliest is pushed, and when
    /// the registry goes.
    earlier: Notify,
    /// The registry was dropped: the driver ends.
    closed: std::sync::atomic::AtomicBool,
}

/// The heap and what keeps it small.
#[derive(Default)]
struct Heap {
    entries: BinaryHeap<Reverse<Entry>>,
    /// The heap's length after the last sweep: the next one comes when it
    /// has doubled.
    swept: usize,
}

impl Heap {
    /// Drops the entries no handle waits for any more: an allocation
    /// deleted, or one scheduled earlier since (an entry is never moved,
    /// so each earlier schedule leaves the later entry behind). Swept as
    /// the heap doubles, which keeps it within about twice the allocations
    /// that wait, at a constant cost per push.
    fn sweep_if_doubled(&mut self) {
        if self.entries.len() < 2 * self.swept.max(512) {
            return;
        }
        self.entries.retain(|Reverse(e)| {
            e.handle.upgrade().is_some_and(|h| {
                h.scheduled().0.load(Ordering::SeqCst) == e.at && h.current().is_some()
            })
        });
        self.swept = self.entries.len();
    }
}

/// What a handle keeps of its place in the heap.
#[derive(Debug)]
pub(crate) struct Scheduled(AtomicI64);

impl Default for Scheduled {
    fn default() -> Self {
        Self(AtomicI64::new(NONE))
    }
}

impl Timers {
    /// Looks at `handle` again at `at`, unless it is already due as early.
    pub(crate) fn schedule(&self, handle: &Arc<Handle>, at: Timestamp) {
        let at = nanos(at);
        let slot = &handle.scheduled().0;
        // Only ever earlier: an entry already due sooner looks at the
        // allocation then and puts it back where it belongs.
        if slot.fetch_min(at, Ordering::SeqCst) <= at {
            return;
        }
        let mut heap = self.heap.lock().unwrap_or_else(PoisonError::into_inner);
        let earliest = heap.entries.peek().is_none_or(|Reverse(e)| at < e.at);
        heap.entries.push(Reverse(Entry {
            at,
            handle: Arc::downgrade(handle),
        }));
        heap.sweep_if_doubled();
        drop(heap);
        if earliest {
            self.earlier.notify_one();
        }
    }

    /// Entries due by `now`, each taken out of its handle's slot (an
    /// entry replaced by an earlier one is dropped here), and the time of
    /// the next one.
    pub(crate) fn due(&self, now: Timestamp, max: usize) -> (Vec<Arc<Handle>>, Option<Timestamp>) {
        let now = nanos(now);
        let mut heap = self.heap.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out = Vec::new();
        while out.len() < max {
            match heap.entries.peek() {
                Some(Reverse(e)) if e.at <= now => {}
                _ => break,
            }
            let Reverse(e) = heap.entries.pop().expect("peeked");
            let Some(handle) = e.handle.upgrade() else {
                continue;
            };
            // Current only if the handle still waits for this moment.
            if handle
                .scheduled()
                .0
                .compare_exchange(e.at, NONE, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                out.push(handle);
            }
        }
        let next = heap.entries.peek().map(|Reverse(e)| from_nanos(e.at));
        (out, next)
    }

    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.earlier.notify_one();
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Entries held, stale ones included.
    pub(crate) fn len(&self) -> usize {
        self.heap
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entries
            .len()
    }

    /// Resolves when an entry earlier than the earliest was pushed.
    pub(crate) fn earlier(&self) -> tokio::sync::futures::Notified<'_> {
        self.earlier.notified()
    }
}

/// How long to sleep until `at`, read on `clock`.
pub(crate) fn until(clock: &Clock, at: Timestamp) -> Duration {
    let left = at - clock.now();
    Duration::try_from(left).unwrap_or(Duration::ZERO)
}
