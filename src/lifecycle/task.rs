//! What an agent reports about one task, and how a report changes the
//! task's recorded status (timestamps, restart counting, the event ring).

use std::{collections::BTreeMap, sync::Arc};

use super::{
    Events, FieldError, Limits, MAX_EVENT_TYPE, Timestamp,
    intern::{EventBody, Sym},
};

named_enum! {
    /// The reported run state of a task. A task that never reported is
    /// `pending`.
    pub enum RunState ("task state") {
        Pending = "pending",
        Running = "running",
        Dead = "dead",
    }
}

/// One entry of a task's event history: what it says, stored once per
/// process however many events say it (`intern.rs`), and when. 16 bytes:
/// a million allocations' full histories are fifty million events.
#[derive(Clone, PartialEq, Eq)]
pub struct Event {
    body: Arc<EventBody>,
    /// UTC nanoseconds since 1970; `IN_BODY` for a time this cannot hold
    /// (an offset other than UTC, or outside the years 1678 to 2262),
    /// which its body holds instead.
    at: i64,
}

impl Event {
    /// `at` for a time the body holds.
    pub const IN_BODY: i64 = i64::MIN;

    pub fn new(kind: &str, time: Timestamp, message: &str, details: Details) -> Self {
        Self::with_body(EventBody::new(kind, message, details), time)
    }

    /// With a body already shared.
    pub fn with_body(body: Arc<EventBody>, time: Timestamp) -> Self {
        let at = (time.offset().is_utc())
            .then(|| i64::try_from(time.unix_timestamp_nanos()).ok())
            .flatten()
            .filter(|&at| at != Self::IN_BODY);
        match at {
            Some(at) => Self {
                body: body.at(None),
                at,
            },
            None => Self {
                body: body.at(Some(time)),
                at: Self::IN_BODY,
            },
        }
    }

    /// When it happened, as given.
    pub fn time(&self) -> Timestamp {
        match self.body.when.as_deref() {
            Some(t) if self.at == Self::IN_BODY => *t,
            _ => Timestamp::from_unix_timestamp_nanos(i128::from(self.at))
                .expect("64-bit nanoseconds are always a valid time"),
        }
    }

    /// With a time given as UTC nanoseconds since 1970, not `Self::IN_BODY`
    /// (which `with_body` takes from a `Timestamp`).
    pub fn at_utc_nanos(body: Arc<EventBody>, at: i64) -> Self {
        debug_assert_ne!(at, Self::IN_BODY);
        Self {
            body: body.at(None),
            at,
        }
    }

    /// Its time as UTC nanoseconds since 1970, when it is held so (a time
    /// given in UTC between the years 1678 and 2262): what a record
    /// writes, without the date arithmetic of `time()`.
    pub fn utc_nanos(&self) -> Option<i64> {
        (self.at != Self::IN_BODY).then_some(self.at)
    }

    /// What it says, shared.
    pub fn body(&self) -> &Arc<EventBody> {
        &self.body
    }

    /// What it says without its time: `body()`, unless the body holds the
    /// time (then the shared body with the same text and no time). Two
    /// live events say the same text exactly when these are one pointer.
    pub fn text_body(&self) -> Arc<EventBody> {
        if self.at == Self::IN_BODY {
            self.body.clone().at(None)
        } else {
            self.body.clone()
        }
    }
}

/// `event.kind`, `event.message`, `event.details`.
impl std::ops::Deref for Event {
    type Target = EventBody;

    fn deref(&self) -> &EventBody {
        &self.body
    }
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event")
            .field("kind", &self.kind)
            .field("time", &self.time())
            .field("message", &self.message)
            .field("details", &self.details)
            .finish()
    }
}

/// An event's details: string pairs in key order, each key once. A key is
/// shared (`Sym`); a value is its body's own, as the body is shared: most
/// values belong to one body (a `Started` event's pid), and keeping each
/// in the process's string table too cost a million full histories 320
/// MiB and a tenth of their start (see BENCHMARKS.md).
///
/// One block of pairs, not a `BTreeMap`: a map allocates a node with room
/// for eleven pairs (~540 bytes) for the one or two an event carries.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Details(Box<[(Sym, Box<str>)]>);

impl Details {
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// In key order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), &**v))
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        let i = self.0.binary_search_by(|(k, _)| k.as_str().cmp(key)).ok()?;
        Some(&self.0[i].1)
    }

    /// Pairs in any order; of equal keys the last one counts, as with a
    /// map.
    pub fn from_pairs<K: AsRef<str>, V: AsRef<str>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        let mut pairs: Vec<(K, V)> = pairs.into_iter().collect();
        // Stable: of equal keys the later stays later.
        pairs.sort_by(|a, b| a.0.as_ref().cmp(b.0.as_ref()));
        let mut out: Vec<(Sym, Box<str>)> = Vec::with_capacity(pairs.len());
        for (k, v) in &pairs {
            let (k, v) = (k.as_ref(), v.as_ref());
            match out.last_mut() {
                Some(last) if last.0 == k => last.1 = Box::from(v),
                _ => out.push((Sym::new(k), Box::from(v))),
            }
        }
        Self(out.into_boxed_slice())
    }
}

impl std::fmt::Debug for Details {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl serde::Serialize for Details {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.iter())
    }
}

/// An event as a client sends it: `time` defaults to the server's clock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventInput {
    pub kind: String,
    pub time: Option<Timestamp>,
    pub message: String,
    pub details: BTreeMap<String, String>,
}

/// One task-state report: the new state, the failed flag, maybe the
/// task's readiness, maybe an event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskReport {
    pub state: RunState,
    pub failed: bool,
    /// `Some(true)` only with `running` (checked by `validate`); `None`
    /// leaves a running task's readiness as it was.
    pub ready: Option<bool>,
    pub event: Option<EventInput>,
}

impl TaskReport {
    /// Appends a canonical encoding of the report to `out`: equal reports
    /// encode equally in every build and on every replica (for an
    /// idempotency key's request hash). Each field length-prefixed, in a
    /// fixed order.
    pub fn fingerprint_into(&self, out: &mut Vec<u8>) {
        fn put(out: &mut Vec<u8>, bytes: &[u8]) {
            out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            out.extend_from_slice(bytes);
        }
        put(out, self.state.as_str().as_bytes());
        out.push(u8::from(self.failed));
        out.push(match self.ready {
            None => 0,
            Some(false) => 1,
            Some(true) => 2,
        });
        match &self.event {
            None => out.push(0),
            Some(e) => {
                out.push(1);
                put(out, e.kind.as_bytes());
                match e.time {
                    None => out.push(0),
                    Some(t) => {
                        out.push(1);
                        out.extend_from_slice(&t.unix_timestamp_nanos().to_le_bytes());
                    }
                }
                put(out, e.message.as_bytes());
                out.extend_from_slice(&(e.details.len() as u64).to_le_bytes());
                for (k, v) in &e.details {
                    put(out, k.as_bytes());
                    put(out, v.as_bytes());
                }
            }
        }
    }

    /// Checks the size limits of the event. `prefix` is the path of this
    /// report in the request (empty for a single report).
    pub fn validate(&self, prefix: &str, limits: &Limits) -> Vec<FieldError> {
        let mut errors = Vec::new();
        if self.ready == Some(true) && self.state != RunState::Running {
            errors.push(FieldError::new(
                format!("{prefix}ready"),
                format!(
                    "ready: true is only valid with state \"running\", not \"{}\"",
                    self.state
                ),
            ));
        }
        let Some(event) = &self.event else {
            return errors;
        };
        let field = |name: &str| {
            if name.is_empty() {
                format!("{prefix}event")
            } else {
                format!("{prefix}event.{name}")
            }
        };
        let type_len = event.kind.chars().count();
        if type_len == 0 || type_len > MAX_EVENT_TYPE {
            errors.push(FieldError::new(
                field("type"),
                format!("must be 1 to {MAX_EVENT_TYPE} characters, got {type_len}"),
            ));
        }
        if json_len(&event.message) > limits.max_event_message {
            errors.push(FieldError::new(
                field("message"),
                format!(
                    "must be at most {} bytes as JSON, got {}",
                    limits.max_event_message,
                    json_len(&event.message)
                ),
            ));
        }
        if event.details.len() > limits.max_event_details {
            errors.push(FieldError::new(
                field("details"),
                format!(
                    "must have at most {} entries, got {}",
                    limits.max_event_details,
                    event.details.len()
                ),
            ));
        }
        for (key, value) in &event.details {
            if json_len(key) > limits.max_detail_key {
                errors.push(FieldError::new(
                    field("details"),
                    format!(
                        "keys must be at most {} bytes as JSON, got {} in a key starting {:?}",
                        limits.max_detail_key,
                        json_len(key),
                        key.chars().take(16).collect::<String>()
                    ),
                ));
            }
            if json_len(value) > limits.max_detail_value {
                errors.push(FieldError::new(
                    field(&format!(
                        "details.{}",
                        key.chars().take(64).collect::<String>()
                    )),
                    format!(
                        "must be at most {} bytes as JSON, got {}",
                        limits.max_detail_value,
                        json_len(value)
                    ),
                ));
            }
        }
        let bytes = json_len(&event.kind)
            + json_len(&event.message)
            + event
                .details
                .iter()
                .map(|(k, v)| json_len(k) + json_len(v))
                .sum::<usize>();
        if bytes > limits.max_event_bytes {
            errors.push(FieldError::new(
                field(""),
                format!(
                    "an event (type, message, details keys and values) must be at most {} bytes as JSON, got {bytes}",
                    limits.max_event_bytes
                ),
            ));
        }
        errors
    }
}

/// The bytes `s` takes as a JSON string's contents, as the server writes
/// it: a limit counts what an answer carries, so that a control character
/// (`\u0001`, six bytes) cannot make an event six times its limit.
pub fn json_len(s: &str) -> usize {
    s.bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 2,
            0..=0x1f => 6,
            _ => 1,
        })
        .sum()
}

/// Everything recorded about one task. Derived facts (its gate, its stop
/// order) are not stored here; see `Allocation`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskStatus {
    pub state: RunState,
    pub failed: bool,
    /// Times the task went back to `pending` after running or dying.
    pub restarts: u64,
    pub started_at: Option<Timestamp>,
    pub finished_at: Option<Timestamp>,
    pub last_restart: Option<Timestamp>,
    /// The most recent events, oldest first, at most `MAX_EVENTS`.
    pub events: Events,
    /// Restart orders given to this task; only goes up.
    pub restart_generation: u64,
    /// Whether the task says it is ready (only ever while `running`).
    pub ready: bool,
    /// The last time the task became ready.
    pub ready_at: Option<Timestamp>,
    /// From a restart order until the task's next report: its state is
    /// from before the order and does not count toward stop orders.
    pub stale: bool,
    /// Global index of the last change that touched this task.
    pub modify_index: u64,
    /// The current run, while `running`: the index of the change that made
    /// the task `running`. Never reused, since indexes only go up, across
    /// deletions and restarts too.
    pub run: Option<u64>,
    /// An operator's restore was made after the task died, or it died,
    /// not failed, while an all-tasks restart was owed to it
    /// (`apply_owing`): a report may take it out of `dead` (as after an
    /// all-tasks restart, which leaves it `stale`). Cleared when it leaves
    /// `dead` or dies again.
    pub reopened: bool,
    /// What few tasks carry (a loss, idempotency keys), out of line: the
    /// others pay one pointer for it, and a new version of the record
    /// copies one pointer.
    pub extra: Option<Arc<TaskExtra>>,
}

/// The event a lost task gets.
pub const LOST_EVENT: &str = "Agent Lost";

/// Idempotency keys a task keeps: a retry comes right after its first
/// try, so the last few writes are all it can be a retry of.
pub const MAX_KEYS: usize = 4;

/// The rarer part of a task's record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TaskExtra {
    /// When the task was declared lost: its agent gave no sign of life
    /// within its TTL while it ran.
    pub lost_at: Option<Timestamp>,
    /// The keyed writes that changed this task most recently, oldest
    /// first, at most `MAX_KEYS`.
    pub keys: Vec<IdemKey>,
    /// Whether each of the task's dependencies holds, parallel to its
    /// spec's `depends_on` (empty when it has none).
    pub deps: Vec<super::DepState>,
    /// Where it stands with the semaphores its spec acquires (none: not
    /// in line).
    pub hold: Option<super::Hold>,
    /// Where it stands with the barrier its spec names (none: not
    /// arrived).
    pub meet: Option<super::Meet>,
}

/// A write's `Idempotency-Key` and the request it came with, each as a
/// stable 64-bit hash (the same on every replica and across restarts).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IdemKey {
    pub key: u64,
    pub request: u64,
}

/// What a task's kept keys say of a write carrying `IdemKey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeySeen {
    /// Not seen: apply the write.
    New,
    /// Seen with the same request: a retry, already applied.
    Retry,
    /// Seen with another request: the client reused a key.
    Reused,
}

impl TaskStatus {
    /// A task that has never reported.
    pub fn new(index: u64) -> Self {
        Self {
            state: RunState::Pending,
            failed: false,
            restarts: 0,
            started_at: None,
            finished_at: None,
            last_restart: None,
            events: Events::default(),
            restart_generation: 0,
            ready: false,
            ready_at: None,
            stale: false,
            modify_index: index,
            run: None,
            reopened: false,
            extra: None,
        }
    }

    /// Whether a report may take the task out of `dead`: an all-tasks
    /// restart (it is `stale`) or an operator's restore (`reopened`) came
    /// after it died.
    pub fn may_leave_dead(&self) -> bool {
        self.stale || self.reopened
    }

    /// When the task was declared lost, if it was (and not revived since).
    pub fn lost_at(&self) -> Option<Timestamp> {
        self.extra.as_ref().and_then(|e| e.lost_at)
    }

    pub fn lost(&self) -> bool {
        self.lost_at().is_some()
    }

    /// Whether each dependency holds (parallel to the spec's
    /// `depends_on`; empty when the task has none).
    pub fn deps(&self) -> &[super::DepState] {
        self.extra.as_deref().map_or(&[], |e| &e.deps)
    }

    /// Whether every dependency holds.
    pub fn unblocked(&self) -> bool {
        self.deps().iter().all(super::DepState::holds)
    }

    /// Sets the dependencies' states.
    pub fn set_deps(&mut self, deps: Vec<super::DepState>) {
        if self.deps() != deps.as_slice() {
            self.extra_mut().deps = deps;
            self.trim_extra();
        }
    }

    /// Where the task stands with its semaphores.
    pub fn hold(&self) -> Option<super::Hold> {
        self.extra.as_deref().and_then(|e| e.hold)
    }

    /// The fence of its grant, while it holds its semaphores.
    pub fn fence(&self) -> Option<u64> {
        match self.hold() {
            Some(super::Hold::Granted { fence, .. }) => Some(fence),
            _ => None,
        }
    }

    /// Sets where the task stands with its semaphores.
    pub fn set_hold(&mut self, hold: Option<super::Hold>) {
        if self.hold() != hold {
            self.extra_mut().hold = hold;
            self.trim_extra();
        }
    }

    /// Where the task stands with its barrier.
    pub fn meet(&self) -> Option<super::Meet> {
        self.extra.as_deref().and_then(|e| e.meet)
    }

    /// Sets where the task stands with its barrier.
    pub fn set_meet(&mut self, meet: Option<super::Meet>) {
        if self.meet() != meet {
            self.extra_mut().meet = meet;
            self.trim_extra();
        }
    }

    /// The idempotency keys kept, oldest first.
    pub fn keys(&self) -> &[IdemKey] {
        self.extra.as_deref().map_or(&[], |e| &e.keys)
    }

    /// What this task's keys say of `key`.
    pub fn seen(&self, key: IdemKey) -> KeySeen {
        match self.keys().iter().find(|k| k.key == key.key) {
            None => KeySeen::New,
            Some(k) if k.request == key.request => KeySeen::Retry,
            Some(_) => KeySeen::Reused,
        }
    }

    fn extra_mut(&mut self) -> &mut TaskExtra {
        Arc::make_mut(self.extra.get_or_insert_with(Default::default))
    }

    /// Drops the out-of-line part once it holds nothing.
    fn trim_extra(&mut self) {
        if self.extra.as_deref() == Some(&TaskExtra::default()) {
            self.extra = None;
        }
    }

    /// Keeps `key` as the newest, dropping the oldest beyond `MAX_KEYS`.
    pub fn remember(&mut self, key: IdemKey) {
        let keys = &mut self.extra_mut().keys;
        keys.retain(|k| k.key != key.key);
        if keys.len() == MAX_KEYS {
            keys.remove(0);
        }
        keys.push(key);
    }

    /// Forgets the idempotency keys kept (the run they were written in is
    /// over).
    pub fn forget_keys(&mut self) {
        if !self.keys().is_empty() {
            self.extra_mut().keys.clear();
            self.trim_extra();
        }
    }

    /// The task's agent gave no sign of life within `ttl` (the last one
    /// at `last_seen`): it is dead, failed and lost, as one change.
    pub fn lose(&mut self, now: Timestamp, ttl: std::time::Duration, last_seen: Timestamp) {
        let shown = crate::units::format_duration(ttl);
        self.state = RunState::Dead;
        self.failed = true;
        self.ready = false;
        self.stale = false;
        self.reopened = false;
        if self.finished_at.is_none() {
            self.finished_at = Some(now);
        }
        self.extra_mut().lost_at = Some(now);
        let last_seen = last_seen
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default();
        self.push_event(Event::new(
            LOST_EVENT,
            now,
            &format!("no sign of life for {shown}"),
            Details::from_pairs([("last_seen", last_seen.as_str()), ("ttl", shown.as_str())]),
        ));
    }

    /// A lost task made `pending` again (an all-tasks restart, a restore
    /// that does not name it): it waits for a new agent. Counts as a
    /// restart, as any return to `pending` does.
    pub fn revive(&mut self, now: Timestamp) {
        self.extra_mut().lost_at = None;
        self.trim_extra();
        self.state = RunState::Pending;
        self.failed = false;
        self.restarts += 1;
        self.last_restart = Some(now);
    }

    /// Clears `lost` only (a restore that gives the task a state).
    pub(super) fn forget_loss(&mut self) {
        if self.lost() {
            self.extra_mut().lost_at = None;
            self.trim_extra();
        }
    }

    /// `dead` and not failed.
    pub fn successful(&self) -> bool {
        self.state == RunState::Dead && !self.failed
    }

    /// `running`, and ready when `readiness` is declared: what a prestart
    /// sidecar is waited on for before `main` opens.
    pub fn up(&self, readiness: bool) -> bool {
        self.state == RunState::Running && (self.ready || !readiness)
    }

    /// Applies a report with the rules of docs/lifecycle.md, to a task
    /// that owes no all-tasks restart: `apply_owing` with `false` (the
    /// tests' shorthand; an allocation knows what its tasks owe).
    #[cfg(test)]
    pub fn apply(&mut self, report: &TaskReport, now: Timestamp) {
        self.apply_owing(report, now, false);
    }

    /// Applies a report with the rules of docs/lifecycle.md. A report with
    /// the same state, the same flag, the same readiness and no event
    /// leaves the status untouched (unless it is the task's first report
    /// after a restart order, which makes its state count again). A lost
    /// task takes no report (the registry refuses it first); a restore
    /// clears the loss before it applies.
    ///
    /// `all_tasks`: the order a stale task owes is an all-tasks restart
    /// (its allocation is back in `init`, where only such an order puts
    /// it). A `dead` report then counts, but one that is not a failure
    /// does not use the order up: the task may still leave `dead` once
    /// (`reopened`). Its agent may have sent it before it heard of the
    /// order (its task ended as the order was made, or the order came
    /// between its two reports of one end), and runs the task again once
    /// it does. A failure is final: it tells the others to stop ("Sibling
    /// Task Failed"), so a run its agent began again would be told to
    /// stop before it starts, and the report of that would lose the
    /// failure. A one-task or running-tasks restart never names a dead
    /// task: a death reported after one uses it up.
    pub fn apply_owing(&mut self, report: &TaskReport, now: Timestamp, all_tasks: bool) {
        if self.lost() {
            return;
        }
        let from = self.state;
        let to = report.state;
        let order_stands = all_tasks && self.stale && to == RunState::Dead && !report.failed;
        if from != to && (from == RunState::Dead || to == RunState::Dead) {
            self.reopened = false;
        }
        if from != to {
            match to {
                RunState::Running => self.started_at = Some(now),
                RunState::Dead => {
                    if self.finished_at.is_none() {
                        self.finished_at = Some(now);
                    }
                }
                RunState::Pending => {
                    self.restarts += 1;
                    self.last_restart = Some(now);
                }
            }
        }
        self.state = to;
        self.failed = report.failed;
        self.stale = false;
        self.reopened |= order_stands;
        match (to, report.ready) {
            (RunState::Running, Some(true)) => {
                if !self.ready {
                    self.ready = true;
                    self.ready_at = Some(now);
                }
            }
            (RunState::Running, None) => {}
            // `ready: false`, or out of `running`.
            _ => self.ready = false,
        }
        if let Some(e) = &report.event {
            self.push_event(Event::new(
                &e.kind,
                e.time.unwrap_or(now),
                &e.message,
                Details::from_pairs(&e.details),
            ));
        }
    }

    /// Appends an event, dropping the oldest beyond `MAX_EVENTS`.
    pub fn push_event(&mut self, event: Event) {
        self.events.push(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifecycle::MAX_EVENTS;
    use time::macros::datetime;

    /// An event is 16 bytes, and any time comes back exactly as given,
    /// offset and all: those it cannot hold itself its body holds.
    #[test]
    fn an_event_is_16_bytes_and_keeps_any_time_exactly() {
        assert_eq!(std::mem::size_of::<Event>(), 16);
        let sentinel = Timestamp::from_unix_timestamp_nanos(i128::from(i64::MIN)).unwrap();
        let times = [
            datetime!(2026-11-26 10:00:00.123456789 UTC),
            datetime!(2026-11-26 10:00:00.123456789 +05:30),
            datetime!(2026-11-26 10:00:00.123456789 -00:00:01),
            datetime!(1970-01-01 0:00 UTC),
            datetime!(9999-12-31 23:59:59.999999999 UTC),
            datetime!(-9999-01-01 0:00 UTC),
            datetime!(1600-01-01 0:00 +01:00),
            sentinel,
            sentinel + time::Duration::NANOSECOND,
        ];
        let mut events = Vec::new();
        for t in times {
            let e = Event::new("Started", t, "m", Details::default());
            assert_eq!(e.time(), t);
            assert_eq!(e.time().offset(), t.offset(), "{t}");
            // The same body from another event keeps each event's time.
            let again = Event::with_body(e.body().clone(), times[0]);
            assert_eq!(again.time(), times[0]);
            assert_eq!(again.time().offset(), times[0].offset());
            events.push(e);
        }
        for (e, t) in events.iter().zip(times) {
            assert_eq!((e.time(), e.time().offset()), (t, t.offset()));
            assert_eq!(&*e.kind, "Started");
        }
    }

    const T0: Timestamp = datetime!(2026-11-21 10:00 UTC);
    const T1: Timestamp = datetime!(2026-11-21 10:01 UTC);
    const T2: Timestamp = datetime!(2026-11-21 10:02 UTC);

    fn report(state: RunState) -> TaskReport {
        TaskReport {
            state,
            failed: false,
            ready: None,
            event: None,
        }
    }

    fn ready(ready: bool) -> TaskReport {
        TaskReport {
            ready: Some(ready),
            ..report(RunState::Running)
        }
    }

    #[test]
    fn added_events_are_found_in_any_copy_of_the_history() {
        let mut t = TaskStatus::new(1);
        for i in 0..MAX_EVENTS {
            let mut r = report(RunState::Running);
            r.event = Some(event(&format!("e{i}")));
            t.apply(&r, T0);
        }
        let prev = t.events.clone();
        let mut r = report(RunState::Running);
        r.event = Some(event("new"));
        t.apply(&r, T1);
        let kinds = |v: Vec<Event>| v.iter().map(|e| e.kind.to_string()).collect::<Vec<_>>();
        assert_eq!(kinds(t.events.added_since(&prev)), ["new"]);
        // A decoded copy is another block: compared by value.
        let copy: Events = prev.all().iter().cloned().collect();
        assert_eq!(kinds(t.events.added_since(&copy)), ["new"]);
        assert!(t.events.added_since(&t.events.clone()).is_empty());
        let same: Events = t.events.all().iter().cloned().collect();
        assert!(t.events.added_since(&same).is_empty(), "compared by value");
        assert_eq!(t.events.added_since(&Events::default()).len(), MAX_EVENTS);
    }

    #[test]
    fn readiness_holds_while_running_until_said_otherwise() {
        let mut t = TaskStatus::new(1);
        t.apply(&report(RunState::Running), T0);
        assert!(!t.ready && t.ready_at.is_none(), "running is not ready");
        t.apply(&ready(true), T1);
        assert_eq!((t.ready, t.ready_at), (true, Some(T1)));
        let before = t.clone();
        t.apply(&ready(true), T2);
        assert_eq!(t, before, "ready again changes nothing, not ready_at");
        t.apply(&report(RunState::Running), T2);
        assert!(t.ready, "a report without `ready` keeps it");
        t.apply(&ready(false), T2);
        assert!(!t.ready);
        assert_eq!(
            t.ready_at,
            Some(T1),
            "ready_at is the last time it became ready"
        );
        t.apply(&ready(true), T2);
        t.apply(&report(RunState::Pending), T2);
        assert!(!t.ready, "leaving running clears readiness");
        t.apply(&report(RunState::Running), T2);
        assert!(!t.ready, "a new run starts not ready");
    }

    #[test]
    fn ready_true_is_only_valid_with_running() {
        let limits = Limits::default();
        let mut r = ready(true);
        assert!(r.validate("", &limits).is_empty());
        for state in [RunState::Pending, RunState::Dead] {
            r.state = state;
            let errors = r.validate("tasks.web.", &limits);
            assert_eq!(errors.len(), 1, "{errors:?}");
            assert_eq!(errors[0].field, "tasks.web.ready");
        }
        r.ready = Some(false);
        assert!(
            r.validate("", &limits).is_empty(),
            "ready: false goes with any state"
        );
    }

    #[test]
    fn any_report_makes_a_stale_state_count_again_and_a_death_may_keep_an_all_tasks_restart() {
        let failed = TaskReport {
            failed: true,
            ..report(RunState::Dead)
        };
        for all_tasks in [false, true] {
            for (from, to) in [
                (RunState::Dead, report(RunState::Pending)),
                (RunState::Running, report(RunState::Running)),
                (RunState::Pending, report(RunState::Pending)),
                (RunState::Dead, report(RunState::Dead)),
                (RunState::Running, report(RunState::Dead)),
                (RunState::Running, failed.clone()),
            ] {
                let case = format!("{from:?} → {to:?}, all tasks: {all_tasks}");
                let mut t = TaskStatus::new(1);
                t.apply(&report(from), T0);
                t.stale = true;
                t.apply_owing(&to, T1, all_tasks);
                assert!(!t.stale, "{case}");
                // Dead, not failed, while an all-tasks restart was owed:
                // it may still leave `dead`, once.
                let kept = all_tasks && to.state == RunState::Dead && !to.failed;
                assert_eq!(t.may_leave_dead(), kept, "{case}");
                if from == RunState::Dead {
                    assert_eq!(t.finished_at, Some(T0), "{case}");
                }
                t.apply(&report(RunState::Pending), T1);
                t.apply_owing(&report(RunState::Dead), T1, all_tasks);
                assert!(!t.may_leave_dead(), "{case}, then a death of its own");
            }
        }
    }

    fn event(kind: &str) -> EventInput {
        EventInput {
            kind: kind.into(),
            time: None,
            message: String::new(),
            details: BTreeMap::new(),
        }
    }

    #[test]
    fn started_at_moves_on_each_start_and_finished_at_is_kept() {
        let mut t = TaskStatus::new(1);
        t.apply(&report(RunState::Running), T0);
        assert_eq!(t.started_at, Some(T0));
        t.apply(&report(RunState::Dead), T1);
        assert_eq!(t.finished_at, Some(T1));
        t.apply(&report(RunState::Pending), T2);
        assert_eq!((t.restarts, t.last_restart), (1, Some(T2)));
        t.apply(&report(RunState::Running), T2);
        assert_eq!(t.started_at, Some(T2), "started_at moves on");
        t.apply(&report(RunState::Dead), T2);
        assert_eq!(
            t.finished_at,
            Some(T1),
            "finished_at is never cleared or moved"
        );
    }

    #[test]
    fn running_to_running_does_not_move_started_at() {
        let mut t = TaskStatus::new(1);
        t.apply(&report(RunState::Running), T0);
        t.apply(&report(RunState::Running), T1);
        assert_eq!(t.started_at, Some(T0));
    }

    #[test]
    fn only_going_back_to_pending_counts_a_restart() {
        let mut t = TaskStatus::new(1);
        t.apply(&report(RunState::Pending), T0);
        assert_eq!(t.restarts, 0, "pending to pending is no restart");
        t.apply(&report(RunState::Running), T0);
        t.apply(&report(RunState::Pending), T1);
        t.apply(&report(RunState::Dead), T1);
        t.apply(&report(RunState::Pending), T2);
        assert_eq!(t.restarts, 2);
        assert_eq!(t.last_restart, Some(T2));
    }

    #[test]
    fn events_keep_the_ten_most_recent_oldest_first() {
        let mut t = TaskStatus::new(1);
        for i in 0..13 {
            let mut r = report(RunState::Running);
            r.event = Some(event(&format!("e{i}")));
            t.apply(&r, T0);
        }
        let events = t.events.all();
        let kinds: Vec<_> = events.iter().map(|e| e.kind.as_str()).collect();
        assert_eq!(
            kinds,
            [
                "e3", "e4", "e5", "e6", "e7", "e8", "e9", "e10", "e11", "e12"
            ]
        );
    }

    #[test]
    fn a_copied_status_shares_its_history_and_a_new_event_copies_no_event() {
        let mut t = TaskStatus::new(1);
        for i in 0..MAX_EVENTS {
            let mut r = report(RunState::Running);
            r.event = Some(event(&format!("e{i}")));
            t.apply(&r, T0);
        }
        let copy = t.clone();
        let (a, b) = (t.events.made().unwrap(), copy.events.made().unwrap());
        assert!(Arc::ptr_eq(a, b), "a copy is one pointer, not ten events");

        let mut next = copy.clone();
        let mut r = report(RunState::Running);
        r.event = Some(event("e10"));
        next.apply(&r, T1);
        let old = t.events.made().unwrap();
        let new = next.events.made().unwrap();
        assert_eq!(new.len(), MAX_EVENTS);
        for (o, n) in old[1..].iter().zip(new.iter()) {
            assert!(
                Arc::ptr_eq(o.body(), n.body()),
                "the kept events share their bodies"
            );
        }
        assert_eq!(next.events.last().unwrap().kind, "e10");
        assert_eq!(t.events.len(), MAX_EVENTS, "the old version is untouched");
        assert_eq!(t.events.all()[0].kind, "e0");
    }

    #[test]
    fn histories_compare_by_content_whoever_holds_them() {
        let e = |k: &str| Event::new(k, T0, "", Details::default());
        let a: Events = [e("a"), e("b")].into_iter().collect();
        let b: Events = [e("a"), e("b")].into_iter().collect();
        assert_eq!(a, b, "equal contents in separate blocks");
        assert_ne!(a, [e("a")].into_iter().collect::<Events>());
        assert_ne!(a, [e("a"), e("c")].into_iter().collect::<Events>());
        let none: Events = std::iter::empty().collect();
        assert_eq!(none, Events::default());
        assert!(
            none.is_empty() && none.made().is_none(),
            "no block for nothing"
        );
        assert_eq!(
            a.all().iter().map(|e| e.kind.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
    }

    #[test]
    fn details_are_kept_in_key_order_and_a_repeated_key_keeps_its_last_value() {
        let pair = |k: &str, v: &str| (k.to_owned(), v.to_owned());
        let d = Details::from_pairs([("signal", "9"), ("exit_code", "1"), ("signal", "15")]);
        assert_eq!(
            d.iter().collect::<Vec<_>>(),
            [("exit_code", "1"), ("signal", "15")]
        );
        assert_eq!(
            (d.get("signal"), d.get("exit_code"), d.get("x")),
            (Some("15"), Some("1"), None)
        );
        let map: BTreeMap<String, String> = [pair("b", "2"), pair("a", "1")].into();
        let from_map = Details::from_pairs(&map);
        assert_eq!(from_map.len(), 2);
        // Written as a JSON object, as the map is.
        assert_eq!(
            serde_json::to_value(&from_map).unwrap(),
            serde_json::to_value(&map).unwrap()
        );
        assert!(Details::default().is_empty());
        assert_eq!(format!("{from_map:?}"), r#"{"a": "1", "b": "2"}"#);
    }

    #[test]
    fn an_event_without_time_gets_the_server_time() {
        let mut t = TaskStatus::new(1);
        let mut r = report(RunState::Running);
        r.event = Some(event("Started"));
        t.apply(&r, T1);
        let mut given = event("Other");
        given.time = Some(T0);
        r.event = Some(given);
        t.apply(&r, T2);
        assert_eq!(t.events.all()[0].time(), T1);
        assert_eq!(t.events.all()[1].time(), T0);
    }

    #[test]
    fn a_report_that_changes_nothing_leaves_the_status_equal() {
        let mut t = TaskStatus::new(1);
        t.apply(&report(RunState::Running), T0);
        let before = t.clone();
        t.apply(&report(RunState::Running), T1);
        assert_eq!(t, before);
    }

    #[test]
    fn validate_names_each_oversized_field() {
        let limits = Limits {
            max_event_message: 3,
            max_event_details: 1,
            ..Limits::default()
        };
        let mut e = event(&"x".repeat(MAX_EVENT_TYPE + 1));
        e.message = "four".into();
        e.details = [("a".into(), "1".into()), ("b".into(), "2".into())].into();
        let r = TaskReport {
            state: RunState::Dead,
            failed: false,
            event: Some(e),
            ready: None,
        };
        let fields: Vec<_> = r
            .validate("tasks.web.", &limits)
            .into_iter()
            .map(|e| e.field)
            .collect();
        assert_eq!(
            fields,
            [
                "tasks.web.event.type",
                "tasks.web.event.message",
                "tasks.web.event.details"
            ]
        );
        let mut ok = r.clone();
        ok.event = Some(event("Started"));
        assert!(ok.validate("", &limits).is_empty());
        // Bytes: a key, a value, the whole event.
        let limits = Limits {
            max_detail_key: 4,
            max_detail_value: 5,
            max_event_bytes: 20,
            ..Limits::default()
        };
        let mut sized = event("Killed");
        sized.details = [
            ("long-key".into(), "v".into()),
            ("k".into(), "too long".into()),
        ]
        .into();
        let errors = TaskReport {
            state: RunState::Dead,
            failed: false,
            event: Some(sized.clone()),
            ready: None,
        }
        .validate("", &limits);
        let fields: Vec<_> = errors.iter().map(|e| e.field.as_str()).collect();
        // Details in key order: "k" before "long-key".
        assert_eq!(
            fields,
            ["event.details.k", "event.details", "event"],
            "{errors:?}"
        );
        assert!(errors[1].message.contains("at most 4 bytes"), "{errors:?}");
        assert!(
            errors[2]
                .message
                .contains("at most 20 bytes as JSON, got 24"),
            "{errors:?}"
        );
        sized.details = [("k".into(), "v".into())].into();
        let fits = TaskReport {
            state: RunState::Dead,
            failed: false,
            event: Some(sized),
            ready: None,
        };
        assert!(fits.validate("", &limits).is_empty());
        let mut empty = r;
        empty.event = Some(event(""));
        assert_eq!(empty.validate("", &limits)[0].field, "event.type");
    }

    #[test]
    fn limits_count_the_bytes_the_json_takes() {
        assert_eq!(json_len("abc"), 3);
        assert_eq!(json_len("a\"b\\c\n"), 9);
        assert_eq!(json_len("\u{1}"), 6);
        assert_eq!(json_len("é"), 2, "UTF-8 is written as it is");
        // A message of control characters within 4 KiB of UTF-8, six times
        // that as JSON: refused, naming the JSON size.
        let mut e = event("Started");
        e.message = "\u{1}".repeat(1000);
        let r = TaskReport {
            state: RunState::Running,
            failed: false,
            ready: None,
            event: Some(e),
        };
        let errors = r.validate("", &Limits::default());
        assert_eq!(errors[0].field, "event.message", "{errors:?}");
        assert!(
            errors[0].message.contains("4096 bytes as JSON, got 6000"),
            "{errors:?}"
        );
        // Rendered, the refused message would have been what the limit says.
        let rendered = serde_json::to_string(&"\u{1}".repeat(1000)).unwrap();
        assert_eq!(rendered.len() - 2, 6000);
    }

    #[test]
    fn run_state_names_are_exact() {
        let names: Vec<_> = RunState::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(names, ["pending", "running", "dead"]);
    }

    #[test]
    fn an_event_is_a_body_pointer_and_a_time() {
        assert!(
            std::mem::size_of::<Event>() <= 24,
            "{}",
            std::mem::size_of::<Event>()
        );
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        /// Strings from a few (so events share them) or any.
        fn text() -> impl Strategy<Value = String> {
            prop_oneof![
                prop::sample::select(vec!["", "Started", "Exit Code: 0", "exit_code", "0"])
                    .prop_map(str::to_owned),
                "\\PC{0,12}",
            ]
        }

        fn input() -> impl Strategy<Value = EventInput> {
            (
                text(),
                text(),
                prop::collection::btree_map(text(), text(), 0..4),
                prop::option::of(0i64..4_000_000_000),
            )
                .prop_map(|(kind, message, details, secs)| EventInput {
                    kind,
                    time: secs.map(|s| Timestamp::from_unix_timestamp(s).unwrap()),
                    message,
                    details,
                })
        }

        proptest! {
            /// What is read back of a history (kept in shared bodies and
            /// strings) is what was reported.
            #[test]
            fn reported_events_read_back_as_reported(
                inputs in prop::collection::vec(input(), 1..(2 * MAX_EVENTS))
            ) {
                let mut t = TaskStatus::new(1);
                for e in &inputs {
                    let mut r = report(RunState::Running);
                    r.event = Some(e.clone());
                    t.apply(&r, T0);
                }
                let kept = &inputs[inputs.len().saturating_sub(MAX_EVENTS)..];
                let read = |events: &Events| -> Vec<EventInput> {
                    events
                        .all()
                        .iter()
                        .map(|e| EventInput {
                            kind: e.kind.to_string(),
                            time: Some(e.time()),
                            message: e.message.to_string(),
                            details: e
                                .details
                                .iter()
                                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                                .collect(),
                        })
                        .collect()
                };
                let expected: Vec<EventInput> = kept
                    .iter()
                    .map(|e| EventInput { time: Some(e.time.unwrap_or(T0)), ..e.clone() })
                    .collect();
                prop_assert_eq!(read(&t.events), expected);
            }
        }
    }
}
