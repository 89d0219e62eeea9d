//! Random histories of puts and deletions, with reopens under different
//! log limits (1 byte: a checkpoint per commit) and unfinished appends left
//! at the end of the log, checked against a map after every reopen.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::{tests::spec, *};
use crate::lifecycle::{AllocId, Allocation};

#[derive(Clone, Debug)]
enum Step {
    Put(u8),
    Delete(u8),
    Reopen(u64),
    /// Close, leave an unfinished append at the end of the newest
    /// segment (the first this many bytes of a frame, then this many
    /// zeros), reopen.
    Tear(usize, usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0..8u8).prop_map(Step::Put),
        2 => (0..8u8).prop_map(Step::Delete),
        1 => prop::sample::select(vec![1, 300, 4096, DEFAULT_LOG_LIMIT]).prop_map(Step::Reopen),
        1 => (0..3000usize, prop_oneof![Just(0usize), 1..3000usize])
            .prop_map(|(keep, zeros)| Step::Tear(keep, zeros)),
    ]
}

fn reopen(
    dir: &Path,
    log_limit: u64,
    model: &BTreeMap<String, Allocation>,
    last: u64,
) -> DiskStore {
    let store = DiskStore::open(DiskStoreConfig {
        max_batch: 16,
        log_limit,
        ..DiskStoreConfig::new(dir.to_owned())
    })
    .unwrap();
    let loaded = store.load().unwrap();
    let expected: Vec<_> = model.values().cloned().collect();
    assert_eq!(loaded.allocations, expected);
    assert_eq!(loaded.last_index, last);
    store
}

/// Waits for every queued commit, then closes the store.
fn settle(rt: &tokio::runtime::Runtime, store: DiskStore, queued: &mut Vec<Commit>) {
    rt.block_on(async {
        for c in queued.drain(..) {
            c.await.unwrap();
        }
    });
    store.close().unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("TASKGATE_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(48)
    ))]

    #[test]
    fn the_store_loads_exactly_what_was_committed(
        steps in prop::collection::vec(step(), 1..60),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut model = BTreeMap::new();
        let mut last = 0;
        let mut limit = 300;
        let mut store = reopen(dir.path(), limit, &model, last);
        let mut queued = Vec::new();
        for step in steps {
            match step {
                Step::Put(n) | Step::Delete(n) => {
                    last += 1;
                    let id = AllocId::parse(&format!("a{n}")).unwrap();
                    let op = if let Step::Put(_) = step {
                        let now = time::OffsetDateTime::UNIX_EPOCH;
                        let a = Allocation::register(id.clone(), Arc::new(spec()), last, now);
                        model.insert(id.to_string(), a.clone());
                        Op::Put(Arc::new(a))
                    } else {
                        model.remove(id.as_str());
                        Op::Delete(id)
                    };
                    // Queued together, so they share group commits.
                    queued.push(store.commit(op));
                }
                Step::Reopen(new_limit) => {
                    settle(&rt, store, &mut queued);
                    limit = new_limit;
                    store = reopen(dir.path(), limit, &model, last);
                }
                Step::Tear(keep, zeros) => {
                    settle(&rt, store, &mut queued);
                    let (seq, _) = log::list_segments(&RealFs, dir.path()).unwrap().pop().unwrap();
                    let path = log::segment_path(dir.path(), seq);
                    let mut change = Vec::new();
                    log::change(&mut change, "never-acked", last + 1, Some(&[7; 2000]));
                    log::append_unfinished(&path, &change, keep, zeros);
                    store = reopen(dir.path(), limit, &model, last);
                }
            }
        }
        settle(&rt, store, &mut queued);
        drop(reopen(dir.path(), DEFAULT_LOG_LIMIT, &model, last));
    }
}
