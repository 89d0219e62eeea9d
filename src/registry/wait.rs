//! Waiting: blocking queries and the start-condition long-poll.
//!
//! A waiter checks its predicate on the allocation's committed state and
//! parks on the handle's notification until it holds (`Handle::wait_for`),
//! raced against its timeout and the shutdown signal. A change published
//! between a check and the park is never slept through; there is no
//! polling and no task per gate.

use std::{
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use super::{Inner, Registry, RegistryError, handle::Slot, lives::Sign};
use crate::lifecycle::Allocation;

/// Who asks a task query: whether it is a sign of life for the task
/// (SEMANTICS, "Runs").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Querier {
    /// A reader (a dashboard, a page): no sign of life.
    Watcher,
    /// An agent that names no run, with a token that may act for the
    /// allocation: a sign of life.
    Agent,
    /// An agent that names its run: a sign of life while that run is the
    /// task's current one.
    Run(u64),
}

impl From<bool> for Querier {
    /// `true`: an agent's query; `false`: a reader's.
    fn from(alive: bool) -> Self {
        if alive {
            Querier::Agent
        } else {
            Querier::Watcher
        }
    }
}

/// Counts one parked request while it lives.
struct Parked(Arc<Inner>);

impl Drop for Parked {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Registry {
    fn park(&self) -> Result<Parked, RegistryError> {
        if self.is_shutting_down() {
            return Err(RegistryError::ShuttingDown);
        }
        let before = self.inner.waiters.fetch_add(1, Ordering::SeqCst);
        let parked = Parked(self.inner.clone());
        if before >= self.inner.config.max_waiters {
            return Err(RegistryError::TooManyWaiters);
        }
        Ok(parked)
    }

    /// Answers at once when `done` holds for the published record, else
    /// parks until it holds, `timeout` elapses (then answers with the
    /// current record: a timeout is not an error), the allocation is
    /// deleted (`Deleted`) or the server shuts down (`ShuttingDown`).
    pub async fn wait_until(
        &self,
        id: &str,
        timeout: Duration,
        done: impl Fn(&Allocation) -> bool,
    ) -> Result<Arc<Allocation>, RegistryError> {
        self.wait_for_task(id, None, timeout, done).await
    }

    /// `wait_until`, asked about `task` by `querier`: a sign of life for
    /// the task when it comes, and for as long as it is parked, if the
    /// querier is its agent.
    async fn wait_for_task(
        &self,
        id: &str,
        task: Option<(&str, Querier)>,
        timeout: Duration,
        done: impl Fn(&Allocation) -> bool,
    ) -> Result<Arc<Allocation>, RegistryError> {
        self.look_up(id).await?;
        let handle = self.handle(id)?;
        let current = match handle.slot_now() {
            Slot::Live(a) => a,
            Slot::Creating | Slot::Deleted => {
                return Err(RegistryError::AllocationNotFound(id.to_owned()));
            }
        };
        let life = task.and_then(|(t, querier)| {
            let i = current.position(t)?;
            match querier {
                Querier::Watcher => None,
                Querier::Agent => Some(i),
                Querier::Run(r) => (current.tasks[i].run == Some(r)).then_some(i),
            }
        });
        if done(&current) || timeout.is_zero() {
            if let Some(i) = life
                && self.ttl(&current, i).is_some()
            {
                handle.lives().touch(current.tasks.len(), i, self.now());
            }
            if let Some(i) = life {
                self.inner.renew(&handle, i, Sign::Came);
            }
            return Ok(current);
        }
        let _parked = self.park()?;
        let _alive = life.and_then(|i| self.parked_life(&handle, &current, i));
        let mut shutdown = self.inner.shutdown.subscribe();
        let gone = || RegistryError::Deleted(id.to_owned());
        tokio::select! {
            changed = handle.wait_for(|s| match s {
                Slot::Live(a) => done(a),
                Slot::Creating | Slot::Deleted => true,
            }) => match changed {
                Slot::Live(a) => Ok(a),
                Slot::Creating | Slot::Deleted => Err(gone()),
            },
            () = tokio::time::sleep(timeout) => handle.current().ok_or_else(gone),
            _ = shutdown.wait_for(|stopping| *stopping) => Err(RegistryError::ShuttingDown),
        }
    }

    /// Blocking query on an allocation: until its `modify_index` > `index`.
    pub async fn wait_alloc(
        &self,
        id: &str,
        index: u64,
        timeout: Duration,
    ) -> Result<Arc<Allocation>, RegistryError> {
        self.wait_until(id, timeout, |a| a.modify_index > index)
            .await
    }

    /// Position of a task in a published record, or `TaskNotFound`.
    pub fn task_position(&self, a: &Allocation, task: &str) -> Result<usize, RegistryError> {
        a.position(task)
            .ok_or_else(|| RegistryError::task_not_found(a, task))
    }

    /// Blocking query on one task: until the task's `modify_index` > `index`.
    ///
    /// The task is looked up by name in every record checked, never by a
    /// position taken from an earlier copy: between two copies the
    /// allocation can be deleted and registered again with other tasks.
    /// `querier`: whether the query is a sign of life for the task.
    pub async fn wait_task(
        &self,
        id: &str,
        task: &str,
        index: u64,
        timeout: Duration,
        querier: impl Into<Querier>,
    ) -> Result<(Arc<Allocation>, usize), RegistryError> {
        let a = self
            .wait_for_task(id, Some((task, querier.into())), timeout, |a| {
                a.position(task)
                    .is_none_or(|i| a.tasks[i].modify_index > index)
            })
            .await?;
        let i = self.task_position(&a, task)?;
        Ok((a, i))
    }

    /// The start-condition long-poll: until the task is allowed to start or
    /// told to stop (the task looked up by name in each record, as in
    /// `wait_task`).
    pub async fn wait_start(
        &self,
        id: &str,
        task: &str,
        timeout: Duration,
        querier: impl Into<Querier>,
    ) -> Result<(Arc<Allocation>, usize), RegistryError> {
        let a = self
            .wait_for_task(id, Some((task, querier.into())), timeout, |a| {
                a.position(task)
                    .is_none_or(|i| a.allowed(i) || a.desired(i).is_stop())
            })
            .await?;
        let i = self.task_position(&a, task)?;
        Ok((a, i))
    }
}

/// A reader of the event stream (`Registry::subscribe`). Counts as a
/// parked request while it lives.
pub struct Subscription {
    registry: Registry,
    /// The last index this reader has been given (or skipped).
    after: u64,
    prefix: String,
    _parked: Parked,
}

impl Registry {
    /// Follows every change after `index` to allocations whose ID starts
    /// with `prefix`.
    pub fn subscribe(&self, index: u64, prefix: String) -> Result<Subscription, RegistryError> {
        Ok(Subscription {
            _parked: self.park()?,
            registry: self.clone(),
            after: index,
            prefix,
        })
    }
}

impl Subscription {
    /// The next changes (at most `max`), or a resync; waits for them.
    /// Ends with `ShuttingDown` at shutdown. Cancel-safe: a call dropped
    /// while it waits has taken nothing.
    pub async fn next(&mut self, max: usize) -> Result<super::feed::Next, RegistryError> {
        let shared = self.registry.inner.clone();
        let mut shutdown = shared.shutdown.subscribe();
        loop {
            if *shutdown.borrow_and_update() {
                return Err(RegistryError::ShuttingDown);
            }
            let moved = shared.feed.moved();
            let mut moved = std::pin::pin!(moved);
            moved.as_mut().enable();
            if let Some(next) = shared.feed.read(&mut self.after, &self.prefix, max) {
                return Ok(next);
            }
            tokio::select! {
                () = moved => {}
                _ = shutdown.changed() => {}
            }
        }
    }

    /// The registry it reads.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// A change as `render` writes it, rendered once and shared by every
    /// reader (`Feed::render`).
    pub fn render(
        &self,
        e: &super::feed::Event,
        render: impl FnOnce(&super::feed::Event) -> bytes::Bytes,
    ) -> bytes::Bytes {
        self.registry.inner.feed.render(e, render)
    }

    /// The last index this reader was given or went past.
    pub fn index(&self) -> u64 {
        self.after
    }
}
