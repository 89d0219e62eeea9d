//! Semaphores in the disk store: handed to the follower in index order,
//! kept through restarts and checkpoints beside the allocations, refused
//! when damaged (named), and salvaged.

use std::sync::Mutex;

use tempfile::TempDir;

use super::{
    log,
    snapshot::{self, Snapshot, SnapshotWriter},
    *,
};
use crate::{
    lifecycle::{AllocId, Allocation, SemName, Semaphore},
    store::{Change, Follower, Loaded},
};

/// The index a change is decided with, above every other in it (the
/// store stamps its own over it).
const PLACEHOLDER: u64 = u64::MAX;

fn open(dir: &Path, log_limit: u64) -> DiskStore {
    DiskStore::open(DiskStoreConfig {
        max_batch: 64,
        log_limit,
        ..DiskStoreConfig::new(dir.to_owned())
    })
    .unwrap()
}

fn semaphore(name: &str, limit: u32, create_index: u64, modify_index: u64) -> Semaphore {
    Semaphore {
        name: SemName::parse(name).unwrap(),
        limit,
        grant_timeout: Duration::from_secs(30),
        create_index,
        modify_index,
    }
}

/// A new semaphore, as the registry appends it.
fn create(name: &str, limit: u32) -> Op {
    Op::PutSemaphore(Arc::new(semaphore(name, limit, PLACEHOLDER, PLACEHOLDER)))
}

/// A change of the semaphore created at index `created`.
fn change(name: &str, limit: u32, created: u64) -> Op {
    Op::PutSemaphore(Arc::new(semaphore(name, limit, created, PLACEHOLDER)))
}

fn delete(name: &str) -> Op {
    Op::DeleteSemaphore(SemName::parse(name).unwrap())
}

fn alloc(id: &str) -> Op {
    Op::Put(Arc::new(Allocation::register(
        AllocId::parse(id).unwrap(),
        Arc::new(super::tests::spec()),
        PLACEHOLDER,
        time::OffsetDateTime::UNIX_EPOCH,
    )))
}

/// What a follower was handed, one line per change, in order.
#[derive(Default)]
struct Seen(Mutex<Vec<String>>);

impl Follower for Seen {
    fn changed(&self, changes: Vec<Change>, _: u64) {
        let mut seen = self.0.lock().unwrap();
        for c in changes {
            seen.push(match c {
                Change::Put(a) => format!("put {} @{}", a.id, a.modify_index),
                Change::Delete { id, index } => format!("delete {id} @{index}"),
                Change::Liveness(l) => format!("{l:?}"),
                Change::PutSemaphore(s) => format!(
                    "put semaphore {} limit {} @{}/{}",
                    s.name, s.limit, s.create_index, s.modify_index
                ),
                Change::DeleteSemaphore { name, index } => {
                    format!("delete semaphore {name} @{index}")
                }
            });
        }
    }

    fn resync(&self, _: Loaded) {
        panic!("a disk store never lists again");
    }
}

fn follow(store: &DiskStore) -> Arc<Seen> {
    let seen = Arc::new(Seen::default());
    let weak: Weak<dyn Follower> = Arc::downgrade(&(seen.clone() as Arc<dyn Follower>));
    store.follow(0, weak);
    seen
}

async fn commit_all(store: &DiskStore, ops: impl IntoIterator<Item = Op>) {
    for op in ops {
        store.commit(op).await.unwrap();
    }
}

fn alloc_ids(loaded: &Loaded) -> Vec<&str> {
    loaded.allocations.iter().map(|a| a.id.as_str()).collect()
}

/// Every file of `dir` with its bytes.
fn files(dir: &Path) -> Vec<(std::ffi::OsString, Vec<u8>)> {
    let mut all: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name(), std::fs::read(e.path()).unwrap())
        })
        .collect();
    all.sort();
    all
}

/// The keys the snapshot in `dir` holds, in order.
fn snapshot_keys(dir: &Path) -> Vec<String> {
    let mut base = Snapshot::open(&RealFs, dir).unwrap().expect("a snapshot");
    let mut keys = Vec::new();
    snapshot::load(Some(&mut base), &[], |key, _| {
        keys.push(key.to_owned());
        Ok(())
    })
    .unwrap();
    keys
}

/// Created, changed (its `create_index` kept, its `modify_index` the
/// change's), deleted: the follower is handed each in index order with
/// the allocations' changes, and a restart loads what they left, with or
/// without checkpoints folding them on the way (a 1-byte log limit seals
/// and folds after every commit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphores_put_changed_and_deleted_survive_restarts_in_index_order() {
    for log_limit in [1, DEFAULT_LOG_LIMIT] {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path(), log_limit);
        let seen = follow(&store);
        commit_all(
            &store,
            [
                create("db", 2),
                alloc("db"),
                create("gpu", 1),
                change("db", 5, 1),
                delete("gpu"),
            ],
        )
        .await;
        assert_eq!(
            *seen.0.lock().unwrap(),
            [
                "put semaphore db limit 2 @1/1",
                "put db @2",
                "put semaphore gpu limit 1 @3/3",
                "put semaphore db limit 5 @1/4",
                "delete semaphore gpu @5",
            ],
            "{log_limit}"
        );
        store.close().unwrap();
        assert_eq!(
            store.stats().checkpoints > 0,
            log_limit == 1,
            "{:?}",
            store.stats()
        );
        drop(store);

        let store = open(dir.path(), 4096);
        let loaded = store.load().unwrap();
        assert_eq!(loaded.semaphores, [semaphore("db", 5, 1, 4)], "{log_limit}");
        assert_eq!(alloc_ids(&loaded), ["db"]);
        assert_eq!(loaded.last_index, 5, "the deletion's index is remembered");
        // Changed again after the restart: the next index, and kept.
        let seen = follow(&store);
        commit_all(&store, [change("db", 9, 1), create("a", 1)]).await;
        assert_eq!(
            *seen.0.lock().unwrap(),
            [
                "put semaphore db limit 9 @1/6",
                "put semaphore a limit 1 @7/7"
            ]
        );
        store.close().unwrap();
        drop(store);
        let loaded = open(dir.path(), 4096).load().unwrap();
        assert_eq!(
            loaded.semaphores,
            [semaphore("a", 1, 7, 7), semaphore("db", 9, 1, 6)],
            "in name order"
        );
        assert_eq!(loaded.last_index, 7);
    }
}

/// A checkpoint folds semaphores into the snapshot under their own keys,
/// after every allocation (one of them named as a semaphore is), and drops
/// a deleted one; a start, and `read_only`, load each kind into its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_with_allocations_and_semaphores_loads_each_kind_into_its_place() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), DEFAULT_LOG_LIMIT);
    commit_all(
        &store,
        [
            alloc("zz"),
            create("db", 2),
            alloc("db"),
            create("a", 1),
            delete("a"),
            create("zz", 4),
        ],
    )
    .await;
    store.close().unwrap();
    drop(store);
    // Segment 1 folded by hand, as the checkpoint thread does it (the
    // restart started segment 2), then removed: the snapshot alone holds
    // them.
    open(dir.path(), DEFAULT_LOG_LIMIT).close().unwrap();
    let (written, _) = super::checkpoint::checkpoint(&RealFs, dir.path(), 0, 1, None).unwrap();
    assert_eq!(written.records, 4);
    std::fs::remove_file(log::segment_path(dir.path(), 1)).unwrap();
    assert_eq!(snapshot_keys(dir.path()), ["db", "zz", "~s/db", "~s/zz"]);

    let read = read_only(dir.path()).unwrap();
    let loaded = open(dir.path(), DEFAULT_LOG_LIMIT).load().unwrap();
    for l in [&read, &loaded] {
        assert_eq!(alloc_ids(l), ["db", "zz"]);
        assert_eq!(
            l.semaphores,
            [semaphore("db", 2, 2, 2), semaphore("zz", 4, 6, 6)]
        );
        assert_eq!(l.last_index, 6);
    }
}

/// A data directory whose snapshot holds `records` (key, record) and
/// whose log holds `logged` (key, index, record), an append each; and
/// where each append starts.
fn directory(records: &[(&str, &[u8])], logged: &[(&str, u64, &[u8])]) -> (TempDir, Vec<u64>) {
    let dir = tempfile::tempdir().unwrap();
    let mut w = SnapshotWriter::create(&RealFs, dir.path(), 0, 1, log::End::NONE).unwrap();
    for (key, record) in records {
        w.put(key, record).unwrap();
    }
    w.finish().unwrap();
    let mut s =
        log::Segment::create(&RealFs, dir.path(), 1, log::End::NONE, log::WRITE_AHEAD).unwrap();
    super::manifest::write(&RealFs, dir.path(), 1).unwrap();
    let mut starts = Vec::new();
    for (key, index, record) in logged {
        starts.push(s.len);
        s.append(&mut log::one_append(key, *index, Some(record)))
            .unwrap();
    }
    std::fs::write(dir.path().join(LOCK_FILE), b"").unwrap();
    (dir, starts)
}

/// A semaphore record that does not read back (in the snapshot, or in
/// the log, or one under another semaphore's key) stops the start, which
/// names the semaphore and where it lies, and changes nothing; `dump`
/// refuses it alike.
#[test]
fn a_damaged_semaphore_record_stops_the_open_naming_it() {
    let good = record::encode_semaphore(&semaphore("db", 2, 1, 1));
    let bad = {
        let mut bytes = good.clone();
        // The limit (after the version, the name's length and "db"): 0.
        bytes[4] = 0;
        bytes
    };
    let other = record::encode_semaphore(&semaphore("gpu", 2, 1, 1));
    let refused = |dir: &Path| {
        let before = files(dir);
        let err = DiskStore::open(DiskStoreConfig::new(dir.to_owned()))
            .err()
            .expect("refused")
            .to_string();
        assert_eq!(files(dir), before, "nothing changed");
        assert_eq!(read_only(dir).err().unwrap().to_string(), err);
        err
    };
    let unreadable = "the record of semaphore \"db\" is unreadable: limit 0 is outside 1 to 10000";

    // In the snapshot.
    for (record, why) in [
        (&bad, unreadable),
        (
            &other,
            "the record under \"~s/db\" is for semaphore \"gpu\"",
        ),
    ] {
        let (dir, _) = directory(&[("~s/db", record)], &[]);
        let err = refused(dir.path());
        assert!(err.contains(why), "{err}");
        assert!(err.contains(SNAPSHOT_FILE), "{err}");
    }

    // In the log, over a good version of it in the snapshot.
    let (dir, starts) = directory(
        &[("~s/db", &good)],
        &[("~s/gpu", 2, &other), ("~s/db", 3, &bad)],
    );
    let err = refused(dir.path());
    let segment = log::segment_path(dir.path(), 1).display().to_string();
    assert!(err.contains(&segment), "{err}");
    assert!(
        err.contains(&format!(
            "in the append at byte {}, {unreadable}",
            starts[1]
        )),
        "{err}"
    );
    assert!(!err.contains(SNAPSHOT_FILE), "{err}");

    // The same records, good: they load.
    let (dir, _) = directory(&[("~s/db", &good)], &[("~s/gpu", 2, &other)]);
    let loaded = open(dir.path(), DEFAULT_LOG_LIMIT).load().unwrap();
    assert_eq!(
        loaded.semaphores,
        [semaphore("db", 2, 1, 1), semaphore("gpu", 2, 1, 1)]
    );
}

/// Where each append of a segment starts (after its 32-byte header), up
/// to the zeros written ahead.
fn appends(bytes: &[u8]) -> Vec<usize> {
    let (mut at, mut starts) = (32, Vec::new());
    while at + 12 <= bytes.len() {
        let len = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        if len == 0 {
            break;
        }
        starts.push(at);
        at += 12 + len;
    }
    starts
}

/// Salvage copies semaphores (from the snapshot and the log, the newest
/// version of each by index, a deletion included) into the new
/// directory; with an append lost after them, it names each whose last
/// index it cannot prove.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salvage_copies_semaphores_and_names_those_it_cannot_prove() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), DEFAULT_LOG_LIMIT);
    commit_all(&store, [create("db", 2), create("old", 1), alloc("x")]).await;
    store.close().unwrap();
    drop(store);
    // Segment 1 into the snapshot; what follows in segment 2.
    open(dir.path(), DEFAULT_LOG_LIMIT).close().unwrap();
    super::checkpoint::checkpoint(&RealFs, dir.path(), 0, 1, None).unwrap();
    std::fs::remove_file(log::segment_path(dir.path(), 1)).unwrap();
    let store = open(dir.path(), DEFAULT_LOG_LIMIT);
    commit_all(
        &store,
        [
            change("db", 7, 1),
            delete("old"),
            create("gpu", 3),
            alloc("y"),
        ],
    )
    .await;
    store.close().unwrap();
    drop(store);

    let out = tempfile::tempdir().unwrap();
    let report = super::salvage(dir.path(), &out.path().join("whole")).unwrap();
    assert!(report.whole(), "{report:?}");
    assert_eq!((report.allocations, report.semaphores), (2, 2));
    let loaded = open(&out.path().join("whole"), DEFAULT_LOG_LIMIT)
        .load()
        .unwrap();
    assert_eq!(
        loaded.semaphores,
        [semaphore("db", 7, 1, 4), semaphore("gpu", 3, 6, 6)]
    );
    assert_eq!(alloc_ids(&loaded), ["x", "y"]);

    // The last append (y's registration) damaged: whatever came before it
    // may have been followed by a lost change.
    let (_, newest) = log::list_segments(&RealFs, dir.path())
        .unwrap()
        .pop()
        .unwrap();
    let mut bytes = std::fs::read(&newest).unwrap();
    let last = *appends(&bytes).last().unwrap();
    bytes[last + 12 + 20] ^= 0x10;
    std::fs::write(&newest, bytes).unwrap();
    let report = super::salvage(dir.path(), &out.path().join("damaged")).unwrap();
    let unproven = &report.unproven;
    assert!(
        unproven.contains(
            &"semaphore \"db\": salvaged at index 4, but what was lost after it may have \
              held newer changes"
                .to_owned()
        ),
        "{unproven:?}"
    );
    assert!(
        unproven.contains(
            &"semaphore \"old\": deleted at index 5, but what was lost after it may have \
              created it again"
                .to_owned()
        ),
        "{unproven:?}"
    );
    assert!(
        unproven
            .iter()
            .any(|l| l.starts_with("semaphore \"gpu\": salvaged at index 6")),
        "{unproven:?}"
    );
    assert_eq!((report.allocations, report.semaphores), (1, 2));
    let loaded = open(&out.path().join("damaged"), DEFAULT_LOG_LIMIT)
        .load()
        .unwrap();
    assert_eq!(
        loaded.semaphores,
        [semaphore("db", 7, 1, 4), semaphore("gpu", 3, 6, 6)]
    );
}
