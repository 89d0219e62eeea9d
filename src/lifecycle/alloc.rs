//! One allocation's record and the operations on it: register, report,
//! restart, restore. Each operation returns the next version of the record
//! (or `None` when nothing changed); the caller persists and publishes it.

use std::sync::Arc;

use super::{
    AllocId, AllocSpec, CoordState, Desired, Details, Event, RunState, Stage, TaskName, TaskReport,
    TaskStatus, Timestamp,
    coordinator::{WaitFor, evaluate, gates, is_open, waiting, waiting_on},
    orders::{Outcome, RUN, StopKind, stop_order},
};

/// Which tasks an operator restart targets (docs/lifecycle.md, Restart).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestartMode {
    /// One task, by position; it must be running and not a poststop task.
    Task(usize),
    /// Every running non-poststop task.
    Running,
    /// Every running or dead non-poststop task; resets the coordinator.
    AllTasks,
}

impl RestartMode {
    pub fn as_str(self) -> &'static str {
        match self {
            RestartMode::Task(_) => "task",
            RestartMode::Running => "running",
            RestartMode::AllTasks => "all_tasks",
        }
    }
}

/// One operation on an allocation, for `Allocation::check_step`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Report,
    Restart(RestartMode),
    Restore,
}

/// Why a restart was refused. A refused restart changes nothing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RestartError {
    #[error(
        "allocation has finished (coordinator is in poststop): nothing is left to restart; \
         register a new allocation to run the group again"
    )]
    AllocationFinished,
    #[error(
        "task \"{0}\" is not running, so it cannot be restarted alone; restart it once it \
         runs, or restart every task with {{\"all_tasks\": true}}"
    )]
    TaskNotRunning(TaskName),
}

/// The event recorded on each task told to restart.
pub const RESTART_EVENT: &str = "Restart Signaled";

/// Everything known about one allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    pub id: AllocId,
    /// Shared between versions: the spec never changes after registration.
    pub spec: Arc<AllocSpec>,
    pub state: CoordState,
    /// Parallel to `spec.tasks()`.
    pub tasks: Vec<TaskStatus>,
    pub create_index: u64,
    pub modify_index: u64,
    pub created_at: Timestamp,
    pub modified_at: Timestamp,
    /// The stop order of every non-poststop task (poststop tasks always
    /// run). Sticky: the first stop order the states call for is kept,
    /// reason and all, until an all-tasks restart or a restore clears it.
    /// One value, not one per task: a record is one heap block less to
    /// copy and to free on every change.
    order: Desired,
}

impl Allocation {
    /// A new allocation, evaluated once with every task pending.
    pub fn register(id: AllocId, spec: Arc<AllocSpec>, index: u64, now: Timestamp) -> Self {
        let tasks = vec![TaskStatus::new(index); spec.tasks().len()];
        let state = evaluate(CoordState::Init, &spec, &tasks);
        Self::from_parts(id, spec, state, tasks, None, index, index, now, now)
    }

    /// Rebuilds a record exactly as it was stored: the coordinator state is
    /// taken as given, never re-evaluated, so recovery opens or closes no
    /// gate. `order` is the stored stop order; `None` (a record of a build
    /// that did not store it) computes it from the states.
    #[allow(clippy::too_many_arguments)]
    pub fn from_parts(
        id: AllocId,
        spec: Arc<AllocSpec>,
        state: CoordState,
        tasks: Vec<TaskStatus>,
        order: Option<Desired>,
        create_index: u64,
        modify_index: u64,
        created_at: Timestamp,
        modified_at: Timestamp,
    ) -> Self {
        let order = order.unwrap_or_else(|| stop_order(&spec, &tasks));
        Self {
            id,
            spec,
            state,
            tasks,
            create_index,
            modify_index,
            created_at,
            modified_at,
            order,
        }
    }

    /// Replaces the index `from` with `to` wherever a change stamped it
    /// (the allocation, its creation, the tasks it touched): a change
    /// decided with a placeholder index takes the one its commit got.
    pub fn restamp(&mut self, from: u64, to: u64) {
        for index in [&mut self.create_index, &mut self.modify_index]
            .into_iter()
            .chain(self.tasks.iter_mut().map(|t| &mut t.modify_index))
        {
            if *index == from {
                *index = to;
            }
        }
    }

    /// Position of a task by name.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.spec.position(name)
    }

    pub fn task_name(&self, i: usize) -> &TaskName {
        &self.spec.tasks()[i].name
    }

    /// Whether task `i`'s gate is open.
    pub fn allowed(&self, i: usize) -> bool {
        is_open(self.state, self.spec.tasks()[i].stage())
    }

    /// The allocation's stop order, as stored (poststop tasks ignore it).
    pub fn order(&self) -> &Desired {
        &self.order
    }

    /// How the allocation ended, once the coordinator is in `poststop`:
    /// `failed` with the failed non-poststop tasks (registration order) if
    /// any, else `succeeded`; `None` before.
    pub fn outcome(&self) -> Option<(Outcome, Vec<TaskName>)> {
        if self.state != CoordState::Poststop {
            return None;
        }
        let failed: Vec<TaskName> = self
            .spec
            .tasks()
            .iter()
            .zip(&self.tasks)
            .filter(|(s, t)| !s.is_poststop() && t.failed)
            .map(|(s, _)| s.name.clone())
            .collect();
        let outcome = if failed.is_empty() {
            Outcome::Succeeded
        } else {
            Outcome::Failed
        };
        Some((outcome, failed))
    }

    /// Task `i`'s stop order.
    pub fn desired(&self, i: usize) -> &Desired {
        if self.spec.tasks()[i].is_poststop() {
            &RUN
        } else {
            &self.order
        }
    }

    /// The invariants of docs/lifecycle.md every settled allocation keeps; the
    /// first one broken, described. Checked by the property tests and the
    /// lifecycle fuzz target after every step.
    pub fn check_invariants(&self) -> Result<(), String> {
        // The allowed set is the gate-table row of the current state, and
        // poststop tasks are never told to stop.
        let row = gates(self.state);
        for (i, spec) in self.spec.tasks().iter().enumerate() {
            if self.allowed(i) != row[spec.stage().column()] {
                return Err(format!("task {i}'s gate is not the gate table's"));
            }
            if spec.is_poststop() && self.desired(i).is_stop() {
                return Err(format!("poststop task {i} was told to stop"));
            }
        }
        // Every non-poststop task dead means poststop. (Not the converse:
        // poststop is terminal, even if a task later reports `pending`
        // against the protocol.)
        let all_dead = self
            .spec
            .tasks()
            .iter()
            .zip(&self.tasks)
            .filter(|(s, _)| !s.is_poststop())
            .all(|(_, t)| t.state == RunState::Dead);
        if all_dead && self.state != CoordState::Poststop {
            return Err(format!(
                "every task is dead but the state is {:?}",
                self.state
            ));
        }
        // The state is stable: evaluating again changes nothing.
        if evaluate(self.state, &self.spec, &self.tasks) != self.state {
            return Err(format!("{:?} is not settled", self.state));
        }
        // Something always holds a live coordinator where it is.
        if self.waiting_on().is_empty() != (self.state == CoordState::Poststop) {
            return Err(format!("waiting_on does not fit {:?}", self.state));
        }
        // No task carries an index newer than its allocation.
        if self
            .tasks
            .iter()
            .any(|t| t.modify_index > self.modify_index)
        {
            return Err("a task's index is newer than its allocation's".to_owned());
        }
        Ok(())
    }

    /// The rules of docs/lifecycle.md that hold between two versions:
    /// `next` came from `self` by `step`. The first one broken, described.
    pub fn check_step(&self, next: &Self, step: Step) -> Result<(), String> {
        // Where the step evaluated from, and whether it cleared the order.
        let (from, cleared) = match step {
            Step::Restart(RestartMode::AllTasks) => (CoordState::Init, true),
            Step::Restore => (CoordState::Prestart, true),
            Step::Report | Step::Restart(_) => (self.state, false),
        };
        // A stop order keeps its reason until cleared.
        if self.order.is_stop() && !cleared && next.order != self.order {
            return Err(format!(
                "the stop order changed from {:?} to {:?}",
                self.order, next.order
            ));
        }
        // Right after an all-tasks restart no restarted task's old state
        // counts: a stop order then has a cause no restart touched — a
        // poststop leader that ended, or only sidecars left to run (rule
        // 3 holds at once for them). Never a failed sibling: every dead
        // non-poststop task was restarted.
        if step == Step::Restart(RestartMode::AllTasks)
            && let Some(reason) = next.order.reason()
        {
            let tasks = || self.spec.tasks().iter();
            let explained = match reason.kind {
                StopKind::LeaderTaskDead => tasks().any(|s| s.leader && s.is_poststop()),
                StopKind::SiblingTaskFailed => false,
                StopKind::MainTasksDead => tasks().all(|s| s.is_poststop() || s.is_sidecar()),
            };
            if !explained {
                return Err(format!(
                    "told to stop right after an all-tasks restart: {:?}",
                    next.order
                ));
            }
        }
        // A readiness task never lets the next stage open while it is not
        // ready.
        let passed = |state: CoordState| {
            from <= state && next.state > state && next.state != CoordState::Poststop
        };
        for (spec, t) in next.spec.tasks().iter().zip(&next.tasks) {
            if !spec.readiness {
                continue;
            }
            let held = match spec.stage() {
                Stage::PrestartSidecar => passed(CoordState::Prestart) && !t.up(true),
                Stage::Main => passed(CoordState::Main) && !t.up(true) && t.state != RunState::Dead,
                _ => false,
            };
            if held {
                return Err(format!(
                    "{:?} went on to {:?} while {} was not ready",
                    from, next.state, spec.name
                ));
            }
        }
        Ok(())
    }

    pub fn waiting_on(&self) -> Vec<TaskName> {
        waiting_on(self.state, &self.spec, &self.tasks)
    }

    /// `waiting_on` with what each task is waited on for.
    pub fn waiting(&self) -> Vec<(TaskName, WaitFor)> {
        waiting(self.state, &self.spec, &self.tasks)
    }

    /// Applies reports (task position, report) together, then evaluates once.
    pub fn report(
        &self,
        reports: &[(usize, TaskReport)],
        now: Timestamp,
        next_index: impl FnOnce() -> u64,
    ) -> Option<Self> {
        self.apply_reports(reports, None, now, next_index)
    }

    /// Restore: jump to `prestart`, apply the reports, evaluate; the stop
    /// order is computed afresh from the restored states.
    pub fn restore(
        &self,
        reports: &[(usize, TaskReport)],
        now: Timestamp,
        next_index: impl FnOnce() -> u64,
    ) -> Option<Self> {
        self.apply_reports(reports, Some(CoordState::Prestart), now, next_index)
    }

    /// Applies reports, then evaluates from `from` (default: the current
    /// state).
    fn apply_reports(
        &self,
        reports: &[(usize, TaskReport)],
        from: Option<CoordState>,
        now: Timestamp,
        next_index: impl FnOnce() -> u64,
    ) -> Option<Self> {
        let mut next = self.clone();
        for (i, r) in reports {
            next.tasks[*i].apply(r, now);
        }
        if from.is_some() {
            next.order = Desired::Run;
        }
        next.state = evaluate(from.unwrap_or(next.state), &next.spec, &next.tasks);
        next.settle(self, now, next_index)
    }

    /// An operator restart. Returns the next version (if anything changed)
    /// and the positions of the tasks told to restart.
    pub fn restart(
        &self,
        mode: RestartMode,
        reason: &str,
        now: Timestamp,
        next_index: impl FnOnce() -> u64,
    ) -> Result<(Option<Self>, Vec<usize>), RestartError> {
        if self.state == CoordState::Poststop {
            return Err(RestartError::AllocationFinished);
        }
        let eligible = |i: usize, states: &[RunState]| {
            !self.spec.tasks()[i].is_poststop() && states.contains(&self.tasks[i].state)
        };
        let chosen: Vec<usize> = match mode {
            RestartMode::Task(i) => {
                if !eligible(i, &[RunState::Running]) {
                    return Err(RestartError::TaskNotRunning(self.task_name(i).clone()));
                }
                vec![i]
            }
            RestartMode::Running => (0..self.tasks.len())
                .filter(|&i| eligible(i, &[RunState::Running]))
                .collect(),
            RestartMode::AllTasks => (0..self.tasks.len())
                .filter(|&i| eligible(i, &[RunState::Running, RunState::Dead]))
                .collect(),
        };
        let mut next = self.clone();
        for &i in &chosen {
            let t = &mut next.tasks[i];
            t.restart_generation += 1;
            // Until it reports again, its state is from before the order.
            t.stale = true;
            t.push_event(Event::new(
                RESTART_EVENT,
                now,
                reason,
                Details::from_pairs([("mode", mode.as_str())]),
            ));
        }
        if mode == RestartMode::AllTasks {
            // Evaluated at once like after any change: if every task is
            // already pending the coordinator moves on without waiting for a
            // report that might never come.
            next.state = evaluate(CoordState::Init, &next.spec, &next.tasks);
            next.order = Desired::Run;
        }
        Ok((next.settle(self, now, next_index), chosen))
    }

    /// Refreshes derived data, then stamps a new index on the allocation and
    /// on every task whose view changed (its status, its gate or its stop
    /// order). Returns `None` when nothing changed at all.
    fn settle(
        mut self,
        prev: &Self,
        now: Timestamp,
        next_index: impl FnOnce() -> u64,
    ) -> Option<Self> {
        if !self.order.is_stop() {
            self.order = stop_order(&self.spec, &self.tasks);
        }
        let touched: Vec<usize> = (0..self.tasks.len())
            .filter(|&i| {
                self.tasks[i] != prev.tasks[i]
                    || self.allowed(i) != prev.allowed(i)
                    || self.desired(i) != prev.desired(i)
            })
            .collect();
        if touched.is_empty() && self.state == prev.state {
            return None;
        }
        let index = next_index();
        for i in touched {
            self.tasks[i].modify_index = index;
        }
        self.modify_index = index;
        self.modified_at = now;
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use time::macros::datetime;

    use super::*;
    use crate::lifecycle::{Limits, RunState, TaskName, TaskSpec};

    /// A change decided with a placeholder index takes its commit's index
    /// wherever it stamped one, and nowhere else.
    #[test]
    fn restamping_replaces_the_placeholder_and_only_it() {
        let now = datetime!(2026-11-24 10:00 UTC);
        let tasks = ["a", "b"].map(|n| TaskSpec {
            name: TaskName::parse(n).unwrap(),
            lifecycle: None,
            leader: false,
            readiness: false,
        });
        let spec = Arc::new(AllocSpec::new(tasks.to_vec(), &Limits::default()).unwrap());
        let mut a = Allocation::register(AllocId::parse("x").unwrap(), spec, 1, now);
        a.restamp(1, 40);
        assert_eq!((a.create_index, a.modify_index), (40, 40));
        assert!(a.tasks.iter().all(|t| t.modify_index == 40));
        let running = TaskReport {
            state: RunState::Running,
            failed: false,
            event: None,
            ready: None,
        };
        let mut next = a.report(&[(1, running)], now, || 41).expect("a change");
        next.restamp(41, 97);
        assert_eq!((next.create_index, next.modify_index), (40, 97));
        assert_eq!(next.tasks[0].modify_index, 40, "untouched");
        assert_eq!(
            next.tasks[1].modify_index, 97,
            "the task the change touched"
        );
    }
}
