//! Durable allocation records. The registry hands every change to a
//! `Store` and publishes it only once the store says it is committed
//! (decide, persist, publish).
//!
//! This layer knows records, not rules: it never evaluates a coordinator.

mod disk;
pub mod fs;
mod memory;
mod migrate;
#[cfg(test)]
mod powerloss;
mod record;
mod salvage;
mod snapshot;
mod wal;

use std::{future::Future, pin::Pin, sync::Arc};

pub use disk::DEFAULT_LOG_CEILING;
pub use disk::{
    DEFAULT_LOG_LIMIT, DiskStore, DiskStoreConfig, FoldBench, FoldChanges, LOCK_FILE, StoreStats,
    read_only,
};
pub use memory::MemoryStore;
pub use migrate::{MIGRATED_FILE, REDB_FILE};
pub use salvage::{SalvageReport, salvage};
pub use snapshot::SNAPSHOT_FILE;
/// The log segments in a data directory, oldest first.
pub fn log_segments(dir: &std::path::Path) -> std::io::Result<Vec<(u64, std::path::PathBuf)>> {
    wal::list_segments(&fs::RealFs, dir)
}

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

/// Everything a store holds, as loaded at start.
#[derive(Debug, Default)]
pub struct Loaded {
    pub allocations: Vec<Allocation>,
    /// The highest global index ever committed (deletions included).
    pub last_index: u64,
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

    /// How the store is doing (`/v1/health`, the metrics).
    fn health(&self) -> StoreHealth {
        StoreHealth::Ok
    }

    /// Commits what is queued and releases the store. Later commits fail
    /// with `Closed`.
    fn close(&self) -> Result<(), StoreError> {
        Ok(())
    }
}
