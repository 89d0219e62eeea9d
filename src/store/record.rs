//! The stored form of allocation and semaphore records, versioned on their own so the
//! files outlive changes to the in-memory types. The snapshot
//! (`disk/snapshot.rs`) and the log (`disk/log.rs`) carry these bytes as they are.
//!
//! This build writes and reads version 5, a compact binary encoding
//! (integers are unsigned LEB128 varints, each in its shortest form,
//! unless marked `zigzag`, signed; `str` is a varint length and UTF-8
//! bytes):
//!
//! ```text
//! record = 0x05 | id: str | state: u8 | create_index | modify_index
//!        | created_at: time | modified_at: time | order | ext | tasks: varint | task*
//! order  = 0 (run)
//!        | reason: u8 (1 Leader Task Dead, 2 Sibling Task Failed, 3 Main Tasks Dead)
//!          | named task: varint (0 none, else position + 1)
//!        | 4 (Deadline Exceeded) | stage: u8 (a coordinator state)
//!        | 5 (Stopped By Operator)
//! task   = name: str | kind: u8 | state: u8 | flags: u8 | restarts
//!        | restart_generation | modify_index
//!        | [started_at: time] | [finished_at: time] | [last_restart: time]
//!        | [ready_at: time] | events: varint | event* | ext
//! kind   = hook (0 none: a main task, 1 prestart, 2 poststart, 3 poststop)
//!        | 0x10 sidecar | 0x20 leader | 0x40 readiness
//! flags  = 0x01 failed | 0x02 started_at | 0x04 finished_at | 0x08 last_restart
//!        | 0x10 ready | 0x20 ready_at | 0x40 stale | 0x80 reopened
//! event  = 0 | type: str | message: str | details: varint | (key: str | value: str)*
//!            | time                           (a body not written before)
//!        | number: varint | time              (1 ≤ number ≤ bodies written so far)
//! time   = unix seconds: zigzag | nanoseconds | UTC offset seconds: zigzag
//! ext    = count: varint | (tag: u8 | len: varint | payload: len bytes)*
//!          tags strictly increasing; each payload is read whole
//! allocation tags: 1 deadlines     = set: u8 (0x1 prestart, 0x2 main,
//!                                    0x4 poststart, 0x8 poststop)
//!                                    | milliseconds: varint per set bit
//!                  2 deadline_at   = time
//!                  3 stage overdue = state: u8 | count | position*
//!                  4 poststop told = count | position*
//!                  5 writes        = count | (id: u64 LE | parent: varint)*
//!                                    (at most 8, oldest first; replicas)
//!                  6 stage clocks  = set: u8 (bits as deadlines)
//!                                    | time per set bit (the deadline each
//!                                    stage got when first entered)
//! task tags:       1 liveness ttl  = milliseconds: varint
//!                  2 lost_at       = time
//!                  3 keys          = count | (key: u64 LE | request: u64 LE)*
//!                  4 depends_on    = count | (allocation: str (empty: this
//!                                    one) | task: str | condition: u8)*
//!                  5 verdicts      = count | verdict*, one per dependency
//!                  6 run           = the current run: varint
//!                  7 acquire       = count | semaphore: str*
//!                  8 hold          = 0 (queued) | since: varint | at: time
//!                                  | 1 (granted) | fence: varint | at: time
//!                  9 barrier       = name: str | size: varint
//!                                    | timeout milliseconds: varint (0: none)
//!                 10 meet          = 0 (arrived) | 1 (passed) | 2 (closed)
//!                                    | at: time
//! verdict = 0 (holds) | why: u8 (1 not_registered, 2 pending, 3 running,
//!           4 dead, 5 failed, 6 not_ready) | 7 (cycle) | count | str*
//!           | 8 (no_such_task)
//! condition = 0 running | 1 ready | 2 succeeded | 3 dead
//! ```
//!
//! Every change writes its whole record, every event of every history,
//! and agents send the same few event bodies to every task of an
//! allocation and again on each restart: so each body is written once
//! per record. The bodies are numbered from 1 in the order the record
//! writes them, and an event whose body was written before in the same
//! record (in any task) is that number (`lifecycle/history.rs`, which
//! keeps a record's histories as stored until they are asked for). A
//! record that uses no extension (most) has one zero per `ext`.
//!
//! States are stored as their position in the tables below (`COORD`,
//! `RUN`, `HOOK`), which are part of the format: never reorder them.
//! Details keys are strictly increasing. Anything else — an unknown code,
//! flag or tag, a length past the end, bytes left over — is damage. A
//! record whose first byte is another version is refused, naming it.
//!
//! A semaphore's record (`encode_semaphore`) is versioned on its own.
//! Its first byte, `SEMAPHORE_VERSION` (0x81: semaphore format 1, the
//! high bit set), is no allocation record's version, so a build that
//! takes it for an allocation's refuses it instead of misreading it. The
//! stores keep it under a key no allocation ID can be (the disk store's
//! `~s/<name>`, the etcd store's `<prefix>sem/<name>`):
//!
//! ```text
//! semaphore = 0x81 | name: str | limit: varint | grant_timeout: nanoseconds
//!           | create_index | modify_index | ext (as above; no tag is defined
//!             yet, so any is damage)
//! ```
//!
//! `limit` and `grant_timeout` must lie in `LIMIT_RANGE` and
//! `GRANT_TIMEOUT_RANGE`, the name be a valid one and `create_index` not
//! above `modify_index`: a record that breaks any of that is damage too.

use std::{sync::Arc, time::Duration};

use crate::{
    lifecycle::{
        AllocId, AllocSpec, Allocation, BarrierSpec, Condition, CoordState, Deadlines, DepState,
        Dependency, Desired, HistoriesReader, HistoriesWriter, Hold, Hook, IdemKey, Lifecycle,
        Limits, Meet, Overdue, RunState, SIZE_RANGE, SemName, StopKind, StopReason, TaskExtra,
        TaskName, TaskSpec, TaskStatus, Timestamp, WRITE_MARKS, Why, WriteMark,
    },
    wire::{Reader, put_str, put_time, put_varint},
};

/// The record format this build writes and reads.
pub const RECORD_VERSION: u8 = 5;

const COORD: [CoordState; 6] = [
    CoordState::Init,
    CoordState::Prestart,
    CoordState::Main,
    CoordState::Poststart,
    CoordState::WaitAlloc,
    CoordState::Poststop,
];
const RUN: [RunState; 3] = [RunState::Pending, RunState::Running, RunState::Dead];
/// Codes 1, 2, 3 (0 is a main task, with no lifecycle).
const HOOK: [Hook; 3] = [Hook::Prestart, Hook::Poststart, Hook::Poststop];

/// Codes 1, 2, 3 of a stop order (0 is run); 4 is a deadline.
const STOP: [StopKind; 3] = [
    StopKind::LeaderTaskDead,
    StopKind::SiblingTaskFailed,
    StopKind::MainTasksDead,
];
const STOP_DEADLINE: u8 = 4;
const STOP_OPERATOR: u8 = 5;
/// "Barrier Timeout": the position (from 1) of the task whose barrier
/// timed out follows (the barrier's name is its spec's).
const STOP_BARRIER: u8 = 6;

const EXT_DEADLINES: u8 = 1;
const EXT_DEADLINE_AT: u8 = 2;
const EXT_STAGE_OVERDUE: u8 = 3;
const EXT_POSTSTOP_TOLD: u8 = 4;
const EXT_WRITES: u8 = 5;
const EXT_STAGE_CLOCKS: u8 = 6;
const EXT_TTL: u8 = 1;
const EXT_LOST_AT: u8 = 2;
const EXT_KEYS: u8 = 3;
const EXT_DEPENDS_ON: u8 = 4;
const EXT_VERDICTS: u8 = 5;
const EXT_RUN: u8 = 6;
const EXT_ACQUIRE: u8 = 7;
const EXT_HOLD: u8 = 8;
const EXT_BARRIER: u8 = 9;
const EXT_MEET: u8 = 10;

/// Codes of a dependency's condition.
const CONDITION: [Condition; 4] = [
    Condition::Running,
    Condition::Ready,
    Condition::Succeeded,
    Condition::Dead,
];
/// Codes 1 to 6 of a blocked verdict (0 holds, 7 a cycle with its path).
const WHY: [Why; 6] = [
    Why::NotRegistered,
    Why::Pending,
    Why::Running,
    Why::Dead,
    Why::Failed,
    Why::NotReady,
];
const VERDICT_CYCLE: u8 = 7;
const VERDICT_NO_SUCH_TASK: u8 = 8;

const SIDECAR: u8 = 0x10;
const LEADER: u8 = 0x20;
const READINESS: u8 = 0x40;
const FAILED: u8 = 0x01;
const STARTED: u8 = 0x02;
const FINISHED: u8 = 0x04;
const LAST_RESTART: u8 = 0x08;
const READY: u8 = 0x10;
const READY_AT: u8 = 0x20;
const STALE: u8 = 0x40;
const REOPENED: u8 = 0x80;

fn code<T: PartialEq + Copy>(table: &[T], value: T) -> u8 {
    table
        .iter()
        .position(|&v| v == value)
        .expect("every variant has a code (tested)") as u8
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// One entry of an extension block: its tag and what writes its payload.
type ExtEntry<'a> = (u8, &'a dyn Fn(&mut Vec<u8>));

/// Writes an extension block: `(tag, payload)` pairs, tags increasing.
/// The payloads are written to a scratch buffer first, for their length.
fn put_ext(buf: &mut Vec<u8>, entries: &[ExtEntry<'_>]) {
    put_varint(buf, entries.len() as u64);
    let mut payload = Vec::new();
    for (tag, write) in entries {
        payload.clear();
        write(&mut payload);
        buf.push(*tag);
        put_varint(buf, payload.len() as u64);
        buf.extend_from_slice(&payload);
    }
}

fn put_positions(buf: &mut Vec<u8>, positions: &[usize]) {
    put_varint(buf, positions.len() as u64);
    for &i in positions {
        put_varint(buf, i as u64);
    }
}

/// The allocation's extension block.
fn put_alloc_ext(buf: &mut Vec<u8>, a: &Allocation) {
    let deadlines = *a.spec.deadlines();
    let overdue = a.overdue();
    let mut entries: Vec<ExtEntry<'_>> = Vec::new();
    let write_deadlines = |b: &mut Vec<u8>| {
        let set: Vec<(usize, Duration)> = Deadlines::STATES
            .iter()
            .enumerate()
            .filter_map(|(bit, &s)| deadlines.of(s).map(|d| (bit, d)))
            .collect();
        b.push(set.iter().fold(0, |m, (bit, _)| m | 1 << bit));
        for (_, d) in set {
            put_varint(b, millis(d));
        }
    };
    if !deadlines.is_empty() {
        entries.push((EXT_DEADLINES, &write_deadlines));
    }
    let write_at = |b: &mut Vec<u8>| put_time(b, a.deadline_at.expect("checked"));
    if a.deadline_at.is_some() {
        entries.push((EXT_DEADLINE_AT, &write_at));
    }
    let stage = overdue.and_then(|o| o.stage.as_ref());
    let write_stage = |b: &mut Vec<u8>| {
        let (state, tasks) = stage.expect("checked");
        b.push(code(&COORD, *state));
        put_positions(b, tasks);
    };
    if stage.is_some() {
        entries.push((EXT_STAGE_OVERDUE, &write_stage));
    }
    let told = overdue.and_then(|o| o.poststop.as_ref());
    let write_told = |b: &mut Vec<u8>| put_positions(b, told.expect("checked"));
    if told.is_some() {
        entries.push((EXT_POSTSTOP_TOLD, &write_told));
    }
    let write_marks = |b: &mut Vec<u8>| {
        put_varint(b, a.writes().len() as u64);
        for m in a.writes() {
            b.extend_from_slice(&m.id.to_le_bytes());
            put_varint(b, m.parent);
        }
    };
    if !a.writes().is_empty() {
        entries.push((EXT_WRITES, &write_marks));
    }
    let clocks = a.clocks();
    let write_clocks = |b: &mut Vec<u8>| {
        b.push(
            clocks
                .iter()
                .enumerate()
                .fold(0, |m, (bit, c)| m | u8::from(c.is_some()) << bit),
        );
        for at in clocks.iter().flatten() {
            put_time(b, *at);
        }
    };
    if clocks.iter().any(Option::is_some) {
        entries.push((EXT_STAGE_CLOCKS, &write_clocks));
    }
    put_ext(buf, &entries);
}

/// A task's extension block.
fn put_task_ext(buf: &mut Vec<u8>, spec: &TaskSpec, status: &TaskStatus) {
    let mut entries: Vec<ExtEntry<'_>> = Vec::new();
    let write_ttl = |b: &mut Vec<u8>| put_varint(b, millis(spec.liveness.expect("checked")));
    if spec.liveness.is_some() {
        entries.push((EXT_TTL, &write_ttl));
    }
    let write_lost = |b: &mut Vec<u8>| put_time(b, status.lost_at().expect("checked"));
    if status.lost() {
        entries.push((EXT_LOST_AT, &write_lost));
    }
    let write_keys = |b: &mut Vec<u8>| {
        put_varint(b, status.keys().len() as u64);
        for k in status.keys() {
            b.extend_from_slice(&k.key.to_le_bytes());
            b.extend_from_slice(&k.request.to_le_bytes());
        }
    };
    if !status.keys().is_empty() {
        entries.push((EXT_KEYS, &write_keys));
    }
    let write_deps = |b: &mut Vec<u8>| {
        put_varint(b, spec.depends_on.len() as u64);
        for d in &spec.depends_on {
            put_str(b, d.allocation.as_ref().map_or("", |a| a.as_str()));
            put_str(b, d.task.as_str());
            b.push(code(&CONDITION, d.condition));
        }
    };
    if !spec.depends_on.is_empty() {
        entries.push((EXT_DEPENDS_ON, &write_deps));
    }
    let write_verdicts = |b: &mut Vec<u8>| {
        put_varint(b, status.deps().len() as u64);
        for v in status.deps() {
            match v {
                DepState::Holds => b.push(0),
                // Never made (a cycle is judged with its path): kept as a
                // cycle with none.
                DepState::Blocked(Why::Cycle) => {
                    b.push(VERDICT_CYCLE);
                    put_varint(b, 0);
                }
                DepState::Blocked(Why::NoSuchTask) => b.push(VERDICT_NO_SUCH_TASK),
                DepState::Blocked(why) => b.push(1 + code(&WHY, *why)),
                DepState::Cycle(path) => {
                    b.push(VERDICT_CYCLE);
                    put_varint(b, path.len() as u64);
                    for step in path.iter() {
                        put_str(b, step);
                    }
                }
            }
        }
    };
    if !status.deps().is_empty() {
        entries.push((EXT_VERDICTS, &write_verdicts));
    }
    let write_run = |b: &mut Vec<u8>| put_varint(b, status.run.expect("checked"));
    if status.run.is_some() {
        entries.push((EXT_RUN, &write_run));
    }
    let write_acquire = |b: &mut Vec<u8>| {
        put_varint(b, spec.acquire.len() as u64);
        for name in &spec.acquire {
            put_str(b, name.as_str());
        }
    };
    if !spec.acquire.is_empty() {
        entries.push((EXT_ACQUIRE, &write_acquire));
    }
    let write_hold = |b: &mut Vec<u8>| match status.hold().expect("checked") {
        Hold::Queued { since, at } => {
            b.push(0);
            put_varint(b, since);
            put_time(b, at);
        }
        Hold::Granted { fence, at } => {
            b.push(1);
            put_varint(b, fence);
            put_time(b, at);
        }
    };
    if status.hold().is_some() {
        entries.push((EXT_HOLD, &write_hold));
    }
    let write_barrier = |b: &mut Vec<u8>| {
        let barrier = spec.barrier.as_ref().expect("checked");
        put_str(b, barrier.name.as_str());
        put_varint(b, u64::from(barrier.size));
        put_varint(b, barrier.timeout.map_or(0, millis));
    };
    if spec.barrier.is_some() {
        entries.push((EXT_BARRIER, &write_barrier));
    }
    let write_meet = |b: &mut Vec<u8>| {
        let (code, at) = match status.meet().expect("checked") {
            Meet::Arrived { at } => (0, at),
            Meet::Passed { at } => (1, at),
            Meet::Closed { at } => (2, at),
        };
        b.push(code);
        put_time(b, at);
    };
    if status.meet().is_some() {
        entries.push((EXT_MEET, &write_meet));
    }
    put_ext(buf, &entries);
}

/// Appends the record of `a` to `buf`.
pub fn encode_into(a: &Allocation, buf: &mut Vec<u8>) {
    buf.push(RECORD_VERSION);
    put_str(buf, a.id.as_str());
    buf.push(code(&COORD, a.state));
    put_varint(buf, a.create_index);
    put_varint(buf, a.modify_index);
    put_time(buf, a.created_at);
    put_time(buf, a.modified_at);
    let specs = a.spec.tasks();
    match a.order() {
        Desired::Run => buf.push(0),
        Desired::Stop(StopReason {
            kind: StopKind::DeadlineExceeded,
            stage,
            ..
        }) => {
            buf.push(STOP_DEADLINE);
            buf.push(code(&COORD, stage.unwrap_or(CoordState::Init)));
        }
        Desired::Stop(StopReason {
            kind: StopKind::StoppedByOperator,
            ..
        }) => buf.push(STOP_OPERATOR),
        Desired::Stop(StopReason {
            kind: StopKind::BarrierTimeout,
            barrier,
            ..
        }) => {
            buf.push(STOP_BARRIER);
            let named = specs
                .iter()
                .position(|s| s.barrier.as_ref().map(|b| &b.name) == barrier.as_ref());
            put_varint(buf, named.map_or(0, |i| i as u64 + 1));
        }
        Desired::Stop(reason) => {
            buf.push(1 + code(&STOP, reason.kind));
            let named = reason.task.as_ref().and_then(|t| a.position(t.as_str()));
            put_varint(buf, named.map_or(0, |i| i as u64 + 1));
        }
    }
    put_alloc_ext(buf, a);
    put_varint(buf, specs.len() as u64);
    let mut histories = HistoriesWriter::new(a.tasks.iter().map(|t| &t.events));
    for (i, (spec, status)) in specs.iter().zip(&a.tasks).enumerate() {
        put_str(buf, spec.name.as_str());
        let mut kind = match spec.lifecycle {
            None => 0,
            Some(Lifecycle { hook, sidecar }) => {
                (1 + code(&HOOK, hook)) | if sidecar { SIDECAR } else { 0 }
            }
        };
        if spec.leader {
            kind |= LEADER;
        }
        if spec.readiness {
            kind |= READINESS;
        }
        buf.push(kind);
        buf.push(code(&RUN, status.state));
        let times = [
            (STARTED, status.started_at),
            (FINISHED, status.finished_at),
            (LAST_RESTART, status.last_restart),
            (READY_AT, status.ready_at),
        ];
        let set = [
            (FAILED, status.failed),
            (READY, status.ready),
            (STALE, status.stale),
            (REOPENED, status.reopened),
        ];
        let flags = times
            .iter()
            .filter(|(_, t)| t.is_some())
            .map(|(bit, _)| *bit)
            .chain(set.iter().filter(|(_, on)| *on).map(|(bit, _)| *bit))
            .fold(0, |f, bit| f | bit);
        buf.push(flags);
        put_varint(buf, status.restarts);
        put_varint(buf, status.restart_generation);
        put_varint(buf, status.modify_index);
        for t in times.iter().filter_map(|(_, t)| *t) {
            put_time(buf, t);
        }
        histories.write(i, &status.events, buf);
        put_task_ext(buf, spec, status);
    }
}

pub fn encode(a: &Allocation) -> Vec<u8> {
    let mut buf = Vec::new();
    encode_into(a, &mut buf);
    buf
}

/// Decodes a stored record exactly as it was (no re-evaluation).
pub fn decode(bytes: &[u8]) -> Result<Allocation, String> {
    match bytes.split_first() {
        Some((&RECORD_VERSION, rest)) => decode_binary(rest),
        Some((&v, _)) => Err(format!(
            "record format version {v}, but this taskgate reads version {RECORD_VERSION} only"
        )),
        None => Err("an empty record".to_owned()),
    }
}

/// What only a record has: extension blocks, positions, codes.
impl<'a> Reader<'a> {
    /// An extension block: its entries' tags and payloads.
    fn ext(&mut self, what: &str) -> Result<Vec<(u8, Reader<'a>)>, String> {
        // An entry takes at least 2 bytes (a tag and an empty length).
        let n = self.count(what, 2)?;
        let mut out: Vec<(u8, Reader<'a>)> = Vec::with_capacity(n);
        for _ in 0..n {
            let tag = self.byte(what)?;
            if out.last().is_some_and(|(last, _)| *last >= tag) {
                return Err(format!("{what}: tag {tag} out of order"));
            }
            let len = self.count(what, 1)?;
            let (payload, rest) = self.bytes.split_at(len);
            self.bytes = rest;
            out.push((tag, Reader { bytes: payload }));
        }
        Ok(out)
    }

    /// The end of an extension's payload: nothing may be left.
    fn done(&self, what: &str) -> Result<(), String> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(format!("{} bytes after {what}", self.bytes.len()))
        }
    }

    fn millis(&mut self, what: &str) -> Result<Duration, String> {
        Ok(Duration::from_millis(self.varint(what)?))
    }

    fn u64_le(&mut self, what: &str) -> Result<u64, String> {
        if self.bytes.len() < 8 {
            return Err(format!("cut short in {what}"));
        }
        let (n, rest) = self.bytes.split_at(8);
        self.bytes = rest;
        Ok(u64::from_le_bytes(n.try_into().expect("8 bytes")))
    }

    /// Task positions, each below `tasks`.
    fn positions(&mut self, what: &str, tasks: usize) -> Result<Vec<usize>, String> {
        let n = self.count(what, 1)?;
        (0..n)
            .map(|_| {
                let i = self.varint(what)?;
                usize::try_from(i)
                    .ok()
                    .filter(|&i| i < tasks)
                    .ok_or_else(|| format!("{what} names task {i} of {tasks}"))
            })
            .collect()
    }

    fn code<T: Copy>(&mut self, table: &[T], what: &str) -> Result<T, String> {
        let b = self.byte(what)?;
        table
            .get(usize::from(b))
            .copied()
            .ok_or_else(|| format!("unknown {what} {b}"))
    }
}

/// What an allocation's extension block holds.
#[derive(Default)]
struct AllocExt<'a> {
    deadlines: Deadlines,
    deadline_at: Option<Timestamp>,
    /// Read once the task count is known.
    stage_overdue: Option<Reader<'a>>,
    poststop_told: Option<Reader<'a>>,
    writes: Vec<WriteMark>,
    clocks: crate::lifecycle::StageClocks,
}

fn alloc_ext<'a>(r: &mut Reader<'a>) -> Result<AllocExt<'a>, String> {
    let mut ext = AllocExt::default();
    for (tag, mut p) in r.ext("the allocation's extensions")? {
        match tag {
            EXT_DEADLINES => {
                let set = p.byte("the deadlines")?;
                if set & !0x0f != 0 || set == 0 {
                    return Err(format!("unknown deadlines {set:#x}"));
                }
                for (bit, &state) in Deadlines::STATES.iter().enumerate() {
                    if set & (1 << bit) != 0 {
                        ext.deadlines.set(state, Some(p.millis("a deadline")?));
                    }
                }
                p.done("the deadlines")?;
            }
            EXT_DEADLINE_AT => {
                ext.deadline_at = Some(p.time("deadline_at")?);
                p.done("deadline_at")?;
            }
            EXT_STAGE_OVERDUE => ext.stage_overdue = Some(p),
            EXT_POSTSTOP_TOLD => ext.poststop_told = Some(p),
            EXT_WRITES => {
                // A mark takes at least 9 bytes.
                let n = p.count("the write marks", 9)?;
                if n > WRITE_MARKS {
                    return Err(format!("{n} write marks (at most {WRITE_MARKS})"));
                }
                for _ in 0..n {
                    let id = p.u64_le("a write mark")?;
                    let parent = p.varint("a write mark")?;
                    ext.writes.push(WriteMark { id, parent });
                }
                p.done("the write marks")?;
            }
            EXT_STAGE_CLOCKS => {
                let set = p.byte("the stage clocks")?;
                if set & !0x0f != 0 || set == 0 {
                    return Err(format!("unknown stage clocks {set:#x}"));
                }
                for (bit, clock) in ext.clocks.iter_mut().enumerate() {
                    if set & (1 << bit) != 0 {
                        *clock = Some(p.time("a stage clock")?);
                    }
                }
                p.done("the stage clocks")?;
            }
            other => return Err(format!("unknown allocation extension {other}")),
        }
    }
    Ok(ext)
}

impl AllocExt<'_> {
    /// The deadlines that passed, now that the task count is known.
    fn overdue(&mut self, tasks: usize) -> Result<Option<Overdue>, String> {
        let mut overdue = Overdue::default();
        if let Some(p) = &mut self.stage_overdue {
            let state = p.code(&COORD, "the overdue stage")?;
            overdue.stage = Some((state, p.positions("the overdue stage's tasks", tasks)?));
            p.done("the overdue stage")?;
        }
        if let Some(p) = &mut self.poststop_told {
            overdue.poststop = Some(p.positions("the poststop tasks told to stop", tasks)?);
            p.done("the poststop tasks told to stop")?;
        }
        Ok((overdue != Overdue::default()).then_some(overdue))
    }
}

/// What a task's extension block holds: its TTL and
/// dependencies (spec), its status's out-of-line part, its run, and the
/// semaphores it acquires (spec).
type TaskExt = (
    Option<Duration>,
    Vec<Dependency>,
    Option<Arc<TaskExtra>>,
    Option<u64>,
    Vec<SemName>,
    Option<BarrierSpec>,
);

fn dependency(p: &mut Reader<'_>) -> Result<Dependency, String> {
    let alloc = p.str("a dependency's allocation")?;
    let allocation = if alloc.is_empty() {
        None
    } else {
        Some(AllocId::parse(alloc).map_err(|e| format!("bad dependency allocation: {e}"))?)
    };
    let task = p.str("a dependency's task")?;
    let task = TaskName::parse(task).map_err(|e| format!("bad dependency task: {e}"))?;
    let condition = p.code(&CONDITION, "a dependency's condition")?;
    Ok(Dependency {
        task,
        allocation,
        condition,
    })
}

fn verdict(p: &mut Reader<'_>) -> Result<DepState, String> {
    Ok(match p.byte("a dependency's verdict")? {
        0 => DepState::Holds,
        VERDICT_CYCLE => {
            let n = p.count("a cycle's path", 1)?;
            let path: Vec<String> = (0..n)
                .map(|_| p.str("a cycle's step").map(str::to_owned))
                .collect::<Result<_, _>>()?;
            DepState::Cycle(path.into())
        }
        VERDICT_NO_SUCH_TASK => DepState::Blocked(Why::NoSuchTask),
        c => DepState::Blocked(
            *WHY.get(usize::from(c) - 1)
                .ok_or_else(|| format!("unknown dependency verdict {c}"))?,
        ),
    })
}

fn task_ext(r: &mut Reader<'_>) -> Result<TaskExt, String> {
    let (mut ttl, mut deps, mut extra, mut run) = (None, Vec::new(), TaskExtra::default(), None);
    let (mut acquire, mut barrier) = (Vec::new(), None);
    for (tag, mut p) in r.ext("a task's extensions")? {
        match tag {
            EXT_TTL => {
                ttl = Some(p.millis("a liveness TTL")?);
                p.done("a liveness TTL")?;
            }
            EXT_LOST_AT => {
                extra.lost_at = Some(p.time("lost_at")?);
                p.done("lost_at")?;
            }
            EXT_KEYS => {
                let n = p.count("the idempotency keys", 16)?;
                for _ in 0..n {
                    let key = p.u64_le("an idempotency key")?;
                    let request = p.u64_le("an idempotency key")?;
                    extra.keys.push(IdemKey { key, request });
                }
                p.done("the idempotency keys")?;
            }
            EXT_DEPENDS_ON => {
                // A dependency takes at least 3 bytes.
                let n = p.count("the dependencies", 3)?;
                deps = (0..n)
                    .map(|_| dependency(&mut p))
                    .collect::<Result<_, _>>()?;
                p.done("the dependencies")?;
            }
            EXT_VERDICTS => {
                let n = p.count("the dependencies' verdicts", 1)?;
                extra.deps = (0..n).map(|_| verdict(&mut p)).collect::<Result<_, _>>()?;
                p.done("the dependencies' verdicts")?;
            }
            EXT_RUN => {
                run = Some(p.varint("the run")?);
                p.done("the run")?;
            }
            EXT_ACQUIRE => {
                // A name takes at least 2 bytes.
                let n = p.count("the semaphores acquired", 2)?;
                for _ in 0..n {
                    let name = p.str("a semaphore's name")?;
                    acquire.push(
                        SemName::parse(name).map_err(|e| format!("bad semaphore name: {e}"))?,
                    );
                }
                p.done("the semaphores acquired")?;
            }
            EXT_HOLD => {
                extra.hold = Some(match p.byte("a hold")? {
                    0 => Hold::Queued {
                        since: p.varint("a hold's place")?,
                        at: p.time("a hold's time")?,
                    },
                    1 => Hold::Granted {
                        fence: p.varint("a grant's fence")?,
                        at: p.time("a grant's time")?,
                    },
                    c => return Err(format!("unknown hold {c}")),
                });
                p.done("a hold")?;
            }
            EXT_BARRIER => {
                let name = p.str("a barrier's name")?;
                let name = SemName::parse(name).map_err(|e| format!("bad barrier name: {e}"))?;
                let size = p.varint("a barrier's size")?;
                let size = u16::try_from(size)
                    .ok()
                    .filter(|s| (SIZE_RANGE.0..=SIZE_RANGE.1).contains(s))
                    .ok_or_else(|| {
                        format!(
                            "barrier size {size} is outside {} to {}",
                            SIZE_RANGE.0, SIZE_RANGE.1
                        )
                    })?;
                let timeout = match p.millis("a barrier's timeout")? {
                    d if d.is_zero() => None,
                    d => Some(d),
                };
                barrier = Some(BarrierSpec {
                    name,
                    size,
                    timeout,
                });
                p.done("a barrier")?;
            }
            EXT_MEET => {
                let code = p.byte("a barrier's meeting")?;
                let at = p.time("a barrier's meeting time")?;
                extra.meet = Some(match code {
                    0 => Meet::Arrived { at },
                    1 => Meet::Passed { at },
                    2 => Meet::Closed { at },
                    c => return Err(format!("unknown barrier meeting {c}")),
                });
                p.done("a barrier's meeting")?;
            }
            other => return Err(format!("unknown task extension {other}")),
        }
    }
    if extra.deps.len() != deps.len() && !extra.deps.is_empty() {
        return Err(format!(
            "{} dependencies but {} verdicts",
            deps.len(),
            extra.deps.len()
        ));
    }
    let extra = (extra != TaskExtra::default()).then(|| Arc::new(extra));
    Ok((ttl, deps, extra, run, acquire, barrier))
}

/// Reads a record, after its version byte.
fn decode_binary(bytes: &[u8]) -> Result<Allocation, String> {
    let kind_bits = 0x0f | SIDECAR | LEADER | READINESS;
    let flag_bits =
        FAILED | STARTED | FINISHED | LAST_RESTART | READY | READY_AT | STALE | REOPENED;
    let mut r = Reader { bytes };
    let id = AllocId::parse(r.str("the allocation ID")?)
        .map_err(|e| format!("bad allocation ID: {e}"))?;
    let state = r.code(&COORD, "coordinator state")?;
    let create_index = r.varint("create_index")?;
    let modify_index = r.varint("modify_index")?;
    let created_at = r.time("created_at")?;
    let modified_at = r.time("modified_at")?;
    // The stop order, its named task as a position checked below.
    let mut deadline_stage = None;
    let order = match r.byte("the stop order")? {
        0 => None,
        STOP_DEADLINE => {
            deadline_stage = Some(r.code(&COORD, "the stop order's stage")?);
            Some((StopKind::DeadlineExceeded, 0))
        }
        STOP_OPERATOR => Some((StopKind::StoppedByOperator, 0)),
        STOP_BARRIER => Some((
            StopKind::BarrierTimeout,
            r.varint("the stop order's barrier")?,
        )),
        c => {
            let kind = *STOP
                .get(usize::from(c) - 1)
                .ok_or_else(|| format!("unknown stop order {c}"))?;
            Some((kind, r.varint("the stop order's task")?))
        }
    };
    let mut ext = alloc_ext(&mut r)?;
    // A task takes at least 9 bytes (an empty name is refused below).
    let n = r.count("the task count", 9)?;
    let (mut specs, mut statuses) = (Vec::with_capacity(n), Vec::with_capacity(n));
    // The tasks' histories, kept as stored (`lifecycle::Events`).
    let mut histories = HistoriesReader::default();
    for _ in 0..n {
        let name = r.str("a task name")?;
        let name = TaskName::parse(name).map_err(|e| format!("bad task name {name:?}: {e}"))?;
        let kind = r.byte("a task kind")?;
        if kind & !kind_bits != 0 {
            return Err(format!("task {name}: unknown kind {kind:#x}"));
        }
        let sidecar = kind & SIDECAR != 0;
        let lifecycle = match kind & 0x0f {
            0 if sidecar => return Err(format!("task {name}: a main task marked sidecar")),
            0 => None,
            hook => Some(Lifecycle {
                hook: *HOOK
                    .get(usize::from(hook - 1))
                    .ok_or_else(|| format!("task {name}: unknown hook {hook}"))?,
                sidecar,
            }),
        };
        let run = r.code(&RUN, "task state")?;
        let flags = r.byte("task flags")?;
        if flags & !flag_bits != 0 {
            return Err(format!("task {name}: unknown flags {flags:#x}"));
        }
        let restarts = r.varint("restarts")?;
        let restart_generation = r.varint("restart_generation")?;
        let task_index = r.varint("a task's modify_index")?;
        let mut time_if = |bit: u8, what: &str| -> Result<Option<Timestamp>, String> {
            (flags & bit != 0).then(|| r.time(what)).transpose()
        };
        let started_at = time_if(STARTED, "started_at")?;
        let finished_at = time_if(FINISHED, "finished_at")?;
        let last_restart = time_if(LAST_RESTART, "last_restart")?;
        let ready_at = time_if(READY_AT, "ready_at")?;
        (histories.read(&mut r)).map_err(|e| format!("task {name}: {e}"))?;
        let (liveness, depends_on, extra, task_run, acquire, barrier) = task_ext(&mut r)?;
        specs.push(TaskSpec {
            name,
            lifecycle,
            leader: kind & LEADER != 0,
            readiness: kind & READINESS != 0,
            liveness,
            depends_on,
            acquire,
            barrier,
        });
        statuses.push(TaskStatus {
            state: run,
            failed: flags & FAILED != 0,
            restarts,
            started_at,
            finished_at,
            last_restart,
            events: Default::default(),
            restart_generation,
            ready: flags & READY != 0,
            ready_at,
            stale: flags & STALE != 0,
            modify_index: task_index,
            run: task_run,
            reopened: flags & REOPENED != 0,
            extra,
        });
    }
    if !r.bytes.is_empty() {
        return Err(format!("{} bytes after the record's end", r.bytes.len()));
    }
    for (status, events) in statuses.iter_mut().zip(histories.finish()) {
        status.events = events;
    }
    let order = match order {
        None => Desired::Run,
        Some((kind, named)) => {
            let task = match named {
                0 => None,
                i => Some(
                    specs
                        .get(usize::try_from(i - 1).unwrap_or(usize::MAX))
                        .ok_or_else(|| format!("the stop order names task {i} of {n}"))?,
                ),
            };
            if kind == StopKind::BarrierTimeout {
                let barrier = task
                    .and_then(|t| t.barrier.as_ref())
                    .ok_or("a barrier's stop order names no task with a barrier")?;
                // Written as the first member of the barrier (one encoding).
                let first = specs
                    .iter()
                    .find_map(|t| t.barrier.as_ref().filter(|b| b.name == barrier.name));
                if !first.is_some_and(|f| std::ptr::eq(f, barrier)) {
                    return Err(format!(
                        "a barrier's stop order names a later member of barrier {:?}",
                        barrier.name.as_str()
                    ));
                }
                Desired::Stop(StopReason::barrier(barrier.name.clone()))
            } else {
                Desired::Stop(StopReason {
                    kind,
                    task: task.map(|t| t.name.clone()),
                    stage: deadline_stage,
                    barrier: None,
                })
            }
        }
    };
    let overdue = ext.overdue(n)?;
    // Checked as a registration is: a damaged record must not break the
    // coordinator's assumptions. The limit on the task count is not
    // re-applied: a record registered under a larger configured limit
    // stays readable.
    let limits = Limits {
        max_tasks: usize::MAX,
        ..Limits::default()
    };
    let spec = AllocSpec::with_deadlines(specs, ext.deadlines, &limits)
        .map_err(|e| format!("invalid task spec: {}: {}", e[0].field, e[0].message))?;
    let a = Allocation::from_parts(
        id,
        Arc::new(spec),
        state,
        statuses,
        Some(order),
        create_index,
        modify_index,
        created_at,
        modified_at,
    );
    Ok(a.with_deadlines(ext.deadline_at, overdue)
        .with_clocks(ext.clocks)
        .with_writes(ext.writes))
}

// ---- semaphores ----

use crate::lifecycle::{GRANT_TIMEOUT_RANGE, LIMIT_RANGE, Semaphore};

/// The first byte of a semaphore's record: its format (1), with the high
/// bit set so that it is no allocation record's version.
pub const SEMAPHORE_VERSION: u8 = 0x81;

/// Appends the record of semaphore `s` to `buf`.
pub fn encode_semaphore_into(s: &Semaphore, buf: &mut Vec<u8>) {
    buf.push(SEMAPHORE_VERSION);
    put_str(buf, s.name.as_str());
    put_varint(buf, u64::from(s.limit));
    put_varint(
        buf,
        u64::try_from(s.grant_timeout.as_nanos()).unwrap_or(u64::MAX),
    );
    put_varint(buf, s.create_index);
    put_varint(buf, s.modify_index);
    put_ext(buf, &[]);
}

pub fn encode_semaphore(s: &Semaphore) -> Vec<u8> {
    let mut buf = Vec::with_capacity(32);
    encode_semaphore_into(s, &mut buf);
    buf
}

/// Decodes a stored semaphore record exactly as it was.
pub fn decode_semaphore(bytes: &[u8]) -> Result<Semaphore, String> {
    let rest = match bytes.split_first() {
        Some((&SEMAPHORE_VERSION, rest)) => rest,
        Some((&v, _)) => {
            return Err(format!(
                "a semaphore record of format byte {v:#04x}, but this taskgate reads \
                 semaphore records of format 1 (byte {SEMAPHORE_VERSION:#04x}) only"
            ));
        }
        None => return Err("an empty record".to_owned()),
    };
    let mut r = Reader { bytes: rest };
    let name = r.str("the semaphore's name")?;
    let name = SemName::parse(name).map_err(|e| format!("bad semaphore name {name:?}: {e}"))?;
    let limit = r.varint("limit")?;
    let (least, most) = LIMIT_RANGE;
    let limit = u32::try_from(limit)
        .ok()
        .filter(|l| (least..=most).contains(l))
        .ok_or_else(|| format!("limit {limit} is outside {least} to {most}"))?;
    let nanos = r.varint("grant_timeout")?;
    let grant_timeout = Duration::from_nanos(nanos);
    let (shortest, longest) = GRANT_TIMEOUT_RANGE;
    if !(shortest..=longest).contains(&grant_timeout) {
        return Err(format!(
            "grant_timeout {grant_timeout:?} is outside {shortest:?} to {longest:?}"
        ));
    }
    let create_index = r.varint("create_index")?;
    let modify_index = r.varint("modify_index")?;
    if create_index > modify_index {
        return Err(format!(
            "create_index {create_index} is above modify_index {modify_index}"
        ));
    }
    if let Some((tag, _)) = r.ext("the semaphore's extensions")?.first() {
        return Err(format!("unknown semaphore extension {tag}"));
    }
    if !r.bytes.is_empty() {
        return Err(format!("{} bytes after the record's end", r.bytes.len()));
    }
    Ok(Semaphore {
        name,
        limit,
        grant_timeout,
        create_index,
        modify_index,
    })
}

#[cfg(test)]
mod semaphore_tests;
#[cfg(test)]
mod tests;
