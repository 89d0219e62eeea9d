//! One allocation's runtime handle.

use std::sync::Arc;

use tokio::sync::{Semaphore, watch};

use crate::lifecycle::Allocation;

/// What a handle's watch channel holds.
#[derive(Clone, Debug)]
pub(crate) enum Slot {
    /// Inserted by a registration whose commit has not finished; readers
    /// treat it as absent.
    Creating,
    /// The committed record.
    Live(Arc<Allocation>),
    /// Deleted (or its registration failed); waiters end with 410.
    Deleted,
}

pub(crate) struct Handle {
    /// Serializes decide → persist → publish for this allocation: one
    /// permit, taken by a `WriteGuard` and held across the store commit
    /// (see `Registry::update`), hence tokio's. Inline rather than an
    /// `Arc<Mutex>` of its own: with a million allocations every separate
    /// block a report touches is a cache miss.
    write: Semaphore,
    /// The committed state. Written only by the holder of `write`, after a
    /// commit; read by every reader and waiter without locking `write`.
    slot: watch::Sender<Slot>,
}

impl Handle {
    pub(crate) fn creating() -> Self {
        Self {
            write: Semaphore::new(1),
            slot: watch::Sender::new(Slot::Creating),
        }
    }

    pub(crate) fn live(a: Arc<Allocation>) -> Self {
        Self {
            write: Semaphore::new(1),
            slot: watch::Sender::new(Slot::Live(a)),
        }
    }

    /// Waits for this allocation's write lock (first come, first served).
    pub(crate) async fn lock_write(self: &Arc<Self>) -> WriteGuard {
        // The semaphore is never closed: acquiring can only wait.
        self.write
            .acquire()
            .await
            .expect("a handle's write lock is never closed")
            .forget();
        WriteGuard(self.clone())
    }

    /// The write lock if it is free.
    pub(crate) fn try_lock_write(self: &Arc<Self>) -> Option<WriteGuard> {
        let permit = self.write.try_acquire().ok()?;
        permit.forget();
        Some(WriteGuard(self.clone()))
    }

    pub(crate) fn slot_now(&self) -> Slot {
        self.slot.borrow().clone()
    }

    /// The committed record, if the allocation exists.
    pub(crate) fn current(&self) -> Option<Arc<Allocation>> {
        match &*self.slot.borrow() {
            Slot::Live(a) => Some(a.clone()),
            Slot::Creating | Slot::Deleted => None,
        }
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<Slot> {
        self.slot.subscribe()
    }

    /// Publishes a committed change and wakes every waiter on this handle.
    pub(crate) fn publish(&self, slot: Slot) {
        self.slot.send_replace(slot);
    }
}

/// A handle's write lock, owned: it keeps the handle alive, can move into
/// the task that commits, and gives the permit back when dropped.
pub(crate) struct WriteGuard(Arc<Handle>);

impl Drop for WriteGuard {
    fn drop(&mut self) {
        self.0.write.add_permits(1);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn the_write_lock_is_exclusive_and_given_back_on_drop_or_cancel() {
        let h = Arc::new(Handle::creating());
        let first = h.try_lock_write().expect("a new handle's lock is free");
        assert!(h.try_lock_write().is_none(), "held");
        // A waiter that gives up (its future dropped after one poll) takes
        // nothing with it.
        let waited = tokio::time::timeout(Duration::ZERO, h.lock_write()).await;
        assert!(waited.is_err(), "waits while held");
        drop(first);
        let second = tokio::time::timeout(Duration::ZERO, h.lock_write())
            .await
            .expect("free again once the holder dropped it");
        assert!(h.try_lock_write().is_none(), "held by the second");
        // Moved into another task and dropped there: given back too.
        tokio::spawn(async move { drop(second) }).await.unwrap();
        // Exactly one permit after all of it.
        let third = h.try_lock_write();
        assert!(third.is_some());
        assert!(h.try_lock_write().is_none(), "never more than one holder");
    }
}
