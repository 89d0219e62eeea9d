//! Durable allocation records. The registry appends every change to a
//! `Store`, and publishes what the store's follower hands back, committed
//! and in index order (decide, persist, publish).
//!
//! This layer knows records, not rules: it never evaluates a coordinator.

mod disk;
pub mod etcd;
pub mod identity;
mod memory;
pub(crate) mod record;

use std::{future::Future, pin::Pin, sync::Arc};

pub(crate) use disk::fs;
pub use disk::{
    DEFAULT_LOG_CEILING, DEFAULT_LOG_LIMIT, DiskStore, DiskStoreConfig, FoldBench, FoldChanges,
    LOCK_FILE, REDB_FILE, SNAPSHOT_FILE, SalvageReport, StoreStats, log_segments, read_only,
    salvage,
};
pub use memory::MemoryStore;

use crate::lifecycle::{AllocId, Allocation, SemName, Semaphore};

/// One change, as the registry decides it.
#[derive(Clone, Debug)]
pub enum Op {
    /// Create or replace an allocation's record. Its `modify_index` is a
    /// placeholder above every other index in it: the store stamps the
    /// index the change takes over it (`Allocation::restamp`).
    Put(Arc<Allocation>),
    /// Remove an allocation.
    Delete(AllocId),
    /// Create or change a semaphore. `expect` compares its
    /// `modify_index`; the store stamps the index the change takes over
    /// it (and over `create_index` when that holds the same placeholder).
    PutSemaphore(Arc<Semaphore>),
    /// Remove a semaphore.
    DeleteSemaphore(SemName),
}

impl Op {
    /// The allocation it changes, if it changes one.
    pub fn alloc_id(&self) -> Option<&AllocId> {
        match self {
            Op::Put(a) => Some(&a.id),
            Op::Delete(id) => Some(id),
            Op::PutSemaphore(_) | Op::DeleteSemaphore(_) => None,
        }
    }
}

/// A change handed to `Store::append`.
#[derive(Debug)]
pub struct Append {
    pub op: Op,
    /// The `modify_index` of the record the change was decided on (0: none).
    /// A store other processes write takes the change only if the record is
    /// still that one; a store this process alone writes takes it as given
    /// (the registry's lock on the allocation keeps it true).
    pub expect: u64,
    /// What the change does to its tasks' liveness keys (`Leases`), in the
    /// same transaction; a deletion removes all of them.
    pub live: Vec<LiveOp>,
    /// The semaphores a put grants (each as the grant was decided on). A
    /// store other processes write takes the change only while each is
    /// still at its `modify_index`, and writes each again in the same
    /// transaction, so that two grants decided on one view of a semaphore
    /// cannot both take. A store this process alone writes ignores them
    /// (the registry decides one semaphore's grants one at a time).
    pub grants: Vec<Arc<Semaphore>>,
}

/// An append in flight.
pub struct Appended {
    /// A put's record as the store took it.
    pub record: Option<Arc<Allocation>>,
    /// Whether `record` is stamped with its index already: the store orders
    /// its appends itself (disk, memory), so the next change of the
    /// allocation may be decided on it before it is durable. Otherwise the
    /// index comes with the commit (etcd).
    pub stamped: bool,
    /// Resolves to the change's index once the follower has been handed
    /// it (disk, memory) or the store committed it (etcd).
    pub done: Pin<Box<dyn Future<Output = Result<u64, AppendError>> + Send>>,
}

/// Why an append did not take.
#[derive(Clone, Debug, thiserror::Error)]
pub enum AppendError {
    /// The record changed since it was read; `seen` is an index at which
    /// the change is visible. Follow up to it, then decide again.
    #[error("the record changed under the write (visible at index {seen})")]
    Conflict { seen: u64 },
    /// An attempt whose answer was lost did commit: the change is visible
    /// at index `seen` (later changes may follow it there). Not to be
    /// decided again.
    #[error("the write committed (visible at index {seen})")]
    Landed { seen: u64 },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A place in a store's queue, taken before a change is decided
/// (`Store::admit`) and given back (dropped) once its append is done.
pub struct Admitted {
    _place: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Admitted {
    /// A place in a store that keeps no count of them.
    pub fn free() -> Self {
        Self { _place: None }
    }

    pub(crate) fn of(place: tokio::sync::OwnedSemaphorePermit) -> Self {
        Self {
            _place: Some(place),
        }
    }
}

/// What a store read at open, kept until `Store::load` takes it (once).
#[derive(Debug)]
pub(crate) struct LoadOnce(std::sync::Mutex<Option<Loaded>>);

impl LoadOnce {
    pub(crate) fn new(loaded: Loaded) -> Self {
        Self(std::sync::Mutex::new(Some(loaded)))
    }

    pub(crate) fn take(&self) -> Result<Loaded, StoreError> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
            .ok_or_else(|| StoreError::Io("the store is loaded once, at start".into()))
    }
}

/// Everything a store holds, as loaded at start.
#[derive(Debug, Default)]
pub struct Loaded {
    pub allocations: Vec<Allocation>,
    /// The highest global index ever committed (deletions included).
    pub last_index: u64,
    /// A store with `Leases`: the liveness keys it holds at `last_index`
    /// (each written, none removed). Empty for the others.
    pub liveness: Vec<Liveness>,
    /// Every semaphore, in name order.
    pub semaphores: Vec<Semaphore>,
}

/// A lease (etcd's lease ID): a key written under it goes when it
/// expires, and a keep-alive renews it.
pub type Lease = i64;

/// What a store with `Leases` keeps of a task's run under a TTL
/// (docs/replicas.md, "Liveness"): written with the change that makes the
/// task `running`, removed with the one that ends its run. Its live key,
/// under `lease`, is written and removed with it, and goes by itself when
/// the lease expires: a mark without its live key is a run whose agent
/// fell silent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mark {
    /// Which run: the task's `started_at` (nanoseconds since the epoch),
    /// so a mark left by an earlier run is never taken for this one's.
    pub run: i64,
    /// The TTL the run is watched under.
    pub ttl: std::time::Duration,
    /// The lease of its live key.
    pub lease: Lease,
}

/// A task's liveness keys, as a store with `Leases` lists or changes them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// The run's mark, written (`Some`) or removed.
    Mark {
        id: AllocId,
        task: crate::lifecycle::TaskName,
        mark: Option<Mark>,
    },
    /// The run's live key, written under a lease (`Some`), or gone:
    /// removed with its run, or its lease expired.
    Live {
        id: AllocId,
        task: crate::lifecycle::TaskName,
        lease: Option<Lease>,
    },
}

/// What a write does to its tasks' liveness keys, in the same transaction
/// as the record: a task that starts a run under a TTL gets its mark and
/// its live key; one whose run ends loses both.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LiveOp {
    Start {
        task: crate::lifecycle::TaskName,
        mark: Mark,
    },
    End {
        task: crate::lifecycle::TaskName,
        /// The run ends because its live key is gone (it is declared
        /// lost): the change holds only while the live key is still gone,
        /// so that a replica that heard the agent and marked the run again
        /// meanwhile wins (docs/replicas.md, "Liveness").
        lapsed: bool,
    },
}

#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    /// A write failed; the store takes nothing more until a restart
    /// recovers from what is durable.
    #[error("store I/O failed: {0}")]
    Io(String),
    /// The store was closed (the server is stopping).
    #[error("the store is closed")]
    Closed,
    /// The store takes no change for now (its queue is full, or its log
    /// reached its ceiling while checkpoints fail); nothing was decided,
    /// and a later try may succeed.
    #[error("the store takes no writes for now: {0}")]
    Unavailable(String),
    /// The store did not confirm a write and whether it was applied cannot
    /// be told: it may have been.
    #[error("{0}")]
    Uncertain(String),
    /// The data directory cannot be used: damaged, locked, or of an unknown
    /// format. Nothing was changed in it.
    #[error("{0}")]
    Unusable(String),
}

/// How a store is doing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum StoreHealth {
    #[default]
    Ok,
    /// Taking writes, but background work keeps failing (each a fixed
    /// code: `checkpoints_failing`, `log_rollover_failing`); the cause is
    /// in the server's log.
    Degraded(Vec<&'static str>),
    /// Refusing writes: `write_failed` (a write it cannot vouch for; a
    /// restart recovers from the log) or `log_full` (the unfolded log
    /// reached its ceiling; writes are taken again once a checkpoint
    /// succeeds). `cause` is for the log, never for an answer.
    Refusing { code: &'static str, cause: String },
}

/// A read through a store's quorum: the index of an allocation's record in
/// the store now (`None`: there is none).
pub type QuorumRead = Pin<Box<dyn Future<Output = Result<Option<u64>, StoreError>> + Send>>;

/// Where records live: an ordered log with etcd's contract.
///
/// An append takes all of its change or none of it. A follower is handed
/// every committed change in index order, exactly once: from the writer
/// thread after `fdatasync` (disk), at once (memory), from the watch
/// (etcd). A store never takes an append after it refused an earlier one:
/// the only refusal after admission is a failed write, which closes the
/// store until a restart replays what is durable (fail-stop, as etcd's
/// WAL). Everything that may be refused for a while (a full queue, a log
/// at its ceiling) is refused by `admit`, before anything is decided.
pub trait Store: Send + Sync + 'static {
    /// Every record, as committed, in ID order. Called once, at start.
    fn load(&self) -> Result<Loaded, StoreError>;

    /// The store's ID (`identity.rs`): given to a data directory or an
    /// etcd prefix when it is first used, the same for every replica.
    fn id(&self) -> &str;

    /// Whether processes other than this one write the store (replicas on
    /// etcd): then this process's view of it can be behind.
    fn shared(&self) -> bool {
        false
    }

    /// Hands every change committed after index `from` to `follower`, in
    /// index order, until the store is closed; after a gap it cannot
    /// replay (a compaction), it lists everything again
    /// (`Follower::resync`). Called once, before the first append.
    fn follow(&self, from: u64, follower: std::sync::Weak<dyn Follower>);

    /// A place for one change, before it is decided: refused while the
    /// store takes no change (its queue is full, its log at its ceiling, a
    /// write failed).
    fn admit(&self) -> Result<Admitted, StoreError> {
        Ok(Admitted::free())
    }

    /// Appends a change (see the trait's contract).
    fn append(&self, append: Append) -> Appended;

    /// For a store other processes write too: the index of `id`'s record
    /// read through the store's quorum, so that a replica can tell a view
    /// that is behind from an allocation that is not there. `None` for a
    /// store this process alone writes: its follower's view is complete.
    fn quorum_read(&self, _id: &AllocId) -> Option<QuorumRead> {
        None
    }

    /// The liveness leases of a store several replicas share (etcd):
    /// there a task's silence is measured by the store. `None`: measured
    /// by this process's clock.
    fn leases(&self) -> Option<Arc<dyn Leases>> {
        None
    }

    /// Why the allocation's record in the store cannot be read by this
    /// build, if it cannot (a store several builds share).
    fn unreadable(&self, _id: &str) -> Option<Unreadable> {
        None
    }

    /// The allocations whose records cannot be read, in ID order.
    fn unreadable_ids(&self) -> Vec<String> {
        Vec::new()
    }

    /// How the store is doing (`/v1/health`, the metrics).
    fn health(&self) -> StoreHealth {
        StoreHealth::Ok
    }

    /// Commits what is queued and releases the store. Later appends fail
    /// with `Closed`.
    fn close(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// Leases for the liveness keys of runs under a TTL, in a store several
/// replicas share: whichever replica hears an agent renews its run's
/// lease, and the store ends the run's live key when the lease expires.
pub trait Leases: Send + Sync {
    /// A lease for a run's live key that expires `ttl` (rounded up to what
    /// the store keeps) after it was granted or last kept alive.
    fn grant(
        &self,
        ttl: std::time::Duration,
    ) -> Pin<Box<dyn Future<Output = Result<Lease, StoreError>> + Send>>;

    /// Writes liveness keys alone (`LiveOp::Start` of runs whose live key
    /// is gone: runs that began before their TTL applied, and runs whose
    /// lease ended while this replica heard their agent), if the
    /// allocation's record is still the one at `expect` and none of those
    /// live keys exists. Resolves to the index it took.
    fn mark(
        &self,
        id: &AllocId,
        expect: u64,
        live: Vec<LiveOp>,
    ) -> Pin<Box<dyn Future<Output = Result<u64, AppendError>> + Send>>;

    /// Renews `lease` (queued; a failure is retried on another member).
    /// Whoever calls it bounds how often.
    fn keep_alive(&self, lease: Lease);

    /// Whether renewals are acknowledged now: false while one has gone
    /// unanswered past the renewal deadline (a sign of life heard then is
    /// answered 503: no lease can carry it for now).
    fn renewing(&self) -> bool {
        true
    }
}

/// A record this build cannot read: why, and the index that wrote it (a
/// deletion compares against it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unreadable {
    pub why: String,
    pub index: u64,
}

/// One committed change, as a store hands it to its follower.
#[derive(Clone, Debug)]
pub enum Change {
    /// The record as committed, stamped with its index.
    Put(Arc<Allocation>),
    Delete {
        id: AllocId,
        index: u64,
    },
    /// A task's liveness key written or gone.
    Liveness(Liveness),
    /// A semaphore as committed, stamped with its index (also written
    /// again by a grant, on a store several replicas write).
    PutSemaphore(Arc<Semaphore>),
    DeleteSemaphore {
        name: SemName,
        index: u64,
    },
}

/// Where a store delivers the changes it follows (the registry).
pub trait Follower: Send + Sync + 'static {
    /// Changes committed up to `index`, in index order (possibly none: the
    /// store has seen everything up to `index`).
    fn changed(&self, changes: Vec<Change>, index: u64);

    /// Everything the store holds, listed at `loaded.last_index`, after it
    /// could not replay the changes since the last `changed`.
    fn resync(&self, loaded: Loaded);
}

/// Appends `op` as a change decided on nothing (`expect` 0) and waits for
/// it: a test's or a tool's way to write a store without a registry.
pub async fn commit(store: &dyn Store, op: Op) -> Result<u64, AppendError> {
    let _admitted = store.admit()?;
    let appended = store.append(Append {
        op,
        expect: 0,
        live: Vec::new(),
        grants: Vec::new(),
    });
    appended.done.await
}
