//! Dependencies between allocations: the registry judges whether a task's
//! dependency on another allocation's task holds (it holds every record),
//! keeps a reverse index (target allocation → its dependents), and after
//! every change of a target writes a new version of each dependent whose
//! verdicts changed, through the ordinary write path. With replicas every
//! replica sees the change on its watch and may try that write; the
//! compare-and-swap keeps one.
//!
//! A dependency that leads back to its own task (a cycle through other
//! allocations, which registration refuses but replicas racing two
//! registrations can make) is judged `cycle`, with the path: shown, never a
//! silent hang.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, PoisonError, RwLock},
};

use super::{Inner, Registry, RegistryError};
use crate::lifecycle::{
    AllocId, AllocSpec, Allocation, DepState, Target, TaskName, judge_dependency,
};

/// Tasks a registration's dependencies may reach, through the other
/// allocations' dependencies, at most: the server follows no chain longer
/// (a registration that would reach more is refused, so every search for
/// a cycle is bounded by it).
pub const MAX_REACH: usize = 1_000;

/// Target allocation → the allocations with a task that depends on one of
/// its tasks (each listed once).
#[derive(Default)]
pub(crate) struct Dependents(RwLock<HashMap<AllocId, HashSet<AllocId>>>);

impl Dependents {
    /// The other allocations `spec` depends on.
    fn targets(spec: &AllocSpec) -> HashSet<&AllocId> {
        spec.tasks()
            .iter()
            .flat_map(|t| t.depends_on.iter())
            .filter_map(|d| d.allocation.as_ref())
            .collect()
    }

    /// `dependent` (registered with `spec`) depends on its targets.
    pub(crate) fn add(&self, dependent: &AllocId, spec: &AllocSpec) {
        let targets = Self::targets(spec);
        if targets.is_empty() {
            return;
        }
        let mut map = self.0.write().unwrap_or_else(PoisonError::into_inner);
        for t in targets {
            map.entry(t.clone()).or_default().insert(dependent.clone());
        }
    }

    /// `dependent` (registered with `spec`) is gone.
    pub(crate) fn remove(&self, dependent: &AllocId, spec: &AllocSpec) {
        let targets = Self::targets(spec);
        if targets.is_empty() {
            return;
        }
        let mut map = self.0.write().unwrap_or_else(PoisonError::into_inner);
        for t in targets {
            if let Some(set) = map.get_mut(t) {
                set.remove(dependent);
                if set.is_empty() {
                    map.remove(t);
                }
            }
        }
    }

    /// The allocations that depend on `target`.
    pub(crate) fn of(&self, target: &str) -> Vec<AllocId> {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(target)
            .map(|set| set.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// A task of an allocation, a node of the dependency graph.
type Node = (AllocId, TaskName);

/// What a registration's dependencies reach.
enum Reach {
    Clear,
    Cycle(Vec<String>),
    TooFar,
}

impl Registry {
    /// The record of `id` this registry holds, if any.
    fn record(&self, id: &str) -> Option<Arc<Allocation>> {
        self.handle(id).ok()?.current()
    }

    /// Whether dependency `j` of task `i` of `a` (on another allocation)
    /// holds now, and if not, why.
    pub(super) fn verdict(&self, a: &Allocation, i: usize, j: usize) -> DepState {
        let d = &a.spec.tasks()[i].depends_on[j];
        let Some(target_alloc) = &d.allocation else {
            return DepState::Holds;
        };
        let target = self.record(target_alloc.as_str());
        let status = target
            .as_ref()
            .and_then(|t| t.position(d.task.as_str()).map(|p| &t.tasks[p]));
        let verdict = judge_dependency(d.condition, status.map_or(Target::Missing, Target::Task));
        if verdict.holds() {
            return verdict;
        }
        // A dependency that does not hold may never hold: it may lead
        // back to its own task.
        let me = (a.id.clone(), a.spec.tasks()[i].name.clone());
        match self.path_back(a, (target_alloc.clone(), d.task.clone()), &me) {
            Some(path) => DepState::Cycle(path.into()),
            None => verdict,
        }
    }

    /// The path from `from` along dependencies back to `to` (`to` first,
    /// then `from` and on, each as `alloc/task`), if there is one. `a` is
    /// the record of `to`'s allocation as the caller holds it (a
    /// registration not yet in the map).
    fn path_back(&self, a: &Allocation, from: Node, to: &Node) -> Option<Vec<String>> {
        let spec_of = |id: &AllocId| -> Option<Arc<AllocSpec>> {
            if *id == a.id {
                Some(a.spec.clone())
            } else {
                self.record(id.as_str()).map(|r| r.spec.clone())
            }
        };
        let show = |(alloc, task): &Node| format!("{alloc}/{task}");
        // Depth-first, with each node's parent kept to rebuild the path.
        let mut parent: HashMap<Node, Option<Node>> = HashMap::new();
        parent.insert(from.clone(), None);
        let mut stack = vec![from];
        // A task that depends on nothing leads nowhere: the common case
        // (a target with no dependencies of its own) costs one look.
        while let Some(node) = stack.pop() {
            if node == *to {
                let mut path = vec![show(&node)];
                let mut at = parent.get(&node).cloned().flatten();
                while let Some(n) = at {
                    path.push(show(&n));
                    at = parent.get(&n).cloned().flatten();
                }
                path.push(show(to));
                path.reverse();
                path.dedup();
                return Some(path);
            }
            if parent.len() > MAX_REACH {
                // Registrations keep what is reachable within the bound;
                // past it (replicas racing) no cycle is claimed.
                return None;
            }
            let Some(spec) = spec_of(&node.0) else {
                continue;
            };
            let Some(t) = spec.position(node.1.as_str()) else {
                continue;
            };
            for d in &spec.tasks()[t].depends_on {
                let next = (
                    d.allocation.clone().unwrap_or_else(|| node.0.clone()),
                    d.task.clone(),
                );
                if !parent.contains_key(&next) {
                    parent.insert(next.clone(), Some(node.clone()));
                    stack.push(next);
                }
            }
        }
        None
    }

    /// What the dependencies of a registration of `a` reach through the
    /// allocations held: a cycle (its path), too many tasks, or neither.
    /// One depth-first walk over every task reachable from `a`'s, each
    /// visited once.
    fn reachable(&self, a: &Allocation) -> Reach {
        let spec_of = |id: &AllocId| -> Option<Arc<AllocSpec>> {
            if *id == a.id {
                Some(a.spec.clone())
            } else {
                self.record(id.as_str()).map(|r| r.spec.clone())
            }
        };
        let show = |(alloc, task): &Node| format!("{alloc}/{task}");
        // Grey: on the current path; black: done.
        let mut grey: Vec<Node> = Vec::new();
        let mut black: HashSet<Node> = HashSet::new();
        for t in a.spec.tasks() {
            let root = (a.id.clone(), t.name.clone());
            if black.contains(&root) {
                continue;
            }
            // (node, its dependencies, the next one to follow)
            let mut stack: Vec<(Node, Vec<Node>, usize)> = Vec::new();
            let edges = |n: &Node| -> Vec<Node> {
                let Some(spec) = spec_of(&n.0) else {
                    return Vec::new();
                };
                let Some(i) = spec.position(n.1.as_str()) else {
                    return Vec::new();
                };
                spec.tasks()[i]
                    .depends_on
                    .iter()
                    .map(|d| {
                        (
                            d.allocation.clone().unwrap_or_else(|| n.0.clone()),
                            d.task.clone(),
                        )
                    })
                    .collect()
            };
            stack.push((root.clone(), edges(&root), 0));
            grey.push(root);
            while let Some((_, next, at)) = stack.last_mut() {
                let Some(n) = next.get(*at).cloned() else {
                    let (done, _, _) = stack.pop().expect("not empty");
                    grey.pop();
                    black.insert(done);
                    continue;
                };
                *at += 1;
                if let Some(start) = grey.iter().position(|g| *g == n) {
                    let mut path: Vec<String> = grey[start..].iter().map(show).collect();
                    path.push(show(&n));
                    return Reach::Cycle(path);
                }
                if black.contains(&n) {
                    continue;
                }
                if black.len() + grey.len() >= MAX_REACH {
                    return Reach::TooFar;
                }
                let e = edges(&n);
                grey.push(n.clone());
                stack.push((n, e, 0));
            }
        }
        Reach::Clear
    }

    /// The checks of a registration's dependencies the registry can make:
    /// no cycle among its own tasks (400), none through the allocations
    /// held (409), no more than `MAX_REACH` tasks reachable (400), and a
    /// `ready` dependency only on a task that declares readiness, where the
    /// target is held (400).
    pub(super) fn check_dependencies(&self, a: &Allocation) -> Result<(), RegistryError> {
        if let Some(cycle) = a.spec.own_cycle() {
            let path = cycle.iter().map(|t| format!("{}/{t}", a.id)).collect();
            return Err(RegistryError::DependencyCycle { path, held: false });
        }
        if !a.spec.reaches_out() {
            return Ok(());
        }
        match self.reachable(a) {
            Reach::Clear => {}
            Reach::Cycle(path) => return Err(RegistryError::DependencyCycle { path, held: true }),
            Reach::TooFar => {
                return Err(RegistryError::Invalid(vec![
                    crate::lifecycle::FieldError::new(
                        "tasks",
                        format!(
                            "the dependencies reach more than {MAX_REACH} tasks through other \
                         allocations' dependencies; the server follows no chain that long"
                        ),
                    ),
                ]));
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
                let readiness = target
                    .position(d.task.as_str())
                    .map(|p| target.spec.tasks()[p].readiness);
                if d.condition == crate::lifecycle::Condition::Ready && readiness == Some(false) {
                    errors.push(crate::lifecycle::FieldError::new(
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

    /// After a change of `target` (registered, changed or deleted): every
    /// allocation that depends on it is judged again, all at once (their
    /// writes share commits), in a task of its own that outlives the
    /// request. The handle resolves once they all are: a writer on a
    /// store this process alone writes awaits it, so that whoever it
    /// answers sees the dependents' new verdicts too. `None`: nobody
    /// depends on `target`.
    pub(super) fn dependents_of(&self, target: &str) -> Option<tokio::task::JoinHandle<()>> {
        let dependents = self.inner.dependents.of(target);
        if dependents.is_empty() {
            return None;
        }
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let registry = self.clone();
        Some(runtime.spawn(async move {
            let mut all = tokio::task::JoinSet::new();
            for d in dependents {
                let r = registry.clone();
                all.spawn(async move { r.resolve(d.as_str()).await });
            }
            while all.join_next().await.is_some() {}
        }))
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
            .update(
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

    /// Judges every allocation with dependencies on others (at start: a
    /// crash between a target's change and its dependents' may have left
    /// a verdict behind).
    pub(super) fn resolve_all(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let ids: Vec<AllocId> = {
            let map = self
                .inner
                .dependents
                .0
                .read()
                .unwrap_or_else(PoisonError::into_inner);
            map.values()
                .flatten()
                .cloned()
                .collect::<HashSet<_>>()
                .into_iter()
                .collect()
        };
        if ids.is_empty() {
            return;
        }
        let registry = self.clone();
        runtime.spawn(async move {
            for id in ids {
                registry.resolve(id.as_str()).await;
            }
        });
    }
}

impl Inner {
    /// Keeps the reverse index for a record that appeared or went.
    pub(super) fn index_dependencies(&self, a: &Allocation, present: bool) {
        if present {
            self.dependents.add(&a.id, &a.spec);
        } else {
            self.dependents.remove(&a.id, &a.spec);
        }
    }
}
