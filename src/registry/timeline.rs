//! Each allocation's timeline: the server's own decisions (registration,
//! coordinator transitions, task state changes, stop and restart orders,
//! restores) next to the agents' events, in index order, the last
//! `--timeline-events` of them.
//!
//! Entries are derived from two successive versions of the record, so
//! every store and every replica keeps the same timeline from the changes
//! it publishes, with no extra write. They are kept compactly (states as
//! bytes, task positions, an agent's event shared with the record, not
//! copied) and written out as JSON only when asked for. The timeline lives
//! in memory: a restarted server starts each allocation's timeline afresh.

use std::{collections::VecDeque, sync::Arc};

use crate::lifecycle::{
    Allocation, CoordState, Desired, EventBody, LOST_EVENT, Meet, RESTART_EVENT, RunState,
    StopKind, Timestamp,
};

/// What happened, compactly; tasks are positions in the allocation's spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum What {
    Registered,
    Coordinator {
        from: CoordState,
        to: CoordState,
    },
    TaskState {
        task: u16,
        state: RunState,
        failed: bool,
        ready: bool,
    },
    StopOrder {
        reason: StopKind,
        named: Option<u16>,
        /// For "Deadline Exceeded": the state whose deadline passed.
        stage: Option<CoordState>,
    },
    /// A task was declared lost; its "Agent Lost" event (the server's)
    /// carries the TTL and the last sign of life.
    Lost {
        task: u16,
        event: Arc<EventBody>,
    },
    /// A deadline passed: a stage's (`prestart`, `main`, `poststart`) or
    /// the poststop tasks'.
    DeadlineExceeded {
        stage: CoordState,
    },
    /// Whether dependency `dep` of `task` holds flipped.
    Dependency {
        task: u16,
        dep: u16,
        holds: bool,
    },
    /// Boxed: rare, and the largest; the entry of every other kind stays
    /// 32 bytes.
    RestartOrder(Box<RestartOrder>),
    Restored,
    /// A semaphore slot of `task` (`sem`: the position of the semaphore in
    /// its `acquire`) changed hands.
    Slot {
        task: u16,
        sem: u16,
        change: SlotChange,
    },
    /// The barrier of `task` opened (`opened`) or timed out for it.
    Barrier {
        task: u16,
        opened: bool,
    },
    /// An event the task's agent sent.
    Agent {
        task: u16,
        event: Arc<EventBody>,
    },
}

/// What happened to a task's slot of a semaphore.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotChange {
    /// Granted (the entry's index, the grant's change, is its fence).
    Acquired,
    /// Given back: why.
    Released(Release),
    /// Granted, not taken up within the grant timeout: back in the queue.
    GrantExpired,
}

/// Why a slot was given back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    Dead,
    Lost,
    /// Back to `pending` (a restart): the task queues again.
    Restarted,
    /// Told to stop, or a dependency stopped holding, before it started.
    NotAllowed,
}

impl Release {
    const ALL: [Self; 4] = [Self::Dead, Self::Lost, Self::Restarted, Self::NotAllowed];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Dead => "dead",
            Self::Lost => "lost",
            Self::Restarted => "restarted",
            Self::NotAllowed => "not_allowed",
        }
    }
}

/// Tasks told to restart, by position; the "Restart Signaled" event
/// carries the mode and the reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestartOrder {
    pub tasks: Box<[u16]>,
    pub event: Arc<EventBody>,
}

/// One entry: the index of the change that made it, and when (UTC
/// nanoseconds since 1970, clamped to what 64 bits hold: the years 1678
/// to 2262).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub index: u64,
    nanos: i64,
    pub what: What,
}

impl Entry {
    pub fn new(index: u64, time: Timestamp, what: What) -> Self {
        let nanos = time
            .unix_timestamp_nanos()
            .clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;
        Self { index, nanos, what }
    }

    pub fn time(&self) -> Timestamp {
        Timestamp::from_unix_timestamp_nanos(i128::from(self.nanos))
            .expect("64-bit nanoseconds are always a valid time")
    }
}

/// The bounded timeline of one allocation, packed.
///
/// At a million allocations with full histories the timelines were the
/// largest part of the server's memory (64 entries of 32 bytes each,
/// ~2 KiB per allocation), so each entry is kept as a few bytes: a header
/// byte (its kind, and whether its index and time differ from the entry
/// before), the differences themselves as variable-length integers, and
/// its fields; an event an entry names is a pointer in `bodies`, shared
/// with the record. An agent's event takes ~10 bytes, a task's state 3.
#[derive(Debug, Default)]
pub struct Timeline {
    /// The entries, oldest first, as `push_back` writes them.
    bytes: VecDeque<u8>,
    /// The event bodies the entries name, in the entries' order.
    bodies: VecDeque<Arc<EventBody>>,
    /// The oldest entry's index and time: the first entry's differences
    /// are from these.
    first: Base,
    /// The newest entry's, which the next entry is packed against.
    last: Base,
    len: u32,
}

/// An entry's index and time, which the next entry is packed against.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Base {
    index: u64,
    nanos: i64,
}

/// Kinds of entry, the low four bits of an entry's header byte.
const REGISTERED: u8 = 0;
const COORDINATOR: u8 = 1;
const TASK_STATE: u8 = 2;
const STOP_ORDER: u8 = 3;
const LOST: u8 = 4;
const DEADLINE: u8 = 5;
const DEPENDENCY: u8 = 6;
const RESTART_ORDER: u8 = 7;
const RESTORED: u8 = 8;
const AGENT: u8 = 9;
const SLOT: u8 = 10;
const BARRIER: u8 = 11;
/// Header bits: the entry's index, or its time, differs from the one
/// before (the difference follows).
const NEW_INDEX: u8 = 0x10;
const NEW_TIME: u8 = 0x20;

impl Timeline {
    /// Appends, dropping the oldest beyond `limit`. Grows its blocks by a
    /// quarter, not by doubling: a settled allocation's timeline takes
    /// little more than its entries.
    pub fn extend(&mut self, new: Vec<Entry>, limit: usize) {
        if limit == 0 {
            return;
        }
        for e in new {
            if self.len as usize >= limit {
                self.pop_front();
            }
            self.push_back(e);
        }
    }

    fn push_back(&mut self, e: Entry) {
        // At most: a header, two differences of ten bytes, and fields
        // (a task position takes up to three).
        let most = 21
            + match &e.what {
                What::RestartOrder(order) => 10 + 3 * order.tasks.len(),
                _ => 8,
            };
        grow(&mut self.bytes, most);
        let mut out = Packer(&mut self.bytes);
        let at = Base {
            index: e.index,
            nanos: e.nanos,
        };
        let before = if self.len == 0 { at } else { self.last };
        let mut head = match &e.what {
            What::Registered => REGISTERED,
            What::Coordinator { .. } => COORDINATOR,
            What::TaskState { .. } => TASK_STATE,
            What::StopOrder { .. } => STOP_ORDER,
            What::Lost { .. } => LOST,
            What::DeadlineExceeded { .. } => DEADLINE,
            What::Dependency { .. } => DEPENDENCY,
            What::RestartOrder(_) => RESTART_ORDER,
            What::Restored => RESTORED,
            What::Agent { .. } => AGENT,
            What::Slot { .. } => SLOT,
            What::Barrier { .. } => BARRIER,
        };
        if at.index != before.index {
            head |= NEW_INDEX;
        }
        if at.nanos != before.nanos {
            head |= NEW_TIME;
        }
        out.byte(head);
        if at.index != before.index {
            out.signed(at.index.wrapping_sub(before.index) as i64);
        }
        if at.nanos != before.nanos {
            out.signed(at.nanos.wrapping_sub(before.nanos));
        }
        let mut body = None;
        match e.what {
            What::Registered | What::Restored => {}
            What::Coordinator { from, to } => {
                out.byte(from as u8);
                out.byte(to as u8);
            }
            What::TaskState {
                task,
                state,
                failed,
                ready,
            } => {
                out.unsigned(task.into());
                out.byte(state as u8 | u8::from(failed) << 4 | u8::from(ready) << 5);
            }
            What::StopOrder {
                reason,
                named,
                stage,
            } => {
                out.byte(reason as u8);
                out.unsigned(named.map_or(0, |t| u64::from(t) + 1));
                out.byte(stage.map_or(0, |s| s as u8 + 1));
            }
            What::Lost { task, event } | What::Agent { task, event } => {
                out.unsigned(task.into());
                body = Some(event);
            }
            What::DeadlineExceeded { stage } => out.byte(stage as u8),
            What::Dependency { task, dep, holds } => {
                out.unsigned(task.into());
                out.unsigned(dep.into());
                out.byte(u8::from(holds));
            }
            What::Slot { task, sem, change } => {
                out.unsigned(task.into());
                out.unsigned(sem.into());
                out.byte(match change {
                    SlotChange::Acquired => 0,
                    SlotChange::Released(why) => 1 + why as u8,
                    SlotChange::GrantExpired => 0xff,
                });
            }
            What::Barrier { task, opened } => {
                out.unsigned(task.into());
                out.byte(u8::from(opened));
            }
            What::RestartOrder(order) => {
                let RestartOrder { tasks, event } = *order;
                out.unsigned(tasks.len() as u64);
                for t in tasks {
                    out.unsigned(t.into());
                }
                body = Some(event);
            }
        }
        if let Some(body) = body {
            grow(&mut self.bodies, 1);
            self.bodies.push_back(body);
        }
        if self.len == 0 {
            self.first = at;
        }
        self.last = at;
        self.len += 1;
    }

    /// Drops the oldest entry.
    fn pop_front(&mut self) {
        let mut cursor = Cursor {
            bytes: &self.bytes,
            at: 0,
            bodies: &self.bodies,
            body: 0,
            base: self.first,
        };
        let Some(dropped) = cursor.pass() else {
            return;
        };
        let (taken, bodies) = (cursor.at, cursor.body);
        self.bytes.drain(..taken);
        self.bodies.drain(..bodies);
        self.len -= 1;
        // The next entry's differences are from the one dropped, which
        // becomes the base.
        self.first = dropped;
    }

    /// The entries, oldest first.
    pub fn entries(&self) -> impl Iterator<Item = Entry> + '_ {
        Cursor {
            bytes: &self.bytes,
            at: 0,
            bodies: &self.bodies,
            body: 0,
            base: self.first,
        }
    }

    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The heap bytes it holds.
    pub fn heap_bytes(&self) -> usize {
        self.bytes.capacity() + self.bodies.capacity() * std::mem::size_of::<Arc<EventBody>>()
    }
}

/// Room for `more` in `q`, growing by at least a quarter.
fn grow<T>(q: &mut VecDeque<T>, more: usize) {
    let need = q.len() + more;
    if need > q.capacity() {
        let by = (need - q.len()).max(q.capacity() / 4);
        q.reserve_exact(by);
    }
}

/// Writes an entry's bytes.
struct Packer<'a>(&'a mut VecDeque<u8>);

impl Packer<'_> {
    fn byte(&mut self, b: u8) {
        self.0.push_back(b);
    }

    /// LEB128: seven bits a byte, low first.
    fn unsigned(&mut self, mut n: u64) {
        while n >= 0x80 {
            self.byte(n as u8 | 0x80);
            n >>= 7;
        }
        self.byte(n as u8);
    }

    /// Zigzag, then LEB128: small differences either way take a byte.
    fn signed(&mut self, n: i64) {
        self.unsigned(((n << 1) ^ (n >> 63)) as u64);
    }
}

/// Reads packed entries in order.
struct Cursor<'a> {
    bytes: &'a VecDeque<u8>,
    at: usize,
    bodies: &'a VecDeque<Arc<EventBody>>,
    body: usize,
    /// The entry before's index and time.
    base: Base,
}

impl Cursor<'_> {
    fn byte(&mut self) -> u8 {
        let b = self.bytes[self.at];
        self.at += 1;
        b
    }

    fn unsigned(&mut self) -> u64 {
        let (mut n, mut shift) = (0u64, 0);
        loop {
            let b = self.byte();
            n |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                return n;
            }
            shift += 7;
        }
    }

    fn signed(&mut self) -> i64 {
        let n = self.unsigned();
        (n >> 1) as i64 ^ -((n & 1) as i64)
    }

    fn task(&mut self) -> u16 {
        pos(self.unsigned() as usize)
    }

    fn body(&mut self) -> Arc<EventBody> {
        let b = self.bodies[self.body].clone();
        self.body += 1;
        b
    }
}

impl Cursor<'_> {
    /// Passes over the next entry (without copying its event's pointer,
    /// which would touch a count every allocation's entries share):
    /// returns its index and time.
    fn pass(&mut self) -> Option<Base> {
        if self.at >= self.bytes.len() {
            return None;
        }
        let head = self.head();
        match head & 0x0f {
            REGISTERED | RESTORED => {}
            COORDINATOR => self.at += 2,
            TASK_STATE => {
                self.unsigned();
                self.at += 1;
            }
            STOP_ORDER => {
                self.at += 1;
                self.unsigned();
                self.at += 1;
            }
            LOST | AGENT => {
                self.unsigned();
                self.body += 1;
            }
            DEADLINE => self.at += 1,
            BARRIER => {
                self.unsigned();
                self.at += 1;
            }
            DEPENDENCY | SLOT => {
                self.unsigned();
                self.unsigned();
                self.at += 1;
            }
            RESTART_ORDER => {
                for _ in 0..self.unsigned() {
                    self.unsigned();
                }
                self.body += 1;
            }
            other => unreachable!("a timeline entry of kind {other}: only `push_back` packs them"),
        }
        Some(self.base)
    }

    /// Reads an entry's header byte and its index and time.
    fn head(&mut self) -> u8 {
        let head = self.byte();
        if head & NEW_INDEX != 0 {
            self.base.index = self.base.index.wrapping_add(self.signed() as u64);
        }
        if head & NEW_TIME != 0 {
            self.base.nanos = self.base.nanos.wrapping_add(self.signed());
        }
        head
    }
}

/// `ALL[i]` of a named enum, as packed by `as u8`.
fn nth<T: Copy>(all: &[T], i: u8) -> T {
    all[usize::from(i)]
}

impl Iterator for Cursor<'_> {
    type Item = Entry;

    fn next(&mut self) -> Option<Entry> {
        if self.at >= self.bytes.len() {
            return None;
        }
        let head = self.head();
        let what = match head & 0x0f {
            REGISTERED => What::Registered,
            RESTORED => What::Restored,
            COORDINATOR => What::Coordinator {
                from: nth(CoordState::ALL, self.byte()),
                to: nth(CoordState::ALL, self.byte()),
            },
            TASK_STATE => {
                let task = self.task();
                let b = self.byte();
                What::TaskState {
                    task,
                    state: nth(RunState::ALL, b & 0x0f),
                    failed: b & 0x10 != 0,
                    ready: b & 0x20 != 0,
                }
            }
            STOP_ORDER => What::StopOrder {
                reason: nth(StopKind::ALL, self.byte()),
                named: self.unsigned().checked_sub(1).map(|t| pos(t as usize)),
                stage: self.byte().checked_sub(1).map(|s| nth(CoordState::ALL, s)),
            },
            LOST => What::Lost {
                task: self.task(),
                event: self.body(),
            },
            AGENT => What::Agent {
                task: self.task(),
                event: self.body(),
            },
            DEADLINE => What::DeadlineExceeded {
                stage: nth(CoordState::ALL, self.byte()),
            },
            DEPENDENCY => What::Dependency {
                task: self.task(),
                dep: self.task(),
                holds: self.byte() != 0,
            },
            SLOT => {
                let (task, sem) = (self.task(), self.task());
                let change = match self.byte() {
                    0 => SlotChange::Acquired,
                    0xff => SlotChange::GrantExpired,
                    why => SlotChange::Released(nth(&Release::ALL, why - 1)),
                };
                What::Slot { task, sem, change }
            }
            BARRIER => What::Barrier {
                task: self.task(),
                opened: self.byte() != 0,
            },
            RESTART_ORDER => {
                let n = self.unsigned() as usize;
                let tasks = (0..n).map(|_| self.task()).collect();
                What::RestartOrder(Box::new(RestartOrder {
                    tasks,
                    event: self.body(),
                }))
            }
            other => unreachable!("a timeline entry of kind {other}: only `push_back` packs them"),
        };
        Some(Entry {
            index: self.base.index,
            nanos: self.base.nanos,
            what,
        })
    }
}

/// The slot entries of task `i` between two versions (`p`, `n`): one per
/// semaphore it acquires.
fn slots(
    a: &Allocation,
    i: usize,
    p: &crate::lifecycle::TaskStatus,
    n: &crate::lifecycle::TaskStatus,
    out: &mut dyn FnMut(What),
) {
    let (was, is) = (p.fence(), n.fence());
    let change = match (was, is) {
        (_, Some(_)) if was != is => SlotChange::Acquired,
        (Some(_), None) => {
            let requeued = matches!(n.hold(), Some(crate::lifecycle::Hold::Queued { .. }));
            if n.lost() {
                SlotChange::Released(Release::Lost)
            } else if n.state == RunState::Dead {
                SlotChange::Released(Release::Dead)
            } else if p.state != RunState::Pending && n.state == RunState::Pending {
                SlotChange::Released(Release::Restarted)
            } else if requeued {
                SlotChange::GrantExpired
            } else {
                SlotChange::Released(Release::NotAllowed)
            }
        }
        _ => return,
    };
    for sem in 0..a.spec.tasks()[i].acquire.len() {
        out(What::Slot {
            task: pos(i),
            sem: pos(sem),
            change,
        });
    }
}

fn pos(i: usize) -> u16 {
    u16::try_from(i).unwrap_or(u16::MAX)
}

/// The entries one published change makes: `prev` is the version before
/// (`None` for a registration), `next` the one published.
pub fn entries(prev: Option<&Allocation>, next: &Allocation) -> Vec<Entry> {
    let mut out = Vec::new();
    let at = |what| Entry::new(next.modify_index, next.modified_at, what);
    let Some(prev) = prev else {
        out.push(Entry::new(
            next.create_index,
            next.created_at,
            What::Registered,
        ));
        if next.state != CoordState::Init {
            out.push(at(What::Coordinator {
                from: CoordState::Init,
                to: next.state,
            }));
        }
        return out;
    };
    // Restart orders: the tasks whose generation went up.
    let mut restarted: Vec<u16> = Vec::new();
    let mut signal: Option<Arc<EventBody>> = None;
    for (i, (p, n)) in prev.tasks.iter().zip(&next.tasks).enumerate() {
        if n.restart_generation > p.restart_generation {
            restarted.push(pos(i));
            if signal.is_none() {
                signal = n.events.last_of(RESTART_EVENT).map(|e| e.body().clone());
            }
        }
    }
    // Only a restore moves the coordinator back without a restart order
    // (a restore that leaves it where it was reads as the reports it is).
    let restored = next.state < prev.state && restarted.is_empty();
    if restored {
        out.push(at(What::Restored));
    }
    if let Some(event) = signal {
        out.push(at(What::RestartOrder(Box::new(RestartOrder {
            tasks: restarted.into_boxed_slice(),
            event,
        }))));
    }
    // A deadline that passed comes before what it causes.
    let (was, is) = (prev.overdue(), next.overdue());
    let stage =
        |o: Option<&crate::lifecycle::Overdue>| o.and_then(|o| o.stage.as_ref().map(|s| s.0));
    let told = |o: Option<&crate::lifecycle::Overdue>| o.is_some_and(|o| o.poststop.is_some());
    if stage(is).is_some() && stage(is) != stage(was) {
        out.push(at(What::DeadlineExceeded {
            stage: stage(is).expect("checked"),
        }));
    }
    if told(is) && !told(was) {
        out.push(at(What::DeadlineExceeded {
            stage: CoordState::Poststop,
        }));
    }
    for (i, (p, n)) in prev.tasks.iter().zip(&next.tasks).enumerate() {
        let lost_now = n.lost() && !p.lost();
        // The agent's events first: they say why the state changed.
        for event in n.events.added_since(&p.events) {
            if lost_now && event.kind == LOST_EVENT {
                out.push(at(What::Lost {
                    task: pos(i),
                    event: event.body().clone(),
                }));
            } else if event.kind != RESTART_EVENT {
                out.push(Entry::new(
                    next.modify_index,
                    event.time(),
                    What::Agent {
                        task: pos(i),
                        event: event.body().clone(),
                    },
                ));
            }
        }
        slots(next, i, p, n, &mut |what| out.push(at(what)));
        if p.meet() != n.meet()
            && let Some(m @ (Meet::Passed { .. } | Meet::Closed { .. })) = n.meet()
        {
            out.push(at(What::Barrier {
                task: pos(i),
                opened: matches!(m, Meet::Passed { .. }),
            }));
        }
        for (j, now) in n.deps().iter().enumerate() {
            let before = p.deps().get(j).is_some_and(|d| d.holds());
            if now.holds() != before || (j >= p.deps().len() && now.holds()) {
                out.push(at(What::Dependency {
                    task: pos(i),
                    dep: pos(j),
                    holds: now.holds(),
                }));
            }
        }
        if (p.state, p.failed, p.ready) != (n.state, n.failed, n.ready) {
            out.push(at(What::TaskState {
                task: pos(i),
                state: n.state,
                failed: n.failed,
                ready: n.ready,
            }));
        }
    }
    if prev.order() != next.order()
        && let Desired::Stop(reason) = next.order()
    {
        out.push(at(What::StopOrder {
            reason: reason.kind,
            // "Barrier Timeout" names the member whose barrier it was.
            named: match &reason.barrier {
                Some(b) => next
                    .spec
                    .tasks()
                    .iter()
                    .position(|t| t.barrier.as_ref().is_some_and(|t| t.name == *b)),
                None => reason.task.as_ref().and_then(|t| next.position(t.as_str())),
            }
            .map(pos),
            stage: reason.stage,
        }));
    }
    if prev.state != next.state {
        out.push(at(What::Coordinator {
            from: prev.state,
            to: next.state,
        }));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifecycle::{
        AllocId, AllocSpec, Hook, Lifecycle, Limits, RestartMode, TaskName, TaskReport, TaskSpec,
    };
    use time::macros::datetime;

    const T: Timestamp = datetime!(2026-11-24 10:00 UTC);

    fn report(state: RunState, failed: bool) -> TaskReport {
        TaskReport {
            state,
            failed,
            ready: None,
            event: None,
        }
    }

    fn five() -> Allocation {
        let task = |name: &str, hook: Option<(Hook, bool)>, leader| TaskSpec {
            name: TaskName::parse(name).unwrap(),
            lifecycle: hook.map(|(hook, sidecar)| Lifecycle { hook, sidecar }),
            leader,
            readiness: false,
            liveness: None,
            depends_on: Vec::new(),
            acquire: Vec::new(),
            barrier: None,
        };
        let tasks = vec![
            task("init", Some((Hook::Prestart, false)), false),
            task("proxy", Some((Hook::Prestart, true)), false),
            task("web", None, true),
            task("announce", Some((Hook::Poststart, false)), false),
            task("cleanup", Some((Hook::Poststop, false)), false),
        ];
        let spec = AllocSpec::new(tasks, &Limits::default()).unwrap();
        Allocation::register(AllocId::parse("a1").unwrap(), Arc::new(spec), 1, T)
    }

    fn kinds(entries: &[Entry]) -> Vec<String> {
        entries
            .iter()
            .map(|e| match &e.what {
                What::Registered => "Registered".to_owned(),
                What::Coordinator { from, to } => format!("Coordinator {from}->{to}"),
                What::TaskState { task, state, .. } => format!("Task State {task} {state}"),
                What::StopOrder { reason, named, .. } => format!("Stop Order {reason} {named:?}"),
                What::RestartOrder(r) => format!("Restart Order {:?}", r.tasks),
                What::Restored => "Restored".to_owned(),
                What::Agent { task, event } => format!("Agent {task} {}", event.kind),
                What::Lost { task, .. } => format!("Agent Lost {task}"),
                What::DeadlineExceeded { stage } => format!("Deadline Exceeded {stage}"),
                What::Dependency { task, dep, holds } => format!("Dependency {task} {dep} {holds}"),
                What::Slot { task, sem, change } => format!("Slot {task} {sem} {change:?}"),
                What::Barrier { task, opened } => format!("Barrier {task} {opened}"),
            })
            .collect()
    }

    #[test]
    fn each_change_says_what_the_server_decided() {
        let a = five();
        assert_eq!(
            kinds(&entries(None, &a)),
            ["Registered", "Coordinator init->prestart"]
        );
        let mut r = report(RunState::Dead, true);
        r.event = Some(crate::lifecycle::EventInput {
            kind: "Terminated".into(),
            time: None,
            message: "Exit Code: 1".into(),
            details: Default::default(),
        });
        let b = a.report(&[(0, r)], T, || 2).unwrap();
        assert_eq!(
            kinds(&entries(Some(&a), &b)),
            [
                "Agent 0 Terminated",
                "Task State 0 dead",
                "Stop Order Sibling Task Failed Some(0)"
            ]
        );
        let (c, _) = b.restart(RestartMode::AllTasks, "again", T, || 3).unwrap();
        let c = c.unwrap();
        assert_eq!(
            kinds(&entries(Some(&b), &c)),
            ["Restart Order [0]", "Coordinator prestart->init"]
        );
        let d = c
            .report(&[(0, report(RunState::Pending, false))], T, || 4)
            .unwrap();
        assert_eq!(
            kinds(&entries(Some(&c), &d)),
            ["Task State 0 pending", "Coordinator init->prestart"]
        );
        let e = d
            .report(
                &[
                    (0, report(RunState::Dead, false)),
                    (1, report(RunState::Running, false)),
                    (2, report(RunState::Running, false)),
                ],
                T,
                || 5,
            )
            .unwrap();
        assert_eq!(e.state, CoordState::Poststart);
        // A restore that moves the coordinator back says so.
        let f = e
            .restore(&[(2, report(RunState::Pending, false))], T, || 6)
            .unwrap();
        assert_eq!(
            kinds(&entries(Some(&e), &f)),
            [
                "Restored",
                "Task State 2 pending",
                "Coordinator poststart->main"
            ]
        );
    }

    #[test]
    fn an_entry_is_32_bytes_and_keeps_its_time() {
        assert_eq!(std::mem::size_of::<Entry>(), 32);
        let t = datetime!(2026-11-24 10:00:00.123456789 +05:30);
        assert_eq!(Entry::new(1, t, What::Registered).time(), t);
        let far = datetime!(9999-12-31 23:59:59 UTC);
        assert!(
            Entry::new(1, far, What::Registered).time().year() == 2262,
            "clamped"
        );
    }

    /// A five-task allocation run from registration to its end as the
    /// agents report it (each start and end with its event): its timeline
    /// fits in 1 KiB.
    #[test]
    fn a_settled_five_task_allocation_s_timeline_takes_at_most_1_kib() {
        let mut a = five();
        let mut timeline = Timeline::default();
        timeline.extend(entries(None, &a), 64);
        let with = |state, kind: &str| {
            let mut r = report(state, false);
            r.event = Some(crate::lifecycle::EventInput {
                kind: kind.into(),
                time: None,
                message: String::new(),
                details: Default::default(),
            });
            r
        };
        // (task, state, event) in the order agents report them.
        let steps = [
            (0, RunState::Running, "Started"),
            (1, RunState::Running, "Started"),
            (0, RunState::Dead, "Terminated"),
            (2, RunState::Running, "Started"),
            (3, RunState::Running, "Started"),
            (3, RunState::Dead, "Terminated"),
            (2, RunState::Dead, "Terminated"),
            (1, RunState::Dead, "Killed"),
            (4, RunState::Running, "Started"),
            (4, RunState::Dead, "Terminated"),
        ];
        for (index, (task, state, kind)) in (2..).zip(steps) {
            let next = a.report(&[(task, with(state, kind))], T, || index).unwrap();
            timeline.extend(entries(Some(&a), &next), 64);
            a = next;
        }
        assert_eq!(a.state, CoordState::Poststop);
        let bytes = timeline.heap_bytes();
        assert!(bytes <= 1024, "{} entries in {bytes} bytes", timeline.len());
    }

    /// What a million allocations with full histories hold: 64 entries,
    /// half of them agents' events, in ~1/3 of what 32-byte entries took.
    #[test]
    fn a_full_timeline_of_agent_events_and_states_packs_into_a_third() {
        let body = crate::lifecycle::EventBody::new("Started", "", Default::default());
        let mut t = Timeline::default();
        let mut index = 1_000_000;
        let mut time = T;
        for _ in 0..100 {
            index += 64;
            time += time::Duration::milliseconds(1500);
            let mut change = Vec::new();
            for task in 0..5 {
                let what = What::Agent {
                    task,
                    event: body.clone(),
                };
                change.push(Entry::new(index, time, what));
            }
            for task in 0..5 {
                let what = What::TaskState {
                    task,
                    state: RunState::Running,
                    failed: false,
                    ready: false,
                };
                change.push(Entry::new(index, time, what));
            }
            t.extend(change, 64);
        }
        assert_eq!(t.len(), 64);
        let bytes = t.heap_bytes();
        assert!(
            bytes <= 64 * std::mem::size_of::<Entry>() / 3,
            "64 entries in {bytes} bytes"
        );
    }

    fn any_entry() -> impl proptest::strategy::Strategy<Value = Entry> {
        use proptest::prelude::*;
        let body = || {
            prop_oneof![
                Just("Started".to_owned()),
                Just("Terminated".to_owned()),
                "[a-z]{1,8}"
            ]
            .prop_map(|k: String| crate::lifecycle::EventBody::new(&k, "m", Default::default()))
        };
        let task = prop_oneof![0u16..8, Just(u16::MAX), any::<u16>()];
        let coord = proptest::sample::select(CoordState::ALL);
        let what = prop_oneof![
            Just(What::Registered),
            Just(What::Restored),
            (coord.clone(), coord.clone()).prop_map(|(from, to)| What::Coordinator { from, to }),
            (
                task.clone(),
                proptest::sample::select(RunState::ALL),
                any::<bool>(),
                any::<bool>()
            )
                .prop_map(|(task, state, failed, ready)| What::TaskState {
                    task,
                    state,
                    failed,
                    ready
                }),
            (
                proptest::sample::select(StopKind::ALL),
                proptest::option::of(task.clone()),
                proptest::option::of(coord.clone())
            )
                .prop_map(|(reason, named, stage)| What::StopOrder {
                    reason,
                    named,
                    stage
                }),
            (task.clone(), body()).prop_map(|(task, event)| What::Lost { task, event }),
            (task.clone(), body()).prop_map(|(task, event)| What::Agent { task, event }),
            coord.prop_map(|stage| What::DeadlineExceeded { stage }),
            (task.clone(), task.clone(), any::<bool>())
                .prop_map(|(task, dep, holds)| What::Dependency { task, dep, holds }),
            (task.clone(), task.clone(), 0u8..6).prop_map(|(task, sem, c)| {
                let change = match c {
                    0 => SlotChange::Acquired,
                    5 => SlotChange::GrantExpired,
                    why => SlotChange::Released(Release::ALL[usize::from(why) - 1]),
                };
                What::Slot { task, sem, change }
            }),
            (task.clone(), any::<bool>()).prop_map(|(task, opened)| What::Barrier { task, opened }),
            (proptest::collection::vec(task, 0..40), body()).prop_map(|(tasks, event)| {
                What::RestartOrder(Box::new(RestartOrder {
                    tasks: tasks.into_boxed_slice(),
                    event,
                }))
            }),
        ];
        // Indexes and times anywhere, and often the same as the entry
        // before (entries of one change).
        let index = prop_oneof![Just(7u64), any::<u64>()];
        let nanos = prop_oneof![Just(0i64), any::<i64>(), -1_000_000i64..1_000_000];
        (index, nanos, what).prop_map(|(index, nanos, what)| Entry { index, nanos, what })
    }

    proptest::proptest! {
        /// Whatever entries come, in whatever batches, the timeline gives
        /// back exactly the last `limit` of them, oldest first.
        #[test]
        fn packed_entries_come_back_exactly(
            batches in proptest::collection::vec(proptest::collection::vec(any_entry(), 0..12), 0..20),
            limit in 1usize..40,
        ) {
            let mut t = Timeline::default();
            let mut all = Vec::new();
            for batch in batches {
                all.extend(batch.iter().cloned());
                t.extend(batch, limit);
                let kept: Vec<Entry> = t.entries().collect();
                let want = &all[all.len().saturating_sub(limit)..];
                proptest::prop_assert_eq!(&kept[..], want);
                proptest::prop_assert_eq!(t.len(), want.len());
            }
        }
    }

    /// Indexes and times at and across both ends of their ranges, task
    /// positions up to `u16::MAX`, a restart order naming every position:
    /// each limit, in batches of each size, keeps exactly the last ones.
    #[test]
    fn entries_at_the_ends_of_their_ranges_come_back_exactly() {
        let body = EventBody::new("Restart Signaled", "", Default::default());
        let order = What::RestartOrder(Box::new(RestartOrder {
            tasks: (0..=u16::MAX).rev().collect(),
            event: body.clone(),
        }));
        let ends = [
            (0u64, 0i64),
            (u64::MAX, i64::MIN),
            (0, i64::MAX),
            (u64::MAX, i64::MIN),
            (u64::MAX, i64::MIN),
            (1, -1),
            (u64::MAX - 1, i64::MAX),
            (u64::MAX, i64::MIN + 1),
            (0, 0),
        ];
        let all: Vec<Entry> = ends
            .into_iter()
            .enumerate()
            .map(|(i, (index, nanos))| {
                let what = match i % 3 {
                    0 => order.clone(),
                    1 => What::Agent {
                        task: u16::MAX,
                        event: body.clone(),
                    },
                    _ => What::StopOrder {
                        reason: StopKind::AgentLost,
                        named: Some(u16::MAX),
                        stage: Some(CoordState::Poststop),
                    },
                };
                Entry { index, nanos, what }
            })
            .collect();
        for limit in 1..=all.len() + 1 {
            for size in 1..=3 {
                let mut t = Timeline::default();
                for (n, batch) in all.chunks(size).enumerate() {
                    t.extend(batch.to_vec(), limit);
                    let pushed = (n * size + batch.len()).min(all.len());
                    let want = &all[pushed.saturating_sub(limit)..pushed];
                    let kept: Vec<Entry> = t.entries().collect();
                    assert_eq!(&kept[..], want, "limit {limit}, batches of {size}");
                }
            }
        }
    }

    #[test]
    fn the_timeline_keeps_the_last_entries() {
        let mut t = Timeline::default();
        let e = |index| Entry::new(index, T, What::Registered);
        t.extend((1..=5).map(e).collect(), 3);
        let kept: Vec<u64> = t.entries().map(|e| e.index).collect();
        assert_eq!(kept, [3, 4, 5]);
        t.extend(vec![e(6)], 0);
        assert_eq!(t.len(), 3, "a limit of 0 keeps nothing new");
    }
}
