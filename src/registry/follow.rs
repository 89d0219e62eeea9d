//! The follower: where every committed change is published, for every
//! store, in index order — the records readers and waiters see, the
//! timelines, the event feed, the timers, the liveness keys, and the
//! dependents' judging — and the view's index, which writers wait on.
//!
//! A store hands its follower each committed change once: the disk store
//! from its writer thread after `fdatasync`, the memory store at once, the
//! etcd store from its watch (this replica's changes and the others'). A
//! writer answers only once the view has reached its change's index, so
//! its caller (and anyone the caller tells) reads it back from here.

use std::{
    collections::HashSet,
    sync::{Arc, RwLockReadGuard, RwLockWriteGuard},
    time::Duration,
};

use super::{
    Inner, Registry, RegistryError,
    feed::Event,
    handle::{Handle, Slot},
    lives::keep_liveness,
    map::AllocMap,
    traces,
};
use crate::{
    lifecycle::{AllocId, Allocation},
    store::{Change, Follower, Loaded},
};

/// The longest a write waits for this replica's view to reach its own
/// change. The change is committed either way; past this the answer goes
/// out without it (a view that far behind is reconnecting, and health says
/// so), well before the request's own timeout would turn a committed change
/// into a 503.
pub(super) const REACH_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest a read waits for this replica's view to reach an
/// allocation the store holds and the view does not (`Registry::look_up`).
const LOOK_UP_WAIT: Duration = Duration::from_secs(5);

/// The map as the follower holds it for a batch: read, unless the batch
/// adds or removes an allocation.
enum Map<'a> {
    Read(RwLockReadGuard<'a, AllocMap>),
    Write(RwLockWriteGuard<'a, AllocMap>),
}

impl Map<'_> {
    fn get(&self, id: &str) -> Option<&Arc<Handle>> {
        match self {
            Map::Read(m) => m.get(id),
            Map::Write(m) => m.get(id),
        }
    }

    fn write(&mut self) -> &mut AllocMap {
        match self {
            Map::Write(m) => m,
            Map::Read(_) => unreachable!("a batch that adds or removes holds the map for writing"),
        }
    }
}

impl Inner {
    /// Publishes a committed record (`recorded`: a change followed one by
    /// one, whose timeline entries are kept; not a listing). Returns its
    /// handle and the version it replaced, if the record was new to this
    /// view.
    fn put(
        &self,
        map: &mut Map<'_>,
        mut a: Arc<Allocation>,
        recorded: bool,
    ) -> Option<(Arc<Handle>, Option<Arc<Allocation>>)> {
        let limit = if recorded {
            self.config.timeline_events
        } else {
            0
        };
        let handle = map.get(a.id.as_str()).cloned();
        let now = handle.as_ref().and_then(|h| h.current());
        if now
            .as_ref()
            .is_some_and(|now| now.modify_index == a.modify_index)
        {
            return None;
        }
        // Equal specs are one value: the version before's, or the shared one.
        let shared = match &now {
            Some(old) if old.spec == a.spec => old.spec.clone(),
            _ => self.share_spec(a.spec.clone()),
        };
        if !Arc::ptr_eq(&shared, &a.spec) {
            Arc::make_mut(&mut a).spec = shared;
        }
        // Deleted and registered again with another spec, the deletion
        // unseen (a listing after a compaction): the old spec's
        // dependencies go from the reverse index.
        if let Some(old) = &now
            && old.spec != a.spec
        {
            self.judges.index(old, false);
        }
        let handle = match handle {
            Some(handle) => handle,
            None => {
                let handle = Arc::new(Handle::creating(&a.id));
                map.write().insert(a.id.clone(), handle.clone());
                handle
            }
        };
        self.judges.index(&a, true);
        self.gates.index(now.as_deref(), Some(&a), a.modify_index);
        handle.publish_live(now.as_deref(), a, limit);
        Some((handle, now))
    }

    /// Removes `id` from the view (deleted at `index`); whether it held it.
    fn gone(&self, map: &mut AllocMap, id: &str, index: u64) -> bool {
        let Some(handle) = map.get(id).cloned() else {
            return false;
        };
        if let Some(a) = handle.current() {
            self.judges.index(&a, false);
            self.gates.index(Some(&a), None, index);
        }
        handle.publish(Slot::Deleted);
        map.remove(id);
        true
    }

    /// Removes a handle a registration inserted, unless the follower made
    /// it live meanwhile.
    pub(super) fn forget_creating(&self, id: &AllocId, handle: &Arc<Handle>) {
        let mut map = self.write_map();
        if matches!(handle.slot_now(), Slot::Creating)
            && map.get(id.as_str()).is_some_and(|h| Arc::ptr_eq(h, handle))
        {
            handle.publish(Slot::Deleted);
            map.remove(id.as_str());
        }
    }

    /// The view reached `index`: every writer waiting for it answers.
    fn reached(&self, index: u64) {
        self.view.send_if_modified(|v| {
            let moved = index > *v;
            *v = (*v).max(index);
            moved
        });
    }

    /// Whether the view holds everything up to `a` (the liveness keys
    /// written with it included): only then does a missing key mean what
    /// it says.
    pub(super) fn view_holds(&self, a: &Allocation) -> bool {
        *self.view.borrow() >= a.modify_index
    }

    /// Schedules each handle's next look, now that the view holds what
    /// changed (a handle named twice is looked at once).
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
    }
}

impl Follower for Inner {
    fn changed(&self, changes: Vec<Change>, index: u64) {
        let mut events = Vec::with_capacity(changes.len());
        let mut judge = Vec::new();
        let mut timed: Vec<Arc<Handle>> = Vec::new();
        let traces = self.config.traces.as_deref();
        let mut spans = Vec::new();
        if !changes.is_empty() {
            let now = self.config.clock.now();
            let read = self.read_map();
            let adds = changes.iter().any(|c| match c {
                Change::Put(a) => read.get(a.id.as_str()).is_none(),
                Change::Delete { .. } => true,
                Change::Liveness(_) | Change::PutSemaphore(_) | Change::DeleteSemaphore { .. } => {
                    false
                }
            });
            let mut map = if adds {
                drop(read);
                Map::Write(self.write_map())
            } else {
                Map::Read(read)
            };
            for change in changes {
                match change {
                    Change::Put(a) => {
                        if let Some((handle, prev)) = self.put(&mut map, a, true) {
                            let a = handle.current().expect("just published");
                            if let Some(traces) = traces {
                                let own = !self.shared
                                    || a.writes()
                                        .last()
                                        .is_some_and(|m| traces.owns(&traces::Own::Put(m.id)));
                                let store = self.store.id();
                                traces.put(store, prev.as_deref(), &a, own, &mut spans);
                            }
                            judge.push((a.id.clone(), a.modify_index));
                            events.push(Event::put(a));
                            timed.push(handle);
                        }
                    }
                    Change::Delete { id, index } => {
                        if let Some(traces) = traces
                            && let Some(last) = map.get(id.as_str()).and_then(|h| h.current())
                        {
                            let own = !self.shared || traces.owns(&traces::Own::Delete(id.clone()));
                            traces.deleted(self.store.id(), &last, now, own, &mut spans);
                        }
                        if self.gone(map.write(), id.as_str(), index) {
                            judge.push((id.clone(), index));
                            events.push(Event::deleted(id, index));
                        }
                    }
                    Change::Liveness(l) => {
                        let map = match &map {
                            Map::Read(m) => &**m,
                            Map::Write(m) => &**m,
                        };
                        if let Some((handle, i, written)) = keep_liveness(map, &l, now) {
                            if written {
                                self.lease_known(&handle, i);
                            }
                            timed.push(handle);
                        }
                    }
                    Change::PutSemaphore(s) => {
                        let (name, index) = (s.name.clone(), s.modify_index);
                        let moved = self.gates.define(&name, Some(s), index);
                        timed.extend(moved.iter().filter_map(|id| map.get(id.as_str()).cloned()));
                    }
                    Change::DeleteSemaphore { name, index } => {
                        let moved = self.gates.define(&name, None, index);
                        timed.extend(moved.iter().filter_map(|id| map.get(id.as_str()).cloned()));
                    }
                }
            }
        }
        // Outside the map's lock; before the writers answer, so that a
        // graceful stop after their answers exports the spans.
        if let Some(traces) = traces
            && !spans.is_empty()
        {
            traces.emit(spans);
        }
        // Before the writers waiting for `index` answer: whoever they tell
        // finds the change in the stream, and the judging it started
        // registered.
        self.feed.append(events, index);
        self.judge(judge);
        self.judge_gates();
        self.reached(index);
        self.look_again(timed);
    }

    fn resync(&self, loaded: Loaded) {
        let now = self.config.clock.now();
        let mut map = Map::Write(self.write_map());
        let listed: HashSet<AllocId> = loaded.allocations.iter().map(|a| a.id.clone()).collect();
        let stale: Vec<AllocId> = map
            .write()
            .range_from("")
            .filter(|(id, h)| !listed.contains(*id) && matches!(h.slot_now(), Slot::Live(_)))
            .map(|(id, _)| id.clone())
            .collect();
        for id in stale {
            self.gone(map.write(), id.as_str(), loaded.last_index);
        }
        let changed = loaded.allocations.len();
        if let Some(traces) = &self.config.traces {
            let now = loaded
                .allocations
                .iter()
                .map(|a| (a.id.as_str(), a.modify_index))
                .collect();
            traces.listed(&now);
        }
        for a in loaded.allocations {
            self.put(&mut map, Arc::new(a), false);
        }
        self.gates.define_all(loaded.semaphores, loaded.last_index);
        // Liveness keys as listed: whatever is not listed is gone (a live
        // key expired while the watch was behind).
        let map = map.write();
        let mut timed = Vec::new();
        for (_, handle) in map.range_from("") {
            if handle.lives().made() {
                for life in handle.lives().all() {
                    life.kept.forget(now);
                }
            }
            timed.push(handle.clone());
        }
        for l in &loaded.liveness {
            if let Some((handle, i, written)) = keep_liveness(map, l, now)
                && written
            {
                self.lease_known(&handle, i);
            }
        }
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

impl Registry {
    /// Waits until the view holds every change up to `index`. False if
    /// `timeout` passed first.
    pub async fn wait_view(&self, index: u64, timeout: Duration) -> bool {
        let mut view = self.inner.view.subscribe();
        if *view.borrow_and_update() >= index {
            return true;
        }
        tokio::time::timeout(timeout, view.wait_for(|&v| v >= index))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Waits until the view holds a committed change at `index` before its
    /// writer answers.
    pub(super) async fn reach(&self, index: u64) {
        if !self.wait_view(index, REACH_TIMEOUT).await {
            tracing::warn!(
                index,
                view = *self.inner.view.borrow(),
                "the view did not reach a committed change in time; answering without it"
            );
        }
    }

    /// 503 `store_failed` for an allocation whose record this build cannot
    /// read.
    pub(super) fn readable(&self, id: &str) -> Result<(), RegistryError> {
        match self.inner.store.unreadable(id) {
            Some(u) => Err(RegistryError::Unreadable {
                id: id.to_owned(),
                why: u.why,
            }),
            None => Ok(()),
        }
    }

    /// Before a request answers from the view about `id`: an allocation
    /// whose record this build cannot read is 503 `store_failed`, and on a
    /// store others write, a miss is checked with the store's quorum: if
    /// the store holds the allocation, the view is waited for (up to
    /// `LOOK_UP_WAIT`), so that a replica never answers 404 for an
    /// allocation that exists (one registered through another replica a
    /// moment ago). A view that does not get there in time is 503
    /// `store_unavailable`.
    pub async fn look_up(&self, id: &str) -> Result<(), RegistryError> {
        self.readable(id)?;
        if self.get(id).is_ok() {
            return Ok(());
        }
        let Ok(alloc) = AllocId::parse(id) else {
            return Ok(());
        };
        let Some(read) = self.inner.store.quorum_read(&alloc) else {
            return Ok(());
        };
        let Some(index) = read.await? else {
            return Ok(());
        };
        if !self.wait_view(index, LOOK_UP_WAIT).await {
            return Err(self.behind(id, index));
        }
        // Reached: there now, or deleted since (404 is then right).
        self.readable(id)
    }

    /// On a store others write too, the index this replica's view has
    /// reached.
    pub fn view_index(&self) -> Option<u64> {
        self.inner.shared.then(|| *self.inner.view.borrow())
    }

    /// The allocations (at most `max`, in ID order) whose records this
    /// replica cannot read.
    pub fn unreadable(&self, max: usize) -> Vec<String> {
        let mut ids = self.inner.store.unreadable_ids();
        ids.truncate(max);
        ids
    }

    pub(super) fn behind(&self, id: &str, index: u64) -> RegistryError {
        RegistryError::Behind {
            id: id.to_owned(),
            index,
            view: *self.inner.view.borrow(),
        }
    }
}
