//! Barriers through the registry against a model of their rules
//! (docs/lifecycle.md, "Barriers"; issue 44: a barrier opens exactly once
//! with exactly `size` members). Random sequences of registrations (that
//! sometimes disagree with a barrier's members, or come after it opened,
//! timed out or filled), sidecars that start or fail, members that run
//! and die once let through, all-tasks restarts and the agents' `pending`
//! after them, deletions, time passing past barrier timeouts and liveness
//! TTLs (losses), and registry restarts (a new registry on the same
//! store; some in the middle of a step, once the store took the step's
//! change and a few more: a decision may be on the anchor and some of the
//! members only) drive the real registry (memory store, tokio's paused
//! clock) and a small model written from the rules alone.
//!
//! Each allocation is a prestart sidecar `side` (its main gate opens once
//! it runs; under a TTL in some allocations) and one or two main tasks
//! naming one barrier. A member **arrives** while it is `pending`, its
//! gate is open, it is not lost and its allocation has no stop order. A
//! barrier whose `size` members arrived opens: all its members pass, at
//! that moment, for good. One whose first counted arrival is older than
//! its timeout times out: all its members are closed and each member's
//! allocation gets the stop order "Barrier Timeout" unless it has one.
//!
//! After each step, once the judge and the timers have nothing left to
//! do, the model's barriers (phase, members and their standing), tasks
//! (state, allowed, stop order) and `blocked_by` reasons must be the
//! registry's. Apart from the model, every change the store commits is
//! replayed and checked: a member's decision is written first to the
//! barrier's anchor (its first-registered member), the opening when
//! exactly `size` members were arrived, the timeout when the first
//! arrival is `timeout` old; a barrier decides at most once (a timed-out
//! one never opens); a decided member stays decided, through restarts of
//! its allocation and of the registry; a member closed by a timeout gets
//! the stop order unless its allocation had one; no member is allowed
//! before its barrier opened. And once settled, the registry's view of
//! each barrier agrees with itself: no gathering barrier has `size`
//! arrived or is past its timeout, every member of a decided one carries
//! the decision.
//!
//! Time moves in half seconds: barrier timeouts end on whole seconds (every
//! step is on one), TTLs (2.5 s) half-way between, so a loss and a timeout
//! never fall on the same instant (their order there would be a race the
//! rules leave open).

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex, PoisonError, Weak},
    time::Duration,
};

use proptest::prelude::*;

use super::*;
use crate::{
    lifecycle::{
        AllocSpec, BarrierSpec, CoordState, Desired, Hook, Lifecycle, Meet, RunState, SemName,
        StopKind, StopReason, TaskName, TaskReport, TaskSpec, Timestamp,
    },
    store::{
        Admitted, Append, Appended, Follower, Loaded, MemoryStore, Op as StoreOp, Store, StoreError,
    },
};

/// Barriers `b0` and `b1`.
const BARRIERS: usize = 2;
/// Allocation IDs `a0` to `a7` (deleted ones are registered again).
const IDS: usize = 8;
/// Most members of one allocation.
const MEMBERS: usize = 2;
/// The model's unit of time.
const HALF: Duration = Duration::from_millis(500);
/// A lossy sidecar's TTL, in halves (2.5 s).
const TTL: u64 = 5;
/// Turns of the scheduler a step may take to settle.
const SETTLE_ROUNDS: usize = 10_000;

fn barrier_name(b: usize) -> SemName {
    SemName::parse(&format!("b{b}")).unwrap()
}

fn alloc_id(n: usize) -> AllocId {
    AllocId::parse(&format!("a{n}")).unwrap()
}

/// Task `i`'s name: `side` first, then the members.
fn task_name(i: usize) -> TaskName {
    TaskName::parse(&if i == 0 {
        "side".to_owned()
    } else {
        format!("worker{i}")
    })
    .unwrap()
}

/// A barrier's terms: its size and timeout (seconds).
type Terms = (u16, Option<u64>);

#[derive(Clone, Debug)]
enum Op {
    /// An allocation whose members all name `barrier`, each on the case's
    /// terms for it (`None`) or on its own.
    Register {
        id: usize,
        lossy: bool,
        barrier: usize,
        members: Vec<Option<Terms>>,
    },
    /// The sidecar reports `running` (once allowed).
    SideUp {
        id: usize,
    },
    /// The sidecar reports `dead`, failed.
    SideFails {
        id: usize,
    },
    /// A member reports `running` (once allowed): the `w`-th of those
    /// that may.
    WorkerUp {
        id: usize,
        w: usize,
    },
    /// A running member reports `dead`: the `w`-th of those running.
    WorkerDown {
        id: usize,
        w: usize,
    },
    /// After a restart order, the agent reports `pending` for the `k`-th
    /// task told to restart.
    Pending {
        id: usize,
        k: usize,
    },
    RestartAll {
        id: usize,
    },
    Delete {
        id: usize,
    },
    /// Time moves on by this many seconds, half a second at a time.
    Pass {
        secs: u64,
    },
    /// The registry is dropped and another opened on the same store.
    Reopen,
    /// The registry stops in the middle of the next step that asks it
    /// something, or of the next whole second time passes to (when only
    /// barriers time out: losses fall between): once the step's own
    /// change and `after` more are committed, the store takes no more;
    /// another registry is opened on what it holds (a decision may be on
    /// the anchor, and on some of the other members, or on none).
    Crash {
        after: usize,
    },
}

/// Small barriers mostly (they open more often); no timeout, a short
/// one or a longer one.
fn terms() -> impl Strategy<Value = Terms> {
    (
        prop_oneof![3 => Just(2u16), 2 => Just(3), 1 => Just(4)],
        prop_oneof![2 => Just(None), 1 => Just(Some(3u64)), 2 => Just(Some(8))],
    )
}

fn op() -> impl Strategy<Value = Op> {
    let member = prop_oneof![4 => Just(None), 1 => terms().prop_map(Some)];
    prop_oneof![
        3 => (
            0..IDS,
            prop::bool::weighted(0.2),
            0..BARRIERS,
            prop_oneof![3 => Just(1), 1 => Just(MEMBERS)]
                .prop_flat_map(move |n| prop::collection::vec(member.clone(), n)),
        )
            .prop_map(|(id, lossy, barrier, members)| Op::Register { id, lossy, barrier, members }),
        6 => (0..IDS).prop_map(|id| Op::SideUp { id }),
        1 => (0..IDS).prop_map(|id| Op::SideFails { id }),
        4 => (0..IDS, 0..MEMBERS).prop_map(|(id, w)| Op::WorkerUp { id, w }),
        2 => (0..IDS, 0..MEMBERS).prop_map(|(id, w)| Op::WorkerDown { id, w }),
        4 => (0..IDS, 0..=MEMBERS).prop_map(|(id, k)| Op::Pending { id, k }),
        2 => (0..IDS).prop_map(|id| Op::RestartAll { id }),
        2 => (0..IDS).prop_map(|id| Op::Delete { id }),
        2 => prop_oneof![Just(1u64), Just(2), Just(4)].prop_map(|secs| Op::Pass { secs }),
        1 => Just(Op::Reopen),
        3 => (0..4usize).prop_map(|after| Op::Crash { after }),
    ]
}

// ---------------------------------------------------------------- the model

/// Where a member stands with its barrier; times in halves since the start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Standing {
    Absent,
    Arrived(u64),
    Passed(u64),
    Closed(u64),
}

impl Standing {
    fn decided(self) -> bool {
        matches!(self, Standing::Passed(_) | Standing::Closed(_))
    }
}

/// The coordinator, as far as these allocations go: `Open` is `main`,
/// `poststart` and `wait_alloc` (the main gate is open in each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Coord {
    Init,
    Prestart,
    Open,
    Poststop,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Order {
    Run,
    SiblingFailed,
    MainDead,
    BarrierTimeout,
}

#[derive(Clone, Debug)]
struct MTask {
    state: RunState,
    /// Told to restart, and no report since.
    stale: bool,
    failed: bool,
    lost: bool,
    /// A member's standing (`Absent` for the sidecar).
    standing: Standing,
}

#[derive(Clone, Debug)]
struct MAlloc {
    /// Registration order (the anchor is the first).
    seq: u64,
    lossy: bool,
    barrier: usize,
    /// Each member's terms, as registered.
    terms: Vec<Terms>,
    /// `side`, then the members.
    tasks: Vec<MTask>,
    coord: Coord,
    order: Order,
    /// A running lossy sidecar's clock: lost `TTL` after this.
    ttl_from: u64,
}

impl MAlloc {
    fn members(&self) -> impl Iterator<Item = (usize, &MTask)> {
        self.tasks.iter().enumerate().skip(1)
    }

    /// Whether task `i` may start: its gate is open, it is not lost, and
    /// a member's barrier opened.
    fn allowed(&self, i: usize) -> bool {
        let t = &self.tasks[i];
        if i == 0 {
            matches!(self.coord, Coord::Prestart | Coord::Open) && !t.lost
        } else {
            self.coord == Coord::Open && !t.lost && matches!(t.standing, Standing::Passed(_))
        }
    }

    /// Whether member `i` counts among its barrier's arrived.
    fn arrives(&self, i: usize) -> bool {
        let t = &self.tasks[i];
        !t.standing.decided()
            && t.state == RunState::Pending
            && self.order == Order::Run
            && self.coord == Coord::Open
            && !t.lost
    }

    /// Where the coordinator, the order and the members stand after a
    /// change at `now`: the coordinator moves on while it can, a stop
    /// order is sticky (else a failed task, or every member dead, gives
    /// one), a decision stays, and a member is arrived (since the change
    /// that made it so) while `arrives` says so.
    fn settle(&mut self, now: u64) {
        let all_dead = || self.tasks.iter().all(|t| t.state == RunState::Dead);
        loop {
            let next = match self.coord {
                _ if all_dead() => Coord::Poststop,
                Coord::Init if self.tasks.iter().all(|t| t.state == RunState::Pending) => {
                    Coord::Prestart
                }
                Coord::Prestart if self.tasks[0].state == RunState::Running => Coord::Open,
                c => c,
            };
            if next == self.coord {
                break;
            }
            self.coord = next;
        }
        if self.order == Order::Run {
            let dead = |t: &MTask| t.state == RunState::Dead && !t.stale;
            if self.tasks.iter().any(|t| dead(t) && t.failed) {
                self.order = Order::SiblingFailed;
            } else if self.members().all(|(_, t)| dead(t)) {
                self.order = Order::MainDead;
            }
        }
        for i in 1..self.tasks.len() {
            let next = match self.tasks[i].standing {
                s if s.decided() => s,
                _ if !self.arrives(i) => Standing::Absent,
                Standing::Absent => Standing::Arrived(now),
                s => s,
            };
            self.tasks[i].standing = next;
        }
    }
}

/// What the registry answers a registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    Ok,
    Mismatch,
    Closed,
}

/// What the registry is asked, the model's choices made (which task,
/// on which terms).
#[derive(Clone, Debug)]
enum Action {
    Register {
        id: usize,
        lossy: bool,
        barrier: usize,
        terms: Vec<Terms>,
        answer: Answer,
    },
    Report {
        id: usize,
        task: usize,
        state: RunState,
        failed: bool,
    },
    RestartAll {
        id: usize,
    },
    Delete {
        id: usize,
    },
    Reopen,
}

impl Action {
    fn report(id: usize, task: usize, state: RunState, failed: bool) -> Self {
        Action::Report {
            id,
            task,
            state,
            failed,
        }
    }
}

/// A barrier's phase; times in halves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Gathering,
    Open(u64),
    TimedOut(u64),
}

/// A member: (registration order, allocation, position). Ordered as
/// registered: the first is the anchor.
type Member = (u64, usize, usize);

struct Model {
    /// Each barrier's terms in this case, for the members that take them.
    start: [Terms; BARRIERS],
    allocs: BTreeMap<usize, MAlloc>,
    /// Each barrier's phase while it has members.
    phases: [Option<Phase>; BARRIERS],
    seq: u64,
    /// Halves since the start.
    now: u64,
}

impl Model {
    fn new(start: [Terms; BARRIERS]) -> Self {
        Self {
            start,
            allocs: BTreeMap::new(),
            phases: [None; BARRIERS],
            seq: 0,
            now: 0,
        }
    }

    /// Barrier `b`'s members, in order.
    fn members(&self, b: usize) -> Vec<Member> {
        let mut out: Vec<Member> = self
            .allocs
            .iter()
            .filter(|(_, a)| a.barrier == b)
            .flat_map(|(&id, a)| a.members().map(move |(i, _)| (a.seq, id, i)))
            .collect();
        out.sort();
        out
    }

    fn standing(&self, (_, id, i): Member) -> Standing {
        self.allocs[&id].tasks[i].standing
    }

    /// Barrier `b`'s terms: its anchor's.
    fn terms(&self, b: usize) -> Option<Terms> {
        let (_, id, i) = *self.members(b).first()?;
        Some(self.allocs[&id].terms[i - 1])
    }

    /// The arrived members of `b` and the first arrival among them.
    fn arrived(&self, b: usize) -> (usize, Option<u64>) {
        let at: Vec<u64> = self
            .members(b)
            .into_iter()
            .filter_map(|m| match self.standing(m) {
                Standing::Arrived(at) => Some(at),
                _ => None,
            })
            .collect();
        (at.len(), at.iter().min().copied())
    }

    /// The answer to a registration of `members` at `b`: each member in
    /// turn, counting those before it in the same allocation, is refused
    /// if `b` decided or holds `size` members already (closed, which
    /// wins), or if its terms are not the first member's (mismatch).
    fn may_join(&self, b: usize, members: &[Terms]) -> Answer {
        let held = self.members(b).len();
        let first = self.terms(b).or(members.first().copied());
        for (k, &terms) in members.iter().enumerate() {
            let size = first.map_or(terms.0, |f| f.0);
            if self.phases[b].is_some_and(|p| p != Phase::Gathering) || held + k >= size.into() {
                return Answer::Closed;
            }
            if first.is_some_and(|f| f != terms) {
                return Answer::Mismatch;
            }
        }
        Answer::Ok
    }

    /// Applies `op`; `None` if it does not apply (then neither side runs
    /// it), else what the registry is to be asked, and answers.
    fn apply(&mut self, op: &Op) -> Option<Action> {
        let now = self.now;
        let action = match *op {
            Op::Register {
                id,
                lossy,
                barrier: b,
                ref members,
            } => {
                if self.allocs.contains_key(&id) {
                    return None;
                }
                let terms: Vec<Terms> =
                    members.iter().map(|t| t.unwrap_or(self.start[b])).collect();
                let answer = self.may_join(b, &terms);
                if answer == Answer::Ok {
                    self.seq += 1;
                    let task = MTask {
                        state: RunState::Pending,
                        stale: false,
                        failed: false,
                        lost: false,
                        standing: Standing::Absent,
                    };
                    let mut a = MAlloc {
                        seq: self.seq,
                        lossy,
                        barrier: b,
                        tasks: vec![task; terms.len() + 1],
                        terms: terms.clone(),
                        coord: Coord::Init,
                        order: Order::Run,
                        ttl_from: 0,
                    };
                    a.settle(now);
                    self.allocs.insert(id, a);
                    self.phases[b].get_or_insert(Phase::Gathering);
                }
                Action::Register {
                    id,
                    lossy,
                    barrier: b,
                    terms,
                    answer,
                }
            }
            Op::SideUp { id } => {
                let a = self.allocs.get_mut(&id)?;
                if a.tasks[0].state != RunState::Pending || !a.allowed(0) || a.order != Order::Run {
                    return None;
                }
                let side = &mut a.tasks[0];
                side.state = RunState::Running;
                side.stale = false;
                a.ttl_from = now;
                a.settle(now);
                Action::report(id, 0, RunState::Running, false)
            }
            Op::SideFails { id } => {
                let a = self.allocs.get_mut(&id)?;
                let side = &mut a.tasks[0];
                if side.state == RunState::Dead {
                    return None;
                }
                side.state = RunState::Dead;
                side.stale = false;
                side.failed = true;
                a.settle(now);
                Action::report(id, 0, RunState::Dead, true)
            }
            Op::WorkerUp { id, w } => {
                let a = self.allocs.get_mut(&id)?;
                let may: Vec<usize> = a
                    .members()
                    .filter(|(i, t)| t.state == RunState::Pending && !t.stale && a.allowed(*i))
                    .map(|(i, _)| i)
                    .collect();
                if may.is_empty() || a.order != Order::Run {
                    return None;
                }
                let i = may[w % may.len()];
                a.tasks[i].state = RunState::Running;
                a.settle(now);
                Action::report(id, i, RunState::Running, false)
            }
            Op::WorkerDown { id, w } => {
                let a = self.allocs.get_mut(&id)?;
                let running: Vec<usize> = a
                    .members()
                    .filter(|(_, t)| t.state == RunState::Running && !t.stale)
                    .map(|(i, _)| i)
                    .collect();
                if running.is_empty() {
                    return None;
                }
                let i = running[w % running.len()];
                a.tasks[i].state = RunState::Dead;
                a.settle(now);
                Action::report(id, i, RunState::Dead, false)
            }
            Op::Pending { id, k } => {
                let a = self.allocs.get_mut(&id)?;
                // No task leaves `dead` in `poststop`.
                let told: Vec<usize> = (0..a.tasks.len())
                    .filter(|&i| {
                        a.tasks[i].stale
                            && !(a.tasks[i].state == RunState::Dead && a.coord == Coord::Poststop)
                    })
                    .collect();
                if told.is_empty() {
                    return None;
                }
                let i = told[k % told.len()];
                let t = &mut a.tasks[i];
                t.state = RunState::Pending;
                t.stale = false;
                t.failed = false;
                a.settle(now);
                Action::report(id, i, RunState::Pending, false)
            }
            Op::RestartAll { id } => {
                // Running and dead tasks are told to restart (a lost one
                // is `pending` again, waiting for a new agent); the
                // coordinator goes back to `init`, and the order is
                // cleared (a decision is not).
                let a = self.allocs.get_mut(&id)?;
                if a.coord == Coord::Poststop {
                    return None;
                }
                for t in &mut a.tasks {
                    if t.state != RunState::Pending {
                        if t.lost {
                            t.lost = false;
                            t.failed = false;
                            t.state = RunState::Pending;
                        }
                        t.stale = true;
                    }
                }
                a.coord = Coord::Init;
                a.order = Order::Run;
                a.settle(now);
                Action::RestartAll { id }
            }
            Op::Delete { id } => {
                let b = self.allocs.remove(&id)?.barrier;
                if self.members(b).is_empty() {
                    self.phases[b] = None;
                }
                Action::Delete { id }
            }
            Op::Pass { .. } | Op::Crash { .. } => unreachable!("not a step of its own"),
            Op::Reopen => {
                self.reopened();
                Action::Reopen
            }
        };
        self.decide();
        Some(action)
    }

    /// A new registry: every running task gets a full TTL.
    fn reopened(&mut self) {
        for a in self.allocs.values_mut() {
            if a.tasks[0].state == RunState::Running {
                a.ttl_from = self.now;
            }
        }
    }

    /// Half a second passes: lossy sidecars silent for their TTL are lost,
    /// then barriers decide.
    fn tick(&mut self) {
        self.now += 1;
        let now = self.now;
        for a in self.allocs.values_mut() {
            if a.lossy && a.tasks[0].state == RunState::Running && a.ttl_from + TTL <= now {
                a.tasks[0] = MTask {
                    state: RunState::Dead,
                    stale: false,
                    failed: true,
                    lost: true,
                    ..a.tasks[0].clone()
                };
                a.settle(now);
            }
        }
        self.decide();
    }

    /// Each gathering barrier opens once `size` members arrived, or times
    /// out once its first arrival is `timeout` old.
    fn decide(&mut self) {
        let now = self.now;
        for b in 0..BARRIERS {
            if self.phases[b] != Some(Phase::Gathering) {
                continue;
            }
            let (size, timeout) = self.terms(b).expect("a barrier has members");
            let (arrived, first) = self.arrived(b);
            let (phase, standing) = if arrived >= size.into() {
                (Phase::Open(now), Standing::Passed(now))
            } else if let (Some(t), Some(first)) = (timeout, first)
                && first + 2 * t <= now
            {
                (Phase::TimedOut(now), Standing::Closed(now))
            } else {
                continue;
            };
            self.phases[b] = Some(phase);
            for (_, id, i) in self.members(b) {
                let a = self.allocs.get_mut(&id).unwrap();
                a.tasks[i].standing = standing;
                if matches!(phase, Phase::TimedOut(_)) && a.order == Order::Run {
                    a.order = Order::BarrierTimeout;
                }
                a.settle(now);
            }
        }
    }
}

// ------------------------------------------------------------ the registry

/// A memory store that keeps every change it commits, in order, for the
/// invariants to replay, and that takes only so many more changes when
/// told (a registry that crashes).
struct Logged {
    store: MemoryStore,
    log: Mutex<Vec<Committed>>,
    /// How many more writes it admits (`None`: any).
    budget: Mutex<Option<usize>>,
}

enum Committed {
    Put(Arc<Allocation>),
    Delete(AllocId),
}

impl Logged {
    /// The changes committed since the last call.
    fn take(&self) -> Vec<Committed> {
        std::mem::take(&mut *self.log.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

impl Store for Logged {
    fn load(&self) -> Result<Loaded, StoreError> {
        self.store.load()
    }

    fn id(&self) -> &str {
        self.store.id()
    }

    fn follow(&self, from: u64, follower: Weak<dyn Follower>) {
        self.store.follow(from, follower)
    }

    /// Each write is admitted once, before it is decided.
    fn admit(&self) -> Result<Admitted, StoreError> {
        let mut budget = self.budget.lock().unwrap_or_else(PoisonError::into_inner);
        match &mut *budget {
            Some(0) => Err(StoreError::Io("the registry crashed".into())),
            Some(n) => {
                *n -= 1;
                self.store.admit()
            }
            None => self.store.admit(),
        }
    }

    /// Committed at once (the memory store's append), so the log is in
    /// index order.
    fn append(&self, append: Append) -> Appended {
        let deleted = match &append.op {
            StoreOp::Delete(id) => Some(id.clone()),
            _ => None,
        };
        let appended = self.store.append(append);
        let committed = match (&appended.record, deleted) {
            (Some(a), _) => Committed::Put(a.clone()),
            (None, Some(id)) => Committed::Delete(id),
            (None, None) => return appended,
        };
        self.log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(committed);
        appended
    }
}

fn spec(lossy: bool, b: usize, terms: &[Terms]) -> AllocSpec {
    let side = TaskSpec {
        lifecycle: Some(Lifecycle {
            hook: Hook::Prestart,
            sidecar: true,
        }),
        liveness: lossy.then_some(HALF * TTL as u32),
        ..TaskSpec::named(task_name(0))
    };
    let members = terms
        .iter()
        .enumerate()
        .map(|(k, &(size, timeout))| TaskSpec {
            barrier: Some(BarrierSpec {
                name: barrier_name(b),
                size,
                timeout: timeout.map(Duration::from_secs),
            }),
            ..TaskSpec::named(task_name(k + 1))
        });
    AllocSpec::new(
        std::iter::once(side).chain(members).collect(),
        &Limits::default(),
    )
    .unwrap()
}

/// Lets the registry do everything the step started: the timers' looks,
/// the judge's decisions and the members following them.
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

/// Asks the registry; what it answers a registration (anything else must
/// be taken).
async fn drive(r: &Registry, action: &Action) -> Result<Answer, TestCaseError> {
    let done = match *action {
        Action::Register {
            id,
            lossy,
            barrier,
            ref terms,
            ..
        } => {
            return match r.register(alloc_id(id), spec(lossy, barrier, terms)).await {
                Ok(_) => Ok(Answer::Ok),
                Err(RegistryError::BarrierMismatch { .. }) => Ok(Answer::Mismatch),
                Err(RegistryError::BarrierClosed { .. }) => Ok(Answer::Closed),
                Err(e) => Err(TestCaseError::fail(format!("{action:?} refused: {e}"))),
            };
        }
        Action::Report {
            id,
            task,
            state,
            failed,
        } => {
            let report = TaskReport {
                state,
                failed,
                ready: None,
                event: None,
            };
            r.report(alloc_id(id).as_str(), vec![(task_name(task), report)])
                .await
                .map(drop)
        }
        Action::RestartAll { id } => r
            .restart(alloc_id(id).as_str(), RestartTarget::AllTasks, "test")
            .await
            .map(drop),
        Action::Delete { id } => r.delete(alloc_id(id).as_str()).await.map(drop),
        Action::Reopen => Ok(()),
    };
    prop_assert!(done.is_ok(), "{action:?} refused: {:?}", done.err());
    Ok(Answer::Ok)
}

/// Halves since the start as the registry's time.
fn at(t0: Timestamp, halves: u64) -> Timestamp {
    t0 + HALF * u32::try_from(halves).unwrap()
}

fn meet(t0: Timestamp, s: Standing) -> Option<Meet> {
    match s {
        Standing::Absent => None,
        Standing::Arrived(h) => Some(Meet::Arrived { at: at(t0, h) }),
        Standing::Passed(h) => Some(Meet::Passed { at: at(t0, h) }),
        Standing::Closed(h) => Some(Meet::Closed { at: at(t0, h) }),
    }
}

fn coord(state: CoordState) -> Coord {
    match state {
        CoordState::Init => Coord::Init,
        CoordState::Prestart => Coord::Prestart,
        CoordState::Main | CoordState::Poststart | CoordState::WaitAlloc => Coord::Open,
        CoordState::Poststop => Coord::Poststop,
    }
}

/// The allocation's order as the model names it (`None`: one the model
/// never gives).
fn order(a: &Allocation) -> Option<Order> {
    match a.order() {
        Desired::Run => Some(Order::Run),
        Desired::Stop(reason) => match reason.kind {
            StopKind::SiblingTaskFailed => Some(Order::SiblingFailed),
            StopKind::MainTasksDead => Some(Order::MainDead),
            StopKind::BarrierTimeout => Some(Order::BarrierTimeout),
            _ => None,
        },
    }
}

/// The model's allocations, barriers and `blocked_by` reasons are the
/// registry's.
fn compare(model: &Model, r: &Registry, t0: Timestamp) -> Result<(), TestCaseError> {
    let ids: Vec<usize> = (0..IDS)
        .filter(|&n| r.get(alloc_id(n).as_str()).is_ok())
        .collect();
    let expected: Vec<usize> = model.allocs.keys().copied().collect();
    prop_assert_eq!(ids, expected, "the allocations");
    for (&id, m) in &model.allocs {
        let a = r.get(alloc_id(id).as_str()).unwrap();
        prop_assert_eq!(coord(a.state), m.coord, "the coordinator of a{}", id);
        prop_assert_eq!(
            order(&a),
            Some(m.order),
            "the order of a{}: {:?}",
            id,
            a.order()
        );
        if let Desired::Stop(reason) = a.order()
            && reason.kind == StopKind::BarrierTimeout
        {
            prop_assert_eq!(reason.barrier.clone(), Some(barrier_name(m.barrier)));
        }
        for (i, t) in m.tasks.iter().enumerate() {
            let s = &a.tasks[i];
            let what = format!("task {i} of a{id}");
            prop_assert_eq!(s.state, t.state, "the state of {}", what);
            prop_assert_eq!(s.stale, t.stale, "whether {} was told to restart", what);
            prop_assert_eq!(s.lost(), t.lost, "whether {} is lost", what);
            prop_assert_eq!(a.allowed(i), m.allowed(i), "whether {} is allowed", what);
            if i == 0 {
                continue;
            }
            prop_assert_eq!(s.meet(), meet(t0, t.standing), "where {} stands", what);
            let size = model.terms(m.barrier).unwrap().0;
            let waits = match (t.standing, model.phases[m.barrier]) {
                (Standing::Arrived(_), Some(Phase::Gathering)) => Some(Gathering::Gathering {
                    arrived: model.arrived(m.barrier).0,
                    size,
                }),
                (Standing::Closed(_), _) => Some(Gathering::TimedOut { size }),
                _ => None,
            };
            prop_assert_eq!(
                r.waiting_at_barrier(&a, i),
                waits.map(|g| (barrier_name(m.barrier), g)),
                "why {} waits at its barrier",
                what
            );
        }
    }
    for b in 0..BARRIERS {
        let name = barrier_name(b);
        let seen = r.barrier(name.as_str());
        prop_assert_eq!(
            seen.is_some(),
            model.phases[b].is_some(),
            "whether {} exists",
            name
        );
        let Some(seen) = seen else { continue };
        let (size, timeout) = model.terms(b).unwrap();
        prop_assert_eq!(
            (seen.size, seen.timeout),
            (size, timeout.map(Duration::from_secs)),
            "the terms of {}",
            name
        );
        let members: Vec<(AllocId, usize, Option<Meet>)> = model
            .members(b)
            .into_iter()
            .map(|m| (alloc_id(m.1), m.2, meet(t0, model.standing(m))))
            .collect();
        prop_assert_eq!(&seen.members, &members, "the members of {}", name);
        let (arrived, first) = model.arrived(b);
        let phase = match model.phases[b].unwrap() {
            Phase::Gathering => BarrierPhase::Gathering {
                arrived,
                first: first.map(|h| at(t0, h)),
            },
            Phase::Open(h) => BarrierPhase::Open(at(t0, h)),
            Phase::TimedOut(h) => BarrierPhase::TimedOut(at(t0, h)),
        };
        prop_assert_eq!(seen.phase, phase, "the phase of {}", name);
    }
    Ok(())
}

// ------------------------------------------------- the registry's invariants

/// Every committed change replayed, in order, on the records as they were
/// (the model plays no part).
#[derive(Default)]
struct Replay {
    records: BTreeMap<AllocId, Arc<Allocation>>,
    /// Each barrier's decision, once written (to its anchor), while it has
    /// members.
    decided: BTreeMap<SemName, Meet>,
}

/// A member as the records give it: its key, terms and standing.
type Seen = ((u64, AllocId, usize), BarrierSpec, Option<Meet>);

impl Replay {
    /// Barrier `name`'s members, in registration order.
    fn members(&self, name: &SemName) -> Vec<Seen> {
        let mut out: Vec<Seen> = self
            .records
            .values()
            .flat_map(|a| {
                a.spec.tasks().iter().enumerate().filter_map(|(i, t)| {
                    let b = t.barrier.as_ref().filter(|b| b.name == *name)?;
                    Some((
                        (a.create_index, a.id.clone(), i),
                        b.clone(),
                        a.tasks[i].meet(),
                    ))
                })
            })
            .collect();
        out.sort_by(|x, y| x.0.cmp(&y.0));
        out
    }

    fn check(&mut self, change: Committed) -> Result<(), TestCaseError> {
        let next = match change {
            Committed::Delete(id) => {
                if let Some(prev) = self.records.remove(&id) {
                    for b in prev.spec.tasks().iter().filter_map(|t| t.barrier.as_ref()) {
                        if self.members(&b.name).is_empty() {
                            self.decided.remove(&b.name);
                        }
                    }
                }
                return Ok(());
            }
            Committed::Put(next) => next,
        };
        let prev = self.records.get(&next.id).cloned();
        for (i, spec) in next.spec.tasks().iter().enumerate() {
            let Some(b) = &spec.barrier else { continue };
            let what = format!("{} of {} at {}", task_name(i), next.id, b.name);
            let before = prev.as_ref().and_then(|p| p.tasks[i].meet());
            let after = next.tasks[i].meet();
            if let Some(decided) = before.filter(|m| m.decided()) {
                prop_assert_eq!(after, Some(decided), "{} stays decided", what);
                continue;
            }
            let Some(decision) = after.filter(|m| m.decided()) else {
                continue;
            };
            if let Some(&first) = self.decided.get(&b.name) {
                prop_assert_eq!(
                    decision,
                    first,
                    "{} follows its barrier's decision (a barrier decides once)",
                    what
                );
            } else {
                // The decision itself: on the anchor, as the members stood.
                let members = self.members(&b.name);
                let (anchor, terms, _) = &members[0];
                prop_assert_eq!(
                    anchor,
                    &(next.create_index, next.id.clone(), i),
                    "{} decided first, not the anchor",
                    what
                );
                let arrived: Vec<Timestamp> = members
                    .iter()
                    .filter_map(|(_, _, m)| match m {
                        Some(Meet::Arrived { at }) => Some(*at),
                        _ => None,
                    })
                    .collect();
                match decision {
                    Meet::Passed { .. } => prop_assert_eq!(
                        arrived.len(),
                        usize::from(terms.size),
                        "{} opened with {} of {} arrived",
                        b.name,
                        arrived.len(),
                        terms.size
                    ),
                    Meet::Closed { at } => {
                        prop_assert!(arrived.len() < usize::from(terms.size));
                        let due = terms
                            .timeout
                            .zip(arrived.iter().min())
                            .map(|(t, first)| *first + t);
                        prop_assert!(
                            due.is_some_and(|due| due <= at),
                            "{} timed out at {} with its first arrival due at {:?}",
                            b.name,
                            at,
                            due
                        );
                    }
                    Meet::Arrived { .. } => unreachable!(),
                }
                self.decided.insert(b.name.clone(), decision);
            }
            if let Meet::Closed { .. } = decision {
                let was = prev.as_ref().map_or(&Desired::Run, |p| p.order());
                let order = if was.is_stop() {
                    was.clone()
                } else {
                    Desired::Stop(StopReason::barrier(b.name.clone()))
                };
                prop_assert_eq!(next.order(), &order, "the order of {} once closed", what);
            }
        }
        self.records.insert(next.id.clone(), next.clone());
        for (i, spec) in next.spec.tasks().iter().enumerate() {
            let Some(b) = &spec.barrier else { continue };
            prop_assert!(
                !next.allowed(i) || matches!(self.decided.get(&b.name), Some(Meet::Passed { .. })),
                "{} of {} allowed before {} opened",
                task_name(i),
                next.id,
                b.name
            );
            let members = self.members(&b.name);
            let arrived = members
                .iter()
                .filter(|(_, _, m)| matches!(m, Some(Meet::Arrived { .. })))
                .count();
            let size = usize::from(members[0].1.size);
            prop_assert!(
                members.len() <= size && arrived <= size,
                "{} has {} members, {} arrived, of size {}",
                b.name,
                members.len(),
                arrived,
                size
            );
        }
        Ok(())
    }
}

/// Once settled, each barrier as the registry shows it agrees with itself
/// and with its members' records, and a decided one stays decided while
/// it exists (`decided`: each barrier's decision seen so far).
fn settled(
    r: &Registry,
    now: Timestamp,
    decided: &mut [Option<BarrierPhase>; BARRIERS],
) -> Result<(), TestCaseError> {
    for (b, decided) in decided.iter_mut().enumerate() {
        let name = barrier_name(b);
        let Some(s) = r.barrier(name.as_str()) else {
            *decided = None;
            continue;
        };
        let size = usize::from(s.size);
        prop_assert!(s.members.len() <= size, "{} has too many members", name);
        let mut meets = BTreeSet::new();
        for (id, i, m) in &s.members {
            let a = r.get(id.as_str()).unwrap();
            prop_assert_eq!(
                a.tasks[*i].meet(),
                *m,
                "{}'s index and {}'s record",
                name,
                id
            );
            prop_assert!(
                !a.allowed(*i) || matches!(s.phase, BarrierPhase::Open(_)),
                "{} of {} allowed while {} is {:?}",
                task_name(*i),
                id,
                name,
                s.phase
            );
            meets.insert(format!("{m:?}"));
        }
        match s.phase {
            BarrierPhase::Gathering { arrived, first } => {
                prop_assert!(arrived < size, "{} gathers with {} arrived", name, arrived);
                if let (Some(t), Some(first)) = (s.timeout, first) {
                    prop_assert!(first + t > now, "{} gathers past its timeout", name);
                }
                prop_assert!(
                    decided.is_none(),
                    "{} gathers again after {:?}",
                    name,
                    decided
                );
            }
            BarrierPhase::Open(_) | BarrierPhase::TimedOut(_) => {
                prop_assert_eq!(meets.len(), 1, "{}'s members differ: {:?}", name, meets);
                prop_assert!(
                    decided.is_none_or(|d| d == s.phase),
                    "{} was {:?}, now {:?}",
                    name,
                    decided,
                    s.phase
                );
                *decided = Some(s.phase);
            }
        }
    }
    Ok(())
}

/// Lets `r` go on until it has nothing left to do or the store took all
/// it would, then drops it and waits until nothing of it is left (its
/// writes in flight ended); the store takes changes again.
async fn crashed(r: Registry, store: &Logged) -> Result<(), TestCaseError> {
    let spent = || *store.budget.lock().unwrap() == Some(0);
    for _ in 0..SETTLE_ROUNDS {
        if spent() || (r.timers_idle() && r.gates_idle_now()) {
            break;
        }
        tokio::task::yield_now().await;
    }
    let gone = Arc::downgrade(&r.inner);
    drop(r);
    for _ in 0..SETTLE_ROUNDS {
        if gone.strong_count() == 0 {
            *store.budget.lock().unwrap() = None;
            return Ok(());
        }
        tokio::task::yield_now().await;
    }
    Err(TestCaseError::fail("the crashed registry never ended"))
}

struct Run {
    store: Arc<Logged>,
    t0: Timestamp,
    replay: Replay,
    decided: [Option<BarrierPhase>; BARRIERS],
}

impl Run {
    /// Everything checked after a step, once the registry settled.
    async fn check(&mut self, r: &Registry, model: &Model) -> Result<(), TestCaseError> {
        settle(r).await?;
        for change in self.store.take() {
            self.replay.check(change)?;
        }
        settled(r, at(self.t0, model.now), &mut self.decided)?;
        compare(model, r, self.t0)
    }
}

fn run(start: [Terms; BARRIERS], ops: Vec<Op>) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async move {
        let store = Arc::new(Logged {
            store: MemoryStore::new(),
            log: Mutex::default(),
            budget: Mutex::default(),
        });
        // One clock across the registry's restarts: the records' times are
        // on it.
        let clock = Clock::tokio();
        let config = || RegistryConfig {
            clock: clock.clone(),
            ..RegistryConfig::default()
        };
        let mut r = Registry::open(store.clone(), config()).unwrap();
        let mut model = Model::new(start);
        let mut run = Run {
            store: store.clone(),
            t0: clock.now(),
            replay: Replay::default(),
            decided: [None; BARRIERS],
        };
        let mut crash = None;
        for op in ops {
            match op {
                Op::Pass { secs } => {
                    for _ in 0..2 * secs {
                        let crashing = crash.filter(|_| model.now % 2 == 1);
                        if let Some(after) = crashing {
                            crash = None;
                            *store.budget.lock().unwrap() = Some(after);
                        }
                        tokio::time::advance(HALF).await;
                        model.tick();
                        if crashing.is_some() {
                            crashed(r, &store).await?;
                            r = Registry::open(store.clone(), config()).unwrap();
                            model.reopened();
                        }
                        run.check(&r, &model).await?;
                    }
                    continue;
                }
                Op::Crash { after } => {
                    crash = Some(after);
                    continue;
                }
                _ => {}
            }
            let Some(action) = model.apply(&op) else {
                continue;
            };
            let crashing = match action {
                Action::Reopen => None,
                _ => crash.take(),
            };
            if let Some(after) = crashing {
                // The step's own write is the first this step admits.
                *store.budget.lock().unwrap() = Some(1 + after);
            }
            let answer = drive(&r, &action).await?;
            if let Action::Register { answer: a, .. } = action {
                prop_assert_eq!(answer, a, "the answer to {:?}", op);
            }
            if crashing.is_some() {
                crashed(r, &store).await?;
                r = Registry::open(store.clone(), config()).unwrap();
                model.reopened();
            } else if let Action::Reopen = action {
                drop(r);
                r = Registry::open(store.clone(), config()).unwrap();
            }
            run.check(&r, &model).await?;
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
    fn barriers_open_once_with_size_members_or_time_out_as_the_rules_say(
        start in prop::array::uniform2(terms()),
        ops in prop::collection::vec(op(), 1..200),
    ) {
        run(start, ops)?;
    }
}
