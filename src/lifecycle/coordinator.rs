//! The coordinator state machine: the gate table, the next-state rule
//! applied until stable, and which tasks hold the coordinator where it is.

use super::{AllocSpec, RunState, Stage, TaskName, TaskSpec, TaskStatus};

named_enum! {
    /// The coordinator's state. Declaration order is the forward order:
    /// the state only moves to a later variant, except through an
    /// all-tasks restart (back to `init`) or a restore (back to `prestart`).
    pub enum CoordState ("coordinator state") {
        Init = "init",
        Prestart = "prestart",
        Main = "main",
        Poststart = "poststart",
        WaitAlloc = "wait_alloc",
        Poststop = "poststop",
    }
}

const O: bool = true;
const C: bool = false;

/// The gate table: which stage gates each state opens, in the column order
/// of `Stage` (prestart_ephemeral, prestart_sidecar, main,
/// poststart_ephemeral, poststart_sidecar, poststop).
pub const fn gates(state: CoordState) -> [bool; 6] {
    match state {
        CoordState::Init => [C, C, C, C, C, C],
        CoordState::Prestart => [O, O, C, C, C, C],
        CoordState::Main => [C, O, O, C, C, C],
        CoordState::Poststart => [C, O, O, O, O, C],
        CoordState::WaitAlloc => [C, O, O, C, O, C],
        CoordState::Poststop => [C, C, C, C, C, O],
    }
}

/// Whether a task of `stage` may start while the coordinator is in `state`.
pub const fn is_open(state: CoordState, stage: Stage) -> bool {
    gates(state)[stage.column()]
}

named_enum! {
    /// What a task in `waiting_on` is waited on for.
    pub enum WaitFor ("wait reason") {
        /// To report `pending` (after an all-tasks restart).
        Pending = "pending",
        /// To end successfully (a prestart ephemeral task).
        Success = "success",
        /// To be running (a prestart sidecar), or to have started (a main
        /// task).
        Running = "running",
        /// To be running and ready (a task that declares readiness).
        Ready = "ready",
        /// To be dead.
        Dead = "dead",
        /// Its gate is open, but a dependency does not hold: it may not
        /// start yet.
        Dependency = "dependency",
    }
}

/// What holds the coordinator in `state` on task `t`, if anything: the one
/// rule behind both the transitions and `waiting_on`.
pub fn wait_for(state: CoordState, spec: &TaskSpec, t: &TaskStatus) -> Option<WaitFor> {
    let stage = spec.stage();
    match state {
        CoordState::Init => (t.state != RunState::Pending).then_some(WaitFor::Pending),
        CoordState::Prestart => match stage {
            Stage::PrestartEphemeral => (!t.successful()).then_some(WaitFor::Success),
            Stage::PrestartSidecar if !t.up(spec.readiness) => Some(if spec.readiness {
                WaitFor::Ready
            } else {
                WaitFor::Running
            }),
            _ => None,
        },
        // A main task that dies before it was ever ready holds nothing.
        CoordState::Main if stage == Stage::Main => match t.state {
            RunState::Pending if spec.readiness => Some(WaitFor::Ready),
            RunState::Pending => Some(WaitFor::Running),
            RunState::Running if !t.up(spec.readiness) => Some(WaitFor::Ready),
            _ => None,
        },
        CoordState::Main => None,
        CoordState::Poststart => (stage == Stage::PoststartEphemeral && t.state != RunState::Dead)
            .then_some(WaitFor::Dead),
        CoordState::WaitAlloc => {
            (stage != Stage::Poststop && t.state != RunState::Dead).then_some(WaitFor::Dead)
        }
        CoordState::Poststop => None,
    }
}

/// One step of the transition rules of docs/lifecycle.md.
pub fn next_state(state: CoordState, spec: &AllocSpec, status: &[TaskStatus]) -> CoordState {
    let tasks = || spec.tasks().iter().zip(status);
    let non_poststop_dead = tasks()
        .filter(|(s, _)| !s.is_poststop())
        .all(|(_, t)| t.state == RunState::Dead);
    if non_poststop_dead {
        return CoordState::Poststop;
    }
    // Each state moves on when no task holds it ("when there is no such
    // task, or every such task ..." is `all` over a set, empty or not).
    let held = || tasks().any(|(s, t)| wait_for(state, s, t).is_some());
    match state {
        CoordState::Init if !held() => CoordState::Prestart,
        CoordState::Prestart if !held() => CoordState::Main,
        CoordState::Main if !held() => CoordState::Poststart,
        CoordState::Poststart if !held() => CoordState::WaitAlloc,
        // `wait_alloc` and `poststop` stay.
        _ => state,
    }
}

/// Applies `next_state` until the state stops changing, so empty stages are
/// skipped in one evaluation.
pub fn evaluate(mut state: CoordState, spec: &AllocSpec, status: &[TaskStatus]) -> CoordState {
    // Each step moves strictly forward or stops, so this ends within
    // `CoordState::ALL.len()` steps; the bound just makes that visible.
    for _ in 0..CoordState::ALL.len() {
        let next = next_state(state, spec, status);
        if next == state {
            break;
        }
        state = next;
    }
    state
}

/// The tasks, in registration order, whose state holds the coordinator in
/// `state`, each with what it is waited on for (the API's `waiting_on` and
/// `waiting`).
pub fn waiting(
    state: CoordState,
    spec: &AllocSpec,
    status: &[TaskStatus],
) -> Vec<(TaskName, WaitFor)> {
    spec.tasks()
        .iter()
        .zip(status)
        .filter_map(|(s, t)| wait_for(state, s, t).map(|w| (s.name.clone(), w)))
        .collect()
}

/// The names of `waiting`.
pub fn waiting_on(state: CoordState, spec: &AllocSpec, status: &[TaskStatus]) -> Vec<TaskName> {
    spec.tasks()
        .iter()
        .zip(status)
        .filter(|(s, t)| wait_for(state, s, t).is_some())
        .map(|(s, _)| s.name.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gate_table_matches_semantics() {
        // Rows as written in docs/lifecycle.md, columns in `Stage` order.
        let open = |state| -> Vec<&str> {
            Stage::ALL
                .iter()
                .filter(|s| is_open(state, **s))
                .map(|s| s.as_str())
                .collect()
        };
        assert!(open(CoordState::Init).is_empty());
        assert_eq!(
            open(CoordState::Prestart),
            ["prestart_ephemeral", "prestart_sidecar"]
        );
        assert_eq!(open(CoordState::Main), ["prestart_sidecar", "main"]);
        assert_eq!(
            open(CoordState::Poststart),
            [
                "prestart_sidecar",
                "main",
                "poststart_ephemeral",
                "poststart_sidecar"
            ]
        );
        assert_eq!(
            open(CoordState::WaitAlloc),
            ["prestart_sidecar", "main", "poststart_sidecar"]
        );
        assert_eq!(open(CoordState::Poststop), ["poststop"]);
    }

    #[test]
    fn state_names_are_exact() {
        // Nomad once printed `poststop` as "poststart"; pin every name.
        let names: Vec<_> = CoordState::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(
            names,
            [
                "init",
                "prestart",
                "main",
                "poststart",
                "wait_alloc",
                "poststop"
            ]
        );
        for s in CoordState::ALL {
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
            assert_eq!(format!("{s}"), s.as_str());
            assert_eq!(s.as_str().parse::<CoordState>().unwrap(), *s);
        }
    }
}
