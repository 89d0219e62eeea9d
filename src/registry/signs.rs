//! One allocation's signs of life as its handle keeps them: each task's
//! latest sign and parked queries, and, with a store that keeps leases,
//! what this replica's view holds of the task's liveness keys and its own
//! renewals of their lease. The rules that read them are in `lives.rs`.

use std::{
    sync::{
        Arc, Mutex, OnceLock, PoisonError,
        atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering},
    },
    time::Duration,
};

use super::clock::{Clock, from_nanos, nanos};
use crate::{
    lifecycle::Timestamp,
    store::{Lease, Mark},
};

/// No sign of life known.
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
    /// replica's renewals.
    pub(crate) kept: Kept,
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
                    kept: Kept::default(),
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

/// The end of a wait is sent at once, but not more often than this per
/// task and replica (a client that parks and ends many short waits).
pub(crate) const END_GAP: Duration = Duration::from_millis(100);

/// Renewals of a lease whose TTL this replica does not know yet (its mark
/// not seen): at most this often.
const EVERY_UNKNOWN: Duration = Duration::from_secs(1);

pub(super) const NEVER: i64 = i64::MIN;
pub(super) const NOT_DUE: i64 = i64::MAX;

/// What the view holds of a task's liveness keys.
#[derive(Clone, Debug, Default)]
pub(crate) struct Keys {
    /// The run's mark, if the store holds one.
    pub mark: Option<Mark>,
    /// Whether the run's live key is there.
    pub live: bool,
    /// When this replica's view saw the live key go (its clock), or found
    /// the run's mark without it (a listing).
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
    pub(super) lease: AtomicI64,
    /// A third of the run's TTL, in milliseconds.
    pub(super) every_ms: AtomicU64,
    /// When this replica last sent a renewal (the due-time heap's clock,
    /// `Timers::now`; `NEVER`).
    pub(super) sent: AtomicI64,
    /// The lease that renewal went to (0: none since a new one was seen).
    pub(super) sent_on: AtomicI64,
    /// A sign of life came that no renewal sent since covers.
    pub(super) want: AtomicBool,
    /// When the due-time heap looks at the task's renewal next (its
    /// clock; `NOT_DUE`: it does not).
    pub(super) due: AtomicI64,
    /// This replica is writing a mark for the run (`mark_runs`).
    pub(crate) marking: AtomicBool,
}

impl Default for Kept {
    fn default() -> Self {
        Self {
            keys: Mutex::default(),
            lease: AtomicI64::new(0),
            every_ms: AtomicU64::new(EVERY_UNKNOWN.as_millis() as u64),
            sent: AtomicI64::new(NEVER),
            sent_on: AtomicI64::new(0),
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

    /// The store wrote (`Some`) or removed the run's mark, seen at `now`.
    /// A mark without its live key (listed after the key went) counts as
    /// the key gone now: the view learns it then.
    pub(crate) fn set_mark(&self, mark: Option<Mark>, now: Timestamp) {
        if let Some(m) = &mark {
            let every = (m.ttl / 3).max(Duration::from_millis(1));
            self.every_ms
                .store(every.as_millis() as u64, Ordering::Relaxed);
        }
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        if mark.is_some() && !keys.live && keys.gone_at.is_none() {
            keys.gone_at = Some(now);
        }
        keys.mark = mark;
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
        if let Some(new) = lease {
            // The last sign heard here renewed another run's lease: this
            // view had not seen the run end yet, and the sign may have
            // been the new run's agent. Renewed again once the new lease
            // is known (`Inner::lease_known`), never spent on a lease
            // nobody needs.
            let old = self.sent_on.swap(0, Ordering::SeqCst);
            if old != 0 && old != new {
                self.want.store(true, Ordering::SeqCst);
            }
        }
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

    pub(super) fn every(&self) -> i64 {
        let ms = self.every_ms.load(Ordering::Relaxed);
        i64::try_from(ms.saturating_mul(1_000_000)).unwrap_or(i64::MAX)
    }
}
