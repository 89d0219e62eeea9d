//! The one write path, for every store: lock the allocation, decide with
//! `lifecycle`, append to the store, wait until the follower has published
//! the change's index, answer.
//!
//! - **Admission first.** A store that takes no change for now (its queue
//!   full, its log at its ceiling, a write failed) refuses before anything
//!   is decided (`Store::admit`), so a refusal never leaves a decision
//!   behind that a later change was decided on.
//! - **Pipelined where the store allows it.** A store that stamps its
//!   appends at once (disk, memory) lets the next writer of the allocation
//!   decide on the version just appended (`Handle::pending`) while it is
//!   made durable: one allocation's writers share group commits. The store
//!   never takes an append after refusing an earlier one (it closes
//!   instead), so a change decided on a version that failed fails too. A
//!   store that stamps only at commit (etcd) keeps the allocation locked
//!   until the change is published.
//! - **Decided again on a conflict.** A store other replicas write takes a
//!   change only if the record is still the one it was decided on; on a
//!   conflict the view catches up with the record that won and the change
//!   is decided again. A decision that writes nothing holds only on the
//!   newest version, asked of the store's quorum.
//! - **Nothing lost to a client that goes away.** Once appended, the rest
//!   runs in a task of its own.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, PoisonError},
};

use super::{
    Quota, Registry, RegistryError, RestartTarget,
    follow::REACH_TIMEOUT,
    handle::{Handle, Pending, Slot, WriteGuard},
    traces,
};
use crate::{
    lifecycle::{
        AllocId, AllocSpec, Allocation, CoordState, IdemKey, KeySeen, Refusal, RestartMode,
        TaskName, TaskReport,
    },
    metrics::Metrics,
    store::{Admitted, Append, AppendError, Appended, Op, StoreError},
};

/// Decisions tried on newer copies before a write gives up (503 with
/// `Retry-After`): each retry needs another replica's change to the same
/// allocation in the moment between reading and appending.
pub(super) const MAX_ROUNDS: usize = 16;

/// The version a change is decided on.
#[derive(Clone)]
enum Base {
    /// Appended and not yet published.
    Pending(Arc<Pending>),
    /// Published.
    Live(Arc<Allocation>),
}

impl Base {
    fn record(&self) -> &Arc<Allocation> {
        match self {
            Base::Pending(p) => &p.record,
            Base::Live(a) => a,
        }
    }
}

/// What a batch of reports is applied as.
#[derive(Clone, Copy)]
enum Apply {
    /// Reports, maybe keyed (`Idempotency-Key`), maybe naming the run of
    /// their agent (`Taskgate-Run`).
    Report(Option<IdemKey>, Option<u64>),
    /// An operator's restore: an order.
    Restore,
    /// An agent's restore: a resume.
    Resume,
}

/// The answer of a write decided on a version whose append failed.
fn parent_failed() -> RegistryError {
    RegistryError::Store(StoreError::Io(
        "a change this one was decided on failed to commit".into(),
    ))
}

/// A store that gave no record for a put broke the `Store` contract.
fn no_record() -> RegistryError {
    RegistryError::Store(StoreError::Io(
        "the store gave back no record for a change it took".into(),
    ))
}

fn contended(id: &str) -> RegistryError {
    RegistryError::Contended(format!(
        "allocation \"{id}\" kept changing through other replicas while this change was \
         decided; try again"
    ))
}

/// How an append ended, once its task is done.
enum Ended {
    /// Published at this index (or, its answer lost, found committed there).
    Done(u64),
    /// Another change came first; visible at this index.
    Conflict(u64),
    Failed(StoreError),
}

impl Registry {
    /// Takes `id`'s write lock and the version to decide on: the one
    /// appended last if it is not published yet, else the published one.
    /// An allocation missing from the view is asked of the store's quorum
    /// once (a store others write: registered through another replica a
    /// moment ago, or the view lags behind a registration).
    async fn lock_live(&self, id: &str) -> Result<(WriteGuard, Arc<Handle>, Base), RegistryError> {
        let mut asked = None;
        for _ in 0..MAX_ROUNDS {
            self.readable(id)?;
            if let Ok(handle) = self.handle(id) {
                let write = handle.lock_write().await;
                // The pending version is cleared only after it is
                // published, so it is the newest while it is above the
                // published one; a deletion published since ends the
                // allocation whatever is still pending.
                let pending = handle.pending();
                match handle.slot_now() {
                    Slot::Live(a) => {
                        let base = match pending {
                            Some(p) if p.record.modify_index > a.modify_index => Base::Pending(p),
                            _ => Base::Live(a),
                        };
                        return Ok((write, handle, base));
                    }
                    Slot::Deleted => continue,
                    Slot::Creating => {}
                }
            }
            match asked {
                // The view reached the store's record and still has no
                // allocation: deleted since.
                Some((_, true)) => break,
                Some((index, false)) => return Err(self.behind(id, index)),
                None => {}
            }
            let Some(read) = AllocId::parse(id)
                .ok()
                .and_then(|alloc| self.inner.store.quorum_read(&alloc))
            else {
                break;
            };
            match read.await? {
                Some(index) => asked = Some((index, self.wait_view(index, REACH_TIMEOUT).await)),
                None => break,
            }
        }
        Err(RegistryError::AllocationNotFound(id.to_owned()))
    }

    /// Whether a decision on `base` that writes nothing (or refuses)
    /// holds: a version not yet published holds once it is (an error if it
    /// failed); on a store others write, only while the store's quorum
    /// still holds that version (asked by marking runs again, when some
    /// are to be). If it does not, the view has caught up with the newer
    /// one on return.
    async fn holds(&self, handle: &Handle, base: &Base) -> Result<bool, RegistryError> {
        if let Base::Pending(p) = base
            && !p.outcome().await
        {
            return Err(parent_failed());
        }
        let a = base.record();
        // Leased, the runs this replica heard whose live key is gone are
        // marked again before the answer: that transaction's compare is
        // the check.
        match self.mark_before_answer(handle, a).await? {
            Some(Ok(index)) => {
                self.reach(index).await;
                return Ok(true);
            }
            Some(Err(seen)) => {
                self.catch_up(handle, a.modify_index, seen).await;
                return Ok(false);
            }
            None => {}
        }
        let Some(read) = self.inner.store.quorum_read(&a.id) else {
            return Ok(true);
        };
        let now = read.await?;
        if now == Some(a.modify_index) {
            return Ok(true);
        }
        self.catch_up(handle, a.modify_index, now.unwrap_or(0))
            .await;
        Ok(false)
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

    /// Waits for an append in a task of its own (a client that goes away
    /// cannot cut it short): the change's publication, then `after` with
    /// its index. `write` is let go once the change is published or failed;
    /// `pending` is settled then.
    async fn finish(
        &self,
        appended: Appended,
        write: Option<WriteGuard>,
        pending: Option<(Arc<Handle>, Arc<Pending>)>,
        creating: Option<(AllocId, Arc<Handle>)>,
        admitted: Admitted,
        after: impl FnOnce(&Registry, u64) + Send + 'static,
    ) -> Ended {
        let registry = self.clone();
        let claim = self.claim(&appended, write.as_ref());
        let task = tokio::spawn(async move {
            let ended = match appended.done.await {
                Ok(index) | Err(AppendError::Landed { seen: index }) => {
                    registry.reach(index).await;
                    Ended::Done(index)
                }
                Err(AppendError::Conflict { seen }) => Ended::Conflict(seen),
                Err(AppendError::Store(e)) => Ended::Failed(e),
            };
            drop(claim);
            if let Some((handle, p)) = pending {
                p.finish(matches!(ended, Ended::Done(_)));
                handle.clear_pending(&p);
            }
            // A registration that did not take leaves no handle behind
            // (registered through another replica: once the view has it).
            if let Some((id, handle)) = creating {
                if let Ended::Conflict(seen) = ended {
                    registry.reach(seen).await;
                }
                if !matches!(ended, Ended::Done(_)) {
                    registry.inner.forget_creating(&id, &handle);
                }
            }
            drop(write);
            drop(admitted);
            if let Ended::Done(index) = ended {
                after(&registry, index);
            }
            ended
        });
        task.await.unwrap_or_else(|e| {
            Ended::Failed(StoreError::Io(format!("the commit task failed: {e}")))
        })
    }

    /// On a store other replicas write, with traces on: claims the append
    /// as this replica's before it can be published, so that this
    /// replica's follower, and no other, emits the spans it ends
    /// (`traces.rs`). A put is known by the write mark the store gave its
    /// record; a deletion (which has no record) by its allocation, whose
    /// write lock it holds.
    fn claim(&self, appended: &Appended, write: Option<&WriteGuard>) -> Option<traces::Claim> {
        let traces = self
            .inner
            .config
            .traces
            .as_ref()
            .filter(|_| self.inner.shared)?;
        let own = match &appended.record {
            Some(a) => traces::Own::Put(a.writes().last()?.id),
            None => traces::Own::Delete(write?.handle().id_owned()),
        };
        Some(traces.claim(own))
    }

    /// The record a write answers with, once its change is published at
    /// `index`: the published one, or (moved on already, or the view late)
    /// the appended one stamped with its index.
    fn published(
        handle: &Handle,
        record: Arc<Allocation>,
        stamped: bool,
        index: u64,
    ) -> Arc<Allocation> {
        if stamped {
            return record;
        }
        match handle.current() {
            Some(now) if now.modify_index == index => now,
            _ => {
                let mut a = (*record).clone();
                let placeholder = a.modify_index;
                a.restamp(placeholder, index);
                Arc::new(a)
            }
        }
    }

    /// Decide → append → publish for one allocation. `decide` gets the
    /// newest version (published, or appended and not yet published) and
    /// the index to stamp the change with (a placeholder the store replaces
    /// with the index it takes), and returns the next record (or `None` for
    /// no change) plus a result for the caller.
    ///
    /// `counted` counts the request in the metrics once it is decided (and
    /// published, if it changed anything); it runs with the publication,
    /// so a client that goes away mid-commit loses neither the metrics nor
    /// the log lines of a change that happened.
    pub(super) async fn write<R>(
        &self,
        id: &str,
        decide: impl Fn(&Allocation, &dyn Fn() -> u64) -> Result<(Option<Allocation>, R), RegistryError>,
        counted: impl FnOnce(&Metrics) + Send + 'static,
    ) -> Result<(Arc<Allocation>, R), RegistryError> {
        let mut admitted = Some(self.inner.store.admit()?);
        // Leases granted for runs this write starts, kept for its next
        // rounds (a lease no round uses expires by itself).
        let mut granted = HashMap::new();
        let counted = Arc::new(Mutex::new(Some(counted)));
        let count = |metrics: &Metrics| {
            if let Some(c) = counted
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
            {
                c(metrics);
            }
        };
        for _ in 0..MAX_ROUNDS {
            let (write, handle, base) = self.lock_live(id).await?;
            let current = base.record().clone();
            let stamp = current.modify_index + 1;
            let (mut next, out) = match decide(&current, &|| stamp) {
                Ok((Some(next), out)) => (next, out),
                // An answer that changes nothing, or a refusal, holds only
                // on the newest version, and only once it is durable.
                decided => {
                    drop(write);
                    if !self.holds(&handle, &base).await? {
                        continue;
                    }
                    let (_, out) = decided?;
                    count(&self.inner.config.metrics);
                    return Ok((current, out));
                }
            };
            next.settle_histories();
            let live = self
                .live_ops(&handle, &current, &next, &mut granted)
                .await?;
            let grants = if self.inner.shared {
                self.inner.gates.granted(&current, &next)
            } else {
                Vec::new()
            };
            let appended = self.inner.store.append(Append {
                op: Op::Put(Arc::new(next)),
                expect: current.modify_index,
                live,
                grants,
            });
            let Some(record) = appended.record.clone() else {
                return Err(no_record());
            };
            let stamped = appended.stamped;
            let (write, pending) = if stamped {
                let p = Arc::new(Pending::new(record.clone()));
                handle.set_pending(p.clone());
                drop(write);
                (None, Some((handle.clone(), p)))
            } else {
                (Some(write), None)
            };
            let observed = (current.clone(), record.clone(), handle.clone());
            let counted = counted.clone();
            let ended = self
                .finish(
                    appended,
                    write,
                    pending,
                    None,
                    admitted.take().expect("admitted once"),
                    move |registry, index| {
                        let (current, record, handle) = observed;
                        let next = Self::published(&handle, record, stamped, index);
                        registry.observe(&current, &next);
                        if let Some(c) = counted
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .take()
                        {
                            c(&registry.inner.config.metrics);
                        }
                    },
                )
                .await;
            match ended {
                Ended::Done(index) => {
                    self.judged(index).await;
                    return Ok((Self::published(&handle, record, stamped, index), out));
                }
                Ended::Conflict(seen) => {
                    self.catch_up(&handle, current.modify_index, seen).await;
                    admitted = Some(self.inner.store.admit()?);
                }
                Ended::Failed(e) => return Err(e.into()),
            }
        }
        Err(contended(id))
    }

    /// Logs and counts what a published change did to the coordinator and
    /// the stop orders.
    fn observe(&self, prev: &Allocation, next: &Allocation) {
        let metrics = &self.inner.config.metrics;
        if prev.state != next.state {
            metrics.transition(prev.state, next.state);
            tracing::info!(
                alloc = %next.id,
                from = %prev.state,
                to = %next.state,
                index = next.modify_index,
                "coordinator transition"
            );
        }
        for i in 0..next.tasks.len() {
            if let (false, Some(reason)) = (prev.desired(i).is_stop(), next.desired(i).reason()) {
                metrics.stop_order(reason.kind);
                tracing::info!(
                    alloc = %next.id,
                    task = %next.task_name(i),
                    reason = %reason.kind,
                    "stop order"
                );
            }
        }
    }

    /// Registers an allocation. Returns the record and whether it is new; an
    /// identical spec already registered is an idempotent success.
    pub async fn register(
        &self,
        id: AllocId,
        spec: AllocSpec,
    ) -> Result<(Arc<Allocation>, bool), RegistryError> {
        self.register_within(id, spec, None).await
    }

    /// `register`, counting a new allocation against the server's limits
    /// and the caller's `quota` (an idempotent re-registration counts
    /// against none). Answers once the dependents its change started
    /// judging are judged.
    pub async fn register_within(
        &self,
        id: AllocId,
        spec: AllocSpec,
        quota: Option<Quota<'_>>,
    ) -> Result<(Arc<Allocation>, bool), RegistryError> {
        if !spec.reaches_out() && !spec.gathers() {
            let (a, created) = self.register_once(id, spec, quota).await?;
            if let Some(index) = created {
                self.judged(index).await;
            }
            return Ok((a, created.is_some()));
        }
        // A registration with dependencies on other allocations (or
        // barrier members, counted against the members published) runs in
        // a task of its own, holding the registrations' lock from its check
        // to its publication (and no longer: no judging runs under it),
        // and then judges what its targets did between the verdicts it
        // was registered with and its publication (when it joined the
        // reverse index): a client that goes away leaves none of it half
        // done.
        let owned = quota.map(|q| {
            (
                q.name.to_owned(),
                q.prefixes.to_vec(),
                q.max_allocations,
                q.max_dependencies,
            )
        });
        let registry = self.clone();
        let task = tokio::spawn(async move {
            let serial = registry.inner.registering.clone().lock_owned().await;
            let quota = owned
                .as_ref()
                .map(|(name, prefixes, allocations, deps)| Quota {
                    name,
                    prefixes,
                    max_allocations: *allocations,
                    max_dependencies: *deps,
                });
            let registered = registry.register_once(id, spec, quota).await;
            drop(serial);
            let (a, created) = registered?;
            let Some(index) = created else {
                return Ok((a, false));
            };
            registry.judged(index).await;
            let id = a.id.clone();
            registry.resolve(id.as_str()).await;
            Ok(match registry.get(id.as_str()) {
                Ok(now) => (now, true),
                Err(_) => (a, true),
            })
        });
        task.await.unwrap_or_else(|e| {
            Err(RegistryError::Store(StoreError::Io(format!(
                "the registration's task failed: {e}"
            ))))
        })
    }

    /// Registers once: the record, and the index it was registered at
    /// (`None`: the same spec was registered already).
    async fn register_once(
        &self,
        id: AllocId,
        spec: AllocSpec,
        quota: Option<Quota<'_>>,
    ) -> Result<(Arc<Allocation>, Option<u64>), RegistryError> {
        let spec = self.inner.share_spec(Arc::new(spec));
        for _ in 0..MAX_ROUNDS {
            // A handle found here may be deleted before its lock is ours;
            // then the map no longer holds it and the next round finds the
            // new state.
            let (handle, fresh) = self.get_or_insert(&id, quota)?;
            let write = match fresh {
                Some(guard) => guard,
                None => handle.lock_write().await,
            };
            match handle.slot_now() {
                Slot::Live(a) if a.spec == spec => return Ok((a, None)),
                Slot::Live(a) => {
                    return Err(RegistryError::AllocationExists {
                        id,
                        index: a.modify_index,
                    });
                }
                Slot::Deleted => continue,
                Slot::Creating => {}
            }
            let admitted = match self.inner.store.admit() {
                Ok(admitted) => admitted,
                Err(e) => {
                    drop(write);
                    self.inner.forget_creating(&id, &handle);
                    return Err(e.into());
                }
            };
            const STAMP: u64 = 1;
            let mut a = Allocation::register(id.clone(), spec.clone(), STAMP, self.now());
            if let Err(e) = self
                .check_dependencies(&a, quota)
                .and_then(|()| self.check_barriers(&a))
            {
                drop(write);
                self.inner.forget_creating(&id, &handle);
                return Err(e);
            }
            self.verdicts(&mut a);
            let a = Arc::new(a);
            self.inner.judges.checked(&a);
            let appended = self.inner.store.append(Append {
                op: Op::Put(a.clone()),
                expect: 0,
                live: Vec::new(),
                grants: Vec::new(),
            });
            let Some(record) = appended.record.clone() else {
                drop(write);
                self.inner.forget_creating(&id, &handle);
                self.inner.judges.unchecked(&a);
                return Err(no_record());
            };
            let stamped = appended.stamped;
            // Logged and counted with the publication, so a client that
            // goes away mid-commit loses neither.
            let logged = (record.clone(), handle.clone());
            let creating = Some((id.clone(), handle.clone()));
            let ended = self
                .finish(appended, Some(write), None, creating, admitted, move |registry, index| {
                    let (record, handle) = logged;
                    let a = Self::published(&handle, record, stamped, index);
                    tracing::info!(alloc = %a.id, state = %a.state, tasks = a.tasks.len(), index, "allocation registered");
                    if a.state != CoordState::Init {
                        registry
                            .inner
                            .config
                            .metrics
                            .transition(CoordState::Init, a.state);
                    }
                })
                .await;
            match ended {
                Ended::Done(index) => {
                    // An attempt whose answer was lost created it: the
                    // record as it is now (others may have changed it).
                    let a = match handle.current() {
                        Some(now) if now.spec == spec => now,
                        _ => Self::published(&handle, record, stamped, index),
                    };
                    return Ok((a, Some(index)));
                }
                // Registered through another replica: the view has it
                // now, and the next round compares the specs.
                Ended::Conflict(_) => self.inner.judges.unchecked(&a),
                Ended::Failed(e) => {
                    self.inner.judges.unchecked(&a);
                    return Err(e.into());
                }
            }
        }
        Err(contended(id.as_str()))
    }

    /// Finds the handle for `id`, or inserts a new one in `Creating` state
    /// together with its write lock, so nobody can write it before it
    /// exists. A new one counts against the limits, checked under the
    /// map's lock so concurrent registrations cannot overshoot them.
    fn get_or_insert(
        &self,
        id: &AllocId,
        quota: Option<Quota<'_>>,
    ) -> Result<(Arc<Handle>, Option<WriteGuard>), RegistryError> {
        if let Some(h) = self.read_map().get(id.as_str()) {
            return Ok((h.clone(), None));
        }
        let mut map = self.write_map();
        if let Some(h) = map.get(id.as_str()) {
            return Ok((h.clone(), None));
        }
        let max = self.inner.config.max_allocations;
        if map.len() >= max {
            return Err(RegistryError::QuotaExceeded(format!(
                "the server holds {max} allocations, its limit (--max-allocations)"
            )));
        }
        if let Some((q, max)) = quota.and_then(|q| Some((q, q.max_allocations?))) {
            let held = if q.prefixes.is_empty() {
                map.len()
            } else {
                q.distinct_prefixes()
                    .into_iter()
                    .map(|p| map.count_prefix(p, max))
                    .sum()
            };
            if held >= max {
                return Err(RegistryError::QuotaExceeded(format!(
                    "token {:?} may hold {} allocations{}, and holds {held}",
                    q.name,
                    max,
                    if q.prefixes.is_empty() {
                        String::new()
                    } else {
                        format!(" within its prefixes {:?}", q.prefixes)
                    }
                )));
            }
        }
        let handle = Arc::new(Handle::creating(id));
        let guard = handle
            .try_lock_write()
            .expect("a new handle's lock is free");
        map.insert(id.clone(), handle.clone());
        Ok((handle, Some(guard)))
    }

    /// Deletes an allocation; its waiters end with `Deleted`. Returns the
    /// index the deletion took.
    pub async fn delete(&self, id: &str) -> Result<u64, RegistryError> {
        let mut admitted = Some(self.inner.store.admit()?);
        for _ in 0..MAX_ROUNDS {
            let admitted = match admitted.take() {
                Some(a) => a,
                None => self.inner.store.admit()?,
            };
            // A record this build cannot read can still be deleted: the
            // compare is on the index that wrote it.
            if let (Some(u), Ok(alloc)) = (self.inner.store.unreadable(id), AllocId::parse(id)) {
                let appended = self.inner.store.append(Append {
                    op: Op::Delete(alloc),
                    expect: u.index,
                    live: Vec::new(),
                    grants: Vec::new(),
                });
                match self
                    .finish(appended, None, None, None, admitted, |_, _| {})
                    .await
                {
                    Ended::Done(index) => {
                        tracing::info!(alloc = %id, index, "an unreadable allocation deleted");
                        self.judged(index).await;
                        return Ok(index);
                    }
                    Ended::Conflict(seen) => {
                        self.reach(seen).await;
                        continue;
                    }
                    Ended::Failed(e) => return Err(e.into()),
                }
            }
            let (write, handle, base) = self.lock_live(id).await?;
            let expect = base.record().modify_index;
            let appended = self.inner.store.append(Append {
                op: Op::Delete(base.record().id.clone()),
                expect,
                live: Vec::new(),
                grants: Vec::new(),
            });
            let logged = id.to_owned();
            let ended = self
                .finish(
                    appended,
                    Some(write),
                    None,
                    None,
                    admitted,
                    move |_, index| {
                        tracing::info!(alloc = %logged, index, "allocation deleted");
                    },
                )
                .await;
            match ended {
                Ended::Done(index) => {
                    self.judged(index).await;
                    return Ok(index);
                }
                Ended::Conflict(seen) => self.catch_up(&handle, expect, seen).await,
                Ended::Failed(e) => return Err(e.into()),
            }
        }
        Err(contended(id))
    }

    /// Applies task-state reports together, then evaluates once. An unknown
    /// task rejects the whole batch.
    pub async fn report(
        &self,
        id: &str,
        reports: Vec<(TaskName, TaskReport)>,
    ) -> Result<Arc<Allocation>, RegistryError> {
        self.report_keyed(id, reports, None).await
    }

    /// `report`, for a request that carries an `Idempotency-Key`: a retry
    /// of a request whose change is already in (the key kept on one of its
    /// tasks) answers the record as it is, applying nothing again.
    pub async fn report_keyed(
        &self,
        id: &str,
        reports: Vec<(TaskName, TaskReport)>,
        key: Option<IdemKey>,
    ) -> Result<Arc<Allocation>, RegistryError> {
        self.report_as(id, reports, key, None).await
    }

    /// `report_keyed`, from an agent that names its run (`Taskgate-Run`):
    /// refused 409 `run_superseded` unless it is every named task's
    /// current run (SEMANTICS, "Runs").
    pub async fn report_as(
        &self,
        id: &str,
        reports: Vec<(TaskName, TaskReport)>,
        key: Option<IdemKey>,
        run: Option<u64>,
    ) -> Result<Arc<Allocation>, RegistryError> {
        self.apply_reports(id, reports, Apply::Report(key, run))
            .await
    }

    /// An operator's restore: the coordinator goes to `prestart`, the
    /// states are applied, and it evaluates until stable; losses and stop
    /// orders are cleared and the deadline's clock starts again.
    pub async fn restore(
        &self,
        id: &str,
        reports: Vec<(TaskName, TaskReport)>,
    ) -> Result<Arc<Allocation>, RegistryError> {
        self.apply_reports(id, reports, Apply::Restore).await
    }

    /// An agent's restore: a resume, not an order. It clears no loss and no
    /// stop order and starts no deadline's clock again; a lost task is 409
    /// `task_lost`, a dead one that no order reopened 409 `task_dead`.
    pub async fn resume(
        &self,
        id: &str,
        reports: Vec<(TaskName, TaskReport)>,
    ) -> Result<Arc<Allocation>, RegistryError> {
        self.apply_reports(id, reports, Apply::Resume).await
    }

    /// An operator's stop: the sticky stop order "Stopped By Operator";
    /// 409 `allocation_finished` once every task is dead.
    pub async fn stop(&self, id: &str) -> Result<Arc<Allocation>, RegistryError> {
        let (a, ()) = self
            .write(
                id,
                |a, next_index| {
                    let next = a.stop(self.now(), next_index).map_err(|error| {
                        RegistryError::StopRefused {
                            error,
                            index: a.modify_index,
                        }
                    })?;
                    Ok((next, ()))
                },
                |_| {},
            )
            .await?;
        Ok(a)
    }

    async fn apply_reports(
        &self,
        id: &str,
        reports: Vec<(TaskName, TaskReport)>,
        apply: Apply,
    ) -> Result<Arc<Allocation>, RegistryError> {
        let count = reports.len();
        // A report is a sign of life, from the moment it arrives (a task
        // whose TTL ends while its report waits for the lock is not lost),
        // unless the record it arrives at refuses it: one naming a run
        // that is over, or another agent's claim (which would otherwise
        // keep the run it is refused by alive).
        let run = match apply {
            Apply::Report(_, run) => run,
            Apply::Restore | Apply::Resume => None,
        };
        match apply {
            Apply::Report(..) => {
                self.signs_of_life(id, &reports, |a, i, r| a.check_report(i, r, run).is_ok())
            }
            Apply::Restore | Apply::Resume => self.signs_of_life(id, &reports, |_, _, _| true),
        }
        let reports = Reports::new(reports);
        let (a, ()) = self
            .write(
                id,
                |a, next_index| {
                    reports.with(a, |reports| {
                        let now = self.now();
                        let refused = |i: usize, why| {
                            let seen = self.signs(a).and_then(|s| s.last_seen(i));
                            RegistryError::refused(a, i, why, run, seen)
                        };
                        if let Some((i, at)) = a.lost_among(reports.iter().map(|(i, _)| *i))
                            && !matches!(apply, Apply::Restore)
                        {
                            return Err(RegistryError::task_lost(a, i, at));
                        }
                        let next = match apply {
                            Apply::Restore => {
                                for (i, r) in reports {
                                    if r.ready == Some(true) && !a.spec.tasks()[*i].readiness {
                                        return Err(refused(*i, Refusal::NoReadiness));
                                    }
                                }
                                a.restore(reports, now, next_index)
                            }
                            Apply::Resume => {
                                for (i, r) in reports {
                                    a.check_report(*i, r, None)
                                        .or_else(|why| match why {
                                            // A resume sets states: it claims no run.
                                            Refusal::Claimed { .. } => Ok(()),
                                            why => Err(why),
                                        })
                                        .map_err(|why| refused(*i, why))?;
                                }
                                a.resume(reports, now, next_index)
                            }
                            Apply::Report(key, run) => {
                                if let Some(key) = key {
                                    match a.key_seen(key) {
                                        KeySeen::New => {}
                                        KeySeen::Retry => return Ok((None, ())),
                                        KeySeen::Reused => {
                                            return Err(RegistryError::KeyReused {
                                                index: a.modify_index,
                                            });
                                        }
                                    }
                                }
                                for (i, r) in reports {
                                    a.check_report(*i, r, run).map_err(|why| refused(*i, why))?;
                                }
                                // A sign of life of the run it begins too.
                                self.heard_at(a, reports.iter().map(|(i, _)| *i), now);
                                a.report_keyed(reports, key, now, next_index)
                            }
                        };
                        Ok((next, ()))
                    })
                },
                move |metrics| metrics.reports(count),
            )
            .await?;
        Ok(a)
    }

    /// An operator restart. Returns the record and the tasks told to restart.
    pub async fn restart(
        &self,
        id: &str,
        target: RestartTarget,
        reason: &str,
    ) -> Result<(Arc<Allocation>, Vec<TaskName>), RegistryError> {
        let counted_as = match target {
            RestartTarget::Task(_) => "task",
            RestartTarget::Running => "running",
            RestartTarget::AllTasks => "all_tasks",
        };
        self.write(
            id,
            |a, next_index| {
                let mode = match &target {
                    RestartTarget::Task(name) => RestartMode::Task(
                        a.position(name.as_str())
                            .ok_or_else(|| RegistryError::task_not_found(a, name.as_str()))?,
                    ),
                    RestartTarget::Running => RestartMode::Running,
                    RestartTarget::AllTasks => RestartMode::AllTasks,
                };
                let (next, chosen) =
                    a.restart(mode, reason, self.now(), next_index)
                        .map_err(|error| RegistryError::RestartRefused {
                            error,
                            index: a.modify_index,
                        })?;
                let names = chosen.iter().map(|&i| a.task_name(i).clone()).collect();
                Ok((next, names))
            },
            move |metrics| metrics.restart(counted_as),
        )
        .await
    }
}

/// A request's reports by task position, for the spec of the version
/// they are decided on; kept (not copied) across the rounds of a write,
/// and placed again by name if a round finds another spec (the allocation
/// deleted and registered again meanwhile).
type Placed = (
    Option<Arc<AllocSpec>>,
    Vec<(usize, TaskReport)>,
    Vec<TaskName>,
);

struct Reports(Mutex<Placed>);

impl Reports {
    fn new(reports: Vec<(TaskName, TaskReport)>) -> Self {
        let (names, reports): (Vec<_>, Vec<_>) =
            reports.into_iter().map(|(name, r)| (name, (0, r))).unzip();
        Self(Mutex::new((None, reports, names)))
    }

    /// `f` of the reports placed for `a`'s spec; an unknown task refuses
    /// them all.
    fn with<T>(
        &self,
        a: &Allocation,
        f: impl FnOnce(&[(usize, TaskReport)]) -> Result<T, RegistryError>,
    ) -> Result<T, RegistryError> {
        let mut held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let (spec, reports, names) = &mut *held;
        if spec.as_ref().is_none_or(|s| !Arc::ptr_eq(s, &a.spec)) {
            for (r, name) in reports.iter_mut().zip(names.iter()) {
                r.0 = a
                    .position(name.as_str())
                    .ok_or_else(|| RegistryError::task_not_found(a, name.as_str()))?;
            }
            *spec = Some(a.spec.clone());
        }
        f(reports)
    }
}
