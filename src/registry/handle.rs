//! One allocation's runtime handle.

use std::sync::Arc;

use tokio::sync::{Mutex, watch};

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
    /// Serializes decide → persist → publish for this allocation. Held
    /// across the store commit (see `Registry::update`), hence tokio's.
    pub(crate) write: Arc<Mutex<()>>,
    /// The committed state. Written only by the holder of `write`, after a
    /// commit; read by every reader and waiter without locking `write`.
    slot: watch::Sender<Slot>,
}

impl Handle {
    pub(crate) fn creating() -> Self {
        Self {
            write: Arc::new(Mutex::new(())),
            slot: watch::Sender::new(Slot::Creating),
        }
    }

    pub(crate) fn live(a: Arc<Allocation>) -> Self {
        Self {
            write: Arc::new(Mutex::new(())),
            slot: watch::Sender::new(Slot::Live(a)),
        }
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
