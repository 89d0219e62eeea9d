//! The embedded disk store: a snapshot file and a write-ahead log, one
//! writer thread (group commit) and one checkpoint thread.
//!
//! Requests serialize their record on their own thread and queue it. The
//! writer takes everything queued at that moment (up to `max_batch`),
//! appends it to the log (`wal.rs`) in one write and one `fdatasync`, and
//! only then acknowledges every change in it. A failed append fails every
//! change in the batch, and the log takes nothing more until a restart
//! recovers from it.
//!
//! Once the log holds `log_limit` bytes, the writer seals its segment,
//! starts the next, and hands the newest record of every allocation changed
//! since the last checkpoint to the checkpoint thread, which writes the next
//! snapshot (`snapshot.rs`: the current one merged with those changes,
//! sequentially, renamed into place), recording in it which segment it
//! folded, and then removes the folded segments. The checkpoint thread runs
//! at the lowest priority, in the time requests leave; while a checkpoint
//! runs the log may grow to `LOG_SLACK` times its limit before the writer
//! waits for it. The log on disk (and in memory until folded) — the
//! segments being folded plus those written since — so stays under about
//! `2 × LOG_SLACK` times the limit: 256 MiB by default, what recovery
//! replays at most.
//!
//! Recovery reads the snapshot, then replays the segments it has not
//! folded, in order. A data directory of the pre-release format (a redb
//! file, `taskgate.redb`) is refused, never read as empty.
//!
//! One process at a time: the store holds an exclusive lock on
//! `taskgate.lock` in the data directory while it is open.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, PoisonError,
        mpsc::{self, Receiver, Sender, SyncSender},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use tokio::sync::oneshot;

use super::{
    Commit, LoadOnce, Loaded, Op, Store, StoreError,
    fs::{DirLock, Fs, LockError, Open, RealFs},
    record,
    snapshot::{self, NEXT_FILE, OLD_FILE, SNAPSHOT_FILE, Snapshot},
    wal::{self, Overlay},
};
use crate::{lifecycle::Allocation, metrics::Metrics};

/// The lock file's name inside the data directory.
pub const LOCK_FILE: &str = "taskgate.lock";

#[derive(Clone)]
pub struct DiskStoreConfig {
    pub dir: PathBuf,
    /// Most changes in one commit; 1 turns group commit off.
    pub max_batch: usize,
    /// Log bytes after which a checkpoint folds them into the snapshot (or a
    /// quarter of the snapshot's size, if that is larger).
    pub log_limit: u64,
    /// Unfolded log past which writes are refused (at least `4 ×` the
    /// log's limit: under a working checkpoint the log never comes near).
    pub log_ceiling: u64,
    /// The first wait before a failed checkpoint or rollover is tried
    /// again (then doubling, up to a minute).
    pub retry: Duration,
    /// Where commit latency and batch sizes are recorded.
    pub metrics: Option<Arc<Metrics>>,
    /// Where the files are: the real file system, or a simulated one in
    /// tests.
    pub fs: Arc<dyn Fs>,
    /// Changes queued for the writer at most (`COMMIT_QUEUE`).
    pub commit_queue: usize,
}

impl std::fmt::Debug for DiskStoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskStoreConfig")
            .field("dir", &self.dir)
            .field("max_batch", &self.max_batch)
            .field("log_limit", &self.log_limit)
            .field("log_ceiling", &self.log_ceiling)
            .finish_non_exhaustive()
    }
}

impl DiskStoreConfig {
    /// The defaults for a data directory.
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            max_batch: 4096,
            log_limit: DEFAULT_LOG_LIMIT,
            log_ceiling: DEFAULT_LOG_CEILING,
            retry: RETRY_FIRST,
            metrics: None,
            fs: Arc::new(RealFs),
            commit_queue: COMMIT_QUEUE,
        }
    }
}

/// Changes queued for the writer at most; one more is refused (503
/// `store_unavailable`) instead of memory growing without bound. Far more
/// than the connections a server takes can have in flight.
const COMMIT_QUEUE: usize = 65_536;

/// Default size of the log between checkpoints.
pub const DEFAULT_LOG_LIMIT: u64 = 64 * 1024 * 1024;
/// Default ceiling of the log not yet folded, while checkpoints fail: a
/// checkpoint reads all of it back, and a start replays it into memory.
pub const DEFAULT_LOG_CEILING: u64 = 1024 * 1024 * 1024;
/// How far past its limit the log may grow while a checkpoint runs.
const LOG_SLACK: u64 = 2;
/// The log's limit is at least the snapshot's size divided by this. A
/// checkpoint rewrites the whole snapshot, so its cost grows with the
/// number of allocations; with the limit growing alike, its cost per
/// change stays the same at any size (and the disk writes at most ~4
/// snapshot bytes per log byte).
const SNAPSHOT_RATIO: u64 = 4;

enum Msg {
    /// One change, as its log frame (built and checksummed by the
    /// requester, on its own thread).
    Change {
        frame: Vec<u8>,
        ack: oneshot::Sender<Result<(), StoreError>>,
    },
    Close(mpsc::SyncSender<()>),
}

/// Counters of the writer and the checkpoints, for tests and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Durable commits (log appends) made.
    pub commits: u64,
    /// Changes (puts and deletes) in them.
    pub changes: u64,
    /// Checkpoints (snapshots written).
    pub checkpoints: u64,
    /// Records (one per allocation changed) those checkpoints wrote.
    pub folded: u64,
    /// Checkpoints that failed, and failed tries to start a log segment.
    pub failed_checkpoints: u64,
    pub failed_rollovers: u64,
}

pub struct DiskStore {
    /// Held (locked) while the store is open.
    _lock: Box<dyn DirLock>,
    /// The data directory's ID (`identity.rs`).
    id: String,
    /// Written by the writer and the checkpoints; read by `stats`.
    stats: Arc<Mutex<StoreStats>>,
    dir: PathBuf,
    /// Queue to the writer thread; `None` once closed.
    queue: Mutex<Option<SyncSender<Msg>>>,
    /// The writer, then the checkpoint thread, joined in that order.
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// What the store held at open, until `load` takes it.
    recovered: LoadOnce,
    /// What is wrong with the writer's work, shared with it.
    trouble: Arc<Mutex<Trouble>>,
}

fn unusable(path: &Path, what: impl std::fmt::Display) -> StoreError {
    StoreError::Unusable(format!(
        "snapshot {}: {what}. Nothing in it was changed. The data directory must be \
         restored from a backup as a whole (the snapshot and its log segments belong \
         together), or moved away to start with an empty store.",
        path.display()
    ))
}

fn unusable_log(path: &Path, what: impl std::fmt::Display) -> StoreError {
    StoreError::Unusable(format!(
        "store log segment {}: {what}. Nothing in it was changed. The data directory must \
         be restored from a backup as a whole (the snapshot and its log segments belong \
         together).",
        path.display()
    ))
}

impl DiskStore {
    /// Opens (or creates) the store in its directory, reads and checks
    /// everything it holds, and starts the writer
    /// and checkpoint threads. Nothing in the directory changes until the
    /// snapshot and the log have been read through and every record
    /// decoded: a refused start leaves the directory as it found it (but
    /// for the lock file).
    pub fn open(config: DiskStoreConfig) -> Result<Self, StoreError> {
        let fs = &*config.fs;
        fs.create_dir_all(&config.dir).map_err(|e| {
            StoreError::Unusable(format!(
                "cannot create the data directory {}: {e}",
                config.dir.display()
            ))
        })?;
        let lock = lock(fs, &config.dir)?;
        refuse_pre_release(&config.dir)?;
        let path = config.dir.join(SNAPSHOT_FILE);
        let folded = snapshot_folded(fs, &config.dir)?;
        let snapshot_bytes = fs
            .open(&path, Open::Read)
            .and_then(|f| f.len())
            .unwrap_or(0);
        let recovery = scan_log(fs, &config.dir, folded)?;
        let loaded = load_with(fs, &config.dir, &recovery.overlay)?;
        // Everything read back: only now is anything changed.
        recovery.apply(fs, &config.dir)?;
        let id = super::identity::ensure(fs, &config.dir)?;
        let (log_bytes, next_seq) = (recovery.log_bytes, recovery.next_seq);
        drop(recovery);
        let segment = wal::Segment::create(fs, &config.dir, next_seq).map_err(|e| {
            StoreError::Unusable(format!(
                "cannot create the store log segment {}: {e}. {}; the directory holds every \
                 acknowledged change.",
                wal::segment_path(&config.dir, next_seq).display(),
                mend(&e)
            ))
        })?;
        let stats = Arc::new(Mutex::new(StoreStats::default()));
        // One checkpoint at a time: the writer sends the next job only
        // once it has the last one's answer.
        let (jobs, jobs_rx) = mpsc::sync_channel(1);
        let (done, done_rx) = mpsc::channel();
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(f)
                .map_err(|e| StoreError::Unusable(format!("cannot start the {name} thread: {e}")))
        };
        let checkpointer = {
            let (dir, stats) = (config.dir.clone(), stats.clone());
            let metrics = config.metrics.clone();
            let fs = config.fs.clone();
            spawn(
                "taskgate-checkpoint",
                Box::new(move || {
                    checkpointer(
                        &*fs,
                        &dir,
                        folded,
                        &jobs_rx,
                        &done,
                        &stats,
                        metrics.as_deref(),
                    )
                }),
            )?
        };
        let (tx, rx) = mpsc::sync_channel(config.commit_queue.max(1));
        let trouble = Arc::new(Mutex::new(Trouble::default()));
        let log_limit = config.log_limit.max(1);
        let writer = Writer {
            fs: config.fs.clone(),
            dir: config.dir.clone(),
            // The live segments recovered are folded by the first
            // checkpoint, with the new one.
            log_bytes: log_bytes + segment.len,
            sealed: Vec::new(),
            segment,
            log_limit,
            log_ceiling: config.log_ceiling.max(4 * log_limit),
            jobs,
            done: done_rx,
            snapshot_bytes,
            in_flight: false,
            trouble: trouble.clone(),
            retry_at: None,
            retry_first: config.retry,
            backoff: config.retry,
            max_batch: config.max_batch.max(1),
            stats: stats.clone(),
            metrics: config.metrics.clone(),
        };
        let writer = spawn("taskgate-store", Box::new(move || writer.run(&rx)))?;
        Ok(Self {
            _lock: lock,
            id,
            stats,
            dir: config.dir,
            queue: Mutex::new(Some(tx)),
            threads: Mutex::new(vec![writer, checkpointer]),
            recovered: LoadOnce::new(loaded),
            trouble,
        })
    }

    /// The data directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn stats(&self) -> StoreStats {
        *self.stats.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues a change for the writer without blocking: a full queue is
    /// refused, not waited on (the caller is an async task).
    fn send(&self, msg: Msg) -> Result<(), StoreError> {
        let queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(q) = queue.as_ref() else {
            return Err(StoreError::Closed);
        };
        q.try_send(msg).map_err(|e| match e {
            mpsc::TrySendError::Full(_) => StoreError::Unavailable(
                "the commit queue is full: changes are waiting for the disk; try again".into(),
            ),
            mpsc::TrySendError::Disconnected(_) => StoreError::Closed,
        })
    }

    /// Waits for the writer (after what is queued) and then the checkpoint
    /// thread (after its checkpoint) to finish.
    fn join(&self) -> Result<(), StoreError> {
        let threads =
            std::mem::take(&mut *self.threads.lock().unwrap_or_else(PoisonError::into_inner));
        let mut result = Ok(());
        for t in threads {
            if t.join().is_err() {
                result = Err(StoreError::Io("a store thread panicked".into()));
            }
        }
        result
    }
}

/// The file of the pre-release store (redb), which no release reads.
pub const REDB_FILE: &str = "taskgate.redb";

/// A directory holding only a pre-release store is refused and named: read
/// as an empty store, its allocations would be lost without a word. The
/// first release's format (the snapshot and its log) is the baseline.
fn refuse_pre_release(dir: &Path) -> Result<(), StoreError> {
    if dir.join(REDB_FILE).exists() && !dir.join(SNAPSHOT_FILE).exists() {
        return Err(StoreError::Unusable(format!(
            "{} holds a store of taskgate's pre-release format ({REDB_FILE}), which this \
             taskgate does not read; move the directory away to start with an empty store",
            dir.display()
        )));
    }
    Ok(())
}

/// Takes the data directory's lock, or says who holds it.
fn lock(fs: &dyn Fs, dir: &Path) -> Result<Box<dyn DirLock>, StoreError> {
    let path = dir.join(LOCK_FILE);
    fs.lock(&path).map_err(|e| match e {
        LockError::Held => StoreError::Unusable(format!(
            "the data directory {} is in use by another process (is another taskgate running on it?)",
            dir.display()
        )),
        LockError::Io(e) => {
            StoreError::Unusable(format!("cannot lock {}: {e}", path.display()))
        }
    })
}

/// The last log segment the snapshot in `dir` folded (0 without a
/// snapshot). A snapshot that is missing while the one it replaced is
/// still there, or while the log starts past segment 1, is a lost
/// snapshot, not an empty store (see `scan_log`).
fn snapshot_folded(fs: &dyn Fs, dir: &Path) -> Result<u64, StoreError> {
    let path = dir.join(SNAPSHOT_FILE);
    match Snapshot::open(fs, dir) {
        Ok(Some(s)) => Ok(s.folded),
        Ok(None) if fs.exists(&dir.join(OLD_FILE)) => Err(unusable(
            &path,
            format!(
                "it is missing, but the snapshot it replaced ({OLD_FILE}) is there: a snapshot \
                 is only ever replaced by a rename, so it was removed by something else"
            ),
        )),
        Ok(None) => Ok(0),
        Err(e) => Err(unusable(&path, format!("cannot be read: {e}"))),
    }
}

/// What the log holds, read without changing anything, and what a start
/// must then tidy (`apply`).
struct Recovery {
    overlay: Overlay,
    /// Bytes of the live segments, up to their last good frame.
    log_bytes: u64,
    /// The sequence number of the segment to write next.
    next_seq: u64,
    /// Segments the snapshot already folded (a checkpoint stopped before
    /// removing them).
    folded: Vec<PathBuf>,
    /// The newest segment's torn tail: the segment and where to cut it.
    torn: Option<(PathBuf, wal::Bad, u64)>,
}

/// Replays the log segments `folded` does not cover into an overlay. They
/// must run on from `folded + 1` with no gap, each read back whole; only
/// the newest may end in a torn append (`wal.rs` says what counts as
/// torn), which `Recovery::apply` then cuts off. Anything else stops the
/// start, naming the file and the offset.
fn scan_log(fs: &dyn Fs, dir: &Path, folded: u64) -> Result<Recovery, StoreError> {
    let dir_error = |e: std::io::Error| {
        StoreError::Unusable(format!(
            "cannot read the store log in {}: {e}",
            dir.display()
        ))
    };
    let mut recovery = Recovery {
        overlay: Overlay::default(),
        log_bytes: 0,
        next_seq: folded + 1,
        folded: Vec::new(),
        torn: None,
    };
    let (done, live): (Vec<_>, Vec<_>) = wal::list_segments(fs, dir)
        .map_err(dir_error)?
        .into_iter()
        .partition(|(seq, _)| *seq <= folded);
    recovery.folded = done.into_iter().map(|(_, path)| path).collect();
    let count = live.len();
    for (i, (seq, path)) in live.into_iter().enumerate() {
        if seq != recovery.next_seq {
            let why = if folded == 0 && i == 0 {
                format!(
                    "the log starts at segment {seq}: segment 1 is missing, or the snapshot \
                     that folded the segments before {seq} ({}) is",
                    dir.join(SNAPSHOT_FILE).display()
                )
            } else {
                format!(
                    "segment {} is missing (the snapshot has folded up to segment {folded})",
                    recovery.next_seq
                )
            };
            return Err(unusable_log(&path, why));
        }
        let content = fs
            .read(&path)
            .map_err(|e| unusable_log(&path, format!("cannot be read: {e}")))?;
        let r = wal::replay(&content, seq, &mut recovery.overlay)
            .map_err(|e| unusable_log(&path, e))?;
        recovery.next_seq = seq + 1;
        recovery.log_bytes += r.valid_len;
        let Some(bad) = r.bad else { continue };
        let newest = i + 1 == count;
        if !(newest && bad.torn) {
            let mut why = format!(
                "it is damaged at byte {}: the frame there {}; the {} bytes from there on \
                 cannot be read",
                bad.at, bad.what, bad.bytes
            );
            if !newest {
                why.push_str(", and newer segments follow it");
            }
            why.push_str(". `taskgate dump --salvage` copies what can be read to a new directory");
            return Err(unusable_log(&path, why));
        }
        recovery.torn = Some((path, bad, r.valid_len));
    }
    Ok(recovery)
}

impl Recovery {
    /// Tidies the data directory once everything in it has been read: cuts
    /// the torn tail off the newest segment (kept beside it as
    /// `<segment>.broken`), and removes the segments already folded, an
    /// unfinished snapshot and an unfinished segment.
    fn apply(&self, fs: &dyn Fs, dir: &Path) -> Result<(), StoreError> {
        if let Some((path, bad, len)) = &self.torn {
            let names_before = fs.list(dir).unwrap_or_default();
            let aside = wal::cut(fs, path, *len)
                .map_err(|e| cut_failed(fs, dir, path, *len, &names_before, e))?;
            tracing::warn!(
                segment = %path.display(),
                at = bad.at,
                bytes = bad.bytes,
                kept_in = %aside.display(),
                "cut off an unfinished append at the end of the store log (the frame there {}; \
                 it was never acknowledged)",
                bad.what
            );
        }
        let mut removed = false;
        for path in &self.folded {
            fs.remove_file(path)
                .map_err(|e| unusable_log(path, format!("cannot remove it: {e}")))?;
            removed = true;
        }
        // A checkpoint that stopped before its rename, a segment creation
        // that stopped before its rename: incomplete, never used.
        for name in [NEXT_FILE, wal::SEGMENT_TEMP] {
            let path = dir.join(name);
            match fs.remove_file(&path) {
                Ok(()) => removed = true,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(StoreError::Unusable(format!(
                        "cannot remove the unfinished {}: {e}",
                        path.display()
                    )));
                }
            }
        }
        if removed {
            fs.sync_dir(dir).map_err(|e| {
                StoreError::Unusable(format!(
                    "cannot sync the data directory {}: {e}",
                    dir.display()
                ))
            })?;
        }
        Ok(())
    }
}

/// What an operator does about a file system error that stopped a start
/// before or after it changed anything; the data is not damaged.
fn mend(e: &std::io::Error) -> &'static str {
    if e.kind() == std::io::ErrorKind::StorageFull {
        "The file system is full: free space on it and start again"
    } else {
        "Mend that (the data directory must take writes) and start again"
    }
}

/// Why a start could not cut the torn tail off segment `path` (back to
/// `len` bytes). The log is not damaged: what stopped the start is the
/// file system (full, read-only, failing), so the answer says to mend that
/// and start again, not to restore a backup. While the segment is still
/// whole, the start has changed nothing, and a `.broken` file the cut
/// began (empty or partial) is removed so that this stays true.
fn cut_failed(
    fs: &dyn Fs,
    dir: &Path,
    path: &Path,
    len: u64,
    names_before: &[std::ffi::OsString],
    e: std::io::Error,
) -> StoreError {
    let what = format!(
        "store log segment {}: it ends in an unfinished append (never acknowledged), which a \
         start keeps aside in a `{}` file and then cuts off; that failed ({e}). {}",
        path.display(),
        wal::BROKEN_SUFFIX,
        mend(&e)
    );
    match fs.open(path, Open::Read).and_then(|f| f.len()) {
        Ok(n) if n > len => {}
        // The tail was made durable in its `.broken` file before the cut
        // began, so whether or not the cut happened, nothing is lost.
        Ok(_) => {
            return StoreError::Unusable(format!(
                "{what}; the segment was cut back and its tail kept beside it. Nothing \
                 acknowledged is lost."
            ));
        }
        Err(_) => {
            return StoreError::Unusable(format!(
                "{what}; whether the segment was cut back cannot be read. Nothing acknowledged \
                 is lost (the tail is kept aside before any cut)."
            ));
        }
    }
    let mut prefix = path.file_name().unwrap_or_default().to_owned();
    prefix.push(wal::BROKEN_SUFFIX);
    let prefix = prefix.to_string_lossy().into_owned();
    let begun = fs
        .list(dir)
        .unwrap_or_default()
        .into_iter()
        .filter(|n| n.to_string_lossy().starts_with(&prefix) && !names_before.contains(n));
    let mut left = Vec::new();
    for n in begun {
        let p = dir.join(&n);
        if fs.remove_file(&p).is_err() {
            left.push(p.display().to_string());
        }
    }
    if left.is_empty() {
        // A crash before this sync can only bring back a stray `.broken`
        // copy, which holds nothing acknowledged.
        let _ = fs.sync_dir(dir);
        StoreError::Unusable(format!(
            "{what}. Nothing in the data directory was changed."
        ))
    } else {
        StoreError::Unusable(format!(
            "{what}, after removing the unfinished copy {} (it holds nothing acknowledged). \
             Nothing else in the data directory was changed.",
            left.join(", ")
        ))
    }
}

/// Every record of the snapshot in `dir` with the log's changes
/// (`overlay`) over it, decoded.
fn load_with(fs: &dyn Fs, dir: &Path, overlay: &Overlay) -> Result<Loaded, StoreError> {
    let path = dir.join(SNAPSHOT_FILE);
    let io = |e: std::io::Error| unusable(&path, format!("cannot be read: {e}"));
    let mut base = Snapshot::open(fs, dir).map_err(io)?;
    let stored_index = base.as_ref().map_or(0, |b| b.last_index);
    // The log's changes are newer than the snapshot's records: merged in ID
    // order, a logged record replaces the snapshot's, a logged deletion
    // drops it.
    let changes = snapshot::sorted(overlay);
    let stored = base.as_ref().map_or(0, Snapshot::records);
    let mut loader = Loader::new(&path, usize::try_from(stored).unwrap_or(0) + changes.len());
    let mut failed = None;
    snapshot::load(base.as_mut(), &changes, |id, record| {
        loader.push(id.to_owned(), record.to_vec()).map_err(|e| {
            failed = Some(e);
            std::io::Error::other("a record did not decode")
        })
    })
    .map_err(|e| failed.take().unwrap_or_else(|| io(e)))?;
    Ok(Loaded {
        allocations: loader.finish()?,
        last_index: stored_index.max(overlay.last_index),
        ..Default::default()
    })
}

/// A shared lock on `dir`, held while reading it from outside a store: a
/// checkpoint must not replace the files midway. Refused while a taskgate
/// has the directory open. A directory no store has opened has no lock
/// file (`None`); nothing is created in it.
pub(super) fn lock_shared(dir: &Path) -> Result<Option<std::fs::File>, StoreError> {
    if !dir.is_dir() {
        return Err(StoreError::Unusable(format!(
            "{} is not a data directory",
            dir.display()
        )));
    }
    let lock_path = dir.join(LOCK_FILE);
    match std::fs::File::open(&lock_path) {
        Ok(file) => match file.try_lock_shared() {
            Ok(()) => Ok(Some(file)),
            Err(std::fs::TryLockError::WouldBlock) => Err(StoreError::Unusable(format!(
                "the data directory {} is in use by a running taskgate: stop it first, \
                 or work on a copy of the directory",
                dir.display()
            ))),
            Err(std::fs::TryLockError::Error(e)) => Err(StoreError::Unusable(format!(
                "cannot lock {}: {e}",
                lock_path.display()
            ))),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(StoreError::Unusable(format!(
            "cannot open the lock file {}: {e}",
            lock_path.display()
        ))),
    }
}

/// Everything the data directory `dir` holds, read without changing a
/// byte of it (`taskgate dump`): what a start would load, except that an
/// unfinished append at the end of the log is left where it is. Refused
/// while a taskgate has the directory open.
pub fn read_only(dir: &Path) -> Result<Loaded, StoreError> {
    let _lock = lock_shared(dir)?;
    refuse_pre_release(dir)?;
    let recovery = scan_log(&RealFs, dir, snapshot_folded(&RealFs, dir)?)?;
    load_with(&RealFs, dir, &recovery.overlay)
}

impl Store for DiskStore {
    fn load(&self) -> Result<Loaded, StoreError> {
        self.recovered.take()
    }

    fn id(&self) -> &str {
        &self.id
    }

    fn commit(&self, op: Op) -> Commit {
        let (ack, done) = oneshot::channel();
        // Sized for a typical record, so encoding it rarely reallocates.
        let mut frame = Vec::with_capacity(1024);
        match op {
            Op::Put(a) => wal::frame_with(&mut frame, a.id.as_str(), a.modify_index, true, |buf| {
                record::encode_into(&a, buf);
            }),
            Op::Delete { id, index } => wal::frame(&mut frame, id.as_str(), index, None),
        }
        let msg = Msg::Change { frame, ack };
        if let Err(e) = self.send(msg) {
            return Box::pin(async { Err(e) });
        }
        Box::pin(async move { done.await.unwrap_or(Err(StoreError::Closed)) })
    }

    fn health(&self) -> super::StoreHealth {
        let t = self.trouble.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(cause) = &t.write {
            return super::StoreHealth::Refusing {
                code: "write_failed",
                cause: cause.clone(),
            };
        }
        if t.full {
            return super::StoreHealth::Refusing {
                code: "log_full",
                cause: format!(
                    "the store log reached its ceiling; checkpoints fail: {}",
                    t.checkpoint
                        .as_deref()
                        .unwrap_or("(no checkpoint has failed)")
                ),
            };
        }
        let mut codes = Vec::new();
        if t.checkpoint.is_some() {
            codes.push("checkpoints_failing");
        }
        if t.rollover.is_some() {
            codes.push("log_rollover_failing");
        }
        if codes.is_empty() {
            super::StoreHealth::Ok
        } else {
            super::StoreHealth::Degraded(codes)
        }
    }

    fn close(&self) -> Result<(), StoreError> {
        let (tx, rx) = mpsc::sync_channel(1);
        // Send the close and drop the queue under one lock, so no change
        // can be queued behind the close.
        let sent = {
            let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            let sent = queue
                .as_ref()
                .is_some_and(|q| q.send(Msg::Close(tx)).is_ok());
            queue.take();
            sent
        };
        if sent {
            let _ = rx.recv();
        }
        self.join()
    }
}

impl Drop for DiskStore {
    fn drop(&mut self) {
        // Stops the writer after what is queued; `close` may have done it.
        self.queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let _ = self.join();
    }
}

/// Decodes loaded records in chunks, each chunk on every core: decoding
/// is most of a recovery.
struct Loader<'a> {
    path: &'a Path,
    raw: Vec<(String, Vec<u8>)>,
    allocations: Vec<Allocation>,
    specs: crate::lifecycle::SpecInterner,
}

impl<'a> Loader<'a> {
    const CHUNK: usize = 16_384;

    fn new(path: &'a Path, capacity: usize) -> Self {
        Self {
            path,
            raw: Vec::with_capacity(Self::CHUNK),
            allocations: Vec::with_capacity(capacity),
            specs: Default::default(),
        }
    }

    /// Takes the records in key order.
    fn push(&mut self, key: String, bytes: Vec<u8>) -> Result<(), StoreError> {
        self.raw.push((key, bytes));
        if self.raw.len() == Self::CHUNK {
            self.decode()?;
        }
        Ok(())
    }

    fn decode(&mut self) -> Result<(), StoreError> {
        let decoded = decode_parallel(&self.raw);
        for ((key, _), result) in self.raw.drain(..).zip(decoded) {
            let mut a = result.map_err(|e| {
                unusable(
                    self.path,
                    format!("the record of allocation {key:?} is unreadable: {e}"),
                )
            })?;
            if a.id.as_str() != key {
                return Err(unusable(
                    self.path,
                    format!("the record under {key:?} is for allocation {:?}", a.id),
                ));
            }
            a.spec = self.specs.share(a.spec);
            self.allocations.push(a);
        }
        Ok(())
    }

    fn finish(mut self) -> Result<Vec<Allocation>, StoreError> {
        self.decode()?;
        Ok(self.allocations)
    }
}

/// A checkpoint to write: every segment up to `sealed` (and after the
/// last one folded) into the next snapshot.
struct Job {
    sealed: u64,
}

/// What is wrong with the store's background work, shared between the
/// writer (which keeps it) and `DiskStore::health`.
#[derive(Debug, Default)]
struct Trouble {
    /// Why the log takes no more changes, after a failed append: for good,
    /// until a restart recovers from the log.
    write: Option<String>,
    /// The last checkpoint's error, while checkpoints fail.
    checkpoint: Option<String>,
    /// The last error starting a new log segment, while that fails.
    rollover: Option<String>,
    /// The log not yet folded reached its ceiling: writes are refused
    /// until a checkpoint succeeds.
    full: bool,
}

/// How long the writer waits before trying a failed checkpoint or
/// rollover again, at first and at most (doubling in between): a
/// checkpoint reads the whole unfolded log back, and tried after every
/// commit, failing ones cut throughput threefold.
const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(60);
/// How often the writer, idle, looks for the answer of a checkpoint that
/// tries again.
const RETRY_POLL: Duration = Duration::from_millis(10);

/// The single writer: one log append and one `fdatasync` per batch.
struct Writer {
    fs: Arc<dyn Fs>,
    dir: PathBuf,
    segment: wal::Segment,
    /// Bytes of the current segment.
    log_bytes: u64,
    /// Sealed segments not folded yet, and their bytes.
    sealed: Vec<(u64, u64)>,
    log_limit: u64,
    /// Unfolded log past which writes are refused.
    log_ceiling: u64,
    jobs: SyncSender<Job>,
    /// One answer per job: the new snapshot's size, or why the checkpoint
    /// failed.
    done: Receiver<Result<u64, String>>,
    /// The snapshot's size (see `SNAPSHOT_RATIO`).
    snapshot_bytes: u64,
    in_flight: bool,
    /// Shared with `DiskStore::health`.
    trouble: Arc<Mutex<Trouble>>,
    /// When a failed checkpoint or rollover is tried again, and the wait
    /// after the next failure.
    retry_at: Option<Instant>,
    retry_first: Duration,
    backoff: Duration,
    max_batch: usize,
    stats: Arc<Mutex<StoreStats>>,
    metrics: Option<Arc<Metrics>>,
}

impl Writer {
    fn run(mut self, queue: &Receiver<Msg>) {
        let mut batch = Vec::with_capacity(self.max_batch);
        let mut buf = Vec::new();
        let mut acks = Vec::new();
        loop {
            // While something failed, wake up to try it again (and to
            // collect the try's answer) even if no change comes.
            let first = match self.wake_at() {
                None => queue
                    .recv()
                    .map_err(|_| mpsc::RecvTimeoutError::Disconnected),
                Some(at) => queue.recv_timeout(at.saturating_duration_since(Instant::now())),
            };
            let first = match first {
                Ok(msg) => msg,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    self.maintain();
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            };
            batch.push(first);
            while batch.len() < self.max_batch {
                match queue.try_recv() {
                    Ok(msg) => batch.push(msg),
                    Err(_) => break,
                }
            }
            let mut closing = None;
            buf.clear();
            for msg in batch.drain(..) {
                match msg {
                    Msg::Change { frame, ack } => {
                        buf.extend_from_slice(&frame);
                        acks.push(ack);
                    }
                    // Everything queued before the close is in this batch.
                    Msg::Close(done) => closing = Some(done),
                }
            }
            if !acks.is_empty() {
                let started = Instant::now();
                let result = self.append(&mut buf);
                if result.is_ok() {
                    if let Some(m) = &self.metrics {
                        m.commit(started.elapsed(), acks.len());
                        m.unfolded_log(self.unfolded());
                    }
                    let mut s = self.stats.lock().unwrap_or_else(PoisonError::into_inner);
                    s.commits += 1;
                    s.changes += acks.len() as u64;
                }
                for ack in acks.drain(..) {
                    let _ = ack.send(result.clone());
                }
                self.maintain();
            }
            if let Some(closed) = closing {
                let _ = closed.send(());
                return;
            }
        }
    }

    /// When to look at the background work without a change to commit:
    /// the next try of what failed, or soon after a try is in flight.
    fn wake_at(&self) -> Option<Instant> {
        if self.retry_at.is_some() {
            return self.retry_at;
        }
        let t = self.trouble();
        let retrying = t.checkpoint.is_some() || t.rollover.is_some() || t.full;
        (retrying && self.in_flight).then(|| Instant::now() + RETRY_POLL)
    }

    fn trouble(&self) -> std::sync::MutexGuard<'_, Trouble> {
        self.trouble.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The log not folded yet: the sealed segments and the current one.
    fn unfolded(&self) -> u64 {
        self.sealed.iter().map(|(_, b)| b).sum::<u64>() + self.log_bytes
    }

    fn append(&mut self, buf: &mut [u8]) -> Result<(), StoreError> {
        if let Some(why) = &self.trouble().write {
            return Err(StoreError::Io(why.clone()));
        }
        let unfolded = self.unfolded();
        if unfolded + buf.len() as u64 > self.log_ceiling {
            let mut t = self.trouble();
            if !t.full {
                t.full = true;
                tracing::error!(
                    unfolded_bytes = unfolded,
                    ceiling = self.log_ceiling,
                    "the store log reached its ceiling because checkpoints fail; writes are refused \
                     until a checkpoint succeeds"
                );
            }
            return Err(StoreError::Unavailable(format!(
                "the store log holds {unfolded} bytes not yet folded into the snapshot, its \
                 ceiling, because checkpoints fail; writes are refused until one succeeds"
            )));
        }
        match self.segment.append(buf) {
            Ok(()) => {
                self.log_bytes += buf.len() as u64;
                Ok(())
            }
            Err(e) => {
                // After a failed write or fsync the file's state is not
                // known; appending after it could put acknowledged changes
                // behind a torn frame, which recovery would not reach.
                let why = format!(
                    "writing the store log failed ({e}); no change is accepted until taskgate \
                     is restarted and recovers from the log"
                );
                tracing::error!(error = %e, "store log append failed; the store takes no more changes");
                self.trouble().write = Some(why.clone());
                Err(StoreError::Io(why))
            }
        }
    }

    /// The log size at which the next checkpoint starts.
    fn limit(&self) -> u64 {
        self.log_limit.max(self.snapshot_bytes / SNAPSHOT_RATIO)
    }

    /// Takes a finished checkpoint's answer, then seals the current
    /// segment and starts the next checkpoint if the log is past its limit.
    /// While a checkpoint runs, the log may grow to `LOG_SLACK` times its
    /// limit; past that the writer waits for it, which bounds the log (and
    /// what recovery replays). A failed checkpoint or rollover is tried
    /// again after a wait that doubles with each failure.
    fn maintain(&mut self) {
        if self.in_flight {
            let answer = match self.done.try_recv() {
                Ok(answer) => Ok(answer),
                Err(mpsc::TryRecvError::Empty)
                    if self.log_bytes < self.limit().saturating_mul(LOG_SLACK) =>
                {
                    Err(false)
                }
                Err(mpsc::TryRecvError::Empty) => self.done.recv().map_err(|_| true),
                Err(mpsc::TryRecvError::Disconnected) => Err(true),
            };
            let answer = match answer {
                Ok(answer) => answer,
                Err(gone) => {
                    if gone {
                        self.checkpointer_gone();
                    }
                    return;
                }
            };
            self.in_flight = false;
            self.finished(answer);
        }
        if self.log_bytes < self.limit() && self.retry_at.is_none() {
            return;
        }
        if self.retry_at.is_some_and(|at| Instant::now() < at) {
            return;
        }
        // Seal the current segment (unless it is empty: a retry of a
        // failed checkpoint alone), then fold everything sealed.
        if self.log_bytes > wal::Segment::HEADER_LEN {
            let next = match wal::Segment::create(&*self.fs, &self.dir, self.segment.seq + 1) {
                Ok(next) => next,
                Err(e) => {
                    let e = e.to_string();
                    if self.trouble().rollover.replace(e.clone()).is_none() {
                        tracing::error!(error = %e, "cannot start a new store log segment; the log grows past its limit until this works");
                    }
                    self.failed(false);
                    return;
                }
            };
            if self.trouble().rollover.take().is_some() {
                tracing::info!("store log segments can be started again");
            }
            let sealed = std::mem::replace(&mut self.segment, next);
            self.sealed.push((sealed.seq, self.log_bytes));
            self.log_bytes = self.segment.len;
        }
        let Some(&(last, _)) = self.sealed.last() else {
            self.retry_at = None;
            return;
        };
        if self.jobs.send(Job { sealed: last }).is_ok() {
            self.in_flight = true;
            // Tried: the next try comes with the answer.
            self.retry_at = None;
        }
    }

    /// The checkpoint thread is gone (it panicked): said once, as a
    /// failing checkpoint, so health shows it and the log's ceiling stops
    /// the growth that follows.
    fn checkpointer_gone(&mut self) {
        let mut t = self.trouble();
        if t.checkpoint.is_none() {
            tracing::error!("the checkpoint thread is gone; the store log grows until its ceiling");
            t.checkpoint = Some("the checkpoint thread is gone".into());
        }
    }

    /// A checkpoint's answer.
    fn finished(&mut self, answer: Result<u64, String>) {
        match answer {
            Ok(bytes) => {
                self.snapshot_bytes = bytes;
                self.sealed.clear();
                if let Some(m) = &self.metrics {
                    m.unfolded_log(self.unfolded());
                }
                self.backoff = self.retry_first;
                let mut t = self.trouble();
                if t.checkpoint.take().is_some() {
                    tracing::info!("store checkpoints work again");
                }
                if std::mem::take(&mut t.full) {
                    tracing::info!(
                        "the store log is folded below its ceiling; writes are taken again"
                    );
                }
            }
            Err(e) => {
                if self.trouble().checkpoint.replace(e.clone()).is_none() {
                    tracing::error!(error = %e, "store checkpoint failed; its changes stay in the log, and it is tried again until it works");
                }
                self.failed(true);
            }
        }
    }

    /// Counts a failed checkpoint or rollover and schedules the next try.
    fn failed(&mut self, checkpoint: bool) {
        if let Some(m) = &self.metrics {
            m.store_failure(if checkpoint { "checkpoint" } else { "rollover" });
        }
        let mut s = self.stats.lock().unwrap_or_else(PoisonError::into_inner);
        if checkpoint {
            s.failed_checkpoints += 1;
        } else {
            s.failed_rollovers += 1;
        }
        drop(s);
        self.retry_at = Some(Instant::now() + self.backoff);
        self.backoff = (self.backoff * 2).min(RETRY_MAX);
    }
}

/// Folds sealed segments into the next snapshot, one job at a time: reads
/// back the segments after `folded` up to the job's, keeps the newest
/// change of each allocation, and merges them into the next snapshot. The
/// writer keeps none of it in memory. A failed checkpoint leaves `folded`
/// where it was, so the next job reads its segments again.
fn checkpointer(
    fs: &dyn Fs,
    dir: &Path,
    mut folded: u64,
    jobs: &Receiver<Job>,
    done: &Sender<Result<u64, String>>,
    stats: &Mutex<StoreStats>,
    metrics: Option<&Metrics>,
) {
    // Checkpoints yield to requests: the kernel runs this thread at the
    // lowest priority, in the time the request threads leave (they wait
    // on every commit's fsync). On Linux the nice value is per thread.
    if let Err(e) = rustix::process::setpriority_process(None, 19) {
        tracing::warn!(error = %e, "cannot lower the checkpoint thread's priority");
    }
    while let Ok(job) = jobs.recv() {
        let started = Instant::now();
        match checkpoint(fs, dir, folded, job.sealed) {
            Ok((written, changes)) => {
                if let Some(m) = metrics {
                    m.checkpoint(started.elapsed(), changes);
                }
                let mut s = stats.lock().unwrap_or_else(PoisonError::into_inner);
                s.checkpoints += 1;
                s.folded += changes as u64;
                drop(s);
                folded = job.sealed;
                remove_folded(fs, dir, job.sealed);
                let _ = done.send(Ok(written.bytes));
            }
            // Logged by the writer, once for a run of failures.
            Err(e) => {
                let _ = done.send(Err(e.to_string()));
            }
        }
    }
}

/// One checkpoint: the sealed segments after `folded` up to `sealed` read
/// back whole, the newest change of every allocation in them picked out
/// where it lies in those bytes (no copy per change), sorted, and merged
/// into the next snapshot. Sealed segments were written whole, so anything
/// that does not read back is damage. Returns the snapshot written and the
/// number of allocations changed.
fn checkpoint(
    fs: &dyn Fs,
    dir: &Path,
    folded: u64,
    sealed: u64,
) -> std::io::Result<(snapshot::Written, usize)> {
    let segments = (folded + 1..=sealed)
        .map(|seq| {
            fs.read(&wal::segment_path(dir, seq))
                .map(|bytes| (seq, bytes))
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut newest: HashMap<&str, Option<&[u8]>> = HashMap::new();
    let mut last_index = 0;
    for (seq, bytes) in &segments {
        let damaged = |what: String| {
            std::io::Error::other(format!(
                "{}: {what}",
                wal::segment_path(dir, *seq).display()
            ))
        };
        let replayed = wal::replay_with(bytes, *seq, |id, index, record| {
            newest.insert(id, record);
            last_index = last_index.max(index);
        })
        .map_err(damaged)?;
        if let Some(bad) = replayed.bad {
            return Err(damaged(format!(
                "sealed, but damaged at byte {}: the frame there {}",
                bad.at, bad.what
            )));
        }
    }
    let changes = sort_changes(newest);
    let written = snapshot::fold_sorted(fs, dir, &changes, last_index, sealed)?;
    Ok((written, changes.len()))
}

/// The changes in ID order. Their IDs lie scattered over the segments
/// read back (tens of megabytes), so sorting by the strings themselves
/// missed the cache on most of its ~n log n compares (`memcmp` was the
/// checkpoint thread's largest symbol at a million allocations, 0.5 µs per
/// change). Each ID is sorted by its first 16 bytes as a number, computed
/// once, which orders like the bytes (zero-padded: a shorter ID that is a
/// prefix of another sorts first either way); only IDs that share those
/// bytes are compared in full.
fn sort_changes<'a>(
    newest: HashMap<&'a str, Option<&'a [u8]>>,
) -> Vec<(&'a str, Option<&'a [u8]>)> {
    fn prefix(id: &str) -> u128 {
        let mut bytes = [0; 16];
        let n = id.len().min(16);
        bytes[..n].copy_from_slice(&id.as_bytes()[..n]);
        u128::from_be_bytes(bytes)
    }
    let mut changes: Vec<_> = newest.into_iter().collect();
    changes.sort_by_cached_key(|&(id, _)| (prefix(id), id));
    changes
}

/// A snapshot folded into by the checkpoints' own code, for `taskgate
/// bench --scenarios checkpoint`: what a checkpoint costs per record, apart
/// from the server around it.
pub struct FoldBench {
    dir: PathBuf,
    sealed: u64,
}

impl FoldBench {
    /// Checkpoints into a new snapshot in `dir`.
    pub fn create(dir: &Path) -> Self {
        Self {
            dir: dir.to_owned(),
            sealed: 0,
        }
    }

    /// Writes `changes` in one checkpoint, as the checkpoint thread does
    /// (sorting them, merging them into the next snapshot, removing the
    /// snapshot it replaced, dropping the changes after). Returns the records the snapshot holds.
    pub fn fold(&mut self, changes: FoldChanges) -> Result<u64, StoreError> {
        self.sealed += 1;
        let written = snapshot::fold(&RealFs, &self.dir, &changes.0, self.sealed)
            .map_err(|e| StoreError::Io(format!("checkpoint failed: {e}")))?;
        remove_folded(&RealFs, &self.dir, self.sealed);
        Ok(written.records)
    }
}

/// What one checkpoint writes, gathered beforehand as the store's writer
/// gathers it while it appends (not part of the checkpoint's cost).
pub struct FoldChanges(Overlay);

impl FoldChanges {
    pub fn new(records: impl IntoIterator<Item = (String, Vec<u8>)>) -> Self {
        let mut overlay = Overlay::default();
        for (id, record) in records {
            overlay.apply(id, Some(record), 1);
        }
        Self(overlay)
    }
}

/// Removes what a checkpoint replaced: the old snapshot and the segments
/// up to `sealed`, a slice at a time (`wal::remove_gently`: freed at once,
/// a million allocations' ~1 GB held the log's fsyncs for ~100 ms). A
/// failure is only logged: the next checkpoint or the next open removes
/// them.
fn remove_folded(fs: &dyn Fs, dir: &Path, sealed: u64) {
    if let Err(e) = wal::remove_gently(fs, &dir.join(OLD_FILE)) {
        tracing::warn!(error = %e, "cannot remove the replaced snapshot; the next checkpoint removes it");
    }
    let result = wal::list_segments(fs, dir).and_then(|segments| {
        for (_, path) in segments.iter().filter(|(seq, _)| *seq <= sealed) {
            wal::remove_gently(fs, path)?;
        }
        Ok(())
    });
    if let Err(e) = result {
        tracing::warn!(error = %e, "cannot remove folded store log segments; the next start removes them");
    }
}

/// Decodes records on every core; the results keep the input order.
fn decode_parallel(raw: &[(String, Vec<u8>)]) -> Vec<Result<Allocation, String>> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = raw.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        let parts: Vec<_> = raw
            .chunks(per)
            .map(|part| {
                s.spawn(move || {
                    part.iter()
                        .map(|(_, bytes)| record::decode(bytes))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        parts
            .into_iter()
            .flat_map(|h| h.join().expect("decoding does not panic"))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fs::RealFs;
    use crate::{
        lifecycle::{AllocId, AllocSpec, Limits, TaskName, TaskSpec},
        registry::{Registry, RegistryConfig},
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
        let store = Arc::new(open_with(dir, 64, log_limit));
        let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
        let mut tasks = Vec::new();
        for id in ids {
            let (r, id) = (r.clone(), AllocId::parse(id).unwrap());
            tasks.push(tokio::spawn(async move {
                r.register(id, spec()).await.unwrap()
            }));
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
        wal::list_segments(&RealFs, dir)
            .unwrap()
            .into_iter()
            .map(|(seq, path)| (seq, std::fs::metadata(path).unwrap().len()))
            .collect()
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
            let bytes = std::fs::read(wal::segment_path(dir.path(), *seq)).unwrap();
            let replayed = wal::replay_with(&bytes, *seq, |_, i, _| {
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unfinished_append_at_the_end_of_the_log_is_cut_off() {
        let dir = tempfile::tempdir().unwrap();
        let (views, _, _) = register(dir.path(), DEFAULT_LOG_LIMIT, &ids("a", 5)).await;
        let (seq, len) = *segments(dir.path()).last().unwrap();
        let path = wal::segment_path(dir.path(), seq);
        // A frame head promising more than follows: the crash came mid-append.
        let mut torn = std::fs::read(&path).unwrap();
        torn.extend_from_slice(&[200, 0, 0, 0, 1, 2, 3, 4, b'{']);
        std::fs::write(&path, &torn).unwrap();
        let (more, _, _) = register(dir.path(), DEFAULT_LOG_LIMIT, &ids("b", 5)).await;
        assert_eq!(std::fs::metadata(&path).unwrap().len(), len, "cut back");
        let mut aside = path.clone().into_os_string();
        aside.push(".broken");
        assert_eq!(
            std::fs::read(aside).unwrap(),
            &torn[len as usize..],
            "kept aside"
        );
        let store = Arc::new(open(dir.path(), 64));
        let r = Registry::open(store, RegistryConfig::default()).unwrap();
        assert_eq!(r.len(), 10);
        for v in views.iter().chain(&more) {
            assert_eq!(*r.get(v.id.as_str()).unwrap(), **v);
        }
    }

    /// Acknowledged changes are never dropped in silence: whatever damage
    /// the log or the snapshot takes (a flipped byte anywhere in the newest
    /// segment, its last frame included, a damaged length, a zeroed block,
    /// an emptied or missing segment, a lost snapshot), the open is refused
    /// with the file (and the offset) named, and nothing in the directory
    /// changes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn damage_anywhere_stops_the_open_naming_it_and_changes_nothing() {
        let good = tempfile::tempdir().unwrap();
        register(good.path(), DEFAULT_LOG_LIMIT, &ids("a", 100)).await;
        register(good.path(), DEFAULT_LOG_LIMIT, &ids("b", 200)).await;
        let all = segments(good.path());
        assert_eq!(all.len(), 2, "{all:?}");
        let older = wal::segment_path(good.path(), all[0].0);
        let newest = wal::segment_path(good.path(), all[1].0);
        let newest_len = all[1].1 as usize;
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
                edit(
                    newest.clone(),
                    Box::new(|b| {
                        let at = b.len() / 2;
                        b[at] ^= 0x04
                    }),
                ),
                "damaged at byte".into(),
            ),
            (
                "a flipped byte in the newest segment's last frame",
                edit(
                    newest.clone(),
                    Box::new(|b| {
                        let at = b.len() - 3;
                        b[at] ^= 0x01
                    }),
                ),
                "damaged at byte".into(),
            ),
            (
                "a damaged length field",
                edit(
                    newest.clone(),
                    Box::new(|b| b[wal::Segment::HEADER_LEN as usize + 1] ^= 0x40),
                ),
                format!("damaged at byte {}", wal::Segment::HEADER_LEN),
            ),
            (
                "a zeroed 4 KiB block",
                edit(newest.clone(), Box::new(|b| b[4096..8192].fill(0))),
                "damaged at byte".into(),
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
                "a lost snapshot",
                Box::new(|dir: &Path| {
                    std::fs::rename(dir.join(SNAPSHOT_FILE), dir.join(OLD_FILE)).unwrap()
                }),
                "snapshot it replaced".into(),
            ),
        ];
        assert!(newest_len > 8192, "{newest_len}");
        // The snapshot case needs one: fold the older segment.
        let with_snapshot = tempfile::tempdir().unwrap();
        register(with_snapshot.path(), 1, &ids("s", 20)).await;
        register(with_snapshot.path(), DEFAULT_LOG_LIMIT, &ids("t", 20)).await;
        for (what, damage, expect) in cases {
            let dir = tempfile::tempdir().unwrap();
            let from = if what == "a lost snapshot" {
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
        let (logged, last, _) = register(dir.path(), DEFAULT_LOG_LIMIT, &ids("l", 60)).await;
        views.extend(logged);
        let snapshot = dir.path().join(SNAPSHOT_FILE);
        let (seq, _) = *segments(dir.path()).last().unwrap();
        let newest = wal::segment_path(dir.path(), seq);
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
        let report = super::super::salvage(dir.path(), &to).unwrap();
        assert_eq!(
            files(dir.path()),
            before,
            "the damaged directory is only read"
        );
        let lost = &report.lost;
        assert_eq!(lost.len(), 4, "{lost:?}");
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
        assert!(
            lost[2].starts_with(&format!("{}: bytes ", newest.display())),
            "{lost:?}"
        );
        // The lost change's index may have been the highest: indexes go on
        // past any it could have had.
        assert!(lost[3].starts_with("indexes go on from "), "{lost:?}");
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
        let err = super::super::salvage(dir.path(), dir.path())
            .unwrap_err()
            .to_string();
        assert!(err.contains("never works in place"), "{err}");
        let err = super::super::salvage(dir.path(), &to)
            .unwrap_err()
            .to_string();
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
    async fn failing_checkpoints_degrade_the_store_then_stop_writes_at_the_ceiling_until_one_works()
    {
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
            wal::list_segments(&RealFs, dir.path()).unwrap().len() == 1
        });
        let path = dir.path().join(SNAPSHOT_FILE);
        let good = std::fs::read(&path).unwrap();
        let mut bad = good.clone();
        bad[good.len() / 2] ^= 0x08;
        std::fs::write(&path, &bad).unwrap();
        assert_eq!(store.health(), super::super::StoreHealth::Ok);
        let mut degraded = false;
        let refused = loop {
            n += 1;
            assert!(n < 5000, "never refused");
            match store.commit(put(n)).await {
                Ok(()) => {}
                Err(e) => break e,
            }
            degraded |=
                store.health() == super::super::StoreHealth::Degraded(vec!["checkpoints_failing"]);
        };
        let acknowledged = n - 1;
        assert!(degraded, "degraded before the ceiling");
        assert!(matches!(refused, StoreError::Unavailable(_)), "{refused:?}");
        assert!(
            matches!(
                store.health(),
                super::super::StoreHealth::Refusing {
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
            store.health() == super::super::StoreHealth::Ok
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
        let blocker = dir.path().join(wal::SEGMENT_TEMP);
        std::fs::create_dir(&blocker).unwrap();
        let mut n = 0;
        while store.stats().failed_rollovers == 0 {
            n += 1;
            assert!(n < 1000);
            store.commit(put(n)).await.unwrap();
        }
        assert_eq!(
            store.health(),
            super::super::StoreHealth::Degraded(vec!["log_rollover_failing"])
        );
        assert_eq!(segments(dir.path()).len(), 1);
        std::fs::remove_dir(&blocker).unwrap();
        wait_until("a rollover that works", || {
            store.health() == super::super::StoreHealth::Ok
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
            (sim::Op::Write, wal::BROKEN_SUFFIX),
            (sim::Op::SyncAll, wal::BROKEN_SUFFIX),
            (sim::Op::Write, wal::SEGMENT_TEMP),
        ] {
            let cut_first = file == wal::SEGMENT_TEMP;
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
            let (_, path) = wal::list_segments(&fs, &dir).unwrap().pop().unwrap();
            let mut torn = fs.contents(&path).unwrap();
            let len = torn.len();
            // A frame head promising more than follows: a crash mid-append.
            torn.extend_from_slice(&[200, 0, 0, 0, 1, 2, 3, 4, b'{']);
            fs.put(&path, torn.clone());
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
                    !fs.exists(&dir.join(wal::SEGMENT_TEMP)),
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
            aside.push(wal::BROKEN_SUFFIX);
            assert_eq!(fs.contents(Path::new(&aside)).unwrap(), &torn[len..]);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn damage_before_the_end_of_the_log_stops_the_open() {
        let dir = tempfile::tempdir().unwrap();
        register(dir.path(), DEFAULT_LOG_LIMIT, &ids("a", 5)).await;
        register(dir.path(), DEFAULT_LOG_LIMIT, &ids("b", 5)).await;
        let all = segments(dir.path());
        assert_eq!(all.len(), 2, "one segment per open: {all:?}");
        let first = wal::segment_path(dir.path(), all[0].0);
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
        std::fs::remove_file(wal::segment_path(dir.path(), all[1].0)).unwrap();
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
        drop(wal::Segment::create(&RealFs, dir.path(), 1).unwrap());
        let (jobs, _jobs) = mpsc::sync_channel(1);
        let (_done, done) = mpsc::channel();
        let trouble = Arc::new(Mutex::new(Trouble::default()));
        let mut writer = Writer {
            fs: Arc::new(RealFs),
            dir: dir.path().to_owned(),
            segment: wal::Segment::read_only(dir.path(), 1).unwrap(),
            log_bytes: 0,
            sealed: Vec::new(),
            log_limit: DEFAULT_LOG_LIMIT,
            log_ceiling: DEFAULT_LOG_CEILING,
            jobs,
            done,
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
        let mut frame = Vec::new();
        wal::frame(&mut frame, "a1", 1, Some(b"{}"));
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
        let len = std::fs::metadata(wal::segment_path(dir.path(), 1))
            .unwrap()
            .len();
        assert_eq!(len, wal::Segment::HEADER_LEN);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queued_changes_share_commits_unless_batching_is_off() {
        for (max_batch, shared) in [(4096, true), (1, false)] {
            let dir = tempfile::tempdir().unwrap();
            let store = open(dir.path(), max_batch);
            let commits: Vec<_> = (1..=200u64)
                .map(|i| {
                    store.commit(Op::Delete {
                        id: AllocId::parse(&format!("x{i}")).unwrap(),
                        index: i,
                    })
                })
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

    #[tokio::test]
    async fn records_of_an_earlier_build_load_and_changes_are_written_in_the_current_format() {
        // An earlier build's data directory: format-1 (JSON) records in the
        // snapshot and in the log.
        let dir = tempfile::tempdir().unwrap();
        let at = time::OffsetDateTime::UNIX_EPOCH;
        let alloc = |id: &str, index| {
            Allocation::register(AllocId::parse(id).unwrap(), Arc::new(spec()), index, at)
        };
        let (a, b) = (alloc("a", 1), alloc("b", 2));
        let mut w = snapshot::SnapshotWriter::create(&RealFs, dir.path(), 0, 1).unwrap();
        w.put("a", &record::encode_json(&a)).unwrap();
        w.finish().unwrap();
        let mut s = wal::Segment::create(&RealFs, dir.path(), 1).unwrap();
        let mut frame = Vec::new();
        wal::frame(&mut frame, "b", 2, Some(&record::encode_json(&b)));
        s.append(&mut frame).unwrap();
        drop(s);

        let store = open(dir.path(), 1);
        let loaded = store.load().unwrap();
        assert_eq!(loaded.allocations, vec![a.clone(), b]);
        let mut changed = a.clone();
        changed.modify_index = 3;
        store
            .commit(Op::Put(Arc::new(changed.clone())))
            .await
            .unwrap();
        store.close().unwrap();
        drop(store);
        let log = std::fs::read(wal::segment_path(dir.path(), 2)).unwrap();
        let mut frames = Overlay::default();
        wal::replay(&log, 2, &mut frames).unwrap();
        let written = frames.changes["a"].as_deref().unwrap();
        assert_eq!(written, record::encode(&changed), "written in format 2");
        assert_eq!(open(dir.path(), 1).load().unwrap().allocations[0], changed);
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
        let newest = wal::list_segments(&RealFs, dir.path())
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
        std::fs::write(wal::segment_path(dir.path(), folded), b"folded").unwrap();
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
        let mut w = snapshot::SnapshotWriter::create(&RealFs, dir.path(), 0, 1).unwrap();
        w.put("broken", b"{not json").unwrap();
        w.finish().unwrap();
        // A torn append the open would cut, and names it would drop.
        let mut s = wal::Segment::create(&RealFs, dir.path(), 1).unwrap();
        let mut frame = Vec::new();
        wal::frame(&mut frame, "fine", 1, Some(b"{}"));
        s.append(&mut frame).unwrap();
        drop(s);
        let mut torn = Vec::new();
        wal::frame(&mut torn, "torn", 2, Some(&[1; 100]));
        wal::append_unfinished(&wal::segment_path(dir.path(), 1), &mut torn, 50, 0);
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
            .commit(Op::Delete {
                id: AllocId::parse("x").unwrap(),
                index: 1,
            })
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Closed));
    }
}

/// Random histories of puts and deletions, with reopens under different
/// log limits (1 byte: a checkpoint per commit) and unfinished appends left
/// at the end of the log, checked against a map after every reopen.
#[cfg(test)]
mod properties {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::{tests::spec, *};
    use crate::lifecycle::AllocId;

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
                            Op::Delete { id, index: last }
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
                        let (seq, _) = wal::list_segments(&RealFs, dir.path()).unwrap().pop().unwrap();
                        let path = wal::segment_path(dir.path(), seq);
                        let mut frame = Vec::new();
                        wal::frame(&mut frame, "never-acked", last + 1, Some(&[7; 2000]));
                        wal::append_unfinished(&path, &mut frame, keep, zeros);
                        store = reopen(dir.path(), limit, &model, last);
                    }
                }
            }
            settle(&rt, store, &mut queued);
            drop(reopen(dir.path(), DEFAULT_LOG_LIMIT, &model, last));
        }
    }

    proptest! {
        /// The checkpoint's sort by a 16-byte prefix key puts changes in
        /// exactly the order of their IDs' bytes: IDs shorter than the key,
        /// IDs that are prefixes of others, and IDs that share the whole
        /// key and differ only after it.
        #[test]
        fn changes_sort_in_id_order(
            ids in proptest::collection::hash_set("(scale-0000000000|[ab]{0,3})[ab0-9]{0,22}", 0..64),
        ) {
            let newest: HashMap<&str, Option<&[u8]>> =
                ids.iter().map(|id| (id.as_str(), Some(id.as_bytes()))).collect();
            let sorted = sort_changes(newest);
            let mut expected: Vec<&str> = ids.iter().map(String::as_str).collect();
            expected.sort_unstable();
            let got: Vec<&str> = sorted.iter().map(|(id, _)| *id).collect();
            prop_assert_eq!(got, expected);
            for (id, record) in sorted {
                prop_assert_eq!(record, Some(id.as_bytes()), "each ID keeps its own record");
            }
        }
    }
}
