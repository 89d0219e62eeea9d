//! The disk store as a whole: reopens, checkpoints, damage, salvage,
//! failing checkpoints and rollovers.

use std::time::Instant;

use super::{
    log,
    snapshot::{self, NEXT_FILE, OLD_FILE, Snapshot},
    writer::{RETRY_FIRST, Trouble},
    *,
};
use crate::{
    lifecycle::{AllocId, AllocSpec, Allocation, Limits, TaskName, TaskSpec},
    registry::{Registry, RegistryConfig},
    store::StoreHealth,
};

fn config(dir: &Path, max_batch: usize, log_limit: u64) -> DiskStoreConfig {
    DiskStoreConfig {
        max_batch,
        log_limit,
        ..DiskStoreConfig::new(dir.to_owned())
    }
}

fn open(dir: &Path, max_batch: usize) -> DiskStore {
    open_with(dir, max_batch, DEFAULT_LOG_LIMIT)
}

fn open_with(dir: &Path, max_batch: usize, log_limit: u64) -> DiskStore {
    DiskStore::open(config(dir, max_batch, log_limit)).unwrap()
}

pub(super) fn spec() -> AllocSpec {
    let task = TaskSpec {
        name: TaskName::parse("web").unwrap(),
        lifecycle: None,
        leader: false,
        readiness: false,
        liveness: None,
        depends_on: Vec::new(),
        acquire: Vec::new(),
        barrier: None,
    };
    AllocSpec::new(vec![task], &Limits::default()).unwrap()
}

/// Registers `ids` concurrently on a store opened with `log_limit`,
/// then closes it. Returns the registry's view of `ids` and its stats.
async fn register(
    dir: &Path,
    log_limit: u64,
    ids: &[String],
) -> (Vec<Arc<Allocation>>, u64, StoreStats) {
    register_with(dir, log_limit, ids, true).await
}

/// `register`, all at once (sharing appends) or one after the other (an
/// append each).
async fn register_with(
    dir: &Path,
    log_limit: u64,
    ids: &[String],
    at_once: bool,
) -> (Vec<Arc<Allocation>>, u64, StoreStats) {
    let store = Arc::new(open_with(dir, 64, log_limit));
    let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
    let mut tasks = Vec::new();
    for id in ids {
        let (r, id) = (r.clone(), AllocId::parse(id).unwrap());
        let task = tokio::spawn(async move { r.register(id, spec()).await.unwrap() });
        if at_once {
            tasks.push(task);
        } else {
            task.await.unwrap();
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    let views = ids.iter().map(|id| r.get(id).unwrap()).collect();
    let last = r.last_index();
    drop(r);
    store.close().unwrap();
    (views, last, store.stats())
}

fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

fn segments(dir: &Path) -> Vec<(u64, u64)> {
    log::list_segments(&RealFs, dir)
        .unwrap()
        .into_iter()
        .map(|(seq, path)| (seq, std::fs::metadata(path).unwrap().len()))
        .collect()
}

/// Leaves in segment `path` what a crash in an append of a 2 KB change
/// may: its first sectors, in the zeros written ahead; returns them.
fn torn_append(path: &Path) -> Vec<u8> {
    let seq = log::list_segments(&RealFs, path.parent().unwrap())
        .unwrap()
        .into_iter()
        .find(|(_, p)| p == path)
        .unwrap()
        .0;
    let len = valid_end(path, seq) as usize;
    let mut change = Vec::new();
    log::change(&mut change, "torn", 1 << 40, Some(&[7; 2000]));
    log::append_unfinished(path, &change, 1000, 0);
    let bytes = std::fs::read(path).unwrap();
    let kept = &bytes[len..];
    kept[..kept.iter().rposition(|&b| b != 0).unwrap() + 1].to_vec()
}

/// Where segment `seq`'s last good frame ends.
fn valid_end(path: &Path, seq: u64) -> u64 {
    log::replay_with(&std::fs::read(path).unwrap(), seq, |_, _, _| {})
        .unwrap()
        .valid_len
}

/// Where each frame of a segment starts (after its 32-byte header).
fn log_appends(bytes: &[u8]) -> Vec<usize> {
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

/// Records, last index and last folded segment of the snapshot.
fn snapshot_facts(dir: &Path) -> (u64, u64, u64) {
    let s = Snapshot::open(&RealFs, dir).unwrap().expect("a snapshot");
    (s.records(), s.last_index, s.folded)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_changes_survive_a_reopen_exactly() {
    // 1 byte: every commit seals a segment and checkpoints it; 1 KiB:
    // some do; the default: none, the reopen replays the log alone.
    for log_limit in [1, 1024, DEFAULT_LOG_LIMIT] {
        let dir = tempfile::tempdir().unwrap();
        let (views, _, stats) = register(dir.path(), log_limit, &ids("a", 50)).await;
        assert_eq!(stats.changes, 50, "{log_limit}");
        assert_eq!(
            stats.checkpoints > 0,
            log_limit < DEFAULT_LOG_LIMIT,
            "{stats:?}"
        );
        let (kept, last) = {
            let store = Arc::new(open_with(dir.path(), 64, log_limit));
            let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
            r.delete("a7").await.unwrap();
            let last = r.last_index();
            drop(r);
            store.close().unwrap();
            (views[3].clone(), last)
        };
        // Reopened with another limit: the history carries over.
        let store = Arc::new(open_with(dir.path(), 64, 4096));
        let r = Registry::open(store, RegistryConfig::default()).unwrap();
        assert_eq!(r.len(), 49, "{log_limit}");
        assert!(r.get("a7").is_err(), "the deletion is durable");
        assert_eq!(*r.get("a3").unwrap(), *kept);
        assert_eq!(r.last_index(), last, "the deletion's index is remembered");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_folds_the_log_into_the_snapshot_and_removes_its_segments() {
    let dir = tempfile::tempdir().unwrap();
    let (_, last, stats) = register(dir.path(), 1, &ids("a", 40)).await;
    assert!(stats.checkpoints > 0, "{stats:?}");
    // A commit made while a checkpoint runs stays in the log until the
    // next one (the close does not wait for it): what is left is the
    // segments after the last checkpoint, and nothing else.
    let left = segments(dir.path());
    let (records, last_index, folded) = snapshot_facts(dir.path());
    assert_eq!(
        folded,
        left[0].0 - 1,
        "the snapshot knows how far it folded: {left:?}"
    );
    assert_eq!(stats.folded, records, "each record folded once: {stats:?}");
    let mut unfolded = 0;
    let mut index = last_index;
    for (seq, _) in &left {
        let bytes = std::fs::read(log::segment_path(dir.path(), *seq)).unwrap();
        let replayed = log::replay_with(&bytes, *seq, |_, i, _| {
            unfolded += 1;
            index = index.max(i);
        })
        .unwrap();
        assert!(replayed.bad.is_none(), "{seq}: {:?}", replayed.bad);
    }
    assert_eq!(records + unfolded, 40, "{records} folded, {unfolded} not");
    assert_eq!(index, last);
    assert!(
        !dir.path().join(OLD_FILE).exists(),
        "the replaced snapshot is removed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_name_a_stopped_checkpoint_left_stays_until_the_next_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (views, _, _) = register(dir.path(), 1, &ids("a", 20)).await;
    let current = dir.path().join(SNAPSHOT_FILE);
    let bytes = std::fs::read(&current).unwrap();
    // Stopped between linking the snapshot it was replacing and the
    // rename: the current snapshot has a second name.
    std::fs::hard_link(&current, dir.path().join(OLD_FILE)).unwrap();
    let store = Arc::new(open_with(dir.path(), 64, 1));
    // The previous generation is kept until a checkpoint is durable.
    assert!(dir.path().join(OLD_FILE).exists());
    assert_eq!(std::fs::read(&current).unwrap(), bytes, "not cut back");
    let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
    assert_eq!(r.len(), 20);
    assert_eq!(*r.get("a5").unwrap(), *views[5]);
    // The store goes on as before: more checkpoints, each removing
    // what it replaced.
    let before = store.stats().checkpoints;
    for id in ids("b", 40) {
        r.register(AllocId::parse(&id).unwrap(), spec())
            .await
            .unwrap();
    }
    drop(r);
    store.close().unwrap();
    assert!(store.stats().checkpoints > before, "{:?}", store.stats());
    assert!(!dir.path().join(OLD_FILE).exists());
    drop(store);
    let store = Arc::new(open_with(dir.path(), 64, 1));
    let r = Registry::open(store, RegistryConfig::default()).unwrap();
    assert_eq!(r.len(), 60);
}

/// A registry opened on `dir` holds exactly `views`.
fn holds_exactly<'a>(dir: &Path, views: impl Iterator<Item = &'a Arc<Allocation>>) {
    let store = Arc::new(open(dir, 64));
    let r = Registry::open(store, RegistryConfig::default()).unwrap();
    let mut n = 0;
    for v in views {
        assert_eq!(*r.get(v.id.as_str()).unwrap(), **v);
        n += 1;
    }
    assert_eq!(r.len(), n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfinished_append_at_the_end_of_the_log_is_cut_off() {
    let dir = tempfile::tempdir().unwrap();
    let (views, _, _) = register(dir.path(), DEFAULT_LOG_LIMIT, &ids("a", 5)).await;
    let (seq, _) = *segments(dir.path()).last().unwrap();
    let path = log::segment_path(dir.path(), seq);
    let len = valid_end(&path, seq) as usize;
    // The first sectors of an append, in the zeros written ahead: the
    // crash came mid-append.
    let head = torn_append(&path);
    let (more, _, _) = register(dir.path(), DEFAULT_LOG_LIMIT, &ids("b", 5)).await;
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        len as u64,
        "cut back"
    );
    let mut aside = path.clone().into_os_string();
    aside.push(".broken");
    assert_eq!(std::fs::read(aside).unwrap(), head, "kept aside");
    holds_exactly(dir.path(), views.iter().chain(&more));
}

/// A segment's appends land in zeros written ahead of them, and the
/// newest keeps them, closed cleanly or not (a start holds it to them):
/// the next start reads every acknowledged change, and once it has
/// started the next segment cuts the zeros off without keeping a copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zeros_written_ahead_of_the_appends_are_cut_off_by_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let (views, _, _) = register(dir.path(), DEFAULT_LOG_LIMIT, &ids("a", 5)).await;
    let (seq, file_len) = *segments(dir.path()).last().unwrap();
    let path = log::segment_path(dir.path(), seq);
    let len = valid_end(&path, seq);
    assert_eq!(file_len, log::WRITE_AHEAD, "a clean close keeps the zeros");
    let (more, _, _) = register(dir.path(), DEFAULT_LOG_LIMIT, &ids("b", 5)).await;
    assert_eq!(std::fs::metadata(&path).unwrap().len(), len, "cut back");
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(!names.iter().any(|n| n.ends_with(".broken")), "{names:?}");
    holds_exactly(dir.path(), views.iter().chain(&more));
}

/// Zeros after a sealed segment's last frame where the next segment's
/// header says it ended further on are appends lost: a start refuses
/// them (naming the segment and the byte) and changes nothing. Zeros
/// after the end that header names (a seal the writer did not finish)
/// hold nothing: the start goes on and cuts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zeros_after_a_sealed_segment_s_last_frame_stop_the_open() {
    let dir = tempfile::tempdir().unwrap();
    let (views, _, _) = register(dir.path(), DEFAULT_LOG_LIMIT, &ids("a", 5)).await;
    let (second, _, _) = register(dir.path(), DEFAULT_LOG_LIMIT, &ids("b", 5)).await;
    let all = segments(dir.path());
    assert_eq!(all.len(), 2, "{all:?}");
    let (seq, len) = all[0];
    let older = log::segment_path(dir.path(), seq);
    let sealed = std::fs::read(&older).unwrap();
    let last = *log_appends(&sealed).last().unwrap();
    let mut bytes = sealed.clone();
    bytes[last..].fill(0);
    bytes.resize(len as usize + 4096, 0);
    std::fs::write(&older, &bytes).unwrap();
    let e = DiskStore::open(config(dir.path(), 64, DEFAULT_LOG_LIMIT))
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains(&older.display().to_string()), "{e}");
    assert!(e.contains(&format!("at byte {last}")), "{e}");
    assert!(e.contains("read as zeros"), "{e}");
    assert_eq!(std::fs::read(&older).unwrap(), bytes, "unchanged");
    let mut bytes = sealed.clone();
    bytes.resize(len as usize + 4096, 0);
    std::fs::write(&older, &bytes).unwrap();
    let (more, _, _) = register(dir.path(), DEFAULT_LOG_LIMIT, &ids("c", 5)).await;
    assert_eq!(std::fs::read(&older).unwrap(), sealed, "cut back");
    holds_exactly(dir.path(), views.iter().chain(&second).chain(&more));
}

/// While it is written, a segment's file runs ahead of its appends in
/// zeros, to a multiple of `WRITE_AHEAD` at most twice that past them;
/// sealed, it ends at its last frame.
#[test]
fn a_segment_is_written_ahead_in_zeros_and_sealed_at_its_last_frame() {
    let dir = tempfile::tempdir().unwrap();
    let mut s =
        log::Segment::create(&RealFs, dir.path(), 1, log::End::NONE, log::WRITE_AHEAD).unwrap();
    let path = log::segment_path(dir.path(), 1);
    let mut lens = Vec::new();
    for i in 0..300 {
        let mut frame = log::one_append(&format!("a{i}"), i + 1, Some(&[7u8; 9000]));
        s.append(&mut frame).unwrap();
        let file = std::fs::metadata(&path).unwrap().len();
        assert!(file > s.len, "{file} for {}", s.len);
        assert!(file <= s.len + 2 * log::WRITE_AHEAD);
        let tail = &std::fs::read(&path).unwrap()[s.len as usize..];
        assert!(tail.iter().all(|&b| b == 0));
        assert_eq!(file % log::WRITE_AHEAD, 0);
        lens.push(file);
    }
    lens.dedup();
    assert!(lens.len() >= 2, "{lens:?}: written ahead again as it grows");
    s.seal().unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(bytes.len() as u64, s.len);
    let r = log::replay(&bytes, 1, &mut log::Overlay::default()).unwrap();
    assert_eq!((r.frames, r.spare, r.bad.is_none()), (300, 0, true));
}

/// Acknowledged changes are never dropped in silence: whatever damage
/// the log or the snapshot takes (a flipped byte anywhere in the newest
/// segment, its last frame included, a damaged length, a zeroed block,
/// an emptied or missing segment, a lost snapshot, a header of another
/// format), the open is refused with the file (and the offset, or the
/// format this build reads) named, and nothing in the directory changes:
/// no segment is cut, none kept aside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damage_anywhere_stops_the_open_naming_it_and_changes_nothing() {
    let good = tempfile::tempdir().unwrap();
    register(good.path(), DEFAULT_LOG_LIMIT, &ids("a", 100)).await;
    register(good.path(), DEFAULT_LOG_LIMIT, &ids("b", 200)).await;
    let all = segments(good.path());
    assert_eq!(all.len(), 2, "{all:?}");
    let older = log::segment_path(good.path(), all[0].0);
    let newest = log::segment_path(good.path(), all[1].0);
    // Where its appends end (zeros written ahead follow).
    let newest_len = valid_end(&newest, all[1].0) as usize;
    type Damage = Box<dyn Fn(&Path)>;
    type Edit = Box<dyn Fn(&mut Vec<u8>)>;
    let edit = |path: PathBuf, f: Edit| -> Damage {
        let name = path.file_name().unwrap().to_owned();
        Box::new(move |dir: &Path| {
            let path = dir.join(&name);
            let mut bytes = std::fs::read(&path).unwrap();
            f(&mut bytes);
            std::fs::write(&path, bytes).unwrap();
        })
    };
    let cases: Vec<(&str, Damage, String)> = vec![
        (
            "a flipped byte in the newest segment",
            edit(newest.clone(), Box::new(move |b| b[newest_len / 2] ^= 0x04)),
            "damaged at byte".into(),
        ),
        (
            "a flipped byte in the newest segment's last frame",
            edit(newest.clone(), Box::new(move |b| b[newest_len - 3] ^= 0x01)),
            "damaged at byte".into(),
        ),
        (
            "a damaged length field",
            edit(
                newest.clone(),
                Box::new(|b| b[log::Segment::HEADER_LEN as usize + 1] ^= 0x40),
            ),
            format!("damaged at byte {}", log::Segment::HEADER_LEN),
        ),
        (
            "a zeroed 4 KiB block",
            edit(newest.clone(), Box::new(|b| b[4096..8192].fill(0))),
            "damaged at byte".into(),
        ),
        (
            // Nothing in the segment itself looks wrong: the next one's
            // header says where it ended.
            "an older segment cut at the boundary of its last append",
            edit(
                older.clone(),
                Box::new(|b| {
                    let last = *log::frame_starts(b).last().unwrap();
                    b.truncate(last)
                }),
            ),
            "are missing (a sealed segment was cut short)".into(),
        ),
        (
            "an emptied older segment",
            edit(older.clone(), Box::new(Vec::clear)),
            "shorter than a segment header".into(),
        ),
        (
            "an emptied newest segment",
            edit(newest.clone(), Box::new(Vec::clear)),
            "shorter than a segment header".into(),
        ),
        (
            "a missing older segment",
            Box::new({
                let name = older.file_name().unwrap().to_owned();
                move |dir: &Path| std::fs::remove_file(dir.join(&name)).unwrap()
            }),
            format!("segment {} is missing", all[0].0),
        ),
        (
            "the newest segment of another format",
            edit(newest.clone(), Box::new(|b| b[7] = 1)),
            "log segment format 1, but this taskgate reads format 3 only".into(),
        ),
        (
            "an older segment of another format",
            edit(older.clone(), Box::new(|b| b[7] = 2)),
            "log segment format 2, but this taskgate reads format 3 only".into(),
        ),
        (
            "a lost snapshot",
            Box::new(|dir: &Path| {
                std::fs::rename(dir.join(SNAPSHOT_FILE), dir.join(OLD_FILE)).unwrap()
            }),
            "snapshot it replaced".into(),
        ),
        (
            "a snapshot of another format",
            edit(PathBuf::from(SNAPSHOT_FILE), Box::new(|b| b[7] = 1)),
            "snapshot format 1, but this taskgate reads format 2 only".into(),
        ),
    ];
    assert!(newest_len > 8192, "{newest_len}");
    // The snapshot case needs one: fold the older segment.
    let with_snapshot = tempfile::tempdir().unwrap();
    register(with_snapshot.path(), 1, &ids("s", 20)).await;
    register(with_snapshot.path(), DEFAULT_LOG_LIMIT, &ids("t", 20)).await;
    for (what, damage, expect) in cases {
        let dir = tempfile::tempdir().unwrap();
        let from = if what.contains("snapshot") {
            with_snapshot.path()
        } else {
            good.path()
        };
        copy_dir(from, dir.path());
        damage(dir.path());
        let before = files(dir.path());
        let err = DiskStore::open(config(dir.path(), 1, DEFAULT_LOG_LIMIT))
            .err()
            .unwrap_or_else(|| panic!("{what}: the store opened"))
            .to_string();
        assert!(err.contains(expect.as_str()), "{what}: {err}");
        assert!(
            err.contains(&dir.path().display().to_string()),
            "{what}: {err}"
        );
        assert_eq!(files(dir.path()), before, "{what}: the directory changed");
    }
}

/// `dump --salvage`: what a damaged snapshot and log still hold goes to
/// a new directory, which opens; what is lost is named; the damaged
/// directory is left as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salvage_copies_what_can_be_read_and_names_what_cannot() {
    let dir = tempfile::tempdir().unwrap();
    // Folded into the snapshot, then in the log.
    let (mut views, _, _) = register(dir.path(), 1, &ids("s", 60)).await;
    let (logged, last, _) =
        register_with(dir.path(), DEFAULT_LOG_LIMIT, &ids("l", 60), false).await;
    views.extend(logged);
    let snapshot = dir.path().join(SNAPSHOT_FILE);
    let (seq, _) = *segments(dir.path()).last().unwrap();
    let newest = log::segment_path(dir.path(), seq);
    // A byte of one record each: the first three-letter "s" ID in the
    // snapshot, the first "l" one in the log (found by its ID's length
    // byte and first letter).
    for (path, letter) in [(&snapshot, b's'), (&newest, b'l')] {
        let mut bytes = std::fs::read(path).unwrap();
        let at = bytes.windows(2).position(|w| w == [3, letter]).unwrap() + 4 + 2;
        bytes[at] ^= 0x10;
        std::fs::write(path, bytes).unwrap();
    }
    assert!(DiskStore::open(config(dir.path(), 1, DEFAULT_LOG_LIMIT)).is_err());
    let before = files(dir.path());
    let out = tempfile::tempdir().unwrap();
    let to = out.path().join("salvaged");
    let report = super::salvage(dir.path(), &to).unwrap();
    assert_eq!(
        files(dir.path()),
        before,
        "the damaged directory is only read"
    );
    let lost = &report.lost;
    assert_eq!(lost.len(), 5, "{lost:?}");
    let snapshot = snapshot.display().to_string();
    assert!(
        lost[0].starts_with(&format!("{snapshot}: bytes ")),
        "{lost:?}"
    );
    assert!(lost[0].ends_with("could not be read"), "{lost:?}");
    assert!(
        lost[1].starts_with(&format!("{snapshot}: its trailer counts ")),
        "{lost:?}"
    );
    // Which records it can have been: the snapshot is in key order.
    assert!(
        lost[2].contains(r#"keys sort after "s1" and before "s11""#),
        "{lost:?}"
    );
    assert!(
        lost[3].starts_with(&format!("{}: bytes ", newest.display())),
        "{lost:?}"
    );
    // The lost change's index may have been the highest: indexes go on
    // past any it could have had.
    assert!(lost[4].starts_with("indexes go on from "), "{lost:?}");
    // The lost append (l10's registration) could have changed anything
    // written before it: those allocations' last index is not proven;
    // those written after it are.
    let unproven = &report.unproven;
    let named = |id: &str| {
        unproven
            .iter()
            .any(|l| l.starts_with(&format!("allocation \"{id}\": salvaged at index")))
    };
    assert!(named("s5") && named("s59") && named("l9"), "{unproven:?}");
    assert!(
        !named("l11") && !named("l59") && !named("l10"),
        "{unproven:?}"
    );
    assert_eq!(unproven.len(), 60 - 1 + 10 + 1, "{unproven:?}");
    assert!(report.last_index > last, "{} > {last}", report.last_index);
    // One record of the snapshot and one change of the log are lost.
    assert_eq!(report.allocations, 118);
    let store = Arc::new(open(&to, 1));
    let r = Registry::open(store, RegistryConfig::default()).unwrap();
    assert_eq!(r.len(), 118);
    assert_eq!(r.last_index(), report.last_index);
    let mut missing = 0;
    for v in &views {
        match r.get(v.id.as_str()) {
            Ok(got) => assert_eq!(*got, **v),
            Err(_) => missing += 1,
        }
    }
    assert_eq!(missing, 2);
    // Never in place, never over something.
    let err = super::salvage(dir.path(), dir.path())
        .unwrap_err()
        .to_string();
    assert!(err.contains("never works in place"), "{err}");
    let err = super::salvage(dir.path(), &to).unwrap_err().to_string();
    assert!(err.contains("is not empty"), "{err}");
}

/// Waits (bounded) until `ready` holds.
fn wait_until(what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn put(n: u64) -> Op {
    let now = time::OffsetDateTime::UNIX_EPOCH;
    let id = AllocId::parse(&format!("p{n}")).unwrap();
    Op::Put(Arc::new(Allocation::register(id, Arc::new(spec()), n, now)))
}

/// A checkpoint that keeps failing (here: the snapshot damaged under a
/// running store) degrades the store, is tried again after a growing
/// wait rather than after every commit, and once the log reaches its
/// ceiling writes are refused; when a checkpoint works again, so do
/// writes, and nothing acknowledged is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_checkpoints_degrade_the_store_then_stop_writes_at_the_ceiling_until_one_works() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = Arc::new(Metrics::new());
    let store = DiskStore::open(DiskStoreConfig {
        log_limit: 1024,
        log_ceiling: 16 * 1024,
        retry: Duration::from_millis(5),
        metrics: Some(metrics.clone()),
        ..DiskStoreConfig::new(dir.path().to_owned())
    })
    .unwrap();
    let mut n = 0;
    while store.stats().checkpoints == 0 {
        n += 1;
        store.commit(put(n)).await.unwrap();
    }
    // Counted by name only: the cleanup may remove one while it is read.
    wait_until("the first checkpoint's cleanup", || {
        log::list_segments(&RealFs, dir.path()).unwrap().len() == 1
    });
    let path = dir.path().join(SNAPSHOT_FILE);
    let good = std::fs::read(&path).unwrap();
    let mut bad = good.clone();
    bad[good.len() / 2] ^= 0x08;
    std::fs::write(&path, &bad).unwrap();
    assert_eq!(store.health(), StoreHealth::Ok);
    let mut degraded = false;
    let refused = loop {
        n += 1;
        assert!(n < 5000, "never refused");
        match store.commit(put(n)).await {
            Ok(()) => {}
            Err(e) => break e,
        }
        degraded |= store.health() == StoreHealth::Degraded(vec!["checkpoints_failing"]);
    };
    let acknowledged = n - 1;
    assert!(degraded, "degraded before the ceiling");
    assert!(matches!(refused, StoreError::Unavailable(_)), "{refused:?}");
    assert!(
        matches!(
            store.health(),
            StoreHealth::Refusing {
                code: "log_full",
                ..
            }
        ),
        "{:?}",
        store.health()
    );
    let stats = store.stats();
    assert!(
        stats.failed_checkpoints >= 1 && stats.failed_checkpoints * 4 < stats.commits,
        "tried again after a wait, not after every commit: {stats:?}"
    );
    let text = metrics.render(Default::default());
    assert!(
        text.contains(&format!(
            "taskgate_store_background_failures_total{{operation=\"checkpoint\"}} {}",
            stats.failed_checkpoints
        )),
        "{text}"
    );
    // Mended: the next try folds the log, and writes are taken again.
    std::fs::write(&path, &good).unwrap();
    wait_until("a checkpoint that works", || {
        store.health() == StoreHealth::Ok
    });
    store.commit(put(n)).await.unwrap();
    store.close().unwrap();
    drop(store);
    let reopened = open(dir.path(), 1);
    let loaded = reopened.load().unwrap();
    assert_eq!(loaded.allocations.len() as u64, acknowledged + 1);
}

/// A log segment that cannot be started (here: a directory in the way
/// of its temporary name) degrades the store while writes go on in the
/// current segment; it is tried again until it works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_rollover_degrades_the_store_until_it_works() {
    let dir = tempfile::tempdir().unwrap();
    let store = DiskStore::open(DiskStoreConfig {
        log_limit: 1024,
        retry: Duration::from_millis(5),
        ..DiskStoreConfig::new(dir.path().to_owned())
    })
    .unwrap();
    let blocker = dir.path().join(log::SEGMENT_TEMP);
    std::fs::create_dir(&blocker).unwrap();
    let mut n = 0;
    while store.stats().failed_rollovers == 0 {
        n += 1;
        assert!(n < 1000);
        store.commit(put(n)).await.unwrap();
    }
    assert_eq!(
        store.health(),
        StoreHealth::Degraded(vec!["log_rollover_failing"])
    );
    assert_eq!(segments(dir.path()).len(), 1);
    std::fs::remove_dir(&blocker).unwrap();
    wait_until("a rollover that works", || {
        store.health() == StoreHealth::Ok
    });
    wait_until("the checkpoint after it", || store.stats().checkpoints > 0);
    store.close().unwrap();
    drop(store);
    assert_eq!(
        open(dir.path(), 1).load().unwrap().allocations.len() as u64,
        n
    );
}

/// A start on a full disk, where setting aside the unfinished append
/// at the end of the log fails (ENOSPC writing or syncing the
/// `.broken` file), is refused saying what helps: free space and start
/// again; not that the directory must be restored from a backup. It
/// changed nothing, and leaves nothing behind (no empty `.broken`),
/// so it says so truly; with space, the same directory starts. The
/// same when the disk fills at the new log segment, after the cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_on_a_full_disk_says_to_free_space_and_changes_nothing() {
    use crate::store::fs::sim::{self, SimFs};
    for (failing, file) in [
        (sim::Op::Write, log::BROKEN_SUFFIX),
        (sim::Op::SyncAll, log::BROKEN_SUFFIX),
        (sim::Op::Write, log::SEGMENT_TEMP),
    ] {
        let cut_first = file == log::SEGMENT_TEMP;
        let fs = SimFs::new();
        let dir = PathBuf::from("/sim/data");
        fs.create_dir_all(&dir).unwrap();
        let open = |fs: &SimFs| {
            DiskStore::open(DiskStoreConfig {
                fs: Arc::new(fs.clone()),
                ..DiskStoreConfig::new(dir.clone())
            })
        };
        let store = open(&fs).unwrap();
        for n in 1..=3 {
            store.commit(put(n)).await.unwrap();
        }
        store.close().unwrap();
        drop(store);
        let (_, path) = log::list_segments(&fs, &dir).unwrap().pop().unwrap();
        // A crash mid-append (made on a real file, put back).
        let real = tempfile::tempdir().unwrap();
        let copy = real.path().join(path.file_name().unwrap());
        std::fs::write(&copy, fs.contents(&path).unwrap()).unwrap();
        let head = torn_append(&copy);
        fs.put(&path, std::fs::read(&copy).unwrap());
        let everything = |fs: &SimFs| {
            let mut names = fs.list(&dir).unwrap();
            names.sort();
            names
                .into_iter()
                .map(|n| (n.clone(), fs.contents(&dir.join(n))))
                .collect::<Vec<_>>()
        };
        let before = everything(&fs);
        fs.fail_with(move |op, path| {
            let hit = path.to_string_lossy().contains(file);
            (op == failing && hit).then(|| std::io::Error::from_raw_os_error(28))
        });
        let err = open(&fs).err().expect("refused").to_string();
        assert!(
            err.contains("free space") && err.contains("start again"),
            "{failing:?} {file}: {err}"
        );
        assert!(!err.contains("backup"), "{failing:?} {file}: {err}");
        if cut_first {
            assert!(err.contains("every acknowledged change"), "{err}");
            assert!(
                !fs.exists(&dir.join(log::SEGMENT_TEMP)),
                "nothing left behind"
            );
        } else {
            assert!(err.contains(&path.display().to_string()), "{err}");
            assert!(
                err.contains("Nothing in the data directory was changed"),
                "{err}"
            );
            assert_eq!(everything(&fs), before, "{failing:?}: nothing left behind");
        }
        fs.heal();
        let store = open(&fs).unwrap();
        assert_eq!(store.load().unwrap().allocations.len(), 3);
        let mut aside = path.clone().into_os_string();
        aside.push(log::BROKEN_SUFFIX);
        assert_eq!(fs.contents(Path::new(&aside)).unwrap(), head);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damage_before_the_end_of_the_log_stops_the_open() {
    let dir = tempfile::tempdir().unwrap();
    register(dir.path(), DEFAULT_LOG_LIMIT, &ids("a", 5)).await;
    register(dir.path(), DEFAULT_LOG_LIMIT, &ids("b", 5)).await;
    let all = segments(dir.path());
    assert_eq!(all.len(), 2, "one segment per open: {all:?}");
    let first = log::segment_path(dir.path(), all[0].0);
    let mut bytes = std::fs::read(&first).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x20;
    std::fs::write(&first, &bytes).unwrap();
    let err = DiskStore::open(config(dir.path(), 1, DEFAULT_LOG_LIMIT))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains(&first.display().to_string()), "{err}");
    assert!(err.contains("newer segments follow"), "{err}");
    assert_eq!(std::fs::read(&first).unwrap(), bytes, "left as it was");
    assert_eq!(segments(dir.path()), all, "nothing removed or added");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_log_segment_stops_the_open() {
    let dir = tempfile::tempdir().unwrap();
    for round in ["a", "b", "c"] {
        register(dir.path(), DEFAULT_LOG_LIMIT, &ids(round, 3)).await;
    }
    let all = segments(dir.path());
    std::fs::remove_file(log::segment_path(dir.path(), all[1].0)).unwrap();
    let err = DiskStore::open(config(dir.path(), 1, DEFAULT_LOG_LIMIT))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains(&format!("segment {} is missing", all[1].0)),
        "{err}"
    );
}

#[test]
fn a_pre_release_data_directory_is_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(REDB_FILE), b"redb").unwrap();
    let err = DiskStore::open(config(dir.path(), 1, DEFAULT_LOG_LIMIT))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("pre-release format (taskgate.redb)"), "{err}");
    let left: Vec<String> = files(dir.path())
        .into_iter()
        .map(|(n, _)| n.to_string_lossy().into_owned())
        .collect();
    assert!(
        left.iter().all(|n| n == REDB_FILE || n == LOCK_FILE),
        "nothing created but the lock: {left:?}"
    );
    assert_eq!(std::fs::read(dir.path().join(REDB_FILE)).unwrap(), b"redb");
}

#[test]
fn a_second_store_on_the_same_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let first = open(dir.path(), 1);
    let err = DiskStore::open(config(dir.path(), 1, DEFAULT_LOG_LIMIT))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("in use by another process"), "{err}");
    drop(first);
    drop(open(dir.path(), 1));
}

#[test]
fn a_failed_append_stops_the_log_until_a_restart_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    drop(log::Segment::create(&RealFs, dir.path(), 1, log::End::NONE, log::WRITE_AHEAD).unwrap());
    let trouble = Arc::new(Mutex::new(Trouble::default()));
    let mut writer = Writer {
        fs: Arc::new(RealFs),
        dir: dir.path().to_owned(),
        segment: log::Segment::read_only(dir.path(), 1).unwrap(),
        log_bytes: 0,
        sealed: Vec::new(),
        log_limit: DEFAULT_LOG_LIMIT,
        log_ceiling: DEFAULT_LOG_CEILING,
        follower: Arc::default(),
        checkpointer: None,
        folded: 0,
        folding: 0,
        supervisor: Default::default(),
        snapshot_bytes: 0,
        in_flight: false,
        trouble: trouble.clone(),
        retry_at: None,
        retry_first: RETRY_FIRST,
        backoff: RETRY_FIRST,
        max_batch: 8,
        stats: Arc::default(),
        metrics: None,
    };
    let mut frame = log::one_append("a1", 1, Some(b"{}"));
    let err = writer.append(&mut frame).unwrap_err().to_string();
    assert!(err.contains("until taskgate is restarted"), "{err}");
    let why = trouble
        .lock()
        .unwrap()
        .write
        .clone()
        .expect("the failure is shared");
    assert_eq!(err, format!("store I/O failed: {why}"));
    // Later appends are refused without touching the file.
    let again = writer.append(&mut frame).unwrap_err().to_string();
    assert_eq!(again, err);
    let len = std::fs::metadata(log::segment_path(dir.path(), 1))
        .unwrap()
        .len();
    assert_eq!(len, log::WRITE_AHEAD, "as created: a header and zeros");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_changes_share_commits_unless_batching_is_off() {
    for (max_batch, shared) in [(4096, true), (1, false)] {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path(), max_batch);
        let commits: Vec<_> = (1..=200u64)
            .map(|i| store.commit(Op::Delete(AllocId::parse(&format!("x{i}")).unwrap())))
            .collect();
        for c in commits {
            c.await.unwrap();
        }
        store.close().unwrap();
        let stats = store.stats();
        drop(store);
        assert_eq!(open(dir.path(), 1).load().unwrap().last_index, 200);
        assert_eq!(stats.changes, 200);
        if shared {
            assert!(stats.commits < 200, "{stats:?}");
        } else {
            assert_eq!(stats.commits, 200, "one commit per change");
        }
    }
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

fn copy_dir(from: &Path, to: &Path) {
    for (name, bytes) in files(from) {
        std::fs::write(to.join(name), bytes).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_loads_what_a_start_would_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // Checkpoints along the way, so there is a snapshot and a log.
    register(dir.path(), 1024, &ids("a", 40)).await;
    {
        let store = Arc::new(open_with(dir.path(), 64, DEFAULT_LOG_LIMIT));
        let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
        r.delete("a7").await.unwrap();
        drop(r);
        store.close().unwrap();
    }
    // A crash mid-append, and a folded segment a checkpoint did not
    // get to remove: what a start repairs.
    let newest = log::list_segments(&RealFs, dir.path())
        .unwrap()
        .pop()
        .unwrap()
        .1;
    let mut torn = std::fs::OpenOptions::new()
        .append(true)
        .open(&newest)
        .unwrap();
    std::io::Write::write_all(&mut torn, &[7, 0, 0, 0, 1, 2]).unwrap();
    drop(torn);
    let folded = snapshot_facts(dir.path()).2;
    std::fs::write(log::segment_path(dir.path(), folded), b"folded").unwrap();
    let before = files(dir.path());

    let read = read_only(dir.path()).unwrap();
    assert_eq!(files(dir.path()), before, "not a byte changed");
    let copy = tempfile::tempdir().unwrap();
    copy_dir(dir.path(), copy.path());
    let started = open(copy.path(), 1).load().unwrap();
    assert_eq!(read.allocations.len(), 39);
    assert_eq!(read.allocations, started.allocations);
    assert_eq!(read.last_index, started.last_index);
}

#[test]
fn read_only_refuses_a_directory_in_use_an_old_one_or_none() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), 1);
    let err = read_only(dir.path()).err().unwrap().to_string();
    assert!(err.contains("in use by a running taskgate"), "{err}");
    drop(store);
    assert!(read_only(dir.path()).unwrap().allocations.is_empty());

    let old = tempfile::tempdir().unwrap();
    std::fs::write(old.path().join(REDB_FILE), b"").unwrap();
    let err = read_only(old.path()).err().unwrap().to_string();
    assert!(err.contains("pre-release format"), "{err}");
    assert_eq!(files(old.path()).len(), 1, "no lock file created");

    let err = read_only(&old.path().join("missing"))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("is not a data directory"), "{err}");
}

#[test]
fn a_corrupt_record_stops_the_open_naming_the_allocation_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut w =
        snapshot::SnapshotWriter::create(&RealFs, dir.path(), 0, 1, log::End::NONE).unwrap();
    w.put("broken", b"{not json").unwrap();
    w.finish().unwrap();
    // A torn append the open would cut, and names it would drop.
    let mut s =
        log::Segment::create(&RealFs, dir.path(), 1, log::End::NONE, log::WRITE_AHEAD).unwrap();
    super::manifest::write(&RealFs, dir.path(), 1).unwrap();
    let mut frame = log::one_append("fine", 1, Some(b"{}"));
    s.append(&mut frame).unwrap();
    drop(s);
    let mut torn = Vec::new();
    log::change(&mut torn, "torn", 2, Some(&[1; 1000]));
    log::append_unfinished(&log::segment_path(dir.path(), 1), &torn, 600, 0);
    std::fs::write(dir.path().join(NEXT_FILE), b"unfinished").unwrap();
    std::fs::write(dir.path().join(LOCK_FILE), b"").unwrap();
    let before = files(dir.path());
    for _ in 0..2 {
        let err = DiskStore::open(config(dir.path(), 1, DEFAULT_LOG_LIMIT))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("\"broken\""), "{err}");
        // Nothing was cut, created or removed.
        assert_eq!(files(dir.path()), before);
    }
}

#[test]
fn a_damaged_snapshot_stops_the_open_and_is_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(SNAPSHOT_FILE);
    std::fs::write(&path, vec![0x42u8; 8192]).unwrap();
    let err = DiskStore::open(config(dir.path(), 1, DEFAULT_LOG_LIMIT))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains(SNAPSHOT_FILE), "{err}");
    assert!(
        err.contains("does not start like a taskgate snapshot"),
        "{err}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), vec![0x42u8; 8192]);
}

#[tokio::test]
async fn commits_after_close_fail_as_closed() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), 8);
    store.close().unwrap();
    let err = store
        .commit(Op::Delete(AllocId::parse("x").unwrap()))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Closed));
}

/// The snapshot and the log vouch for each other: a snapshot of another
/// data directory (or an older one) that folded as many segments as this
/// one's did does not fit the segment after it, and the start is refused,
/// naming both, changing nothing. So is a log whose first segment does
/// not follow the snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_that_does_not_fit_the_log_stops_the_open() {
    // Two directories with the same shape: a snapshot that folded
    // segment 1, and segment 2 after it.
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    for (d, prefix) in dirs.iter().zip(["a", "b"]) {
        fold_first_segment(d.path(), prefix).await;
        assert_eq!(snapshot_facts(d.path()).2, 1);
        assert_eq!(segments(d.path())[0].0, 2, "{prefix}");
    }
    let [mine, theirs] = &dirs;
    std::fs::copy(
        theirs.path().join(SNAPSHOT_FILE),
        mine.path().join(SNAPSHOT_FILE),
    )
    .unwrap();
    let before = files(mine.path());
    let err = DiskStore::open(config(mine.path(), 1, DEFAULT_LOG_LIMIT))
        .err()
        .expect("refused")
        .to_string();
    let segment = log::segment_path(mine.path(), 2).display().to_string();
    assert!(err.contains(&segment), "{err}");
    assert!(err.contains(SNAPSHOT_FILE), "{err}");
    assert!(err.contains("not of one history"), "{err}");
    assert_eq!(files(mine.path()), before);
}

/// A store whose first segment was folded into its snapshot by a
/// checkpoint, with a second segment after it: what a checkpoint at the
/// first rollover leaves.
async fn fold_first_segment(dir: &Path, prefix: &str) {
    register_with(dir, DEFAULT_LOG_LIMIT, &ids(prefix, 5), false).await;
    register_with(
        dir,
        DEFAULT_LOG_LIMIT,
        &ids(&format!("{prefix}x"), 2),
        false,
    )
    .await;
    // Folded by hand, as the checkpoint thread does it, then removed.
    let (written, _) = super::checkpoint::checkpoint(&RealFs, dir, 0, 1, None).unwrap();
    assert_eq!(written.records, 5);
    std::fs::remove_file(log::segment_path(dir, 1)).unwrap();
}

/// A checkpoint never folds a log whose segments do not vouch for each
/// other (here: the first cut at an append's boundary, under a running
/// store): it fails, and the store says so, instead of hiding the loss in
/// the next snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_refuses_a_sealed_segment_cut_short() {
    let dir = tempfile::tempdir().unwrap();
    for round in ["a", "b"] {
        register_with(dir.path(), DEFAULT_LOG_LIMIT, &ids(round, 3), false).await;
    }
    let first = log::segment_path(dir.path(), 1);
    let mut bytes = std::fs::read(&first).unwrap();
    bytes.truncate(*log::frame_starts(&bytes).last().unwrap());
    std::fs::write(&first, &bytes).unwrap();
    let err = super::checkpoint::checkpoint(&RealFs, dir.path(), 0, 2, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("are missing"), "{err}");
    assert!(!dir.path().join(SNAPSHOT_FILE).exists());
}

/// Salvage by index: the newest version of an allocation wins wherever
/// it lies. Here a checkpoint folded segments 1 and 2 (the allocation at
/// index 7 in the first, at 88 in the second) and stopped before removing
/// segment 1; with the snapshot's header damaged, salvage cannot know what
/// it folded and reads segment 1 too — whose older version must not win.
#[test]
fn salvage_keeps_the_newest_version_wherever_it_lies() {
    let dir = tempfile::tempdir().unwrap();
    let at = time::OffsetDateTime::UNIX_EPOCH;
    let version = |index| {
        let mut a = Allocation::register(AllocId::parse("x").unwrap(), Arc::new(spec()), 1, at);
        a.modify_index = index;
        a
    };
    let (old, new) = (version(7), version(88));
    let mut s =
        log::Segment::create(&RealFs, dir.path(), 1, log::End::NONE, log::WRITE_AHEAD).unwrap();
    super::manifest::write(&RealFs, dir.path(), 1).unwrap();
    let mut frame = log::one_append("x", 7, Some(&record::encode(&old)));
    s.append(&mut frame).unwrap();
    drop(s);
    let mut w =
        snapshot::SnapshotWriter::create(&RealFs, dir.path(), 2, 88, log::End::NONE).unwrap();
    w.put("x", &record::encode(&new)).unwrap();
    w.finish().unwrap();
    let path = dir.path().join(SNAPSHOT_FILE);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[9] ^= 0x01;
    std::fs::write(&path, bytes).unwrap();
    let to = tempfile::tempdir().unwrap();
    let to = to.path().join("salvaged");
    let report = super::salvage(dir.path(), &to).unwrap();
    assert!(
        report
            .lost
            .iter()
            .any(|l| l.contains("its header is damaged")),
        "{:?}",
        report.lost
    );
    assert!(report.unproven.is_empty(), "{:?}", report.unproven);
    let loaded = open(&to, 1).load().unwrap();
    assert_eq!(loaded.allocations, vec![new]);
    assert_eq!(loaded.last_index, 88);
}

// ---- zeros written ahead of the appends: what they must not hide ----

/// The newest segment as a crash leaves it (zeros written ahead after its
/// last frame) with a block zeroed from the head of an acknowledged
/// append, acknowledged appends after it: damage, which a start must
/// refuse, `dump` too, and which salvage reads past: a run of frames
/// that ends in the zeros counts as reaching the end of the file (else
/// the appends after the block would be taken for a torn tail).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zeroed_block_before_acknowledged_appends_with_zeros_written_ahead_is_damage() {
    zeroed_block_before_acknowledged_appends(true).await;
}

/// The control: the same damage in a segment cut at its last frame (a
/// clean close) is refused, and salvage reads past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zeroed_block_before_acknowledged_appends_is_damage() {
    zeroed_block_before_acknowledged_appends(false).await;
}

async fn zeroed_block_before_acknowledged_appends(ahead: bool) {
    let dir = tempfile::tempdir().unwrap();
    let (_, _, _) = register_with(dir.path(), DEFAULT_LOG_LIMIT, &ids("a", 30), false).await;
    let (seq, len) = *segments(dir.path()).last().unwrap();
    let path = log::segment_path(dir.path(), seq);
    let mut bytes = std::fs::read(&path).unwrap();
    let starts = log::frame_starts(&bytes);
    let from = starts[10];
    let to = (from + 12).next_multiple_of(512);
    assert!(
        to + 1000 < len as usize,
        "appends after the block: {to} {len}"
    );
    bytes[from..to].fill(0);
    // As a crash leaves the newest segment: the zeros written ahead.
    if ahead {
        bytes.resize(len as usize + log::WRITE_AHEAD as usize, 0);
    }
    std::fs::write(&path, &bytes).unwrap();

    let mut broken = Vec::new();
    match super::read_only(dir.path()) {
        Ok(l) => broken.push(format!(
            "dump read the directory: {} of 30 allocations",
            l.allocations.len()
        )),
        Err(e) => assert!(e.to_string().contains("damaged"), "{e}"),
    }
    let out = tempfile::tempdir().unwrap();
    let report = super::salvage(dir.path(), &out.path().join("s")).unwrap();
    if report.allocations < 25 {
        broken.push(format!(
            "salvage copied {} of 30 allocations (a block of ~1 KiB zeroed); lost: {:?}",
            report.allocations, report.lost
        ));
    }
    match DiskStore::open(config(dir.path(), 1, DEFAULT_LOG_LIMIT)) {
        Ok(s) => {
            let n = s.load().unwrap().allocations.len();
            let names: Vec<_> = std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            broken.push(format!(
                "the store started with {n} of 30 acknowledged allocations; files {names:?}"
            ));
        }
        Err(e) => assert!(e.to_string().contains(&format!("byte {from}")), "{e}"),
    }
    assert!(broken.is_empty(), "{broken:#?}");
}

/// The checkpoint folds sealed segments 1 and 2 while segment 3 is
/// written. Segment 2's last append reads as zeros from its start to the
/// end of the file, or is cut off at that boundary (damage): folded, the
/// snapshot would say the log ended there and the checkpointer would
/// remove the segment, the append gone for good. So the checkpoint
/// refuses zeros after a sealed segment's last frame, and checks the last
/// segment it folds against where the writer sealed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_refuses_a_sealed_segment_ending_in_zeros() {
    checkpoint_last_sealed(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_refuses_a_sealed_segment_cut_at_its_last_append() {
    checkpoint_last_sealed(true).await;
}

async fn checkpoint_last_sealed(cut: bool) {
    let dir = tempfile::tempdir().unwrap();
    for round in ["a", "b", "c"] {
        register_with(dir.path(), DEFAULT_LOG_LIMIT, &ids(round, 3), false).await;
    }
    assert_eq!(segments(dir.path()).len(), 3);
    let second = log::segment_path(dir.path(), 2);
    let mut bytes = std::fs::read(&second).unwrap();
    // Where the writer sealed it.
    let sealed = log::replay(&bytes, 2, &mut log::Overlay::default())
        .unwrap()
        .end();
    let last = *log::frame_starts(&bytes).last().unwrap();
    if cut {
        bytes.truncate(last);
    } else {
        bytes[last..].fill(0);
    }
    std::fs::write(&second, &bytes).unwrap();
    let folded = super::checkpoint::checkpoint(&RealFs, dir.path(), 0, 2, Some(sealed));
    assert!(
        folded.is_err(),
        "folded segments 1 and 2 with segment 2's last append lost ({})",
        if cut { "cut" } else { "zeros" }
    );
}

/// A crash alone: the newest segment's last append (unacknowledged) torn
/// with its head's sector lost and later sectors written, the zeros
/// written ahead after it. `dump --salvage` on that directory counts the
/// torn append as lost log, not the zeros after it: the indexes it skips
/// are at most what the torn append's bytes could hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salvage_of_a_crashed_directory_does_not_count_the_zeros_written_ahead_as_lost() {
    let dir = tempfile::tempdir().unwrap();
    let (_, last, _) = register_with(dir.path(), DEFAULT_LOG_LIMIT, &ids("a", 5), false).await;
    let (seq, _) = *segments(dir.path()).last().unwrap();
    let path = log::segment_path(dir.path(), seq);
    let len = valid_end(&path, seq);
    let mut changes = Vec::new();
    log::change(&mut changes, "torn", last + 1, Some(&[0x5a; 3000]));
    log::append_unfinished(&path, &changes, usize::MAX, 0);
    let mut bytes = std::fs::read(&path).unwrap();
    let torn = bytes[len as usize..].iter().rposition(|&b| b != 0).unwrap() as u64 + 1;
    let head_sector_end = (len as usize + 12).next_multiple_of(512);
    bytes[len as usize..head_sector_end].fill(0);
    std::fs::write(&path, &bytes).unwrap();
    let out = tempfile::tempdir().unwrap();
    let report = super::salvage(dir.path(), &out.path().join("s")).unwrap();
    assert_eq!(report.allocations, 5);
    assert!(
        report.last_index <= last + 1 + torn / log::MIN_CHANGE,
        "torn append of {torn} bytes; last index {last}; salvage goes on from {}: {:?}",
        report.last_index,
        report.lost
    );
}

/// A change the store refused is never on disk. Writers on one allocation
/// pipeline their changes (each decided on the one before it) while the
/// log runs into its ceiling, checkpoints failing: the writers told of a
/// failure must find neither their change nor any change decided on it
/// after a restart, and the record a restart loads is the last one a
/// writer was told of.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_refused_at_the_log_ceiling_never_comes_back_after_a_restart() {
    use crate::lifecycle::{EventInput, RunState, TaskReport};
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(
        DiskStore::open(DiskStoreConfig {
            log_limit: 1024,
            log_ceiling: 64 * 1024,
            retry: Duration::from_millis(5),
            ..DiskStoreConfig::new(dir.path().to_owned())
        })
        .unwrap(),
    );
    // Checkpoints fail from now on: a directory where the next snapshot
    // is written.
    std::fs::create_dir(dir.path().join(NEXT_FILE)).unwrap();
    let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
    r.register(AllocId::parse("a").unwrap(), spec())
        .await
        .unwrap();
    let report = |n: usize| {
        vec![(
            TaskName::parse("web").unwrap(),
            TaskReport {
                state: if n.is_multiple_of(2) {
                    RunState::Running
                } else {
                    RunState::Pending
                },
                failed: false,
                ready: None,
                event: Some(EventInput {
                    kind: "Note".into(),
                    time: None,
                    // Of many sizes, so that batches are too.
                    message: format!("w{n} {}", "x".repeat(n % 7 * 150)),
                    details: Default::default(),
                }),
            },
        )]
    };
    let mut told = Vec::new();
    let mut refused = Vec::new();
    for round in 0..400 {
        let writers: Vec<_> = (0..16)
            .map(|k| {
                let (r, n) = (r.clone(), round * 16 + k);
                tokio::spawn(async move { (n, r.report("a", report(n)).await) })
            })
            .collect();
        for w in writers {
            match w.await.unwrap() {
                (n, Ok(a)) => told.push((a.modify_index, n)),
                (n, Err(_)) => refused.push(n),
            }
        }
        if refused.len() >= 64 {
            break;
        }
    }
    assert!(refused.len() >= 64, "the log never reached its ceiling");
    drop(r);
    store.close().unwrap();
    drop(store);
    std::fs::remove_dir(dir.path().join(NEXT_FILE)).unwrap();
    let reopened = Arc::new(open(dir.path(), 64));
    let r = Registry::open(reopened, RegistryConfig::default()).unwrap();
    let a = r.get("a").unwrap();
    let last = told.iter().map(|(index, _)| *index).max().unwrap();
    assert_eq!(a.modify_index, last, "the last change a writer was told of");
    let refused: std::collections::HashSet<String> =
        refused.iter().map(|n| format!("w{n} ")).collect();
    for e in a.tasks[0].events.all().iter() {
        let key = e.message.split_inclusive(' ').next().unwrap_or_default();
        assert!(
            !refused.contains(key),
            "a refused write's event came back: {}",
            e.message
        );
    }
}

/// A disk store that refuses a change takes none after it, however small:
/// at the log's ceiling, checkpoints failing, every change after the first
/// refused one is refused too, until a checkpoint works; a restart finds
/// exactly the changes that were taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_at_its_ceiling_takes_no_change_after_one_it_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = DiskStore::open(DiskStoreConfig {
        log_limit: 1024,
        log_ceiling: 16 * 1024,
        retry: Duration::from_millis(5),
        ..DiskStoreConfig::new(dir.path().to_owned())
    })
    .unwrap();
    std::fs::create_dir(dir.path().join(NEXT_FILE)).unwrap();
    // Records of 40 tasks each: far larger than the changes tried after.
    let big = |n: u64| {
        let tasks = (0..40)
            .map(|t| TaskSpec::named(TaskName::parse(&format!("task-{t}")).unwrap()))
            .collect();
        let spec = AllocSpec::new(tasks, &Limits::default()).unwrap();
        let id = AllocId::parse(&format!("p{n}")).unwrap();
        let now = time::OffsetDateTime::UNIX_EPOCH;
        Op::Put(Arc::new(Allocation::register(id, Arc::new(spec), n, now)))
    };
    let mut taken = Vec::new();
    let mut n = 0;
    loop {
        n += 1;
        assert!(n < 5000, "never refused");
        match store.commit(big(n)).await {
            Ok(()) => taken.push(n),
            Err(e) => {
                assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}");
                break;
            }
        }
    }
    // Smaller than any put: a deletion of the first, and a put of the
    // smallest record there is.
    let first = AllocId::parse(&format!("p{}", taken[0])).unwrap();
    assert!(
        store.commit(Op::Delete(first)).await.is_err(),
        "a deletion after a refusal"
    );
    assert!(
        store.commit(put(n + 1)).await.is_err(),
        "a put after a refusal"
    );
    store.close().unwrap();
    drop(store);
    std::fs::remove_dir(dir.path().join(NEXT_FILE)).unwrap();
    let loaded: Vec<String> = open(dir.path(), 1).loaded_ids();
    let mut expected: Vec<String> = taken.iter().map(|n| format!("p{n}")).collect();
    expected.sort();
    assert_eq!(loaded, expected);
}

/// The checkpoint thread, if it panics (here: in the file system, writing
/// the next snapshot), is started again by the writer: health names it
/// (`checkpoint_restarted`), and the next checkpoint folds the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_thread_that_panics_is_started_again() {
    use crate::store::fs::sim::{self, SimFs};
    let fs = SimFs::new();
    let dir = std::path::PathBuf::from("/sim/data");
    fs.create_dir_all(&dir).unwrap();
    let mut once = true;
    fs.fail_with(move |op, path| {
        let next = path.to_string_lossy().ends_with(NEXT_FILE);
        if op == sim::Op::Write && next && std::mem::take(&mut once) {
            panic!("a test's panic in the checkpoint thread");
        }
        None
    });
    let supervisor = crate::supervise::Supervisor::new();
    let store = DiskStore::open(DiskStoreConfig {
        log_limit: 1024,
        retry: Duration::from_millis(5),
        fs: Arc::new(fs.clone()),
        supervisor: supervisor.clone(),
        ..DiskStoreConfig::new(dir.clone())
    })
    .unwrap();
    let mut n = 0;
    while store.stats().checkpoints == 0 {
        n += 1;
        assert!(n < 5000, "no checkpoint ever worked");
        store.commit(put(n)).await.unwrap();
    }
    assert_eq!(supervisor.problems(), ["checkpoint_restarted"]);
    store.close().unwrap();
}

/// A panic on the writer's thread (here: in the follower it hands a
/// durable batch to) leaves the log's state unknown: the changes in
/// flight fail, and the supervisor stops the server, whose restart
/// recovers from the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_on_the_writer_thread_stops_the_server() {
    struct Panics;
    impl crate::store::Follower for Panics {
        fn changed(&self, _: Vec<crate::store::Change>, _: u64) {
            panic!("a test's panic in the follower");
        }
        fn resync(&self, _: Loaded) {}
    }
    let dir = tempfile::tempdir().unwrap();
    let supervisor = crate::supervise::Supervisor::new();
    let store = DiskStore::open(DiskStoreConfig {
        supervisor: supervisor.clone(),
        ..DiskStoreConfig::new(dir.path().to_owned())
    })
    .unwrap();
    let follower: Arc<dyn crate::store::Follower> = Arc::new(Panics);
    store.follow(0, Arc::downgrade(&follower));
    assert!(store.commit(put(1)).await.is_err());
    let why = tokio::time::timeout(Duration::from_secs(30), supervisor.stopping())
        .await
        .expect("the server is told to stop");
    assert_eq!(why, "the task `store_writer` panicked");
    assert!(store.close().is_err(), "its thread panicked");
    drop(store);
    let reopened = open(dir.path(), 1);
    assert_eq!(
        reopened.loaded_ids(),
        ["p1"],
        "durable before the follower was handed it"
    );
}

/// A record in the log that passes its append's checks but does not
/// decode is blamed on the segment and the byte of its append (it used to
/// be blamed on the snapshot, which may not even exist).
#[test]
fn a_bad_record_in_the_log_names_its_segment_and_append() {
    let dir = tempfile::tempdir().unwrap();
    let mut s =
        log::Segment::create(&RealFs, dir.path(), 1, log::End::NONE, log::WRITE_AHEAD).unwrap();
    super::manifest::write(&RealFs, dir.path(), 1).unwrap();
    s.append(&mut log::one_append("gone", 1, None)).unwrap();
    let second = s.len;
    s.append(&mut log::one_append("broken", 2, Some(b"{not json")))
        .unwrap();
    drop(s);
    std::fs::write(dir.path().join(LOCK_FILE), b"").unwrap();
    let before = files(dir.path());
    let err = DiskStore::open(config(dir.path(), 1, DEFAULT_LOG_LIMIT))
        .err()
        .unwrap()
        .to_string();
    let segment = log::segment_path(dir.path(), 1).display().to_string();
    assert!(err.contains(&segment), "{err}");
    assert!(
        err.contains(&format!("in the append at byte {second}")),
        "{err}"
    );
    assert!(err.contains("\"broken\""), "{err}");
    assert!(!err.contains(SNAPSHOT_FILE), "{err}");
    assert_eq!(files(dir.path()), before, "nothing changed");
}
