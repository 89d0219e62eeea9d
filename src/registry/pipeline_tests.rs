//! Pipelined appends (`write.rs`) against a store that stamps its appends
//! at once and commits them when the test says: random interleavings of
//! writers on one allocation and commits that succeed or fail never let a
//! reader see, or a writer be told of, a change the store does not hold,
//! and a store that failed a commit holds nothing after it.

use std::{
    collections::{BTreeMap, VecDeque},
    sync::{Arc, Mutex, Weak},
};

use proptest::prelude::*;
use tokio::sync::oneshot;

use super::*;
use crate::{
    lifecycle::{AllocSpec, EventInput, RunState, TaskName, TaskReport, TaskSpec},
    store::{
        Admitted, Append, AppendError, Appended, Change, Follower, Loaded, Op, Store, StoreError,
    },
};

/// An append handed over, and where its outcome goes.
type Queued = (Arc<Allocation>, oneshot::Sender<Result<u64, AppendError>>);

/// Appends are stamped with the next index and wait in a queue, in index
/// order, until the test commits them; the store hands each durable one to
/// its follower before it answers, and after a failed one it takes and
/// admits nothing more (fail-stop, as the disk store).
#[derive(Default)]
struct Gated {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Queued>,
    last: u64,
    /// What the store holds: the record of each allocation, by the index
    /// that wrote it.
    durable: BTreeMap<u64, Arc<Allocation>>,
    failed: bool,
    follower: Option<Weak<dyn Follower>>,
}

impl Gated {
    fn queued(&self) -> usize {
        self.state.lock().unwrap().queue.len()
    }

    /// Commits the oldest `n` appends together (a group commit): durable
    /// and handed to the follower, or all failed; their writers told in
    /// reverse order (a store may tell a group in any order).
    fn finish_group(&self, n: usize, ok: bool) {
        let mut s = self.state.lock().unwrap();
        let n = n.min(s.queue.len());
        let group: Vec<Queued> = s.queue.drain(..n).collect();
        if group.is_empty() {
            return;
        }
        let ok = ok && !s.failed;
        s.failed |= !ok;
        let mut told = Vec::new();
        let mut changes = Vec::new();
        let mut last = 0;
        for (a, done) in group {
            if ok {
                s.durable.insert(a.modify_index, a.clone());
                last = a.modify_index;
                changes.push(Change::Put(a.clone()));
                told.push((done, Ok(a.modify_index)));
            } else {
                let e = StoreError::Io("the test failed this commit".into());
                told.push((done, Err(AppendError::Store(e))));
            }
        }
        let follower = s.follower.clone();
        drop(s);
        if let (true, Some(f)) = (ok, follower.and_then(|f| f.upgrade())) {
            f.changed(changes, last);
        }
        for (done, result) in told.into_iter().rev() {
            let _ = done.send(result);
        }
    }

    /// Commits the oldest append: durable, or failed.
    fn finish(&self, ok: bool) {
        self.finish_group(1, ok);
    }

    fn holds(&self, a: &Allocation) -> bool {
        self.state
            .lock()
            .unwrap()
            .durable
            .get(&a.modify_index)
            .is_some_and(|d| **d == *a)
    }

    fn durable(&self) -> BTreeMap<u64, Arc<Allocation>> {
        self.state.lock().unwrap().durable.clone()
    }
}

impl Store for Gated {
    fn load(&self) -> Result<Loaded, StoreError> {
        Ok(Loaded::default())
    }

    fn id(&self) -> &str {
        "gated"
    }

    fn follow(&self, _: u64, follower: Weak<dyn Follower>) {
        self.state.lock().unwrap().follower = Some(follower);
    }

    fn admit(&self) -> Result<Admitted, StoreError> {
        match self.state.lock().unwrap().failed {
            true => Err(StoreError::Io("a commit failed before".into())),
            false => Ok(Admitted::free()),
        }
    }

    fn append(&self, append: Append) -> Appended {
        let Op::Put(mut a) = append.op else {
            unreachable!("the tests delete nothing")
        };
        let (done, wait) = oneshot::channel();
        let mut s = self.state.lock().unwrap();
        if s.failed {
            let _ = done.send(Err(AppendError::Store(StoreError::Closed)));
        } else {
            s.last += 1;
            let placeholder = a.modify_index;
            Arc::make_mut(&mut a).restamp(placeholder, s.last);
            s.queue.push_back((a.clone(), done));
        }
        Appended {
            record: Some(a),
            stamped: true,
            done: Box::pin(async move { wait.await.unwrap_or(Err(StoreError::Closed.into())) }),
        }
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
        let mut failed_at = None;
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
                Step::Fail => {
                    store.finish(false);
                    if store.state.lock().unwrap().failed {
                        failed_at.get_or_insert(store.durable().len());
                    }
                }
                Step::Group(n) => store.finish_group(n, true),
                Step::Yield => {}
            }
            settle().await;
            check(&store, &r, &answers)?;
            if let Some(held) = failed_at {
                prop_assert_eq!(
                    store.durable().len(),
                    held,
                    "a commit taken after a failed one"
                );
            }
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
        let durable = store.durable();
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
            .all()
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
/// are handed to the store before the first is durable.
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
