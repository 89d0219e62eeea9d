//! The in-memory store: for tests and `--in-memory`. `new` keeps what was
//! committed, so a test can rebuild a registry from it as a restart would;
//! `volatile` (the server's `--in-memory`) keeps nothing, as nothing ever
//! loads it again: no second copy of every record's index entry and no lock
//! every commit takes.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use super::{Commit, Loaded, Op, Store, StoreError};
use crate::lifecycle::{AllocId, Allocation};

pub struct MemoryStore {
    /// A new ID per store: nothing of it outlives the process.
    id: String,
    /// Committed records; written by `commit`, read by `load`. `None` for a
    /// volatile store. A std mutex: it is never held across an `.await`.
    records: Option<Mutex<HashMap<AllocId, Arc<Allocation>>>>,
    /// The highest index committed.
    last_index: AtomicU64,
    /// When set, every commit fails (to test the failure path).
    fail: AtomicBool,
    /// When set, commits never finish (to test timeouts).
    stall: AtomicBool,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self {
            id: super::identity::new_id(),
            records: None,
            last_index: AtomicU64::new(0),
            fail: AtomicBool::new(false),
            stall: AtomicBool::new(false),
        }
    }
}

impl MemoryStore {
    /// A store that keeps every committed record for `load`.
    pub fn new() -> Self {
        Self {
            records: Some(Mutex::default()),
            ..Self::default()
        }
    }

    /// A store that keeps no record: `load` finds only the last index.
    pub fn volatile() -> Self {
        Self::default()
    }

    fn records(&self) -> Option<std::sync::MutexGuard<'_, HashMap<AllocId, Arc<Allocation>>>> {
        let records = self.records.as_ref()?;
        Some(records.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Makes every following commit fail until called with `false`.
    pub fn fail_commits(&self, fail: bool) {
        self.fail.store(fail, Ordering::SeqCst);
    }

    /// Makes every following commit hang until the end of time.
    pub fn stall_commits(&self, stall: bool) {
        self.stall.store(stall, Ordering::SeqCst);
    }
}

impl Store for MemoryStore {
    fn id(&self) -> &str {
        &self.id
    }

    fn load(&self) -> Result<Loaded, StoreError> {
        // In ID order, as the `Store` contract (and the disk store) loads them.
        let mut allocations: Vec<Allocation> = self
            .records()
            .map(|records| records.values().map(|a| (**a).clone()).collect())
            .unwrap_or_default();
        allocations.sort_unstable_by(|a, b| a.id.cmp(&b.id));
        Ok(Loaded {
            allocations,
            last_index: self.last_index.load(Ordering::SeqCst),
            ..Default::default()
        })
    }

    fn commit(&self, op: Op) -> Commit {
        if self.stall.load(Ordering::SeqCst) {
            return Box::pin(std::future::pending());
        }
        if self.fail.load(Ordering::SeqCst) {
            return Box::pin(async { Err(StoreError::Io("injected failure".into())) });
        }
        let index = match &op {
            Op::Put(a) => a.modify_index,
            Op::Delete { index, .. } => *index,
        };
        self.last_index.fetch_max(index, Ordering::SeqCst);
        if let Some(mut records) = self.records() {
            match op {
                Op::Put(a) => {
                    records.insert(a.id.clone(), a);
                }
                Op::Delete { id, .. } => {
                    records.remove(&id);
                }
            }
        }
        Box::pin(async { Ok(()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifecycle::{AllocSpec, Limits, TaskName, TaskSpec};

    fn record(id: &str, index: u64) -> Arc<Allocation> {
        let task = TaskSpec {
            name: TaskName::parse("web").unwrap(),
            lifecycle: None,
            leader: false,
            readiness: false,
            liveness: None,
            depends_on: Vec::new(),
        };
        let spec = AllocSpec::new(vec![task], &Limits::default()).unwrap();
        Arc::new(Allocation::register(
            AllocId::parse(id).unwrap(),
            Arc::new(spec),
            index,
            time::OffsetDateTime::UNIX_EPOCH,
        ))
    }

    async fn commit_three(store: &MemoryStore) {
        store.commit(Op::Put(record("b", 1))).await.unwrap();
        store.commit(Op::Put(record("a", 2))).await.unwrap();
        let id = AllocId::parse("b").unwrap();
        store.commit(Op::Delete { id, index: 3 }).await.unwrap();
    }

    #[tokio::test]
    async fn a_retaining_store_loads_what_was_committed_in_id_order() {
        let store = MemoryStore::new();
        commit_three(&store).await;
        store.commit(Op::Put(record("c", 4))).await.unwrap();
        let loaded = store.load().unwrap();
        let ids: Vec<_> = loaded.allocations.iter().map(|a| a.id.as_str()).collect();
        assert_eq!(ids, ["a", "c"]);
        assert_eq!(loaded.last_index, 4);
    }

    #[tokio::test]
    async fn a_volatile_store_keeps_only_the_last_index() {
        let store = MemoryStore::volatile();
        commit_three(&store).await;
        let loaded = store.load().unwrap();
        assert!(loaded.allocations.is_empty());
        assert_eq!(loaded.last_index, 3, "a deletion's index counts too");
    }
}
