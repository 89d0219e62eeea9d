//! What the registry does by time: the task that drives the timer heap,
//! looking at an allocation when its moment comes (the ordinary write
//! path, with `Allocation::tick` as the decision), and signs of life.
//!
//! With a replicated store every replica's timer may fire for the same
//! allocation; the compare-and-swap keeps one decision, and the others
//! find nothing left to do on the record that won.

use std::{
    sync::{Arc, Weak, atomic::Ordering},
    time::Duration,
};

use super::{
    Inner, Registry, RegistryError,
    handle::Handle,
    timers::{Timers, until},
};
use crate::lifecycle::{Allocation, Timestamp};

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
        if let Some(at) = a.wake_at(&|i| handle.lives().seen(i, now), default) {
            self.schedule(handle, at);
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
        // The driver holds the heap, not the registry: wake it to see
        // that the registry is gone.
        self.timers.close();
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
        let due = a
            .wake_at(&|i| handle.lives().seen(i, now), default)
            .is_some_and(|at| at <= now);
        if due {
            let decided = self
                .update(
                    handle.id(),
                    |a, next_index| {
                        let now = self.now();
                        let seen = |i| handle.lives().seen(i, now);
                        Ok((a.tick(now, &seen, default, next_index), ()))
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
        if !a.spec.timed(default) {
            return;
        }
        let now = self.now();
        for name in tasks {
            if let Some(i) = a.position(name)
                && a.spec.ttl(i, default).is_some()
            {
                handle.lives().touch(a.tasks.len(), i, now);
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
        Ok(a)
    }

    /// The latest sign of life this server knows of for task `i` (the
    /// task view's `last_seen`), for a task under a TTL.
    pub fn last_seen(&self, a: &Allocation, i: usize) -> Option<Timestamp> {
        a.spec.ttl(i, self.inner.config.default_liveness_ttl)?;
        let handle = self.handle(a.id.as_str()).ok()?;
        handle.lives().seen(i, self.now())
    }

    /// The TTL task `i` runs under (its own, or the server's default).
    pub fn ttl(&self, a: &Allocation, i: usize) -> Option<Duration> {
        a.spec.ttl(i, self.inner.config.default_liveness_ttl)
    }

    /// Entries in the timer heap (stale ones included), for the metrics.
    pub fn timer_entries(&self) -> usize {
        self.inner.timers.len()
    }
}
