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
//! silent hang. Every question about the graph is one search
//! (`lifecycle::walk`, `lifecycle::cycles`), linear in what it reaches.
//!
//! **Bounded work per change.** Judging a dependent looks up each target
//! allocation once and judges each dependency from its target's state; the
//! cycles through a dependent's dependencies depend only on the graph, not
//! on states, so they are searched for once per change of the graph (an
//! allocation with dependencies on others appearing or going) and kept.
//! A registration searches the graph once, under the registrations' lock,
//! and judges what changed meanwhile after letting it go. Limits bound
//! the graph itself: dependencies on one allocation's tasks from others
//! (`--max-dependents`), and those a token's allocations declare
//! (`max_dependencies`).

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex, PoisonError, RwLock},
};

use tokio::sync::watch;

use super::{Inner, Quota, Registry, RegistryError};
use crate::lifecycle::{
    AllocId, AllocSpec, Allocation, DepState, FieldError, Node, Positions, Target, Walk, cycles,
    judge_dependency, walk,
};

/// Tasks a registration's dependencies may reach, through the other
/// allocations' dependencies, at most: the server follows no chain longer
/// (a registration that would reach more is refused, so every search for
/// a cycle is bounded by it).
pub const MAX_REACH: usize = 1_000;

/// Dependencies on one allocation's tasks that the tasks of other
/// allocations may declare together, by default (`--max-dependents`):
/// what one change of a target makes the server judge at most.
pub const DEFAULT_MAX_DEPENDENTS: usize = 4_096;

/// The reverse index, the cycles found, and the judges in flight.
#[derive(Default)]
pub(super) struct Judges {
    index: RwLock<Index>,
    /// Allocation → the cycles through its dependencies on others, as of
    /// a generation of the index.
    cycles: Mutex<HashMap<AllocId, Known>>,
    /// Registrations this server checked (no cycle through them), from
    /// their check until the follower publishes them: the spec each was
    /// checked with.
    checked: Mutex<HashMap<AllocId, Arc<AllocSpec>>>,
    /// Cycle searches made (the tests count them).
    #[cfg(test)]
    searches: std::sync::atomic::AtomicU64,
    /// The index of a published change → its dependents' judging, while
    /// it runs: a writer answers once the judging its change started is
    /// done, so that whoever it answers sees the dependents' new verdicts
    /// too.
    judging: Mutex<HashMap<u64, watch::Receiver<bool>>>,
}

/// The dependency graph between allocations, as the follower publishes
/// it.
#[derive(Default)]
struct Index {
    /// Target allocation → the allocations with a task that depends on
    /// one of its tasks.
    dependents: HashMap<AllocId, Onto>,
    /// Every allocation with dependencies on others → how many it
    /// declares; in ID order, so that a token's are counted by prefix.
    declared: BTreeMap<AllocId, usize>,
    /// The generation of the graph, in two counts. `added`: allocations
    /// with dependencies on others that appeared without this server's
    /// check (another replica's registrations, what was loaded or listed
    /// again); only they can close a cycle, since a registration checked
    /// here closes none. `removed`: allocations that went; they can only
    /// break a cycle, or bring one into reach. A search that found no
    /// cycle holds until `added` moves; one that found some (or was cut
    /// short) also until `removed` does.
    added: u64,
    removed: u64,
}

/// The dependents of one target.
#[derive(Default)]
struct Onto {
    /// Each dependent → its dependencies on the target's tasks.
    by: HashMap<AllocId, usize>,
    /// Their sum.
    edges: usize,
}

/// The cycles through one allocation's dependencies, found in one
/// generation of the index for one spec.
struct Known {
    generation: (u64, u64),
    spec: Arc<AllocSpec>,
    paths: Arc<Paths>,
    /// Whether it holds only until `removed` moves too.
    fragile: bool,
}

/// (task position, dependency position) → the cycle it is on, as shown.
type Paths = HashMap<(usize, usize), Arc<[String]>>;

impl Judges {
    /// The other allocations `spec` depends on, each with how many of its
    /// dependencies name it.
    fn targets(spec: &AllocSpec) -> HashMap<&AllocId, usize> {
        let mut targets = HashMap::new();
        for d in spec.tasks().iter().flat_map(|t| t.depends_on.iter()) {
            if let Some(t) = d.allocation.as_ref() {
                *targets.entry(t).or_insert(0) += 1;
            }
        }
        targets
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Index> {
        self.index.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps the reverse index for a record that appeared (`present`) or
    /// went. Every published version of an allocation comes here; only
    /// one that changes the graph takes the index's write lock.
    pub(super) fn index(&self, a: &Allocation, present: bool) {
        if !a.spec.reaches_out() || self.read().declared.contains_key(&a.id) == present {
            return;
        }
        let targets = Self::targets(&a.spec);
        let checked = present && {
            let mut checked = self.checked.lock().unwrap_or_else(PoisonError::into_inner);
            let ours = checked.get(&a.id).is_some_and(|spec| *spec == a.spec);
            if ours {
                checked.remove(&a.id);
            }
            ours
        };
        let mut guard = self.index.write().unwrap_or_else(PoisonError::into_inner);
        let index = &mut *guard;
        if present {
            if index.declared.contains_key(&a.id) {
                return;
            }
            if !checked {
                index.added += 1;
            }
            index.declared.insert(a.id.clone(), targets.values().sum());
            for (t, n) in targets {
                let onto = index.dependents.entry(t.clone()).or_default();
                onto.by.insert(a.id.clone(), n);
                onto.edges += n;
            }
        } else {
            if index.declared.remove(&a.id).is_none() {
                return;
            }
            index.removed += 1;
            for t in targets.into_keys() {
                if let Some(onto) = index.dependents.get_mut(t) {
                    onto.edges -= onto.by.remove(&a.id).unwrap_or(0);
                    if onto.by.is_empty() {
                        index.dependents.remove(t);
                    }
                }
            }
        }
        drop(guard);
        if !present {
            self.cycles
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&a.id);
        }
    }

    /// The allocations that depend on `target`.
    fn of(&self, target: &str) -> Vec<AllocId> {
        self.read()
            .dependents
            .get(target)
            .map(|onto| onto.by.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Every allocation that depends on another.
    fn all(&self) -> Vec<AllocId> {
        self.read().declared.keys().cloned().collect()
    }

    /// Dependencies on `target`'s tasks from other allocations.
    fn edges_onto(&self, target: &str) -> usize {
        self.read().dependents.get(target).map_or(0, |o| o.edges)
    }

    /// Dependencies on others that the allocations whose IDs start with
    /// one of `prefixes` (each ID once) declare together, counted up to
    /// `stop` at least (the count goes no further once it is there).
    fn declared_within(&self, prefixes: &[&str], stop: usize) -> usize {
        let index = self.read();
        let mut n = 0;
        for p in prefixes {
            for (id, d) in index
                .declared
                .range::<str, _>((std::ops::Bound::Included(*p), std::ops::Bound::Unbounded))
            {
                if !id.as_str().starts_with(p) || n >= stop {
                    break;
                }
                n += d;
            }
        }
        n
    }

    /// Cycle searches made so far.
    #[cfg(test)]
    pub(super) fn searches(&self) -> u64 {
        self.searches.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// A registration this server checked: no cycle runs through it (so
    /// its publication leaves every search made before it standing).
    pub(super) fn checked(&self, a: &Allocation) {
        if a.spec.reaches_out() {
            self.checked
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(a.id.clone(), a.spec.clone());
        }
    }

    /// A checked registration that was not published.
    pub(super) fn unchecked(&self, a: &Allocation) {
        let mut checked = self.checked.lock().unwrap_or_else(PoisonError::into_inner);
        if checked
            .get(&a.id)
            .is_some_and(|spec| Arc::ptr_eq(spec, &a.spec))
        {
            checked.remove(&a.id);
        }
    }

    /// The cycles known for `a`'s spec that still hold, or the generation
    /// to search in.
    fn known(&self, a: &Allocation) -> Result<Arc<Paths>, (u64, u64)> {
        let generation = {
            let index = self.read();
            (index.added, index.removed)
        };
        let known = self.cycles.lock().unwrap_or_else(PoisonError::into_inner);
        match known.get(&a.id) {
            Some(k)
                if Arc::ptr_eq(&k.spec, &a.spec)
                    && k.generation.0 == generation.0
                    && (!k.fragile || k.generation.1 == generation.1) =>
            {
                Ok(k.paths.clone())
            }
            _ => Err(generation),
        }
    }

    fn keep(&self, a: &Allocation, generation: (u64, u64), paths: Arc<Paths>, fragile: bool) {
        // A record that went meanwhile is not kept (its entry would stay).
        if !self.read().declared.contains_key(&a.id) {
            return;
        }
        self.cycles
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                a.id.clone(),
                Known {
                    generation,
                    spec: a.spec.clone(),
                    paths,
                    fragile,
                },
            );
    }
}

/// The records of the allocations a spec depends on, each looked up once
/// per judging, with their tasks by name.
struct Held<'r> {
    registry: &'r Registry,
    records: HashMap<AllocId, Option<(Arc<Allocation>, Positions)>>,
}

impl<'r> Held<'r> {
    fn new(registry: &'r Registry) -> Self {
        Self {
            registry,
            records: HashMap::new(),
        }
    }

    /// Allocation `id` as held, and its tasks by name.
    fn get(&mut self, id: &AllocId) -> Option<&(Arc<Allocation>, Positions)> {
        let registry = self.registry;
        self.records
            .entry(id.clone())
            .or_insert_with(|| {
                registry.record(id.as_str()).map(|a| {
                    let names = a
                        .spec
                        .tasks()
                        .iter()
                        .enumerate()
                        .map(|(i, t)| (t.name.clone(), i))
                        .collect();
                    (a, names)
                })
            })
            .as_ref()
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

    /// The cycles through `a`'s dependencies on others: kept from the
    /// last search while no change of the graph since could have changed
    /// them, else searched for once (past the reach registrations keep,
    /// replicas racing, no cycle is claimed). On one server that is one
    /// search per dependent: only records this server did not check can
    /// close a cycle.
    fn cycles_of(&self, a: &Allocation) -> Arc<Paths> {
        let generation = match self.inner.judges.known(a) {
            Ok(paths) => return paths,
            Err(generation) => generation,
        };
        #[cfg(test)]
        self.inner
            .judges
            .searches
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let found = cycles(&a.id, self.spec_of(a), MAX_REACH + a.tasks.len());
        let fragile = found.too_far || !found.paths.is_empty();
        let paths: Arc<Paths> = Arc::new(
            found
                .paths
                .into_iter()
                .map(|(at, path)| (at, show(&path).into()))
                .collect(),
        );
        self.inner
            .judges
            .keep(a, generation, paths.clone(), fragile);
        paths
    }

    /// The verdicts of `a`'s dependencies on other allocations, by task
    /// and dependency (`Holds` in the place of one inside `a`): each
    /// target looked up once, and the cycles asked for only if a
    /// dependency does not hold and `a` may be on one (`search`; a
    /// registration's own search found none).
    fn judge_all(&self, a: &Allocation, search: bool) -> Vec<Vec<DepState>> {
        let mut held = Held::new(self);
        let mut paths: Option<Arc<Paths>> = None;
        let mut all = Vec::with_capacity(a.tasks.len());
        for (i, t) in a.spec.tasks().iter().enumerate() {
            let mut row = Vec::with_capacity(t.depends_on.len());
            for (j, d) in t.depends_on.iter().enumerate() {
                let Some(target) = &d.allocation else {
                    row.push(DepState::Holds);
                    continue;
                };
                let status = match held.get(target) {
                    None => Target::Missing,
                    Some((t, names)) => names
                        .get(&d.task)
                        .map_or(Target::NoSuchTask, |&p| Target::Task(&t.tasks[p])),
                };
                let verdict = judge_dependency(d.condition, status);
                if verdict.holds() || !search {
                    row.push(verdict);
                    continue;
                }
                // A dependency that does not hold may never hold: it may
                // lead back to its own task.
                let paths = paths.get_or_insert_with(|| self.cycles_of(a));
                row.push(match paths.get(&(i, j)) {
                    Some(path) => DepState::Cycle(path.clone()),
                    None => verdict,
                });
            }
            all.push(row);
        }
        all
    }

    /// Takes the verdicts of a registration's dependencies on others (its
    /// own search found no cycle through them).
    pub(super) fn verdicts(&self, a: &mut Allocation) {
        let verdicts = self.judge_all(a, false);
        a.set_verdicts(&|i, j| verdicts[i][j].clone());
    }

    /// The checks of a registration's dependencies the registry can make:
    /// no cycle among its own tasks (400), none through the allocations
    /// held (409), no more than `MAX_REACH` tasks reachable (400), where
    /// the target allocation is held, a task of that name in it and a
    /// `ready` dependency only on one that declares readiness (400); and
    /// the limits: dependencies on one allocation from others
    /// (`--max-dependents`) and those of the caller's allocations
    /// (`quota`), 429. One search of the graph in all.
    pub(super) fn check_dependencies(
        &self,
        a: &Allocation,
        quota: Option<Quota<'_>>,
    ) -> Result<(), RegistryError> {
        let roots = || {
            a.spec
                .tasks()
                .iter()
                .map(|t| (a.id.clone(), t.name.clone()))
        };
        let own = |id: &AllocId| (*id == a.id).then(|| a.spec.clone());
        if let Walk::Cycle(path) = walk(roots(), own, usize::MAX) {
            return Err(RegistryError::DependencyCycle {
                path: show(&path),
                held: false,
            });
        }
        if !a.spec.reaches_out() {
            return Ok(());
        }
        self.within_limits(a, quota)?;
        match walk(roots(), self.spec_of(a), MAX_REACH) {
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
        let mut held = Held::new(self);
        let mut errors = Vec::new();
        for (i, t) in a.spec.tasks().iter().enumerate() {
            for (j, d) in t.depends_on.iter().enumerate() {
                let Some((target, names)) = d.allocation.as_ref().and_then(|id| held.get(id))
                else {
                    continue;
                };
                let Some(&p) = names.get(&d.task) else {
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

    /// The limits on the graph a registration may make (429
    /// `quota_exceeded`): the dependencies on each of its targets' tasks
    /// from other allocations, with its own, at most `--max-dependents`;
    /// those declared by the allocations within the caller's prefixes,
    /// with its own, at most the caller's `max_dependencies`. Checked
    /// under the registrations' lock, so on one server no two
    /// registrations overshoot together.
    fn within_limits(&self, a: &Allocation, quota: Option<Quota<'_>>) -> Result<(), RegistryError> {
        let judges = &self.inner.judges;
        let max = self.inner.config.max_dependents;
        let targets = Judges::targets(&a.spec);
        let mut by_id: Vec<(&&AllocId, &usize)> = targets.iter().collect();
        by_id.sort_unstable();
        for (target, &n) in by_id {
            let held = judges.edges_onto(target.as_str());
            if held.saturating_add(n) > max {
                return Err(RegistryError::QuotaExceeded(format!(
                    "allocation {:?} already has {held} dependencies on its tasks from other \
                     allocations, and this one declares {n} more: past the server's limit of \
                     {max} (--max-dependents), which bounds what one change of it makes the \
                     server judge",
                    target.as_str()
                )));
            }
        }
        let Some((q, max)) = quota.and_then(|q| Some((q, q.max_dependencies?))) else {
            return Ok(());
        };
        let own: usize = targets.values().sum();
        let prefixes = q.distinct_prefixes();
        let held = if prefixes.is_empty() {
            judges.declared_within(&[""], max)
        } else {
            judges.declared_within(&prefixes, max)
        };
        if held.saturating_add(own) > max {
            return Err(RegistryError::QuotaExceeded(format!(
                "token {:?} may declare {max} dependencies on other allocations{}, and its \
                 allocations declare {}{held}; this one declares {own} more",
                q.name,
                if q.prefixes.is_empty() {
                    String::new()
                } else {
                    format!(" within its prefixes {:?}", q.prefixes)
                },
                if held >= max { "at least " } else { "" },
            )));
        }
        Ok(())
    }

    /// Judges an allocation's dependencies on others again and writes a
    /// new version if a verdict changed.
    pub(super) async fn resolve(&self, id: &str) {
        let Ok(handle) = self.handle(id) else { return };
        let Some(current) = handle.current() else {
            return;
        };
        if !current.spec.reaches_out() {
            return;
        }
        // Most changes of a target change no verdict of a dependent: judged
        // first without the lock, and written only when one changed. The
        // published record is the one to compare with only while no write
        // holds the lock: one in progress may carry a verdict about to be
        // stale (the target changed again meanwhile), so it is judged again
        // once that write is done.
        let changed = handle.writing() || {
            let verdicts = self.judge_all(&current, true);
            current.spec.tasks().iter().enumerate().any(|(i, t)| {
                t.depends_on.iter().enumerate().any(|(j, d)| {
                    d.allocation.is_some()
                        && current.tasks[i].deps().get(j) != Some(&verdicts[i][j])
                })
            })
        };
        if !changed {
            return;
        }
        let written = self
            .write(
                id,
                |a, next_index| {
                    let verdicts = self.judge_all(a, true);
                    let verdict = |i: usize, j: usize| verdicts[i][j].clone();
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
