//! The in-memory store: for tests and `--in-memory`. It keeps what was
//! committed, so a test can rebuild a registry from it as a restart would.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
};

use super::{Commit, Loaded, Op, Store, StoreError};
use crate::lifecycle::{AllocId, Allocation};

#[derive(Default)]
pub struct MemoryStore {
    /// Committed records and the last index; written by `commit`, read by
    /// `load`. A std mutex: it is never held across an `.await`.
    inner: Mutex<Inner>,
    /// When set, every commit fails (to test the failure path).
    fail: AtomicBool,
    /// When set, commits never finish (to test timeouts).
    stall: AtomicBool,
}

#[derive(Default)]
struct Inner {
    records: HashMap<AllocId, Arc<Allocation>>,
    last_index: u64,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
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
    fn load(&self) -> Result<Loaded, StoreError> {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(Loaded {
            // In ID order, as the `Store` contract (and redb) loads them.
            allocations: {
                let mut all: Vec<Allocation> =
                    inner.records.values().map(|a| (**a).clone()).collect();
                all.sort_unstable_by(|a, b| a.id.cmp(&b.id));
                all
            },
            last_index: inner.last_index,
        })
    }

    fn commit(&self, op: Op) -> Commit {
        if self.stall.load(Ordering::SeqCst) {
            return Box::pin(std::future::pending());
        }
        if self.fail.load(Ordering::SeqCst) {
            return Box::pin(async { Err(StoreError::Io("injected failure".into())) });
        }
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        match op {
            Op::Put(a) => {
                inner.last_index = inner.last_index.max(a.modify_index);
                inner.records.insert(a.id.clone(), a);
            }
            Op::Delete { id, index } => {
                inner.last_index = inner.last_index.max(index);
                inner.records.remove(&id);
            }
        }
        Box::pin(async { Ok(()) })
    }
}
