//! What the registry refuses, and why.

use crate::{
    lifecycle::{AllocId, Allocation, Refusal, RestartError, TaskName, Timestamp},
    store::StoreError,
};

/// A caller's own limits on what the allocations whose IDs start with one
/// of `prefixes` (any ID, if there are none) may hold together.
#[derive(Clone, Copy, Debug)]
pub struct Quota<'a> {
    pub name: &'a str,
    pub prefixes: &'a [String],
    /// Registered allocations (`None`: no limit of the caller's own).
    pub max_allocations: Option<usize>,
    /// Dependencies on other allocations, declared by its allocations
    /// together (`None`: no limit of the caller's own).
    pub max_dependencies: Option<usize>,
}

impl Quota<'_> {
    /// The prefixes to count under, each ID once: a prefix inside another
    /// of the list (or given twice) is the other's count already.
    pub fn distinct_prefixes(&self) -> Vec<&str> {
        let covered = |i: usize, p: &String| {
            self.prefixes
                .iter()
                .enumerate()
                .any(|(j, o)| j != i && p.starts_with(o.as_str()) && (o.len() < p.len() || j < i))
        };
        self.prefixes
            .iter()
            .enumerate()
            .filter(|&(i, p)| !covered(i, p))
            .map(|(_, p)| p.as_str())
            .collect()
    }
}

/// Which tasks a restart request names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RestartTarget {
    Task(TaskName),
    Running,
    AllTasks,
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("allocation \"{0}\" not found")]
    AllocationNotFound(String),
    #[error("task \"{task}\" not found in allocation \"{alloc}\"; its tasks are {tasks}")]
    TaskNotFound {
        alloc: String,
        task: String,
        /// The allocation's task names, quoted, comma-separated.
        tasks: String,
    },
    #[error(
        "allocation \"{id}\" is already registered with a different task spec; delete it \
         first (DELETE /v1/allocations/{id}) or register the new spec under another ID"
    )]
    AllocationExists { id: AllocId, index: u64 },
    #[error("{error}")]
    RestartRefused { error: RestartError, index: u64 },
    #[error(
        "task \"{task}\" of allocation \"{alloc}\" was declared lost at {lost_at}: its agent gave \
         no sign of life within its TTL. Stop its process; an all-tasks restart or a restore \
         runs it again"
    )]
    TaskLost {
        alloc: String,
        task: String,
        /// RFC 3339.
        lost_at: String,
        index: u64,
    },
    #[error(
        "this Idempotency-Key was used before with another request; a retry must send the \
         same request, and a new request needs a new key"
    )]
    KeyReused { index: u64 },
    /// The request names a run of the task that is not its current one.
    #[error(
        "run {sent} of task \"{task}\" of allocation \"{alloc}\" is over ({}): the agent that \
         sent this is a leftover of an earlier run or registration and must stop its process",
        match current { Some(r) => format!("the current run is {r}"), None => "the task runs no run now".to_owned() }
    )]
    RunSuperseded {
        alloc: String,
        task: String,
        sent: u64,
        current: Option<u64>,
        index: u64,
    },
    /// Another agent runs the task.
    #[error(
        "task \"{task}\" of allocation \"{alloc}\" is running under run {run}{}: another agent \
         runs it. Do not start a second copy; wait until its run ends or is lost",
        match last_seen { Some(t) => format!(" (last sign of life {t})"), None => String::new() }
    )]
    TaskClaimed {
        alloc: String,
        task: String,
        run: u64,
        /// RFC 3339, if the server knows one.
        last_seen: Option<String>,
        index: u64,
    },
    /// The task is dead, and no order since lets it leave `dead`.
    #[error(
        "task \"{task}\" of allocation \"{alloc}\" is dead{}: it stays dead until an \
         operator's all-tasks restart or restore (only a restore once the allocation is in \
         poststop); an agent that finds its task dead reports \
         nothing and exits",
        match finished_at { Some(t) => format!(" (since {t})"), None => String::new() }
    )]
    TaskDead {
        alloc: String,
        task: String,
        /// RFC 3339.
        finished_at: Option<String>,
        index: u64,
    },
    /// An operator's stop of an allocation whose tasks are all dead.
    #[error("{error}")]
    StopRefused {
        error: crate::lifecycle::StopError,
        index: u64,
    },
    #[error("allocation \"{0}\" was deleted")]
    Deleted(String),
    #[error("semaphore \"{0}\" not found")]
    SemaphoreNotFound(String),
    /// A barrier member registered after the barrier opened or timed
    /// out, or beyond its size.
    #[error("barrier \"{name}\" is closed to new members: {why}")]
    BarrierClosed { name: String, why: String },
    /// A barrier member whose size or timeout is not its members'.
    #[error("barrier \"{name}\" has members of size {size}{}; every member must say the same", timeout.map(|t| format!(" and timeout {}", crate::units::format_duration(t))).unwrap_or_else(|| " and no timeout".into()))]
    BarrierMismatch {
        name: String,
        size: u16,
        timeout: Option<std::time::Duration>,
    },
    #[error("too many requests are waiting; retry later")]
    TooManyWaiters,
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("{0}")]
    QuotaExceeded(String),
    /// The registration's dependencies close a cycle: among its own tasks
    /// (`held` false), or through allocations the server holds.
    #[error(
        "these dependencies close a cycle, so none of its tasks could ever start: {}",
        path.join(" → ")
    )]
    DependencyCycle { path: Vec<String>, held: bool },
    /// A valid request for something this server does not do.
    #[error("{0}")]
    Unsupported(String),
    /// A rule only the registry can check is broken (it needs the other
    /// allocations it holds).
    #[error("the allocation spec is not valid")]
    Invalid(Vec<crate::lifecycle::FieldError>),
    /// The allocation kept changing under the request (deleted and
    /// registered again by others); a later try will go through.
    #[error("{0}")]
    Contended(String),
    /// The allocation's record in a store several replicas write cannot
    /// be read by this build.
    #[error("the record of allocation \"{id}\" in the store cannot be read by this server: {why}")]
    Unreadable { id: String, why: String },
    /// The store holds the allocation at `index` and this replica's view
    /// has not reached it in time.
    #[error(
        "this replica has not caught up with allocation \"{id}\" yet (the store holds it at \
         index {index}, this replica's view is at {view}); try again"
    )]
    Behind { id: String, index: u64, view: u64 },
    /// A sign of life heard while etcd acknowledges no lease renewal
    /// (docs/replicas.md, "Liveness"): no lease can carry it for now.
    #[error(
        "the sign of life for task \"{task}\" of allocation \"{alloc}\" was heard, but etcd \
         acknowledges no lease renewal now (one has waited past the renewal deadline), so it \
         cannot be kept for the task's TTL; send it again"
    )]
    Unrenewed { alloc: String, task: String },
    /// A sign of life heard while this replica's view holds the run's
    /// live key gone (its lease ended; docs/replicas.md, "Liveness"): the
    /// run is being marked again under a new lease, and until then no
    /// lease carries the sign.
    #[error(
        "the sign of life for task \"{task}\" of allocation \"{alloc}\" was heard, but the \
         etcd lease of its run has ended and the run is not marked again under a new one yet, \
         so it cannot be kept for the task's TTL; send it again"
    )]
    LeaseEnded { alloc: String, task: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl RegistryError {
    /// `TaskLost` for task `i` of `a`, lost at `at`.
    pub fn task_lost(a: &Allocation, i: usize, at: Timestamp) -> Self {
        Self::TaskLost {
            alloc: a.id.to_string(),
            task: a.task_name(i).to_string(),
            lost_at: at
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default(),
            index: a.modify_index,
        }
    }

    /// The error of `refusal` for task `i` of `a` (`last_seen`: the task's
    /// latest sign of life, if the server knows one).
    pub fn refused(
        a: &Allocation,
        i: usize,
        refusal: Refusal,
        sent: Option<u64>,
        last_seen: Option<Timestamp>,
    ) -> Self {
        let rfc3339 = |t: Timestamp| {
            t.format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default()
        };
        let (alloc, task, index) = (a.id.to_string(), a.task_name(i).to_string(), a.modify_index);
        match refusal {
            Refusal::Lost { at } => Self::task_lost(a, i, at),
            Refusal::Superseded { current } => Self::RunSuperseded {
                alloc,
                task,
                sent: sent.unwrap_or_default(),
                current,
                index,
            },
            Refusal::Claimed { run } => Self::TaskClaimed {
                alloc,
                task,
                run,
                last_seen: last_seen.map(rfc3339),
                index,
            },
            Refusal::Dead { finished_at } => Self::TaskDead {
                alloc,
                task,
                finished_at: finished_at.map(rfc3339),
                index,
            },
            Refusal::NoReadiness => Self::Invalid(vec![crate::lifecycle::FieldError::new(
                "ready",
                format!(
                    "task \"{task}\" declares no readiness, so it cannot be ready (declare \
                     `readiness` on it)"
                ),
            )]),
        }
    }

    /// `TaskNotFound` for `task` in `a`, listing the tasks it has.
    pub fn task_not_found(a: &Allocation, task: &str) -> Self {
        let tasks: Vec<String> = a
            .spec
            .tasks()
            .iter()
            .map(|t| format!("\"{}\"", t.name))
            .collect();
        Self::TaskNotFound {
            alloc: a.id.to_string(),
            task: task.to_owned(),
            tasks: tasks.join(", "),
        }
    }
}
