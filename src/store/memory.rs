//! The in-memory store: for tests and `--in-memory`. `new` keeps what was
//! committed, so a test can rebuild a registry from it as a restart would;
//! `volatile` (the server's `--in-memory`) keeps nothing, as nothing ever
//! loads it again: no second copy of every record and no map every append
//! writes.
//!
//! An append is committed at once: stamped with the next index and handed
//! to the follower in the same call, under one lock, so the follower sees
//! every change in index order.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, PoisonError, Weak,
        atomic::{AtomicBool, Ordering},
    },
};

use super::{
    Admitted, Append, AppendError, Appended, Change, Follower, Loaded, Op, Store, StoreError,
};
use crate::lifecycle::{AllocId, Allocation, SemName, Semaphore};

pub struct MemoryStore {
    /// A new ID per store: nothing of it outlives the process.
    id: String,
    /// Whether `load` gets the records back (`new`) or nothing (`volatile`).
    retain: bool,
    /// The log's state; its lock orders the appends and their delivery.
    /// A std mutex: it is never held across an `.await`.
    state: Mutex<State>,
    /// When set, every admission is refused (to test the failure path).
    fail: AtomicBool,
    /// When set, appends never finish (to test timeouts).
    stall: AtomicBool,
}

#[derive(Default)]
struct State {
    /// The highest index committed.
    last_index: u64,
    /// Committed records, when `retain`.
    records: HashMap<AllocId, Arc<Allocation>>,
    /// Committed semaphores, when `retain`.
    semaphores: std::collections::BTreeMap<SemName, Arc<Semaphore>>,
    follower: Option<Weak<dyn Follower>>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self {
            id: super::identity::new_id(),
            retain: false,
            state: Mutex::default(),
            fail: AtomicBool::new(false),
            stall: AtomicBool::new(false),
        }
    }
}

impl MemoryStore {
    /// A store that keeps every committed record for `load`.
    pub fn new() -> Self {
        Self {
            retain: true,
            ..Self::default()
        }
    }

    /// A store that keeps no record: `load` finds only the last index.
    pub fn volatile() -> Self {
        Self::default()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Refuses every following change (before it is decided) until called
    /// with `false`.
    pub fn fail_commits(&self, fail: bool) {
        self.fail.store(fail, Ordering::SeqCst);
    }

    /// Makes every following append hang until the end of time.
    pub fn stall_commits(&self, stall: bool) {
        self.stall.store(stall, Ordering::SeqCst);
    }
}

impl Store for MemoryStore {
    fn id(&self) -> &str {
        &self.id
    }

    fn load(&self) -> Result<Loaded, StoreError> {
        let state = self.state();
        // In ID order, as the `Store` contract (and the disk store) loads them.
        let mut allocations: Vec<Allocation> =
            state.records.values().map(|a| (**a).clone()).collect();
        allocations.sort_unstable_by(|a, b| a.id.cmp(&b.id));
        Ok(Loaded {
            allocations,
            last_index: state.last_index,
            semaphores: state.semaphores.values().map(|s| (**s).clone()).collect(),
            ..Default::default()
        })
    }

    fn follow(&self, from: u64, follower: Weak<dyn Follower>) {
        let mut state = self.state();
        state.last_index = state.last_index.max(from);
        state.follower = Some(follower);
    }

    fn admit(&self) -> Result<Admitted, StoreError> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(StoreError::Io("injected failure".into()));
        }
        Ok(Admitted::free())
    }

    fn append(&self, append: Append) -> Appended {
        if self.stall.load(Ordering::SeqCst) {
            let record = match append.op {
                Op::Put(a) => Some(a),
                _ => None,
            };
            return Appended {
                record,
                stamped: false,
                done: Box::pin(std::future::pending()),
            };
        }
        let mut state = self.state();
        let index = state.last_index + 1;
        state.last_index = index;
        let (change, record) = match append.op {
            Op::Put(mut a) => {
                let placeholder = a.modify_index;
                Arc::make_mut(&mut a).restamp(placeholder, index);
                if self.retain {
                    state.records.insert(a.id.clone(), a.clone());
                }
                (Change::Put(a.clone()), Some(a))
            }
            Op::Delete(id) => {
                state.records.remove(&id);
                (Change::Delete { id, index }, None)
            }
            Op::PutSemaphore(mut s) => {
                let placeholder = s.modify_index;
                Arc::make_mut(&mut s).restamp(placeholder, index);
                if self.retain {
                    state.semaphores.insert(s.name.clone(), s.clone());
                }
                (Change::PutSemaphore(s), None)
            }
            Op::DeleteSemaphore(name) => {
                state.semaphores.remove(&name);
                (Change::DeleteSemaphore { name, index }, None)
            }
        };
        if let Some(follower) = state.follower.as_ref().and_then(Weak::upgrade) {
            follower.changed(vec![change], index);
        }
        drop(state);
        Appended {
            record,
            stamped: true,
            done: Box::pin(async move { Ok::<_, AppendError>(index) }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifecycle::{AllocSpec, Limits, TaskName, TaskSpec};
    use crate::store::commit;

    fn record(id: &str) -> Arc<Allocation> {
        let task = TaskSpec {
            name: TaskName::parse("web").unwrap(),
            lifecycle: None,
            leader: false,
            readiness: false,
            liveness: None,
            depends_on: Vec::new(),
            acquire: Vec::new(),
            barrier: None,
        };
        let spec = AllocSpec::new(vec![task], &Limits::default()).unwrap();
        Arc::new(Allocation::register(
            AllocId::parse(id).unwrap(),
            Arc::new(spec),
            1,
            time::OffsetDateTime::UNIX_EPOCH,
        ))
    }

    async fn commit_three(store: &MemoryStore) {
        commit(store, Op::Put(record("b"))).await.unwrap();
        commit(store, Op::Put(record("a"))).await.unwrap();
        let id = AllocId::parse("b").unwrap();
        commit(store, Op::Delete(id)).await.unwrap();
    }

    #[tokio::test]
    async fn a_retaining_store_loads_what_was_committed_in_id_order() {
        let store = MemoryStore::new();
        commit_three(&store).await;
        let index = commit(&store, Op::Put(record("c"))).await.unwrap();
        assert_eq!(index, 4);
        let loaded = store.load().unwrap();
        let ids: Vec<_> = loaded.allocations.iter().map(|a| a.id.as_str()).collect();
        assert_eq!(ids, ["a", "c"]);
        assert_eq!(loaded.last_index, 4);
        assert_eq!(loaded.allocations[1].modify_index, 4, "stamped");
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
