//! The coordinator state machine: the gate table, the next-state rule
//! applied until stable, and which tasks hold the coordinator where it is.

use super::{AllocSpec, RunState, Stage, TaskName, TaskStatus};

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

fn tasks<'a>(
    spec: &'a AllocSpec,
    status: &'a [TaskStatus],
) -> impl Iterator<Item = (Stage, &'a TaskStatus)> + Clone + 'a {
    spec.tasks().iter().map(|t| t.stage()).zip(status)
}

fn of_stage<'a>(
    all: impl Iterator<Item = (Stage, &'a TaskStatus)> + Clone + 'a,
    stages: &'a [Stage],
) -> impl Iterator<Item = &'a TaskStatus> + 'a {
    all.filter(move |(s, _)| stages.contains(s)).map(|(_, t)| t)
}

/// One step of the transition rules of docs/lifecycle.md.
pub fn next_state(state: CoordState, spec: &AllocSpec, status: &[TaskStatus]) -> CoordState {
    let all = tasks(spec, status);
    let non_poststop_dead = all
        .clone()
        .filter(|(s, _)| *s != Stage::Poststop)
        .all(|(_, t)| t.state == RunState::Dead);
    if non_poststop_dead {
        return CoordState::Poststop;
    }
    // Every rule below reads "when there is no such task, or every such task
    // ...": `all` over an empty set is true, which is exactly that.
    let advance = match state {
        CoordState::Init => all.clone().all(|(_, t)| t.state == RunState::Pending),
        CoordState::Prestart => {
            of_stage(all.clone(), &[Stage::PrestartEphemeral]).all(TaskStatus::successful)
                && of_stage(all.clone(), &[Stage::PrestartSidecar])
                    .all(|t| t.state == RunState::Running)
        }
        CoordState::Main => {
            of_stage(all.clone(), &[Stage::Main]).all(|t| t.state != RunState::Pending)
        }
        CoordState::Poststart => {
            of_stage(all.clone(), &[Stage::PoststartEphemeral]).all(|t| t.state == RunState::Dead)
        }
        CoordState::WaitAlloc | CoordState::Poststop => false,
    };
    if !advance {
        return state;
    }
    match state {
        CoordState::Init => CoordState::Prestart,
        CoordState::Prestart => CoordState::Main,
        CoordState::Main => CoordState::Poststart,
        CoordState::Poststart => CoordState::WaitAlloc,
        CoordState::WaitAlloc => CoordState::WaitAlloc,
        CoordState::Poststop => CoordState::Poststop,
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
/// `state` (the API's `waiting_on`).
pub fn waiting_on(state: CoordState, spec: &AllocSpec, status: &[TaskStatus]) -> Vec<TaskName> {
    let holds = |stage: Stage, t: &TaskStatus| -> bool {
        match state {
            CoordState::Init => t.state != RunState::Pending,
            CoordState::Prestart => match stage {
                Stage::PrestartEphemeral => !t.successful(),
                Stage::PrestartSidecar => t.state != RunState::Running,
                _ => false,
            },
            CoordState::Main => stage == Stage::Main && t.state == RunState::Pending,
            CoordState::Poststart => {
                stage == Stage::PoststartEphemeral && t.state != RunState::Dead
            }
            CoordState::WaitAlloc => stage != Stage::Poststop && t.state != RunState::Dead,
            CoordState::Poststop => false,
        }
    };
    spec.tasks()
        .iter()
        .zip(status)
        .filter(|(s, t)| holds(s.stage(), t))
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
