//! Request bodies as clients send them, and their conversion into the
//! validated domain types ("parse, don't validate"). Decoding rejects
//! unknown, duplicate and missing fields (`invalid_json`); the rules that
//! need the whole value (identifiers, limits, one leader) come after
//! (`invalid_request`), each with the path of its field.

use std::{fmt, marker::PhantomData};

use serde::{
    Deserialize, Deserializer,
    de::{MapAccess, Visitor},
};
use time::OffsetDateTime;
use utoipa::ToSchema;

use crate::lifecycle::{
    AllocId, AllocSpec, BarrierSpec, Condition, Deadlines, Dependency, EventInput, FieldError,
    Hook, Lifecycle, Limits, MAX_ACQUIRE, MAX_EVENT_DETAILS, RunState, SemName, TaskName,
    TaskReport, TaskSpec,
};

/// A JSON object whose keys must be unique, kept in the order sent, of at
/// most `MAX` entries. Decoding stops at the first entry past `MAX`, and
/// each key is checked against a hash set of those before it, so a body
/// with tens of thousands of keys costs no more than reading it (a
/// pairwise check is quadratic in the keys).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UniqueMap<V, const MAX: usize>(pub Vec<(String, V)>);

impl<V, const MAX: usize> Default for UniqueMap<V, MAX> {
    fn default() -> Self {
        Self(Vec::new())
    }
}

impl<'de, V: Deserialize<'de>, const MAX: usize> Deserialize<'de> for UniqueMap<V, MAX> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V_<V, const MAX: usize>(PhantomData<V>);
        impl<'de, V: Deserialize<'de>, const MAX: usize> Visitor<'de> for V_<V, MAX> {
            type Value = UniqueMap<V, MAX>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "an object of at most {MAX} entries")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out: Vec<(String, V)> = Vec::new();
                let mut seen = std::collections::HashSet::new();
                while let Some(key) = map.next_key::<String>()? {
                    if out.len() == MAX {
                        return Err(serde::de::Error::custom(format!(
                            "more than {MAX} entries (the limit)"
                        )));
                    }
                    if !seen.insert(key.clone()) {
                        return Err(serde::de::Error::custom(format!("duplicate key `{key}`")));
                    }
                    let value = map.next_value()?;
                    out.push((key, value));
                }
                Ok(UniqueMap(out))
            }
        }
        d.deserialize_map(V_::<V, MAX>(PhantomData))
    }
}

/// Most tasks a batch report may name: an allocation has at most this many
/// (`Limits::max_tasks` by default).
const MAX_TASKS: usize = 256;

/// A count as a client sent it: JSON has one kind of number, and `2.0` is
/// the integer 2 (as its schema's `integer` says). `None` for a fraction, a
/// negative number or one past `u64`.
pub fn whole(n: &serde_json::Number) -> Option<u64> {
    n.as_u64().or_else(|| {
        n.as_f64()
            .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < u64::MAX as f64)
            .map(|f| f as u64)
    })
}

/// Implements `Deserialize` for request bodies so that they accept only a
/// JSON object. serde's derive also takes an array of the fields in order
/// (`["running"]` as a report), which is not in the contract. Each type
/// derives with `#[serde(remote = "Self")]`, which makes the derived code
/// an inherent `deserialize` function that the impl below calls with the
/// object's entries.
macro_rules! objects_only {
    ($($t:ty),* $(,)?) => {$(
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct ObjectVisitor;
                impl<'de> Visitor<'de> for ObjectVisitor {
                    type Value = $t;
                    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                        f.write_str("a JSON object")
                    }
                    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<$t, A::Error> {
                        <$t>::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    }
                }
                d.deserialize_map(ObjectVisitor)
            }
        }
    )*};
}

objects_only!(
    RegisterBody,
    TaskSpecBody,
    LifecycleBody,
    LivenessBody,
    BarrierBody,
    DeadlinesBody,
    DependencyBody,
    ReportBody,
    EventBody,
    BatchBody,
    RestartBody,
);

/// `PUT /v1/allocations/{alloc_id}`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(remote = "Self", deny_unknown_fields)]
#[schema(example = json!({"tasks": [
    {"name": "init", "lifecycle": {"hook": "prestart"}},
    {"name": "proxy", "lifecycle": {"hook": "prestart", "sidecar": true}, "readiness": true},
    {"name": "web", "leader": true},
    {"name": "announce", "lifecycle": {"hook": "poststart"}},
    {"name": "cleanup", "lifecycle": {"hook": "poststop"}}
]}))]
pub struct RegisterBody {
    /// 1 to 256 tasks with unique names.
    #[schema(min_items = 1, max_items = 256)]
    pub tasks: Vec<TaskSpecBody>,
    /// How long the coordinator may stay in `prestart`, `main` and
    /// `poststart`, and poststop tasks may run: past one, the allocation
    /// is told to stop ("Deadline Exceeded") and fails.
    #[serde(default)]
    pub deadlines: Option<DeadlinesBody>,
}

/// One task of a registration.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(remote = "Self", deny_unknown_fields)]
pub struct TaskSpecBody {
    /// 1 to 128 characters from `A-Z a-z 0-9 . _ -`, starting with a letter or digit.
    #[schema(
        example = "web",
        min_length = 1,
        max_length = 128,
        pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"
    )]
    pub name: String,
    /// Absent or `null` for a main task.
    #[serde(default)]
    pub lifecycle: Option<LifecycleBody>,
    /// At most one task is the leader.
    #[serde(default)]
    pub leader: bool,
    /// The task reports when it is ready (`"ready": true`), and the next
    /// stage waits for that: `main` for ready prestart sidecars,
    /// `poststart` for ready (or dead) main tasks. Prestart sidecars and
    /// main tasks only.
    #[serde(default)]
    pub readiness: bool,
    /// While the task runs, its agent gives a sign of life (a report, a
    /// parked start-condition or task query, or a heartbeat) at least once
    /// per `ttl`, or the task is declared lost: dead, failed, `lost`.
    /// Absent: the server's `--default-liveness-ttl`, if any.
    #[serde(default)]
    pub liveness: Option<LivenessBody>,
    /// Start conditions on other tasks, of this allocation or another one
    /// (at most 16): the task may start only while its gate is open and
    /// every one holds.
    #[serde(default)]
    #[schema(max_items = 16)]
    pub depends_on: Vec<DependencyBody>,
    /// Semaphores the task must hold a slot of to start (at most 4,
    /// distinct; names as allocation IDs): once it is otherwise allowed
    /// it queues, and it is granted all of them at once, first come first
    /// served (`grants` on the task says with which fences). The caller's
    /// token must cover each name (`semaphore_prefixes`).
    #[serde(default)]
    #[schema(max_items = 4, example = json!(["db-migrations"]), value_type = Vec<SemaphoreNameBody>)]
    pub acquire: Vec<String>,
    /// A barrier the task starts together at with the other tasks that
    /// name it, in any allocation: it is allowed only once `size` of them
    /// are each otherwise allowed at once; then all are released together
    /// and the barrier stays open. Not on a poststop task. The caller's
    /// token must cover the name (`semaphore_prefixes`, which cover
    /// barriers too).
    #[serde(default)]
    pub barrier: Option<BarrierBody>,
}

/// A task's `barrier`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(remote = "Self", deny_unknown_fields)]
#[schema(example = json!({"name": "train-42", "size": 4, "timeout": "10m"}))]
pub struct BarrierBody {
    /// As an allocation ID.
    #[schema(value_type = SemaphoreNameBody)]
    pub name: String,
    /// How many tasks open it (2 to 1000); every member must say the same.
    #[schema(value_type = u64, minimum = 2, maximum = 1000)]
    pub size: serde_json::Number,
    /// How long it may gather (1 s to 7 d; every member must say the
    /// same), from the earliest arrival among the members counted now (a
    /// member that leaves the count takes its arrival with it): then
    /// every member's allocation is told to stop ("Barrier Timeout") and
    /// fails. Absent: no limit.
    #[serde(default)]
    #[schema(example = "10m")]
    pub timeout: Option<String>,
}

/// A semaphore's name in a task's `acquire` (the schema only: names are
/// parsed as `SemName`).
pub struct SemaphoreNameBody;

impl utoipa::PartialSchema for SemaphoreNameBody {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .description(Some("A semaphore's name: as an allocation ID"))
            .min_length(Some(1))
            .max_length(Some(128))
            .pattern(Some("^[A-Za-z0-9][A-Za-z0-9._-]*$"))
            .into()
    }
}

impl ToSchema for SemaphoreNameBody {
    fn name() -> std::borrow::Cow<'static, str> {
        std::borrow::Cow::Borrowed("SemaphoreName")
    }
}

/// A start condition on another task.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(remote = "Self", deny_unknown_fields)]
#[schema(example = json!({"task": "db", "allocation": "db-7", "condition": "ready"}))]
pub struct DependencyBody {
    /// The task waited on.
    #[schema(
        min_length = 1,
        max_length = 128,
        pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"
    )]
    pub task: String,
    /// Its allocation; absent (or this allocation's ID) for a task of this
    /// one. Need not be registered yet: until it is, the dependency does
    /// not hold.
    #[serde(default)]
    #[schema(
        min_length = 1,
        max_length = 128,
        pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"
    )]
    pub allocation: Option<String>,
    pub condition: Condition,
}

/// A task's liveness.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(remote = "Self", deny_unknown_fields)]
pub struct LivenessBody {
    /// A duration with a unit (`500ms`, `30s`, `5m`), 1 s to 24 h.
    #[schema(example = "30s")]
    pub ttl: String,
}

/// How long the allocation may stay in a stage; each optional, 1 s to 7
/// days, as a duration with a unit (`10m`).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(remote = "Self", deny_unknown_fields)]
#[schema(example = json!({"prestart": "10m", "main": "5m"}))]
pub struct DeadlinesBody {
    /// From when the coordinator enters `prestart` until it leaves it.
    #[serde(default)]
    pub prestart: Option<String>,
    /// From when the coordinator enters `main` until it leaves it.
    #[serde(default)]
    pub main: Option<String>,
    /// From when the coordinator enters `poststart` until it leaves it.
    #[serde(default)]
    pub poststart: Option<String>,
    /// How long poststop tasks may run once their gate opened.
    #[serde(default)]
    pub poststop: Option<String>,
}

/// A duration field of a request: parsed, or its error at `field`.
fn duration_field(
    errors: &mut Vec<FieldError>,
    field: impl FnOnce() -> String,
    text: Option<&str>,
) -> Option<std::time::Duration> {
    match crate::units::parse_duration(text?) {
        Ok(d) => Some(d),
        Err(e) => {
            errors.push(FieldError::new(field(), e));
            None
        }
    }
}

/// A task's lifecycle hook.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(remote = "Self", deny_unknown_fields)]
pub struct LifecycleBody {
    pub hook: Hook,
    /// Keep running alongside later stages; not allowed on `poststop`.
    #[serde(default)]
    pub sidecar: bool,
}

impl RegisterBody {
    /// The spec of allocation `own` (a dependency naming `own` is one on a
    /// task of this allocation).
    pub fn into_spec(self, limits: &Limits, own: &AllocId) -> Result<AllocSpec, Vec<FieldError>> {
        let mut errors = Vec::new();
        let mut tasks = Vec::with_capacity(self.tasks.len());
        for (i, t) in self.tasks.into_iter().enumerate() {
            let liveness = duration_field(
                &mut errors,
                || format!("tasks[{i}].liveness.ttl"),
                t.liveness.as_ref().map(|l| l.ttl.as_str()),
            );
            let mut depends_on = Vec::with_capacity(t.depends_on.len());
            for (j, d) in t.depends_on.into_iter().enumerate() {
                let field = |what: &str| format!("tasks[{i}].depends_on[{j}].{what}");
                let task = TaskName::parse(&d.task).map_err(|e| {
                    errors.push(FieldError::new(field("task"), format!("{:?} {e}", d.task)))
                });
                let allocation = match d.allocation {
                    None => Ok(None),
                    Some(a) => match AllocId::parse(&a) {
                        Ok(a) if a == *own => Ok(None),
                        Ok(a) => Ok(Some(a)),
                        Err(e) => {
                            errors.push(FieldError::new(field("allocation"), format!("{a:?} {e}")));
                            Err(())
                        }
                    },
                };
                if let (Ok(task), Ok(allocation)) = (task, allocation) {
                    depends_on.push(Dependency {
                        task,
                        allocation,
                        condition: d.condition,
                    });
                }
            }
            let mut acquire = Vec::with_capacity(t.acquire.len().min(MAX_ACQUIRE));
            if t.acquire.len() > MAX_ACQUIRE {
                // Refused as a whole: the names of a list too long are not
                // read, whatever its length.
                errors.push(FieldError::new(
                    format!("tasks[{i}].acquire"),
                    format!(
                        "at most {MAX_ACQUIRE} semaphores per task, got {}",
                        t.acquire.len()
                    ),
                ));
            }
            for (k, name) in t.acquire.iter().enumerate().take(MAX_ACQUIRE) {
                match SemName::parse(name) {
                    Ok(n) => acquire.push(n),
                    Err(e) => errors.push(FieldError::new(
                        format!("tasks[{i}].acquire[{k}]"),
                        format!("{name:?} {e}"),
                    )),
                }
            }
            let barrier = t.barrier.and_then(|b| {
                let field = |what: &str| format!("tasks[{i}].barrier.{what}");
                let timeout =
                    duration_field(&mut errors, || field("timeout"), b.timeout.as_deref());
                let name = SemName::parse(&b.name)
                    .map_err(|e| {
                        errors.push(FieldError::new(field("name"), format!("{:?} {e}", b.name)))
                    })
                    .ok()?;
                let Some(size) = whole(&b.size).and_then(|n| u16::try_from(n).ok()) else {
                    errors.push(FieldError::new(
                        field("size"),
                        format!("must be 2 to 1000, got {}", b.size),
                    ));
                    return None;
                };
                Some(BarrierSpec {
                    name,
                    size,
                    timeout,
                })
            });
            match TaskName::parse(&t.name) {
                Ok(name) => tasks.push(TaskSpec {
                    name,
                    lifecycle: t.lifecycle.map(|l| Lifecycle {
                        hook: l.hook,
                        sidecar: l.sidecar,
                    }),
                    leader: t.leader,
                    readiness: t.readiness,
                    liveness,
                    depends_on,
                    acquire,
                    barrier,
                }),
                Err(e) => errors.push(FieldError::new(
                    format!("tasks[{i}].name"),
                    format!("{:?} {e}", t.name),
                )),
            }
        }
        let mut deadlines = Deadlines::default();
        if let Some(d) = &self.deadlines {
            for (state, text) in
                Deadlines::STATES
                    .into_iter()
                    .zip([&d.prestart, &d.main, &d.poststart, &d.poststop])
            {
                let parsed = duration_field(
                    &mut errors,
                    || format!("deadlines.{state}"),
                    text.as_deref(),
                );
                deadlines.set(state, parsed);
            }
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        AllocSpec::with_deadlines(tasks, deadlines, limits)
    }
}

/// `PUT .../tasks/{task}/state`, and each value of a batch.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(remote = "Self", deny_unknown_fields)]
#[schema(example = json!({"state": "dead", "failed": true,
    "event": {"type": "Terminated", "message": "Exit Code: 1", "details": {"exit_code": "1"}}}))]
pub struct ReportBody {
    pub state: RunState,
    /// Only meaningful with `dead`: the task failed.
    #[serde(default)]
    pub failed: bool,
    /// The task is ready (`true` only with `running`) or no longer ready.
    /// Absent: a running task stays as ready as it was; leaving `running`
    /// clears readiness.
    #[serde(default)]
    pub ready: Option<bool>,
    #[serde(default)]
    pub event: Option<EventBody>,
}

/// An event to record with a report.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(remote = "Self", deny_unknown_fields)]
pub struct EventBody {
    /// 1 to 64 characters.
    #[serde(rename = "type")]
    #[schema(example = "Terminated", min_length = 1, max_length = 64)]
    pub kind: String,
    /// At most 4 KiB (of UTF-8).
    #[serde(default)]
    #[schema(example = "Exit Code: 1", max_length = 4096)]
    pub message: String,
    /// String to string: at most 32 entries, keys of at most 128 bytes,
    /// values of at most 1 KiB; the whole event (type, message, keys and
    /// values) at most 8 KiB.
    #[serde(default)]
    #[schema(value_type = BTreeMap<String, String>)]
    pub details: UniqueMap<String, MAX_EVENT_DETAILS>,
    /// RFC 3339; defaults to the server's time.
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub time: Option<OffsetDateTime>,
}

impl ReportBody {
    /// Converts and checks limits; `prefix` is this report's path in the
    /// request (`""` or `tasks.web.`).
    pub fn into_report(self, prefix: &str, limits: &Limits) -> Result<TaskReport, Vec<FieldError>> {
        // Times are kept in UTC: one whose instant lies past the year 9999
        // there (`9999-12-31T23:59:59-00:01`) has no UTC form.
        let utc = |t: OffsetDateTime| t.checked_to_offset(time::UtcOffset::UTC);
        let far = (self.event.as_ref())
            .and_then(|e| e.time)
            .is_some_and(|t| utc(t).is_none());
        let report = TaskReport {
            state: self.state,
            failed: self.failed,
            ready: self.ready,
            event: self.event.map(|e| EventInput {
                kind: e.kind,
                time: e.time.map(|t| utc(t).unwrap_or(t)),
                message: e.message,
                details: e.details.0.into_iter().collect(),
            }),
        };
        let mut errors = report.validate(prefix, limits);
        if far {
            errors.push(FieldError::new(
                format!("{prefix}event.time"),
                "must be at most 9999-12-31T23:59:59.999999999Z in UTC",
            ));
        }
        if errors.is_empty() {
            Ok(report)
        } else {
            Err(errors)
        }
    }
}

/// `POST .../task-states` and `POST .../restore`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(remote = "Self", deny_unknown_fields)]
#[schema(example = json!({"tasks": {"init": {"state": "dead"}, "proxy": {"state": "running", "ready": true}}}))]
pub struct BatchBody {
    /// Task name to report; each task at most once.
    #[schema(value_type = BTreeMap<String, ReportBody>)]
    pub tasks: UniqueMap<ReportBody, MAX_TASKS>,
}

impl BatchBody {
    pub fn into_reports(
        self,
        limits: &Limits,
    ) -> Result<Vec<(TaskName, TaskReport)>, Vec<FieldError>> {
        let mut errors = Vec::new();
        let mut out = Vec::with_capacity(self.tasks.0.len());
        for (name, body) in self.tasks.0 {
            let prefix = format!("tasks.{name}.");
            let name = TaskName::parse(&name)
                .map_err(|e| FieldError::new(format!("tasks.{name}"), format!("{name:?} {e}")));
            match (name, body.into_report(&prefix, limits)) {
                (Ok(n), Ok(r)) => out.push((n, r)),
                (n, r) => {
                    errors.extend(n.err());
                    errors.extend(r.err().into_iter().flatten());
                }
            }
        }
        if errors.is_empty() {
            Ok(out)
        } else {
            Err(errors)
        }
    }
}

/// `POST .../restart`: `{}` restarts running tasks, `{"task": "web"}` one
/// task, `{"all_tasks": true}` every task and the coordinator.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(remote = "Self", deny_unknown_fields)]
#[schema(example = json!({"all_tasks": true, "reason": "new configuration"}))]
pub struct RestartBody {
    /// Restart only this task; it must be running.
    #[serde(default)]
    #[schema(
        min_length = 1,
        max_length = 128,
        pattern = "^[A-Za-z0-9][A-Za-z0-9._-]*$"
    )]
    pub task: Option<String>,
    /// Restart every running or dead task and reset the coordinator.
    #[serde(default)]
    pub all_tasks: bool,
    /// Recorded in each task's "Restart Signaled" event (at most 4 KiB).
    #[serde(default)]
    #[schema(max_length = 4096)]
    pub reason: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An event time whose instant in UTC lies past the year 9999 (valid
    /// RFC 3339: the last second of 9999 a minute west of UTC) is refused
    /// as a field error, not a panic converting it to UTC.
    #[test]
    fn an_event_time_past_9999_in_utc_is_a_field_error() {
        let report = |time: &str| {
            let body: ReportBody = serde_json::from_value(serde_json::json!({
                "state": "running",
                "event": {"type": "Started", "time": time}
            }))
            .unwrap();
            body.into_report("tasks.web.", &Limits::default())
        };
        let errors = report("9999-12-31T23:59:59-00:01").unwrap_err();
        let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["tasks.web.event.time"]);
        // The last instant there is, and the first, are taken.
        for time in [
            "9999-12-31T23:59:59.999999999Z",
            "0000-01-01T00:00:00+23:59",
        ] {
            let r = report(time).unwrap();
            let t = r.event.unwrap().time.unwrap();
            assert_eq!(t.offset(), time::UtcOffset::UTC, "{time}");
        }
    }
}
