//! Each allocation's timeline: the server's own decisions (registration,
//! coordinator transitions, task state changes, stop and restart orders,
//! restores) next to the agents' events, in index order, the last
//! `--timeline-events` of them.
//!
//! Entries are derived from two successive versions of the record, so
//! every store and every replica keeps the same timeline from the changes
//! it publishes, with no extra write. They are kept compactly (states as
//! bytes, task positions, an agent's event shared with the record, not
//! copied) and written out as JSON only when asked for. The timeline lives
//! in memory: a restarted server starts each allocation's timeline afresh.

use std::{collections::VecDeque, sync::Arc};

use crate::lifecycle::{
    Allocation, CoordState, Desired, EventBody, LOST_EVENT, RESTART_EVENT, RunState, StopKind,
    Timestamp,
};

/// What happened, compactly; tasks are positions in the allocation's spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum What {
    Registered,
    Coordinator {
        from: CoordState,
        to: CoordState,
    },
    TaskState {
        task: u16,
        state: RunState,
        failed: bool,
        ready: bool,
    },
    StopOrder {
        reason: StopKind,
        named: Option<u16>,
        /// For "Deadline Exceeded": the state whose deadline passed.
        stage: Option<CoordState>,
    },
    /// A task was declared lost; its "Agent Lost" event (the server's)
    /// carries the TTL and the last sign of life.
    Lost {
        task: u16,
        event: Arc<EventBody>,
    },
    /// A deadline passed: a stage's (`prestart`, `main`, `poststart`) or
    /// the poststop tasks'.
    DeadlineExceeded {
        stage: CoordState,
    },
    /// Whether dependency `dep` of `task` holds flipped.
    Dependency {
        task: u16,
        dep: u16,
        holds: bool,
    },
    /// Boxed: rare, and the largest; the entry of every other kind stays
    /// 32 bytes.
    RestartOrder(Box<RestartOrder>),
    Restored,
    /// An event the task's agent sent.
    Agent {
        task: u16,
        event: Arc<EventBody>,
    },
}

/// Tasks told to restart, by position; the "Restart Signaled" event
/// carries the mode and the reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestartOrder {
    pub tasks: Box<[u16]>,
    pub event: Arc<EventBody>,
}

/// One entry: the index of the change that made it, and when (UTC
/// nanoseconds since 1970, clamped to what 64 bits hold: the years 1678
/// to 2262).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub index: u64,
    nanos: i64,
    pub what: What,
}

impl Entry {
    pub fn new(index: u64, time: Timestamp, what: What) -> Self {
        let nanos = time
            .unix_timestamp_nanos()
            .clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;
        Self { index, nanos, what }
    }

    pub fn time(&self) -> Timestamp {
        Timestamp::from_unix_timestamp_nanos(i128::from(self.nanos))
            .expect("64-bit nanoseconds are always a valid time")
    }
}

/// The bounded timeline of one allocation.
#[derive(Debug, Default)]
pub struct Timeline {
    entries: VecDeque<Entry>,
}

impl Timeline {
    /// Appends, dropping the oldest beyond `limit`. Grows its block to
    /// the size it needs, not by doubling: a settled allocation's 28 or so
    /// entries take 28 slots, not 32 or 64.
    pub fn extend(&mut self, new: Vec<Entry>, limit: usize) {
        if limit == 0 {
            return;
        }
        let room = limit.min(self.entries.len() + new.len());
        if room > self.entries.capacity() {
            self.entries.reserve_exact(room - self.entries.len());
        }
        for e in new {
            if self.entries.len() == limit {
                self.entries.pop_front();
            }
            self.entries.push_back(e);
        }
    }

    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.entries.iter()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

fn pos(i: usize) -> u16 {
    u16::try_from(i).unwrap_or(u16::MAX)
}

/// The entries one published change makes: `prev` is the version before
/// (`None` for a registration), `next` the one published.
pub fn entries(prev: Option<&Allocation>, next: &Allocation) -> Vec<Entry> {
    let mut out = Vec::new();
    let at = |what| Entry::new(next.modify_index, next.modified_at, what);
    let Some(prev) = prev else {
        out.push(Entry::new(
            next.create_index,
            next.created_at,
            What::Registered,
        ));
        if next.state != CoordState::Init {
            out.push(at(What::Coordinator {
                from: CoordState::Init,
                to: next.state,
            }));
        }
        return out;
    };
    // Restart orders: the tasks whose generation went up.
    let mut restarted: Vec<u16> = Vec::new();
    let mut signal: Option<Arc<EventBody>> = None;
    for (i, (p, n)) in prev.tasks.iter().zip(&next.tasks).enumerate() {
        if n.restart_generation > p.restart_generation {
            restarted.push(pos(i));
            if signal.is_none() {
                signal = n.events.last_of(RESTART_EVENT).map(|e| e.body().clone());
            }
        }
    }
    // Only a restore moves the coordinator back without a restart order
    // (a restore that leaves it where it was reads as the reports it is).
    let restored = next.state < prev.state && restarted.is_empty();
    if restored {
        out.push(at(What::Restored));
    }
    if let Some(event) = signal {
        out.push(at(What::RestartOrder(Box::new(RestartOrder {
            tasks: restarted.into_boxed_slice(),
            event,
        }))));
    }
    // A deadline that passed comes before what it causes.
    let (was, is) = (prev.overdue(), next.overdue());
    let stage =
        |o: Option<&crate::lifecycle::Overdue>| o.and_then(|o| o.stage.as_ref().map(|s| s.0));
    let told = |o: Option<&crate::lifecycle::Overdue>| o.is_some_and(|o| o.poststop.is_some());
    if stage(is).is_some() && stage(is) != stage(was) {
        out.push(at(What::DeadlineExceeded {
            stage: stage(is).expect("checked"),
        }));
    }
    if told(is) && !told(was) {
        out.push(at(What::DeadlineExceeded {
            stage: CoordState::Poststop,
        }));
    }
    for (i, (p, n)) in prev.tasks.iter().zip(&next.tasks).enumerate() {
        let lost_now = n.lost() && !p.lost();
        // The agent's events first: they say why the state changed.
        for event in n.events.added_since(&p.events) {
            if lost_now && event.kind == LOST_EVENT {
                out.push(at(What::Lost {
                    task: pos(i),
                    event: event.body().clone(),
                }));
            } else if event.kind != RESTART_EVENT {
                out.push(Entry::new(
                    next.modify_index,
                    event.time,
                    What::Agent {
                        task: pos(i),
                        event: event.body().clone(),
                    },
                ));
            }
        }
        for (j, now) in n.deps().iter().enumerate() {
            let before = p.deps().get(j).is_some_and(|d| d.holds());
            if now.holds() != before || (j >= p.deps().len() && now.holds()) {
                out.push(at(What::Dependency {
                    task: pos(i),
                    dep: pos(j),
                    holds: now.holds(),
                }));
            }
        }
        if (p.state, p.failed, p.ready) != (n.state, n.failed, n.ready) {
            out.push(at(What::TaskState {
                task: pos(i),
                state: n.state,
                failed: n.failed,
                ready: n.ready,
            }));
        }
    }
    if prev.order() != next.order()
        && let Desired::Stop(reason) = next.order()
    {
        out.push(at(What::StopOrder {
            reason: reason.kind,
            named: reason
                .task
                .as_ref()
                .and_then(|t| next.position(t.as_str()))
                .map(pos),
            stage: reason.stage,
        }));
    }
    if prev.state != next.state {
        out.push(at(What::Coordinator {
            from: prev.state,
            to: next.state,
        }));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifecycle::{
        AllocId, AllocSpec, Hook, Lifecycle, Limits, RestartMode, TaskName, TaskReport, TaskSpec,
    };
    use time::macros::datetime;

    const T: Timestamp = datetime!(2026-11-24 10:00 UTC);

    fn report(state: RunState, failed: bool) -> TaskReport {
        TaskReport {
            state,
            failed,
            ready: None,
            event: None,
        }
    }

    fn five() -> Allocation {
        let task = |name: &str, hook: Option<(Hook, bool)>, leader| TaskSpec {
            name: TaskName::parse(name).unwrap(),
            lifecycle: hook.map(|(hook, sidecar)| Lifecycle { hook, sidecar }),
            leader,
            readiness: false,
            liveness: None,
            depends_on: Vec::new(),
        };
        let tasks = vec![
            task("init", Some((Hook::Prestart, false)), false),
            task("proxy", Some((Hook::Prestart, true)), false),
            task("web", None, true),
            task("announce", Some((Hook::Poststart, false)), false),
            task("cleanup", Some((Hook::Poststop, false)), false),
        ];
        let spec = AllocSpec::new(tasks, &Limits::default()).unwrap();
        Allocation::register(AllocId::parse("a1").unwrap(), Arc::new(spec), 1, T)
    }

    fn kinds(entries: &[Entry]) -> Vec<String> {
        entries
            .iter()
            .map(|e| match &e.what {
                What::Registered => "Registered".to_owned(),
                What::Coordinator { from, to } => format!("Coordinator {from}->{to}"),
                What::TaskState { task, state, .. } => format!("Task State {task} {state}"),
                What::StopOrder { reason, named, .. } => format!("Stop Order {reason} {named:?}"),
                What::RestartOrder(r) => format!("Restart Order {:?}", r.tasks),
                What::Restored => "Restored".to_owned(),
                What::Agent { task, event } => format!("Agent {task} {}", event.kind),
                What::Lost { task, .. } => format!("Agent Lost {task}"),
                What::DeadlineExceeded { stage } => format!("Deadline Exceeded {stage}"),
                What::Dependency { task, dep, holds } => format!("Dependency {task} {dep} {holds}"),
            })
            .collect()
    }

    #[test]
    fn each_change_says_what_the_server_decided() {
        let a = five();
        assert_eq!(
            kinds(&entries(None, &a)),
            ["Registered", "Coordinator init->prestart"]
        );
        let mut r = report(RunState::Dead, true);
        r.event = Some(crate::lifecycle::EventInput {
            kind: "Terminated".into(),
            time: None,
            message: "Exit Code: 1".into(),
            details: Default::default(),
        });
        let b = a.report(&[(0, r)], T, || 2).unwrap();
        assert_eq!(
            kinds(&entries(Some(&a), &b)),
            [
                "Agent 0 Terminated",
                "Task State 0 dead",
                "Stop Order Sibling Task Failed Some(0)"
            ]
        );
        let (c, _) = b.restart(RestartMode::AllTasks, "again", T, || 3).unwrap();
        let c = c.unwrap();
        assert_eq!(
            kinds(&entries(Some(&b), &c)),
            ["Restart Order [0]", "Coordinator prestart->init"]
        );
        let d = c
            .report(&[(0, report(RunState::Pending, false))], T, || 4)
            .unwrap();
        assert_eq!(
            kinds(&entries(Some(&c), &d)),
            ["Task State 0 pending", "Coordinator init->prestart"]
        );
        let e = d
            .report(
                &[
                    (0, report(RunState::Dead, false)),
                    (1, report(RunState::Running, false)),
                    (2, report(RunState::Running, false)),
                ],
                T,
                || 5,
            )
            .unwrap();
        assert_eq!(e.state, CoordState::Poststart);
        // A restore that moves the coordinator back says so.
        let f = e
            .restore(&[(2, report(RunState::Pending, false))], T, || 6)
            .unwrap();
        assert_eq!(
            kinds(&entries(Some(&e), &f)),
            [
                "Restored",
                "Task State 2 pending",
                "Coordinator poststart->main"
            ]
        );
    }

    #[test]
    fn an_entry_is_32_bytes_and_keeps_its_time() {
        assert_eq!(std::mem::size_of::<Entry>(), 32);
        let t = datetime!(2026-11-24 10:00:00.123456789 +05:30);
        assert_eq!(Entry::new(1, t, What::Registered).time(), t);
        let far = datetime!(9999-12-31 23:59:59 UTC);
        assert!(
            Entry::new(1, far, What::Registered).time().year() == 2262,
            "clamped"
        );
    }

    /// A five-task allocation run from registration to its end as the
    /// agents report it (each start and end with its event): its timeline
    /// fits in 1 KiB.
    #[test]
    fn a_settled_five_task_allocation_s_timeline_takes_at_most_1_kib() {
        let mut a = five();
        let mut timeline = Timeline::default();
        timeline.extend(entries(None, &a), 64);
        let with = |state, kind: &str| {
            let mut r = report(state, false);
            r.event = Some(crate::lifecycle::EventInput {
                kind: kind.into(),
                time: None,
                message: String::new(),
                details: Default::default(),
            });
            r
        };
        // (task, state, event) in the order agents report them.
        let steps = [
            (0, RunState::Running, "Started"),
            (1, RunState::Running, "Started"),
            (0, RunState::Dead, "Terminated"),
            (2, RunState::Running, "Started"),
            (3, RunState::Running, "Started"),
            (3, RunState::Dead, "Terminated"),
            (2, RunState::Dead, "Terminated"),
            (1, RunState::Dead, "Killed"),
            (4, RunState::Running, "Started"),
            (4, RunState::Dead, "Terminated"),
        ];
        for (index, (task, state, kind)) in (2..).zip(steps) {
            let next = a.report(&[(task, with(state, kind))], T, || index).unwrap();
            timeline.extend(entries(Some(&a), &next), 64);
            a = next;
        }
        assert_eq!(a.state, CoordState::Poststop);
        let bytes = timeline.entries.capacity() * std::mem::size_of::<Entry>();
        assert!(bytes <= 1024, "{} entries in {bytes} bytes", timeline.len());
    }

    #[test]
    fn the_timeline_keeps_the_last_entries() {
        let mut t = Timeline::default();
        let e = |index| Entry::new(index, T, What::Registered);
        t.extend((1..=5).map(e).collect(), 3);
        let kept: Vec<u64> = t.entries().map(|e| e.index).collect();
        assert_eq!(kept, [3, 4, 5]);
        t.extend(vec![e(6)], 0);
        assert_eq!(t.len(), 3, "a limit of 0 keeps nothing new");
    }
}
