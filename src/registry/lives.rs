//! Signs of life, and how a task's silence is measured.
//!
//! A task under a TTL is alive while its agent reports, heartbeats or
//! waits; a run that gives no sign for its TTL is declared lost. Who
//! measures the silence depends on the store, decided once, at start
//! (`Liveness`):
//!
//! - **Local** (a store this process alone writes): this process's clock.
//!   Signs of life are atomics in the handle; the due-time heap looks at
//!   the allocation when the earliest TTL would end, and `lifecycle`
//!   decides. A restart gives every running task a full TTL.
//! - **Leased** (a store several replicas share, etcd): the store. A run
//!   under a TTL has a mark and a live key under a lease; whichever replica
//!   hears the agent renews the lease, the store removes the live key when
//!   it expires, every replica's view sees that, and the lost decision is
//!   an ordinary write that one replica wins. No replica's memory or clock
//!   measures a silence: a replica that starts, restarts or heard nothing
//!   learns it from the keys. A running task under a TTL whose run has no
//!   mark (it began before its TTL applied) is marked, which starts its
//!   clock then.
//!
//! Renewals are bounded per task and replica. A sign of life that comes
//! (a report, a heartbeat, the start of a wait) is sent at once unless one
//! was sent in the last third of the TTL (`every`); then it is sent when
//! that third is up, never dropped: the lease must not end before a TTL
//! after the latest sign heard. While a query for the task is parked here,
//! one renewal per `every` keeps the lease up. The end of a wait is sent at
//! once (at most one per `END_GAP`): it is the last sign of life of an
//! agent that died with its connections, and its renewal is what puts the
//! lease's expiry one TTL after the death rather than up to a third of a
//! TTL later.

use std::{
    collections::HashMap,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use super::{
    Inner, Registry, RegistryError,
    clock::nanos,
    handle::Handle,
    map::AllocMap,
    signs::{END_GAP, NEVER, ParkedLife},
};
use crate::{
    lifecycle::{Allocation, RunState, TTL_RANGE, TaskName, TaskReport, Timestamp, UNTIL_TOLD},
    store::{AppendError, Lease, Leases, LiveOp, Liveness as Key, Mark, Store},
};

/// After a mark that could not be written, the next try.
const RETRY: Duration = Duration::from_secs(1);

/// After a mark again that failed (the store did not answer), the next try
/// (sooner: the other replicas decide the run lost `GRACE` after its live
/// key went).
const REMARK_RETRY: Duration = Duration::from_millis(250);

/// How long a replica that heard no sign of life of a run within its TTL
/// waits, once its view saw the run's live key go, before it declares the
/// run lost: the time a replica that did hear the agent has to mark the
/// run again (`mark_again`; its view sees the key go when this one does,
/// and a grant and a transaction take milliseconds on a healthy etcd).
/// Part of the slack of a lost decision (docs/replicas.md, "Liveness").
pub const GRACE: Duration = Duration::from_secs(1);

/// `t + d`, or the end of time where that is past it.
fn plus(t: Timestamp, d: Duration) -> Timestamp {
    time::Duration::try_from(d)
        .ok()
        .and_then(|d| t.checked_add(d))
        .unwrap_or(time::PrimitiveDateTime::MAX.assume_utc())
}

/// What the view holds of a run whose live key is gone (`Inner::lease_gone`).
struct Gone {
    /// The run's mark.
    mark: Mark,
    /// Its TTL, within `TTL_RANGE`.
    ttl: Duration,
    /// When this replica's view saw the key go.
    at: Option<Timestamp>,
    /// The latest sign of life of the run this replica heard (a parked
    /// query is one now).
    heard: Option<Timestamp>,
}

impl Gone {
    /// Whether this replica heard the run's agent less than a TTL ago.
    fn heard_within(&self, now: Timestamp) -> bool {
        self.heard.is_some_and(|h| plus(h, self.ttl) > now)
    }
}

/// Who measures a task's silence (see the module's comment).
pub(super) enum Liveness {
    Local,
    Leased(Arc<dyn Leases>),
}

impl Liveness {
    /// As the store can: leases if it has them.
    pub(super) fn of(store: &dyn Store) -> Self {
        match store.leases() {
            Some(leases) => Self::Leased(leases),
            None => Self::Local,
        }
    }

    /// A record loaded at start: with local liveness, every running task
    /// under a TTL is alive now (their agents' long-polls were cut by the
    /// restart, not by their death); leased, the store keeps their clocks.
    pub(super) fn loaded(&self, handle: &Handle, now: Timestamp, default: Option<Duration>) {
        if let (Self::Local, Some(a)) = (self, handle.current())
            && a.spec.timed(default)
        {
            handle.lives().init_at(a.tasks.len(), now);
        }
    }

    fn leases(&self) -> Option<&Arc<dyn Leases>> {
        match self {
            Self::Local => None,
            Self::Leased(l) => Some(l),
        }
    }
}

/// Why a renewal is asked for.
#[derive(Clone, Copy, Debug)]
pub(super) enum Sign {
    /// A sign of life came: a report, a heartbeat, the start of a wait.
    Came,
    /// A parked query for the task ended.
    Ended,
}

/// The runs `tasks` of `handle`'s allocation may be marked again: the
/// marking that claimed them is done.
fn marking_done(handle: &Handle, tasks: impl IntoIterator<Item = usize>) {
    for i in tasks {
        if let Some(l) = handle.lives().life(i) {
            l.kept.marking.store(false, Ordering::SeqCst);
        }
    }
}

/// Task `i`'s run of `a` marked again: `mark` under a new lease.
async fn under_new_lease(
    leases: &dyn Leases,
    a: &Allocation,
    i: usize,
    mark: Mark,
) -> Result<LiveOp, RegistryError> {
    let lease = leases.grant(mark.ttl).await?;
    Ok(LiveOp::Start {
        task: a.task_name(i).clone(),
        mark: Mark { lease, ..mark },
    })
}

/// Marks the runs `todo` of `a` again, each under a new lease, in one
/// transaction that holds only while the store holds `a` and their live
/// keys are still gone: `Ok(index)` written, `Err(seen)` refused (the store
/// being at `seen`).
async fn write_marks_again(
    leases: &dyn Leases,
    a: &Allocation,
    todo: &[(usize, Mark)],
) -> Result<Result<u64, u64>, RegistryError> {
    let mut ops = Vec::new();
    for &(i, mark) in todo {
        ops.push(under_new_lease(leases, a, i, mark).await?);
    }
    match leases.mark(&a.id, a.modify_index, ops).await {
        Ok(index) => Ok(Ok(index)),
        Err(AppendError::Conflict { seen } | AppendError::Landed { seen }) => Ok(Err(seen)),
        Err(AppendError::Store(e)) => Err(e.into()),
    }
}

/// Applies a liveness key the store listed or changed to the handle of its
/// allocation in `map` (if the view holds it, with that task). Returns the
/// handle, and whether a live key was written (its lease is new).
pub(super) fn keep_liveness(
    map: &AllocMap,
    l: &Key,
    now: Timestamp,
) -> Option<(Arc<Handle>, usize, bool)> {
    let (id, task) = match l {
        Key::Mark { id, task, .. } | Key::Live { id, task, .. } => (id, task),
    };
    let handle = map.get(id.as_str())?;
    let a = handle.current()?;
    let i = a.position(task.as_str())?;
    let life = handle.lives().life_made(a.tasks.len(), i)?;
    let written = match l {
        Key::Mark { mark, .. } => {
            life.kept.set_mark(*mark, now);
            false
        }
        Key::Live { lease, .. } => life.kept.set_live(*lease, now),
    };
    Some((handle.clone(), i, written))
}

impl Inner {
    /// The latest sign of life of each task, as time alone judges it:
    /// this process's memory (local); leased, alive until the store says
    /// otherwise (`lapsed`).
    pub(super) fn seen<'a>(
        &'a self,
        handle: &'a Handle,
        now: Timestamp,
    ) -> impl Fn(usize) -> Option<Timestamp> + 'a {
        let leased = self.lives.leases().is_some();
        move |i| {
            if leased {
                Some(UNTIL_TOLD)
            } else {
                handle.lives().seen(i, now)
            }
        }
    }

    /// Leased: task `i` of `a` runs, the view holds all of `a`, the run is
    /// marked, and its live key is gone: its lease ended.
    fn lease_gone(&self, handle: &Handle, a: &Allocation, i: usize) -> Option<Gone> {
        self.lives.leases()?;
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
        let now = self.config.clock.now();
        let (min, max) = TTL_RANGE;
        Some(Gone {
            mark,
            // A stored TTL out of every task's range (damage) counts as
            // the nearest in it.
            ttl: mark.ttl.clamp(min, max),
            at: keys.gone_at,
            // From the run's beginning on: the signs before it were
            // another run's (the report that began it counts, heard as of
            // its decision: `Registry::heard_at`).
            heard: handle
                .lives()
                .seen(i, now)
                .filter(|&h| t.started_at.is_some_and(|s| h >= s)),
        })
    }

    /// Leased: the mark to write again for task `i` of `a` (the same run,
    /// under the TTL of its mark; its lease to be granted), if the run's
    /// live key is gone and this replica heard its agent within that TTL
    /// (as of `now`).
    fn to_mark_again(
        &self,
        handle: &Handle,
        a: &Allocation,
        i: usize,
        now: Timestamp,
    ) -> Option<Mark> {
        let g = self.lease_gone(handle, a, i)?;
        g.heard_within(now).then_some(Mark {
            ttl: g.ttl,
            ..g.mark
        })
    }

    /// Leased: the marks to write again for the tasks of `a`, now
    /// (`to_mark_again`), with their positions.
    fn marks_again<'a>(
        &'a self,
        handle: &'a Handle,
        a: &'a Allocation,
    ) -> impl Iterator<Item = (usize, Mark)> + 'a {
        let now = self.config.clock.now();
        (0..a.tasks.len()).filter_map(move |i| Some((i, self.to_mark_again(handle, a, i, now)?)))
    }

    /// Whether task `i` of `a` has its signs of life kept here: it runs
    /// under a TTL (its own, or this replica's default), or, leased, the
    /// store keeps liveness keys for the allocation (another replica's
    /// default gave it a TTL: its signs renew its lease and count for
    /// marking it again all the same).
    pub(super) fn watched(&self, handle: &Handle, a: &Allocation, i: usize) -> bool {
        a.spec.ttl(i, self.config.default_liveness_ttl).is_some()
            || (self.lives.leases().is_some() && handle.lives().made())
    }

    /// Leased: task `i` of `a` is to be declared lost now: its run's live
    /// key is gone, this replica heard no sign of life of it within its
    /// TTL (else it marks the run again: `mark_again`), and the key went
    /// `GRACE` ago or more (the time a replica that heard the agent has to
    /// mark it again first). `Some(the latest sign of life known)`: this
    /// replica's own, or the moment the lease was last renewed as its
    /// expiry tells, whichever is later. Never for a task this replica
    /// knows no TTL of (the replica whose default gave it one decides).
    pub(super) fn lapsed(&self, handle: &Handle, a: &Allocation, i: usize) -> Option<Timestamp> {
        a.spec.ttl(i, self.config.default_liveness_ttl)?;
        let g = self.lease_gone(handle, a, i)?;
        let now = self.config.clock.now();
        if g.heard_within(now) || g.at.is_some_and(|at| plus(at, GRACE) > now) {
            return None;
        }
        // A stored TTL too long for the calendar renews nothing knowable.
        let renewed =
            g.at.and_then(|at| at.checked_sub(g.mark.ttl.try_into().ok()?));
        renewed.max(g.heard).or(a.tasks[i].started_at)
    }

    /// Leased: task `i` of `a` runs under a TTL (this replica's) and the
    /// store holds no mark of its run.
    fn unmarked(&self, handle: &Handle, a: &Allocation, i: usize) -> bool {
        let t = &a.tasks[i];
        if self.lives.leases().is_none()
            || t.state != RunState::Running
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

    /// When leases say `a` must be looked at next: at once (a task
    /// lapsed), when a run whose live key went is to be declared lost
    /// (its grace over, or the sign this replica heard a TTL old), or
    /// never. Marks the runs that have no mark, and marks again those
    /// whose live key went while this replica heard their agent within
    /// their TTL. Local: never.
    pub(super) fn lease_due(&self, handle: &Arc<Handle>, a: &Allocation) -> Option<Timestamp> {
        self.lives.leases()?;
        let now = self.config.clock.now();
        let mut next: Option<Timestamp> = None;
        let mut again = false;
        for i in 0..a.tasks.len() {
            let Some(g) = self.lease_gone(handle, a, i) else {
                continue;
            };
            let at = match g.heard {
                Some(heard) if g.heard_within(now) => {
                    again = true;
                    plus(heard, g.ttl)
                }
                // Not this replica's to decide (`lapsed`).
                _ if a.spec.ttl(i, self.config.default_liveness_ttl).is_none() => continue,
                _ => g.at.map_or(now, |at| plus(at, GRACE)),
            };
            next = Some(next.map_or(at, |n| n.min(at)));
        }
        if again {
            self.mark_again(handle);
        }
        if (0..a.tasks.len()).any(|i| self.unmarked(handle, a, i)) {
            self.mark_runs(handle);
        }
        next
    }

    /// Marks again the runs of `handle`'s allocation whose live key went
    /// while this replica heard their agent within their TTL: a lease
    /// etcd ended early (revoked by a leader that resumed from a pause,
    /// etcd issues #12528 and #15247; counted down while etcd had no
    /// quorum; its renewal lost with a replica), so the agent is alive as
    /// far as this replica knows. The same run, a new lease, written only
    /// while the live key is still gone and the record unchanged. In a
    /// task of its own; a failure is tried again while the sign heard is
    /// within the TTL (`lease_due` looks again then).
    fn mark_again(&self, handle: &Arc<Handle>) {
        let Some(registry) = self.registry() else {
            return;
        };
        let Some(a) = handle.current() else { return };
        let todo: Vec<(usize, Mark)> = self
            .marks_again(handle, &a)
            .filter(|&(i, _)| {
                handle
                    .lives()
                    .life(i)
                    .is_some_and(|l| !l.kept.marking.swap(true, Ordering::SeqCst))
            })
            .collect();
        if todo.is_empty() {
            return;
        }
        let handle = handle.clone();
        self.spawn(async move {
            let outcome = registry.mark_again_now(&a, &todo).await;
            marking_done(&handle, todo.iter().map(|&(i, _)| i));
            match outcome {
                // Written; or not (the record or a live key moved on), and
                // the view holds what refused it: looked at again now, on
                // that (another replica's writes must not keep the run
                // unmarked past the others' grace).
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(alloc = %a.id, error = %e, "a run whose lease ended while its agent was heard could not be marked again; trying again");
                    tokio::time::sleep(REMARK_RETRY).await;
                }
            }
            if let Some(now) = handle.current() {
                registry.inner.reschedule(&handle, &now);
            }
        });
    }

    /// Marks the runs of `handle`'s allocation that run under a TTL without
    /// a mark (they started before their TTL applied: the server's default
    /// turned on since, or a change written by another build): from now on
    /// the store measures their silence. In a task of its own; a failure is
    /// tried again.
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
        let handle = handle.clone();
        self.spawn(async move {
            let outcome = registry.mark_unmarked(&a, &todo).await;
            marking_done(&handle, todo.iter().copied());
            if let Err(e) = outcome {
                tracing::warn!(alloc = %a.id, error = %e, "a running task's TTL could not be given to the store; trying again");
                tokio::time::sleep(RETRY).await;
            }
            if let Some(now) = handle.current() {
                registry.inner.reschedule(&handle, &now);
            }
        });
    }

    /// A sign of life for task `i` heard here: leased, a renewal of its
    /// lease now, or when the bound allows. Local: nothing more to do.
    pub(super) fn renew(&self, handle: &Arc<Handle>, i: usize, sign: Sign) {
        let Some(leases) = self.lives.leases() else {
            return;
        };
        let Some(life) = handle.lives().life(i) else {
            return;
        };
        let k = &life.kept;
        if k.lease.load(Ordering::SeqCst) == 0 {
            // No live key seen yet (the view lags behind the write that
            // made the task running), or it went: sent once one is. A
            // run whose key went is marked again now, not when this
            // replica's decision was due: the replicas that heard nothing
            // declare it lost `GRACE` after the key went.
            k.want.store(true, Ordering::SeqCst);
            self.mark_again(handle);
            return;
        }
        let gap = match sign {
            Sign::Came => k.every(),
            Sign::Ended => k.every().min(END_GAP.as_nanos() as i64),
        };
        k.want.store(true, Ordering::SeqCst);
        let sent = k.sent.load(Ordering::SeqCst);
        let now = self.timers.now();
        if sent == NEVER || now.saturating_sub(sent) >= gap {
            self.send(leases.as_ref(), handle, i);
        } else {
            self.renew_at(handle, i, sent.saturating_add(gap));
        }
    }

    /// The view saw task `i`'s live key written: renewed at once if a
    /// query for it is parked here or a sign of life waited for it.
    pub(super) fn lease_known(&self, handle: &Arc<Handle>, i: usize) {
        let (Some(leases), Some(life)) = (self.lives.leases(), handle.lives().life(i)) else {
            return;
        };
        if life.is_parked() || life.kept.want.load(Ordering::SeqCst) {
            self.send(leases.as_ref(), handle, i);
        }
    }

    /// Sends a renewal of task `i`'s lease now (if it has one and a sign
    /// of life or a parked query wants it), and schedules the next while a
    /// query is parked.
    fn send(&self, leases: &dyn Leases, handle: &Arc<Handle>, i: usize) {
        let Some(life) = handle.lives().life(i) else {
            return;
        };
        let k = &life.kept;
        let lease = k.lease.load(Ordering::SeqCst);
        if lease == 0 {
            return;
        }
        let wanted = k.want.swap(false, Ordering::SeqCst);
        let parked = life.is_parked();
        if !wanted && !parked {
            return;
        }
        let now = self.timers.now();
        k.sent.store(now, Ordering::SeqCst);
        k.sent_on.store(lease, Ordering::SeqCst);
        leases.keep_alive(lease);
        if parked {
            self.renew_at(handle, i, now.saturating_add(k.every()));
        }
    }

    /// A renewal of task `i` came due (`time.rs`).
    pub(super) fn renewal_due(&self, handle: &Arc<Handle>, i: usize) {
        let (Some(leases), Some(life)) = (self.lives.leases(), handle.lives().life(i)) else {
            return;
        };
        let k = &life.kept;
        let now = self.timers.now();
        let sent = k.sent.load(Ordering::SeqCst);
        let every = k.every();
        let refresh = life.is_parked() && now.saturating_sub(sent) >= every;
        if k.want.load(Ordering::SeqCst) || refresh {
            k.want.store(true, Ordering::SeqCst);
            self.send(leases.as_ref(), handle, i);
        } else if life.is_parked() {
            self.renew_at(handle, i, sent.saturating_add(every));
        }
    }
}

impl Registry {
    /// A sign of life for tasks of an allocation (a report): each task
    /// under a TTL whose report the current record would take (`taken`)
    /// is alive now.
    pub(super) fn signs_of_life(
        &self,
        id: &str,
        reports: &[(TaskName, TaskReport)],
        taken: impl Fn(&Allocation, usize, &TaskReport) -> bool,
    ) {
        let Ok(handle) = self.handle(id) else { return };
        let Some(a) = handle.current() else { return };
        let default = self.inner.config.default_liveness_ttl;
        // A store with leases may keep liveness keys for tasks this
        // replica knows no TTL of (another's default): their leases are
        // renewed all the same.
        if !a.spec.timed(default) && !handle.lives().made() {
            return;
        }
        let now = self.now();
        for (name, report) in reports {
            if let Some(i) = a.position(name.as_str())
                && taken(&a, i, report)
            {
                if self.inner.watched(&handle, &a, i) {
                    handle.lives().touch(a.tasks.len(), i, now);
                }
                self.inner.renew(&handle, i, Sign::Came);
            }
        }
    }

    /// Leased: signs of life of `tasks` of `a` at `now`, the reports a
    /// write decides at `now` (a run a report begins begins then: its
    /// report is a sign of that run's life, `Inner::lease_gone`).
    pub(super) fn heard_at(
        &self,
        a: &Allocation,
        tasks: impl IntoIterator<Item = usize>,
        now: Timestamp,
    ) {
        if !self.inner.lives_leased() {
            return;
        }
        let Ok(handle) = self.handle(a.id.as_str()) else {
            return;
        };
        for i in tasks {
            if self.inner.watched(&handle, a, i) {
                handle.lives().touch(a.tasks.len(), i, now);
            }
        }
    }

    /// `PUT .../tasks/{task}/heartbeat`: a sign of life that writes
    /// nothing and wakes nobody. Returns the record it was checked
    /// against (for its index).
    pub fn heartbeat(&self, id: &str, task: &str) -> Result<Arc<Allocation>, RegistryError> {
        self.heartbeat_as(id, task, None)
    }

    /// `heartbeat`, from an agent that names its run: refused 409
    /// `run_superseded` unless it is the task's current run.
    pub fn heartbeat_as(
        &self,
        id: &str,
        task: &str,
        run: Option<u64>,
    ) -> Result<Arc<Allocation>, RegistryError> {
        let handle = self.handle(id)?;
        let a = handle
            .current()
            .ok_or_else(|| RegistryError::AllocationNotFound(id.to_owned()))?;
        let i = self.task_position(&a, task)?;
        a.check_run(i, run)
            .map_err(|why| RegistryError::refused(&a, i, why, run, None))?;
        if self.inner.watched(&handle, &a, i) {
            handle.lives().touch(a.tasks.len(), i, self.now());
        }
        self.inner.renew(&handle, i, Sign::Came);
        // Heard (a replica that heard a run's agent within its TTL marks
        // it again if its lease ends), but not acknowledged while no
        // lease renewal is, nor while the run's lease has ended and the
        // run is not marked again yet (the other replicas' lost decision
        // may land before this replica's mark): the agent tries again.
        if self.inner.unrenewed(&handle, &a, i) {
            return Err(RegistryError::Unrenewed {
                alloc: id.to_owned(),
                task: task.to_owned(),
            });
        }
        if self.inner.lease_gone(&handle, &a, i).is_some() {
            return Err(RegistryError::LeaseEnded {
                alloc: id.to_owned(),
                task: task.to_owned(),
            });
        }
        Ok(a)
    }

    /// A query parked for task `i` of `a` (its agent's): a sign of life
    /// now, and for as long as it waits; its end is one too (leased: it
    /// renews the lease, as it is the last sign of an agent that died with
    /// its connections). `None` if the task is not watched.
    pub(super) fn parked_life(
        &self,
        handle: &Arc<Handle>,
        a: &Allocation,
        i: usize,
    ) -> Option<ParkedLife> {
        if !self.inner.watched(handle, a, i) {
            return None;
        }
        let leased = self.inner.lives.leases().is_some();
        handle.lives().touch(a.tasks.len(), i, self.now());
        let ended: Option<Box<dyn FnOnce() + Send>> = leased.then(|| {
            let (inner, handle) = (Arc::downgrade(&self.inner), handle.clone());
            Box::new(move || {
                if let Some(inner) = inner.upgrade() {
                    inner.renew(&handle, i, Sign::Ended);
                }
            }) as Box<dyn FnOnce() + Send>
        });
        let parked = handle
            .lives()
            .park(a.tasks.len(), i, self.inner.config.clock.clone(), ended);
        // Counted as parked first: the renewal then keeps the lease up for
        // as long as the wait lasts.
        self.inner.renew(handle, i, Sign::Came);
        Some(parked)
    }

    /// What a view of `a` shows of its tasks' signs of life: the
    /// allocation looked up and the clock read once for all its tasks.
    /// `None` when no task of `a` runs under a TTL, or `a` is gone.
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
        let Some(leases) = self.inner.lives.leases() else {
            return Ok(());
        };
        let default = self.inner.config.default_liveness_ttl;
        let mut ops = Vec::new();
        for &i in todo {
            let (Some(ttl), Some(started)) = (a.spec.ttl(i, default), a.tasks[i].started_at) else {
                continue;
            };
            let lease = leases.grant(ttl).await?;
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
        match leases.mark(&a.id, a.modify_index, ops).await {
            Ok(index) => {
                tracing::info!(alloc = %a.id, index, "running tasks under a TTL without a mark of their run are watched from now on");
                self.wait_view(index, Duration::from_secs(10)).await;
                Ok(())
            }
            // The record moved on: its next publication looks again.
            Err(AppendError::Conflict { .. } | AppendError::Landed { .. }) => Ok(()),
            Err(AppendError::Store(e)) => Err(e.into()),
        }
    }

    /// Writes new leases for the runs `todo` of `a` whose live key went
    /// while this replica heard their agent (see `Inner::mark_again`):
    /// each the same run under the TTL of its mark, if the store still
    /// holds `a` and the live keys are still gone.
    async fn mark_again_now(
        &self,
        a: &Allocation,
        todo: &[(usize, Mark)],
    ) -> Result<bool, RegistryError> {
        let Some(leases) = self.inner.lives.leases() else {
            return Ok(true);
        };
        match write_marks_again(leases.as_ref(), a, todo).await? {
            Ok(index) => {
                let tasks: Vec<&str> = todo.iter().map(|&(i, _)| a.task_name(i).as_str()).collect();
                tracing::warn!(alloc = %a.id, ?tasks, index, "the lease of a run ended while this replica heard its agent within the TTL (etcd ended it early: a leader that resumed from a pause, or a quorum lost for longer than the TTL); the run is marked again with a new lease, not declared lost");
                self.wait_view(index, Duration::from_secs(10)).await;
                Ok(true)
            }
            // The record moved on, or another replica marked the run
            // again: once the view holds that (something newer than `a`
            // at least), the next look decides.
            Err(seen) => {
                let newer = seen.max(a.modify_index + 1);
                self.wait_view(newer, Duration::from_secs(10)).await;
                Ok(false)
            }
        }
    }

    /// Leased: what `decided` (the next record, decided on `current`) does
    /// to its tasks' liveness keys: a run under a TTL that starts gets its
    /// mark and live key (under a lease from `granted`, granted on first
    /// use and kept for the next rounds of the same write), a run that ends
    /// loses them. Local: nothing.
    pub(super) async fn live_ops(
        &self,
        handle: &Handle,
        current: &Allocation,
        decided: &Allocation,
        granted: &mut HashMap<usize, Lease>,
    ) -> Result<Vec<LiveOp>, RegistryError> {
        let Some(leases) = self.inner.lives.leases() else {
            return Ok(Vec::new());
        };
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
                    let lease = match granted.get(&i) {
                        Some(&l) => l,
                        None => {
                            let l = leases.grant(ttl).await?;
                            granted.insert(i, l);
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
                    // Declared lost because its live key is gone: only
                    // while it still is (a replica that heard the agent
                    // may have marked the run again).
                    let lapsed = !runs
                        && now.lost()
                        && handle.lives().life(i).is_some_and(|l| {
                            let keys = l.kept.keys();
                            keys.mark.is_some() && !keys.live
                        });
                    ops.push(LiveOp::End {
                        task: task(),
                        lapsed,
                    });
                }
                // The run goes on, its live key gone, and this replica
                // heard its agent within its TTL (a report this write
                // answers, say): marked again in the same transaction, so
                // that no lost decision can land between the write's
                // answer and the mark (`mark_again` would come after).
                _ if ran && runs && !new_run => {
                    if let Some(mark) = self.inner.to_mark_again(handle, current, i, self.now()) {
                        ops.push(under_new_lease(leases.as_ref(), current, i, mark).await?);
                    }
                }
                _ => {}
            }
        }
        Ok(ops)
    }

    /// Leased: before a decision on `a` that writes nothing is answered,
    /// the runs of `a` this replica heard within their TTL whose live key
    /// is gone are marked again (else a lost decision could land between
    /// the answer and `mark_again`), in a transaction that holds only while
    /// `a` is the newest record. `None`: no run to mark; `Some(Ok(index))`:
    /// marked; `Some(Err(seen))`: refused, the store being at `seen`.
    pub(super) async fn mark_before_answer(
        &self,
        handle: &Handle,
        a: &Allocation,
    ) -> Result<Option<Result<u64, u64>>, RegistryError> {
        let Some(leases) = self.inner.lives.leases() else {
            return Ok(None);
        };
        let todo: Vec<(usize, Mark)> = self.inner.marks_again(handle, a).collect();
        if todo.is_empty() {
            return Ok(None);
        }
        write_marks_again(leases.as_ref(), a, &todo).await.map(Some)
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

impl Inner {
    /// Leased: whether a sign of life for task `i` of `a` (running, its
    /// lease renewed by this replica) comes while etcd acknowledges no
    /// renewal.
    fn unrenewed(&self, handle: &Handle, a: &Allocation, i: usize) -> bool {
        let Some(leases) = self.lives.leases() else {
            return false;
        };
        a.tasks[i].state == RunState::Running && self.watched(handle, a, i) && !leases.renewing()
    }

    /// Whether the store measures silences (`Liveness::Leased`).
    pub(super) fn lives_leased(&self) -> bool {
        self.lives.leases().is_some()
    }
}
