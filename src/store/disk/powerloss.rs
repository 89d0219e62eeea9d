//! Power loss, simulated: the disk store runs on `fs::sim::SimFs`, which
//! crashes at a random operation — dropping every write, create, rename
//! and unlink that no fsync made durable, and tearing unsynced appends at a
//! random byte (their end perhaps zeros) — and recovery must then start,
//! and hold every acknowledged change. A second crash may strike during
//! that recovery (its repairs must be crash-safe too).
//!
//! Also here: the store's answers to a disk that fails — ENOSPC and EIO on
//! fsync, a read-only directory — through the same seam, where neither a
//! root user nor tmpfs would let a test make them happen.

use std::{
    collections::BTreeMap,
    io,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use proptest::prelude::*;

use super::{
    Commit, DiskStore, DiskStoreConfig,
    fs::{
        Fs,
        sim::{self, SimFs},
    },
    tests::spec,
};
use crate::{
    lifecycle::{AllocId, Allocation},
    store::{Op, Store, StoreError, StoreHealth},
};

fn dir() -> PathBuf {
    PathBuf::from("/sim/data")
}

fn open(fs: &SimFs, log_limit: u64) -> Result<DiskStore, StoreError> {
    DiskStore::open(DiskStoreConfig {
        max_batch: 16,
        log_limit,
        retry: Duration::from_millis(1),
        fs: Arc::new(fs.clone()),
        // Crossed often: appends into zeros, and appends that write more.
        write_ahead: 2048,
        ..DiskStoreConfig::new(dir())
    })
}

/// What one key may hold after a crash: the last acknowledged value (its
/// index; `None` for deleted or never written), or one written after it
/// whose commit had not answered.
#[derive(Clone, Debug, Default)]
struct Key {
    acked: Option<u64>,
    maybe: Vec<Option<u64>>,
}

/// One step: a put (of `size` detail bytes) or a deletion of key `key`.
#[derive(Clone, Debug)]
struct Step {
    key: u8,
    put: bool,
    size: usize,
}

fn step() -> impl Strategy<Value = Step> {
    (0..6u8, prop::bool::weighted(0.8), 0..600usize).prop_map(|(key, put, size)| Step {
        key,
        put,
        size,
    })
}

fn alloc(key: u8, index: u64, size: usize) -> Allocation {
    sized_alloc(&format!("key-{key}"), index, size)
}

/// Allocation `id` at `index` whose record carries `size` bytes of event
/// message.
pub(super) fn sized_alloc(id: &str, index: u64, size: usize) -> Allocation {
    let id = AllocId::parse(id).unwrap();
    let mut a = Allocation::register(
        id,
        Arc::new(spec()),
        index,
        time::OffsetDateTime::UNIX_EPOCH,
    );
    // Records of different sizes, so appends cross sector boundaries.
    let report = crate::lifecycle::TaskReport {
        state: crate::lifecycle::RunState::Running,
        failed: false,
        event: Some(crate::lifecycle::EventInput {
            kind: "Started".into(),
            time: None,
            message: "x".repeat(size),
            details: Default::default(),
        }),
        ready: None,
    };
    if let Some(next) = a.report(&[(0, report)], time::OffsetDateTime::UNIX_EPOCH, || index) {
        a = next;
    }
    a.modify_index = index;
    a
}

/// Runs `steps` against a store on `fs` (at most three commits in flight,
/// on distinct keys) until the first failed commit; returns what each key
/// may hold.
fn drive(fs: &SimFs, log_limit: u64, steps: &[Step]) -> (BTreeMap<u8, Key>, u64) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut keys: BTreeMap<u8, Key> = BTreeMap::new();
    // The crash may come while it opens: then nothing was acknowledged.
    let Ok(store) = open(fs, log_limit) else {
        return (keys, 0);
    };
    let mut index = 0;
    let mut acked_index = 0;
    'run: for chunk in steps.chunks(3) {
        let mut flight: Vec<(u8, Option<u64>, u64, Commit)> = Vec::new();
        for s in chunk {
            if flight.iter().any(|(k, _, _, _)| *k == s.key) {
                continue;
            }
            index += 1;
            let (value, op) = if s.put {
                (Some(index), Op::Put(Arc::new(alloc(s.key, index, s.size))))
            } else {
                let id = AllocId::parse(&format!("key-{}", s.key)).unwrap();
                (None, Op::Delete(id))
            };
            keys.entry(s.key).or_default().maybe.push(value);
            flight.push((s.key, value, index, store.commit(op)));
        }
        let mut failed = false;
        for (key, value, its_index, commit) in flight {
            if rt.block_on(commit).is_ok() {
                let k = keys.get_mut(&key).unwrap();
                k.acked = value;
                k.maybe.clear();
                acked_index = acked_index.max(its_index);
            } else {
                failed = true;
            }
        }
        if failed {
            break 'run;
        }
    }
    drop(store);
    (keys, acked_index)
}

/// Checks a recovered store against what each key may hold.
fn check(store: &DiskStore, keys: &BTreeMap<u8, Key>, acked_index: u64) -> Result<(), String> {
    let loaded = store.load().map_err(|e| e.to_string())?;
    let got: BTreeMap<String, u64> = loaded
        .allocations
        .iter()
        .map(|a| (a.id.to_string(), a.modify_index))
        .collect();
    for (key, k) in keys {
        let name = format!("key-{key}");
        let found = got.get(&name).copied();
        if found != k.acked && !k.maybe.contains(&found) {
            return Err(format!(
                "{name}: recovered {found:?}; acknowledged {:?}, in flight {:?}",
                k.acked, k.maybe
            ));
        }
    }
    if let Some(stray) = got
        .keys()
        .find(|n| !keys.keys().any(|k| format!("key-{k}") == **n))
    {
        return Err(format!("{stray} was never written"));
    }
    if loaded.last_index < acked_index {
        return Err(format!(
            "the index went back: {} < {acked_index}",
            loaded.last_index
        ));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("TASKGATE_POWERLOSS_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(64)
    ))]

    /// A crash at any operation, a torn last write, maybe a second crash
    /// during the recovery: the store starts, and holds every acknowledged
    /// change (or a newer one whose commit had not answered), nothing that
    /// was never written, and an index that never goes back.
    #[test]
    fn a_power_loss_at_any_moment_keeps_every_acknowledged_change(
        steps in prop::collection::vec(step(), 1..60),
        crash_at in 1..3000u64,
        second in prop::option::weighted(0.3, 1..200u64),
        log_limit in prop::sample::select(vec![200u64, 2048, 1 << 26]),
        seed in any::<u64>(),
        cut in prop::option::weighted(0.5, any::<prop::sample::Index>()),
    ) {
        let fs = SimFs::new();
        fs.create_dir_all(&dir()).unwrap();
        // The first crash comes during the workload, or right after it.
        fs.crash_after(crash_at, seed);
        let (keys, acked_index) = drive(&fs, log_limit, &steps);
        fs.crash_now(seed);
        let mut image = fs.image().unwrap();
        if let Some(n) = second {
            let during = SimFs::from_image(&image);
            during.crash_after(n, seed ^ 1);
            if let Ok(store) = open(&during, log_limit) {
                drop(store);
            }
            during.crash_now(seed ^ 1);
            image = during.image().unwrap();
        }
        let after = SimFs::from_image(&image);
        let store = open(&after, log_limit)
            .map_err(|e| TestCaseError::fail(format!("recovery refused to start: {e}")))?;
        check(&store, &keys, acked_index).map_err(TestCaseError::fail)?;
        if let Some(cut) = cut {
            drop(store);
            cut_a_sealed_segment(&after, log_limit, cut)?;
        }
    }
}

/// Then damage no crash can cause, on what the recovery left: a sealed
/// segment cut at one of its frame boundaries (its last appends gone, the
/// segment after it intact). Nothing in the segment itself looks wrong;
/// the next one's header says where it ended, so the start is refused,
/// naming the segment, and changes nothing.
fn cut_a_sealed_segment(
    fs: &SimFs,
    log_limit: u64,
    pick: prop::sample::Index,
) -> Result<(), TestCaseError> {
    fs.crash_now(0);
    let mut image = fs.image().unwrap();
    let segments: Vec<PathBuf> = image
        .files
        .keys()
        .filter(|p| p.to_string_lossy().contains("taskgate.wal.0"))
        .filter(|p| !p.to_string_lossy().ends_with(super::log::BROKEN_SUFFIX))
        .cloned()
        .collect();
    // Every (segment, boundary) at which a cut loses at least one append.
    let cuts: Vec<(PathBuf, usize)> = segments[..segments.len().saturating_sub(1)]
        .iter()
        .flat_map(|path| {
            let starts = super::log::frame_starts(&image.files[path]);
            starts.into_iter().map(move |at| (path.clone(), at))
        })
        .collect();
    if cuts.is_empty() {
        return Ok(());
    }
    let (path, at) = pick.get(&cuts).clone();
    image.files.get_mut(&path).unwrap().truncate(at);
    let damaged = SimFs::from_image(&image);
    let err = match open(&damaged, log_limit) {
        Ok(_) => {
            return Err(TestCaseError::fail(format!(
                "{} cut at byte {at}: the store started",
                path.display()
            )));
        }
        Err(e) => e.to_string(),
    };
    let named = err.contains(&path.display().to_string()) && err.contains(&format!("byte {at}"));
    prop_assert!(named, "{err}");
    damaged.crash_now(0);
    prop_assert_eq!(
        damaged.image().unwrap().files,
        image.files,
        "nothing changed"
    );
    Ok(())
}

/// Commits `n` puts, one at a time, on keys `first..`; returns the results.
fn commit_puts(store: &DiskStore, first: u8, n: u8) -> Vec<Result<(), StoreError>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    (first..first + n)
        .map(|k| rt.block_on(store.commit(Op::Put(Arc::new(alloc(k, u64::from(k) + 1, 10))))))
        .collect()
}

/// A crash in the middle of an append of many changes (one frame of
/// several sectors), over many seeds: the disk kept a prefix of it with
/// its end lost, or any of its sectors, later ones without earlier ones.
/// Every start is a start (the tail is torn, not damage), with every
/// acknowledged change.
#[test]
fn a_crash_mid_append_with_its_sectors_lost_in_any_order_is_a_torn_tail() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut out_of_order = 0;
    for seed in 0..120 {
        let fs = SimFs::new();
        fs.create_dir_all(&dir()).unwrap();
        let store = open(&fs, 1 << 26).unwrap();
        assert!(commit_puts(&store, 0, 3).iter().all(Result::is_ok));
        // Its fsync never returns: the machine dies in it. (The append
        // reaches the end of the zeros written ahead: the first fsync,
        // of the zeros it writes first, goes through.)
        let mut syncs = 0;
        fs.fail_with(move |op, path: &Path| {
            let log = path.to_string_lossy().contains("taskgate.wal.");
            if op != sim::Op::SyncData || !log {
                return None;
            }
            syncs += 1;
            (syncs > 1).then(|| io::Error::from_raw_os_error(5))
        });
        // Records of ~3 KB: whatever the writer takes in its first
        // append spans several sectors.
        let batch: Vec<_> = (3..9u8)
            .map(|k| store.commit(Op::Put(Arc::new(alloc(k, u64::from(k) + 1, 3000)))))
            .collect();
        for c in batch {
            assert!(rt.block_on(c).is_err());
        }
        drop(store);
        fs.crash_now(seed);
        let image = fs.image().unwrap();
        let (_, log) = image
            .files
            .iter()
            .rfind(|(p, _)| p.to_string_lossy().contains("taskgate.wal."))
            .unwrap();
        let zero_sectors: Vec<bool> = log.chunks(512).map(|c| c.iter().all(|&b| b == 0)).collect();
        if zero_sectors.windows(2).any(|w| w[0] && !w[1]) {
            out_of_order += 1;
        }
        let after = SimFs::from_image(&image);
        let store = open(&after, 1 << 26).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        let ids = store.loaded_ids();
        assert_eq!(ids[..3], ["key-0", "key-1", "key-2"], "seed {seed}");
    }
    assert!(
        out_of_order > 10,
        "{out_of_order} seeds lost sectors out of order"
    );
}

fn enospc() -> io::Error {
    io::Error::from_raw_os_error(28)
}

/// ENOSPC or EIO on the log's fsync: the change is refused, the store takes
/// no more (what reached the disk is unknown), health says so; the
/// changes acknowledged before survive, and a restart recovers.
#[test]
fn a_failed_fsync_of_the_log_stops_writes_until_a_restart() {
    for error in [enospc as fn() -> io::Error, || {
        io::Error::from_raw_os_error(5)
    }] {
        let fs = SimFs::new();
        fs.create_dir_all(&dir()).unwrap();
        let store = open(&fs, 1 << 26).unwrap();
        assert!(commit_puts(&store, 0, 3).iter().all(Result::is_ok));
        let fail = error;
        fs.fail_with(move |op, path: &Path| {
            let log = path.to_string_lossy().contains("taskgate.wal.");
            (op == sim::Op::SyncData && log).then(fail)
        });
        let refused = commit_puts(&store, 3, 2);
        assert!(refused.iter().all(Result::is_err), "{refused:?}");
        assert!(
            matches!(
                store.health(),
                StoreHealth::Refusing {
                    code: "write_failed",
                    ..
                }
            ),
            "{:?}",
            store.health()
        );
        fs.heal();
        assert!(commit_puts(&store, 5, 1)[0].is_err(), "not until a restart");
        drop(store);
        fs.crash_now(3);
        let after = SimFs::from_image(&fs.image().unwrap());
        let store = open(&after, 1 << 26).unwrap();
        let ids = store.loaded_ids();
        assert!(
            ids.starts_with(&["key-0".into(), "key-1".into(), "key-2".into()]),
            "{ids:?}"
        );
    }
}

/// The zeros written ahead of the appends cannot be written (the disk is
/// nearly full): the append that needed them fails, and so does every
/// one after it until a restart (without them, a crash could leave the
/// newest segment shorter than a start holds it to). A crash then loses
/// nothing acknowledged and the start is not refused.
#[test]
fn zeros_that_cannot_be_written_ahead_fail_the_append_and_lose_nothing() {
    let fs = SimFs::new();
    fs.create_dir_all(&dir()).unwrap();
    let store = open(&fs, 1 << 26).unwrap();
    assert!(commit_puts(&store, 0, 3).iter().all(Result::is_ok));
    // 120 appends of ~110 bytes pass the 2 KiB written ahead (in this
    // file's stores) a few times.
    let failed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = failed.clone();
    // An append that writes ahead seeks to the end of the zeros, writes
    // them, seeks back and writes its frame; one that does not only
    // writes its frame. The write right after a commit's first seek (a
    // seek is a `Read` here) is the zeros'.
    let mut seeks = 0;
    fs.fail_with(move |op, path: &Path| {
        if !path.to_string_lossy().contains("taskgate.wal.") {
            return None;
        }
        match op {
            sim::Op::Read => seeks += 1,
            sim::Op::Write if seeks == 1 => {
                seeks += 1;
                seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                return Some(enospc());
            }
            sim::Op::SyncData => seeks = 0,
            _ => {}
        }
        None
    });
    let done = commit_puts(&store, 3, 120);
    assert_eq!(failed.load(std::sync::atomic::Ordering::SeqCst), 1);
    let acked = done.iter().take_while(|r| r.is_ok()).count();
    assert!(acked < done.len(), "{done:?}");
    assert!(done[acked..].iter().all(Result::is_err), "{done:?}");
    assert!(
        !matches!(store.health(), StoreHealth::Ok),
        "{:?}",
        store.health()
    );
    drop(store);
    fs.crash_now(5);
    let after = SimFs::from_image(&fs.image().unwrap());
    let store = open(&after, 1 << 26).unwrap();
    assert_eq!(store.load().unwrap().allocations.len(), 3 + acked);
}

/// A directory that becomes read-only (EROFS on every create and rename),
/// or a disk that fills up under the checkpoint: writes go on in the
/// current segment while the store reports itself degraded, and once the
/// directory takes writes again, the rollover and the checkpoint happen.
#[test]
fn a_read_only_directory_or_a_full_disk_degrades_the_store_until_it_mends() {
    for (what, fault) in [
        (
            "read-only",
            Box::new(|op: sim::Op, _: &Path| {
                matches!(
                    op,
                    sim::Op::Open(super::fs::Open::Truncate | super::fs::Open::CreateNew)
                        | sim::Op::Rename
                )
                .then(|| io::Error::from_raw_os_error(30))
            }) as Box<dyn FnMut(sim::Op, &Path) -> Option<io::Error> + Send>,
        ),
        (
            "full",
            Box::new(|op: sim::Op, path: &Path| {
                let snapshot = path.to_string_lossy().contains("snapshot");
                (op == sim::Op::Write && snapshot).then(enospc)
            }),
        ),
    ] {
        let fs = SimFs::new();
        fs.create_dir_all(&dir()).unwrap();
        let store = open(&fs, 200).unwrap();
        let mut fault = Some(fault);
        fs.fail_with(move |op, path| fault.as_mut().and_then(|f| f(op, path)));
        let results = commit_puts(&store, 0, 40);
        assert!(
            results.iter().all(Result::is_ok),
            "{what}: writes go on: {results:?}"
        );
        let degraded = (0..10_000).any(|_| {
            std::thread::sleep(Duration::from_millis(1));
            matches!(store.health(), StoreHealth::Degraded(_))
        });
        assert!(degraded, "{what}: {:?}", store.health());
        fs.heal();
        let mended = (0..10_000).any(|_| {
            std::thread::sleep(Duration::from_millis(1));
            store.health() == StoreHealth::Ok && store.stats().checkpoints > 0
        });
        assert!(mended, "{what}: {:?} {:?}", store.health(), store.stats());
        assert!(commit_puts(&store, 40, 5).iter().all(Result::is_ok));
        drop(store);
        fs.crash_now(1);
        let after = SimFs::from_image(&fs.image().unwrap());
        let loaded = open(&after, 200).unwrap().load().unwrap();
        assert_eq!(loaded.allocations.len(), 45, "{what}");
    }
}

/// Stray files a crash can leave — a segment being created, a snapshot
/// being written, a cut tail kept aside — never stop a start or count as
/// data; the unfinished ones are removed.
#[test]
fn stray_temporary_files_are_removed_or_left_alone() {
    let fs = SimFs::new();
    fs.create_dir_all(&dir()).unwrap();
    let store = open(&fs, 1 << 26).unwrap();
    assert!(commit_puts(&store, 0, 3).iter().all(Result::is_ok));
    drop(store);
    let stray = [
        (super::log::SEGMENT_TEMP, true),
        (super::snapshot::NEXT_FILE, true),
        ("taskgate.wal.00000000000000000001.broken", false),
    ];
    for (name, _) in stray {
        fs.put(&dir().join(name), b"half-written".to_vec());
    }
    let store = open(&fs, 1 << 26).unwrap();
    assert_eq!(store.load().unwrap().allocations.len(), 3);
    for (name, removed) in stray {
        assert_eq!(!fs.exists(&dir().join(name)), removed, "{name}");
    }
}

/// The writer's queue is bounded: with the disk stalled in an fsync, the
/// change one past the queue's size (changes admitted and not yet
/// answered, the stalled one included) is refused at once, before it is
/// decided (503 `store_unavailable` at the HTTP edge) instead of memory
/// growing; the queued ones commit once the disk goes on.
#[test]
fn a_full_commit_queue_refuses_the_next_change_instead_of_growing() {
    let fs = SimFs::new();
    fs.create_dir_all(&dir()).unwrap();
    let store = DiskStore::open(DiskStoreConfig {
        max_batch: 1,
        commit_queue: 4,
        fs: Arc::new(fs.clone()),
        ..DiskStoreConfig::new(dir())
    })
    .unwrap();
    let (stalled_tx, stalled) = std::sync::mpsc::channel();
    let (go, gate) = std::sync::mpsc::channel::<()>();
    let gate = std::sync::Mutex::new(gate);
    fs.fail_with(move |op, _| {
        if op == sim::Op::SyncData {
            let _ = stalled_tx.send(());
            let _ = gate.lock().unwrap().recv();
        }
        None
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let put = |k: u8| store.commit(Op::Put(Arc::new(alloc(k, u64::from(k) + 1, 10))));
    // The first change is taken by the writer, which stalls in its fsync.
    let first = put(0);
    stalled.recv().unwrap();
    let queued: Vec<_> = (1..=3).map(put).collect();
    // Refused at once: ready on its first poll, not queued behind the
    // stalled disk.
    let mut fifth = put(4);
    let refused = fifth
        .as_mut()
        .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()));
    assert!(
        matches!(&refused, std::task::Poll::Ready(Err(StoreError::Unavailable(why))) if why.contains("queue is full")),
        "{refused:?}"
    );
    // The disk goes on (the hook runs under the file system's lock, so it
    // is released first, not replaced).
    drop(go);
    rt.block_on(first).unwrap();
    for q in queued {
        rt.block_on(q).unwrap();
    }
}

/// Sealing a segment fails (its `set_len`, or its `sync_all` after
/// the cut), the writer goes on appending to it (a failed rollover), then
/// the machine crashes at a random later moment: every acknowledged
/// change is there.
#[test]
fn a_failed_seal_then_more_appends_then_a_crash_keeps_every_acknowledged_change() {
    for seed in 0..200u64 {
        let fs = SimFs::new();
        fs.create_dir_all(&dir()).unwrap();
        let store = open(&fs, 300).unwrap();
        let op = if seed % 2 == 0 {
            sim::Op::SyncAll
        } else {
            sim::Op::SetLen
        };
        let mut left = 1 + seed % 3;
        fs.fail_with(move |o, path: &Path| {
            let p = path.to_string_lossy();
            if o == op && p.contains("taskgate.wal.0") && left > 0 {
                left -= 1;
                return Some(io::Error::from_raw_os_error(5));
            }
            None
        });
        fs.crash_after(20 + seed * 7 % 400, seed);
        let done = commit_puts(&store, 0, 60);
        fs.crash_now(seed);
        drop(store);
        let after = SimFs::from_image(&fs.image().unwrap());
        let store = open(&after, 300).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        let got: BTreeMap<String, u64> = store
            .load()
            .unwrap()
            .allocations
            .iter()
            .map(|a| (a.id.to_string(), a.modify_index))
            .collect();
        for (k, r) in done.iter().enumerate() {
            if r.is_ok() {
                assert_eq!(
                    got.get(&format!("key-{k}")),
                    Some(&(k as u64 + 1)),
                    "seed {seed}: key-{k} acknowledged"
                );
            }
        }
    }
}

/// A rollover whose new segment was renamed into place but whose directory
/// sync failed (having made the name durable all the same), and whose
/// removal failed too: the writer goes on appending to the segment before
/// it, and the unused segment stays. After a crash, the start removes the
/// unused segment and holds every acknowledged change: it is not taken for
/// damage, though its header says the log before it ended where the writer
/// had sealed it.
#[test]
fn a_rollover_whose_directory_sync_failed_then_a_crash_keeps_every_acknowledged_change() {
    for seed in 0..20u64 {
        let fs = SimFs::new();
        fs.create_dir_all(&dir()).unwrap();
        let store = open(&fs, 300).unwrap();
        // From the first rename of a new segment into place on: every
        // directory sync fails, every rename of a new segment after it (a
        // try again), and every removal of a segment.
        let mut renamed = false;
        fs.fail_with(move |o, path: &Path| {
            let eio = || Some(io::Error::from_raw_os_error(5));
            let p = path.to_string_lossy();
            match o {
                sim::Op::Rename if p.ends_with(super::log::SEGMENT_TEMP) && renamed => eio(),
                sim::Op::Rename if p.ends_with(super::log::SEGMENT_TEMP) => {
                    renamed = true;
                    None
                }
                sim::Op::SyncDir if renamed => eio(),
                sim::Op::Remove if renamed && p.contains("taskgate.wal.0") => eio(),
                _ => None,
            }
        });
        let mut done = Vec::new();
        let mut k = 0;
        while store.stats().failed_rollovers == 0 {
            assert!(k < 200, "no rollover failed");
            done.extend(commit_puts(&store, k, 1));
            k += 1;
        }
        // The failed sync made the new segment's name durable.
        fs.persist_names();
        done.extend(commit_puts(&store, k, 10 + (seed % 10) as u8));
        fs.crash_now(seed);
        drop(store);
        let after = SimFs::from_image(&fs.image().unwrap());
        let store = open(&after, 300).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        let got: BTreeMap<String, u64> = store
            .load()
            .unwrap()
            .allocations
            .iter()
            .map(|a| (a.id.to_string(), a.modify_index))
            .collect();
        assert!(done.iter().all(Result::is_ok), "seed {seed}");
        for k in 0..done.len() {
            assert_eq!(
                got.get(&format!("key-{k}")),
                Some(&(k as u64 + 1)),
                "seed {seed}: key-{k} acknowledged"
            );
        }
    }
}
