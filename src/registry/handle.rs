//! One allocation's runtime handle.

use std::sync::{
    Arc, Mutex, PoisonError, RwLock,
    atomic::{AtomicI64, AtomicU8, Ordering},
};

use tokio::sync::{Notify, Semaphore};

use super::{
    signs::Lives,
    timeline::{self, Timeline},
};

/// A handle the due-time heap does not look at.
pub(super) const NOT_SCHEDULED: i64 = i64::MAX;
use crate::lifecycle::{AllocId, Allocation};

/// What a handle publishes.
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

/// Everything of one allocation's runtime state but the record itself, in
/// one heap block: with a million allocations every separate block a report
/// touches is a cache miss (and, before, a `tokio::sync::watch` channel
/// added a block of ~350 bytes whose every send locked nine mutexes).
///
/// Its locks (`write`, `slot`, `timeline`) are taken in the registry's
/// lock order, written down at `Inner` in `registry/mod.rs`: `write`
/// before any other lock, `slot` and `timeline` each on its own, never
/// while the other is held.
pub(crate) struct Handle {
    /// The allocation's ID, which the registry's map compares on every
    /// lookup (see `Key`).
    key: Key,
    /// Serializes this allocation's decisions: one permit, taken by a
    /// `WriteGuard`. An update on a store that stamps its appends at once
    /// holds it only to decide and append (`write.rs`: appends are
    /// pipelined); a registration, a deletion, and any write on a store
    /// that stamps at commit hold it until their change is published.
    /// Tokio's.
    write: Semaphore,
    /// The newest version appended whose change has not been published
    /// yet: the next writer decides on it; no reader ever sees it. Written
    /// by the holder of `write`; cleared once it is published (or failed)
    /// unless a newer one replaced it.
    pending: Mutex<Option<Arc<Pending>>>,
    /// The published state. Written only by the store's follower (and a
    /// registration that failed); read by every reader and waiter without
    /// locking `write`.
    slot: RwLock<Slot>,
    /// Woken after every change of `slot` (see `wait_for`).
    changed: Notify,
    /// The allocation's recent history (`timeline.rs`); written with each
    /// publication, before the waiters are woken.
    timeline: Mutex<Timeline>,
    /// Its tasks' signs of life (`lives.rs`), for tasks under a TTL:
    /// written by reports, heartbeats and parked queries, read when the
    /// allocation is looked at. Not part of the record.
    lives: Lives,
    /// The moment the due-time heap looks at it next (`time.rs`).
    pub(crate) scheduled: AtomicI64,
}

/// IDs up to this many bytes (a UUID's 36 fit) are kept in the handle's
/// own block.
const INLINE_ID: usize = 39;

/// An allocation ID where a lookup compares it without leaving the handle:
/// with a million allocations, a pointer to the ID's own string is a cache
/// miss of its own on every request (measured: see BENCHMARKS.md, "What
/// mattered").
enum Key {
    Inline { len: u8, bytes: [u8; INLINE_ID] },
    Shared(AllocId),
}

impl Key {
    fn new(id: &AllocId) -> Self {
        let s = id.as_str().as_bytes();
        if s.len() > INLINE_ID {
            return Key::Shared(id.clone());
        }
        let mut bytes = [0; INLINE_ID];
        bytes[..s.len()].copy_from_slice(s);
        Key::Inline {
            len: s.len() as u8,
            bytes,
        }
    }

    fn as_str(&self) -> &str {
        match self {
            Key::Inline { len, bytes } => {
                std::str::from_utf8(&bytes[..usize::from(*len)]).expect("copied from a str whole")
            }
            Key::Shared(id) => id.as_str(),
        }
    }
}

/// A version appended, and whether it was published once that is known.
pub(crate) struct Pending {
    pub(crate) record: Arc<Allocation>,
    /// 0 while the commit runs, then `OK` or `FAILED`.
    outcome: AtomicU8,
    done: Notify,
}

const OK: u8 = 1;
const FAILED: u8 = 2;

impl Pending {
    pub(crate) fn new(record: Arc<Allocation>) -> Self {
        Self {
            record,
            outcome: AtomicU8::new(0),
            done: Notify::new(),
        }
    }

    /// Ends the commit: published (`ok`), or failed.
    pub(crate) fn finish(&self, ok: bool) {
        self.outcome
            .store(if ok { OK } else { FAILED }, Ordering::Release);
        self.done.notify_waiters();
    }

    /// Waits until the commit is published (true) or failed (false).
    pub(crate) async fn outcome(&self) -> bool {
        loop {
            let done = self.done.notified();
            let mut done = std::pin::pin!(done);
            // Registered before the check: a `finish` after it wakes this.
            done.as_mut().enable();
            match self.outcome.load(Ordering::Acquire) {
                OK => return true,
                FAILED => return false,
                _ => done.await,
            }
        }
    }
}

impl Handle {
    pub(crate) fn creating(id: &AllocId) -> Self {
        Self::new(id, Slot::Creating)
    }

    pub(crate) fn live(a: Arc<Allocation>) -> Self {
        let id = a.id.clone();
        Self::new(&id, Slot::Live(a))
    }

    fn new(id: &AllocId, slot: Slot) -> Self {
        Self {
            key: Key::new(id),
            write: Semaphore::new(1),
            pending: Mutex::new(None),
            slot: RwLock::new(slot),
            changed: Notify::new(),
            timeline: Mutex::new(Timeline::default()),
            lives: Lives::default(),
            scheduled: AtomicI64::new(NOT_SCHEDULED),
        }
    }

    pub(crate) fn lives(&self) -> &Lives {
        &self.lives
    }

    /// The allocation's ID.
    pub(crate) fn id(&self) -> &str {
        self.key.as_str()
    }

    /// The allocation's ID, as one.
    pub(crate) fn id_owned(&self) -> AllocId {
        match &self.key {
            Key::Shared(id) => id.clone(),
            Key::Inline { .. } => AllocId::parse(self.id()).expect("copied from an ID"),
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

    /// Whether a write holds the lock now, or a change appended is not
    /// published yet.
    pub(crate) fn writing(&self) -> bool {
        self.write.available_permits() == 0 || self.pending().is_some()
    }

    /// The version appended last that is not published yet. Read before
    /// the slot by a writer: it is cleared only after its publication, so
    /// a writer that finds none finds the slot up to date.
    pub(crate) fn pending(&self) -> Option<Arc<Pending>> {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Records the version just appended (under the write lock).
    pub(crate) fn set_pending(&self, pending: Arc<Pending>) {
        *self.pending.lock().unwrap_or_else(PoisonError::into_inner) = Some(pending);
    }

    /// Forgets `mine` once it is published or failed, unless a newer
    /// version replaced it.
    pub(crate) fn clear_pending(&self, mine: &Arc<Pending>) {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        if pending.as_ref().is_some_and(|p| Arc::ptr_eq(p, mine)) {
            *pending = None;
        }
    }

    /// The write lock if it is free.
    pub(crate) fn try_lock_write(self: &Arc<Self>) -> Option<WriteGuard> {
        let permit = self.write.try_acquire().ok()?;
        permit.forget();
        Some(WriteGuard(self.clone()))
    }

    pub(crate) fn slot_now(&self) -> Slot {
        self.slot
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The published record, if the allocation exists.
    pub(crate) fn current(&self) -> Option<Arc<Allocation>> {
        match self.slot_now() {
            Slot::Live(a) => Some(a),
            Slot::Creating | Slot::Deleted => None,
        }
    }

    /// Publishes a committed version of the record, its timeline entries
    /// (from `prev`, the version before, or none for a new allocation)
    /// first, then wakes every waiter (the follower's).
    pub(crate) fn publish_live(
        &self,
        prev: Option<&Allocation>,
        next: Arc<Allocation>,
        limit: usize,
    ) {
        if limit > 0 {
            let entries = timeline::entries(prev, &next);
            self.timeline
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend(entries, limit);
        }
        self.publish(Slot::Live(next));
    }

    /// The timeline's entries, oldest first.
    pub(crate) fn timeline(&self) -> Vec<timeline::Entry> {
        self.timeline
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entries()
            .collect()
    }

    /// Publishes a committed change and wakes every waiter on this handle.
    pub(crate) fn publish(&self, slot: Slot) {
        let old = std::mem::replace(
            &mut *self.slot.write().unwrap_or_else(PoisonError::into_inner),
            slot,
        );
        self.changed.notify_waiters();
        // The replaced record is freed (if this was its last reference)
        // outside the lock.
        drop(old);
    }

    /// The published state once `ready` holds for it. A change published
    /// between a check and the park is never slept through: the waiter is
    /// registered for the next wake-up before it looks at the state.
    pub(crate) async fn wait_for(&self, mut ready: impl FnMut(&Slot) -> bool) -> Slot {
        loop {
            let notified = self.changed.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            let slot = self.slot_now();
            if ready(&slot) {
                return slot;
            }
            notified.await;
        }
    }
}

/// A handle's write lock, owned: it keeps the handle alive, can move into
/// the task that commits, and gives the permit back when dropped.
pub(crate) struct WriteGuard(Arc<Handle>);

impl WriteGuard {
    /// The handle whose lock this is.
    pub(crate) fn handle(&self) -> &Arc<Handle> {
        &self.0
    }
}

impl Drop for WriteGuard {
    fn drop(&mut self) {
        self.0.write.add_permits(1);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_handle_knows_its_id_short_or_long() {
        for len in [1, INLINE_ID - 1, INLINE_ID, INLINE_ID + 1, 128] {
            let id = AllocId::parse(&"a".repeat(len)).unwrap();
            assert_eq!(Handle::creating(&id).id(), id.as_str(), "{len}");
            assert_eq!(
                matches!(Key::new(&id), Key::Inline { .. }),
                len <= INLINE_ID
            );
        }
    }

    #[tokio::test]
    async fn the_write_lock_is_exclusive_and_given_back_on_drop_or_cancel() {
        let h = Arc::new(Handle::creating(&AllocId::parse("a1").unwrap()));
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

    #[tokio::test]
    async fn a_waiter_returns_at_once_or_on_the_publish_that_satisfies_it() {
        let h = Arc::new(Handle::creating(&AllocId::parse("a1").unwrap()));
        let now = h.wait_for(|s| matches!(s, Slot::Creating));
        let now = tokio::time::timeout(Duration::ZERO, now).await;
        assert!(matches!(now, Ok(Slot::Creating)), "already true: no park");

        // Waiters in tasks of their own, so only a real wake-up (not a
        // poll by the test) can finish them.
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let h = h.clone();
                tokio::spawn(async move { h.wait_for(|s| matches!(s, Slot::Deleted)).await })
            })
            .collect();
        // On this single-threaded runtime, yielding runs each waiter to its
        // park (if one ran late it would see the final state: still correct).
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        h.publish(Slot::Creating);
        for w in &waiters {
            assert!(!w.is_finished(), "a change that does not satisfy it");
        }
        h.publish(Slot::Deleted);
        for w in waiters {
            let s = tokio::time::timeout(Duration::from_secs(10), w)
                .await
                .expect("woken by the publish")
                .unwrap();
            assert!(matches!(s, Slot::Deleted));
        }
    }
}
