//! Property tests: random allocations driven by random sequences of
//! reports, restarts and restores, checked against the invariants of
//! docs/lifecycle.md after every step.

use std::sync::Arc;

use proptest::prelude::*;
use time::macros::datetime;

use super::*;

const NOW: Timestamp = datetime!(2026-11-21 10:00 UTC);

fn arb_lifecycle() -> impl Strategy<Value = Option<Lifecycle>> {
    prop_oneof![
        Just(None),
        (
            prop_oneof![Just(Hook::Prestart), Just(Hook::Poststart)],
            any::<bool>()
        )
            .prop_map(|(hook, sidecar)| Some(Lifecycle { hook, sidecar })),
        Just(Some(Lifecycle {
            hook: Hook::Poststop,
            sidecar: false
        })),
    ]
}

/// Seconds: a TTL or a deadline of 1 to 100 s, or none.
fn arb_secs() -> impl Strategy<Value = Option<std::time::Duration>> {
    prop::option::of((1u64..100).prop_map(std::time::Duration::from_secs))
}

fn arb_alloc() -> impl Strategy<Value = Allocation> {
    (
        prop::collection::vec((arb_lifecycle(), any::<bool>(), arb_secs()), 1..7),
        prop::option::of(0usize..7),
        [arb_secs(), arb_secs(), arb_secs(), arb_secs()],
    )
        .prop_map(|(lcs, leader, deadlines)| {
            let specs = lcs
                .into_iter()
                .enumerate()
                .map(|(i, (lifecycle, readiness, ttl))| {
                    let mut t = TaskSpec {
                        name: TaskName::parse(&format!("t{i}")).unwrap(),
                        lifecycle,
                        leader: leader == Some(i),
                        readiness: false,
                        liveness: ttl,
                        depends_on: Vec::new(),
                        acquire: Vec::new(),
                        barrier: None,
                    };
                    t.readiness =
                        readiness && matches!(t.stage(), Stage::PrestartSidecar | Stage::Main);
                    t
                })
                .collect();
            let mut d = Deadlines::default();
            for (state, secs) in Deadlines::STATES.into_iter().zip(deadlines) {
                d.set(state, secs);
            }
            let spec = AllocSpec::with_deadlines(specs, d, &Limits::default()).unwrap();
            Allocation::register(AllocId::parse("a").unwrap(), Arc::new(spec), 1, NOW)
        })
}

/// A generated report: task, state, failed, with an event, readiness
/// (0 absent, 1 ready if running, 2 not ready).
type RawReport = (usize, RunState, bool, bool, u8);

#[derive(Clone, Debug)]
enum Op {
    Report(Vec<RawReport>),
    Restart(u8, usize),
    Restore(Vec<RawReport>),
    /// Time passes (seconds), then the allocation is looked at.
    Tick(u64),
}

fn arb_reports() -> impl Strategy<Value = Vec<RawReport>> {
    prop::collection::vec(
        (
            0usize..7,
            prop_oneof![
                Just(RunState::Pending),
                Just(RunState::Running),
                Just(RunState::Dead)
            ],
            any::<bool>(),
            any::<bool>(),
            0u8..3,
        ),
        1..4,
    )
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => arb_reports().prop_map(Op::Report),
        1 => (0u8..3, 0usize..7).prop_map(|(m, t)| Op::Restart(m, t)),
        1 => arb_reports().prop_map(Op::Restore),
        2 => (0u64..120).prop_map(Op::Tick),
    ]
}

/// Turns generated tuples into reports for the tasks that exist, one report
/// per task (the API rejects duplicates, so the model does too).
fn to_reports(a: &Allocation, raw: &[RawReport]) -> Vec<(usize, TaskReport)> {
    let mut out: Vec<(usize, TaskReport)> = Vec::new();
    for &(i, state, failed, with_event, ready) in raw {
        let i = i % a.tasks.len();
        if out.iter().any(|(j, _)| *j == i) {
            continue;
        }
        let event = with_event.then(|| EventInput {
            kind: "Test".into(),
            time: None,
            message: String::new(),
            details: Default::default(),
        });
        out.push((
            i,
            TaskReport {
                state,
                failed: failed && state == RunState::Dead,
                ready: match ready {
                    0 => None,
                    1 => Some(state == RunState::Running),
                    _ => Some(false),
                },
                event,
            },
        ));
    }
    out
}

fn check_invariants(a: &Allocation) -> Result<(), TestCaseError> {
    a.check_invariants().map_err(TestCaseError::fail)
}

proptest! {
    // `TASKGATE_FUZZ_CASES` runs more (CI's fuzz step does).
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("TASKGATE_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(512)
    ))]

    #[test]
    fn invariants_hold_over_random_histories(
        start in arb_alloc(),
        ops in prop::collection::vec(arb_op(), 0..40),
    ) {
        let mut a = start;
        let mut index = a.modify_index;
        let mut now = NOW;
        // Each task's latest sign of life: its latest report.
        let mut seen: Vec<Option<Timestamp>> = vec![None; a.tasks.len()];
        check_invariants(&a)?;
        for op in ops {
            let before = a.clone();
            let mut next_index = || { index += 1; index };
            let mut step = Step::Report;
            let (next, may_go_back_to) = match &op {
                Op::Report(raw) => {
                    let r = to_reports(&a, raw);
                    for (i, _) in &r {
                        seen[*i] = Some(now);
                    }
                    // A lost task takes no report (the registry answers
                    // 409 first): its status stays as it was.
                    let next = a.report(&r, now, &mut next_index);
                    if let Some(next) = &next {
                        for (i, _) in &r {
                            if a.tasks[*i].lost() {
                                prop_assert_eq!(&next.tasks[*i].events, &a.tasks[*i].events);
                                prop_assert!(next.tasks[*i].lost());
                            }
                        }
                    }
                    (next, None)
                }
                Op::Tick(secs) => {
                    now += std::time::Duration::from_secs(*secs);
                    let seen_at = |i: usize| seen[i];
                    let due = a.wake_at(&seen_at, None).is_some_and(|at| at <= now);
                    let next = a.tick(now, &seen_at, None, &mut next_index);
                    prop_assert_eq!(next.is_some(), due, "a tick changes exactly what is due");
                    // Nothing is left due once looked at.
                    let after = next.as_ref().unwrap_or(&a);
                    if let Some(at) = after.wake_at(&seen_at, None) {
                        prop_assert!(at > now, "still due after a tick: {} <= {}", at, now);
                    }
                    (next, None)
                }
                Op::Restore(raw) => {
                    let r = to_reports(&a, raw);
                    for (i, _) in &r {
                        seen[*i] = Some(now);
                    }
                    step = Step::Restore;
                    let next = a.restore(&r, now, &mut next_index);
                    // Computed afresh from the restored states, stale
                    // ones aside.
                    if let Some(next) = &next {
                        prop_assert_eq!(
                            next.order(),
                            &orders::stop_order(&next.spec, &next.tasks)
                        );
                    }
                    (next, Some(CoordState::Prestart))
                }
                Op::Restart(m, t) => {
                    let mode = match m {
                        0 => RestartMode::Task(t % a.tasks.len()),
                        1 => RestartMode::Running,
                        _ => RestartMode::AllTasks,
                    };
                    step = Step::Restart(mode);
                    match a.restart(mode, "prop", now, &mut next_index) {
                        Ok((next, chosen)) => {
                            for &i in &chosen {
                                prop_assert!(!a.spec.tasks()[i].is_poststop());
                            }
                            let back = (mode == RestartMode::AllTasks).then_some(CoordState::Init);
                            (next, back)
                        }
                        Err(RestartError::AllocationFinished) => {
                            prop_assert_eq!(a.state, CoordState::Poststop);
                            (None, None)
                        }
                        Err(RestartError::TaskNotRunning(_)) => {
                            prop_assert!(matches!(mode, RestartMode::Task(_)));
                            (None, None)
                        }
                    }
                }
            };
            if let Some(next) = next {
                prop_assert!(next.modify_index > before.modify_index, "indexes only go up");
                before.check_step(&next, step).map_err(TestCaseError::fail)?;
                a = next;
            }
            // The state moves only forward, except through the two resets.
            if a.state < before.state {
                prop_assert!(
                    may_go_back_to.is_some_and(|floor| a.state >= floor),
                    "{} went back to {} on {:?}", before.state, a.state, op
                );
            }
            check_invariants(&a)?;
            // Repeating a task's current state without an event is a no-op
            // (unless the task has a restart order it has not answered:
            // its first report after it makes its state count again).
            let same: Vec<_> = a.tasks.iter().enumerate().filter(|(_, t)| !t.stale).map(|(i, t)| {
                (i, TaskReport { state: t.state, failed: t.failed, ready: None, event: None })
            }).collect();
            prop_assert!(a.report(&same, now, || 0).is_none(), "a no-op report changed something");
            // A deadline runs only in a state that has one.
            if a.deadline_at.is_some() {
                prop_assert!(a.spec.deadlines().of(a.state).is_some(), "a deadline in {:?}", a.state);
            }
        }
    }

    #[test]
    fn evaluate_is_idempotent(a in arb_alloc(), raw in arb_reports(), from in 0usize..6) {
        let mut tasks = a.tasks.clone();
        for (i, r) in to_reports(&a, &raw) {
            tasks[i].apply(&r, NOW);
        }
        let once = evaluate(CoordState::ALL[from], &a.spec, &tasks);
        prop_assert_eq!(evaluate(once, &a.spec, &tasks), once);
        prop_assert_eq!(next_state(once, &a.spec, &tasks), once);
    }
}

/// The transition rules of docs/lifecycle.md written out once more, rule by
/// rule and independently of `wait_for`: the differential reference for
/// `next_state`.
fn reference_next(state: CoordState, spec: &AllocSpec, status: &[TaskStatus]) -> CoordState {
    let tasks: Vec<(&TaskSpec, &TaskStatus)> = spec.tasks().iter().zip(status).collect();
    let of = |stage: Stage| tasks.iter().filter(move |(s, _)| s.stage() == stage);
    let dead = |t: &TaskStatus| t.state == RunState::Dead;
    let running = |t: &TaskStatus| t.state == RunState::Running;
    if tasks
        .iter()
        .filter(|(s, _)| !s.is_poststop())
        .all(|(_, t)| dead(t))
    {
        return CoordState::Poststop;
    }
    match state {
        CoordState::Init if tasks.iter().all(|(_, t)| t.state == RunState::Pending) => {
            CoordState::Prestart
        }
        CoordState::Prestart
            if of(Stage::PrestartEphemeral).all(|(_, t)| dead(t) && !t.failed)
                && of(Stage::PrestartSidecar)
                    .all(|(s, t)| running(t) && (!s.readiness || t.ready)) =>
        {
            CoordState::Main
        }
        CoordState::Main
            if of(Stage::Main).all(|(s, t)| {
                t.state != RunState::Pending && (!s.readiness || t.ready || dead(t))
            }) =>
        {
            CoordState::Poststart
        }
        CoordState::Poststart if of(Stage::PoststartEphemeral).all(|(_, t)| dead(t)) => {
            CoordState::WaitAlloc
        }
        other => other,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    /// `next_state` agrees with the reference in every state, for any
    /// task states (readiness included), reachable or not.
    #[test]
    fn next_state_agrees_with_the_written_rules(
        a in arb_alloc(),
        states in prop::collection::vec((0u8..3, any::<bool>(), any::<bool>()), 7),
        from in 0usize..6,
    ) {
        let tasks: Vec<TaskStatus> = a.tasks.iter().zip(&states).map(|(t, &(s, failed, ready))| {
            let mut t = t.clone();
            t.state = [RunState::Pending, RunState::Running, RunState::Dead][usize::from(s)];
            t.failed = failed && t.state == RunState::Dead;
            t.ready = ready && t.state == RunState::Running;
            t
        }).collect();
        let state = CoordState::ALL[from];
        prop_assert_eq!(next_state(state, &a.spec, &tasks), reference_next(state, &a.spec, &tasks));
        // And `waiting_on` is empty exactly where the state moves on (or is
        // poststop).
        let moves = next_state(state, &a.spec, &tasks) != state;
        let waits = !waiting_on(state, &a.spec, &tasks).is_empty();
        if state != CoordState::WaitAlloc && state != CoordState::Poststop && !moves {
            prop_assert!(waits, "held in {:?} by nothing", state);
        }
    }
}

/// Whether a dependency holds, written out once more from the table of
/// docs/lifecycle.md (Dependencies): the differential reference for
/// `deps::judge`.
fn reference_holds(condition: Condition, t: Option<&TaskStatus>) -> bool {
    let Some(t) = t else { return false };
    if t.stale {
        return false;
    }
    match condition {
        Condition::Running => t.state == RunState::Running,
        Condition::Ready => t.state == RunState::Running && t.ready,
        Condition::Succeeded => t.state == RunState::Dead && !t.failed,
        Condition::Dead => t.state == RunState::Dead,
    }
}

/// A spec whose tasks depend on earlier tasks of the list (same
/// allocation) and on tasks of two other allocations; dependencies the
/// registration would refuse are dropped.
fn arb_dependent() -> impl Strategy<Value = Allocation> {
    let condition = prop_oneof![
        Just(Condition::Running),
        Just(Condition::Ready),
        Just(Condition::Succeeded),
        Just(Condition::Dead),
    ];
    (prop::collection::vec(
        (
            arb_lifecycle(),
            any::<bool>(),
            prop::collection::vec((0usize..8, condition, 0u8..4), 0..3),
        ),
        1..7,
    ),)
        .prop_map(|(tasks,)| {
            let mut specs: Vec<TaskSpec> = Vec::new();
            for (i, (lifecycle, readiness, deps)) in tasks.into_iter().enumerate() {
                let mut t = TaskSpec {
                    lifecycle,
                    ..TaskSpec::named(TaskName::parse(&format!("t{i}")).unwrap())
                };
                t.readiness =
                    readiness && matches!(t.stage(), Stage::PrestartSidecar | Stage::Main);
                for (target, condition, other) in deps {
                    let d = match other {
                        // Another allocation's task.
                        0 | 1 => Dependency {
                            task: TaskName::parse(&format!("x{target}")).unwrap(),
                            allocation: Some(AllocId::parse(&format!("other-{other}")).unwrap()),
                            condition,
                        },
                        // An earlier task of this one (no cycles).
                        _ if i > 0 => Dependency {
                            task: specs[target % i].name.clone(),
                            allocation: None,
                            condition,
                        },
                        _ => continue,
                    };
                    let mut with = specs.clone();
                    let mut candidate = t.clone();
                    candidate.depends_on.push(d.clone());
                    with.push(candidate);
                    if AllocSpec::new(with, &Limits::default()).is_ok() {
                        t.depends_on.push(d);
                    }
                }
                specs.push(t);
            }
            let spec = AllocSpec::new(specs, &Limits::default()).unwrap();
            Allocation::register(AllocId::parse("a").unwrap(), Arc::new(spec), 1, NOW)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("TASKGATE_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(512)
    ))]

    /// `allowed`, `blocked_by` and `waiting` agree with the written rules
    /// through random histories: the gate open, not lost, and every
    /// dependency holding by the table, for targets of this allocation
    /// (judged from its own states) and of others (whatever the registry
    /// says of them).
    #[test]
    fn dependencies_agree_with_the_written_rules(
        start in arb_dependent(),
        ops in prop::collection::vec((arb_reports(), prop::collection::vec(any::<bool>(), 8)), 0..30),
    ) {
        let mut a = start;
        let mut index = a.modify_index;
        for (raw, others) in ops {
            let r = to_reports(&a, &raw);
            if let Some(next) = a.report(&r, NOW, || { index += 1; index }) {
                a = next;
            }
            // The registry's verdicts on the other allocations' tasks.
            let verdict = |i: usize, j: usize| {
                if others[(i + j) % 8] { DepState::Holds } else { DepState::Blocked(Why::Pending) }
            };
            if let Some(next) = a.resolve(&verdict, NOW, || { index += 1; index }) {
                a = next;
            }
            check_invariants(&a)?;
            for (i, spec) in a.spec.tasks().iter().enumerate() {
                let deps_hold = spec.depends_on.iter().enumerate().all(|(j, d)| match &d.allocation {
                    Some(_) => others[(i + j) % 8],
                    None => reference_holds(
                        d.condition,
                        a.spec.position(d.task.as_str()).map(|t| &a.tasks[t]),
                    ),
                });
                let gate = coordinator::is_open(a.state, spec.stage());
                prop_assert_eq!(a.allowed(i), gate && !a.tasks[i].lost() && deps_hold, "task {}", i);
                prop_assert_eq!(a.blocked_by(i).is_empty(), deps_hold);
            }
            for (name, why) in a.waiting() {
                let i = a.position(name.as_str()).unwrap();
                if why == WaitFor::Dependency {
                    prop_assert!(!a.blocked_by(i).is_empty());
                    prop_assert_eq!(a.tasks[i].state, RunState::Pending);
                }
            }
        }
    }
}
