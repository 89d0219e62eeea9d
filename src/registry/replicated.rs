//! Writes and the view over a store that several replicas write (etcd).
//!
//! Decide → compare-and-swap → follow: a change is decided on this
//! replica's copy of the record and committed only if the store still holds
//! that copy (`ReplicatedStore::swap`); on a conflict the replica follows the
//! store up to the newer record and decides again. Nothing is published by
//! the writer: the store's follower (`impl Follower for Inner`) publishes
//! every change, this replica's and the others', in index order, and a
//! writer answers only once the view has reached its change's index, so its
//! caller (and anyone the caller tells) reads it back from this replica.

use std::{
    collections::HashSet,
    sync::{Arc, PoisonError},
    time::Duration,
};

use super::feed::Event;
use super::{
    Inner, Quota, Registry, RegistryError, Slot,
    handle::{Handle, WriteGuard},
};
use crate::{
    lifecycle::{AllocId, AllocSpec, Allocation, CoordState, Timestamp, WriteMark},
    metrics::Metrics,
    store::{Change, Follower, Liveness, Loaded, Op, ReplicatedStore, SwapError},
};

/// Decisions tried on newer copies before a write gives up (503 with
/// `Retry-After`): each retry needs another replica's change to the same
/// allocation in the moment between reading and swapping.
const MAX_SWAPS: usize = 16;

/// The longest a write waits for this replica's view to reach its own
/// change. The change is committed either way; past this the answer goes
/// out without it (a view that far behind is reconnecting, and health says
/// so), well before the request's own timeout would turn a committed change
/// into a 503.
const REACH_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest a read waits for this replica's view to reach an
/// allocation the store holds and the view does not (`Registry::look_up`).
const LOOK_UP_WAIT: Duration = Duration::from_secs(5);

/// 503 `store_failed` for an allocation whose record this build cannot
/// read.
fn unreadable(store: &dyn ReplicatedStore, id: &str) -> Result<(), RegistryError> {
    match store.unreadable(id) {
        Some(u) => Err(RegistryError::Unreadable {
            id: id.to_owned(),
            why: u.why,
        }),
        None => Ok(()),
    }
}

/// The index given to a change while it is decided: above every index in
/// the record it was decided on, so that it alone is replaced by the
/// commit's own index (`Allocation::restamp`).
fn placeholder(current: &Allocation) -> u64 {
    current.modify_index + 1
}

impl Registry {
    /// Waits until this replica's view holds every change up to `index`
    /// (with a shared store; with any other, the view is always current).
    /// False if `timeout` passed first.
    pub async fn wait_view(&self, index: u64, timeout: Duration) -> bool {
        let mut view = self.inner.view.subscribe();
        if self.inner.store.replicated().is_none() {
            return true;
        }
        tokio::time::timeout(timeout, view.wait_for(|&v| v >= index))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Waits until this replica's view holds a committed change at `index`
    /// before its writer answers.
    async fn reach(&self, index: u64) {
        if !self.wait_view(index, REACH_TIMEOUT).await {
            tracing::warn!(
                index,
                view = *self.inner.view.borrow(),
                "the view did not reach a committed change in time; answering without it"
            );
        }
    }

    /// Before a request answers from this replica's view about `id`: on a
    /// store several replicas write, an allocation whose record this build
    /// cannot read is 503 `store_failed`, and a miss is checked with the
    /// store's quorum: if the store holds the allocation, the view is
    /// waited for (up to `LOOK_UP_WAIT`), so that a replica never answers
    /// 404 for an allocation that exists (one registered through another
    /// replica a moment ago, or through this one while its view lagged).
    /// A view that does not get there in time is 503 `store_unavailable`.
    /// Nothing on any other store.
    pub async fn look_up(&self, id: &str) -> Result<(), RegistryError> {
        let Some(store) = self.inner.store.replicated() else {
            return Ok(());
        };
        unreadable(store, id)?;
        if self.get(id).is_ok() {
            return Ok(());
        }
        let Ok(alloc) = AllocId::parse(id) else {
            return Ok(());
        };
        let Some(index) = store.index_of(&alloc).await? else {
            return Ok(());
        };
        if !self.wait_view(index, LOOK_UP_WAIT).await {
            return Err(self.behind(id, index));
        }
        // Reached: there now, or deleted since (404 is then right).
        unreadable(store, id)
    }

    /// On a store several replicas write, the index this replica's view
    /// has reached.
    pub fn view_index(&self) -> Option<u64> {
        self.inner
            .store
            .replicated()
            .map(|_| *self.inner.view.borrow())
    }

    /// The allocations (at most `max`, in ID order) whose records this
    /// replica cannot read.
    pub fn unreadable(&self, max: usize) -> Vec<String> {
        let mut ids = self
            .inner
            .store
            .replicated()
            .map(|s| s.unreadable_ids())
            .unwrap_or_default();
        ids.truncate(max);
        ids
    }

    fn behind(&self, id: &str, index: u64) -> RegistryError {
        RegistryError::Behind {
            id: id.to_owned(),
            index,
            view: *self.inner.view.borrow(),
        }
    }

    /// Takes an allocation's write lock, retrying while the handle found
    /// was replaced (deleted and registered again) before the lock was
    /// ours. Serializes this replica's own writers, so they rarely
    /// conflict with one another. An allocation missing from the view, or
    /// whose registration the view has not reached yet, is asked of the
    /// store once (`look_up`).
    async fn lock_live(
        &self,
        store: &dyn ReplicatedStore,
        id: &str,
    ) -> Result<(WriteGuard, Arc<Handle>, Arc<Allocation>), RegistryError> {
        let mut asked = None;
        for _ in 0..MAX_SWAPS {
            unreadable(store, id)?;
            let handle = self.handle(id).ok();
            if let Some(handle) = &handle {
                let write = handle.lock_write().await;
                match handle.slot_now() {
                    Slot::Live(a) => return Ok((write, handle.clone(), a)),
                    Slot::Deleted => continue,
                    Slot::Creating => {}
                }
            }
            // Not in the view (yet): registered through another replica a
            // moment ago, or the view lags behind a registration.
            match asked {
                // The view reached the store's record and still has no
                // allocation: deleted since.
                Some((_, true)) => break,
                Some((index, false)) => return Err(self.behind(id, index)),
                None => {}
            }
            let Ok(alloc) = AllocId::parse(id) else {
                break;
            };
            match store.index_of(&alloc).await? {
                Some(index) => {
                    asked = Some((index, self.wait_view(index, REACH_TIMEOUT).await));
                }
                None => break,
            }
        }
        Err(RegistryError::AllocationNotFound(id.to_owned()))
    }

    /// After a conflict: waits until the view holds the record that won
    /// (at index `seen`), or for a record deleted meanwhile (`seen` 0),
    /// until the handle no longer holds the one the change was decided on.
    async fn catch_up(&self, handle: &Handle, expect: u64, seen: u64) {
        if seen > 0 {
            return self.reach(seen).await;
        }
        let moved = handle.wait_for(|s| !matches!(s, Slot::Live(a) if a.modify_index == expect));
        if tokio::time::timeout(REACH_TIMEOUT, moved).await.is_err() {
            tracing::warn!(alloc = %handle.id(), "the view did not see a deletion in time");
        }
    }

    fn contended(id: &str) -> RegistryError {
        RegistryError::Contended(format!(
            "allocation \"{id}\" kept changing through other replicas while this change was \
             decided; try again"
        ))
    }

    pub(super) async fn update_shared<R>(
        &self,
        store: &dyn ReplicatedStore,
        id: &str,
        decide: impl Fn(&Allocation, &dyn Fn() -> u64) -> Result<(Option<Allocation>, R), RegistryError>,
        counted: impl FnOnce(&Metrics) + Send + 'static,
    ) -> Result<(Arc<Allocation>, R), RegistryError> {
        // Leases granted for runs this write starts, kept for its next
        // rounds (a lease no round uses expires by itself).
        let mut leases = std::collections::HashMap::new();
        for _ in 0..MAX_SWAPS {
            let (write, handle, current) = self.lock_live(store, id).await?;
            let stamp = placeholder(&current);
            let decided = decide(&current, &|| stamp);
            // A decision that writes nothing (a report that changes nothing,
            // a refused restart) holds only if this copy is the newest:
            // another replica's change may not have reached this view yet.
            // Asked through the store's quorum; if the copy is behind, the
            // view catches up and the request is decided again.
            let writes = matches!(decided, Ok((Some(_), _)));
            let refused = matches!(decided, Err(RegistryError::RestartRefused { .. }));
            if !writes && (refused || decided.is_ok()) {
                let now = store.index_of(&current.id).await?;
                if now != Some(current.modify_index) {
                    drop(write);
                    self.catch_up(&handle, current.modify_index, now.unwrap_or(0))
                        .await;
                    continue;
                }
            }
            let (next, out) = decided?;
            let Some(mut next) = next else {
                counted(&self.inner.config.metrics);
                return Ok((current, out));
            };
            let expect = current.modify_index;
            next.mark_write(WriteMark {
                id: fastrand::u64(..),
                parent: expect,
            });
            let live = self
                .live_ops(store, &handle, &current, &next, &mut leases)
                .await?;
            match store
                .swap(Op::Put(Arc::new(next.clone())), expect, live)
                .await
            {
                Ok(index) => {
                    self.reach(index).await;
                    drop(write);
                    next.restamp(stamp, index);
                    self.observe(&current, &next);
                    counted(&self.inner.config.metrics);
                    return Ok((Arc::new(next), out));
                }
                // An attempt whose answer was lost committed: answered with
                // the record as it is now, never decided again.
                Err(SwapError::Landed { seen }) => {
                    self.reach(seen).await;
                    drop(write);
                    next.restamp(stamp, seen);
                    self.observe(&current, &next);
                    counted(&self.inner.config.metrics);
                    let now = handle.current().unwrap_or_else(|| Arc::new(next));
                    return Ok((now, out));
                }
                Err(SwapError::Conflict { seen }) => {
                    drop(write);
                    self.catch_up(&handle, current.modify_index, seen).await;
                }
                Err(SwapError::Store(e)) => return Err(e.into()),
            }
        }
        Err(Self::contended(id))
    }

    pub(super) async fn register_shared(
        &self,
        store: &dyn ReplicatedStore,
        id: AllocId,
        spec: AllocSpec,
        quota: Option<Quota<'_>>,
    ) -> Result<(Arc<Allocation>, bool), RegistryError> {
        let spec = self
            .inner
            .specs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .share(Arc::new(spec));
        for _ in 0..MAX_SWAPS {
            let (handle, fresh) = self.get_or_insert(&id, quota)?;
            let write = match fresh {
                Some(guard) => guard,
                None => handle.lock_write().await,
            };
            match handle.slot_now() {
                Slot::Live(a) if a.spec == spec => return Ok((a, false)),
                Slot::Live(a) => {
                    return Err(RegistryError::AllocationExists {
                        id,
                        index: a.modify_index,
                    });
                }
                Slot::Deleted => continue,
                Slot::Creating => {}
            }
            const STAMP: u64 = 1;
            let mut a = Allocation::register(id.clone(), spec.clone(), STAMP, self.now());
            if let Err(e) = self.check_dependencies(&a) {
                drop(write);
                self.inner.forget_creating(&id, &handle);
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
            a.mark_write(WriteMark {
                id: fastrand::u64(..),
                parent: 0,
            });
            match store
                .swap(Op::Put(Arc::new(a.clone())), 0, Vec::new())
                .await
            {
                Ok(index) | Err(SwapError::Landed { seen: index }) => {
                    self.reach(index).await;
                    drop(write);
                    a.restamp(STAMP, index);
                    tracing::info!(alloc = %a.id, state = %a.state, tasks = a.tasks.len(), index, "allocation registered");
                    if a.state != CoordState::Init {
                        self.inner
                            .config
                            .metrics
                            .transition(CoordState::Init, a.state);
                    }
                    // An attempt whose answer was lost created it: the
                    // record as it is now (others may have changed it).
                    let a = match handle.current() {
                        Some(now) if now.spec == a.spec => now,
                        _ => Arc::new(a),
                    };
                    return Ok((a, true));
                }
                // Registered through another replica: once the view has
                // it, the next round compares the specs.
                Err(SwapError::Conflict { seen }) => {
                    drop(write);
                    self.reach(seen).await;
                    self.inner.forget_creating(&id, &handle);
                }
                Err(SwapError::Store(e)) => {
                    drop(write);
                    self.inner.forget_creating(&id, &handle);
                    return Err(e.into());
                }
            }
        }
        Err(Self::contended(id.as_str()))
    }

    pub(super) async fn delete_shared(
        &self,
        store: &dyn ReplicatedStore,
        id: &str,
    ) -> Result<u64, RegistryError> {
        for _ in 0..MAX_SWAPS {
            // A record this build cannot read can still be deleted: the
            // compare is on the index that wrote it.
            if let (Some(u), Ok(alloc)) = (store.unreadable(id), AllocId::parse(id)) {
                let op = Op::Delete {
                    id: alloc,
                    index: 0,
                };
                match store.swap(op, u.index, Vec::new()).await {
                    Ok(index) | Err(SwapError::Landed { seen: index }) => {
                        self.reach(index).await;
                        tracing::info!(alloc = %id, index, "an unreadable allocation deleted");
                        return Ok(index);
                    }
                    Err(SwapError::Conflict { seen }) => {
                        self.reach(seen).await;
                        continue;
                    }
                    Err(SwapError::Store(e)) => return Err(e.into()),
                }
            }
            let (write, handle, current) = self.lock_live(store, id).await?;
            let op = Op::Delete {
                id: current.id.clone(),
                index: 0,
            };
            match store.swap(op, current.modify_index, Vec::new()).await {
                Ok(index) | Err(SwapError::Landed { seen: index }) => {
                    self.reach(index).await;
                    drop(write);
                    tracing::info!(alloc = %id, index, "allocation deleted");
                    return Ok(index);
                }
                Err(SwapError::Conflict { seen }) => {
                    drop(write);
                    self.catch_up(&handle, current.modify_index, seen).await;
                }
                Err(SwapError::Store(e)) => return Err(e.into()),
            }
        }
        Err(Self::contended(id))
    }
}

impl Inner {
    /// Removes a handle a registration inserted, unless the view made it
    /// live meanwhile (registered through another replica).
    fn forget_creating(&self, id: &AllocId, handle: &Arc<Handle>) {
        let mut map = self.write_map();
        if matches!(handle.slot_now(), Slot::Creating)
            && map.get(id.as_str()).is_some_and(|h| Arc::ptr_eq(h, handle))
        {
            handle.publish(Slot::Deleted);
            map.remove(id.as_str());
        }
    }

    /// Publishes a record the store committed (under the map's lock, so a
    /// registration's cleanup never removes a handle made live here).
    /// `recorded`: a change followed one by one (its timeline entries are
    /// kept), not a listing.
    /// Returns the record as published, if it was new to this view.
    fn put(
        &self,
        map: &mut super::AllocMap,
        mut a: Allocation,
        recorded: bool,
    ) -> Option<Arc<Allocation>> {
        a.spec = self
            .specs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .share(a.spec);
        let a = Arc::new(a);
        let limit = if recorded {
            self.config.timeline_events
        } else {
            0
        };
        match map.get(a.id.as_str()) {
            Some(handle) => {
                let now = handle.current();
                let same = now
                    .as_ref()
                    .is_some_and(|now| now.modify_index == a.modify_index);
                if same {
                    return None;
                }
                // Deleted and registered again with another spec, the
                // deletion unseen (a listing after a compaction): the old
                // spec's dependencies go from the reverse index.
                if let Some(old) = &now
                    && old.spec != a.spec
                {
                    self.index_dependencies(old, false);
                }
                handle.publish_live(now.as_deref(), a.clone(), limit);
                self.reschedule(handle, &a);
            }
            None => {
                let handle = Arc::new(Handle::creating(&a.id));
                handle.publish_live(None, a.clone(), limit);
                self.reschedule(&handle, &a);
                map.insert(a.id.clone(), handle);
            }
        }
        self.index_dependencies(&a, true);
        Some(a)
    }

    /// Whether the view held `id`.
    fn gone(&self, map: &mut super::AllocMap, id: &str) -> bool {
        let Some(handle) = map.get(id) else {
            return false;
        };
        if let Some(a) = handle.current() {
            self.index_dependencies(&a, false);
        }
        handle.publish(Slot::Deleted);
        map.remove(id);
        true
    }

    /// The registry this is the inner state of, while it lives.
    pub(super) fn registry(&self) -> Option<Registry> {
        self.me.upgrade().map(|inner| Registry { inner })
    }

    /// The view reached `index`: the global index and every writer
    /// waiting for it follow.
    fn reached(&self, index: u64) {
        self.index
            .fetch_max(index, std::sync::atomic::Ordering::SeqCst);
        self.view.send_if_modified(|v| {
            let moved = index > *v;
            *v = (*v).max(index);
            moved
        });
    }
}

/// Applies a liveness key the store listed or changed to the handle of its
/// allocation in `map` (if the view holds it, with that task). Returns the
/// handle, and whether a live key was written (its lease is new).
pub(super) fn keep_liveness(
    map: &mut super::AllocMap,
    l: &Liveness,
    now: Timestamp,
) -> Option<(Arc<Handle>, usize, bool)> {
    let (id, task) = match l {
        Liveness::Mark { id, task, .. } | Liveness::Live { id, task, .. } => (id, task),
    };
    let handle = map.get(id.as_str())?;
    let a = handle.current()?;
    let i = a.position(task.as_str())?;
    let life = handle.lives().life_made(a.tasks.len(), i)?;
    let written = match l {
        Liveness::Mark { mark, .. } => {
            life.kept.set_mark(*mark);
            false
        }
        Liveness::Live { lease, .. } => life.kept.set_live(*lease, now),
    };
    Some((handle.clone(), i, written))
}

impl Follower for Inner {
    fn changed(&self, changes: Vec<Change>, index: u64) {
        let mut events = Vec::new();
        let mut touched = Vec::new();
        // Looked at once the view holds all of it (`reschedule` trusts a
        // missing key only then).
        let mut timed: Vec<Arc<Handle>> = Vec::new();
        if !changes.is_empty() {
            let now = self.config.clock.now();
            let mut map = self.write_map();
            for change in changes {
                match change {
                    Change::Put(a) => {
                        if let Some(a) = self.put(&mut map, a, true) {
                            if let Some(h) = map.get(a.id.as_str()) {
                                timed.push(h.clone());
                            }
                            touched.push(a.id.clone());
                            events.push(Event::put(a));
                        }
                    }
                    Change::Delete { id, index } => {
                        if self.gone(&mut map, id.as_str()) {
                            touched.push(id.clone());
                            events.push(Event::deleted(id, index));
                        }
                    }
                    Change::Liveness(l) => {
                        if let Some((handle, i, written)) = keep_liveness(&mut map, &l, now) {
                            if written && let Some(store) = self.store.replicated() {
                                self.keeper.lease_known(store, &handle, i);
                            }
                            timed.push(handle);
                        }
                    }
                }
            }
        }
        // Before the writers waiting for `index` answer: whoever they tell
        // finds the change in the stream too.
        self.feed.append(events, index);
        self.reached(index);
        self.look_again(timed);
        // Every replica judges the dependents of what changed; the
        // compare-and-swap keeps one write of each new verdict.
        if !touched.is_empty()
            && let Some(registry) = self.registry()
        {
            for id in touched {
                // Not waited for: this is the watch's thread of changes.
                let _ = registry.dependents_of(id.as_str());
            }
        }
    }

    fn resync(&self, loaded: Loaded) {
        let now = self.config.clock.now();
        let mut map = self.write_map();
        let listed: HashSet<AllocId> = loaded.allocations.iter().map(|a| a.id.clone()).collect();
        let stale: Vec<AllocId> = map
            .range_from("")
            .filter(|(id, h)| !listed.contains(*id) && matches!(h.slot_now(), Slot::Live(_)))
            .map(|(id, _)| id.clone())
            .collect();
        for id in stale {
            self.gone(&mut map, id.as_str());
        }
        let changed = loaded.allocations.len();
        for a in loaded.allocations {
            self.put(&mut map, a, false);
        }
        // Liveness keys as listed: whatever is not listed is gone (a live
        // key expired while the watch was behind).
        let mut timed = Vec::new();
        for (_, handle) in map.range_from("") {
            if handle.lives().made() {
                for life in handle.lives().all() {
                    life.kept.forget(now);
                }
                timed.push(handle.clone());
            }
        }
        for l in &loaded.liveness {
            if let Some((handle, i, written)) = keep_liveness(&mut map, l, now) {
                if written && let Some(store) = self.store.replicated() {
                    self.keeper.lease_known(store, &handle, i);
                }
                timed.push(handle);
            }
        }
        drop(map);
        // What changed meanwhile is known only as a whole: the stream's
        // readers list again too.
        self.feed.reset(loaded.last_index);
        tracing::info!(
            allocations = changed,
            index = loaded.last_index,
            "the view was listed again"
        );
        self.reached(loaded.last_index);
        self.look_again(timed);
        if let Some(registry) = self.registry() {
            registry.resolve_all();
        }
    }
}

impl Inner {
    /// Schedules each handle's next look again, now that the view holds
    /// what changed (a handle named twice is looked at once).
    fn look_again(&self, mut handles: Vec<Arc<Handle>>) {
        if handles.is_empty() {
            return;
        }
        handles.sort_by_key(|h| Arc::as_ptr(h) as usize);
        handles.dedup_by_key(|h| Arc::as_ptr(h) as usize);
        for handle in handles {
            if let Some(a) = handle.current() {
                self.reschedule(&handle, &a);
            }
        }
        self.keep_driving();
    }
}
