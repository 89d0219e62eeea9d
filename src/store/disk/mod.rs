//! The embedded disk store: a snapshot file and a write-ahead log, one
//! writer thread (group commit) and one checkpoint thread. Its formats are
//! drawn in the files that own them and written out in
//! `docs/storage-format.md`:
//!
//! ```text
//! <data dir>/taskgate.snapshot        snapshot.rs   every record in ID order, chained,
//!                                                   and where the log it folded ended
//!            taskgate.wal.<seq>       log.rs        one frame per append; each header says
//!                                                   where the segment before it ended
//!            (both made of)           frame.rs      len | crc | chain | payload, and what
//!                                                   a torn append looks like
//!            taskgate.manifest        manifest.rs   which segment is the newest
//!            taskgate.lock, store-id               one process at a time; the store's ID
//!
//!   start:      recovery.rs    read and check all of it, then repair (cut a torn tail)
//!   running:    writer.rs      one append and one fdatasync per batch
//!               checkpoint.rs  fold sealed segments into the next snapshot
//!   refused:    salvage.rs     `taskgate dump --salvage`: what can be proven, by index
//!   tests:      fs.rs          the file system seam; fs/sim.rs crashes it (powerloss.rs)
//! ```
//!
//! Semaphores (`Op::PutSemaphore`, `Op::DeleteSemaphore`) go the same
//! way as allocations, through the same queue, log, checkpoints, recovery
//! and salvage: a semaphore's record (`record::encode_semaphore`) is kept
//! under the key `~s/<name>` where an allocation's is under its ID
//! (`SEMAPHORE_KEY`), and a start hands it to `Loaded::semaphores`.
//!
//! An append is admitted first (a place in the writer's queue, refused
//! while the queue is full, the log is at its ceiling or a write failed),
//! then stamped with the next index and serialized on the requester's
//! thread, and queued, in index order. The writer takes everything queued
//! at that moment (up to `max_batch`), appends it to the log (`log.rs`) as
//! one frame, in one write and one `fdatasync`, hands the batch to the
//! follower (the registry publishes it), and only then answers every change
//! in it. A failed append fails every change in the batch, and the log
//! takes nothing more until a restart recovers from it (fail-stop).
//!
//! Once the log holds `log_limit` bytes, the writer starts the next
//! segment (its header vouching for where this one ends), names it in the
//! manifest (`manifest.rs`), seals this one, and hands the newest record
//! of every allocation changed since the last checkpoint to the
//! checkpoint thread, which writes the next
//! snapshot (`snapshot.rs`: the current one merged with those changes,
//! sequentially, renamed into place), recording in it which segment it
//! folded and where that segment ended, and then removes the folded
//! segments. The checkpoint thread runs
//! at the lowest priority, in the time requests leave; while a checkpoint
//! runs the log may grow to `LOG_SLACK` times its limit before the writer
//! waits for it. The log on disk (and in memory until folded) — the
//! segments being folded plus those written since — so stays under about
//! `2 × LOG_SLACK` times the limit: 256 MiB by default, what recovery
//! replays at most.
//!
//! Recovery reads the snapshot, then replays the segments it has not
//! folded, in order, each checked against its neighbours. A data directory
//! of the pre-release format (a redb file, `taskgate.redb`) is refused,
//! never read as empty.
//!
//! One process at a time: the store holds an exclusive lock on
//! `taskgate.lock` in the data directory while it is open.

#[cfg(test)]
mod audit_tests;
mod checkpoint;
mod frame;
pub mod fs;
mod log;
mod manifest;
#[cfg(test)]
mod powerloss;
#[cfg(test)]
mod properties;
mod recovery;
mod salvage;
#[cfg(test)]
mod semaphore_tests;
mod snapshot;
#[cfg(test)]
mod tests;
mod writer;

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, OnceLock, PoisonError, Weak,
        mpsc::{self, Sender},
    },
    thread::JoinHandle,
    time::Duration,
};

use tokio::sync::{Semaphore, oneshot};

use super::{
    Admitted, Append, AppendError, Appended, Change, Follower, LoadOnce, Loaded, Op, Store,
    StoreError, record,
};
use crate::{lifecycle::SemName, metrics::Metrics};
use checkpoint::Checkpointer;
use fs::{DirLock, Fs, LockError, Open, RealFs};
use recovery::{load_with, mend, refuse_pre_release, scan};
use writer::RETRY_FIRST;
use writer::{Trouble, Writer};

pub use checkpoint::{FoldBench, FoldChanges};
pub use recovery::{REDB_FILE, read_only};
pub use salvage::{SalvageReport, salvage};
pub use snapshot::SNAPSHOT_FILE;

/// The log segments in a data directory, oldest first.
pub fn log_segments(dir: &Path) -> std::io::Result<Vec<(u64, PathBuf)>> {
    log::list_segments(&RealFs, dir)
}

/// The lock file's name inside the data directory.
pub const LOCK_FILE: &str = "taskgate.lock";

/// What the key of a semaphore's record starts with, in the log and the
/// snapshot, where the other keys are allocation IDs: those start with a
/// letter or digit, so no allocation ID is a semaphore's key, and `~`
/// sorts after every one of them (the snapshot holds the semaphores after
/// the allocations, in name order).
const SEMAPHORE_KEY: &str = "~s/";

/// The key of semaphore `name`'s record: `~s/<name>`.
fn semaphore_key(name: &SemName) -> String {
    let mut key = String::with_capacity(SEMAPHORE_KEY.len() + name.as_str().len());
    key.push_str(SEMAPHORE_KEY);
    key.push_str(name.as_str());
    key
}

/// The semaphore's name a key holds, if it is a semaphore's key.
fn semaphore_name(key: &str) -> Option<&str> {
    key.strip_prefix(SEMAPHORE_KEY)
}

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
    /// Changes admitted and not yet answered at most (`COMMIT_QUEUE`).
    pub commit_queue: usize,
    /// How far a segment's file is written with zeros ahead of its
    /// appends (`log::WRITE_AHEAD`; small in tests, to cross it often).
    pub write_ahead: u64,
    /// Told when the writer or the checkpoint thread ends unasked.
    pub supervisor: crate::supervise::Supervisor,
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
            write_ahead: log::WRITE_AHEAD,
            supervisor: crate::supervise::Supervisor::default(),
        }
    }
}

/// Changes admitted and not yet answered at most; one more is refused
/// before it is decided (503 `store_unavailable`) instead of memory growing
/// without bound. Far more than the connections a server takes can have in
/// flight.
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

pub(super) enum Msg {
    /// One change, stamped with its index and encoded for the log by the
    /// requester, on its own thread (`log::change_with`); the writer joins
    /// a batch of them into one frame.
    Change {
        bytes: Vec<u8>,
        /// What the follower is handed once it is durable.
        change: Change,
        index: u64,
        ack: oneshot::Sender<Result<u64, AppendError>>,
    },
    Close(mpsc::SyncSender<()>),
}

/// The writer's queue and the last index handed out, under one lock: a
/// change takes its index and its place in the queue together, so the
/// queue (and the log, and the follower) is in index order.
struct Queue {
    tx: Option<Sender<Msg>>,
    last_index: u64,
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
    /// The writer's queue; its sender is `None` once closed.
    queue: Mutex<Queue>,
    /// Places in the queue (`admit`), given back as changes are answered.
    places: Arc<Semaphore>,
    /// Who the writer hands durable changes to (`follow`).
    follower: Arc<OnceLock<Weak<dyn Follower>>>,
    /// The writer (which ends its checkpoint thread before it ends).
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
        let (folded, recovery) = scan(fs, &config.dir, config.write_ahead)?;
        let snapshot_bytes = fs
            .open(&path, Open::Read)
            .and_then(|f| f.len())
            .unwrap_or(0);
        let loaded = load_with(fs, &config.dir, &recovery.overlay)?;
        let id = super::identity::read(fs, &config.dir)?;
        // Everything read back: only now is anything changed.
        recovery.apply(fs, &config.dir)?;
        let (log_bytes, next_seq, previous) = (recovery.log_bytes, recovery.next_seq, recovery.end);
        let cannot = |what: &Path, e: std::io::Error| {
            StoreError::Unusable(format!(
                "cannot create {}: {e}. {}; the directory holds every acknowledged change.",
                what.display(),
                mend(&e)
            ))
        };
        let segment = log::Segment::create(fs, &config.dir, next_seq, previous, config.write_ahead)
            .map_err(|e| cannot(&log::segment_path(&config.dir, next_seq), e))?;
        manifest::write(fs, &config.dir, next_seq)
            .map_err(|e| cannot(&config.dir.join(manifest::MANIFEST_FILE), e))?;
        recovery.cut_older(fs);
        drop(recovery);
        // A new directory gets its ID once it holds a store: an ID without
        // a manifest is one whose data was removed.
        let id = match id {
            Some(id) => id,
            None => super::identity::create(fs, &config.dir)?,
        };
        let stats = Arc::new(Mutex::new(StoreStats::default()));
        let unstarted = |name: &str, e: std::io::Error| {
            StoreError::Unusable(format!("cannot start the {name} thread: {e}"))
        };
        let checkpointer = Checkpointer::start(
            config.fs.clone(),
            config.dir.clone(),
            folded.seq,
            stats.clone(),
            config.metrics.clone(),
        )
        .map_err(|e| unstarted("checkpoint", e))?;
        let (tx, rx) = mpsc::channel();
        let follower = Arc::new(OnceLock::new());
        let trouble = Arc::new(Mutex::new(Trouble::default()));
        let log_limit = config.log_limit.max(1);
        let mut writer = Writer {
            fs: config.fs.clone(),
            dir: config.dir.clone(),
            // The live segments recovered are folded by the first
            // checkpoint, with the new one.
            log_bytes: log_bytes + segment.len,
            sealed: Vec::new(),
            segment,
            log_limit,
            log_ceiling: config.log_ceiling.max(4 * log_limit),
            checkpointer: Some(checkpointer),
            folded: folded.seq,
            folding: folded.seq,
            snapshot_bytes,
            in_flight: false,
            trouble: trouble.clone(),
            retry_at: None,
            retry_first: config.retry,
            backoff: config.retry,
            max_batch: config.max_batch.max(1),
            stats: stats.clone(),
            metrics: config.metrics.clone(),
            follower: follower.clone(),
            supervisor: config.supervisor.clone(),
        };
        // The writer is vital: a panic (in the follower it hands batches
        // to, say) leaves the log's state unknown, so the server stops.
        let vital = config.supervisor.vital("store_writer");
        let writer = std::thread::Builder::new()
            .name("taskgate-store".into())
            .spawn(move || {
                writer.run(&rx);
                writer.stop_checkpointer();
                vital.done();
            })
            .map_err(|e| unstarted("store", e))?;
        let last_index = loaded
            .allocations
            .iter()
            .map(|a| a.modify_index)
            .chain(loaded.semaphores.iter().map(|s| s.modify_index))
            .fold(loaded.last_index, u64::max);
        Ok(Self {
            _lock: lock,
            id,
            stats,
            dir: config.dir,
            queue: Mutex::new(Queue {
                tx: Some(tx),
                last_index,
            }),
            places: Arc::new(Semaphore::new(config.commit_queue.max(1))),
            follower,
            threads: Mutex::new(vec![writer]),
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

    fn trouble(&self) -> std::sync::MutexGuard<'_, Trouble> {
        self.trouble.lock().unwrap_or_else(PoisonError::into_inner)
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

/// A test's commit in flight (`DiskStore::commit`).
#[cfg(test)]
pub(crate) type Commit =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), StoreError>> + Send>>;

#[cfg(test)]
impl DiskStore {
    /// Admits and appends `op` at once (so that changes a test queues
    /// together share group commits); resolves once it is durable.
    pub(crate) fn commit(&self, op: Op) -> Commit {
        let admitted = match self.admit() {
            Ok(admitted) => admitted,
            Err(e) => return Box::pin(async move { Err(e) }),
        };
        let appended = self.append(Append {
            op,
            expect: 0,
            live: Vec::new(),
            grants: Vec::new(),
        });
        Box::pin(async move {
            let done = appended.done.await;
            drop(admitted);
            done.map(|_| ()).map_err(|e| match e {
                AppendError::Store(e) => e,
                other => StoreError::Io(other.to_string()),
            })
        })
    }

    /// The IDs of the allocations it loaded, in order (a test's look).
    fn loaded_ids(&self) -> Vec<String> {
        self.load()
            .unwrap()
            .allocations
            .iter()
            .map(|a| a.id.to_string())
            .collect()
    }
}

impl Store for DiskStore {
    fn load(&self) -> Result<Loaded, StoreError> {
        self.recovered.take()
    }

    fn id(&self) -> &str {
        &self.id
    }

    fn follow(&self, from: u64, follower: Weak<dyn Follower>) {
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        queue.last_index = queue.last_index.max(from);
        let _ = self.follower.set(follower);
    }

    fn admit(&self) -> Result<Admitted, StoreError> {
        if let Some(refused) = self.trouble().refusal() {
            return Err(refused);
        }
        match self.places.clone().try_acquire_owned() {
            Ok(place) => Ok(Admitted::of(place)),
            Err(_) => Err(StoreError::Unavailable(
                "the commit queue is full: changes are waiting for the disk; try again".into(),
            )),
        }
    }

    /// Takes `expect` as given (the registry's locks keep it true: this
    /// process alone writes the directory), for semaphores as for
    /// allocations, and ignores `grants` for the same reason: the registry
    /// decides one semaphore's grants one at a time, so no two grants can
    /// be decided on one view of it.
    fn append(&self, append: Append) -> Appended {
        let (ack, done) = oneshot::channel();
        // Sized for a typical record, so encoding it rarely reallocates.
        let mut bytes = Vec::with_capacity(1024);
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        let index = queue.last_index + 1;
        let (change, record) = match append.op {
            Op::Put(mut a) => {
                let placeholder = a.modify_index;
                Arc::make_mut(&mut a).restamp(placeholder, index);
                log::change_with(&mut bytes, a.id.as_str(), index, true, |buf| {
                    record::encode_into(&a, buf);
                });
                (Change::Put(a.clone()), Some(a))
            }
            Op::Delete(id) => {
                log::change(&mut bytes, id.as_str(), index, None);
                (Change::Delete { id, index }, None)
            }
            Op::PutSemaphore(mut s) => {
                let placeholder = s.modify_index;
                Arc::make_mut(&mut s).restamp(placeholder, index);
                log::change_with(&mut bytes, &semaphore_key(&s.name), index, true, |buf| {
                    record::encode_semaphore_into(&s, buf);
                });
                (Change::PutSemaphore(s), None)
            }
            Op::DeleteSemaphore(name) => {
                log::change(&mut bytes, &semaphore_key(&name), index, None);
                (Change::DeleteSemaphore { name, index }, None)
            }
        };
        let msg = Msg::Change {
            bytes,
            change,
            index,
            ack,
        };
        let sent = queue.tx.as_ref().is_some_and(|tx| tx.send(msg).is_ok());
        if !sent {
            // Never queued: refused, nothing of it written.
            return Appended {
                record,
                stamped: false,
                done: Box::pin(async { Err(AppendError::Store(StoreError::Closed)) }),
            };
        }
        queue.last_index = index;
        drop(queue);
        Appended {
            record,
            stamped: true,
            done: Box::pin(async move {
                // Queued, and its answer gone with the writer (it
                // panicked): the change may be durable.
                done.await.unwrap_or_else(|_| {
                    Err(AppendError::Store(StoreError::Uncertain(
                        "the store's writer stopped before it answered; the change may have \
                         been made durable: read it back after the restart"
                            .into(),
                    )))
                })
            }),
        }
    }

    fn health(&self) -> super::StoreHealth {
        self.trouble().health()
    }

    fn close(&self) -> Result<(), StoreError> {
        let (tx, rx) = mpsc::sync_channel(1);
        // Send the close and drop the queue under one lock, so no change
        // can be queued behind the close.
        let sent = {
            let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            let sent = queue
                .tx
                .as_ref()
                .is_some_and(|q| q.send(Msg::Close(tx)).is_ok());
            queue.tx.take();
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
            .tx
            .take();
        let _ = self.join();
    }
}
