//! The upstream scenarios of docs/lifecycle.md (Nomad's coordinator tests), plus
//! the restart and restore rules, each as a named test.

use std::sync::Arc;

use time::macros::datetime;

use super::*;

const NOW: Timestamp = datetime!(2026-11-21 10:00 UTC);

/// Notation of docs/lifecycle.md: `(name, hook, sidecar)`; hook "" is main.
pub(super) fn alloc(tasks: &[(&str, &str, bool)]) -> Allocation {
    let specs = tasks
        .iter()
        .map(|(name, hook, sidecar)| TaskSpec {
            name: TaskName::parse(name).unwrap(),
            lifecycle: (!hook.is_empty()).then(|| Lifecycle {
                hook: hook.parse().unwrap(),
                sidecar: *sidecar,
            }),
            leader: false,
            readiness: false,
            liveness: None,
            depends_on: Vec::new(),
            acquire: Vec::new(),
            barrier: None,
        })
        .collect();
    let spec = AllocSpec::new(specs, &Limits::default()).unwrap();
    Allocation::register(AllocId::parse("a1").unwrap(), Arc::new(spec), 1, NOW)
}

/// Reports in the notation of `report` (`failed`: dead and failed).
pub(super) fn reports(a: &Allocation, states: &[(&str, &str)]) -> Vec<(usize, TaskReport)> {
    states
        .iter()
        .map(|(name, st)| {
            let (state, failed) = match *st {
                "failed" => (RunState::Dead, true),
                s => (s.parse().unwrap(), false),
            };
            let report = TaskReport {
                state,
                failed,
                event: None,
                ready: None,
            };
            (a.position(name).unwrap(), report)
        })
        .collect()
}

/// Reports states (`pending`, `running`, `dead`, or `failed` for dead and
/// failed) together, as one batch.
fn report(a: &mut Allocation, states: &[(&str, &str)]) {
    let r = reports(a, states);
    let next_index = a.modify_index + 1;
    if let Some(next) = a.report(&r, NOW, || next_index) {
        *a = next;
    }
}

fn restore(a: &mut Allocation, states: &[(&str, &str)]) {
    let r = reports(a, states);
    let next_index = a.modify_index + 1;
    if let Some(next) = a.restore(&r, NOW, || next_index) {
        *a = next;
    }
}

fn allowed(a: &Allocation) -> Vec<&str> {
    (0..a.tasks.len())
        .filter(|&i| a.allowed(i))
        .map(|i| a.task_name(i).as_str())
        .collect()
}

#[track_caller]
fn check(a: &Allocation, state: CoordState, open: &[&str]) {
    assert_eq!(a.state, state, "coordinator state");
    assert_eq!(allowed(a), open, "allowed tasks in {state}");
}

#[test]
fn upstream_1_only_main() {
    let mut a = alloc(&[("web", "", false)]);
    check(&a, CoordState::Main, &["web"]);
    report(&mut a, &[("web", "running")]);
    check(&a, CoordState::WaitAlloc, &["web"]);
}

#[test]
fn upstream_2_prestart_sidecar_and_ephemeral() {
    let mut a = alloc(&[
        ("web", "", false),
        ("side", "prestart", true),
        ("init", "prestart", false),
    ]);
    check(&a, CoordState::Prestart, &["side", "init"]);
    report(&mut a, &[("side", "running")]);
    check(&a, CoordState::Prestart, &["side", "init"]);
    report(&mut a, &[("init", "running")]);
    check(&a, CoordState::Prestart, &["side", "init"]);
    report(&mut a, &[("init", "dead")]);
    check(&a, CoordState::Main, &["web", "side"]);
}

#[test]
fn upstream_3_two_inits_then_main() {
    let mut a = alloc(&[
        ("main-0", "", false),
        ("init-0", "prestart", false),
        ("init-1", "prestart", false),
    ]);
    check(&a, CoordState::Prestart, &["init-0", "init-1"]);
    report(&mut a, &[("init-0", "dead"), ("init-1", "dead")]);
    check(&a, CoordState::Main, &["main-0"]);
}

#[test]
fn upstream_4_a_failed_init_keeps_prestart() {
    let mut a = alloc(&[
        ("main-0", "", false),
        ("init-0", "prestart", false),
        ("init-1", "prestart", false),
    ]);
    report(&mut a, &[("init-0", "dead"), ("init-1", "failed")]);
    check(&a, CoordState::Prestart, &["init-0", "init-1"]);
    assert_eq!(a.waiting_on(), [TaskName::parse("init-1").unwrap()]);
}

#[test]
fn upstream_5_a_pending_sidecar_keeps_prestart() {
    let mut a = alloc(&[
        ("web", "", false),
        ("side", "prestart", true),
        ("init", "prestart", false),
    ]);
    report(&mut a, &[("init", "dead")]);
    check(&a, CoordState::Prestart, &["side", "init"]);
    assert_eq!(a.waiting_on(), [TaskName::parse("side").unwrap()]);
}

#[test]
fn upstream_6_poststart_opens_once_main_runs() {
    let mut a = alloc(&[
        ("web", "", false),
        ("side", "prestart", true),
        ("post", "poststart", false),
    ]);
    check(&a, CoordState::Prestart, &["side"]);
    report(&mut a, &[("side", "running")]);
    check(&a, CoordState::Main, &["web", "side"]);
    report(&mut a, &[("web", "running")]);
    check(&a, CoordState::Poststart, &["web", "side", "post"]);
}

#[test]
fn upstream_7_restore_prestart_still_running() {
    let mut a = alloc(&[
        ("pre_ephemeral", "prestart", false),
        ("pre_side", "prestart", true),
        ("main", "", false),
    ]);
    restore(
        &mut a,
        &[
            ("pre_ephemeral", "running"),
            ("pre_side", "running"),
            ("main", "pending"),
        ],
    );
    check(&a, CoordState::Prestart, &["pre_ephemeral", "pre_side"]);
}

#[test]
fn upstream_7_restore_prestart_done() {
    let mut a = alloc(&[
        ("pre_ephemeral", "prestart", false),
        ("pre_side", "prestart", true),
        ("main", "", false),
    ]);
    restore(
        &mut a,
        &[("pre_ephemeral", "dead"), ("pre_side", "running")],
    );
    check(&a, CoordState::Main, &["pre_side", "main"]);
}

#[test]
fn upstream_7_restore_only_main_running() {
    let mut a = alloc(&[("main", "", false)]);
    restore(&mut a, &[("main", "running")]);
    assert!(a.allowed(0));
    check(&a, CoordState::WaitAlloc, &["main"]);
}

#[test]
fn upstream_7_restore_poststart_tasks() {
    let mut a = alloc(&[
        ("main", "", false),
        ("post_ephemeral", "poststart", false),
        ("post_side", "poststart", true),
    ]);
    restore(
        &mut a,
        &[
            ("main", "running"),
            ("post_ephemeral", "dead"),
            ("post_side", "running"),
        ],
    );
    check(&a, CoordState::WaitAlloc, &["main", "post_side"]);
}

#[test]
fn upstream_7_restore_into_poststop() {
    let mut a = alloc(&[("main", "", false), ("poststop", "poststop", false)]);
    restore(&mut a, &[("main", "dead"), ("poststop", "running")]);
    check(&a, CoordState::Poststop, &["poststop"]);
}

#[test]
fn restore_from_poststop_goes_back_to_prestart() {
    let mut a = alloc(&[("init", "prestart", false), ("web", "", false)]);
    report(&mut a, &[("init", "dead"), ("web", "dead")]);
    assert_eq!(a.state, CoordState::Poststop);
    restore(&mut a, &[("init", "running"), ("web", "pending")]);
    check(&a, CoordState::Prestart, &["init"]);
}

#[test]
fn only_poststop_tasks_start_in_poststop() {
    let a = alloc(&[("cleanup", "poststop", false)]);
    check(&a, CoordState::Poststop, &["cleanup"]);
}

#[test]
fn empty_stages_are_skipped_in_one_evaluation() {
    let a = alloc(&[("web", "", false), ("cleanup", "poststop", false)]);
    check(&a, CoordState::Main, &["web"]);
    let mut a = a;
    report(&mut a, &[("web", "running")]);
    check(&a, CoordState::WaitAlloc, &["web"]);
}

#[test]
fn every_non_poststop_task_dead_means_poststop_from_any_state() {
    let mut a = alloc(&[
        ("init", "prestart", false),
        ("web", "", false),
        ("cleanup", "poststop", false),
    ]);
    report(&mut a, &[("init", "failed"), ("web", "dead")]);
    check(&a, CoordState::Poststop, &["cleanup"]);
    assert!(a.waiting_on().is_empty());
}

#[test]
fn poststart_sidecars_do_not_hold_wait_alloc() {
    let mut a = alloc(&[
        ("web", "", false),
        ("post", "poststart", false),
        ("log", "poststart", true),
    ]);
    report(&mut a, &[("web", "running")]);
    check(&a, CoordState::Poststart, &["web", "post", "log"]);
    report(&mut a, &[("post", "failed")]);
    check(&a, CoordState::WaitAlloc, &["web", "log"]);
    assert_eq!(
        a.waiting_on(),
        [
            TaskName::parse("web").unwrap(),
            TaskName::parse("log").unwrap()
        ]
    );
}

#[test]
fn the_five_task_walkthrough_opens_gates_in_order() {
    let mut a = alloc(&[
        ("init", "prestart", false),
        ("proxy", "prestart", true),
        ("web", "", false),
        ("announce", "poststart", false),
        ("cleanup", "poststop", false),
    ]);
    check(&a, CoordState::Prestart, &["init", "proxy"]);
    report(&mut a, &[("init", "running"), ("proxy", "running")]);
    report(&mut a, &[("init", "dead")]);
    check(&a, CoordState::Main, &["proxy", "web"]);
    report(&mut a, &[("web", "running")]);
    check(&a, CoordState::Poststart, &["proxy", "web", "announce"]);
    report(&mut a, &[("announce", "dead")]);
    check(&a, CoordState::WaitAlloc, &["proxy", "web"]);
    report(&mut a, &[("web", "dead")]);
    assert!(a.desired(1).is_stop(), "the sidecar is told to stop");
    report(&mut a, &[("proxy", "dead")]);
    check(&a, CoordState::Poststop, &["cleanup"]);
}

// ---- restarts ----

fn five() -> Allocation {
    let mut a = alloc(&[
        ("init", "prestart", false),
        ("proxy", "prestart", true),
        ("web", "", false),
        ("announce", "poststart", false),
        ("cleanup", "poststop", false),
    ]);
    report(&mut a, &[("init", "dead"), ("proxy", "running")]);
    report(&mut a, &[("web", "running")]);
    a
}

#[test]
fn restart_one_task_signals_only_it_and_keeps_the_coordinator() {
    let a = five();
    let web = a.position("web").unwrap();
    let (next, chosen) = a
        .restart(RestartMode::Task(web), "why", NOW, || 99)
        .unwrap();
    let next = next.unwrap();
    assert_eq!(chosen, [web]);
    assert_eq!(next.state, a.state);
    assert_eq!(next.tasks[web].restart_generation, 1);
    assert_eq!(
        next.tasks[web].state,
        RunState::Running,
        "reported state unchanged"
    );
    let ev = next.tasks[web].events.last().unwrap();
    assert_eq!(
        (ev.kind.as_str(), ev.message.as_str()),
        ("Restart Signaled", "why")
    );
    assert_eq!(next.tasks[web].modify_index, 99);
    assert_eq!(
        next.tasks[0].modify_index, a.tasks[0].modify_index,
        "others untouched"
    );
}

#[test]
fn restart_one_task_that_is_not_running_fails() {
    let a = five();
    for name in ["init", "announce", "cleanup"] {
        let i = a.position(name).unwrap();
        let err = a.restart(RestartMode::Task(i), "", NOW, || 99).unwrap_err();
        assert_eq!(
            err,
            RestartError::TaskNotRunning(TaskName::parse(name).unwrap())
        );
    }
}

#[test]
fn restart_running_tasks_skips_the_others() {
    let a = five();
    let (next, chosen) = a.restart(RestartMode::Running, "", NOW, || 99).unwrap();
    let names: Vec<_> = chosen.iter().map(|&i| a.task_name(i).as_str()).collect();
    assert_eq!(names, ["proxy", "web"]);
    assert_eq!(next.unwrap().state, a.state);
}

#[test]
fn restart_running_with_nothing_running_changes_nothing() {
    let a = alloc(&[("init", "prestart", false), ("web", "", false)]);
    let (next, chosen) = a.restart(RestartMode::Running, "", NOW, || 99).unwrap();
    assert!(chosen.is_empty());
    assert!(next.is_none());
}

#[test]
fn restart_all_tasks_resets_to_init_and_replays_in_order() {
    let a = five();
    let (next, chosen) = a.restart(RestartMode::AllTasks, "", NOW, || 99).unwrap();
    let mut a = next.unwrap();
    let names: Vec<_> = chosen.iter().map(|&i| a.task_name(i).as_str()).collect();
    assert_eq!(names, ["init", "proxy", "web"], "poststop never restarts");
    check(&a, CoordState::Init, &[]);
    report(&mut a, &[("init", "pending"), ("proxy", "pending")]);
    check(&a, CoordState::Init, &[]);
    assert_eq!(a.waiting_on(), [TaskName::parse("web").unwrap()]);
    report(&mut a, &[("web", "pending")]);
    check(&a, CoordState::Prestart, &["init", "proxy"]);
    report(&mut a, &[("init", "dead"), ("proxy", "running")]);
    check(&a, CoordState::Main, &["proxy", "web"]);
}

#[test]
fn restart_all_tasks_moves_on_at_once_when_all_are_pending() {
    let a = alloc(&[("init", "prestart", false), ("web", "", false)]);
    let (next, chosen) = a.restart(RestartMode::AllTasks, "", NOW, || 99).unwrap();
    assert!(chosen.is_empty());
    assert!(next.is_none(), "reset and re-evaluated to the same state");
    assert_eq!(a.state, CoordState::Prestart);
}

#[test]
fn restart_in_poststop_fails_and_changes_nothing() {
    let mut a = alloc(&[("web", "", false), ("cleanup", "poststop", false)]);
    report(&mut a, &[("web", "dead")]);
    for mode in [
        RestartMode::Running,
        RestartMode::AllTasks,
        RestartMode::Task(0),
    ] {
        assert_eq!(
            a.restart(mode, "", NOW, || 99).unwrap_err(),
            RestartError::AllocationFinished
        );
    }
    assert_eq!(a.state, CoordState::Poststop);
}

// ---- indexes ----

#[test]
fn a_noop_report_changes_no_index() {
    let mut a = five();
    let before = a.clone();
    let r = reports(&a, &[("web", "running")]);
    assert!(
        a.report(&r, NOW, || unreachable!("no index for a no-op"))
            .is_none()
    );
    report(&mut a, &[("web", "running")]);
    assert_eq!(a, before);
}

#[test]
fn a_change_stamps_the_allocation_and_only_the_tasks_it_touched() {
    let a = alloc(&[("web", "", false), ("other", "", false)]);
    let r = reports(&a, &[("web", "running")]);
    let next = a.report(&r, NOW, || 7).unwrap();
    assert_eq!(next.modify_index, 7);
    assert_eq!(next.tasks[0].modify_index, 7);
    assert_eq!(next.tasks[1].modify_index, 1);
}

#[test]
fn a_new_stop_order_touches_the_task_it_stops() {
    let mut a = five();
    let proxy = a.position("proxy").unwrap();
    report(&mut a, &[("announce", "dead")]);
    let before = a.tasks[proxy].modify_index;
    report(&mut a, &[("web", "dead")]);
    assert!(a.desired(proxy).is_stop());
    assert!(a.tasks[proxy].modify_index > before);
}

#[test]
fn a_gate_opening_touches_the_task_behind_it() {
    let mut a = five();
    // `announce` opened when web started: its index moved with the gate.
    let announce = a.position("announce").unwrap();
    assert_eq!(a.tasks[announce].modify_index, a.modify_index);
    report(&mut a, &[("announce", "running")]);
    assert_eq!(a.tasks[announce].modify_index, a.modify_index);
}
