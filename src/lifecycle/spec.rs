//! What an allocation is made of: tasks, their lifecycle hooks and the
//! stage each one listens on.

use std::{collections::HashSet, sync::Arc, time::Duration};

use super::{
    CoordState, FieldError, Limits, TaskName,
    deps::{Dependency, MAX_DEPENDENCIES, never_holds},
};
use crate::units::format_duration;

named_enum! {
    /// When a task runs relative to the main tasks.
    pub enum Hook ("hook") {
        Prestart = "prestart",
        Poststart = "poststart",
        Poststop = "poststop",
    }
}

named_enum! {
    /// The gate a task listens on. The declaration order is the column
    /// order of the gate table.
    pub enum Stage ("stage") {
        PrestartEphemeral = "prestart_ephemeral",
        PrestartSidecar = "prestart_sidecar",
        Main = "main",
        PoststartEphemeral = "poststart_ephemeral",
        PoststartSidecar = "poststart_sidecar",
        Poststop = "poststop",
    }
}

impl Stage {
    /// Position in the gate table.
    pub const fn column(self) -> usize {
        match self {
            Stage::PrestartEphemeral => 0,
            Stage::PrestartSidecar => 1,
            Stage::Main => 2,
            Stage::PoststartEphemeral => 3,
            Stage::PoststartSidecar => 4,
            Stage::Poststop => 5,
        }
    }
}

/// A task's lifecycle block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Lifecycle {
    pub hook: Hook,
    pub sidecar: bool,
}

/// One task of an allocation, as registered.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TaskSpec {
    pub name: TaskName,
    /// `None` for a main task.
    pub lifecycle: Option<Lifecycle>,
    pub leader: bool,
    /// The task says when it is ready (prestart sidecars and main tasks
    /// only): the next stage waits for it.
    pub readiness: bool,
    /// While it runs, its agent gives a sign of life at least once per
    /// this long, or the task is declared lost. `None`: the server's
    /// default (`--default-liveness-ttl`), if any.
    pub liveness: Option<Duration>,
    /// Start conditions on other tasks (of this allocation or another
    /// one), at most `MAX_DEPENDENCIES`.
    pub depends_on: Vec<Dependency>,
    /// The semaphores the task must hold a slot of to start, at most
    /// `MAX_ACQUIRE`, distinct.
    pub acquire: Vec<super::SemName>,
    /// The barrier the task starts together with its other members at.
    pub barrier: Option<super::BarrierSpec>,
}

impl TaskSpec {
    pub fn stage(&self) -> Stage {
        match self.lifecycle {
            None => Stage::Main,
            Some(Lifecycle { hook, sidecar }) => match (hook, sidecar) {
                (Hook::Prestart, false) => Stage::PrestartEphemeral,
                (Hook::Prestart, true) => Stage::PrestartSidecar,
                (Hook::Poststart, false) => Stage::PoststartEphemeral,
                (Hook::Poststart, true) => Stage::PoststartSidecar,
                (Hook::Poststop, _) => Stage::Poststop,
            },
        }
    }

    pub fn is_poststop(&self) -> bool {
        self.stage() == Stage::Poststop
    }

    pub fn is_sidecar(&self) -> bool {
        matches!(self.lifecycle, Some(Lifecycle { sidecar: true, .. }))
    }

    /// The task with only a name: a main task, no leader, no readiness,
    /// no TTL of its own.
    pub fn named(name: TaskName) -> Self {
        Self {
            name,
            lifecycle: None,
            leader: false,
            readiness: false,
            liveness: None,
            depends_on: Vec::new(),
            acquire: Vec::new(),
            barrier: None,
        }
    }
}

/// Shortest and longest liveness TTL a task may declare.
pub const TTL_RANGE: (Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(24 * 3600));

/// Shortest and longest stage deadline.
pub const DEADLINE_RANGE: (Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(7 * 24 * 3600));

/// How long the coordinator may stay in a state (`prestart`, `main`,
/// `poststart`), and how long poststop tasks may run once their gate
/// opened (`poststop`). Each optional.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Deadlines {
    pub prestart: Option<Duration>,
    pub main: Option<Duration>,
    pub poststart: Option<Duration>,
    pub poststop: Option<Duration>,
}

impl Deadlines {
    /// The states that take a deadline, with their wire names, in order.
    pub const STATES: [CoordState; 4] = [
        CoordState::Prestart,
        CoordState::Main,
        CoordState::Poststart,
        CoordState::Poststop,
    ];

    /// The deadline of `state`, if it has one.
    pub fn of(&self, state: CoordState) -> Option<Duration> {
        match state {
            CoordState::Prestart => self.prestart,
            CoordState::Main => self.main,
            CoordState::Poststart => self.poststart,
            CoordState::Poststop => self.poststop,
            CoordState::Init | CoordState::WaitAlloc => None,
        }
    }

    /// Sets the deadline of `state` (one of `STATES`).
    pub fn set(&mut self, state: CoordState, d: Option<Duration>) {
        match state {
            CoordState::Prestart => self.prestart = d,
            CoordState::Main => self.main = d,
            CoordState::Poststart => self.poststart = d,
            CoordState::Poststop => self.poststop = d,
            CoordState::Init | CoordState::WaitAlloc => {
                debug_assert!(false, "{state} takes no deadline")
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        Self::STATES.iter().all(|&s| self.of(s).is_none())
    }
}

/// A validated task list: 1 to `max_tasks` tasks, unique names, at most one
/// leader, no sidecar poststop task. Two specs are equal when they would
/// behave the same (an omitted `sidecar` equals `false`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AllocSpec {
    tasks: Vec<TaskSpec>,
    deadlines: Deadlines,
}

/// `field` must lie in `range` (a TTL, a deadline).
fn check_range(
    errors: &mut Vec<FieldError>,
    field: String,
    d: Option<Duration>,
    (min, max): (Duration, Duration),
) {
    if let Some(d) = d
        && (d < min || d > max)
    {
        errors.push(FieldError::new(
            field,
            format!(
                "must be {} to {}, got {}",
                format_duration(min),
                format_duration(max),
                format_duration(d)
            ),
        ));
    }
}

/// How many semaphores task `i` acquires, and that each is named once.
fn check_acquire(errors: &mut Vec<FieldError>, task: &TaskSpec, i: usize) {
    if task.acquire.len() > super::MAX_ACQUIRE {
        errors.push(FieldError::new(
            format!("tasks[{i}].acquire"),
            format!(
                "at most {} semaphores per task, got {}",
                super::MAX_ACQUIRE,
                task.acquire.len()
            ),
        ));
        // Not compared name by name: a long list costs nothing more.
        return;
    }
    for (k, name) in task.acquire.iter().enumerate() {
        if task.acquire[..k].contains(name) {
            errors.push(FieldError::new(
                format!("tasks[{i}].acquire[{k}]"),
                format!("semaphore {name:?} is named twice; a task holds one slot of each"),
            ));
        }
    }
}

/// The rules of task `i`'s dependencies that its own allocation can
/// check: how many, on which task, in which stage, on what condition.
fn check_dependencies(errors: &mut Vec<FieldError>, tasks: &[TaskSpec], i: usize) {
    let task = &tasks[i];
    if task.depends_on.len() > MAX_DEPENDENCIES {
        errors.push(FieldError::new(
            format!("tasks[{i}].depends_on"),
            format!(
                "at most {MAX_DEPENDENCIES} dependencies are allowed, got {}",
                task.depends_on.len()
            ),
        ));
    }
    for (j, d) in task.depends_on.iter().enumerate() {
        if d.allocation.is_some() {
            continue;
        }
        let field = || format!("tasks[{i}].depends_on[{j}]");
        let Some(target) = tasks.iter().find(|t| t.name == d.task) else {
            errors.push(FieldError::new(
                field(),
                format!(
                    "\"{}\" depends on \"{}\", which is no task of this allocation (name its \
                     `allocation` for a task of another one)",
                    task.name, d.task
                ),
            ));
            continue;
        };
        if target.name == task.name {
            errors.push(FieldError::new(
                field(),
                format!("\"{}\" cannot depend on itself", task.name),
            ));
            continue;
        }
        if let Some(why) = never_holds(task.stage(), target.stage(), target.readiness, d.condition)
        {
            errors.push(FieldError::new(
                field(),
                format!(
                    "\"{}\" depends on \"{}\" being {}, which never holds while it may start: \
                     {why}",
                    task.name, d.task, d.condition
                ),
            ));
        }
    }
}

impl AllocSpec {
    /// Whether a task acquires semaphores.
    pub fn acquires(&self) -> bool {
        self.tasks().iter().any(|t| !t.acquire.is_empty())
    }

    /// Whether a task meets others at a barrier.
    pub fn gathers(&self) -> bool {
        self.tasks().iter().any(|t| t.barrier.is_some())
    }

    /// Whether a task waits on something shared across allocations (a
    /// semaphore or a barrier).
    pub fn gated(&self) -> bool {
        self.tasks()
            .iter()
            .any(|t| !t.acquire.is_empty() || t.barrier.is_some())
    }

    /// Checks the cross-task rules. Every broken rule is reported, each
    /// with the path `tasks[i]...` of the offending field.
    pub fn new(tasks: Vec<TaskSpec>, limits: &Limits) -> Result<Self, Vec<FieldError>> {
        Self::with_deadlines(tasks, Deadlines::default(), limits)
    }

    /// `new`, with stage deadlines.
    pub fn with_deadlines(
        tasks: Vec<TaskSpec>,
        deadlines: Deadlines,
        limits: &Limits,
    ) -> Result<Self, Vec<FieldError>> {
        let mut errors = Vec::new();
        if tasks.is_empty() {
            errors.push(FieldError::new("tasks", "at least one task is required"));
        }
        if tasks.len() > limits.max_tasks {
            errors.push(FieldError::new(
                "tasks",
                format!(
                    "at most {} tasks are allowed, got {}",
                    limits.max_tasks,
                    tasks.len()
                ),
            ));
        }
        let mut seen = HashSet::new();
        let mut leader: Option<&TaskName> = None;
        for (i, task) in tasks.iter().enumerate() {
            if !seen.insert(task.name.as_str()) {
                errors.push(FieldError::new(
                    format!("tasks[{i}].name"),
                    format!("duplicate task name \"{}\"", task.name),
                ));
            }
            if task.leader {
                match leader {
                    Some(first) => errors.push(FieldError::new(
                        format!("tasks[{i}].leader"),
                        format!("at most one leader is allowed; \"{first}\" is already the leader"),
                    )),
                    None => leader = Some(&task.name),
                }
            }
            if task.readiness && !matches!(task.stage(), Stage::PrestartSidecar | Stage::Main) {
                errors.push(FieldError::new(
                    format!("tasks[{i}].readiness"),
                    format!(
                        "only a prestart sidecar or a main task can declare readiness; \"{}\" is {}",
                        task.name,
                        task.stage()
                    ),
                ));
            }
            if let Some(Lifecycle {
                hook: Hook::Poststop,
                sidecar: true,
            }) = task.lifecycle
            {
                errors.push(FieldError::new(
                    format!("tasks[{i}].lifecycle.sidecar"),
                    "a poststop task cannot be a sidecar",
                ));
            }
            check_range(
                &mut errors,
                format!("tasks[{i}].liveness.ttl"),
                task.liveness,
                TTL_RANGE,
            );
            check_dependencies(&mut errors, &tasks, i);
            check_acquire(&mut errors, &tasks[i], i);
            if let Some(b) = &task.barrier {
                if task.is_poststop() {
                    // Poststop tasks are the cleanup: no stop order reaches
                    // them, so a barrier that timed out would hold one, and
                    // its allocation, for ever.
                    errors.push(FieldError::new(
                        format!("tasks[{i}].barrier"),
                        format!(
                            "a poststop task cannot meet at a barrier: \"{}\" is the \
                             allocation's cleanup, which must run whatever other allocations \
                             do; name the barrier on a prestart, main or poststart task",
                            task.name
                        ),
                    ));
                }
                let (min, max) = super::SIZE_RANGE;
                if !(min..=max).contains(&b.size) {
                    errors.push(FieldError::new(
                        format!("tasks[{i}].barrier.size"),
                        format!("must be {min} to {max}, got {}", b.size),
                    ));
                }
                check_range(
                    &mut errors,
                    format!("tasks[{i}].barrier.timeout"),
                    b.timeout,
                    super::BARRIER_TIMEOUT_RANGE,
                );
            }
        }
        for state in Deadlines::STATES {
            check_range(
                &mut errors,
                format!("deadlines.{state}"),
                deadlines.of(state),
                DEADLINE_RANGE,
            );
        }
        if errors.is_empty() {
            Ok(Self { tasks, deadlines })
        } else {
            Err(errors)
        }
    }

    pub fn tasks(&self) -> &[TaskSpec] {
        &self.tasks
    }

    pub fn deadlines(&self) -> &Deadlines {
        &self.deadlines
    }

    /// The TTL task `i` runs under: its own, else `default`.
    pub fn ttl(&self, i: usize, default: Option<Duration>) -> Option<Duration> {
        self.tasks[i].liveness.or(default)
    }

    /// Whether a task depends on a task of another allocation.
    pub fn reaches_out(&self) -> bool {
        self.tasks
            .iter()
            .any(|t| t.depends_on.iter().any(|d| d.allocation.is_some()))
    }

    /// Whether anything of this allocation happens by time alone: a
    /// deadline, or a task under a TTL (with `default`, every task).
    pub fn timed(&self, default: Option<Duration>) -> bool {
        default.is_some()
            || !self.deadlines.is_empty()
            || self.tasks.iter().any(|t| t.liveness.is_some())
    }

    /// Position of a task by name.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.tasks.iter().position(|t| t.name.as_str() == name)
    }
}

/// Makes equal task specs one shared value: the allocations of one job
/// share their spec, so a million of them need not hold a million copies.
/// Specs no allocation uses any more are dropped now and then, so the set
/// stays proportional to the specs in use.
#[derive(Default)]
pub struct SpecInterner {
    specs: HashSet<Arc<AllocSpec>, foldhash::fast::RandomState>,
    /// Size after the last pruning; the next comes at twice that.
    pruned_at: usize,
}

impl SpecInterner {
    /// The shared copy of `spec` (this one, if it is new).
    pub fn share(&mut self, spec: Arc<AllocSpec>) -> Arc<AllocSpec> {
        if let Some(shared) = self.specs.get(&spec) {
            return shared.clone();
        }
        if self.specs.len() >= 2 * self.pruned_at.max(512) {
            self.specs.retain(|s| Arc::strong_count(s) > 1);
            self.pruned_at = self.specs.len();
        }
        self.specs.insert(spec.clone());
        spec
    }

    pub fn len(&self) -> usize {
        self.specs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A task spec from a short notation, for tests: `("web", None)`,
    /// `("side", Some((Hook::Prestart, true)))`.
    pub(crate) fn task(name: &str, lc: Option<(Hook, bool)>) -> TaskSpec {
        TaskSpec {
            lifecycle: lc.map(|(hook, sidecar)| Lifecycle { hook, sidecar }),
            ..TaskSpec::named(TaskName::parse(name).unwrap())
        }
    }

    #[test]
    fn only_prestart_sidecars_and_main_tasks_declare_readiness() {
        use Hook::*;
        let limits = Limits::default();
        for (lc, ok) in [
            (None, true),
            (Some((Prestart, true)), true),
            (Some((Prestart, false)), false),
            (Some((Poststart, false)), false),
            (Some((Poststart, true)), false),
            (Some((Poststop, false)), false),
        ] {
            let mut t = task("t", lc);
            t.readiness = true;
            match AllocSpec::new(vec![t], &limits) {
                Ok(_) => assert!(ok, "{lc:?} was taken"),
                Err(e) => {
                    assert!(!ok, "{lc:?} was refused: {e:?}");
                    assert_eq!(e[0].field, "tasks[0].readiness");
                }
            }
        }
    }

    #[test]
    fn ttls_and_deadlines_must_lie_in_their_ranges() {
        let limits = Limits::default();
        let mut t = task("web", None);
        for (ttl, ok) in [
            (Duration::from_millis(999), false),
            (Duration::from_secs(1), true),
            (Duration::from_secs(24 * 3600), true),
            (Duration::from_secs(24 * 3600 + 1), false),
        ] {
            t.liveness = Some(ttl);
            match AllocSpec::new(vec![t.clone()], &limits) {
                Ok(_) => assert!(ok, "{ttl:?} was taken"),
                Err(e) => {
                    assert!(!ok, "{ttl:?} was refused: {e:?}");
                    assert_eq!(e[0].field, "tasks[0].liveness.ttl");
                    assert!(e[0].message.starts_with("must be 1s to 24h, got "), "{e:?}");
                }
            }
        }
        let mut d = Deadlines::default();
        d.set(
            CoordState::Poststop,
            Some(Duration::from_secs(7 * 24 * 3600 + 1)),
        );
        d.set(CoordState::Main, Some(Duration::from_millis(10)));
        let e = AllocSpec::with_deadlines(vec![task("web", None)], d, &limits).unwrap_err();
        let fields: Vec<_> = e.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["deadlines.main", "deadlines.poststop"]);
        d.set(
            CoordState::Poststop,
            Some(Duration::from_secs(7 * 24 * 3600)),
        );
        d.set(CoordState::Main, Some(Duration::from_secs(1)));
        let spec = AllocSpec::with_deadlines(vec![task("web", None)], d, &limits).unwrap();
        assert_eq!(
            spec.deadlines().of(CoordState::Main),
            Some(Duration::from_secs(1))
        );
        assert_eq!(spec.deadlines().of(CoordState::WaitAlloc), None);
        assert!(spec.timed(None));
    }

    #[test]
    fn a_spec_is_timed_by_a_deadline_a_ttl_or_a_default_ttl() {
        let limits = Limits::default();
        let plain = AllocSpec::new(vec![task("web", None)], &limits).unwrap();
        assert!(!plain.timed(None));
        assert!(plain.timed(Some(Duration::from_secs(5))));
        assert_eq!(
            plain.ttl(0, Some(Duration::from_secs(5))),
            Some(Duration::from_secs(5))
        );
        let mut t = task("web", None);
        t.liveness = Some(Duration::from_secs(30));
        let own = AllocSpec::new(vec![t], &limits).unwrap();
        assert!(own.timed(None));
        assert_eq!(
            own.ttl(0, Some(Duration::from_secs(5))),
            Some(Duration::from_secs(30))
        );
    }

    #[test]
    fn stage_follows_the_lifecycle_table() {
        use Hook::*;
        let cases = [
            (None, Stage::Main),
            (Some((Prestart, false)), Stage::PrestartEphemeral),
            (Some((Prestart, true)), Stage::PrestartSidecar),
            (Some((Poststart, false)), Stage::PoststartEphemeral),
            (Some((Poststart, true)), Stage::PoststartSidecar),
            (Some((Poststop, false)), Stage::Poststop),
        ];
        for (lc, stage) in cases {
            assert_eq!(task("t", lc).stage(), stage, "{lc:?}");
        }
    }

    #[test]
    fn stage_columns_follow_declaration_order() {
        for (i, s) in Stage::ALL.iter().enumerate() {
            assert_eq!(s.column(), i);
        }
    }

    #[test]
    fn rejects_cross_task_rule_breaks_with_paths() {
        let limits = Limits::default();
        let mut a = task("web", None);
        a.leader = true;
        let mut b = task("web", Some((Hook::Poststop, true)));
        b.leader = true;
        let errors = AllocSpec::new(vec![a, b], &limits).unwrap_err();
        let fields: Vec<_> = errors.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "tasks[1].name",
                "tasks[1].leader",
                "tasks[1].lifecycle.sidecar"
            ]
        );
        assert_eq!(errors[0].message, "duplicate task name \"web\"");
    }

    #[test]
    fn rejects_empty_and_oversized_task_lists() {
        let limits = Limits {
            max_tasks: 2,
            ..Limits::default()
        };
        assert_eq!(
            AllocSpec::new(vec![], &limits).unwrap_err()[0].field,
            "tasks"
        );
        let three = vec![task("a", None), task("b", None), task("c", None)];
        let err = AllocSpec::new(three, &limits).unwrap_err();
        assert_eq!(err[0].message, "at most 2 tasks are allowed, got 3");
    }

    #[test]
    fn wire_names_are_exact() {
        let names: Vec<_> = Stage::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(
            names,
            [
                "prestart_ephemeral",
                "prestart_sidecar",
                "main",
                "poststart_ephemeral",
                "poststart_sidecar",
                "poststop"
            ]
        );
        for s in Stage::ALL {
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
            assert_eq!(s.as_str().parse::<Stage>().unwrap(), *s);
        }
        let hooks: Vec<_> = Hook::ALL.iter().map(|h| h.as_str()).collect();
        assert_eq!(hooks, ["prestart", "poststart", "poststop"]);
        let err = "prestop".parse::<Hook>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown hook \"prestop\", expected one of `prestart`, `poststart`, `poststop`"
        );
    }

    #[test]
    fn equal_specs_are_shared_and_unused_ones_dropped() {
        let spec = |names: &[&str]| {
            let tasks = names.iter().map(|n| task(n, None)).collect();
            Arc::new(AllocSpec::new(tasks, &Limits::default()).unwrap())
        };
        let mut interner = SpecInterner::default();
        let a = interner.share(spec(&["web"]));
        let b = interner.share(spec(&["web"]));
        assert!(Arc::ptr_eq(&a, &b));
        let c = interner.share(spec(&["db"]));
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(interner.len(), 2);
        // Specs nobody holds any more go at the next pruning.
        drop(c);
        for i in 0..2_000 {
            drop(interner.share(spec(&[&format!("t{i}")])));
        }
        assert!(interner.len() < 1_100, "{} specs kept", interner.len());
        assert!(Arc::ptr_eq(&interner.share(spec(&["web"])), &a));
    }
}
