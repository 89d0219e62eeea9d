//! Dependencies: start conditions on other tasks, in this allocation or in
//! another one (docs/lifecycle.md, Dependencies).
//!
//! A task may start only while its stage's gate is open **and** every
//! dependency holds. Whether one holds is a fact about its target's
//! state: for a target in the same allocation it is recomputed with every
//! change of the record; for a target in another allocation the registry
//! judges it (it holds the other record) and hands the verdicts in
//! (`Allocation::resolve`). Either way it is kept with the record, so a
//! view, a replica and a restarted server all show the same `blocked_by`.
//!
//! ```text
//!   condition   holds when the target is       else blocked, why
//!   running     running                        pending | dead | failed
//!   ready       running and ready              not_ready | pending | dead | failed
//!   succeeded   dead, not failed               pending | running | failed
//!   dead        dead (failed or not)           pending | running
//!   (any)       -                              not_registered (no such allocation or task)
//!                                              cycle (the dependency leads back to the task)
//! ```

use std::{collections::HashMap, sync::Arc};

use super::{AllocId, RunState, Stage, TaskName, TaskStatus};

named_enum! {
    /// What a dependency waits for its target to be.
    pub enum Condition ("dependency condition") {
        Running = "running",
        Ready = "ready",
        Succeeded = "succeeded",
        Dead = "dead",
    }
}

named_enum! {
    /// Why a dependency does not hold.
    pub enum Why ("blocked reason") {
        NotRegistered = "not_registered",
        Pending = "pending",
        Running = "running",
        Dead = "dead",
        Failed = "failed",
        NotReady = "not_ready",
        Cycle = "cycle",
        NoSuchTask = "no_such_task",
    }
}

/// Dependencies a task may declare.
pub const MAX_DEPENDENCIES: usize = 16;

/// One dependency of a task, as registered. `allocation` is `None` for a
/// task of the same allocation.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Dependency {
    pub task: TaskName,
    pub allocation: Option<AllocId>,
    pub condition: Condition,
}

/// Whether one dependency holds, as last judged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DepState {
    Holds,
    Blocked(Why),
    /// It leads back to its own task: `alloc/task` names along the way,
    /// from the dependent to the task that closes the cycle.
    Cycle(Arc<[String]>),
}

impl DepState {
    pub fn holds(&self) -> bool {
        matches!(self, DepState::Holds)
    }

    /// Why it does not hold (`None`: it holds).
    pub fn why(&self) -> Option<Why> {
        match self {
            DepState::Holds => None,
            DepState::Blocked(why) => Some(*why),
            DepState::Cycle(_) => Some(Why::Cycle),
        }
    }
}

/// What a dependency finds of its target.
#[derive(Clone, Copy, Debug)]
pub enum Target<'a> {
    /// No such allocation.
    Missing,
    /// The allocation is held, and has no task of that name.
    NoSuchTask,
    /// The target task's status.
    Task(&'a TaskStatus),
}

/// Whether `condition` holds for `target`, and if not, why.
pub fn judge(condition: Condition, target: Target<'_>) -> DepState {
    let t = match target {
        Target::Missing => return DepState::Blocked(Why::NotRegistered),
        Target::NoSuchTask => return DepState::Blocked(Why::NoSuchTask),
        Target::Task(t) => t,
    };
    // Told to restart and not heard from since: it is going back to
    // `pending` (an all-tasks restart makes its tasks pending), so what it
    // last said no longer holds anything open.
    if t.stale {
        return DepState::Blocked(Why::Pending);
    }
    let dead = || {
        if t.failed { Why::Failed } else { Why::Dead }
    };
    let why = match (condition, t.state) {
        (Condition::Running, RunState::Running) => return DepState::Holds,
        (Condition::Ready, RunState::Running) if t.ready => return DepState::Holds,
        (Condition::Ready, RunState::Running) => Why::NotReady,
        (Condition::Running | Condition::Ready, RunState::Pending) => Why::Pending,
        (Condition::Running | Condition::Ready, RunState::Dead) => dead(),
        (Condition::Succeeded, RunState::Dead) if !t.failed => return DepState::Holds,
        (Condition::Succeeded, RunState::Dead) => Why::Failed,
        (Condition::Dead, RunState::Dead) => return DepState::Holds,
        (Condition::Succeeded | Condition::Dead, RunState::Pending) => Why::Pending,
        (Condition::Succeeded | Condition::Dead, RunState::Running) => Why::Running,
    };
    DepState::Blocked(why)
}

/// A stage's place in the order dependencies inside an allocation must
/// follow: prestart (ephemeral and sidecar) < main < poststart < poststop.
pub fn rank(stage: Stage) -> u8 {
    match stage {
        Stage::PrestartEphemeral | Stage::PrestartSidecar => 0,
        Stage::Main => 1,
        Stage::PoststartEphemeral | Stage::PoststartSidecar => 2,
        Stage::Poststop => 3,
    }
}

/// Why a dependency inside one allocation (from a task of stage `from` on
/// one of stage `to`, which declares readiness or not) can never hold while
/// the dependent may start; `None` if it can.
pub fn never_holds(from: Stage, to: Stage, to_readiness: bool, c: Condition) -> Option<String> {
    if rank(to) > rank(from) {
        return Some(format!(
            "a {from} task cannot wait on a later stage ({to}): that gate opens only after \
             this one"
        ));
    }
    let live = matches!(c, Condition::Running | Condition::Ready);
    if live && to == Stage::PrestartEphemeral && rank(from) > 0 {
        return Some(format!(
            "a prestart task that is not a sidecar has finished before {from} opens: it is \
             never {c} then (use `succeeded`)"
        ));
    }
    if live && from == Stage::Poststop && to != Stage::Poststop {
        return Some(format!(
            "every {to} task is dead before poststop opens: it is never {c} then (use `dead` \
             or `succeeded`)"
        ));
    }
    if c == Condition::Ready && !to_readiness {
        return Some(
            "the task declares no readiness, so it is never ready (declare `readiness`, or \
             wait for `running`)"
                .to_owned(),
        );
    }
    None
}

/// A task of an allocation: a node of the dependency graph.
pub type Node = (AllocId, TaskName);

/// What a walk of the dependency graph found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Walk {
    /// No cycle within reach.
    Clear,
    /// A cycle, as the tasks along it (the first repeated at the end).
    Cycle(Vec<Node>),
    /// More than the walk's limit of tasks is reachable.
    TooFar,
}

/// Which dependencies of one allocation's tasks lie on a cycle
/// (`cycles`): by (task position, dependency position), the path from
/// the task through the dependency back to it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cycles {
    pub paths: HashMap<(usize, usize), Vec<Node>>,
    /// More than the walk's limit of tasks was reachable: no cycle is
    /// claimed.
    pub too_far: bool,
}

/// A spec's tasks by name: their positions.
pub type Positions = HashMap<TaskName, usize>;

/// The dependency graph as far as one walk has seen it: each task a
/// number, each allocation's spec asked for once (with its tasks by
/// name), each task's dependencies in `depends_on` order.
struct Graph<F> {
    spec_of: F,
    /// Allocation → its spec (`None`: not known, its tasks lead nowhere)
    /// and its tasks' positions by name.
    specs: HashMap<AllocId, Option<(Arc<super::AllocSpec>, Positions)>>,
    nodes: Vec<Node>,
    ids: HashMap<Node, usize>,
}

impl<F: Fn(&AllocId) -> Option<Arc<super::AllocSpec>>> Graph<F> {
    fn new(spec_of: F) -> Self {
        Self {
            spec_of,
            specs: HashMap::new(),
            nodes: Vec::new(),
            ids: HashMap::new(),
        }
    }

    fn id(&mut self, n: Node) -> usize {
        if let Some(&i) = self.ids.get(&n) {
            return i;
        }
        self.nodes.push(n.clone());
        self.ids.insert(n, self.nodes.len() - 1);
        self.nodes.len() - 1
    }

    /// The dependencies of task `v`, as task numbers (none for a task of
    /// an allocation not known, or one its allocation does not have).
    fn edges(&mut self, v: usize) -> Vec<usize> {
        let (alloc, task) = self.nodes[v].clone();
        let spec_of = &self.spec_of;
        let known = self.specs.entry(alloc.clone()).or_insert_with(|| {
            spec_of(&alloc).map(|spec| {
                let names = spec
                    .tasks()
                    .iter()
                    .enumerate()
                    .map(|(i, t)| (t.name.clone(), i))
                    .collect();
                (spec, names)
            })
        });
        let Some((spec, names)) = known else {
            return Vec::new();
        };
        let Some(&i) = names.get(&task) else {
            return Vec::new();
        };
        let targets: Vec<Node> = spec.tasks()[i]
            .depends_on
            .iter()
            .map(|d| {
                (
                    d.allocation.clone().unwrap_or_else(|| alloc.clone()),
                    d.task.clone(),
                )
            })
            .collect();
        targets.into_iter().map(|n| self.id(n)).collect()
    }
}

/// How a depth-first search of the graph ended.
enum Found {
    /// Every task within reach seen.
    All,
    /// The first cycle met (when asked to stop there), as task numbers.
    Cycle(Vec<usize>),
    TooFar,
}

const UNSEEN: usize = usize::MAX;

/// The one depth-first search of the dependency graph: Tarjan's strongly
/// connected components, made iterative. Per task (by number): its visit
/// order, the lowest visit order it reaches on the stack, its place on
/// the current path (`UNSEEN`: not on it), whether it is on Tarjan's
/// stack, its component and its dependencies.
#[derive(Default)]
struct Search {
    order: Vec<usize>,
    low: Vec<usize>,
    depth: Vec<usize>,
    stacked: Vec<bool>,
    component: Vec<usize>,
    edges: Vec<Vec<usize>>,
    visited: usize,
    components: usize,
    tarjan: Vec<usize>,
    /// The current path: (task, the next of its dependencies to follow).
    path: Vec<(usize, usize)>,
}

impl Search {
    /// Room for every task the graph has numbered.
    fn fit(&mut self, n: usize) {
        if self.order.len() < n {
            self.order.resize(n, UNSEEN);
            self.low.resize(n, UNSEEN);
            self.depth.resize(n, UNSEEN);
            self.stacked.resize(n, false);
            self.component.resize(n, UNSEEN);
            self.edges.resize(n, Vec::new());
        }
    }

    fn enter<F: Fn(&AllocId) -> Option<Arc<super::AllocSpec>>>(
        &mut self,
        v: usize,
        graph: &mut Graph<F>,
    ) {
        let edges = graph.edges(v);
        self.fit(graph.nodes.len());
        self.order[v] = self.visited;
        self.low[v] = self.visited;
        self.visited += 1;
        self.depth[v] = self.path.len();
        self.stacked[v] = true;
        self.tarjan.push(v);
        self.edges[v] = edges;
        self.path.push((v, 0));
    }

    /// From `roots` in order, each task visited once and each dependency
    /// followed once: linear in what is within reach. It stops at the
    /// first cycle if `first_cycle`, or before visiting a task that is
    /// not a root once `max` are seen.
    fn run<F: Fn(&AllocId) -> Option<Arc<super::AllocSpec>>>(
        &mut self,
        graph: &mut Graph<F>,
        roots: &[usize],
        max: usize,
        first_cycle: bool,
    ) -> Found {
        self.fit(graph.nodes.len());
        for &root in roots {
            if self.order[root] != UNSEEN {
                continue;
            }
            self.enter(root, graph);
            while let Some(&(v, at)) = self.path.last() {
                if let Some(&w) = self.edges[v].get(at) {
                    self.path.last_mut().expect("not empty").1 += 1;
                    if self.order[w] == UNSEEN {
                        if self.visited >= max {
                            return Found::TooFar;
                        }
                        self.enter(w, graph);
                    } else if self.stacked[w] {
                        if first_cycle && self.depth[w] != UNSEEN {
                            let mut cycle: Vec<usize> =
                                self.path[self.depth[w]..].iter().map(|&(n, _)| n).collect();
                            cycle.push(w);
                            return Found::Cycle(cycle);
                        }
                        self.low[v] = self.low[v].min(self.order[w]);
                    }
                    continue;
                }
                // Every dependency of `v` followed.
                self.path.pop();
                self.depth[v] = UNSEEN;
                if let Some(&(parent, _)) = self.path.last() {
                    self.low[parent] = self.low[parent].min(self.low[v]);
                }
                if self.low[v] == self.order[v] {
                    while let Some(w) = self.tarjan.pop() {
                        self.stacked[w] = false;
                        self.component[w] = self.components;
                        if w == v {
                            break;
                        }
                    }
                    self.components += 1;
                }
            }
        }
        Found::All
    }
}

/// The first cycle within reach of `roots`, along the dependencies of the
/// specs `spec_of` knows (a task of an allocation it does not know leads
/// nowhere): depth-first from the roots in order, each task visited once,
/// until a cycle or `max` tasks are seen (the roots not counted until
/// reached). One search, linear in what it sees.
pub fn walk(
    roots: impl IntoIterator<Item = Node>,
    spec_of: impl Fn(&AllocId) -> Option<Arc<super::AllocSpec>>,
    max: usize,
) -> Walk {
    let mut graph = Graph::new(spec_of);
    let roots: Vec<usize> = roots.into_iter().map(|n| graph.id(n)).collect();
    match Search::default().run(&mut graph, &roots, max, true) {
        Found::All => Walk::Clear,
        Found::Cycle(path) => {
            Walk::Cycle(path.into_iter().map(|v| graph.nodes[v].clone()).collect())
        }
        Found::TooFar => Walk::TooFar,
    }
}

/// Which dependencies of `alloc`'s tasks lead back to their own task, each
/// with a shortest such path: one search from `alloc`'s tasks (a task and
/// the target of its dependency in one strongly connected component are
/// on a cycle), then one breadth-first search inside the component from
/// each target that is. Past `max` tasks no cycle is claimed.
pub fn cycles(
    alloc: &AllocId,
    spec_of: impl Fn(&AllocId) -> Option<Arc<super::AllocSpec>>,
    max: usize,
) -> Cycles {
    let Some(spec) = spec_of(alloc) else {
        return Cycles::default();
    };
    let mut graph = Graph::new(spec_of);
    let roots: Vec<usize> = spec
        .tasks()
        .iter()
        .map(|t| graph.id((alloc.clone(), t.name.clone())))
        .collect();
    let mut search = Search::default();
    match search.run(&mut graph, &roots, max, false) {
        Found::All => {}
        // A search that does not stop at a cycle finds none to stop at.
        Found::Cycle(_) | Found::TooFar => {
            return Cycles {
                paths: HashMap::new(),
                too_far: true,
            };
        }
    }
    let Search {
        component, edges, ..
    } = search;
    // From each target on a cycle: the task before each task on the
    // shortest paths out of it, within its component.
    let mut before: HashMap<usize, HashMap<usize, usize>> = HashMap::new();
    let mut paths = HashMap::new();
    for (i, t) in spec.tasks().iter().enumerate() {
        let v = roots[i];
        for (j, d) in t.depends_on.iter().enumerate() {
            let w = edges[v][j];
            if d.allocation.is_none() || component[w] != component[v] {
                continue;
            }
            let tree = before.entry(w).or_insert_with(|| {
                let mut tree = HashMap::from([(w, w)]);
                let mut queue = std::collections::VecDeque::from([w]);
                while let Some(x) = queue.pop_front() {
                    for &y in &edges[x] {
                        if component[y] == component[w] && !tree.contains_key(&y) {
                            tree.insert(y, x);
                            queue.push_back(y);
                        }
                    }
                }
                tree
            });
            // v, w, …, v
            let mut back = vec![v];
            let mut at = v;
            while at != w {
                at = tree[&at];
                back.push(at);
            }
            back.push(v);
            back.reverse();
            paths.insert(
                (i, j),
                back.into_iter().map(|x| graph.nodes[x].clone()).collect(),
            );
        }
    }
    Cycles {
        paths,
        too_far: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(state: RunState, failed: bool, ready: bool) -> TaskStatus {
        let mut t = TaskStatus::new(1);
        t.state = state;
        t.failed = failed;
        t.ready = ready;
        t
    }

    #[test]
    fn each_condition_holds_exactly_as_the_table_says() {
        use Condition as C;
        use RunState as S;
        let cases = [
            (C::Running, status(S::Running, false, false), None),
            (
                C::Running,
                status(S::Pending, false, false),
                Some(Why::Pending),
            ),
            (C::Running, status(S::Dead, false, false), Some(Why::Dead)),
            (C::Running, status(S::Dead, true, false), Some(Why::Failed)),
            (C::Ready, status(S::Running, false, true), None),
            (
                C::Ready,
                status(S::Running, false, false),
                Some(Why::NotReady),
            ),
            (
                C::Ready,
                status(S::Pending, false, false),
                Some(Why::Pending),
            ),
            (C::Ready, status(S::Dead, true, false), Some(Why::Failed)),
            (C::Succeeded, status(S::Dead, false, false), None),
            (
                C::Succeeded,
                status(S::Dead, true, false),
                Some(Why::Failed),
            ),
            (
                C::Succeeded,
                status(S::Running, false, false),
                Some(Why::Running),
            ),
            (
                C::Succeeded,
                status(S::Pending, false, false),
                Some(Why::Pending),
            ),
            (C::Dead, status(S::Dead, true, false), None),
            (C::Dead, status(S::Dead, false, false), None),
            (
                C::Dead,
                status(S::Running, false, false),
                Some(Why::Running),
            ),
            (
                C::Dead,
                status(S::Pending, false, false),
                Some(Why::Pending),
            ),
        ];
        for (c, t, why) in cases {
            assert_eq!(judge(c, Target::Task(&t)).why(), why, "{c} on {t:?}");
        }
        for c in Condition::ALL {
            assert_eq!(judge(*c, Target::Missing).why(), Some(Why::NotRegistered));
            // A task told to restart is as good as pending.
            let mut stale = status(RunState::Running, false, true);
            stale.stale = true;
            assert_eq!(judge(*c, Target::Task(&stale)).why(), Some(Why::Pending));
        }
    }

    #[test]
    fn stage_order_and_conditions_that_can_never_hold_are_named() {
        use Stage::*;
        assert!(never_holds(Main, PrestartSidecar, false, Condition::Running).is_none());
        assert!(
            never_holds(
                PrestartEphemeral,
                PrestartEphemeral,
                false,
                Condition::Succeeded
            )
            .is_none()
        );
        assert!(never_holds(Main, Main, true, Condition::Ready).is_none());
        let later = never_holds(PrestartEphemeral, Main, false, Condition::Running).unwrap();
        assert!(later.contains("later stage"), "{later}");
        let gone = never_holds(Main, PrestartEphemeral, false, Condition::Running).unwrap();
        assert!(gone.contains("use `succeeded`"), "{gone}");
        assert!(
            never_holds(
                PrestartEphemeral,
                PrestartEphemeral,
                false,
                Condition::Running
            )
            .is_none()
        );
        let post = never_holds(Poststop, Main, false, Condition::Ready).unwrap();
        assert!(post.contains("before poststop opens"), "{post}");
        assert!(never_holds(Poststop, Main, false, Condition::Dead).is_none());
        let unready = never_holds(Main, Main, false, Condition::Ready).unwrap();
        assert!(unready.contains("declares no readiness"), "{unready}");
    }

    /// A spec of tasks `t0..`, each depending on the listed positions
    /// (`(alloc, position)` for another allocation's task).
    fn spec(deps: &[&[(Option<&str>, usize)]]) -> Arc<super::super::AllocSpec> {
        spec_with(deps, &super::super::Limits::default())
    }

    fn spec_with(
        deps: &[&[(Option<&str>, usize)]],
        limits: &super::super::Limits,
    ) -> Arc<super::super::AllocSpec> {
        use super::super::{AllocSpec, TaskSpec};
        let tasks = deps
            .iter()
            .enumerate()
            .map(|(i, on)| TaskSpec {
                name: TaskName::parse(&format!("t{i}")).unwrap(),
                lifecycle: None,
                leader: false,
                readiness: false,
                liveness: None,
                depends_on: on
                    .iter()
                    .map(|&(alloc, j)| Dependency {
                        allocation: alloc.map(|a| AllocId::parse(a).unwrap()),
                        task: TaskName::parse(&format!("t{j}")).unwrap(),
                        condition: Condition::Dead,
                    })
                    .collect(),
                acquire: Vec::new(),
                barrier: None,
            })
            .collect();
        Arc::new(AllocSpec::new(tasks, limits).unwrap())
    }

    /// `spec`, past the default task limit.
    fn spec_of_size(deps: &[&[(Option<&str>, usize)]]) -> Arc<super::super::AllocSpec> {
        use super::super::Limits;
        let limits = Limits {
            max_tasks: deps.len(),
            ..Limits::default()
        };
        spec_with(deps, &limits)
    }

    fn node(alloc: &str, t: usize) -> Node {
        (
            AllocId::parse(alloc).unwrap(),
            TaskName::parse(&format!("t{t}")).unwrap(),
        )
    }

    fn within(
        specs: Vec<(&str, Arc<super::super::AllocSpec>)>,
    ) -> impl Fn(&AllocId) -> Option<Arc<super::super::AllocSpec>> {
        move |id| {
            specs
                .iter()
                .find(|(a, _)| *a == id.as_str())
                .map(|(_, s)| s.clone())
        }
    }

    #[test]
    fn a_walk_finds_a_cycle_with_its_path_and_none_in_a_diamond() {
        let roots = |n| (0..n).map(|i| node("a", i)).collect::<Vec<_>>();
        let chain = spec(&[&[(None, 1)], &[(None, 2)], &[]]);
        assert_eq!(walk(roots(3), within(vec![("a", chain)]), 100), Walk::Clear);
        let ring = spec(&[&[(None, 1)], &[(None, 2)], &[(None, 0)]]);
        assert_eq!(
            walk(roots(3), within(vec![("a", ring)]), 100),
            Walk::Cycle(vec![node("a", 0), node("a", 1), node("a", 2), node("a", 0)])
        );
        let diamond = spec(&[&[(None, 1), (None, 2)], &[(None, 2)], &[]]);
        assert_eq!(
            walk(roots(3), within(vec![("a", diamond)]), 100),
            Walk::Clear
        );
    }

    #[test]
    fn a_walk_through_other_allocations_stops_at_what_it_does_not_know_and_at_its_limit() {
        // a/t0 → b/t0 → c/t0 → a/t0, with c unknown: no cycle seen.
        let a = spec(&[&[(Some("b"), 0)]]);
        let b = spec(&[&[(Some("c"), 0)]]);
        let c = spec(&[&[(Some("a"), 0)]]);
        let known = within(vec![("a", a.clone()), ("b", b.clone())]);
        assert_eq!(walk([node("a", 0)], known, 100), Walk::Clear);
        let all = || within(vec![("a", a.clone()), ("b", b.clone()), ("c", c.clone())]);
        assert_eq!(
            walk([node("a", 0)], all(), 100),
            Walk::Cycle(vec![node("a", 0), node("b", 0), node("c", 0), node("a", 0)])
        );
        assert_eq!(walk([node("a", 0)], all(), 2), Walk::TooFar);
    }

    #[test]
    fn cycles_names_each_dependency_that_leads_back_with_its_shortest_path() {
        // a/t0 → b/t0 → c/t0 → a/t0, and a/t1 → b/t0 too (on the same
        // cycle: b/t0 leads back to a/t0, not to a/t1); a/t2 → d/t0 (no
        // way back).
        let a = spec(&[&[(Some("b"), 0)], &[(Some("b"), 0)], &[(Some("d"), 0)]]);
        let b = spec(&[&[(Some("c"), 0)]]);
        let c = spec(&[&[(Some("a"), 0)]]);
        let d = spec(&[&[]]);
        let all = || {
            within(vec![
                ("a", a.clone()),
                ("b", b.clone()),
                ("c", c.clone()),
                ("d", d.clone()),
            ])
        };
        let id = AllocId::parse("a").unwrap();
        let found = cycles(&id, all(), 100);
        assert!(!found.too_far);
        assert_eq!(
            found.paths,
            HashMap::from([(
                (0, 0),
                vec![node("a", 0), node("b", 0), node("c", 0), node("a", 0)]
            )])
        );
        // c unknown: no way back.
        let known = within(vec![("a", a.clone()), ("b", b.clone())]);
        assert_eq!(cycles(&id, known, 100), Cycles::default());
        // Past the limit, nothing is claimed.
        assert!(cycles(&id, all(), 3).too_far);
        assert!(cycles(&id, all(), 3).paths.is_empty());
        // The shortest way back: a/t0 → b/t0, and b/t0 → c/t0 → a/t0 or
        // straight b/t0 → a/t0.
        let b2 = spec(&[&[(Some("c"), 0), (Some("a"), 0)]]);
        let two = within(vec![("a", a.clone()), ("b", b2), ("c", c.clone())]);
        assert_eq!(
            cycles(&id, two, 100).paths[&(0, 0)],
            vec![node("a", 0), node("b", 0), node("a", 0)]
        );
    }

    #[test]
    fn a_search_asks_for_each_allocation_once_however_many_tasks_it_visits() {
        // One allocation of 2,000 tasks, each on the next, and a second
        // whose 16 tasks each depend on every 100th of them.
        let n = 2_000;
        let chain: Vec<Vec<(Option<&str>, usize)>> = (0..n)
            .map(|i| {
                if i + 1 < n {
                    vec![(None, i + 1)]
                } else {
                    vec![]
                }
            })
            .collect();
        let chain: Vec<&[(Option<&str>, usize)]> = chain.iter().map(|v| v.as_slice()).collect();
        let fan: Vec<(Option<&str>, usize)> = (0..16).map(|k| (Some("c"), k * 100)).collect();
        let fans: Vec<&[(Option<&str>, usize)]> = (0..16).map(|_| fan.as_slice()).collect();
        let known = within(vec![
            ("c", spec_of_size(&chain)),
            ("f", spec_of_size(&fans)),
        ]);
        let asked = std::cell::Cell::new(0);
        let counted = |id: &AllocId| {
            asked.set(asked.get() + 1);
            known(id)
        };
        let f = AllocId::parse("f").unwrap();
        assert_eq!(cycles(&f, counted, usize::MAX), Cycles::default());
        // `f` once for its roots, then `f` and `c` once each.
        assert_eq!(asked.get(), 3);
        asked.set(0);
        let roots = (0..16).map(|i| node("f", i));
        assert_eq!(walk(roots, counted, usize::MAX), Walk::Clear);
        assert_eq!(asked.get(), 2);
        // Each task counts once towards the limit, however many paths
        // lead to it: 16 roots and the chain.
        let roots = (0..16).map(|i| node("f", i));
        assert_eq!(walk(roots, &known, 16 + n), Walk::Clear);
        let roots = (0..16).map(|i| node("f", i));
        assert_eq!(walk(roots, &known, n), Walk::TooFar);
    }

    #[test]
    fn wire_names_are_exact() {
        let c: Vec<_> = Condition::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(c, ["running", "ready", "succeeded", "dead"]);
        let w: Vec<_> = Why::ALL.iter().map(|w| w.as_str()).collect();
        assert_eq!(
            w,
            [
                "not_registered",
                "pending",
                "running",
                "dead",
                "failed",
                "not_ready",
                "cycle",
                "no_such_task"
            ]
        );
    }
}
