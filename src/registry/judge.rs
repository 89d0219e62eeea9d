//! Dependencies between allocations: the registry judges whether a task's
//! dependency on another allocation's task holds (it holds every record),
//! keeps a reverse index (target allocation → its dependents), and after
//! the follower publishes a change of a target, writes a new version of
//! each dependent whose verdicts changed, through the one write path. With
//! replicas every replica's follower sees the change and may try that
//! write; the compare-and-swap keeps one.
//!
//! A dependency that leads back to its own task (a cycle through other
//! allocations, which registration refuses but replicas racing two
//! registrations can make) is judged `cycle`, with the path: shown, never a
//! silent hang. Every question about the graph is one walk
//! (`lifecycle::walk`).

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex, PoisonError, RwLock},
};

use tokio::sync::watch;

use super::{Inner, Registry, RegistryError};
use crate::lifecycle::{
    AllocId, AllocSpec, Allocation, DepState, FieldError, Node, Target, Walk, judge_dependency,
    walk,
};

/// Tasks a registration's dependencies may reach, through the other
/// allocations' dependencies, at most: the server follows no chain longer
/// (a registration that would reach more is refused, so every search for
/// a cycle is bounded by it).
pub const MAX_REACH: usize = 1_000;

/// The reverse index and the judges in flight.
#[derive(Default)]
pub(super) struct Judges {
    /// Target allocation → the allocations with a task that depends on
    /// one of its tasks (each listed once). Written by the follower as
    /// allocations with dependencies on others appear and go.
    dependents: RwLock<HashMap<AllocId, HashSet<AllocId>>>,
    /// The index of a published change → its dependents' judging, while
    /// it runs: a writer answers once the judging its change started is
    /// done, so that whoever it answers sees the dependents' new verdicts
    /// too.
    judging: Mutex<HashMap<u64, watch::Receiver<bool>>>,
}

impl Judges {
    /// The other allocations `spec` depends on.
    fn targets(spec: &AllocSpec) -> HashSet<&AllocId> {
        spec.tasks()
            .iter()
            .flat_map(|t| t.depends_on.iter())
            .filter_map(|d| d.allocation.as_ref())
            .collect()
    }

    /// Keeps the reverse index for a record that appeared (`present`) or
    /// went.
    pub(super) fn index(&self, a: &Allocation, present: bool) {
        let targets = Self::targets(&a.spec);
        if targets.is_empty() {
            return;
        }
        let mut map = self
            .dependents
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        for t in targets {
            if present {
                map.entry(t.clone()).or_default().insert(a.id.clone());
            } else if let Some(set) = map.get_mut(t) {
                set.remove(&a.id);
                if set.is_empty() {
                    map.remove(t);
                }
            }
        }
    }

    /// The allocations that depend on `target`.
    fn of(&self, target: &str) -> Vec<AllocId> {
        self.dependents
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(target)
            .map(|set| set.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Every allocation that depends on another.
    fn all(&self) -> Vec<AllocId> {
        let map = self
            .dependents
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        let all: HashSet<&AllocId> = map.values().flatten().collect();
        all.into_iter().cloned().collect()
    }
}

impl Inner {
    /// After the follower published `changed` (each a target's ID and the
    /// index of its change): every allocation that depends on one of them
    /// is judged again, all at once (their writes share commits), in a task
    /// of its own.
    pub(super) fn judge(&self, changed: Vec<(AllocId, u64)>) {
        let mut dependents: Vec<AllocId> = Vec::new();
        let mut indexes = Vec::new();
        for (id, index) in changed {
            let of = self.judges.of(id.as_str());
            if !of.is_empty() {
                dependents.extend(of);
                indexes.push(index);
            }
        }
        if dependents.is_empty() {
            return;
        }
        dependents.sort_unstable();
        dependents.dedup();
        let Some(registry) = self.registry() else {
            return;
        };
        let (done, judged) = watch::channel(false);
        let mut judging = self
            .judges
            .judging
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for &index in &indexes {
            judging.insert(index, judged.clone());
        }
        drop(judging);
        let started = self.spawn(async move {
            let mut all = tokio::task::JoinSet::new();
            for d in dependents {
                let r = registry.clone();
                all.spawn(async move { r.resolve(d.as_str()).await });
            }
            while all.join_next().await.is_some() {}
            let mut judging = registry
                .inner
                .judges
                .judging
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            for index in indexes {
                judging.remove(&index);
            }
            drop(judging);
            done.send_replace(true);
        });
        if started.is_none() {
            tracing::warn!("dependents cannot be judged outside a runtime");
        }
    }
}

impl Registry {
    /// Waits until the judging of dependents that the change at `index`
    /// started is done (if it started any).
    pub(super) async fn judged(&self, index: u64) {
        let judging = self
            .inner
            .judges
            .judging
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&index)
            .cloned();
        if let Some(mut judged) = judging {
            // A judge that ended without saying so (its task gone) ends
            // the wait too.
            let _ = judged.wait_for(|done| *done).await;
        }
    }

    /// The record of `id` this registry holds, if any.
    fn record(&self, id: &str) -> Option<Arc<Allocation>> {
        self.handle(id).ok()?.current()
    }

    /// The spec of `id` as this registry holds it, or `a`'s (a
    /// registration not yet in the map).
    fn spec_of<'a>(
        &'a self,
        a: &'a Allocation,
    ) -> impl Fn(&AllocId) -> Option<Arc<AllocSpec>> + 'a {
        move |id| {
            if *id == a.id {
                Some(a.spec.clone())
            } else {
                self.record(id.as_str()).map(|r| r.spec.clone())
            }
        }
    }

    /// Whether dependency `j` of task `i` of `a` (on another allocation)
    /// holds now, and if not, why.
    pub(super) fn verdict(&self, a: &Allocation, i: usize, j: usize) -> DepState {
        let d = &a.spec.tasks()[i].depends_on[j];
        let Some(target_alloc) = &d.allocation else {
            return DepState::Holds;
        };
        let target = self.record(target_alloc.as_str());
        let status = match &target {
            None => Target::Missing,
            Some(t) => t
                .position(d.task.as_str())
                .map_or(Target::NoSuchTask, |p| Target::Task(&t.tasks[p])),
        };
        let verdict = judge_dependency(d.condition, status);
        if verdict.holds() {
            return verdict;
        }
        // A dependency that does not hold may never hold: it may lead
        // back to its own task. Past the reach registrations keep (replicas
        // racing), no cycle is claimed.
        let me: Node = (a.id.clone(), a.spec.tasks()[i].name.clone());
        let from: Node = (target_alloc.clone(), d.task.clone());
        match walk([from], self.spec_of(a), Some(&me), MAX_REACH) {
            Walk::Cycle(path) => DepState::Cycle(show(&path).into()),
            Walk::Clear | Walk::TooFar => verdict,
        }
    }

    /// The verdicts of every dependency of `a` on another allocation.
    pub(super) fn verdicts(&self, a: &mut Allocation) {
        let verdicts: Vec<Vec<DepState>> = (0..a.tasks.len())
            .map(|i| {
                (0..a.spec.tasks()[i].depends_on.len())
                    .map(|j| self.verdict(a, i, j))
                    .collect()
            })
            .collect();
        a.set_verdicts(&|i, j| verdicts[i][j].clone());
    }

    /// The checks of a registration's dependencies the registry can make:
    /// no cycle among its own tasks (400), none through the allocations
    /// held (409), no more than `MAX_REACH` tasks reachable (400), and,
    /// where the target allocation is held, a task of that name in it and
    /// a `ready` dependency only on one that declares readiness (400).
    pub(super) fn check_dependencies(&self, a: &Allocation) -> Result<(), RegistryError> {
        let roots = || {
            a.spec
                .tasks()
                .iter()
                .map(|t| (a.id.clone(), t.name.clone()))
        };
        let own = |id: &AllocId| (*id == a.id).then(|| a.spec.clone());
        if let Walk::Cycle(path) = walk(roots(), own, None, usize::MAX) {
            return Err(RegistryError::DependencyCycle {
                path: show(&path),
                held: false,
            });
        }
        if !a.spec.reaches_out() {
            return Ok(());
        }
        match walk(roots(), self.spec_of(a), None, MAX_REACH) {
            Walk::Clear => {}
            Walk::Cycle(path) => {
                return Err(RegistryError::DependencyCycle {
                    path: show(&path),
                    held: true,
                });
            }
            Walk::TooFar => {
                return Err(RegistryError::Invalid(vec![FieldError::new(
                    "tasks",
                    format!(
                        "the dependencies reach more than {MAX_REACH} tasks through other \
                         allocations' dependencies; the server follows no chain that long"
                    ),
                )]));
            }
        }
        let mut errors = Vec::new();
        for (i, t) in a.spec.tasks().iter().enumerate() {
            for (j, d) in t.depends_on.iter().enumerate() {
                let Some(target) = d
                    .allocation
                    .as_ref()
                    .and_then(|id| self.record(id.as_str()))
                else {
                    continue;
                };
                let Some(p) = target.position(d.task.as_str()) else {
                    let names: Vec<&str> = target
                        .spec
                        .tasks()
                        .iter()
                        .map(|t| t.name.as_str())
                        .collect();
                    errors.push(FieldError::new(
                        format!("tasks[{i}].depends_on[{j}].task"),
                        format!(
                            "\"{}\" depends on {}/{}, but allocation {} has no task \"{}\" \
                             (its tasks: {})",
                            t.name,
                            target.id,
                            d.task,
                            target.id,
                            d.task,
                            names.join(", ")
                        ),
                    ));
                    continue;
                };
                let readiness = Some(target.spec.tasks()[p].readiness);
                if d.condition == crate::lifecycle::Condition::Ready && readiness == Some(false) {
                    errors.push(FieldError::new(
                        format!("tasks[{i}].depends_on[{j}]"),
                        format!(
                            "\"{}\" depends on {}/{} being ready, but that task declares no \
                             readiness, so it is never ready (declare `readiness` on it, or \
                             wait for `running`)",
                            t.name, target.id, d.task
                        ),
                    ));
                }
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(RegistryError::Invalid(errors))
        }
    }

    /// Judges an allocation's dependencies on others again and writes a
    /// new version if a verdict changed.
    pub(super) async fn resolve(&self, id: &str) {
        let Ok(handle) = self.handle(id) else { return };
        let Some(current) = handle.current() else {
            return;
        };
        // Most changes of a target change no verdict of a dependent: judged
        // first without the lock, and written only when one changed. The
        // published record is the one to compare with only while no write
        // holds the lock: one in progress may carry a verdict about to be
        // stale (the target changed again meanwhile), so it is judged again
        // once that write is done.
        let changed = handle.writing()
            || current.spec.tasks().iter().enumerate().any(|(i, t)| {
                t.depends_on.iter().enumerate().any(|(j, d)| {
                    d.allocation.is_some()
                        && current.tasks[i].deps().get(j) != Some(&self.verdict(&current, i, j))
                })
            });
        if !changed {
            return;
        }
        let written = self
            .write(
                id,
                |a, next_index| {
                    let verdict = |i, j| self.verdict(a, i, j);
                    Ok((a.resolve(&verdict, self.now(), next_index), ()))
                },
                |_| {},
            )
            .await;
        if let Err(e) = written
            && !matches!(
                e,
                RegistryError::AllocationNotFound(_) | RegistryError::Deleted(_)
            )
        {
            tracing::warn!(alloc = %id, error = %e, "a dependency's new verdict could not be written");
        }
    }

    /// Judges every allocation with dependencies on others (at start, or
    /// after the view was listed again: what changed meanwhile is known
    /// only as a whole).
    pub(super) fn resolve_all(&self) {
        let ids = self.inner.judges.all();
        if ids.is_empty() {
            return;
        }
        let registry = self.clone();
        self.inner.spawn(async move {
            for id in ids {
                registry.resolve(id.as_str()).await;
            }
        });
    }
}

/// A path of the graph as the API shows it: `alloc/task` steps.
fn show(path: &[Node]) -> Vec<String> {
    path.iter().map(|(a, t)| format!("{a}/{t}")).collect()
}
