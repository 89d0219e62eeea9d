//! Durable allocation records. The registry hands every change to a
//! `Store` and publishes it only once the store says it is committed
//! (decide, persist, publish).
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

use crate::lifecycle::{AllocId, Allocation};

/// One change to persist.
#[derive(Clone, Debug)]
pub enum Op {
    /// Create or replace an allocation's record.
    Put(Arc<Allocation>),
    /// Remove an allocation. `index` is the global index the deletion used,
    /// so the counter never goes back across a restart.
    Delete { id: AllocId, index: u64 },
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
    /// A store several replicas share: the liveness keys it holds at
    /// `last_index` (each written, none removed). Empty for the others.
    pub liveness: Vec<Liveness>,
}

/// A lease in a store several replicas share (etcd's lease ID): a key
/// written under it goes when it expires, and a keep-alive renews it.
pub type Lease = i64;

/// What a store several replicas share keeps of a task's run under a TTL
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

/// A task's liveness keys, as a store several replicas share lists or
/// changes them.
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
    },
}

#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    /// A commit failed; nothing of it is applied.
    #[error("store I/O failed: {0}")]
    Io(String),
    /// The store was closed (the server is stopping).
    #[error("the store is closed")]
    Closed,
    /// The store refuses writes for now (its log reached its ceiling while
    /// checkpoints fail); nothing of the change is applied, and a later try
    /// may succeed.
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

/// A commit in flight: resolves once the change is durable, or failed.
pub type Commit = Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send>>;

/// Where records live.
///
/// `commit` may acknowledge asynchronously (a writer thread that groups
/// many changes into one durable transaction). Changes submitted in order
/// are committed in that order; the registry submits one allocation's
/// changes one at a time, in order.
pub trait Store: Send + Sync + 'static {
    /// Every record, as committed, in ID order. Called once, at start,
    /// before any commit.
    fn load(&self) -> Result<Loaded, StoreError>;

    /// Queues a change. The returned future resolves when it is durable.
    fn commit(&self, op: Op) -> Commit;

    /// The store's ID (`identity.rs`): given to a data directory or an
    /// etcd prefix when it is first used, the same for every replica.
    fn id(&self) -> &str;

    /// How the store is doing (`/v1/health`, the metrics).
    fn health(&self) -> StoreHealth {
        StoreHealth::Ok
    }

    /// Commits what is queued and releases the store. Later commits fail
    /// with `Closed`.
    fn close(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// A store other replicas write too (etcd), or `None` for one this
    /// process alone writes (disk, memory), whose `commit` is all there is.
    fn replicated(&self) -> Option<&dyn ReplicatedStore> {
        None
    }
}

/// A store that several replicas write at once. A change is decided on the
/// replica's copy of a record and committed only if the record is still
/// that copy (compare-and-swap on its `modify_index`); the store assigns the
/// change its index at commit. Nothing is published by the writer: every
/// replica (the writer's included) learns each change from `follow`, in
/// index order, so all of them publish the same changes in the same order.
pub trait ReplicatedStore: Send + Sync {
    /// Commits `op` if the allocation's record is still the one at
    /// `expect` (its `modify_index`; 0: no record). The record in a `Put`
    /// carries a placeholder index above every other index in it; readers
    /// see it stamped with the index the commit got (`Allocation::restamp`).
    /// Resolves to that index.
    ///
    /// `live` is what the change does to its tasks' liveness keys, applied
    /// in the same transaction; a deletion removes all of the
    /// allocation's.
    fn swap(&self, op: Op, expect: u64, live: Vec<LiveOp>) -> Swap;

    /// A lease for a run's live key that expires `ttl` (rounded up to what
    /// the store keeps) after it was granted or last kept alive.
    fn grant(
        &self,
        ttl: std::time::Duration,
    ) -> Pin<Box<dyn Future<Output = Result<Lease, StoreError>> + Send>>;

    /// Writes liveness keys alone (`LiveOp::Start` of runs that have none:
    /// runs that began before their TTL applied), if the allocation's
    /// record is still the one at `expect`. Resolves to the index it took.
    fn mark(&self, id: &AllocId, expect: u64, live: Vec<LiveOp>) -> Swap;

    /// Renews `lease` (queued; a failure is retried on another member).
    /// Whoever calls it bounds how often.
    fn keep_alive(&self, lease: Lease);

    /// The index of the allocation's record in the store now (`None`:
    /// there is none), read through the store's quorum: a write for an
    /// allocation this replica has not seen yet learns whether it is only
    /// behind.
    fn index_of(
        &self,
        id: &AllocId,
    ) -> Pin<Box<dyn Future<Output = Result<Option<u64>, StoreError>> + Send>>;

    /// Hands every change after index `from` to `follower`, in index
    /// order, until the store is closed; after a gap it cannot replay
    /// (a compaction), it lists everything again (`Follower::resync`).
    fn follow(&self, from: u64, follower: std::sync::Weak<dyn Follower>);

    /// Why the allocation's record in the store cannot be read by this
    /// build, if it cannot.
    fn unreadable(&self, id: &str) -> Option<Unreadable>;

    /// The allocations whose records cannot be read, in ID order.
    fn unreadable_ids(&self) -> Vec<String>;
}

/// A record this build cannot read: why, and the index that wrote it (a
/// deletion compares against it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unreadable {
    pub why: String,
    pub index: u64,
}

/// A compare-and-swap in flight.
pub type Swap = Pin<Box<dyn Future<Output = Result<u64, SwapError>> + Send>>;

#[derive(Clone, Debug, thiserror::Error)]
pub enum SwapError {
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

/// One change a shared store saw committed, by any replica.
#[derive(Debug)]
pub enum Change {
    /// The record as committed, stamped with its index.
    Put(Allocation),
    Delete {
        id: AllocId,
        index: u64,
    },
    /// A task's liveness key written or gone.
    Liveness(Liveness),
}

/// Where a shared store delivers the changes it follows (the registry).
pub trait Follower: Send + Sync + 'static {
    /// Changes committed up to `index`, in index order (possibly none: the
    /// store has seen everything up to `index`).
    fn changed(&self, changes: Vec<Change>, index: u64);

    /// Everything the store holds, listed at `loaded.last_index`, after it
    /// could not replay the changes since the last `changed`.
    fn resync(&self, loaded: Loaded);
}
