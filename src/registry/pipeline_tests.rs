//! Pipelined commits (`Registry::update`) against a store whose commits
//! finish when the test says: random interleavings of writers on one
//! allocation and commits that succeed or fail never let a reader see, or a
//! writer be told of, a change the store does not hold.

use std::{
    collections::{BTreeMap, VecDeque},
    sync::{Arc, Mutex},
};

use proptest::prelude::*;
use tokio::sync::oneshot;

use super::*;
use crate::{
    lifecycle::{EventInput, RunState, TaskName, TaskReport, TaskSpec},
    store::{Commit, Loaded, Op, Store, StoreError},
};

/// A commit handed over, and where its outcome goes.
type Queued = (Op, oneshot::Sender<Result<(), StoreError>>);

/// Commits wait in a queue, in the order they were handed over, until the
/// test finishes them; the store makes them durable in that order, and
/// after a failed one it takes no other (as the disk store does).
#[derive(Default)]
struct Gated {
    queue: Mutex<VecDeque<Queued>>,
    /// What the store holds: the record of each allocation, by the index
    /// that wrote it.
    durable: Mutex<BTreeMap<u64, Arc<Allocation>>>,
    failed: Mutex<bool>,
}

impl Gated {
    fn queued(&self) -> usize {
        self.queue.lock().unwrap().len()
    }

    /// Finishes the oldest commit: durable, or failed.
    fn finish(&self, ok: bool) {
        let Some((op, done)) = self.queue.lock().unwrap().pop_front() else {
            return;
        };
        let mut failed = self.failed.lock().unwrap();
        if ok && !*failed {
            if let Op::Put(a) = op {
                self.durable.lock().unwrap().insert(a.modify_index, a);
            }
            let _ = done.send(Ok(()));
        } else {
            *failed = true;
            let _ = done.send(Err(StoreError::Io("the test failed this commit".into())));
        }
    }

    /// A group commit: the oldest `n` made durable together, their
    /// writers told in reverse order (a store may tell a group in any
    /// order).
    fn finish_group(&self, n: usize) {
        let mut told = Vec::new();
        for _ in 0..n {
            let Some((op, done)) = self.queue.lock().unwrap().pop_front() else {
                break;
            };
            if *self.failed.lock().unwrap() {
                told.push((done, Err(StoreError::Io("after a failed commit".into()))));
                continue;
            }
            if let Op::Put(a) = op {
                self.durable.lock().unwrap().insert(a.modify_index, a);
            }
            told.push((done, Ok(())));
        }
        for (done, result) in told.into_iter().rev() {
            let _ = done.send(result);
        }
    }

    fn holds(&self, a: &Allocation) -> bool {
        self.durable
            .lock()
            .unwrap()
            .get(&a.modify_index)
            .is_some_and(|d| **d == *a)
    }
}

impl Store for Gated {
    fn load(&self) -> Result<Loaded, StoreError> {
        Ok(Loaded {
            allocations: Vec::new(),
            last_index: 0,
            liveness: Vec::new(),
        })
    }

    fn commit(&self, op: Op) -> Commit {
        let (done, wait) = oneshot::channel();
        self.queue.lock().unwrap().push_back((op, done));
        Box::pin(async move { wait.await.unwrap_or(Err(StoreError::Closed)) })
    }

    fn id(&self) -> &str {
        "gated"
    }
}

#[derive(Clone, Debug)]
enum Step {
    /// A writer reports `web` running or pending, with an event or
    /// without (then it may change nothing).
    Write(bool, bool),
    /// The oldest commit is made durable.
    Durable,
    /// The oldest commit fails.
    Fail,
    /// The oldest few are made durable together, told in reverse order.
    Group(usize),
    /// Tasks run until they wait.
    Yield,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (any::<bool>(), any::<bool>()).prop_map(|(r, e)| Step::Write(r, e)),
        4 => Just(Step::Durable),
        1 => Just(Step::Fail),
        3 => (2..6usize).prop_map(Step::Group),
        3 => Just(Step::Yield),
    ]
}

fn report(running: bool, n: usize) -> Vec<(TaskName, TaskReport)> {
    report_with(running, Some(n))
}

fn report_with(running: bool, event: Option<usize>) -> Vec<(TaskName, TaskReport)> {
    vec![(
        TaskName::parse("web").unwrap(),
        TaskReport {
            state: if running {
                RunState::Running
            } else {
                RunState::Pending
            },
            failed: false,
            ready: None,
            event: event.map(|n| EventInput {
                kind: "Note".into(),
                time: None,
                message: format!("w{n}"),
                details: Default::default(),
            }),
        },
    )]
}

async fn settle() {
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
}

/// What every step checks: the published record is one the store holds,
/// and each answer the writers got is a record the store holds (or an
/// error).
fn check(
    store: &Gated,
    r: &Registry,
    answers: &Mutex<Vec<Result<Arc<Allocation>, String>>>,
) -> Result<(), TestCaseError> {
    let seen = r.get("a").unwrap();
    prop_assert!(
        store.holds(&seen),
        "a reader sees index {} that the store does not hold",
        seen.modify_index
    );
    for answer in answers.lock().unwrap().iter().flatten() {
        prop_assert!(
            store.holds(answer),
            "a writer was told of index {} that the store does not hold",
            answer.modify_index
        );
    }
    Ok(())
}

/// A registry on a gated store, with allocation `a` (one task, `web`)
/// registered and its commit finished.
async fn registered() -> (Arc<Gated>, Registry) {
    let store = Arc::new(Gated::default());
    let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
    let spec = AllocSpec::new(
        vec![TaskSpec::named(TaskName::parse("web").unwrap())],
        &Limits::default(),
    )
    .unwrap();
    let registering = {
        let r = r.clone();
        tokio::spawn(async move { r.register(AllocId::parse("a").unwrap(), spec).await })
    };
    settle().await;
    store.finish(true);
    registering.await.unwrap().unwrap();
    (store, r)
}

fn run(steps: Vec<Step>) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let (store, r) = registered().await;

        let answers = Arc::new(Mutex::new(Vec::new()));
        let mut writers = Vec::new();
        let mut last_seen = 1;
        for (n, s) in steps.into_iter().enumerate() {
            match s {
                Step::Write(running, event) => {
                    let (r, answers) = (r.clone(), answers.clone());
                    writers.push(tokio::spawn(async move {
                        let got = r
                            .report("a", report_with(running, event.then_some(n)))
                            .await;
                        answers.lock().unwrap().push(got.map_err(|e| e.to_string()));
                    }));
                }
                Step::Durable => store.finish(true),
                Step::Fail => store.finish(false),
                Step::Group(n) => store.finish_group(n),
                Step::Yield => {}
            }
            settle().await;
            check(&store, &r, &answers)?;
            let now = r.get("a").unwrap().modify_index;
            prop_assert!(
                now >= last_seen,
                "a reader saw index {now} after {last_seen}"
            );
            last_seen = now;
        }
        // Everything still queued finishes; every writer gets its answer.
        while store.queued() > 0 || writers.iter().any(|w| !w.is_finished()) {
            store.finish(true);
            settle().await;
            check(&store, &r, &answers)?;
        }
        // The newest record the store holds is the one published (the
        // last publication is the newest: never an older one after it),
        // and every answer is a record the store holds.
        let durable = store.durable.lock().unwrap().clone();
        let seen = r.get("a").unwrap();
        if let Some((_, newest)) = durable.last_key_value() {
            prop_assert_eq!(&seen, newest);
        }
        let told: Vec<u64> = answers
            .lock()
            .unwrap()
            .iter()
            .flatten()
            .map(|a| a.modify_index)
            .collect();
        for i in &told {
            prop_assert!(durable.contains_key(i));
        }
        // Each event the store holds is in the published history once.
        let messages: Vec<String> = seen.tasks[0]
            .events
            .iter()
            .map(|e| e.message.to_string())
            .collect();
        let mut unique = messages.clone();
        unique.sort();
        unique.dedup();
        prop_assert_eq!(unique.len(), messages.len(), "{:?}", messages);
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig {
        // `TASKGATE_FUZZ_CASES` runs more (CI's fuzz step does).
        cases: std::env::var("TASKGATE_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(256),
        ..ProptestConfig::default()
    })]

    #[test]
    fn pipelined_commits_never_expose_or_acknowledge_what_the_store_lacks(
        steps in proptest::collection::vec(step(), 1..40)
    ) {
        run(steps)?;
    }
}

/// 64 writers on one allocation share the store's commits: all 64 changes
/// are handed to the store before the first is durable (before, each
/// waited for the one before it to be durable).
#[tokio::test]
async fn writers_on_one_allocation_do_not_wait_for_each_others_commit() {
    let (store, r) = registered().await;

    let writers: Vec<_> = (0..64)
        .map(|n| {
            let r = r.clone();
            tokio::spawn(async move { r.report("a", report(n % 2 == 0, n)).await })
        })
        .collect();
    for _ in 0..64 {
        settle().await;
    }
    assert_eq!(
        store.queued(),
        64,
        "every change handed to the store at once"
    );
    assert_eq!(r.get("a").unwrap().modify_index, 1, "nothing published yet");
    while store.queued() > 0 {
        store.finish(true);
    }
    for w in writers {
        w.await.unwrap().unwrap();
    }
    let a = r.get("a").unwrap();
    assert_eq!(a.modify_index, 65);
    assert!(store.holds(&a));
}
