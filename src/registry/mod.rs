//! The runtime: one handle per allocation, the global index, and waiting.
//!
//! Every write follows decide → persist → publish in one place
//! (`Registry::update`): the next record is computed by `lifecycle`, handed
//! to the store, and only after the commit is it published on the
//! handle (`handle.rs`), where readers and parked waiters see it. No
//! caller ever sees a record that a crash could take back.
//!
//! This module must not know HTTP: it speaks allocations, task names and
//! durations.

mod deps;
pub mod feed;
mod handle;
mod keep;
mod replicated;
mod timed;
pub mod timeline;
mod timers;
mod wait;

pub use deps::MAX_REACH;
pub use timed::Signs;
pub use timers::Clock;
pub use wait::Subscription;

use std::{
    collections::{BTreeSet, HashSet},
    ops::Bound,
    sync::{
        Arc, Mutex, PoisonError, RwLock,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
};

use tokio::sync::watch;

use crate::{
    lifecycle::{
        AllocId, AllocSpec, Allocation, CoordState, IdemKey, KeySeen, Limits, RestartError,
        RestartMode, SpecInterner, TaskName, TaskReport, Timestamp,
    },
    metrics::Metrics,
    store::{Op, Store, StoreError},
};
use handle::{Handle, Slot, WriteGuard};

/// Runtime settings of the registry.
#[derive(Clone)]
pub struct RegistryConfig {
    pub limits: Limits,
    /// Requests parked in long-polls and blocking queries at once.
    pub max_waiters: usize,
    /// Allocations registered at once; registering one more is
    /// `QuotaExceeded`.
    pub max_allocations: usize,
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
}

/// Entries an allocation's timeline keeps by default.
pub const DEFAULT_TIMELINE_EVENTS: usize = 64;

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            max_waiters: 100_000,
            max_allocations: DEFAULT_MAX_ALLOCATIONS,
            metrics: Arc::new(Metrics::new()),
            timeline_events: DEFAULT_TIMELINE_EVENTS,
            event_buffer: DEFAULT_EVENT_BUFFER,
            event_buffer_bytes: DEFAULT_EVENT_BUFFER_BYTES,
            default_liveness_ttl: None,
            clock: Clock::system(),
        }
    }
}

/// Changes the event stream keeps by default: a reader that falls this
/// far behind lists again. Each holds the allocation's version it tells
/// (a few KiB with full histories, which would otherwise be freed).
pub const DEFAULT_EVENT_BUFFER: usize = 4_096;

/// Bytes of rendered changes the event stream keeps by default.
pub const DEFAULT_EVENT_BUFFER_BYTES: usize = 64 << 20;

/// The largest global index: indexes are 0 to 2^63 - 1 in the API.
pub const MAX_INDEX: u64 = i64::MAX as u64;

/// Allocations a server holds at most, by default: at ~1 KiB each settled
/// and up to ~16 KiB with full event histories, what these machines hold.
pub const DEFAULT_MAX_ALLOCATIONS: usize = 4_000_000;

/// A caller's own limit on registered allocations: at most `max` whose IDs
/// start with one of `prefixes` (any ID, if there are none).
#[derive(Clone, Copy, Debug)]
pub struct Quota<'a> {
    pub name: &'a str,
    pub prefixes: &'a [String],
    pub max: usize,
}

/// What a batch of reports is applied as.
#[derive(Clone, Copy)]
enum Apply {
    /// Reports, maybe keyed (`Idempotency-Key`).
    Report(Option<IdemKey>),
    Restore,
}

/// Which tasks a restart request names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RestartTarget {
    Task(TaskName),
    Running,
    AllTasks,
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("allocation \"{0}\" not found")]
    AllocationNotFound(String),
    #[error("task \"{task}\" not found in allocation \"{alloc}\"; its tasks are {tasks}")]
    TaskNotFound {
        alloc: String,
        task: String,
        /// The allocation's task names, quoted, comma-separated.
        tasks: String,
    },
    #[error(
        "allocation \"{id}\" is already registered with a different task spec; delete it \
         first (DELETE /v1/allocations/{id}) or register the new spec under another ID"
    )]
    AllocationExists { id: AllocId, index: u64 },
    #[error("{error}")]
    RestartRefused { error: RestartError, index: u64 },
    #[error(
        "task \"{task}\" of allocation \"{alloc}\" was declared lost at {lost_at}: its agent gave \
         no sign of life within its TTL. Stop its process; an all-tasks restart or a restore \
         runs it again"
    )]
    TaskLost {
        alloc: String,
        task: String,
        /// RFC 3339.
        lost_at: String,
        index: u64,
    },
    #[error(
        "this Idempotency-Key was used before with another request; a retry must send the \
         same request, and a new request needs a new key"
    )]
    KeyReused { index: u64 },
    #[error("allocation \"{0}\" was deleted")]
    Deleted(String),
    #[error("too many requests are waiting; retry later")]
    TooManyWaiters,
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("{0}")]
    QuotaExceeded(String),
    /// The registration's dependencies close a cycle: among its own tasks
    /// (`held` false), or through allocations the server holds.
    #[error(
        "these dependencies close a cycle, so none of its tasks could ever start: {}",
        path.join(" → ")
    )]
    DependencyCycle { path: Vec<String>, held: bool },
    /// A valid request for something this server does not do.
    #[error("{0}")]
    Unsupported(String),
    /// A rule only the registry can check is broken (it needs the other
    /// allocations it holds).
    #[error("the allocation spec is not valid")]
    Invalid(Vec<crate::lifecycle::FieldError>),
    /// The allocation kept changing under the request (deleted and
    /// registered again by others); a later try will go through.
    #[error("{0}")]
    Contended(String),
    /// The allocation's record in a store several replicas write cannot
    /// be read by this build.
    #[error("the record of allocation \"{id}\" in the store cannot be read by this server: {why}")]
    Unreadable { id: String, why: String },
    /// The store holds the allocation at `index` and this replica's view
    /// has not reached it in time.
    #[error(
        "this replica has not caught up with allocation \"{id}\" yet (the store holds it at \
         index {index}, this replica's view is at {view}); try again"
    )]
    Behind { id: String, index: u64, view: u64 },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl RegistryError {
    /// `TaskLost` for task `i` of `a`, lost at `at`.
    pub fn task_lost(a: &Allocation, i: usize, at: Timestamp) -> Self {
        Self::TaskLost {
            alloc: a.id.to_string(),
            task: a.task_name(i).to_string(),
            lost_at: at
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default(),
            index: a.modify_index,
        }
    }

    /// `TaskNotFound` for `task` in `a`, listing the tasks it has.
    pub fn task_not_found(a: &Allocation, task: &str) -> Self {
        let tasks: Vec<String> = a
            .spec
            .tasks()
            .iter()
            .map(|t| format!("\"{}\"", t.name))
            .collect();
        Self::TaskNotFound {
            alloc: a.id.to_string(),
            task: task.to_owned(),
            tasks: tasks.join(", "),
        }
    }
}

/// A cheap-to-clone handle on all allocations.
#[derive(Clone)]
pub struct Registry {
    inner: Arc<Inner>,
}

/// The registry's shared state.
///
/// **Lock order.** A lock may be taken while holding only locks above it
/// in this list, never one below it:
/// 1. a handle's write semaphore (`Handle::write`, `handle.rs`): one
///    allocation's decisions, in order; tokio's, the only lock held
///    across an `.await` (a registration's or a deletion's commit, or a
///    deletion waiting for the changes handed to the store before it; an
///    update holds it only to decide and hand its record to the store). At most one at a time: a
///    writer never waits for another allocation's write lock while it
///    holds its own (the dependents of a change are judged in tasks of
///    their own, awaited only after the writer has let its lock go). The
///    one taken under (2): a registration's new handle is inserted with
///    its write lock already held (`try_lock_write`, which never waits,
///    on a handle nobody else can see yet).
/// 2. the allocation map (`allocs`, a std `RwLock`): held only to look up,
///    insert or remove handles. A writer holding (1) reads it to judge its
///    dependencies on other allocations; the replicated view holds its
///    write side while it publishes what the store's watch delivered, and
///    takes the locks below under it.
/// 3. a handle's slot `RwLock` (the committed record) and its timeline
///    `Mutex` (`handle.rs`), each taken and let go on its own (publishing
///    extends the timeline, lets it go, then writes the slot); readers
///    take the slot's read side without (1).
/// 4. leaves, none held while another lock is taken: the spec interner
///    (`specs`), the reverse dependency index (`dependents`, `deps.rs`),
///    the timer heap (`timers.rs`; it holds handles only as weak
///    references and touches their atomics), the keeper's heap of lease
///    renewals (`keep.rs`, the same), a task's liveness keys in its handle
///    (`keep::Kept`), and the feed (`feed.rs`).
struct Inner {
    /// Allocation ID → handle, sorted for listing. Inserted by `register`,
    /// removed by `delete`, read by everything. A std lock: it is only held
    /// to look up or insert, never across an `.await`.
    allocs: RwLock<AllocMap>,
    /// The last global index handed out. Every change takes the next one.
    index: Arc<AtomicU64>,
    /// Every change in index order, for the event stream (`feed.rs`).
    feed: Arc<feed::Feed>,
    /// Where every change is committed before it is published.
    store: Arc<dyn Store>,
    config: RegistryConfig,
    /// Requests parked now (`taskgate_waiters`).
    waiters: AtomicUsize,
    /// Equal task specs shared between allocations (a std lock, held only
    /// to look one up).
    specs: Mutex<SpecInterner>,
    /// Turns `true` once, at shutdown; every parked waiter watches it.
    shutdown: watch::Sender<bool>,
    /// With a shared store: the index up to which this replica's view has
    /// applied every change (`replicated.rs`). Writers wait on it.
    view: watch::Sender<u64>,
    /// Every timed allocation's next moment to be looked at (`timers.rs`).
    timers: Arc<timers::Timers>,
    /// Whether the task that drives `timers` runs (started on first use,
    /// inside a runtime).
    driving: std::sync::atomic::AtomicBool,
    /// With a shared store: this replica's renewals of the leases of the
    /// tasks it hears signs of life for (`keep.rs`).
    keeper: Arc<keep::Keeper>,
    /// This registry, for the tasks it starts (which must not keep it
    /// alive).
    me: std::sync::Weak<Inner>,
    /// Target allocation → the allocations that depend on its tasks
    /// (`deps.rs`), kept with the view: written when an allocation with
    /// dependencies on others appears or goes, read after every change.
    dependents: deps::Dependents,
    /// Held by a registration with dependencies on other allocations from
    /// its check to its publication: two of them racing could otherwise
    /// close a cycle neither sees (each one's check runs before the other
    /// exists). Registrations without such dependencies never take it.
    registering: tokio::sync::Mutex<()>,
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
}

impl Registry {
    /// Loads every record from the store and rebuilds the handles exactly as
    /// they were, coordinator states included.
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
        // Stores load in key order, for which collecting builds the map in
        // one pass.
        let mut specs = SpecInterner::default();
        let default_ttl = config.default_liveness_ttl;
        let loaded_at = config.clock.now();
        let mut timed = Vec::new();
        let shared = store.replicated().is_some();
        let allocs = AllocMap::from_sorted(loaded.allocations.into_iter().map(|mut a| {
            a.spec = specs.share(a.spec);
            let (id, tasks) = (a.id.clone(), a.tasks.len());
            let handle = Arc::new(Handle::live(Arc::new(a)));
            if handle.current().is_some_and(|a| a.spec.timed(default_ttl)) {
                // Their agents' long-polls were cut by the restart, not by
                // their death: every running task gets a full TTL. With a
                // shared store the store keeps their clocks: no replica's
                // start restarts one.
                if !shared {
                    handle.lives().init_at(tasks, loaded_at);
                }
                timed.push(handle.clone());
            }
            (id, handle)
        }));
        let mut allocs = allocs;
        for l in loaded.liveness {
            replicated::keep_liveness(&mut allocs, &l, loaded_at);
        }
        let index = Arc::new(AtomicU64::new(last));
        let registry = Self {
            inner: Arc::new_cyclic(|me| Inner {
                allocs: RwLock::new(allocs),
                feed: Arc::new(feed::Feed::new(
                    index.clone(),
                    config.event_buffer,
                    config.event_buffer_bytes,
                )),
                index,
                store,
                config,
                waiters: AtomicUsize::new(0),
                specs: Mutex::new(specs),
                shutdown: watch::Sender::new(false),
                view: watch::Sender::new(last),
                timers: Arc::new(timers::Timers::default()),
                driving: std::sync::atomic::AtomicBool::new(false),
                keeper: Arc::new(keep::Keeper::default()),
                me: me.clone(),
                dependents: deps::Dependents::default(),
                registering: tokio::sync::Mutex::new(()),
            }),
        };
        for (_, handle) in registry.read_map().range_from("") {
            if let Some(a) = handle.current() {
                registry.inner.index_dependencies(&a, true);
            }
        }
        registry.resolve_all();
        // A deadline that passed while the server was down fires as soon
        // as the timers run.
        for handle in timed {
            if let Some(a) = handle.current() {
                registry.inner.reschedule(&handle, &a);
            }
        }
        if let Some(shared) = registry.inner.store.replicated() {
            // Weak: the store's follower must not keep the registry (and
            // with it the store) alive.
            let weak = Arc::downgrade(&registry.inner);
            shared.follow(last, weak);
        }
        Ok(registry)
    }

    pub fn config(&self) -> &RegistryConfig {
        &self.inner.config
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.config.metrics
    }

    /// The last global index handed out.
    pub fn last_index(&self) -> u64 {
        self.inner.index.load(Ordering::SeqCst)
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

    fn next_index(&self) -> u64 {
        let index = self.inner.index.fetch_add(1, Ordering::SeqCst) + 1;
        // 2^63 changes at a billion a second take 292 years; only a loaded
        // index can come near, and `open` refuses those.
        assert!(index <= MAX_INDEX, "the global index is exhausted");
        index
    }

    /// The committed record of an allocation.
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

    /// One page of allocations whose ID starts with `prefix`, in ID order,
    /// from `start` (inclusive) on. Returns the ID that starts the next page.
    pub fn list(
        &self,
        prefix: &str,
        start: Option<&str>,
        per_page: usize,
    ) -> (Vec<Arc<Allocation>>, Option<AllocId>) {
        // A page starts at the token or at the prefix, whichever is later:
        // a token from another listing still gives a well-defined page.
        let from = match start {
            Some(token) if token > prefix => token,
            _ => prefix,
        };
        let map = self.read_map();
        let mut page = Vec::new();
        for (id, handle) in map.range_from(from) {
            if !id.as_str().starts_with(prefix) {
                break;
            }
            if let Some(a) = handle.current() {
                if page.len() == per_page {
                    return (page, Some(id.clone()));
                }
                page.push(a);
            }
        }
        (page, None)
    }

    /// Registers an allocation. Returns the record and whether it is new; an
    /// identical spec already registered is an idempotent success.
    pub async fn register(
        &self,
        id: AllocId,
        spec: AllocSpec,
    ) -> Result<(Arc<Allocation>, bool), RegistryError> {
        self.register_within(id, spec, None).await
    }

    /// `register`, counting a new allocation against the server's limit and
    /// the caller's `quota` (an idempotent re-registration counts against
    /// neither).
    pub async fn register_within(
        &self,
        id: AllocId,
        spec: AllocSpec,
        quota: Option<Quota<'_>>,
    ) -> Result<(Arc<Allocation>, bool), RegistryError> {
        let _serial = if spec.reaches_out() {
            Some(self.inner.registering.lock().await)
        } else {
            None
        };
        let registered = self.register_unserialized(id, spec, quota).await?;
        if registered.1 && registered.0.spec.reaches_out() {
            // What its targets did between the verdicts it was registered
            // with and its publication (when it joined the reverse index)
            // is judged now: nothing of it is missed.
            self.resolve(registered.0.id.as_str()).await;
            if let Ok(now) = self.get(registered.0.id.as_str()) {
                return Ok((now, true));
            }
        }
        Ok(registered)
    }

    async fn register_unserialized(
        &self,
        id: AllocId,
        spec: AllocSpec,
        quota: Option<Quota<'_>>,
    ) -> Result<(Arc<Allocation>, bool), RegistryError> {
        if let Some(store) = self.inner.store.replicated() {
            return self.register_shared(store, id, spec, quota).await;
        }
        // A handle found here may be deleted before its lock is ours; then
        // the map no longer holds it and the next round finds the new state.
        // Each round needs a delete to race it, so a few rounds suffice.
        for _ in 0..8 {
            let (handle, fresh) = self.get_or_insert(&id, quota)?;
            let write = match fresh {
                Some(guard) => guard,
                None => handle.lock_write().await,
            };
            match handle.slot_now() {
                Slot::Live(a) if *a.spec == spec => return Ok((a, false)),
                Slot::Live(a) => {
                    return Err(RegistryError::AllocationExists {
                        id,
                        index: a.modify_index,
                    });
                }
                Slot::Deleted => continue,
                Slot::Creating => {
                    let mut a = Allocation::register(
                        id.clone(),
                        self.inner
                            .specs
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .share(Arc::new(spec)),
                        0,
                        self.now(),
                    );
                    if let Err(e) = self.check_dependencies(&a) {
                        drop(write);
                        self.remove(&id, &handle);
                        return Err(e);
                    }
                    let verdicts: Vec<Vec<crate::lifecycle::DepState>> = (0..a.tasks.len())
                        .map(|i| {
                            (0..a.spec.tasks()[i].depends_on.len())
                                .map(|j| self.verdict(&a, i, j))
                                .collect()
                        })
                        .collect();
                    a.set_verdicts(&|i, j| verdicts[i][j].clone());
                    let ticket = self.inner.feed.begin();
                    let index = self.next_index();
                    a.restamp(0, index);
                    let a = Arc::new(a);
                    let registry = self.clone();
                    let published = a.clone();
                    // Logged and counted with the publication, so a client
                    // that goes away mid-commit loses neither.
                    let done = self
                        .commit_then(write, Op::Put(a), move |committed| match committed {
                            Ok(()) => {
                                handle.publish_live(
                                    None,
                                    published.clone(),
                                    registry.inner.config.timeline_events,
                                );
                                registry.inner.reschedule(&handle, &published);
                                registry.inner.index_dependencies(&published, true);
                                ticket.publish(feed::Event::put(published.clone()));
                                let dependents = registry.dependents_of(published.id.as_str());
                                let a = &published;
                                tracing::info!(alloc = %a.id, state = %a.state, tasks = a.tasks.len(), "allocation registered");
                                if a.state != CoordState::Init {
                                    registry
                                        .inner
                                        .config
                                        .metrics
                                        .transition(CoordState::Init, a.state);
                                }
                                Ok((published, dependents))
                            }
                            Err(e) => {
                                registry.remove(&id, &handle);
                                Err(e.into())
                            }
                        })
                        .await;
                    let (a, dependents) = done?;
                    settled(dependents).await;
                    return Ok((a, true));
                }
            }
        }
        Err(RegistryError::Contended(format!(
            "allocation \"{id}\" kept being deleted while it was registered; try again"
        )))
    }

    /// Finds the handle for `id`, or inserts a new one in `Creating` state
    /// together with its write lock, so nobody can write it before it
    /// exists. A new one counts against the limits, checked under the
    /// map's lock so concurrent registrations cannot overshoot them.
    fn get_or_insert(
        &self,
        id: &AllocId,
        quota: Option<Quota<'_>>,
    ) -> Result<(Arc<Handle>, Option<WriteGuard>), RegistryError> {
        if let Some(h) = self.read_map().get(id.as_str()) {
            return Ok((h.clone(), None));
        }
        let mut map = self.write_map();
        if let Some(h) = map.get(id.as_str()) {
            return Ok((h.clone(), None));
        }
        let max = self.inner.config.max_allocations;
        if map.len() >= max {
            return Err(RegistryError::QuotaExceeded(format!(
                "the server holds {max} allocations, its limit (--max-allocations)"
            )));
        }
        if let Some(q) = quota {
            let held = if q.prefixes.is_empty() {
                map.len()
            } else {
                // Each ID once: a prefix inside another of the list (or
                // given twice) is the other's count already.
                let covered = |i: usize, p: &String| {
                    q.prefixes.iter().enumerate().any(|(j, o)| {
                        j != i && p.starts_with(o.as_str()) && (o.len() < p.len() || j < i)
                    })
                };
                q.prefixes
                    .iter()
                    .enumerate()
                    .filter(|&(i, p)| !covered(i, p))
                    .map(|(_, p)| map.count_prefix(p, q.max))
                    .sum()
            };
            if held >= q.max {
                return Err(RegistryError::QuotaExceeded(format!(
                    "token {:?} may hold {} allocations{}, and holds {held}",
                    q.name,
                    q.max,
                    if q.prefixes.is_empty() {
                        String::new()
                    } else {
                        format!(" within its prefixes {:?}", q.prefixes)
                    }
                )));
            }
        }
        let handle = Arc::new(Handle::creating(id));
        let guard = handle
            .try_lock_write()
            .expect("a new handle's lock is free");
        map.insert(id.clone(), handle.clone());
        Ok((handle, Some(guard)))
    }

    /// Removes `handle` from the map (if it is still the one there) and
    /// tells everyone watching it that it is gone.
    fn remove(&self, id: &AllocId, handle: &Arc<Handle>) {
        handle.publish(Slot::Deleted);
        let mut map = self.write_map();
        if map.get(id.as_str()).is_some_and(|h| Arc::ptr_eq(h, handle)) {
            map.remove(id.as_str());
        }
    }

    /// Deletes an allocation; its waiters end with `Deleted`. Returns the
    /// index the deletion took.
    pub async fn delete(&self, id: &str) -> Result<u64, RegistryError> {
        if let Some(store) = self.inner.store.replicated() {
            return self.delete_shared(store, id).await;
        }
        let handle = self.handle(id)?;
        let write = handle.lock_write().await;
        // Changes handed to the store before it are published first.
        if let Some(p) = handle.pending()
            && !p.outcome().await
        {
            return Err(parent_failed());
        }
        let Slot::Live(a) = handle.slot_now() else {
            return Err(RegistryError::AllocationNotFound(id.to_owned()));
        };
        let ticket = self.inner.feed.begin();
        let index = self.next_index();
        let op = Op::Delete {
            id: a.id.clone(),
            index,
        };
        let registry = self.clone();
        let done = self
            .commit_then(write, op, move |committed| {
                committed?;
                registry.remove(&a.id, &handle);
                registry.inner.index_dependencies(&a, false);
                ticket.publish(feed::Event::deleted(a.id.clone(), index));
                let dependents = registry.dependents_of(a.id.as_str());
                tracing::info!(alloc = %a.id, index, "allocation deleted");
                Ok((index, dependents))
            })
            .await?;
        let (index, dependents) = done;
        settled(dependents).await;
        Ok(index)
    }

    /// Decide → persist → publish for one allocation. `decide` gets the
    /// newest record decided (durable, or handed to the store and not yet
    /// published) and a source of fresh indexes, and returns the next
    /// record (or `None` for no change) plus a result for the caller.
    ///
    /// Commits are pipelined: the write lock is held only to decide and
    /// hand the record to the store, so one allocation's writers share
    /// the store's group commits instead of waiting one fsync each. A
    /// writer is answered once its own change and every one it was decided
    /// on are durable and published; nothing a reader sees was not
    /// durable; an answer decided on a version whose commit failed fails
    /// too (a store that failed a commit takes none after it).
    ///
    /// `counted` counts the request in the metrics once it is decided (and
    /// committed, if it changed anything); it runs with the publication,
    /// so a client that goes away mid-commit loses neither the metrics nor
    /// the log lines of a change that happened.
    async fn update<R>(
        &self,
        id: &str,
        decide: impl Fn(&Allocation, &dyn Fn() -> u64) -> Result<(Option<Allocation>, R), RegistryError>,
        counted: impl FnOnce(&Metrics) + Send + 'static,
    ) -> Result<(Arc<Allocation>, R), RegistryError> {
        if let Some(store) = self.inner.store.replicated() {
            return self.update_shared(store, id, decide, counted).await;
        }
        let handle = self.handle(id)?;
        let write = handle.lock_write().await;
        // The pending version first, then the slot: a commit is cleared
        // from `pending` only after it is published.
        let parent = handle.pending();
        let current = match &parent {
            Some(p) => p.record.clone(),
            None => match handle.slot_now() {
                Slot::Live(a) => a,
                Slot::Creating | Slot::Deleted => {
                    return Err(RegistryError::AllocationNotFound(id.to_owned()));
                }
            },
        };
        let ticket = self.inner.feed.begin();
        let decided = decide(&current, &|| self.next_index());
        let (next, out) = match decided {
            Ok((Some(next), out)) => (next, out),
            // An answer that changes nothing (or refuses) was decided on a
            // version that may not be durable yet: it goes out once that
            // version is (never a state a reader could not see).
            other => {
                drop(write);
                drop(ticket);
                if let Some(p) = &parent
                    && !p.outcome().await
                {
                    return Err(parent_failed());
                }
                let (_, out) = other?;
                counted(&self.inner.config.metrics);
                return Ok((current, out));
            }
        };
        // Pipelined: handed to the store in decision order (the store
        // makes changes durable in the order they are handed to it), the
        // lock let go for the next writer, which decides on this version;
        // published once durable and once the version it was decided on
        // is published. A task of its own, so that a client that goes
        // away cannot stop a change between its commit and its
        // publication.
        let next = Arc::new(next);
        let commit = self.inner.store.commit(Op::Put(next.clone()));
        let mine = Arc::new(handle::Pending::new(next.clone()));
        handle.set_pending(mine.clone());
        drop(write);
        let registry = self.clone();
        let published = next.clone();
        let task = tokio::spawn(async move {
            let committed = commit.await;
            let after = match &parent {
                Some(p) => p.outcome().await,
                None => true,
            };
            let done = match (committed, after) {
                (Ok(()), true) => {
                    handle.publish_live(
                        Some(&current),
                        published.clone(),
                        registry.inner.config.timeline_events,
                    );
                    registry.inner.reschedule(&handle, &published);
                    ticket.publish(feed::Event::put(published.clone()));
                    let dependents = registry.dependents_of(published.id.as_str());
                    registry.observe(&current, &published);
                    counted(&registry.inner.config.metrics);
                    Ok(dependents)
                }
                (Ok(()), false) => {
                    // A store that failed a commit takes none after it, so
                    // this is a store that broke its promise: not published.
                    tracing::error!(alloc = %published.id, index = published.modify_index, "a change was committed after the one it was decided on failed; it is not published");
                    Err(parent_failed())
                }
                (Err(e), _) => Err(RegistryError::Store(e)),
            };
            mine.finish(done.is_ok());
            handle.clear_pending(&mine);
            done
        });
        let dependents = task.await.unwrap_or_else(|e| {
            Err(RegistryError::Store(StoreError::Io(format!(
                "the commit task failed: {e}"
            ))))
        })?;
        settled(dependents).await;
        Ok((next, out))
    }

    /// Logs and counts what a committed change did to the coordinator and
    /// the stop orders.
    fn observe(&self, prev: &Allocation, next: &Allocation) {
        let metrics = &self.inner.config.metrics;
        if prev.state != next.state {
            metrics.transition(prev.state, next.state);
            tracing::info!(
                alloc = %next.id,
                from = %prev.state,
                to = %next.state,
                index = next.modify_index,
                "coordinator transition"
            );
        }
        for i in 0..next.tasks.len() {
            if let (false, Some(reason)) = (prev.desired(i).is_stop(), next.desired(i).reason()) {
                metrics.stop_order(reason.kind);
                tracing::info!(
                    alloc = %next.id,
                    task = %next.task_name(i),
                    reason = %reason.kind,
                    "stop order"
                );
            }
        }
    }

    /// Commits `op`, then runs `finish` with the outcome while the
    /// allocation's write lock is still held. Runs as a task of its own: a
    /// client that goes away mid-request cannot cancel a change between its
    /// commit and its publication, which would leave memory behind the disk.
    async fn commit_then<T: Send + 'static>(
        &self,
        write: WriteGuard,
        op: Op,
        finish: impl FnOnce(Result<(), StoreError>) -> Result<T, RegistryError> + Send + 'static,
    ) -> Result<T, RegistryError> {
        let commit = self.inner.store.commit(op);
        let task = tokio::spawn(async move {
            let out = finish(commit.await);
            drop(write);
            out
        });
        task.await.unwrap_or_else(|e| {
            Err(RegistryError::Store(StoreError::Io(format!(
                "the commit task failed: {e}"
            ))))
        })
    }

    fn positions(
        a: &Allocation,
        reports: Vec<(TaskName, TaskReport)>,
    ) -> Result<Vec<(usize, TaskReport)>, RegistryError> {
        reports
            .into_iter()
            .map(|(name, r)| {
                a.position(name.as_str())
                    .map(|i| (i, r))
                    .ok_or_else(|| RegistryError::task_not_found(a, name.as_str()))
            })
            .collect()
    }

    /// Applies task-state reports together, then evaluates once. An unknown
    /// task rejects the whole batch.
    pub async fn report(
        &self,
        id: &str,
        reports: Vec<(TaskName, TaskReport)>,
    ) -> Result<Arc<Allocation>, RegistryError> {
        self.report_keyed(id, reports, None).await
    }

    /// `report`, for a request that carries an `Idempotency-Key`: a retry
    /// of a request whose change is already in (the key kept on one of its
    /// tasks) answers the record as it is, applying nothing again.
    pub async fn report_keyed(
        &self,
        id: &str,
        reports: Vec<(TaskName, TaskReport)>,
        key: Option<IdemKey>,
    ) -> Result<Arc<Allocation>, RegistryError> {
        self.apply_reports(id, reports, Apply::Report(key)).await
    }

    /// Restore: the coordinator goes to `prestart`, the states are applied,
    /// and it evaluates until stable.
    pub async fn restore(
        &self,
        id: &str,
        reports: Vec<(TaskName, TaskReport)>,
    ) -> Result<Arc<Allocation>, RegistryError> {
        self.apply_reports(id, reports, Apply::Restore).await
    }

    async fn apply_reports(
        &self,
        id: &str,
        reports: Vec<(TaskName, TaskReport)>,
        apply: Apply,
    ) -> Result<Arc<Allocation>, RegistryError> {
        let count = reports.len();
        // A report is a sign of life, from the moment it arrives: a task
        // whose TTL ends while its report waits for the lock is not lost.
        self.signs_of_life(id, reports.iter().map(|(name, _)| name.as_str()));
        // A shared store may decide more than once (after a conflict): a
        // copy is kept for the later rounds. The first takes the reports.
        let spare = self.inner.store.replicated().map(|_| reports.clone());
        let first = std::sync::Mutex::new(Some(reports));
        let (a, ()) = self
            .update(
                id,
                |a, next_index| {
                    let taken = first.lock().unwrap_or_else(PoisonError::into_inner).take();
                    let reports = taken
                        .or_else(|| spare.clone())
                        .expect("only a shared store decides twice, and it keeps a copy");
                    let reports = Self::positions(a, reports)?;
                    let now = self.now();
                    let next = match apply {
                        Apply::Restore => a.restore(&reports, now, next_index),
                        Apply::Report(key) => {
                            if let Some((i, at)) = a.lost_among(reports.iter().map(|(i, _)| *i)) {
                                return Err(RegistryError::task_lost(a, i, at));
                            }
                            if let Some(key) = key {
                                match a.key_seen(key) {
                                    KeySeen::New => {}
                                    KeySeen::Retry => return Ok((None, ())),
                                    KeySeen::Reused => {
                                        return Err(RegistryError::KeyReused {
                                            index: a.modify_index,
                                        });
                                    }
                                }
                            }
                            a.report_keyed(&reports, key, now, next_index)
                        }
                    };
                    Ok((next, ()))
                },
                move |metrics| metrics.reports(count),
            )
            .await?;
        Ok(a)
    }

    /// An operator restart. Returns the record and the tasks told to restart.
    pub async fn restart(
        &self,
        id: &str,
        target: RestartTarget,
        reason: &str,
    ) -> Result<(Arc<Allocation>, Vec<TaskName>), RegistryError> {
        let counted_as = match target {
            RestartTarget::Task(_) => "task",
            RestartTarget::Running => "running",
            RestartTarget::AllTasks => "all_tasks",
        };
        self.update(
            id,
            |a, next_index| {
                let mode = match &target {
                    RestartTarget::Task(name) => RestartMode::Task(
                        a.position(name.as_str())
                            .ok_or_else(|| RegistryError::task_not_found(a, name.as_str()))?,
                    ),
                    RestartTarget::Running => RestartMode::Running,
                    RestartTarget::AllTasks => RestartMode::AllTasks,
                };
                let (next, chosen) =
                    a.restart(mode, reason, self.now(), next_index)
                        .map_err(|error| RegistryError::RestartRefused {
                            error,
                            index: a.modify_index,
                        })?;
                let names = chosen.iter().map(|&i| a.task_name(i).clone()).collect();
                Ok((next, names))
            },
            move |metrics| metrics.restart(counted_as),
        )
        .await
    }
}

/// Waits until the dependents a change started judging are judged (a task
/// of its own, which goes on if this wait is dropped).
/// The answer of a write decided on a version whose commit failed.
fn parent_failed() -> RegistryError {
    RegistryError::Store(StoreError::Io(
        "a change this one was decided on failed to commit".into(),
    ))
}

async fn settled(dependents: Option<tokio::task::JoinHandle<()>>) {
    if let Some(h) = dependents {
        let _ = h.await;
    }
}

/// Allocation ID → handle: a hash map for the lookup every request makes
/// (constant time, where a B-tree of a million string keys costs dozens of
/// cache misses), and the IDs in order for listing.
#[derive(Default)]
struct AllocMap {
    /// Keyed by the ID each handle holds (`ByHandleId`): the table holds
    /// one pointer per allocation, and a lookup reads the ID from the
    /// handle it goes on to use.
    /// foldhash, seeded per process: several times SipHash's speed on
    /// IDs, which clients still cannot aim collisions at.
    by_id: HashSet<ByHandleId, foldhash::fast::RandomState>,
    ids: BTreeSet<AllocId>,
}

/// A handle in the registry's map, hashed and compared by its ID.
struct ByHandleId(Arc<Handle>);

impl std::hash::Hash for ByHandleId {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // As the `str` it is looked up by hashes (`Borrow` requires it).
        self.0.id().hash(state);
    }
}

impl PartialEq for ByHandleId {
    fn eq(&self, other: &Self) -> bool {
        self.0.id() == other.0.id()
    }
}

impl Eq for ByHandleId {}

impl std::borrow::Borrow<str> for ByHandleId {
    fn borrow(&self) -> &str {
        self.0.id()
    }
}

impl AllocMap {
    /// From entries in ID order (as stores load them).
    // A handle is hashed by its ID, which never changes (its other fields
    // are the mutable part).
    #[allow(clippy::mutable_key_type)]
    fn from_sorted(entries: impl Iterator<Item = (AllocId, Arc<Handle>)>) -> Self {
        let mut by_id = HashSet::with_hasher(foldhash::fast::RandomState::default());
        let ids = entries
            .map(|(id, handle)| {
                by_id.insert(ByHandleId(handle));
                id
            })
            .collect();
        Self { by_id, ids }
    }

    fn get(&self, id: &str) -> Option<&Arc<Handle>> {
        self.by_id.get(id).map(|h| &h.0)
    }

    /// Adds `handle` (for `id`, which it holds), replacing one there.
    fn insert(&mut self, id: AllocId, handle: Arc<Handle>) {
        debug_assert_eq!(handle.id(), id.as_str());
        if self.by_id.replace(ByHandleId(handle)).is_none() {
            self.ids.insert(id);
        }
    }

    fn remove(&mut self, id: &str) {
        if self.by_id.remove(id) {
            self.ids.remove(id);
        }
    }

    fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Makes the ID index agree with the handles again (after a panic
    /// between updating one and the other).
    fn repair(&mut self) {
        self.ids = self
            .by_id
            .iter()
            .filter_map(|h| AllocId::parse(h.0.id()).ok())
            .collect();
    }

    /// How many IDs start with `prefix`, counted up to `limit`.
    fn count_prefix(&self, prefix: &str, limit: usize) -> usize {
        self.ids
            .range::<str, _>((Bound::Included(prefix), Bound::Unbounded))
            .take_while(|id| id.as_str().starts_with(prefix))
            .take(limit)
            .count()
    }

    /// Entries in ID order from `from` (inclusive).
    fn range_from<'a>(
        &'a self,
        from: &str,
    ) -> impl Iterator<Item = (&'a AllocId, &'a Arc<Handle>)> {
        self.ids
            .range::<str, _>((Bound::Included(from), Bound::Unbounded))
            .map(|id| {
                (
                    id,
                    &self.by_id.get(id.as_str()).expect("ids and by_id agree").0,
                )
            })
    }
}

#[cfg(test)]
mod pipeline_tests;
#[cfg(test)]
mod replicated_tests;
#[cfg(test)]
mod tests;
