//! The runtime: one handle per allocation, the view the store's follower
//! keeps, and waiting.
//!
//! One way through, for every store (`write.rs`): lock the allocation,
//! decide with `lifecycle`, append to the store, wait until the store's
//! follower has published the change's index, answer. Publication happens
//! in one place, the follower (`follow.rs`): the records readers and
//! parked waiters see, the timelines, the event feed, the timers and the
//! dependents' judging. So no caller ever sees a record that a crash could
//! take back, and every replica of a shared store publishes the same
//! changes in the same order.
//!
//! | file | its job |
//! |---|---|
//! | `write.rs` | the write path: registrations, reports, restarts, deletions |
//! | `follow.rs` | the follower: publishing committed changes; the view's index |
//! | `handle.rs` | one allocation's runtime state and its locks |
//! | `map.rs` | allocation ID → handle |
//! | `clock.rs` | where the time comes from |
//! | `time.rs` | the one due-time heap, and what time does |
//! | `signs.rs` | each task's signs of life, as its handle keeps them |
//! | `lives.rs` | how a task's silence is measured, and lease renewals |
//! | `judge.rs` | dependencies between allocations, and the graph walk |
//! | `gates.rs` | semaphores: their lines and the grants; the judge |
//! | `barriers.rs` | barriers: their members and decisions |
//! | `wait.rs` | long-polls, blocking queries, the event stream's readers |
//! | `feed.rs`, `timeline.rs` | the event stream's changes; each allocation's history |
//! | `traces.rs` | each allocation's trace (OpenTelemetry), when traces are on |
//!
//! This module must not know HTTP: it speaks allocations, task names and
//! durations.

mod barriers;
mod clock;
mod error;
pub mod feed;
mod follow;
mod gates;
mod handle;
mod judge;
mod lives;
mod map;
mod signs;
mod time;
pub mod timeline;
mod traces;
mod wait;
mod write;

pub use barriers::{BarrierPhase, BarrierState, Gathering};
pub use clock::Clock;
pub use error::{Quota, RegistryError, RestartTarget};
pub use gates::{Holder, Place, SemaphoreState, Waiting};
pub use judge::{DEFAULT_MAX_DEPENDENTS, MAX_REACH};
pub use lives::{GRACE, Signs};
pub use traces::Traces;
pub use wait::{Querier, Subscription};

use std::sync::{
    Arc, Mutex, PoisonError, RwLock,
    atomic::{AtomicBool, AtomicUsize, Ordering},
};

use tokio::sync::watch;

use crate::{
    lifecycle::{AllocId, Allocation, Limits, SpecInterner},
    metrics::Metrics,
    store::{Store, StoreError},
};
use handle::Handle;
use map::AllocMap;

/// Runtime settings of the registry.
#[derive(Clone)]
pub struct RegistryConfig {
    pub limits: Limits,
    /// Requests parked in long-polls and blocking queries at once.
    pub max_waiters: usize,
    /// Allocations registered at once; registering one more is
    /// `QuotaExceeded`.
    pub max_allocations: usize,
    /// Dependencies on one allocation's tasks that other allocations'
    /// tasks may declare together; a registration that would declare
    /// more is `QuotaExceeded`.
    pub max_dependents: usize,
    /// Where transitions, reports, restarts and stop orders are counted.
    pub metrics: Arc<Metrics>,
    /// Entries each allocation's timeline keeps (0: none).
    pub timeline_events: usize,
    /// Changes kept for the event stream's readers to resume from.
    pub event_buffer: usize,
    /// Most bytes of those changes kept rendered (the oldest go first).
    pub event_buffer_bytes: usize,
    /// The TTL of every task that declares none (`None`: such tasks are
    /// never declared lost).
    pub default_liveness_ttl: Option<std::time::Duration>,
    /// Where the time comes from (the system's; tokio's in tests).
    pub clock: Clock,
    /// Restarts the registry's long-lived task (the due-time heap's
    /// driver) if it panics, and tells health.
    pub supervisor: crate::supervise::Supervisor,
    /// Where each allocation's trace goes (`None`: traces are off, and
    /// nothing of them runs).
    pub traces: Option<Arc<Traces>>,
}

/// Entries an allocation's timeline keeps by default.
pub const DEFAULT_TIMELINE_EVENTS: usize = 64;

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            max_waiters: 100_000,
            max_allocations: DEFAULT_MAX_ALLOCATIONS,
            max_dependents: DEFAULT_MAX_DEPENDENTS,
            metrics: Arc::new(Metrics::new()),
            timeline_events: DEFAULT_TIMELINE_EVENTS,
            event_buffer: DEFAULT_EVENT_BUFFER,
            event_buffer_bytes: DEFAULT_EVENT_BUFFER_BYTES,
            default_liveness_ttl: None,
            clock: Clock::system(),
            supervisor: crate::supervise::Supervisor::default(),
            traces: None,
        }
    }
}

/// Changes the event stream keeps by default: a reader that falls this
/// far behind lists again. Each holds the allocation's version it tells
/// (a few KiB with full histories, which would otherwise be freed).
pub const DEFAULT_EVENT_BUFFER: usize = 4_096;

/// Bytes of rendered changes the event stream keeps by default.
pub const DEFAULT_EVENT_BUFFER_BYTES: usize = 64 << 20;

/// Allocations a filtered list page passes over at most before it
/// answers (`Registry::list`).
pub const MAX_SCANNED: usize = 10_000;

/// The largest global index: indexes are 0 to 2^63 - 1 in the API.
pub const MAX_INDEX: u64 = i64::MAX as u64;

/// Allocations a server holds at most, by default: at ~1 KiB each settled
/// and up to ~16 KiB with full event histories, what these machines hold.
pub const DEFAULT_MAX_ALLOCATIONS: usize = 4_000_000;

/// A cheap-to-clone handle on all allocations.
#[derive(Clone)]
pub struct Registry {
    inner: Arc<Inner>,
}

/// The registry's shared state.
///
/// **Lock order.** A lock may be taken while holding only locks above it
/// in this list, never one below it:
/// 1. `registering`: a registration with dependencies on other allocations
///    or with barrier members holds it from its check to its publication
///    (tokio's; held across `.await`), and lets it go before any dependent
///    is judged; a barrier's decision (`barriers.rs`) is written under it.
/// 2. a handle's write lock (`handle.rs`): one allocation's decisions, in
///    order; tokio's, held across `.await` by a registration or a deletion
///    until its change is published, and by any write on a store that
///    stamps its changes only at commit. At most one at a time: a writer
///    never waits for another allocation's write lock while it holds its
///    own (the dependents of a change are judged in tasks of their own).
///    The one taken under (4): a registration's new handle is inserted
///    with its write lock already held (`try_lock_write`, which never
///    waits, on a handle nobody else can see yet).
/// 3. the store's own lock around an append (the memory store hands the
///    change to the follower under it, so the locks below are taken under
///    it there).
/// 4. the allocation map (`allocs`, a std `RwLock`): held only to look up,
///    insert or remove handles, and by the follower while it publishes a
///    batch, which takes the locks below under it.
/// 5. the due-time heap (`time.rs`): it holds handles only as weak
///    references, and its sweep reads their slots under its lock.
/// 6. a handle's slot `RwLock` (the published record) and its timeline
///    `Mutex`, each taken and let go on its own (publishing extends the
///    timeline, lets it go, then writes the slot).
/// 7. leaves, none held while another lock is taken: the spec interner
///    (`specs`), the reverse dependency index, the cycles found, the
///    registrations checked and the judges in flight (`judge.rs`), the
///    semaphores and their lines (`gates.rs`), a task's liveness keys (`signs.rs`),
///    a handle's pending version, the feed (`feed.rs`), the open traces
///    and the writes claimed for them (`traces.rs`).
struct Inner {
    /// Allocation ID → handle, sorted for listing. Inserted by a
    /// registration (a handle being created) or the follower, removed by
    /// the follower (a deletion) or a failed registration, read by
    /// everything. A std lock: never held across an `.await`.
    allocs: RwLock<AllocMap>,
    /// Every published change in index order, for the event stream.
    feed: feed::Feed,
    /// Where every change is appended before it is published.
    store: Arc<dyn Store>,
    config: RegistryConfig,
    /// Requests parked now (`taskgate_waiters`).
    waiters: AtomicUsize,
    /// Equal task specs shared between allocations (a std lock, held only
    /// to look one up).
    specs: Mutex<SpecInterner>,
    /// Turns `true` once, at shutdown; every parked waiter watches it.
    shutdown: watch::Sender<bool>,
    /// The index up to which the follower has published every change;
    /// writers wait on it (`follow.rs`).
    view: watch::Sender<u64>,
    /// Every timer: allocations to look at, leases to renew (`time.rs`).
    timers: Arc<time::Timers>,
    /// How a task's silence is measured (`lives.rs`).
    lives: lives::Liveness,
    /// Whether other processes write the store too (replicas): then the
    /// view can be behind it.
    shared: bool,
    /// Target allocation → the allocations that depend on its tasks, and
    /// the judges in flight (`judge.rs`).
    judges: judge::Judges,
    /// The semaphores, their lines and their judge (`gates.rs`).
    gates: gates::Gates,
    /// Held by a registration with dependencies on other allocations from
    /// its check to its publication: two of them racing could otherwise
    /// close a cycle neither sees, or pass a limit together. Registrations
    /// without such dependencies never take it, and nobody judges
    /// dependents under it.
    registering: Arc<tokio::sync::Mutex<()>>,
    /// Where the registry's tasks run: the follower may publish from a
    /// thread outside the runtime (the disk store's writer).
    runtime: Option<tokio::runtime::Handle>,
    /// This registry, for the tasks it starts (which must not keep it
    /// alive).
    me: std::sync::Weak<Inner>,
}

impl Inner {
    fn read_map(&self) -> std::sync::RwLockReadGuard<'_, AllocMap> {
        if let Ok(map) = self.allocs.read() {
            return map;
        }
        // Poisoned: mended under the write lock (the read guard that came
        // with the error is gone by now).
        drop(self.write_map());
        self.allocs.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The map for writing. A writer that panicked may have left its two
    /// structures disagreeing: the ID index is rebuilt from the handles
    /// then, before anyone reads it.
    fn write_map(&self) -> std::sync::RwLockWriteGuard<'_, AllocMap> {
        match self.allocs.write() {
            Ok(map) => map,
            Err(poisoned) => {
                let mut map = poisoned.into_inner();
                map.repair();
                self.allocs.clear_poison();
                tracing::warn!("the allocation map was rebuilt after a panic while it was written");
                map
            }
        }
    }

    /// The registry this is the inner state of, while it lives.
    fn registry(&self) -> Option<Registry> {
        self.me.upgrade().map(|inner| Registry { inner })
    }

    /// Starts `task` on the registry's runtime (none: not started).
    fn spawn<F>(&self, task: F) -> Option<tokio::task::JoinHandle<F::Output>>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let runtime = self
            .runtime
            .clone()
            .or_else(|| tokio::runtime::Handle::try_current().ok())?;
        Some(runtime.spawn(task))
    }

    /// Starts a long-lived task under the supervisor (which starts it again
    /// with `make()`'s function if it panics), once: `started` turns true
    /// then. Outside a runtime nothing starts; the next call inside one
    /// does. Cheap once started (one atomic load; `make` is not called).
    fn keep_once<F, Fut>(&self, started: &AtomicBool, name: &'static str, make: impl FnOnce() -> F)
    where
        F: Fn() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        if started.load(Ordering::Acquire) {
            return;
        }
        let Some(runtime) = self
            .runtime
            .clone()
            .or_else(|| tokio::runtime::Handle::try_current().ok())
        else {
            return;
        };
        if started
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            let _entered = runtime.enter();
            self.config.supervisor.keep(name, make());
        }
    }

    fn share_spec(
        &self,
        spec: Arc<crate::lifecycle::AllocSpec>,
    ) -> Arc<crate::lifecycle::AllocSpec> {
        self.specs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .share(spec)
    }
}

impl Registry {
    /// Loads every record from the store and rebuilds the handles exactly as
    /// they were, coordinator states included, then follows the store.
    pub fn open(store: Arc<dyn Store>, config: RegistryConfig) -> Result<Self, StoreError> {
        let loaded = store.load()?;
        let last = loaded
            .allocations
            .iter()
            .map(|a| a.modify_index)
            .fold(loaded.last_index, u64::max);
        if last > MAX_INDEX {
            // Indexes count up by one per change; one this high is damage
            // (or someone's edit), and counting on from it would leave the
            // API's range and then wrap.
            return Err(StoreError::Unusable(format!(
                "the store's last index is {last}, past the largest index there is \
                 ({MAX_INDEX}); the data directory is damaged"
            )));
        }
        let mut specs = SpecInterner::default();
        let lives = lives::Liveness::of(store.as_ref());
        let shared = store.shared();
        let loaded_at = config.clock.now();
        // Stores load in key order, for which collecting builds the map in
        // one pass.
        let map = AllocMap::from_sorted(loaded.allocations.into_iter().map(|mut a| {
            a.spec = specs.share(a.spec);
            let handle = Arc::new(Handle::live(Arc::new(a)));
            lives.loaded(&handle, loaded_at, config.default_liveness_ttl);
            (handle.id_owned(), handle)
        }));
        for l in &loaded.liveness {
            lives::keep_liveness(&map, l, loaded_at);
        }
        let registry = Self {
            inner: Arc::new_cyclic(|me| Inner {
                allocs: RwLock::new(map),
                feed: feed::Feed::new(last, config.event_buffer, config.event_buffer_bytes),
                store,
                timers: Arc::new(time::Timers::new(config.clock.clone())),
                config,
                waiters: AtomicUsize::new(0),
                specs: Mutex::new(specs),
                shutdown: watch::Sender::new(false),
                view: watch::Sender::new(last),
                lives,
                shared,
                judges: judge::Judges::default(),
                gates: gates::Gates::default(),
                registering: Arc::default(),
                runtime: tokio::runtime::Handle::try_current().ok(),
                me: me.clone(),
            }),
        };
        let handles: Vec<Arc<Handle>> = registry
            .read_map()
            .range_from("")
            .map(|(_, h)| h.clone())
            .collect();
        for handle in &handles {
            if let Some(a) = handle.current() {
                registry.inner.judges.index(&a, true);
                registry.inner.gates.index(None, Some(&a), a.modify_index);
            }
        }
        registry.inner.gates.define_all(loaded.semaphores, last);
        registry.inner.judge_gates();
        registry.resolve_all();
        // A deadline that passed while the server was down fires as soon
        // as the timers run.
        for handle in &handles {
            if let Some(a) = handle.current() {
                registry.inner.reschedule(handle, &a);
            }
        }
        // Weak: the store's follower must not keep the registry (and with
        // it the store) alive.
        let follower: std::sync::Weak<Inner> = Arc::downgrade(&registry.inner);
        registry.inner.store.follow(last, follower);
        Ok(registry)
    }

    pub fn config(&self) -> &RegistryConfig {
        &self.inner.config
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.config.metrics
    }

    /// The index up to which every change is published here.
    pub fn last_index(&self) -> u64 {
        *self.inner.view.borrow()
    }

    /// Bytes of rendered changes the event stream keeps.
    pub fn stream_rendered_bytes(&self) -> usize {
        self.inner.feed.rendered_bytes()
    }

    /// The index up to which every change is in the event stream's order
    /// (and published: a listing read after it holds every change up to
    /// it).
    pub fn stream_index(&self) -> u64 {
        self.inner.feed.frontier()
    }

    /// Registered allocations.
    pub fn len(&self) -> usize {
        self.read_map().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Requests parked in waits now.
    pub fn waiters(&self) -> usize {
        self.inner.waiters.load(Ordering::SeqCst)
    }

    /// Ends every parked wait with `ShuttingDown` and refuses new ones.
    /// Writes keep working, so requests in flight can finish.
    pub fn shutdown(&self) {
        self.inner.shutdown.send_replace(true);
    }

    /// The store's ID (`X-Taskgate-Store`).
    pub fn store_id(&self) -> &str {
        self.inner.store.id()
    }

    /// How the store is doing.
    pub fn store_health(&self) -> crate::store::StoreHealth {
        self.inner.store.health()
    }

    pub fn is_shutting_down(&self) -> bool {
        *self.inner.shutdown.borrow()
    }

    fn read_map(&self) -> std::sync::RwLockReadGuard<'_, AllocMap> {
        self.inner.read_map()
    }

    fn write_map(&self) -> std::sync::RwLockWriteGuard<'_, AllocMap> {
        self.inner.write_map()
    }

    fn handle(&self, id: &str) -> Result<Arc<Handle>, RegistryError> {
        self.read_map()
            .get(id)
            .cloned()
            .ok_or_else(|| RegistryError::AllocationNotFound(id.to_owned()))
    }

    /// The published record of an allocation.
    pub fn get(&self, id: &str) -> Result<Arc<Allocation>, RegistryError> {
        self.handle(id)?
            .current()
            .ok_or_else(|| RegistryError::AllocationNotFound(id.to_owned()))
    }

    /// The allocation's timeline as of `a` (a version of it the caller
    /// holds): entries up to its index, oldest first.
    pub fn timeline(&self, a: &Allocation) -> Vec<timeline::Entry> {
        let Ok(handle) = self.handle(a.id.as_str()) else {
            return Vec::new();
        };
        let mut entries = handle.timeline();
        entries.retain(|e| e.index <= a.modify_index);
        entries
    }

    /// One page of allocations whose ID starts with `prefix` and that
    /// `keep` keeps, in ID order, from `start` (inclusive) on. Returns the
    /// ID that starts the next page. A page looks at no more than
    /// `per_page` allocations kept and `MAX_SCANNED` left out, so a rare
    /// filter among many allocations answers in bounded time: its page
    /// may then be short, or empty, with a next page.
    pub fn list(
        &self,
        prefix: &str,
        start: Option<&str>,
        per_page: usize,
        mut keep: impl FnMut(&Allocation) -> bool,
    ) -> (Vec<Arc<Allocation>>, Option<AllocId>) {
        // A page starts at the token or at the prefix, whichever is later:
        // a token from another listing still gives a well-defined page.
        let from = match start {
            Some(token) if token > prefix => token,
            _ => prefix,
        };
        let map = self.read_map();
        let mut page = Vec::new();
        let mut left_out = 0;
        for (id, handle) in map.range_from(from) {
            if !id.as_str().starts_with(prefix) {
                break;
            }
            if let Some(a) = handle.current() {
                if page.len() == per_page || left_out == MAX_SCANNED {
                    return (page, Some(id.clone()));
                }
                if keep(&a) {
                    page.push(a);
                } else {
                    left_out += 1;
                }
            }
        }
        (page, None)
    }

    /// Entries in the due-time heap (stale ones included), for the metrics.
    pub fn timer_entries(&self) -> usize {
        self.inner.timers.len()
    }
}

#[cfg(test)]
mod audit_tests;
#[cfg(test)]
mod barrier_audit_tests;
#[cfg(test)]
mod barrier_properties;
#[cfg(test)]
mod barrier_tests;
#[cfg(test)]
mod gates_properties;
#[cfg(test)]
mod gates_tests;
#[cfg(test)]
mod pipeline_tests;
#[cfg(test)]
mod replicated_tests;
#[cfg(test)]
mod sem_audit_tests;
#[cfg(test)]
mod tests;
