//! Each allocation's trace (docs/operations.md, "Traces"): a span per
//! stage the coordinator went through and a span per wait of a task
//! before it could start, under one root span, the allocation's.
//!
//! Built by the follower from the changes it publishes, only when traces
//! are on (`RegistryConfig::traces`; with them off nothing here runs):
//!
//! - **One trace per allocation.** Its ID is a hash of the store's ID, the
//!   allocation's ID and its `create_index`, so every replica and every
//!   restart puts the allocation's spans in the same trace, and an
//!   allocation deleted and registered again gets a new one. Span IDs are
//!   hashes too (of the trace and the index of the change that ended the
//!   span), so a span is the same span wherever it is made.
//! - **Timestamps from the records**: a span ends at the `modified_at` of
//!   the change that ended it and starts at that of the change that began
//!   it, as this replica's follower saw them. A start this replica did not
//!   see (the server started, or listed the store again, since) is the
//!   earliest time the records it has vouch for, and the span says
//!   `taskgate.start_exact = false`.
//! - **Emitted once, by the replica whose write made the change.** Every
//!   replica follows every change and keeps the open stages (so any of
//!   them can end one), but only the writer's follower emits: on a store
//!   this process alone writes, that is every change; on a shared store
//!   (etcd), the write path claims its own writes (`Claim`) before they
//!   can be published, by the write mark the store puts in the record (or
//!   the allocation ID of a deletion), and the follower takes the claim
//!   when it publishes the change. A replica that dies between its commit
//!   and its publication leaves that change's spans unsent.
//!
//! What a task waits on is a `Wait`: its stage's gate, or one of its
//! dependencies. Semaphores and barriers (not built yet) are two more
//! kinds, each with its own start (when the task first had to wait) and
//! end (when it was let through).
//!
//! The open state of each allocation is a leaf lock (`open`), taken by the
//! follower under the allocation map; spans go to the exporter's queue
//! (a bounded channel that drops when full, never waits) after the map is
//! let go.

use std::{
    borrow::Cow,
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::SystemTime,
};

use opentelemetry::{
    InstrumentationScope, KeyValue, StringValue, Value,
    trace::{Event, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState},
};
use opentelemetry_sdk::trace::{
    Sampler, SamplingDecision, ShouldSample, SpanData, SpanEvents, SpanLinks, SpanProcessor,
};
use sha2::{Digest, Sha256};

use crate::lifecycle::{
    AllocId, Allocation, CoordState, Dependency, Outcome, RunState, Stage, Timestamp, gates,
};

/// Where an allocation's spans go, and which traces are sampled.
pub struct Traces {
    /// The exporter's queue (the batch span processor the request spans
    /// go through too).
    sink: Arc<dyn SpanProcessor>,
    /// The configured sampler (`OTEL_TRACES_SAMPLER`), asked about each
    /// allocation's trace as about a root span of it: the decision depends
    /// on the trace ID alone, so every span of a trace gets the same.
    sampler: Sampler,
    scope: InstrumentationScope,
    /// Allocation → what is open in its trace.
    open: Mutex<HashMap<AllocId, Open, foldhash::fast::RandomState>>,
    /// This replica's writes in flight on a shared store (`Claim`).
    own: Mutex<HashSet<Own, foldhash::fast::RandomState>>,
}

impl std::fmt::Debug for Traces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Traces")
            .field("sampler", &self.sampler)
            .finish_non_exhaustive()
    }
}

/// A time the trace knows something began, and whether this replica saw
/// it begin (`exact`) or only found it begun.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Since {
    at: SystemTime,
    exact: bool,
}

impl Since {
    fn exact(at: Timestamp) -> Self {
        Self {
            at: at.into(),
            exact: true,
        }
    }

    /// Begun no later than `a`'s change: the earliest time this replica
    /// can vouch for.
    fn found(a: &Allocation) -> Self {
        Self {
            at: a.modified_at.into(),
            exact: false,
        }
    }

    /// A wait's start: the later of when its cause began (`self`) and
    /// when the task became pending (`pending`, from the record: exact).
    fn or_later(self, pending: SystemTime) -> Self {
        if pending >= self.at {
            Self {
                at: pending,
                exact: true,
            }
        } else {
            self
        }
    }
}

/// What is open in one allocation's trace.
#[derive(Debug)]
struct Open {
    create_index: u64,
    /// The last change seen (a listing keeps the entry only if it is
    /// still the allocation's record).
    seen: u64,
    /// When the coordinator entered its state.
    entered: Since,
    /// Since when each stage's gate has been closed (`Stage::column`
    /// order; `None`: open).
    closed: [Option<Since>; 6],
    /// The dependencies that do not hold: (task, dependency), since when.
    blocked: Vec<(usize, usize, Since)>,
    /// What happened during the current stage: its span's events.
    notes: Vec<Event>,
}

impl Open {
    /// A new allocation: everything begins at its registration.
    fn registered(a: &Allocation) -> Self {
        let at = Since::exact(a.created_at);
        Self::with(a, at, Since::exact(a.modified_at))
    }

    /// An allocation this replica did not see begin (loaded at start, or
    /// listed again).
    fn found(a: &Allocation) -> Self {
        Self::with(a, Since::found(a), Since::found(a))
    }

    fn with(a: &Allocation, since: Since, entered: Since) -> Self {
        let open = gates(a.state);
        let blocked = a
            .tasks
            .iter()
            .enumerate()
            .flat_map(|(i, t)| {
                t.deps()
                    .iter()
                    .enumerate()
                    .filter(|(_, d)| !d.holds())
                    .map(move |(j, _)| (i, j, since))
            })
            .collect();
        Self {
            create_index: a.create_index,
            seen: a.modify_index,
            entered,
            closed: open.map(|o| (!o).then_some(since)),
            blocked,
            notes: Vec::new(),
        }
    }

    /// Task `task`'s dependency `dep` holds now: since when it did not.
    fn unblocked(&mut self, task: usize, dep: usize) -> Option<Since> {
        let at = self
            .blocked
            .iter()
            .position(|&(t, d, _)| (t, d) == (task, dep))?;
        Some(self.blocked.swap_remove(at).2)
    }
}

/// What a task waited on before it could start.
enum Wait<'a> {
    /// Its stage's gate: the coordinator's state.
    Gate(Stage),
    /// Its dependency `depends_on[.0]`.
    Dependency(usize, &'a Dependency),
}

impl Wait<'_> {
    fn kind(&self) -> &'static str {
        match self {
            Wait::Gate(_) => "gate",
            Wait::Dependency(..) => "dependency",
        }
    }

    fn attributes(&self, out: &mut Vec<KeyValue>) {
        match self {
            Wait::Gate(stage) => out.push(KeyValue::new("taskgate.gate", stage.as_str())),
            Wait::Dependency(j, d) => {
                let target = match &d.allocation {
                    Some(alloc) => format!("{alloc}/{}", d.task),
                    None => d.task.to_string(),
                };
                out.push(KeyValue::new("taskgate.dependency", target));
                out.push(KeyValue::new(
                    "taskgate.dependency.condition",
                    d.condition.as_str(),
                ));
                out.push(KeyValue::new("taskgate.dependency.index", *j as i64));
            }
        }
    }
}

/// A write of this replica, as the follower will see it published.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum Own {
    /// A put, by the write mark the store gave its record.
    Put(u64),
    /// A deletion of this allocation.
    Delete(AllocId),
}

/// A write of this replica in flight, claimed before it can be published;
/// forgotten when dropped, if the follower did not take it (the write
/// failed, or lost to another replica's). One pointer: it rides in every
/// commit's task, which traces off should not make larger.
pub(super) struct Claim(Box<(Arc<Traces>, Own)>);

impl Drop for Claim {
    fn drop(&mut self) {
        let (traces, own) = &*self.0;
        traces.own().remove(own);
    }
}

/// The IDs of one allocation's trace.
struct Trace {
    id: TraceId,
    root: SpanId,
}

impl Trace {
    fn of(store: &str, a: &Allocation) -> Self {
        let mut h = Sha256::new();
        for part in [b"taskgate allocation trace".as_slice(), store.as_bytes()] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part);
        }
        h.update(a.id.as_str().as_bytes());
        h.update(a.create_index.to_le_bytes());
        let digest = h.finalize();
        let mut id = [0; 16];
        id.copy_from_slice(&digest[..16]);
        // All zeros is the invalid trace ID.
        id[15] |= u8::from(id == [0; 16]);
        let id = TraceId::from_bytes(id);
        Self {
            root: span_id(id, b"allocation", 0, 0),
            id,
        }
    }
}

/// A change's trace, hashed and sampled only once the change is found to
/// end a span (most changes end none), and only for this replica's own.
struct Lazy<'a> {
    /// The store and the record, if the change is this replica's.
    of: Option<(&'a str, &'a Allocation)>,
    /// `None` until asked; then the trace if sampled.
    trace: Option<Option<Trace>>,
}

impl<'a> Lazy<'a> {
    fn new(of: Option<(&'a str, &'a Allocation)>) -> Self {
        Self { of, trace: None }
    }

    /// Whether spans of this change may be sent at all.
    fn wanted(&self) -> bool {
        self.of.is_some() && !matches!(self.trace, Some(None))
    }

    fn get(&mut self, traces: &Traces) -> Option<&Trace> {
        let (store, a) = self.of?;
        self.trace
            .get_or_insert_with(|| traces.sampled(store, a))
            .as_ref()
    }
}

/// A span's ID: a hash of its trace, its kind and two numbers that tell it
/// from the trace's other spans of that kind.
fn span_id(trace: TraceId, kind: &[u8], a: u64, b: u64) -> SpanId {
    let mut h = Sha256::new();
    h.update(trace.to_bytes());
    h.update(kind);
    h.update(a.to_le_bytes());
    h.update(b.to_le_bytes());
    let digest = h.finalize();
    let mut id = [0; 8];
    id.copy_from_slice(&digest[..8]);
    id[7] |= u8::from(id == [0; 8]);
    SpanId::from_bytes(id)
}

/// Whether every task has ended after the coordinator reached poststop:
/// nothing is left to wait for.
fn finished(a: &Allocation) -> bool {
    a.state == CoordState::Poststop && a.tasks.iter().all(|t| t.state == RunState::Dead)
}

/// When task `i` last became pending: at registration, or when it last
/// went back to pending.
fn pending_since(a: &Allocation, i: usize) -> SystemTime {
    a.tasks[i]
        .last_restart
        .filter(|r| *r > a.created_at)
        .unwrap_or(a.created_at)
        .into()
}

impl Traces {
    pub fn new(sink: Arc<dyn SpanProcessor>, sampler: Sampler) -> Self {
        Self {
            sink,
            sampler,
            scope: InstrumentationScope::builder("taskgate")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
            open: Mutex::default(),
            own: Mutex::default(),
        }
    }

    fn open(&self) -> MutexGuard<'_, HashMap<AllocId, Open, foldhash::fast::RandomState>> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn own(&self) -> MutexGuard<'_, HashSet<Own, foldhash::fast::RandomState>> {
        self.own.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims a write of this replica before it can be published.
    pub(super) fn claim(self: &Arc<Self>, own: Own) -> Claim {
        self.own().insert(own.clone());
        Claim(Box::new((self.clone(), own)))
    }

    /// Whether `own` is a write of this replica (taking its claim).
    pub(super) fn owns(&self, own: &Own) -> bool {
        self.own().remove(own)
    }

    /// The allocation's trace if it is sampled.
    fn sampled(&self, store: &str, a: &Allocation) -> Option<Trace> {
        let trace = Trace::of(store, a);
        let decision = self
            .sampler
            .should_sample(None, trace.id, "allocation", &SpanKind::Internal, &[], &[])
            .decision;
        (decision == SamplingDecision::RecordAndSample).then_some(trace)
    }

    /// A change published: `prev` is the version before (`None`: a
    /// registration), `next` the one published. Keeps what is open in the
    /// trace, and if `own`, adds the spans the change ends to `out`.
    pub(super) fn put(
        &self,
        store: &str,
        prev: Option<&Allocation>,
        next: &Allocation,
        own: bool,
        out: &mut Vec<SpanData>,
    ) {
        let mut open = self.open();
        let Some(prev) = prev.filter(|p| p.create_index == next.create_index) else {
            // A registration; or (never seen before, its registration
            // unseen) a record whose history here begins now.
            let begins = if next.modify_index == next.create_index {
                Open::registered(next)
            } else {
                Open::found(next)
            };
            open.insert(next.id.clone(), begins);
            return;
        };
        let entry = open
            .entry(next.id.clone())
            .or_insert_with(|| Open::found(prev));
        if entry.create_index != next.create_index {
            *entry = Open::found(prev);
        }
        entry.seen = next.modify_index;
        let mut trace = Lazy::new(own.then_some((store, next)));
        let at = Since::exact(next.modified_at);
        self.note(entry, prev, next, at.at);
        self.gates(entry, prev, next, at, &mut trace, out);
        self.dependencies(entry, prev, next, at, &mut trace, out);
        if prev.state != next.state {
            if !finished(prev)
                && let Some(trace) = trace.get(self)
            {
                out.push(self.stage(trace, prev, entry, at.at, next.state.as_str(), next));
            }
            entry.entered = at;
            entry.notes.clear();
        }
        if finished(next) && !finished(prev) {
            if let Some(trace) = trace.get(self) {
                if entry.entered.at < at.at {
                    out.push(self.stage(trace, next, entry, at.at, "finished", next));
                }
                out.push(self.root(trace, next, at.at, false));
            }
            open.remove(&next.id);
        }
    }

    /// `last` deleted at `at` (the follower's clock: a deletion's record
    /// has no time): its trace ends, if it had not.
    pub(super) fn deleted(
        &self,
        store: &str,
        last: &Allocation,
        at: Timestamp,
        own: bool,
        out: &mut Vec<SpanData>,
    ) {
        let entry = self.open().remove(&last.id);
        if !own || finished(last) {
            return;
        }
        let Some(trace) = self.sampled(store, last) else {
            return;
        };
        let entry = entry
            .filter(|e| e.create_index == last.create_index)
            .unwrap_or_else(|| Open::found(last));
        // Another replica's clock may be behind the record's.
        let at = SystemTime::from(at).max(entry.entered.at);
        out.push(self.stage(&trace, last, &entry, at, "deleted", last));
        out.push(self.root(&trace, last, at, true));
    }

    /// After the view was listed again: what is open is kept for the
    /// allocations whose record is the one last seen; the others' changes
    /// in between were not seen.
    pub(super) fn listed(&self, now: &HashMap<&str, u64>) {
        self.open()
            .retain(|id, e| now.get(id.as_str()) == Some(&e.seen));
    }

    /// Hands spans to the exporter's queue.
    pub(super) fn emit(&self, spans: Vec<SpanData>) {
        for span in spans {
            self.sink.on_end(span);
        }
    }

    /// What happened during the stage: a deadline that passed, a task
    /// declared lost.
    fn note(&self, entry: &mut Open, prev: &Allocation, next: &Allocation, at: SystemTime) {
        let stage = |a: &Allocation| a.overdue().and_then(|o| o.stage.as_ref().map(|s| s.0));
        if let Some(overdue) = stage(next)
            && stage(prev) != Some(overdue)
        {
            entry.notes.push(Event::new(
                "deadline exceeded",
                at,
                vec![KeyValue::new("taskgate.stage", overdue.as_str())],
                0,
            ));
        }
        for (i, (p, n)) in prev.tasks.iter().zip(&next.tasks).enumerate() {
            if n.lost() && !p.lost() {
                entry.notes.push(Event::new(
                    "task lost",
                    at,
                    vec![KeyValue::new(
                        "taskgate.task",
                        next.task_name(i).as_str().to_owned(),
                    )],
                    0,
                ));
            }
        }
    }

    /// Gates the change opened end the waits of the pending tasks behind
    /// them; gates it closed start their clocks.
    fn gates(
        &self,
        entry: &mut Open,
        prev: &Allocation,
        next: &Allocation,
        at: Since,
        trace: &mut Lazy<'_>,
        out: &mut Vec<SpanData>,
    ) {
        let (was, is) = (gates(prev.state), gates(next.state));
        for column in 0..was.len() {
            match (was[column], is[column]) {
                (false, true) => {
                    let since = entry.closed[column].take().unwrap_or(Since::found(prev));
                    if !trace.wanted() {
                        continue;
                    }
                    for (i, spec) in next.spec.tasks().iter().enumerate() {
                        let stage = spec.stage();
                        if stage.column() == column && next.tasks[i].state == RunState::Pending {
                            let start = since.or_later(pending_since(next, i));
                            if start.at < at.at
                                && let Some(trace) = trace.get(self)
                            {
                                out.push(self.wait(trace, next, i, &Wait::Gate(stage), start, at));
                            }
                        }
                    }
                }
                (true, false) => entry.closed[column] = Some(at),
                _ => {}
            }
        }
    }

    /// Dependencies that came to hold end the waits of the pending tasks
    /// that declared them; those that stopped holding start their clocks.
    fn dependencies(
        &self,
        entry: &mut Open,
        prev: &Allocation,
        next: &Allocation,
        at: Since,
        trace: &mut Lazy<'_>,
        out: &mut Vec<SpanData>,
    ) {
        for (i, (p, n)) in prev.tasks.iter().zip(&next.tasks).enumerate() {
            for (j, dep) in n.deps().iter().enumerate() {
                let held = p.deps().get(j).is_some_and(|d| d.holds());
                match (held, dep.holds()) {
                    (false, true) => {
                        let since = entry.unblocked(i, j).unwrap_or(Since::found(prev));
                        let start = since.or_later(pending_since(next, i));
                        if n.state == RunState::Pending
                            && start.at < at.at
                            && let Some(d) = next.spec.tasks()[i].depends_on.get(j)
                            && let Some(trace) = trace.get(self)
                        {
                            let wait = Wait::Dependency(j, d);
                            out.push(self.wait(trace, next, i, &wait, start, at));
                        }
                    }
                    (true, false) => entry.blocked.push((i, j, at)),
                    _ => {}
                }
            }
        }
    }

    /// The span of stage `a.state`, from when it was entered to `end`;
    /// `then` says what came next (a state, `finished` or `deleted`),
    /// `at` is the record that ended it.
    fn stage(
        &self,
        trace: &Trace,
        a: &Allocation,
        entry: &Open,
        end: SystemTime,
        then: &'static str,
        at: &Allocation,
    ) -> SpanData {
        let waited: Vec<StringValue> = a
            .waiting_on()
            .iter()
            .map(|t| t.as_str().to_owned().into())
            .collect();
        let attributes = vec![
            KeyValue::new("taskgate.alloc_id", a.id.as_str().to_owned()),
            KeyValue::new("taskgate.stage", a.state.as_str()),
            KeyValue::new("taskgate.stage.next", then),
            KeyValue::new("taskgate.waited_on", Value::Array(waited.into())),
            KeyValue::new("taskgate.index", at.modify_index as i64),
            KeyValue::new("taskgate.start_exact", entry.entered.exact),
        ];
        let mut span = self.span(
            trace,
            span_id(trace.id, b"stage", at.modify_index, 0),
            format!("stage {}", a.state).into(),
            entry.entered.at,
            end,
            attributes,
        );
        span.events.events = entry.notes.clone();
        span
    }

    /// The span of task `i`'s wait on `wait`, which change `next` ended.
    fn wait(
        &self,
        trace: &Trace,
        next: &Allocation,
        i: usize,
        wait: &Wait<'_>,
        start: Since,
        end: Since,
    ) -> SpanData {
        let mut attributes = vec![
            KeyValue::new("taskgate.alloc_id", next.id.as_str().to_owned()),
            KeyValue::new("taskgate.task", next.task_name(i).as_str().to_owned()),
            KeyValue::new("taskgate.wait", wait.kind()),
        ];
        wait.attributes(&mut attributes);
        attributes.push(KeyValue::new("taskgate.index", next.modify_index as i64));
        attributes.push(KeyValue::new("taskgate.start_exact", start.exact));
        let which = match wait {
            Wait::Gate(_) => 0,
            Wait::Dependency(j, _) => *j as u64 + 1,
        };
        self.span(
            trace,
            span_id(
                trace.id,
                b"wait",
                next.modify_index,
                (i as u64) << 32 | which,
            ),
            format!("wait {}", wait.kind()).into(),
            start.at,
            end.at,
            attributes,
        )
    }

    /// The allocation's own span: from its registration to `end`, when it
    /// finished or was deleted.
    fn root(&self, trace: &Trace, a: &Allocation, end: SystemTime, deleted: bool) -> SpanData {
        let mut attributes = vec![
            KeyValue::new("taskgate.alloc_id", a.id.as_str().to_owned()),
            KeyValue::new("taskgate.create_index", a.create_index as i64),
            KeyValue::new("taskgate.tasks", a.tasks.len() as i64),
            KeyValue::new("taskgate.deleted", deleted),
        ];
        let mut status = Status::Unset;
        if let Some((outcome, failed)) = a.outcome().filter(|_| finished(a)) {
            attributes.push(KeyValue::new("taskgate.outcome", outcome.as_str()));
            if outcome == Outcome::Failed {
                let names: Vec<&str> = failed.iter().map(|t| t.as_str()).collect();
                status = Status::error(format!("failed: {}", names.join(", ")));
            }
        }
        let mut span = self.span(
            trace,
            trace.root,
            "allocation".into(),
            a.created_at.into(),
            end,
            attributes,
        );
        span.parent_span_id = SpanId::INVALID;
        span.status = status;
        span
    }

    /// A span of `trace` under its root.
    fn span(
        &self,
        trace: &Trace,
        id: SpanId,
        name: Cow<'static, str>,
        start: SystemTime,
        end: SystemTime,
        attributes: Vec<KeyValue>,
    ) -> SpanData {
        SpanData {
            span_context: SpanContext::new(
                trace.id,
                id,
                TraceFlags::SAMPLED,
                false,
                TraceState::default(),
            ),
            parent_span_id: trace.root,
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name,
            start_time: start,
            end_time: end.max(start),
            attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: Status::Unset,
            instrumentation_scope: self.scope.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use opentelemetry_sdk::{error::OTelSdkResult, trace::Span};
    use time::macros::datetime;

    use super::*;
    use crate::lifecycle::{
        AllocSpec, Hook, Lifecycle, Limits, RestartMode, TaskName, TaskReport, TaskSpec,
    };

    const T: Timestamp = datetime!(2026-11-24 10:00 UTC);

    /// Keeps the spans it is handed.
    #[derive(Debug, Default)]
    struct Kept(Mutex<Vec<SpanData>>);

    impl SpanProcessor for Kept {
        fn on_start(&self, _: &mut Span, _: &opentelemetry::Context) {}
        fn on_end(&self, span: SpanData) {
            self.0.lock().unwrap().push(span);
        }
        fn force_flush(&self) -> OTelSdkResult {
            Ok(())
        }
        fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
            Ok(())
        }
    }

    /// Traces that keep what they emit, with `sampler`.
    fn traces(sampler: Sampler) -> (Arc<Kept>, Traces) {
        let kept = Arc::new(Kept::default());
        (kept.clone(), Traces::new(kept, sampler))
    }

    fn at(seconds: i64) -> Timestamp {
        T + time::Duration::seconds(seconds)
    }

    fn five(id: &str) -> Allocation {
        let task = |name: &str, hook: Option<(Hook, bool)>| TaskSpec {
            name: TaskName::parse(name).unwrap(),
            lifecycle: hook.map(|(hook, sidecar)| Lifecycle { hook, sidecar }),
            leader: name == "web",
            readiness: false,
            liveness: None,
            depends_on: Vec::new(),
            acquire: Vec::new(),
            barrier: None,
        };
        let tasks = vec![
            task("init", Some((Hook::Prestart, false))),
            task("proxy", Some((Hook::Prestart, true))),
            task("web", None),
            task("announce", Some((Hook::Poststart, false))),
            task("cleanup", Some((Hook::Poststop, false))),
        ];
        let spec = AllocSpec::new(tasks, &Limits::default()).unwrap();
        Allocation::register(AllocId::parse(id).unwrap(), Arc::new(spec), 1, T)
    }

    /// `a` with task `i` reported `state` at `at(seconds)`.
    fn report(a: &Allocation, i: usize, state: RunState, seconds: i64) -> Allocation {
        let r = TaskReport {
            state,
            failed: false,
            ready: None,
            event: None,
        };
        a.report(&[(i, r)], at(seconds), || a.modify_index + 1)
            .expect("a change")
    }

    /// The five-task allocation from registration to its end, one task's
    /// report a second.
    fn run_through(id: &str) -> Vec<Allocation> {
        let mut versions = vec![five(id)];
        let steps = [
            (0, RunState::Running),
            (1, RunState::Running),
            (0, RunState::Dead),
            (2, RunState::Running),
            (3, RunState::Dead),
            (2, RunState::Dead),
            (1, RunState::Dead),
            (4, RunState::Dead),
        ];
        for (n, (task, state)) in (1..).zip(steps) {
            let next = report(versions.last().unwrap(), task, state, n);
            versions.push(next);
        }
        versions
    }

    /// Publishes `versions` in order, each written by this replica if
    /// `own(n)` says so; the spans emitted.
    fn publish(
        traces: &Traces,
        versions: &[Allocation],
        own: impl Fn(usize) -> bool,
    ) -> Vec<SpanData> {
        let mut out = Vec::new();
        traces.put("store", None, &versions[0], own(0), &mut out);
        for (n, pair) in versions.windows(2).enumerate() {
            traces.put("store", Some(&pair[0]), &pair[1], own(n + 1), &mut out);
        }
        out
    }

    fn attr(span: &SpanData, key: &str) -> Option<Value> {
        span.attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| kv.value.clone())
    }

    fn named<'a>(spans: &'a [SpanData], name: &str) -> Vec<&'a SpanData> {
        spans.iter().filter(|s| s.name == name).collect()
    }

    fn time(seconds: i64) -> SystemTime {
        at(seconds).into()
    }

    #[test]
    fn stages_and_waits_take_their_times_from_the_records() {
        let (_, traces) = traces(Sampler::AlwaysOn);
        let spans = publish(&traces, &run_through("a1"), |_| true);
        let stages: Vec<(String, SystemTime, SystemTime)> = spans
            .iter()
            .filter(|s| s.name.starts_with("stage "))
            .map(|s| (s.name.to_string(), s.start_time, s.end_time))
            .collect();
        assert_eq!(
            stages,
            [
                ("stage prestart".into(), time(0), time(3)),
                ("stage main".into(), time(3), time(4)),
                ("stage poststart".into(), time(4), time(5)),
                ("stage wait_alloc".into(), time(5), time(7)),
                ("stage poststop".into(), time(7), time(8)),
            ]
        );
        let waits: Vec<(Option<Value>, SystemTime, SystemTime)> = named(&spans, "wait gate")
            .iter()
            .map(|s| (attr(s, "taskgate.task"), s.start_time, s.end_time))
            .collect();
        assert_eq!(
            waits,
            [
                (Some("web".into()), time(0), time(3)),
                (Some("announce".into()), time(0), time(4)),
                (Some("cleanup".into()), time(0), time(7)),
            ]
        );
        let root = named(&spans, "allocation")[0];
        assert_eq!((root.start_time, root.end_time), (time(0), time(8)));
        assert_eq!(root.parent_span_id, SpanId::INVALID);
        assert!(
            spans
                .iter()
                .all(|s| s.span_context.trace_id() == root.span_context.trace_id())
        );
        assert!(
            spans
                .iter()
                .filter(|s| s.name != "allocation")
                .all(|s| s.parent_span_id == root.span_context.span_id())
        );
        assert!(
            spans
                .iter()
                .filter_map(|s| attr(s, "taskgate.start_exact"))
                .all(|e| e == Value::Bool(true))
        );
        assert!(
            traces.open().is_empty(),
            "a finished allocation keeps nothing"
        );
    }

    /// Any replica can end a stage another replica's write began, and
    /// emits only what its own writes end; the IDs are the same wherever
    /// the spans are made.
    #[test]
    fn a_replica_emits_what_its_own_writes_end_and_no_more() {
        let versions = run_through("a1");
        let (_, everything) = traces(Sampler::AlwaysOn);
        let all = publish(&everything, &versions, |_| true);
        // This replica wrote every other change.
        let (_, half) = traces(Sampler::AlwaysOn);
        let mine = publish(&half, &versions, |n| n % 2 == 0);
        let (_, rest) = traces(Sampler::AlwaysOn);
        let theirs = publish(&rest, &versions, |n| n % 2 == 1);
        let ids = |spans: &[SpanData]| {
            let mut ids: Vec<([u8; 8], SystemTime, SystemTime)> = spans
                .iter()
                .map(|s| {
                    (
                        s.span_context.span_id().to_bytes(),
                        s.start_time,
                        s.end_time,
                    )
                })
                .collect();
            ids.sort();
            ids
        };
        let mut both = mine.clone();
        both.extend(theirs);
        assert_eq!(
            ids(&both),
            ids(&all),
            "each span once, with its exact start"
        );
        assert!(!mine.is_empty() && mine.len() < all.len());
    }

    /// A stage this replica did not see begin (it started since) starts
    /// at the last change it knows of, and says it is not exact.
    #[test]
    fn a_start_this_replica_did_not_see_says_so() {
        let versions = run_through("a1");
        let (_, traces) = traces(Sampler::AlwaysOn);
        // Seen from the change after proxy's running report (second 2)
        // on: as a replica started since, or a record first seen then.
        let mut spans = Vec::new();
        traces.put("store", Some(&versions[2]), &versions[3], true, &mut spans);
        for pair in versions[3..].windows(2) {
            traces.put("store", Some(&pair[0]), &pair[1], true, &mut spans);
        }
        let (_, unseen) = self::traces(Sampler::AlwaysOn);
        let mut first_seen = Vec::new();
        unseen.put("store", None, &versions[2], true, &mut first_seen);
        for pair in versions[2..].windows(2) {
            unseen.put("store", Some(&pair[0]), &pair[1], true, &mut first_seen);
        }
        let times = |spans: &[SpanData]| {
            spans
                .iter()
                .map(|s| (s.name.clone(), s.start_time, s.end_time))
                .collect::<Vec<_>>()
        };
        assert_eq!(times(&spans), times(&first_seen));
        let prestart = named(&spans, "stage prestart")[0];
        assert_eq!((prestart.start_time, prestart.end_time), (time(2), time(3)));
        assert_eq!(
            attr(prestart, "taskgate.start_exact"),
            Some(Value::Bool(false))
        );
        let main = named(&spans, "stage main")[0];
        assert_eq!(attr(main, "taskgate.start_exact"), Some(Value::Bool(true)));
        // web was pending since registration, but when its gate closed
        // this replica did not see: the wait is as inexact.
        let web = named(&spans, "wait gate")[0];
        assert_eq!((web.start_time, web.end_time), (time(2), time(3)));
        assert_eq!(attr(web, "taskgate.start_exact"), Some(Value::Bool(false)));
    }

    /// An all-tasks restart closes every gate and replays the stages:
    /// each visit is a span of its own, the tasks wait again from when
    /// they reported pending.
    #[test]
    fn an_all_tasks_restart_replays_the_stages_each_its_own_span() {
        let versions = run_through("a1");
        let running = &versions[4]; // main, web running (second 4)
        let (restarted, _) = running
            .restart(RestartMode::AllTasks, "again", at(10), || 6)
            .unwrap();
        let mut v = versions[..5].to_vec();
        v.push(restarted.unwrap());
        for (n, task) in [0, 1, 2].into_iter().enumerate() {
            let next = report(v.last().unwrap(), task, RunState::Pending, 11 + n as i64);
            v.push(next);
        }
        assert_eq!(v.last().unwrap().state, CoordState::Prestart);
        let next = report(v.last().unwrap(), 0, RunState::Dead, 20);
        let next = report(&next, 1, RunState::Running, 21);
        v.push(next);
        assert_eq!(v.last().unwrap().state, CoordState::Main);
        let (_, traces) = traces(Sampler::AlwaysOn);
        let spans = publish(&traces, &v, |_| true);
        let stages: Vec<(String, SystemTime, SystemTime)> = spans
            .iter()
            .filter(|s| s.name.starts_with("stage "))
            .map(|s| (s.name.to_string(), s.start_time, s.end_time))
            .collect();
        assert_eq!(
            stages,
            [
                ("stage prestart".into(), time(0), time(3)),
                ("stage main".into(), time(3), time(4)),
                ("stage poststart".into(), time(4), time(10)),
                ("stage init".into(), time(10), time(13)),
                ("stage prestart".into(), time(13), time(21)),
            ]
        );
        let mut ids: Vec<[u8; 8]> = spans
            .iter()
            .map(|s| s.span_context.span_id().to_bytes())
            .collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), spans.len(), "distinct spans");
        // web reported pending at second 13 and waited for main from then.
        let web = named(&spans, "wait gate")
            .into_iter()
            .filter(|s| attr(s, "taskgate.task") == Some("web".into()))
            .map(|s| (s.start_time, s.end_time))
            .collect::<Vec<_>>();
        assert_eq!(web, [(time(0), time(3)), (time(13), time(21))]);
    }

    #[test]
    fn a_deletion_ends_the_open_stage_and_the_allocation() {
        let versions = run_through("a1");
        let (_, traces) = traces(Sampler::AlwaysOn);
        let mut spans = publish(&traces, &versions[..5], |_| true);
        traces.deleted("store", &versions[4], at(30), true, &mut spans);
        let last = spans.last().unwrap();
        assert_eq!(last.name, "allocation");
        assert_eq!(attr(last, "taskgate.deleted"), Some(Value::Bool(true)));
        assert_eq!((last.start_time, last.end_time), (time(0), time(30)));
        let cut = named(&spans, "stage poststart")[0];
        assert_eq!((cut.start_time, cut.end_time), (time(4), time(30)));
        assert_eq!(attr(cut, "taskgate.stage.next"), Some("deleted".into()));
        assert!(traces.open().is_empty());
        // A finished allocation's trace ended with it: its deletion adds
        // nothing.
        let (_, traces) = self::traces(Sampler::AlwaysOn);
        let mut spans = publish(&traces, &versions, |_| true);
        let n = spans.len();
        traces.deleted("store", versions.last().unwrap(), at(30), true, &mut spans);
        assert_eq!(spans.len(), n);
    }

    /// A deadline that passed and a task declared lost during a stage are
    /// events of its span, at the times of their changes.
    #[test]
    fn a_stage_s_deadline_and_lost_tasks_are_its_events() {
        let versions = run_through("a1");
        // Prestart, proxy running (second 2): its deadline passes at 2.5,
        // then the running tasks are lost at 2.75 (a TTL of 1 s).
        let mut late = versions[2].clone();
        late.modify_index += 1;
        late.modified_at = at(2) + time::Duration::milliseconds(500);
        let late = late.with_deadlines(
            None,
            Some(crate::lifecycle::Overdue {
                stage: Some((CoordState::Prestart, vec![0])),
                poststop: None,
            }),
        );
        let lost_at = at(2) + time::Duration::milliseconds(750);
        let lost = late
            .tick_lapsed(
                lost_at,
                &|_| None,
                &|i| (i == 1).then_some(at(2)),
                Some(Duration::from_secs(1)),
                || late.modify_index + 1,
            )
            .expect("proxy lost");
        assert_eq!(lost.state, CoordState::Prestart);
        let (_, traces) = traces(Sampler::AlwaysOn);
        let mut spans = publish(
            &traces,
            &[&versions[..3], &[late, lost.clone()]].concat(),
            |_| true,
        );
        // Deleted while still in prestart: the stage's span ends there.
        traces.deleted("store", &lost, at(3), true, &mut spans);
        let prestart = named(&spans, "stage prestart")[0];
        let events: Vec<(&str, SystemTime, Option<Value>)> = prestart
            .events
            .iter()
            .map(|e| {
                let what = e.attributes.first().map(|kv| kv.value.clone());
                (e.name.as_ref(), e.timestamp, what)
            })
            .collect();
        assert_eq!(
            events,
            [
                (
                    "deadline exceeded",
                    (at(2) + time::Duration::milliseconds(500)).into(),
                    Some("prestart".into())
                ),
                // init, running since second 1, outlived the TTL too.
                ("task lost", lost_at.into(), Some("init".into())),
                ("task lost", lost_at.into(), Some("proxy".into())),
            ]
        );
    }

    /// The sampler decides per trace: all of an allocation's spans or
    /// none, the same on every replica.
    #[test]
    fn the_sampler_keeps_or_drops_whole_traces() {
        let (_, off) = traces(Sampler::AlwaysOff);
        assert!(publish(&off, &run_through("a1"), |_| true).is_empty());
        let ratio = || Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(0.5)));
        let (_, one) = traces(ratio());
        let (_, two) = traces(ratio());
        let mut kept = 0;
        for n in 0..64 {
            let versions = run_through(&format!("alloc-{n}"));
            let spans = publish(&one, &versions, |_| true);
            assert!(spans.is_empty() || spans.len() == 9, "{}", spans.len());
            assert_eq!(spans.len(), publish(&two, &versions, |_| true).len());
            kept += usize::from(!spans.is_empty());
        }
        assert!((8..=56).contains(&kept), "{kept} of 64 kept at 0.5");
    }

    /// Two stores' allocations of one ID are two traces; an allocation
    /// registered again is a new one.
    #[test]
    fn the_trace_is_the_store_s_the_allocation_s_and_its_registration_s() {
        let a = five("a1");
        let id = |store: &str, a: &Allocation| Trace::of(store, a).id;
        assert_eq!(id("s1", &a), id("s1", &a));
        assert_ne!(id("s1", &a), id("s2", &a));
        let again = Allocation::register(a.id.clone(), a.spec.clone(), 7, T);
        assert_ne!(id("s1", &a), id("s1", &again));
    }

    /// A listing after a gap keeps what is open only for the allocations
    /// whose record is still the one last seen: the others' starts were
    /// not seen, and say so.
    #[test]
    fn a_listing_keeps_only_what_it_still_vouches_for() {
        let versions = run_through("a1");
        let other = run_through("a2");
        let (_, traces) = traces(Sampler::AlwaysOn);
        publish(&traces, &versions[..4], |_| true);
        publish(&traces, &other[..4], |_| true);
        // a1 moved on unseen (index 5 is listed); a2 did not; a3 is gone.
        let listed = HashMap::from([
            ("a1", versions[4].modify_index),
            ("a2", other[3].modify_index),
        ]);
        traces.listed(&listed);
        let mut spans = Vec::new();
        traces.put("store", Some(&versions[4]), &versions[5], true, &mut spans);
        traces.put("store", Some(&other[3]), &other[4], true, &mut spans);
        let exact: Vec<(Option<Value>, Option<Value>)> = named(&spans, "stage main")
            .iter()
            .chain(&named(&spans, "stage poststart"))
            .map(|s| {
                (
                    attr(s, "taskgate.alloc_id"),
                    attr(s, "taskgate.start_exact"),
                )
            })
            .collect();
        assert!(
            exact.contains(&(Some("a2".into()), Some(Value::Bool(true)))),
            "{exact:?}"
        );
        assert!(
            exact.contains(&(Some("a1".into()), Some(Value::Bool(false)))),
            "{exact:?}"
        );
    }

    /// A claim is taken once by the follower, and forgotten if the write
    /// never got there.
    #[test]
    fn a_claim_is_taken_once_or_forgotten() {
        let (_, traces) = traces(Sampler::AlwaysOn);
        let traces = Arc::new(traces);
        let claim = traces.claim(Own::Put(7));
        assert!(traces.owns(&Own::Put(7)));
        assert!(!traces.owns(&Own::Put(7)), "taken");
        drop(claim);
        let lost = traces.claim(Own::Delete(AllocId::parse("a1").unwrap()));
        drop(lost);
        assert!(!traces.owns(&Own::Delete(AllocId::parse("a1").unwrap())));
        assert!(traces.own().is_empty());
    }
}
