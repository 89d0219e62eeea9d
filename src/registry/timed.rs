//! What the registry does by time: the task that drives the timer heap,
//! looking at an allocation when its moment comes (the ordinary write
//! path, with `Allocation::tick` as the decision), and signs of life.
//!
//! With a replicated store every replica's timer may fire for the same
//! allocation; the compare-and-swap keeps one decision, and the others
//! find nothing left to do on the record that won. There a task's silence
//! is not measured here: the store expires the lease of its live key
//! (`keep.rs`), and a running task whose live key is gone is lost at once
//! (`Allocation::tick_lapsed`). A running task under a TTL whose run has no
//! mark (it began before its TTL applied) is marked, which starts its
//! clock then.

use std::{
    sync::{Arc, Weak, atomic::Ordering},
    time::Duration,
};

use super::{
    Inner, Registry, RegistryError,
    handle::Handle,
    keep::{Keeper, Sign},
    timers::{Timers, nanos, until},
};
use crate::{
    lifecycle::{Allocation, RunState, Timestamp, UNTIL_TOLD},
    store::{LiveOp, Mark, ReplicatedStore},
};

/// Allocations looked at together at most: a restart after a long outage
/// can find a million deadlines due at once.
const MAX_LOOKING: usize = 256;

/// After a look that failed (the store refused the write), the next try.
const RETRY: Duration = Duration::from_secs(1);

impl Inner {
    /// Puts a timed allocation's next moment in the heap. Called after
    /// every publication and every look; cheap for an allocation that
    /// uses no TTL and no deadline (one check of its spec).
    pub(super) fn reschedule(&self, handle: &Arc<Handle>, a: &Allocation) {
        let default = self.config.default_liveness_ttl;
        if !a.spec.timed(default) {
            return;
        }
        let now = self.config.clock.now();
        if self.store.replicated().is_some() {
            if !self.view_holds(a) {
                // The follower looks again once the view has all of it.
                return;
            }
            if (0..a.tasks.len()).any(|i| self.lapsed(handle, a, i).is_some()) {
                return self.schedule(handle, now);
            }
            if (0..a.tasks.len()).any(|i| self.unmarked(handle, a, i)) {
                self.mark_runs(handle);
            }
        }
        let seen = self.seen(handle, now);
        if let Some(at) = a.wake_at(&seen, default)
            && at != UNTIL_TOLD
        {
            self.schedule(handle, at);
        }
    }

    /// Whether this replica's view holds everything up to `a` (the
    /// liveness keys written with it included): only then does a missing
    /// key mean what it says.
    fn view_holds(&self, a: &Allocation) -> bool {
        *self.view.borrow() >= a.modify_index
    }

    /// The latest sign of life of each task, as time alone judges it: this
    /// server's memory with a store of its own; with a shared store, alive
    /// until the store says otherwise (`lapsed`).
    fn seen<'a>(
        &'a self,
        handle: &'a Handle,
        now: Timestamp,
    ) -> impl Fn(usize) -> Option<Timestamp> + 'a {
        let shared = self.store.replicated().is_some();
        move |i| {
            if shared {
                Some(UNTIL_TOLD)
            } else {
                handle.lives().seen(i, now)
            }
        }
    }

    /// With a shared store: task `i` of `a` runs under a TTL, its run is
    /// marked, and its live key is gone: its lease expired. `Some(the
    /// latest sign of life known)`: this replica's own, or the moment the
    /// lease was last renewed as its expiry tells, whichever is later.
    fn lapsed(&self, handle: &Handle, a: &Allocation, i: usize) -> Option<Timestamp> {
        let t = &a.tasks[i];
        if t.state != RunState::Running || !self.view_holds(a) {
            return None;
        }
        let life = handle.lives().life(i)?;
        let keys = life.kept.keys();
        let mark = keys.mark?;
        if keys.live || Some(mark.run) != t.started_at.map(nanos) {
            return None;
        }
        let renewed = keys.gone_at.map(|at| at - mark.ttl);
        let heard = life.last_seen().filter(|&h| Some(h) >= t.started_at);
        renewed.max(heard).or(t.started_at)
    }

    /// With a shared store: task `i` of `a` runs under a TTL (this
    /// replica's) and the store holds no mark of its run.
    fn unmarked(&self, handle: &Handle, a: &Allocation, i: usize) -> bool {
        let t = &a.tasks[i];
        if t.state != RunState::Running
            || a.spec.ttl(i, self.config.default_liveness_ttl).is_none()
            || !self.view_holds(a)
        {
            return false;
        }
        let run = t.started_at.map(nanos);
        let keys = handle
            .lives()
            .life(i)
            .map(|l| l.kept.keys())
            .unwrap_or_default();
        keys.mark.is_none_or(|m| Some(m.run) != run)
    }

    /// Marks the runs of `handle`'s allocation that run under a TTL without
    /// a mark (they started before their TTL applied: the server's default
    /// turned on since, or a change written by an older build): from now
    /// on the store measures their silence. In a task of its own; a failure
    /// is tried again.
    fn mark_runs(&self, handle: &Arc<Handle>) {
        let Some(registry) = self.registry() else {
            return;
        };
        let Some(a) = handle.current() else { return };
        let tasks = a.tasks.len();
        let todo: Vec<usize> = (0..tasks)
            .filter(|&i| self.unmarked(handle, &a, i))
            .filter(|&i| {
                handle
                    .lives()
                    .life_made(tasks, i)
                    .is_some_and(|l| !l.kept.marking.swap(true, Ordering::SeqCst))
            })
            .collect();
        if todo.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let handle = handle.clone();
        runtime.spawn(async move {
            let outcome = registry.mark_unmarked(&a, &todo).await;
            for &i in &todo {
                if let Some(l) = handle.lives().life(i) {
                    l.kept.marking.store(false, Ordering::SeqCst);
                }
            }
            if let Err(e) = outcome {
                tracing::warn!(alloc = %a.id, error = %e, "a running task's TTL could not be given to the store; trying again");
                tokio::time::sleep(RETRY).await;
            }
            if let Some(now) = handle.current() {
                registry.inner.reschedule(&handle, &now);
            }
        });
    }

    /// With a shared store: renews the lease of task `i` for a sign of
    /// life heard here (`keep.rs` bounds how often).
    pub(super) fn renew(&self, handle: &Arc<Handle>, i: usize, sign: Sign) {
        let Some(store) = self.store.replicated() else {
            return;
        };
        self.keeper.sign(store, handle, i, sign);
        self.keep_driving();
    }

    /// Starts the task that sends due renewals, once, inside a runtime.
    pub(super) fn keep_driving(&self) {
        if self.keeper.driving.load(Ordering::Acquire) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self
            .keeper
            .driving
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            runtime.spawn(Keeper::drive(self.me.clone(), self.keeper.clone()));
        }
    }

    fn schedule(&self, handle: &Arc<Handle>, at: Timestamp) {
        self.timers.schedule(handle, at);
        self.drive();
    }

    /// Starts the task that drives the heap, once, inside a runtime.
    fn drive(&self) {
        if self.driving.load(Ordering::Acquire) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self
            .driving
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            runtime.spawn(drive(self.me.clone(), self.timers.clone()));
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The drivers hold their heaps, not the registry: wake them to see
        // that the registry is gone.
        self.timers.close();
        self.keeper.close();
    }
}

/// Looks at every allocation when its moment comes, until the registry
/// is dropped.
async fn drive(me: Weak<Inner>, timers: Arc<Timers>) {
    let mut looking = tokio::task::JoinSet::new();
    loop {
        while looking.try_join_next().is_some() {}
        let earlier = timers.earlier();
        let mut earlier = std::pin::pin!(earlier);
        // Registered before the heap is read: a push after the read wakes
        // this wait.
        earlier.as_mut().enable();
        let (next, clock) = {
            let Some(inner) = me.upgrade() else { return };
            if timers.is_closed() {
                return;
            }
            let clock = inner.config.clock.clone();
            let registry = Registry { inner };
            let (due, next) = timers.due(clock.now(), MAX_LOOKING);
            let more = !due.is_empty();
            for handle in due {
                while looking.len() >= MAX_LOOKING {
                    looking.join_next().await;
                }
                let r = registry.clone();
                looking.spawn(async move { r.look_at(handle).await });
            }
            if more {
                continue;
            }
            (next, clock)
        };
        match next {
            Some(at) => {
                tokio::select! {
                    () = tokio::time::sleep(until(&clock, at)) => {}
                    () = earlier => {}
                }
            }
            None => earlier.await,
        }
    }
}

impl Registry {
    /// The registry's time now.
    pub(super) fn now(&self) -> Timestamp {
        self.inner.config.clock.now()
    }

    /// An allocation's moment came: what time alone does to it is decided
    /// and written like any change, then its next moment is scheduled.
    async fn look_at(&self, handle: Arc<Handle>) {
        let Some(a) = handle.current() else { return };
        let default = self.inner.config.default_liveness_ttl;
        let now = self.now();
        let inner = &self.inner;
        let due = (0..a.tasks.len()).any(|i| inner.lapsed(&handle, &a, i).is_some())
            || a.wake_at(&inner.seen(&handle, now), default)
                .is_some_and(|at| at <= now);
        if due {
            let decided = self
                .update(
                    handle.id(),
                    |a, next_index| {
                        let now = self.now();
                        let seen = inner.seen(&handle, now);
                        let lapsed = |i| inner.lapsed(&handle, a, i);
                        Ok((a.tick_lapsed(now, &seen, &lapsed, default, next_index), ()))
                    },
                    |_| {},
                )
                .await;
            match decided {
                Ok(_) => {}
                Err(RegistryError::AllocationNotFound(_) | RegistryError::Deleted(_)) => return,
                Err(e) => {
                    tracing::warn!(alloc = %handle.id(), error = %e, "a deadline or TTL that passed could not be recorded; trying again");
                    self.inner.schedule(&handle, self.now() + RETRY);
                    return;
                }
            }
        }
        if let Some(a) = handle.current() {
            self.inner.reschedule(&handle, &a);
        }
    }

    /// A sign of life for tasks of an allocation (a report): each task
    /// under a TTL is alive now.
    pub(super) fn signs_of_life<'a>(&self, id: &str, tasks: impl IntoIterator<Item = &'a str>) {
        let Ok(handle) = self.handle(id) else { return };
        let Some(a) = handle.current() else { return };
        let default = self.inner.config.default_liveness_ttl;
        // A shared store may keep liveness keys for tasks this replica
        // knows no TTL of (another's default): their leases are renewed
        // all the same.
        if !a.spec.timed(default) && !handle.lives().made() {
            return;
        }
        let now = self.now();
        for name in tasks {
            if let Some(i) = a.position(name) {
                if a.spec.ttl(i, default).is_some() {
                    handle.lives().touch(a.tasks.len(), i, now);
                }
                self.inner.renew(&handle, i, Sign::Came);
            }
        }
    }

    /// `PUT .../tasks/{task}/heartbeat`: a sign of life that writes
    /// nothing and wakes nobody. Returns the record it was checked
    /// against (for its index).
    pub fn heartbeat(&self, id: &str, task: &str) -> Result<Arc<Allocation>, RegistryError> {
        let handle = self.handle(id)?;
        let a = handle
            .current()
            .ok_or_else(|| RegistryError::AllocationNotFound(id.to_owned()))?;
        let i = self.task_position(&a, task)?;
        if let Some(lost_at) = a.tasks[i].lost_at() {
            return Err(RegistryError::task_lost(&a, i, lost_at));
        }
        if a.spec
            .ttl(i, self.inner.config.default_liveness_ttl)
            .is_some()
        {
            handle.lives().touch(a.tasks.len(), i, self.now());
        }
        self.inner.renew(&handle, i, Sign::Came);
        Ok(a)
    }

    /// What a view of `a` shows of its tasks' signs of life: the
    /// allocation looked up and the clock read once for all its tasks (a
    /// lookup and a clock read per task were most of what the third
    /// edition's fields cost a full answer). `None` when no task of `a`
    /// runs under a TTL, or `a` is gone.
    pub fn signs(&self, a: &Allocation) -> Option<Signs> {
        let default = self.inner.config.default_liveness_ttl;
        if !(0..a.tasks.len()).any(|i| a.spec.ttl(i, default).is_some()) {
            return None;
        }
        let handle = self.handle(a.id.as_str()).ok()?;
        Some(Signs {
            handle,
            now: self.now(),
        })
    }

    /// The TTL task `i` runs under (its own, or the server's default).
    pub fn ttl(&self, a: &Allocation, i: usize) -> Option<Duration> {
        a.spec.ttl(i, self.inner.config.default_liveness_ttl)
    }

    /// The server's `--default-liveness-ttl`.
    pub fn default_liveness_ttl(&self) -> Option<Duration> {
        self.inner.config.default_liveness_ttl
    }

    /// Writes marks for the runs `todo` of `a` (see `Inner::mark_runs`),
    /// if the store still holds `a`.
    async fn mark_unmarked(&self, a: &Allocation, todo: &[usize]) -> Result<(), RegistryError> {
        let Some(store) = self.inner.store.replicated() else {
            return Ok(());
        };
        let default = self.inner.config.default_liveness_ttl;
        let mut ops = Vec::new();
        for &i in todo {
            let (Some(ttl), Some(started)) = (a.spec.ttl(i, default), a.tasks[i].started_at) else {
                continue;
            };
            let lease = store.grant(ttl).await?;
            ops.push(LiveOp::Start {
                task: a.task_name(i).clone(),
                mark: Mark {
                    run: nanos(started),
                    ttl,
                    lease,
                },
            });
        }
        if ops.is_empty() {
            return Ok(());
        }
        match store.mark(&a.id, a.modify_index, ops).await {
            Ok(index) => {
                tracing::info!(alloc = %a.id, index, "running tasks under a TTL without a mark of their run are watched from now on");
                self.wait_view(index, Duration::from_secs(10)).await;
                Ok(())
            }
            // The record moved on: its next publication looks again.
            Err(
                crate::store::SwapError::Conflict { .. } | crate::store::SwapError::Landed { .. },
            ) => Ok(()),
            Err(crate::store::SwapError::Store(e)) => Err(e.into()),
        }
    }

    /// With a shared store, what `decided` (the next record, decided on
    /// `current`) does to its tasks' liveness keys: a run under a TTL that
    /// starts gets its mark and live key (under a lease from `leases`,
    /// granted on first use and kept for the next rounds of the same
    /// write), a run that ends loses them.
    pub(super) async fn live_ops(
        &self,
        store: &dyn ReplicatedStore,
        handle: &Handle,
        current: &Allocation,
        decided: &Allocation,
        leases: &mut std::collections::HashMap<usize, crate::store::Lease>,
    ) -> Result<Vec<LiveOp>, RegistryError> {
        let default = self.inner.config.default_liveness_ttl;
        let mut ops = Vec::new();
        for (i, (was, now)) in current.tasks.iter().zip(&decided.tasks).enumerate() {
            let (ran, runs) = (
                was.state == RunState::Running,
                now.state == RunState::Running,
            );
            let new_run = runs && (!ran || was.started_at != now.started_at);
            let kept = handle
                .lives()
                .life(i)
                .is_some_and(|l| l.kept.keys().mark.is_some());
            let ttl = decided.spec.ttl(i, default);
            let task = || decided.task_name(i).clone();
            match (new_run, ttl, now.started_at) {
                (true, Some(ttl), Some(started)) => {
                    let lease = match leases.get(&i) {
                        Some(&l) => l,
                        None => {
                            let l = store.grant(ttl).await?;
                            leases.insert(i, l);
                            l
                        }
                    };
                    ops.push(LiveOp::Start {
                        task: task(),
                        mark: Mark {
                            run: nanos(started),
                            ttl,
                            lease,
                        },
                    });
                }
                _ if ran && (new_run || !runs) && (kept || ttl.is_some()) => {
                    ops.push(LiveOp::End { task: task() });
                }
                _ => {}
            }
        }
        Ok(ops)
    }

    /// Entries in the timer heap (stale ones included), for the metrics.
    pub fn timer_entries(&self) -> usize {
        self.inner.timers.len()
    }
}

/// The signs of life of one allocation's tasks as a view shows them
/// (`Registry::signs`).
pub struct Signs {
    handle: Arc<Handle>,
    now: Timestamp,
}

impl Signs {
    /// The latest sign of life this server knows of for task `i` (a
    /// parked query is one now), if the task runs under a TTL.
    pub fn last_seen(&self, i: usize) -> Option<Timestamp> {
        self.handle.lives().seen(i, self.now)
    }
}
