//! Time in the registry: its clock, the one due-time heap that holds every
//! timer, and what time does to an allocation.
//!
//! `lifecycle/` decides what time does (`Allocation::tick`) and says when
//! it must be asked again (`Allocation::wake_at`); this module only keeps
//! those moments and wakes on the earliest. One heap holds every timer —
//! an allocation to look at (a TTL, a deadline), a lease to renew
//! (`lives.rs`) — and one task drives it, however many it holds: a million
//! allocations with TTLs are a million heap entries, not a million timers.
//!
//! An entry is never moved later. A sign of life (a heartbeat, a report, a
//! parked query) only stores a time in its task's slot; when the entry
//! comes due the allocation is asked again, finds its tasks alive, and is
//! put back at the new moment. So a heartbeat costs an atomic store, and an
//! allocation costs one heap operation per TTL at most.
//!
//! The heap counts on tokio's monotonic clock (paused in tests); a moment
//! the rules give as a wall time is put on it when it is scheduled, and
//! the look at it reads the wall time again, so a wall clock that moves
//! costs an extra look, never a missed one.

use std::{
    cmp::Reverse,
    collections::BinaryHeap,
    sync::{
        Arc, Mutex, PoisonError, Weak,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use tokio::sync::Notify;

use super::{
    Inner, Registry, RegistryError,
    clock::Clock,
    handle::{Handle, NOT_SCHEDULED},
    signs::NOT_DUE,
};
use crate::lifecycle::{Allocation, Timestamp, UNTIL_TOLD};

/// Allocations looked at together at most: a restart after a long outage
/// can find a million deadlines due at once.
const MAX_LOOKING: usize = 256;

/// After a look that failed (the store refused the write), the next try.
const RETRY: Duration = Duration::from_secs(1);

/// What comes due.
#[derive(Clone, Copy)]
enum Due {
    /// Look at the allocation (`Registry::look_at`).
    Look,
    /// Renew the lease of a task's run (`Inner::renewal_due`).
    Renew(usize),
}

/// A heap entry: `what` of `handle` at `at` (the heap's clock).
struct Entry {
    at: i64,
    handle: Weak<Handle>,
    what: Due,
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

impl Entry {
    /// Whether the entry's handle still waits for this moment; taken out
    /// of its slot if it does (an entry replaced by an earlier one is not).
    fn take(&self, handle: &Handle) -> bool {
        let slot = match self.what {
            Due::Look => &handle.scheduled,
            Due::Renew(i) => match handle.lives().life(i) {
                Some(life) => &life.kept.due,
                None => return false,
            },
        };
        let none = match self.what {
            Due::Look => NOT_SCHEDULED,
            Due::Renew(_) => NOT_DUE,
        };
        slot.compare_exchange(self.at, none, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// Whether the entry is one its handle still waits for.
    fn current(&self) -> bool {
        self.handle.upgrade().is_some_and(|h| {
            let at = match self.what {
                Due::Look => h.scheduled.load(Ordering::SeqCst),
                Due::Renew(i) => h
                    .lives()
                    .life(i)
                    .map_or(NOT_DUE, |l| l.kept.due.load(Ordering::SeqCst)),
            };
            at == self.at && h.current().is_some()
        })
    }
}

/// Every timer, earliest first.
pub(super) struct Timers {
    /// The heap's clock starts here (tokio's: paused in tests).
    base: tokio::time::Instant,
    /// The wall clock the rules' moments are read on.
    clock: Clock,
    /// A std lock: held to push or pop, never across an `.await`.
    heap: Mutex<Heap>,
    /// Woken when an entry earlier than the earliest is pushed, and when
    /// the registry goes.
    earlier: Notify,
    /// Whether the task that drives the heap runs (started on first use,
    /// inside a runtime).
    driving: AtomicBool,
    /// The registry was dropped: the driver ends.
    closed: AtomicBool,
    /// Places for looks running at once.
    looking: Arc<tokio::sync::Semaphore>,
    /// A test's way to make the driver panic once.
    #[cfg(test)]
    pub(super) panic_once: AtomicBool,
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
    /// the heap doubles, which keeps it within about twice the entries
    /// waited for, at a constant cost per push.
    fn sweep_if_doubled(&mut self) {
        if self.entries.len() < 2 * self.swept.max(512) {
            return;
        }
        self.entries.retain(|Reverse(e)| e.current());
        self.swept = self.entries.len();
    }
}

impl Timers {
    pub(super) fn new(clock: Clock) -> Self {
        Self {
            base: tokio::time::Instant::now(),
            clock,
            heap: Mutex::default(),
            earlier: Notify::new(),
            driving: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            looking: Arc::new(tokio::sync::Semaphore::new(MAX_LOOKING)),
            #[cfg(test)]
            panic_once: AtomicBool::new(false),
        }
    }

    /// The heap's time now: nanoseconds since it started.
    pub(super) fn now(&self) -> i64 {
        i64::try_from(self.base.elapsed().as_nanos()).unwrap_or(i64::MAX)
    }

    /// The heap's time of the wall time `at`.
    fn of_wall(&self, at: Timestamp) -> i64 {
        let left = at - self.clock.now();
        let left = i64::try_from(left.whole_nanoseconds()).unwrap_or(if left.is_negative() {
            i64::MIN
        } else {
            i64::MAX
        });
        self.now().saturating_add(left.max(0))
    }

    /// Puts `what` of `handle` at `at` (the heap's clock) in the heap,
    /// unless its slot is already due as early. True if it was the new
    /// earliest.
    fn push(&self, handle: &Arc<Handle>, at: i64, what: Due) -> bool {
        let slot = match what {
            Due::Look => &handle.scheduled,
            Due::Renew(i) => match handle.lives().life(i) {
                Some(life) => &life.kept.due,
                None => return false,
            },
        };
        // Only ever earlier: an entry already due sooner looks then and
        // puts it back where it belongs.
        if slot.fetch_min(at, Ordering::SeqCst) <= at {
            return false;
        }
        let mut heap = self.heap.lock().unwrap_or_else(PoisonError::into_inner);
        let earliest = heap.entries.peek().is_none_or(|Reverse(e)| at < e.at);
        heap.entries.push(Reverse(Entry {
            at,
            handle: Arc::downgrade(handle),
            what,
        }));
        heap.sweep_if_doubled();
        drop(heap);
        if earliest {
            self.earlier.notify_one();
        }
        earliest
    }

    /// Entries due by now, each taken out of its handle's slot, and the
    /// time of the next one.
    fn due(&self, max: usize) -> (Vec<(Arc<Handle>, Due)>, Option<i64>) {
        let now = self.now();
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
            if e.take(&handle) {
                out.push((handle, e.what));
            }
        }
        let next = heap.entries.peek().map(|Reverse(e)| e.at);
        (out, next)
    }

    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.earlier.notify_one();
    }

    /// Entries held, stale ones included.
    pub(super) fn len(&self) -> usize {
        self.heap
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entries
            .len()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The driver holds the registry weakly: wake it to see it is gone.
        self.timers.close();
    }
}

impl Inner {
    /// Puts a timed allocation's next moment in the heap. Called after
    /// every publication and every look; cheap for an allocation that
    /// uses no TTL and no deadline (one check of its spec).
    pub(super) fn reschedule(&self, handle: &Arc<Handle>, a: &Allocation) {
        let default = self.config.default_liveness_ttl;
        // Leased, a task may run under another replica's default TTL:
        // its liveness keys are watched here all the same (`lease_due`).
        let watched = self.lives_leased() && handle.lives().made();
        if !(a.spec.timed(default) || a.spec.gated() || watched) {
            return;
        }
        // Leased, the view decides only once it holds all of `a` (the
        // liveness keys written with it included): the follower looks
        // again then.
        if self.lives_leased() && !self.view_holds(a) {
            return;
        }
        let now = self.config.clock.now();
        let leases = self.lease_due(handle, a);
        let seen = self.seen(handle, now);
        let time = a.wake_at(&seen, default).filter(|&at| at != UNTIL_TOLD);
        let grants = self.gates.lapses_at(a);
        let barriers = self.gates.barrier_due(a, now);
        if let Some(at) = [leases, time, grants, barriers].into_iter().flatten().min() {
            self.schedule(handle, at);
        }
    }

    /// Looks at `handle`'s allocation at `at` (a wall time).
    pub(super) fn schedule(&self, handle: &Arc<Handle>, at: Timestamp) {
        self.timers.push(handle, self.timers.of_wall(at), Due::Look);
        self.drive();
    }

    /// Renews task `i`'s lease at `at` (the heap's clock).
    pub(super) fn renew_at(&self, handle: &Arc<Handle>, i: usize, at: i64) {
        self.timers.push(handle, at, Due::Renew(i));
        self.drive();
    }

    /// Starts the task that drives the heap, once, inside a runtime; the
    /// supervisor starts it again if it panics.
    pub(super) fn drive(&self) {
        self.keep_once(&self.timers.driving, "timers", || {
            let (me, timers) = (self.me.clone(), self.timers.clone());
            move || drive(me.clone(), timers.clone())
        });
    }
}

/// Runs what comes due, until the registry is dropped. Holds the heap,
/// not the registry, while it waits. Each look runs in a task of its own
/// (at most `MAX_LOOKING` at once), so a driver that panics and is started
/// again loses none that it took out of the heap.
async fn drive(me: Weak<Inner>, timers: Arc<Timers>) {
    loop {
        let earlier = timers.earlier.notified();
        let mut earlier = std::pin::pin!(earlier);
        // Registered before the heap is read: a push after the read wakes
        // this wait.
        earlier.as_mut().enable();
        let next = {
            let Some(inner) = me.upgrade() else { return };
            if timers.closed.load(Ordering::SeqCst) {
                return;
            }
            #[cfg(test)]
            if timers.panic_once.swap(false, Ordering::SeqCst) {
                panic!("a test's panic in the timer driver");
            }
            // Places for looks first: an entry is taken out of the heap
            // only once its look can start.
            let places = timers.looking.available_permits().min(MAX_LOOKING);
            if places == 0 {
                drop(inner);
                let place = timers.looking.clone().acquire_owned().await;
                drop(place);
                continue;
            }
            let (due, next) = timers.due(places);
            let more = !due.is_empty();
            for (handle, what) in due {
                match what {
                    Due::Renew(i) => inner.renewal_due(&handle, i),
                    Due::Look => {
                        let place = timers
                            .looking
                            .clone()
                            .try_acquire_owned()
                            .expect("counted above");
                        let r = Registry {
                            inner: inner.clone(),
                        };
                        tokio::spawn(async move {
                            r.look_at(handle).await;
                            drop(place);
                        });
                    }
                }
            }
            if more {
                continue;
            }
            next
        };
        match next {
            Some(at) => {
                let wait = u64::try_from(at.saturating_sub(timers.now())).unwrap_or(0);
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_nanos(wait)) => {}
                    () = earlier => {}
                }
            }
            None => earlier.await,
        }
    }
}

impl Registry {
    /// The registry's time now.
    pub(super) fn now(&self) -> Timestamp {
        self.inner.config.clock.now()
    }

    /// Whether nothing is due on the heap by now and no look runs (a
    /// test's way to know that time has done all it will until it moves).
    #[cfg(test)]
    pub(super) fn timers_idle(&self) -> bool {
        let timers = &self.inner.timers;
        let now = timers.now();
        let due = timers
            .heap
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entries
            .iter()
            .any(|Reverse(e)| e.at <= now && e.current());
        !due && timers.looking.available_permits() == MAX_LOOKING
    }

    /// An allocation's moment came: what time alone does to it is decided
    /// and written like any change, then its next moment is scheduled.
    async fn look_at(&self, handle: Arc<Handle>) {
        let Some(a) = handle.current() else { return };
        let default = self.inner.config.default_liveness_ttl;
        let now = self.now();
        let inner = &self.inner;
        let due = (0..a.tasks.len()).any(|i| inner.lapsed(&handle, &a, i).is_some())
            || a.wake_at(&inner.seen(&handle, now), default)
                .is_some_and(|at| at <= now);
        if due {
            let decided = self
                .write(
                    handle.id(),
                    |a, next_index| {
                        let now = self.now();
                        let seen = inner.seen(&handle, now);
                        let lapsed = |i| inner.lapsed(&handle, a, i);
                        Ok((a.tick_lapsed(now, &seen, &lapsed, default, next_index), ()))
                    },
                    |_| {},
                )
                .await;
            match decided {
                Ok(_) => {}
                Err(RegistryError::AllocationNotFound(_) | RegistryError::Deleted(_)) => return,
                Err(e) => {
                    tracing::warn!(alloc = %handle.id(), error = %e, "a deadline or TTL that passed could not be recorded; trying again");
                    self.inner.schedule(&handle, self.now() + RETRY);
                    return;
                }
            }
        }
        if let Some(a) = handle.current()
            && inner.gates.lapses_at(&a).is_some_and(|at| at <= self.now())
            && let Err(e) = self.lapse_grants(handle.id()).await
        {
            tracing::warn!(alloc = %handle.id(), error = %e, "a semaphore's grant that lapsed could not be recorded; trying again");
            self.inner.schedule(&handle, self.now() + RETRY);
            return;
        }
        if let Some(a) = handle.current() {
            self.inner.reschedule(&handle, &a);
        }
    }
}
