//! Semaphores across allocations (docs/lifecycle.md, "Semaphores"): the
//! definitions as the follower publishes them, each semaphore's line (its
//! holders and its queue, kept from the published records), and the judge
//! that grants slots through the one write path.
//!
//! A task's place is in its own record (`Hold`): queued since the index of
//! the change that made it otherwise allowed, or granted by a change
//! (whose index is the grant's fence). The lines here are only an index of
//! those records, rebuilt at start, so nothing about a line is stored
//! twice.
//!
//! **Granting.** After a publication changes a line (a holder left, a task
//! joined, a limit moved), the judge plans the grants of each changed
//! semaphore from the published lines: a task is granted once it is within
//! the first `limit − holders` of every queue it is in (one order, `since`,
//! in every queue: no task passes another, and no two wait on each other).
//! Each grant is a write of the task's allocation that checks the plan
//! again under the allocation's lock. One judge runs per registry and
//! waits for its grants' publication before it plans again, so on a store
//! this process alone writes no two plans overlap. With replicas every
//! replica plans, and each grant's append compares the version of every
//! semaphore it grants (`Append::grants`): of two grants decided on one
//! view of a semaphore, one commits; the other is decided again on the
//! newer view.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use tokio::sync::{Notify, watch};

use super::{Inner, Registry, RegistryError};
use crate::{
    lifecycle::{AllocId, Allocation, Hold, SemName, Semaphore, Timestamp},
    store::{Append, AppendError, Op},
};

/// After a grant that could not be written, the judge tries again after
/// this long.
const RETRY: Duration = Duration::from_secs(1);

/// Where a queued task stands in a semaphore's queue: its place (`since`),
/// allocation and task position. Ordered as the queue is.
pub type Place = (u64, AllocId, usize);

/// A holder of a slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    pub fence: u64,
    pub since: Timestamp,
}

/// One semaphore's line, as the published records give it.
#[derive(Default)]
struct Line {
    /// (allocation, task position) → its grant.
    holders: BTreeMap<(AllocId, usize), Holder>,
    queue: BTreeSet<Place>,
    /// The index of the last change of the line or the definition.
    changed: u64,
}

#[derive(Default)]
pub(super) struct State {
    defs: BTreeMap<SemName, Arc<Semaphore>>,
    lines: HashMap<SemName, Line>,
    /// Semaphores whose line or definition changed since the judge last
    /// planned.
    dirty: BTreeSet<SemName>,
    /// Each queued task (allocation, position) → the semaphores it waits
    /// for (its spec's `acquire`, shared with the spec's).
    wants: HashMap<(AllocId, usize), Arc<[SemName]>>,
    /// The barriers, by name (`barriers.rs`).
    pub(super) barriers: HashMap<SemName, super::barriers::Barrier>,
    /// Barriers whose members changed since the judge last planned.
    pub(super) gathering: BTreeSet<SemName>,
}

/// The semaphores, their lines, and the judge (a leaf lock: `state` is
/// never held while another lock is taken).
#[derive(Default)]
pub(super) struct Gates {
    state: Mutex<State>,
    /// Wakes the judge (shared with it: the judge holds no registry while
    /// it waits).
    pub(super) wake: Arc<Notify>,
    /// Whether the judge runs.
    judging: std::sync::atomic::AtomicBool,
    /// Bumped to the index of every change of a line or a definition
    /// (blocking queries on semaphores wait on it).
    pub(super) moved: watch::Sender<u64>,
    /// One definition write at a time on this server.
    writing: tokio::sync::Mutex<()>,
    /// Whether the judge has nothing left to do (set under `state`'s
    /// lock, with the dirty set it read empty).
    pub(super) idle: watch::Sender<bool>,
}

/// A semaphore as `GET /v1/semaphores/{name}` shows it.
#[derive(Clone, Debug)]
pub struct SemaphoreState {
    pub semaphore: Arc<Semaphore>,
    /// (allocation, task position, grant), by fence.
    pub holders: Vec<(AllocId, usize, Holder)>,
    /// In order.
    pub queue: Vec<Place>,
    /// The index of the last change of its line or definition.
    pub changed: u64,
}

/// Why a task that acquires a semaphore is held back by it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Waiting {
    /// In its queue, at `position` (1: first).
    Queued { position: usize },
    /// No semaphore of that name exists.
    NotRegistered,
}

impl State {
    fn line(&mut self, name: &SemName) -> &mut Line {
        self.lines.entry(name.clone()).or_default()
    }

    /// Takes `a`'s tasks out of their lines (`add` false) or puts them in.
    fn index(&mut self, a: &Allocation, add: bool, index: u64) {
        for (i, spec) in a.spec.tasks().iter().enumerate() {
            let Some(hold) = a.tasks[i].hold() else {
                continue;
            };
            if let Hold::Queued { .. } = hold {
                let key = (a.id.clone(), i);
                if add {
                    self.wants.insert(key, spec.acquire.as_slice().into());
                } else {
                    self.wants.remove(&key);
                }
            }
            for name in &spec.acquire {
                let line = self.line(name);
                match hold {
                    Hold::Queued { since, .. } => {
                        let place = (since, a.id.clone(), i);
                        if add {
                            line.queue.insert(place);
                        } else {
                            line.queue.remove(&place);
                        }
                    }
                    Hold::Granted { fence, at } => {
                        let key = (a.id.clone(), i);
                        if add {
                            line.holders.insert(key, Holder { fence, since: at });
                        } else {
                            line.holders.remove(&key);
                        }
                    }
                }
                line.changed = line.changed.max(index);
                // The line of a semaphore that does not exist goes with its
                // last task.
                let empty = line.holders.is_empty() && line.queue.is_empty();
                if empty && !add && !self.defs.contains_key(name) {
                    self.lines.remove(name);
                } else {
                    self.dirty.insert(name.clone());
                }
            }
        }
    }

    /// How many of a semaphore's slots are free now (none while it does
    /// not exist).
    fn free(&self, name: &SemName) -> usize {
        let Some(def) = self.defs.get(name) else {
            return 0;
        };
        let held = self.lines.get(name).map_or(0, |l| l.holders.len());
        (def.limit as usize).saturating_sub(held)
    }

    /// Whether the task at `place` takes a place in its queues: not while
    /// one of its semaphores does not exist (it cannot be granted then,
    /// and one tenant's missing semaphore must not hold up the others'
    /// queues; it counts again, in its old place, once it exists).
    fn counts(&self, place: &Place) -> bool {
        self.wants
            .get(&(place.1.clone(), place.2))
            .is_some_and(|sems| sems.iter().all(|n| self.defs.contains_key(n)))
    }

    /// The places ahead of `place` in `name`'s queue that count.
    fn ahead<'a>(&'a self, name: &SemName, place: &'a Place) -> impl Iterator<Item = &'a Place> {
        self.lines
            .get(name)
            .into_iter()
            .flat_map(move |l| l.queue.range(..place))
            .filter(|p| self.counts(p))
    }

    /// Whether `place` is within the first `free` of `name`'s queue.
    fn within(&self, name: &SemName, place: &Place) -> bool {
        let free = self.free(name);
        free > 0
            && self
                .lines
                .get(name)
                .is_some_and(|l| l.queue.contains(place))
            && self.ahead(name, place).take(free).count() < free
    }

    /// Whether task `i` of `a`, queued at `since`, may be granted now.
    fn may_grant(&self, a: &Allocation, i: usize, since: u64) -> bool {
        let place = (since, a.id.clone(), i);
        a.spec.tasks()[i]
            .acquire
            .iter()
            .all(|name| self.within(name, &place))
    }

    /// The grants the lines of `names` allow now: every task within the
    /// first free places of each queue it is in.
    fn plan(&self, names: &BTreeSet<SemName>) -> BTreeSet<(AllocId, usize, u64)> {
        let mut grants = BTreeSet::new();
        for name in names {
            let free = self.free(name);
            let Some(line) = self.lines.get(name) else {
                continue;
            };
            for place in line.queue.iter().filter(|p| self.counts(p)).take(free) {
                let (since, id, i) = place;
                if grants.contains(&(id.clone(), *i, *since)) {
                    continue;
                }
                // Within the free places of every queue it is in (a
                // semaphore that does not exist has none).
                let fits = self
                    .wants
                    .get(&(id.clone(), *i))
                    .is_some_and(|sems| sems.iter().all(|n| self.within(n, place)));
                if fits {
                    grants.insert((id.clone(), *i, *since));
                }
            }
        }
        grants
    }
}

impl Gates {
    pub(super) fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps the lines and the barriers for a published change of an
    /// allocation (`prev` before it, `next` after it; `None`: absent).
    /// Cheap for allocations that acquire nothing and meet at no barrier.
    pub(super) fn index(&self, prev: Option<&Allocation>, next: Option<&Allocation>, index: u64) {
        let gated = |a: Option<&Allocation>| a.is_some_and(|a| a.spec.gated());
        if !gated(prev) && !gated(next) {
            return;
        }
        if let (Some(p), Some(n)) = (prev, next)
            && Arc::ptr_eq(&p.spec, &n.spec)
            && p.tasks
                .iter()
                .zip(&n.tasks)
                .all(|(a, b)| a.hold() == b.hold() && a.meet() == b.meet())
        {
            return;
        }
        let mut state = self.state();
        if let Some(p) = prev {
            state.index(p, false, index);
            state.index_members(p, false, index);
            if next.is_none() {
                state.keep_decisions(p);
            }
        }
        if let Some(n) = next {
            state.index(n, true, index);
            state.index_members(n, true, index);
        }
        self.idle.send_replace(false);
        drop(state);
        self.moved(index);
        self.wake.notify_one();
    }

    /// A published definition (`None`: deleted). Returns the allocations
    /// holding it whose grants' lapse moved (its grant timeout changed, or
    /// it went): their timers are set again.
    pub(super) fn define(
        &self,
        name: &SemName,
        def: Option<Arc<Semaphore>>,
        index: u64,
    ) -> Vec<AllocId> {
        let mut state = self.state();
        let before = state.defs.get(name).map(|d| (d.limit, d.grant_timeout));
        let after = def.as_ref().map(|d| (d.limit, d.grant_timeout));
        let timeout_moved = before.map(|b| b.1) != after.map(|a| a.1);
        let holders: Vec<AllocId> = if timeout_moved {
            state
                .lines
                .get(name)
                .map(|l| l.holders.keys().map(|(id, _)| id.clone()).collect())
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        match def {
            Some(d) => state.defs.insert(name.clone(), d),
            None => state.defs.remove(name),
        };
        // A grant that only wrote the semaphore again (replicas) changes
        // nothing a line shows.
        let unused = state
            .lines
            .get(name)
            .is_some_and(|l| l.holders.is_empty() && l.queue.is_empty());
        if before.is_some() != after.is_some() {
            // Its waiters take a place in their other semaphores' queues
            // only while it exists: those queues moved too.
            let others: Vec<SemName> = state
                .lines
                .get(name)
                .into_iter()
                .flat_map(|l| l.queue.iter())
                .filter_map(|(_, id, i)| state.wants.get(&(id.clone(), *i)))
                .flat_map(|sems| sems.iter().cloned())
                .collect();
            state.dirty.extend(others);
        }
        if before != after {
            if after.is_none() && unused {
                state.lines.remove(name);
            } else {
                state.line(name).changed = index;
                state.dirty.insert(name.clone());
            }
            self.idle.send_replace(false);
            drop(state);
            self.moved(index);
            self.wake.notify_one();
        }
        holders
    }

    /// Every definition again (a start, or a listing after a gap).
    pub(super) fn define_all(&self, defs: Vec<Semaphore>, index: u64) {
        let mut state = self.state();
        let names: BTreeSet<SemName> = state
            .defs
            .keys()
            .cloned()
            .chain(defs.iter().map(|d| d.name.clone()))
            .collect();
        state.defs = defs
            .into_iter()
            .map(|d| (d.name.clone(), Arc::new(d)))
            .collect();
        for name in names {
            state.line(&name).changed = index;
            state.dirty.insert(name);
        }
        self.idle.send_replace(false);
        drop(state);
        self.moved(index);
        self.wake.notify_one();
    }

    fn moved(&self, index: u64) {
        self.moved.send_if_modified(|v| {
            let moved = index > *v;
            *v = (*v).max(index);
            moved
        });
    }

    /// The definitions of the semaphores task `i` of `next` was granted by
    /// the change from `prev` (each as this view holds it), for a store
    /// several replicas write (`Append::grants`).
    pub(super) fn granted(&self, prev: &Allocation, next: &Allocation) -> Vec<Arc<Semaphore>> {
        let mut out = Vec::new();
        let state = self.state();
        for (i, spec) in next.spec.tasks().iter().enumerate() {
            let granted = |a: &Allocation| matches!(a.tasks[i].hold(), Some(Hold::Granted { .. }));
            if spec.acquire.is_empty() || !granted(next) || granted(prev) {
                continue;
            }
            out.extend(
                spec.acquire
                    .iter()
                    .filter_map(|n| state.defs.get(n).cloned()),
            );
        }
        out
    }

    /// When the first grant of `a` that has not been taken up lapses:
    /// granted, still `pending`, past the shortest `grant_timeout` of its
    /// semaphores.
    pub(super) fn lapses_at(&self, a: &Allocation) -> Option<Timestamp> {
        let state = self.state();
        (0..a.tasks.len())
            .filter_map(|i| lapses(&state, a, i))
            .min()
    }

    /// Why task `i` of `a` is held back by its semaphores, by semaphore (a
    /// task that holds them, or is in no line, is held back by none).
    pub(super) fn waiting(&self, a: &Allocation, i: usize) -> Vec<(SemName, Waiting)> {
        let Some(Hold::Queued { since, .. }) = a.tasks[i].hold() else {
            return Vec::new();
        };
        let place = (since, a.id.clone(), i);
        let state = self.state();
        a.spec.tasks()[i]
            .acquire
            .iter()
            .map(|name| {
                let why = if !state.defs.contains_key(name) {
                    Waiting::NotRegistered
                } else {
                    let position = state.ahead(name, &place).count() + 1;
                    Waiting::Queued { position }
                };
                (name.clone(), why)
            })
            .collect()
    }
}

/// When task `i`'s grant lapses, if it holds one it has not taken up.
fn lapses(state: &State, a: &Allocation, i: usize) -> Option<Timestamp> {
    let Some(Hold::Granted { at, .. }) = a.tasks[i].hold() else {
        return None;
    };
    if a.tasks[i].state != crate::lifecycle::RunState::Pending {
        return None;
    }
    // A deleted semaphore takes back nothing: its grant has no timeout.
    let timeout = a.spec.tasks()[i]
        .acquire
        .iter()
        .filter_map(|n| state.defs.get(n).map(|d| d.grant_timeout))
        .min()?;
    Some(at.saturating_add(time::Duration::try_from(timeout).unwrap_or(time::Duration::MAX)))
}

impl Inner {
    /// Starts the judge, once, inside a runtime; the supervisor starts it
    /// again if it panics.
    pub(super) fn judge_gates(&self) {
        self.keep_once(&self.gates.judging, "semaphores", || {
            let me = self.me.clone();
            move || judge(me.clone())
        });
    }
}

/// Plans and writes grants whenever a line changes, until the registry is
/// dropped.
async fn judge(me: std::sync::Weak<Inner>) {
    let Some(wake) = me.upgrade().map(|inner| inner.gates.wake.clone()) else {
        return;
    };
    loop {
        let woken = wake.notified();
        let mut woken = std::pin::pin!(woken);
        // Registered before the lines are read: a change after the read
        // wakes this wait.
        woken.as_mut().enable();
        let plan = {
            let Some(inner) = me.upgrade() else { return };
            let now = inner.config.clock.now();
            let mut state = inner.gates.state();
            let dirty = std::mem::take(&mut state.dirty);
            let gathering = std::mem::take(&mut state.gathering);
            if dirty.is_empty() && gathering.is_empty() {
                inner.gates.idle.send_replace(true);
                None
            } else {
                let grants = state.plan(&dirty);
                let meets = state.plan_meets(&gathering, now);
                drop(state);
                Some((Registry { inner }, grants, meets, dirty, gathering))
            }
        };
        let Some((registry, grants, meets, dirty, gathering)) = plan else {
            woken.await;
            continue;
        };
        let mut all = tokio::task::JoinSet::new();
        for (id, i, since) in grants {
            let r = registry.clone();
            all.spawn(async move { r.grant(&id, i, since).await });
        }
        for (id, i, name) in meets {
            let r = registry.clone();
            all.spawn(async move { r.meet(&id, i, &name).await });
        }
        let mut failed = false;
        while let Some(done) = all.join_next().await {
            failed |= !matches!(done, Ok(Ok(())));
        }
        if failed {
            // Planned again after a pause: the lines may have moved, and a
            // store that refuses writes is not asked again at once.
            {
                let mut state = registry.inner.gates.state();
                state.dirty.extend(dirty);
                state.gathering.extend(gathering);
            }
            drop(registry);
            tokio::time::sleep(RETRY).await;
        }
    }
}

impl Registry {
    /// Waits until the judge has planned every change of a line published
    /// so far and written its grants (a test's way to know that no grant
    /// is coming).
    #[cfg(test)]
    pub(super) async fn gates_idle(&self) {
        let mut idle = self.inner.gates.idle.subscribe();
        let _ = idle.wait_for(|idle| *idle).await;
    }

    /// Whether the judge has nothing left to do now (`gates_idle`, without
    /// waiting).
    #[cfg(test)]
    pub(super) fn gates_idle_now(&self) -> bool {
        *self.inner.gates.idle.borrow()
    }

    /// Grants task `i` of `id` its semaphores, if the lines as published
    /// still allow it when its allocation's write decides.
    async fn grant(&self, id: &AllocId, i: usize, since: u64) -> Result<(), RegistryError> {
        let written = self
            .write(
                id.as_str(),
                |a, next_index| {
                    let queued =
                        matches!(a.tasks.get(i).and_then(|t| t.hold()), Some(Hold::Queued { since: s, .. }) if s == since);
                    if !queued || !self.inner.gates.state().may_grant(a, i, since) {
                        return Ok((None, ()));
                    }
                    Ok((a.grant(i, self.now(), next_index), ()))
                },
                |_| {},
            )
            .await;
        match written {
            Ok(_) | Err(RegistryError::AllocationNotFound(_) | RegistryError::Deleted(_)) => Ok(()),
            Err(e) => {
                tracing::warn!(alloc = %id, error = %e, "a semaphore's grant could not be written; trying again");
                Err(e)
            }
        }
    }

    /// Lets every grant of `a` that was not taken up in time lapse (the
    /// task goes to the back of its queues).
    pub(super) async fn lapse_grants(&self, id: &str) -> Result<(), RegistryError> {
        let written = self
            .write(
                id,
                |a, next_index| {
                    let now = self.now();
                    let state = self.inner.gates.state();
                    let due: Vec<usize> = (0..a.tasks.len())
                        .filter(|&i| lapses(&state, a, i).is_some_and(|at| at <= now))
                        .collect();
                    drop(state);
                    let index = next_index();
                    let mut next: Option<Allocation> = None;
                    for i in due {
                        let base = next.as_ref().unwrap_or(a);
                        if let Some(n) = base.expire_grant(i, now, || index) {
                            next = Some(n);
                        }
                    }
                    Ok((next, ()))
                },
                |_| {},
            )
            .await;
        match written {
            Ok(_) | Err(RegistryError::AllocationNotFound(_) | RegistryError::Deleted(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The semaphore `name`, its holders (by fence) and its queue.
    pub fn semaphore(&self, name: &str) -> Option<SemaphoreState> {
        let state = self.inner.gates.state();
        let def = state.defs.get(name)?.clone();
        Some(line_state(&state, def))
    }

    /// Up to `max` semaphores from `start` (inclusive) in name order.
    pub fn semaphores(&self, start: &str, max: usize) -> Vec<SemaphoreState> {
        let state = self.inner.gates.state();
        state
            .defs
            .range::<str, _>((std::ops::Bound::Included(start), std::ops::Bound::Unbounded))
            .take(max)
            .map(|(_, d)| line_state(&state, d.clone()))
            .collect()
    }

    /// How many semaphores there are.
    pub fn semaphore_count(&self) -> usize {
        self.inner.gates.state().defs.len()
    }

    /// Why task `i` of `a` waits on its semaphores (see `Gates::waiting`).
    pub fn waiting_on_semaphores(&self, a: &Allocation, i: usize) -> Vec<(SemName, Waiting)> {
        self.inner.gates.waiting(a, i)
    }

    /// Waits until semaphore `name`'s line or definition changed past
    /// `index`, it is deleted, or `timeout` passed; the semaphore as it is
    /// then.
    pub async fn wait_semaphore(
        &self,
        name: &str,
        index: u64,
        timeout: Duration,
    ) -> Option<SemaphoreState> {
        self.wait_gate(index, timeout, |state| {
            let def = state.defs.get(name)?;
            Some(
                state
                    .lines
                    .get(name)
                    .map_or(def.modify_index, |l| l.changed.max(def.modify_index)),
            )
        })
        .await;
        self.semaphore(name)
    }

    /// Waits until the index `changed` reads from the gates (`None`: the
    /// semaphore or barrier is gone, for good) passes `index`, or
    /// `timeout` passed: a blocking query on a semaphore or a barrier.
    pub(super) async fn wait_gate(
        &self,
        index: u64,
        timeout: Duration,
        changed: impl Fn(&State) -> Option<u64>,
    ) {
        let mut moved = self.inner.gates.moved.subscribe();
        let _ = tokio::time::timeout(timeout, async {
            loop {
                let now = changed(&self.inner.gates.state());
                if now.is_none_or(|c| c > index) || self.is_shutting_down() {
                    return;
                }
                if moved.changed().await.is_err() {
                    return;
                }
            }
        })
        .await;
    }

    /// Creates semaphore `name` or changes its limit and grant timeout.
    /// The semaphore as published, and whether it is new.
    pub async fn put_semaphore(
        &self,
        name: SemName,
        limit: u32,
        grant_timeout: Duration,
    ) -> Result<(Arc<Semaphore>, bool), RegistryError> {
        let _one = self.inner.gates.writing.lock().await;
        for _ in 0..super::write::MAX_ROUNDS {
            let now = self.inner.gates.state().defs.get(&name).cloned();
            if let Some(d) = &now
                && d.limit == limit
                && d.grant_timeout == grant_timeout
            {
                return Ok((d.clone(), false));
            }
            let expect = now.as_ref().map_or(0, |d| d.modify_index);
            let placeholder = self.last_index().max(expect) + 1;
            let def = Semaphore {
                name: name.clone(),
                limit,
                grant_timeout,
                create_index: now.as_ref().map_or(placeholder, |d| d.create_index),
                modify_index: placeholder,
            };
            match self
                .append_semaphore(Op::PutSemaphore(Arc::new(def)), expect)
                .await?
            {
                Some(index) => {
                    let published = self.inner.gates.state().defs.get(&name).cloned();
                    return match published {
                        Some(d) if d.modify_index >= index => Ok((d, now.is_none())),
                        // Changed or deleted again at once by another
                        // replica: what this write made is what it says.
                        _ => Err(RegistryError::Contended(format!(
                            "semaphore {name:?} was changed again by another replica as this \
                             change was made; read it again"
                        ))),
                    };
                }
                None => continue,
            }
        }
        Err(RegistryError::Contended(format!(
            "semaphore {name:?} kept changing under this write; try again"
        )))
    }

    /// Deletes semaphore `name`; its holders keep their slots, its waiters
    /// wait visibly (`not_registered`).
    pub async fn delete_semaphore(&self, name: &SemName) -> Result<(), RegistryError> {
        let _one = self.inner.gates.writing.lock().await;
        for _ in 0..super::write::MAX_ROUNDS {
            let Some(now) = self.inner.gates.state().defs.get(name).cloned() else {
                return Err(RegistryError::SemaphoreNotFound(name.to_string()));
            };
            if self
                .append_semaphore(Op::DeleteSemaphore(name.clone()), now.modify_index)
                .await?
                .is_some()
            {
                return Ok(());
            }
        }
        Err(RegistryError::Contended(format!(
            "semaphore {name:?} kept changing under this write; try again"
        )))
    }

    /// Appends a definition's change and waits for its publication: its
    /// index, or `None` after a conflict (the view then holds what the
    /// store held).
    async fn append_semaphore(&self, op: Op, expect: u64) -> Result<Option<u64>, RegistryError> {
        let admitted = self.inner.store.admit()?;
        let appended = self.inner.store.append(Append {
            op,
            expect,
            live: Vec::new(),
            grants: Vec::new(),
        });
        let done = appended.done.await;
        drop(admitted);
        match done {
            Ok(index) | Err(AppendError::Landed { seen: index }) => {
                self.reach(index).await;
                Ok(Some(index))
            }
            Err(AppendError::Conflict { seen }) => {
                self.wait_view(seen, super::follow::REACH_TIMEOUT).await;
                Ok(None)
            }
            Err(AppendError::Store(e)) => Err(e.into()),
        }
    }
}

fn line_state(state: &State, semaphore: Arc<Semaphore>) -> SemaphoreState {
    let line = state.lines.get(&semaphore.name);
    let mut holders: Vec<(AllocId, usize, Holder)> = line
        .map(|l| {
            l.holders
                .iter()
                .map(|((id, i), h)| (id.clone(), *i, h.clone()))
                .collect()
        })
        .unwrap_or_default();
    holders.sort_by_key(|(_, _, h)| h.fence);
    SemaphoreState {
        holders,
        queue: line
            .map(|l| l.queue.iter().cloned().collect())
            .unwrap_or_default(),
        changed: line.map_or(semaphore.modify_index, |l| {
            l.changed.max(semaphore.modify_index)
        }),
        semaphore,
    }
}
