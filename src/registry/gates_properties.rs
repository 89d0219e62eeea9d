//! Semaphores through the registry against a model of their rules
//! (docs/lifecycle.md, "Semaphores"). Random sequences of registrations,
//! reports, restarts, deletions, limit changes, semaphores deleted and
//! created again, time passing past grant timeouts and registry restarts
//! (a new registry on the same store) drive the real registry (memory
//! store, tokio's paused clock) and a small model written from the rules
//! alone. After each step, once the judge and the timers have nothing left
//! to do, the model's holders and queues must be the registry's, and the
//! registry must keep the invariants: no grant over the limit, no later
//! task granted while an earlier one that shares a semaphore waits and
//! fits, no task waiting while it is first in line with a free slot in
//! each of its semaphores, fences strictly growing per semaphore across
//! the whole run.
//!
//! The allocations are main tasks only (no hooks, dependencies, TTLs or
//! deadlines): such a task is otherwise allowed while it is `pending` and
//! its allocation is not held by an all-tasks restart (the coordinator in
//! `init` until every task is `pending` again). The lifecycle's other
//! rules have their own property tests (`lifecycle/properties.rs`).
//!
//! One thing the rules leave open: grants of several allocations that
//! lapse at the same instant go to the back in the order the registry
//! writes them. The model takes that order from the registry (those
//! granted again first, then the rest by their place) and checks the rest.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use proptest::prelude::*;

use super::*;
use crate::{
    lifecycle::{AllocSpec, Hold, RunState, SemName, TaskName, TaskReport, TaskSpec},
    store::MemoryStore,
};

/// Semaphores `s0`, `s1`, `s2`.
const SEMS: usize = 3;
/// Allocation IDs `a0` to `a5` (deleted ones are registered again).
const IDS: usize = 6;
/// Most tasks of one allocation.
const TASKS: usize = 2;
/// Turns of the scheduler a step may take to settle.
const SETTLE_ROUNDS: usize = 10_000;

fn sem_name(s: usize) -> SemName {
    SemName::parse(&format!("s{s}")).unwrap()
}

fn alloc_id(n: usize) -> AllocId {
    AllocId::parse(&format!("a{n}")).unwrap()
}

fn task_name(i: usize) -> TaskName {
    TaskName::parse(&format!("t{i}")).unwrap()
}

#[derive(Clone, Debug)]
enum Op {
    /// Main tasks, each acquiring the semaphores listed.
    Register {
        id: usize,
        acquire: Vec<Vec<usize>>,
    },
    Report {
        id: usize,
        task: usize,
        state: RunState,
    },
    RestartRunning {
        id: usize,
    },
    RestartAll {
        id: usize,
    },
    Delete {
        id: usize,
    },
    /// Created or changed; the timeout in seconds.
    PutSemaphore {
        sem: usize,
        limit: u32,
        timeout: u64,
    },
    DeleteSemaphore {
        sem: usize,
    },
    /// Time moves on by this many seconds.
    Pass {
        secs: u64,
    },
    /// The registry is dropped and another opened on the same store.
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    let acquire = prop::sample::subsequence((0..SEMS).collect::<Vec<_>>(), 1..=SEMS);
    prop_oneof![
        3 => (0..IDS, prop::collection::vec(acquire, 1..=TASKS))
            .prop_map(|(id, acquire)| Op::Register { id, acquire }),
        8 => (
            0..IDS,
            0..TASKS,
            prop_oneof![
                3 => Just(RunState::Running),
                2 => Just(RunState::Dead),
                1 => Just(RunState::Pending),
            ]
        )
            .prop_map(|(id, task, state)| Op::Report { id, task, state }),
        1 => (0..IDS).prop_map(|id| Op::RestartRunning { id }),
        1 => (0..IDS).prop_map(|id| Op::RestartAll { id }),
        1 => (0..IDS).prop_map(|id| Op::Delete { id }),
        2 => (0..SEMS, 1..=3u32, prop_oneof![Just(2u64), Just(5)])
            .prop_map(|(sem, limit, timeout)| Op::PutSemaphore { sem, limit, timeout }),
        1 => (0..SEMS).prop_map(|sem| Op::DeleteSemaphore { sem }),
        2 => prop_oneof![Just(1u64), Just(2), Just(3), Just(6)].prop_map(|secs| Op::Pass { secs }),
        1 => Just(Op::Reopen),
    ]
}

// ---------------------------------------------------------------- the model

/// Where a task stands with its semaphores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stand {
    /// In line; places are ordered by this stamp (one per change, in the
    /// order of the changes), then allocation, then task.
    Queued(u64),
    /// Holds a slot of every semaphore it acquires since this second.
    Granted(u64),
}

#[derive(Clone, Debug)]
struct MTask {
    acquire: Vec<usize>,
    state: RunState,
    /// An all-tasks restart came after it died, and no report since but
    /// a `dead` one, not failed, while the coordinator was still in
    /// `init` (a task running at the order is not followed here: the
    /// model lets its death use the order up).
    may_leave_dead: bool,
    stand: Option<Stand>,
}

#[derive(Clone, Debug)]
struct MAlloc {
    tasks: Vec<MTask>,
    /// Held by an all-tasks restart until every task is `pending`.
    init: bool,
    /// Every task was dead at once: the coordinator is in `poststop` for
    /// good, and no task leaves `dead` again.
    finished: bool,
}

impl MAlloc {
    fn states(&self) -> Vec<RunState> {
        self.tasks.iter().map(|t| t.state).collect()
    }

    /// Whether task `i` is in line for its semaphores or holds them: it
    /// acquires some, is `pending`, and its gate is open.
    fn wants(&self, i: usize) -> bool {
        !self.tasks[i].acquire.is_empty()
            && self.tasks[i].state == RunState::Pending
            && !self.init
            && !self.finished
    }

    /// Where each task stands after a change (`before`: the states before
    /// it). A dead task holds nothing; a running one keeps its grant (one
    /// that started without one holds nothing); a pending one that wants
    /// its slots keeps its grant or place, unless it came back to `pending`
    /// (it queues again, at the back); one that does not want them leaves.
    fn keep(&mut self, before: &[RunState], stamp: u64) {
        if self.tasks.iter().all(|t| t.state == RunState::Dead) {
            self.finished = true;
        } else if self.init && self.tasks.iter().all(|t| t.state == RunState::Pending) {
            self.init = false;
        }
        let wants: Vec<bool> = (0..self.tasks.len()).map(|i| self.wants(i)).collect();
        for ((t, was), wants) in self.tasks.iter_mut().zip(before).zip(wants) {
            if t.acquire.is_empty() {
                continue;
            }
            t.stand = match (t.state, t.stand) {
                (RunState::Dead, _) => None,
                (RunState::Running, Some(Stand::Granted(at))) => Some(Stand::Granted(at)),
                (RunState::Running, _) => None,
                (RunState::Pending, _) if !wants => None,
                (RunState::Pending, _) if *was != RunState::Pending => Some(Stand::Queued(stamp)),
                (RunState::Pending, None) => Some(Stand::Queued(stamp)),
                (RunState::Pending, kept) => kept,
            };
        }
    }
}

/// A task: (allocation, position).
type Key = (usize, usize);

#[derive(Default)]
struct Model {
    /// Each semaphore's limit and grant timeout (seconds), if it exists.
    defs: [Option<(u32, u64)>; SEMS],
    allocs: BTreeMap<usize, MAlloc>,
    /// Stamps handed out (one per change).
    stamps: u64,
    /// Seconds since the start.
    now: u64,
}

impl Model {
    fn stamp(&mut self) -> u64 {
        self.stamps += 1;
        self.stamps
    }

    /// Applies `op`; false if the registry would refuse it or it does not
    /// apply (then neither side runs it).
    fn apply(&mut self, op: &Op) -> bool {
        match op {
            Op::Register { id, acquire } => {
                if self.allocs.contains_key(id) {
                    return false;
                }
                let tasks: Vec<MTask> = acquire
                    .iter()
                    .map(|a| MTask {
                        acquire: a.clone(),
                        state: RunState::Pending,
                        may_leave_dead: false,
                        stand: None,
                    })
                    .collect();
                let before = vec![RunState::Pending; tasks.len()];
                let mut a = MAlloc {
                    tasks,
                    init: false,
                    finished: false,
                };
                let stamp = self.stamp();
                a.keep(&before, stamp);
                self.allocs.insert(*id, a);
            }
            Op::Report { id, task, state } => {
                let stamp = self.stamp();
                let Some(a) = self.allocs.get_mut(id) else {
                    return false;
                };
                let Some(t) = a.tasks.get(*task) else {
                    return false;
                };
                // Dead is final until an order, and in `poststop`; a
                // second `running` is another agent's claim.
                if (t.state == RunState::Dead
                    && *state != RunState::Dead
                    && (!t.may_leave_dead || a.finished))
                    || (t.state == RunState::Running && *state == RunState::Running)
                {
                    return false;
                }
                let before = a.states();
                let init = a.init;
                let t = &mut a.tasks[*task];
                t.state = *state;
                t.may_leave_dead &= init && *state == RunState::Dead;
                a.keep(&before, stamp);
            }
            Op::RestartRunning { id } => {
                // Running tasks are told to restart; each keeps its grant
                // until it reports `pending`.
                let Some(a) = self.allocs.get(id) else {
                    return false;
                };
                if a.finished || !a.tasks.iter().any(|t| t.state == RunState::Running) {
                    return false;
                }
            }
            Op::RestartAll { id } => {
                let stamp = self.stamp();
                let Some(a) = self.allocs.get_mut(id) else {
                    return false;
                };
                if a.finished {
                    return false;
                }
                let before = a.states();
                for t in &mut a.tasks {
                    if t.state == RunState::Dead {
                        t.may_leave_dead = true;
                    }
                }
                a.init = true;
                a.keep(&before, stamp);
            }
            Op::Delete { id } => {
                if self.allocs.remove(id).is_none() {
                    return false;
                }
            }
            Op::PutSemaphore {
                sem,
                limit,
                timeout,
            } => self.defs[*sem] = Some((*limit, *timeout)),
            Op::DeleteSemaphore { sem } => {
                if self.defs[*sem].take().is_none() {
                    return false;
                }
            }
            Op::Pass { secs } => self.now += secs,
            Op::Reopen => {}
        }
        true
    }

    fn task(&self, (id, i): Key) -> &MTask {
        &self.allocs[&id].tasks[i]
    }

    fn tasks(&self) -> impl Iterator<Item = (Key, &MTask)> {
        self.allocs
            .iter()
            .flat_map(|(&id, a)| a.tasks.iter().enumerate().map(move |(i, t)| ((id, i), t)))
    }

    /// The queue of semaphore `s`, in order.
    fn queue(&self, s: usize) -> Vec<Key> {
        let mut q: Vec<(u64, Key)> = self
            .tasks()
            .filter(|(_, t)| t.acquire.contains(&s))
            .filter_map(|(k, t)| match t.stand {
                Some(Stand::Queued(stamp)) => Some((stamp, k)),
                _ => None,
            })
            .collect();
        q.sort();
        q.into_iter().map(|(_, k)| k).collect()
    }

    fn holders(&self, s: usize) -> usize {
        self.tasks()
            .filter(|(_, t)| t.acquire.contains(&s) && matches!(t.stand, Some(Stand::Granted(_))))
            .count()
    }

    /// The shortest grant timeout of the semaphores a task acquires that
    /// exist (none if none does: a deleted semaphore takes nothing back).
    fn timeout(&self, t: &MTask) -> Option<u64> {
        t.acquire
            .iter()
            .filter_map(|&s| self.defs[s].map(|(_, timeout)| timeout))
            .min()
    }

    /// Whether a queued task takes a place in its queues: only while every
    /// semaphore it acquires exists.
    fn counts(&self, t: &MTask) -> bool {
        t.acquire.iter().all(|&s| self.defs[s].is_some())
    }

    /// What time and the lines do after a step: grants not taken up in
    /// time lapse (to the back, in the order `seen` wrote them), then every
    /// task within the first `limit − holders` of each of its queues is
    /// granted.
    fn resolve(&mut self, seen: &Seen) {
        let mut lapsed: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for ((id, i), t) in self.tasks() {
            if let Some(Stand::Granted(at)) = t.stand
                && t.state == RunState::Pending
                && self
                    .timeout(t)
                    .is_some_and(|timeout| at + timeout <= self.now)
            {
                lapsed.entry(id).or_default().push(i);
            }
        }
        // One change per allocation; those the registry granted again
        // first (their order cannot show), then the others by place.
        let mut order: Vec<((u8, u64), usize)> = lapsed
            .iter()
            .map(|(&id, tasks)| {
                let places: Vec<Option<Hold>> = tasks
                    .iter()
                    .map(|&i| seen.get(&id).and_then(|a| a.get(i)).and_then(|t| t.hold))
                    .collect();
                let since = places.iter().find_map(|h| match h {
                    Some(Hold::Queued { since, .. }) => Some(*since),
                    _ => None,
                });
                (since.map_or((0, 0), |s| (1, s)), id)
            })
            .collect();
        order.sort();
        for (_, id) in order {
            let stamp = self.stamp();
            for &i in &lapsed[&id] {
                self.allocs.get_mut(&id).unwrap().tasks[i].stand = Some(Stand::Queued(stamp));
            }
        }
        loop {
            let queues: Vec<Vec<Key>> = (0..SEMS)
                .map(|s| {
                    self.queue(s)
                        .into_iter()
                        .filter(|&k| self.counts(self.task(k)))
                        .collect()
                })
                .collect();
            let free: Vec<usize> = (0..SEMS)
                .map(|s| {
                    self.defs[s].map_or(0, |(limit, _)| {
                        (limit as usize).saturating_sub(self.holders(s))
                    })
                })
                .collect();
            let ready: Vec<Key> = self
                .tasks()
                .filter(|(_, t)| matches!(t.stand, Some(Stand::Queued(_))))
                .filter(|(k, t)| {
                    t.acquire.iter().all(|&s| {
                        queues[s]
                            .iter()
                            .position(|q| q == k)
                            .is_some_and(|rank| rank < free[s])
                    })
                })
                .map(|(k, _)| k)
                .collect();
            if ready.is_empty() {
                break;
            }
            for (id, i) in ready {
                self.allocs.get_mut(&id).unwrap().tasks[i].stand = Some(Stand::Granted(self.now));
            }
        }
    }
}

// ------------------------------------------------------------ the registry

#[derive(Clone, Debug)]
struct SeenTask {
    acquire: Vec<usize>,
    state: RunState,
    hold: Option<Hold>,
}

/// The registry's records: allocation → its tasks.
type Seen = BTreeMap<usize, Vec<SeenTask>>;

fn look(r: &Registry) -> Seen {
    (0..IDS)
        .filter_map(|n| {
            let a = r.get(alloc_id(n).as_str()).ok()?;
            let tasks = a
                .spec
                .tasks()
                .iter()
                .zip(&a.tasks)
                .map(|(spec, t)| SeenTask {
                    acquire: spec
                        .acquire
                        .iter()
                        .map(|name| (0..SEMS).find(|&s| sem_name(s) == *name).unwrap())
                        .collect(),
                    state: t.state,
                    hold: t.hold(),
                })
                .collect();
            Some((n, tasks))
        })
        .collect()
}

fn seen_tasks(seen: &Seen) -> impl Iterator<Item = (Key, &SeenTask)> {
    seen.iter()
        .flat_map(|(&id, tasks)| tasks.iter().enumerate().map(move |(i, t)| ((id, i), t)))
}

/// Semaphore `s`'s queue as the records give it: by place, then
/// allocation, then task.
fn seen_queue(seen: &Seen, s: usize) -> Vec<Key> {
    let mut q: Vec<(u64, Key)> = seen_tasks(seen)
        .filter(|(_, t)| t.acquire.contains(&s))
        .filter_map(|(k, t)| match t.hold {
            Some(Hold::Queued { since, .. }) => Some((since, k)),
            _ => None,
        })
        .collect();
    q.sort();
    q.into_iter().map(|(_, k)| k).collect()
}

fn seen_holders(seen: &Seen, s: usize) -> Vec<Key> {
    seen_tasks(seen)
        .filter(|(_, t)| t.acquire.contains(&s) && matches!(t.hold, Some(Hold::Granted { .. })))
        .map(|(k, _)| k)
        .collect()
}

/// Semaphore `s`'s queue, only the tasks that take a place in it (each of
/// their semaphores exists).
fn counting_queue(seen: &Seen, defs: &[Option<(u32, u64)>; SEMS], s: usize) -> Vec<Key> {
    seen_queue(seen, s)
        .into_iter()
        .filter(|k| {
            seen.get(&k.0)
                .and_then(|a| a.get(k.1))
                .is_some_and(|t| t.acquire.iter().all(|&s| defs[s].is_some()))
        })
        .collect()
}

/// Whether a queued task would be granted now: each of its semaphores
/// exists and it is within the first `limit − holders` of the queue.
fn fits(seen: &Seen, defs: &[Option<(u32, u64)>; SEMS], key: Key, t: &SeenTask) -> bool {
    t.acquire.iter().all(|&s| {
        let Some((limit, _)) = defs[s] else {
            return false;
        };
        let free = (limit as usize).saturating_sub(seen_holders(seen, s).len());
        counting_queue(seen, defs, s)
            .iter()
            .position(|&q| q == key)
            .is_some_and(|rank| rank < free)
    })
}

/// Lets the registry do everything the step started: the timers' looks,
/// the judge's plans and grants.
async fn settle(r: &Registry) -> Result<(), TestCaseError> {
    for _ in 0..SETTLE_ROUNDS {
        if r.timers_idle() && r.gates_idle_now() {
            return Ok(());
        }
        tokio::task::yield_now().await;
    }
    Err(TestCaseError::fail(
        "the judge and the timers never settled",
    ))
}

async fn drive(r: &Registry, op: &Op) -> Result<(), TestCaseError> {
    let done = match op {
        Op::Register { id, acquire } => {
            let tasks = acquire
                .iter()
                .enumerate()
                .map(|(i, sems)| TaskSpec {
                    acquire: sems.iter().map(|&s| sem_name(s)).collect(),
                    ..TaskSpec::named(task_name(i))
                })
                .collect();
            let spec = AllocSpec::new(tasks, &Limits::default()).unwrap();
            r.register(alloc_id(*id), spec).await.map(drop)
        }
        Op::Report { id, task, state } => {
            let report = TaskReport {
                state: *state,
                failed: false,
                ready: None,
                event: None,
            };
            r.report(alloc_id(*id).as_str(), vec![(task_name(*task), report)])
                .await
                .map(drop)
        }
        Op::RestartRunning { id } => r
            .restart(alloc_id(*id).as_str(), RestartTarget::Running, "test")
            .await
            .map(drop),
        Op::RestartAll { id } => r
            .restart(alloc_id(*id).as_str(), RestartTarget::AllTasks, "test")
            .await
            .map(drop),
        Op::Delete { id } => r.delete(alloc_id(*id).as_str()).await.map(drop),
        Op::PutSemaphore {
            sem,
            limit,
            timeout,
        } => r
            .put_semaphore(sem_name(*sem), *limit, Duration::from_secs(*timeout))
            .await
            .map(drop),
        Op::DeleteSemaphore { sem } => r.delete_semaphore(&sem_name(*sem)).await,
        Op::Pass { secs } => {
            tokio::time::advance(Duration::from_secs(*secs)).await;
            Ok(())
        }
        Op::Reopen => Ok(()),
    };
    prop_assert!(done.is_ok(), "{op:?} refused: {:?}", done.err());
    Ok(())
}

/// The model's holders, queues and task states are the registry's; each
/// semaphore's line (what `GET /v1/semaphores/{name}` shows) is its
/// records'.
fn compare(
    model: &Model,
    seen: &Seen,
    r: &Registry,
    t0: crate::lifecycle::Timestamp,
) -> Result<(), TestCaseError> {
    let ids: Vec<usize> = seen.keys().copied().collect();
    let expected: Vec<usize> = model.allocs.keys().copied().collect();
    prop_assert_eq!(ids, expected, "the allocations");
    for (key, t) in seen_tasks(seen) {
        let m = model.task(key);
        prop_assert_eq!(t.state, m.state, "the state of {:?}", key);
        let same = match (t.hold, m.stand) {
            (None, None) | (Some(Hold::Queued { .. }), Some(Stand::Queued(_))) => true,
            (Some(Hold::Granted { at, .. }), Some(Stand::Granted(secs))) => {
                at == t0 + Duration::from_secs(secs)
            }
            _ => false,
        };
        prop_assert!(
            same,
            "{:?} stands {:?} in the registry, {:?} in the model",
            key,
            t.hold,
            m.stand
        );
    }
    for s in 0..SEMS {
        prop_assert_eq!(seen_queue(seen, s), model.queue(s), "the queue of s{}", s);
        let line = r.semaphore(sem_name(s).as_str());
        prop_assert_eq!(
            line.as_ref()
                .map(|l| (l.semaphore.limit, l.semaphore.grant_timeout.as_secs())),
            model.defs[s],
            "the definition of s{}",
            s
        );
        if let Some(line) = line {
            let mut holders: Vec<Key> = line
                .holders
                .iter()
                .map(|(id, i, _)| (key_of(id), *i))
                .collect();
            holders.sort();
            prop_assert_eq!(holders, seen_holders(seen, s), "the holders of s{}", s);
            let queue: Vec<Key> = line
                .queue
                .iter()
                .map(|(_, id, i)| (key_of(id), *i))
                .collect();
            prop_assert_eq!(queue, seen_queue(seen, s), "the line of s{}", s);
        }
    }
    Ok(())
}

fn key_of(id: &AllocId) -> usize {
    id.as_str()[1..].parse().unwrap()
}

/// The invariants, on the registry alone (`prev`: its records before the
/// step; `fences`: the highest fence of each semaphore so far).
fn invariants(
    prev: &Seen,
    seen: &Seen,
    defs: &[Option<(u32, u64)>; SEMS],
    fences: &mut [u64; SEMS],
) -> Result<(), TestCaseError> {
    let fence_of = |t: &SeenTask| match t.hold {
        Some(Hold::Granted { fence, .. }) => Some(fence),
        _ => None,
    };
    let mut granted: Vec<(u64, Key, &SeenTask)> = seen_tasks(seen)
        .filter_map(|(k, t)| {
            let fence = fence_of(t)?;
            let before = prev.get(&k.0).and_then(|a| a.get(k.1)).and_then(fence_of);
            (before != Some(fence)).then_some((fence, k, t))
        })
        .collect();
    granted.sort_by_key(|(fence, _, _)| *fence);
    for &(fence, key, t) in &granted {
        for &s in &t.acquire {
            prop_assert!(
                fence > fences[s],
                "{:?} granted s{} with fence {} after fence {}",
                key,
                s,
                fence,
                fences[s]
            );
            fences[s] = fence;
            let holders = seen_holders(seen, s).len();
            let limit = defs[s].map(|(limit, _)| limit as usize);
            prop_assert!(
                limit.is_some_and(|limit| holders <= limit),
                "{:?} granted s{}: {} holders, limit {:?}",
                key,
                s,
                holders,
                limit
            );
        }
        // Its place before the step, if it was in line then (else it
        // joined during the step, after everyone in line before it).
        let place = match prev
            .get(&key.0)
            .and_then(|a| a.get(key.1))
            .and_then(|t| t.hold)
        {
            Some(Hold::Queued { since, .. }) => since,
            _ => u64::MAX,
        };
        for (earlier, e) in seen_tasks(seen) {
            let Some(Hold::Queued { since, .. }) = e.hold else {
                continue;
            };
            let shares = e.acquire.iter().any(|s| t.acquire.contains(s));
            prop_assert!(
                !(since < place && shares && fits(seen, defs, earlier, e)),
                "{:?} granted while {:?}, earlier in a line they share, waits and fits",
                key,
                earlier
            );
        }
    }
    for (key, t) in seen_tasks(seen) {
        if !matches!(t.hold, Some(Hold::Queued { .. })) {
            continue;
        }
        let first_with_room = t.acquire.iter().all(|&s| {
            defs[s].is_some_and(|(limit, _)| seen_holders(seen, s).len() < limit as usize)
                && counting_queue(seen, defs, s).first() == Some(&key)
        });
        prop_assert!(
            !first_with_room,
            "{:?} waits, first in line with a free slot in each of its semaphores",
            key
        );
    }
    Ok(())
}

fn run(start: [(u32, u64); SEMS], ops: Vec<Op>) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async move {
        let store = Arc::new(MemoryStore::new());
        // One clock across the registry's restarts: the grants' times are
        // on it.
        let clock = Clock::tokio();
        let t0 = clock.now();
        let config = || RegistryConfig {
            clock: clock.clone(),
            ..RegistryConfig::default()
        };
        let mut r = Registry::open(store.clone(), config()).unwrap();
        let mut model = Model::default();
        let mut prev = Seen::new();
        let mut fences = [0; SEMS];
        let puts = start
            .iter()
            .enumerate()
            .map(|(sem, &(limit, timeout))| Op::PutSemaphore {
                sem,
                limit,
                timeout,
            });
        for op in puts.chain(ops) {
            if !model.apply(&op) {
                continue;
            }
            drive(&r, &op).await?;
            if let Op::Reopen = op {
                drop(r);
                r = Registry::open(store.clone(), config()).unwrap();
            }
            settle(&r).await?;
            let seen = look(&r);
            invariants(&prev, &seen, &model.defs, &mut fences)?;
            model.resolve(&seen);
            compare(&model, &seen, &r, t0)?;
            prev = seen;
        }
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig {
        // `TASKGATE_FUZZ_CASES` runs more (CI's fuzz step does).
        cases: std::env::var("TASKGATE_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(64),
        ..ProptestConfig::default()
    })]

    #[test]
    fn the_registry_grants_slots_as_the_rules_say(
        start in prop::array::uniform3((1..=3u32, prop_oneof![Just(2u64), Just(5)])),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        run(start, ops)?;
    }
}
