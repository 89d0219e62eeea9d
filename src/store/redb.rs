//! The embedded disk store: one redb file, one writer thread, group commit.
//!
//! Requests serialize their record on their own thread and queue it. The
//! writer takes everything queued at that moment (up to `max_batch`),
//! writes it in one transaction with one durable commit (fsync), and only
//! then acknowledges every change in it. A failed commit fails every
//! change in the batch and applies none of them.

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, PoisonError,
        mpsc::{self, Receiver, Sender},
    },
    thread::JoinHandle,
};

use redb::{
    Database, DatabaseError, ReadableDatabase, ReadableTable, ReadableTableMetadata,
    TableDefinition, TableError,
};
use tokio::sync::oneshot;

use super::{Commit, Loaded, Op, Store, StoreError, record};
use crate::{lifecycle::Allocation, metrics::Metrics};

/// The data file's name inside the data directory.
pub const DATA_FILE: &str = "taskgate.redb";

/// allocation ID → record (see `record.rs`).
const ALLOCATIONS: TableDefinition<&str, &[u8]> = TableDefinition::new("allocations");
/// Store-wide facts: the file format and the last global index.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const META_FORMAT: &str = "format";
const META_LAST_INDEX: &str = "last_index";
/// The file layout this build reads and writes (tables and their meaning).
const FILE_FORMAT: u64 = 1;

#[derive(Clone, Debug)]
pub struct RedbStoreConfig {
    pub dir: PathBuf,
    /// Most changes in one commit; 1 turns group commit off.
    pub max_batch: usize,
    /// redb's page cache. Every record also lives in memory as a decoded
    /// allocation, so a small cache serves the writer; redb's default
    /// (1 GiB) would hold a second copy of the whole file after loading.
    pub cache_bytes: usize,
    /// Where commit latency and batch sizes are recorded.
    pub metrics: Option<Arc<Metrics>>,
}

/// Default page cache of the store.
pub const DEFAULT_CACHE_BYTES: usize = 64 * 1024 * 1024;

enum Msg {
    Put {
        id: String,
        bytes: Vec<u8>,
        index: u64,
        ack: oneshot::Sender<Result<(), StoreError>>,
    },
    Delete {
        id: String,
        index: u64,
        ack: oneshot::Sender<Result<(), StoreError>>,
    },
    Close(mpsc::SyncSender<()>),
}

/// Counters of the writer, for tests and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Durable commits made.
    pub commits: u64,
    /// Changes (puts and deletes) in them.
    pub changes: u64,
}

pub struct RedbStore {
    /// The open file; read by `load`, written only by the writer thread.
    db: Arc<Database>,
    /// Written by the writer after each commit; read by `stats`.
    stats: Arc<Mutex<StoreStats>>,
    path: PathBuf,
    /// Queue to the writer thread; `None` once closed.
    queue: Mutex<Option<Sender<Msg>>>,
    writer: Mutex<Option<JoinHandle<()>>>,
}

fn unusable(path: &Path, what: impl std::fmt::Display) -> StoreError {
    StoreError::Unusable(format!(
        "data file {}: {what}. Nothing in it was changed. If it is damaged, restore it \
         from a backup, or move it away to start with an empty store.",
        path.display()
    ))
}

impl RedbStore {
    /// Opens (or creates) the data file and starts the writer thread.
    pub fn open(config: RedbStoreConfig) -> Result<Self, StoreError> {
        std::fs::create_dir_all(&config.dir).map_err(|e| {
            StoreError::Unusable(format!(
                "cannot create the data directory {}: {e}",
                config.dir.display()
            ))
        })?;
        let path = config.dir.join(DATA_FILE);
        let db = Database::builder()
            .set_cache_size(config.cache_bytes)
            .create(&path)
            .map_err(|e| match e {
            DatabaseError::DatabaseAlreadyOpen => StoreError::Unusable(format!(
                "data file {} is in use by another process (is another taskgate running on this directory?)",
                path.display()
            )),
            other => unusable(&path, format!("cannot be opened: {other}")),
        })?;
        let db = Arc::new(db);
        Self::check_format(&db, &path)?;
        let (tx, rx) = mpsc::channel();
        let stats = Arc::new(Mutex::new(StoreStats::default()));
        let writer = {
            let db = db.clone();
            let stats = stats.clone();
            let max_batch = config.max_batch.max(1);
            let metrics = config.metrics.clone();
            std::thread::Builder::new()
                .name("taskgate-store".into())
                .spawn(move || writer_loop(&db, &rx, max_batch, &stats, metrics.as_deref()))
                .map_err(|e| StoreError::Unusable(format!("cannot start the store writer: {e}")))?
        };
        Ok(Self {
            db,
            stats,
            path,
            queue: Mutex::new(Some(tx)),
            writer: Mutex::new(Some(writer)),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn stats(&self) -> StoreStats {
        *self.stats.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new file gets the current format; an existing one must have it.
    fn check_format(db: &Database, path: &Path) -> Result<(), StoreError> {
        let io = |e: &dyn std::fmt::Display| unusable(path, format!("cannot be read: {e}"));
        let txn = db.begin_write().map_err(|e| io(&e))?;
        {
            let mut meta = txn.open_table(META).map_err(|e| io(&e))?;
            let format = meta
                .get(META_FORMAT)
                .map_err(|e| io(&e))?
                .map(|v| v.value());
            match format {
                Some(FILE_FORMAT) => {}
                Some(other) => {
                    return Err(unusable(
                        path,
                        format!(
                            "it has file format {other}, and this taskgate reads format {FILE_FORMAT} \
                             (was it written by a newer taskgate?)"
                        ),
                    ));
                }
                None => {
                    let allocations = txn.open_table(ALLOCATIONS).map_err(|e| io(&e))?;
                    if !allocations.is_empty().map_err(|e| io(&e))? {
                        return Err(unusable(path, "it holds records but no format marker"));
                    }
                    drop(allocations);
                    meta.insert(META_FORMAT, FILE_FORMAT).map_err(|e| io(&e))?;
                }
            }
        }
        txn.commit().map_err(|e| io(&e))
    }

    fn send(&self, msg: Msg) -> bool {
        let queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        queue.as_ref().is_some_and(|q| q.send(msg).is_ok())
    }
}

impl Store for RedbStore {
    fn load(&self) -> Result<Loaded, StoreError> {
        let path = &self.path;
        let io = |e: &dyn std::fmt::Display| unusable(path, format!("cannot be read: {e}"));
        let txn = self.db.begin_read().map_err(|e| io(&e))?;
        let last_index = match txn.open_table(META) {
            Ok(meta) => meta
                .get(META_LAST_INDEX)
                .map_err(|e| io(&e))?
                .map_or(0, |v| v.value()),
            Err(TableError::TableDoesNotExist(_)) => 0,
            Err(e) => return Err(io(&e)),
        };
        let table = match txn.open_table(ALLOCATIONS) {
            Ok(t) => t,
            Err(TableError::TableDoesNotExist(_)) => {
                return Ok(Loaded {
                    allocations: Vec::new(),
                    last_index,
                });
            }
            Err(e) => return Err(io(&e)),
        };
        // Records are decoded in chunks, each chunk split over the cores:
        // decoding JSON is most of a recovery.
        const CHUNK: usize = 16_384;
        let mut allocations: Vec<Allocation> =
            Vec::with_capacity(table.len().map_err(|e| io(&e))? as usize);
        let mut specs = crate::lifecycle::SpecInterner::default();
        let mut raw: Vec<(String, Vec<u8>)> = Vec::with_capacity(CHUNK);
        let mut iter = table.iter().map_err(|e| io(&e))?;
        loop {
            let entry = iter.next().transpose().map_err(|e| io(&e))?;
            let done = entry.is_none();
            if let Some((key, value)) = entry {
                raw.push((key.value().to_owned(), value.value().to_vec()));
            }
            if raw.len() == CHUNK || (done && !raw.is_empty()) {
                let decoded = decode_parallel(&raw);
                for ((key, _), result) in raw.drain(..).zip(decoded) {
                    let mut a = result.map_err(|e| {
                        unusable(
                            path,
                            format!("the record of allocation {key:?} is unreadable: {e}"),
                        )
                    })?;
                    if a.id.as_str() != key {
                        return Err(unusable(
                            path,
                            format!("the record under {key:?} is for allocation {:?}", a.id),
                        ));
                    }
                    a.spec = specs.share(a.spec);
                    allocations.push(a);
                }
            }
            if done {
                break;
            }
        }
        Ok(Loaded {
            allocations,
            last_index,
        })
    }

    fn commit(&self, op: Op) -> Commit {
        let (ack, done) = oneshot::channel();
        let msg = match op {
            Op::Put(a) => Msg::Put {
                id: a.id.to_string(),
                bytes: record::encode(&a),
                index: a.modify_index,
                ack,
            },
            Op::Delete { id, index } => Msg::Delete {
                id: id.to_string(),
                index,
                ack,
            },
        };
        if !self.send(msg) {
            return Box::pin(async { Err(StoreError::Closed) });
        }
        Box::pin(async move { done.await.unwrap_or(Err(StoreError::Closed)) })
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
        if let Some(writer) = self
            .writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            writer
                .join()
                .map_err(|_| StoreError::Io("the store writer panicked".into()))?;
        }
        Ok(())
    }
}

impl Drop for RedbStore {
    fn drop(&mut self) {
        // Stops the writer after what is queued; `close` may have done it.
        self.queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(writer) = self
            .writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            let _ = writer.join();
        }
    }
}

/// The single writer: one transaction and one durable commit per batch.
fn writer_loop(
    db: &Database,
    queue: &Receiver<Msg>,
    max_batch: usize,
    stats: &Mutex<StoreStats>,
    metrics: Option<&Metrics>,
) {
    let mut batch = Vec::with_capacity(max_batch);
    while let Ok(first) = queue.recv() {
        batch.push(first);
        while batch.len() < max_batch {
            match queue.try_recv() {
                Ok(msg) => batch.push(msg),
                Err(_) => break,
            }
        }
        let mut closing = None;
        let mut acks = Vec::with_capacity(batch.len());
        let started = std::time::Instant::now();
        let result = write_batch(db, batch.drain(..), &mut acks, &mut closing);
        match &result {
            Err(e) => tracing::error!(error = %e, changes = acks.len(), "store commit failed"),
            Ok(()) if !acks.is_empty() => {
                if let Some(m) = metrics {
                    m.commit(started.elapsed(), acks.len());
                }
                let mut s = stats.lock().unwrap_or_else(PoisonError::into_inner);
                s.commits += 1;
                s.changes += acks.len() as u64;
            }
            Ok(()) => {}
        }
        for ack in acks {
            let _ = ack.send(result.clone());
        }
        if let Some(closed) = closing {
            let _ = closed.send(());
            return;
        }
    }
}

fn write_batch(
    db: &Database,
    batch: impl Iterator<Item = Msg>,
    acks: &mut Vec<oneshot::Sender<Result<(), StoreError>>>,
    closing: &mut Option<mpsc::SyncSender<()>>,
) -> Result<(), StoreError> {
    let io = |e: &dyn std::fmt::Display| StoreError::Io(e.to_string());
    let txn = db.begin_write().map_err(|e| io(&e))?;
    let mut last = 0;
    {
        let mut table = txn.open_table(ALLOCATIONS).map_err(|e| io(&e))?;
        for msg in batch {
            match msg {
                Msg::Put {
                    id,
                    bytes,
                    index,
                    ack,
                } => {
                    acks.push(ack);
                    last = last.max(index);
                    table
                        .insert(id.as_str(), bytes.as_slice())
                        .map_err(|e| io(&e))?;
                }
                Msg::Delete { id, index, ack } => {
                    acks.push(ack);
                    last = last.max(index);
                    table.remove(id.as_str()).map_err(|e| io(&e))?;
                }
                // Everything queued before the close is in this batch.
                Msg::Close(done) => *closing = Some(done),
            }
        }
    }
    if acks.is_empty() {
        // Only a close: nothing to commit.
        txn.abort().map_err(|e| io(&e))?;
        return Ok(());
    }
    {
        let mut meta = txn.open_table(META).map_err(|e| io(&e))?;
        let stored = meta
            .get(META_LAST_INDEX)
            .map_err(|e| io(&e))?
            .map_or(0, |v| v.value());
        if last > stored {
            meta.insert(META_LAST_INDEX, last).map_err(|e| io(&e))?;
        }
    }
    txn.commit().map_err(|e| io(&e))
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
    use crate::{
        lifecycle::{AllocId, AllocSpec, Limits, TaskName, TaskSpec},
        registry::{Registry, RegistryConfig},
    };

    fn config(dir: &Path, max_batch: usize) -> RedbStoreConfig {
        RedbStoreConfig {
            dir: dir.to_owned(),
            max_batch,
            cache_bytes: DEFAULT_CACHE_BYTES,
            metrics: None,
        }
    }

    fn open(dir: &Path, max_batch: usize) -> RedbStore {
        RedbStore::open(config(dir, max_batch)).unwrap()
    }

    fn spec() -> AllocSpec {
        let task = TaskSpec {
            name: TaskName::parse("web").unwrap(),
            lifecycle: None,
            leader: false,
        };
        AllocSpec::new(vec![task], &Limits::default()).unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn acknowledged_changes_survive_a_reopen_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let (kept, last) = {
            let store = Arc::new(open(dir.path(), 64));
            let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
            let mut tasks = Vec::new();
            for i in 0..50 {
                let r = r.clone();
                tasks.push(tokio::spawn(async move {
                    r.register(AllocId::parse(&format!("a{i}")).unwrap(), spec())
                        .await
                        .unwrap()
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
            r.delete("a7").await.unwrap();
            let kept = r.get("a3").unwrap();
            let last = r.last_index();
            drop(r);
            store.close().unwrap();
            (kept, last)
        };
        let store = Arc::new(open(dir.path(), 64));
        let r = Registry::open(store, RegistryConfig::default()).unwrap();
        assert_eq!(r.len(), 49);
        assert!(r.get("a7").is_err(), "the deletion is durable");
        assert_eq!(*r.get("a3").unwrap(), *kept);
        assert_eq!(r.last_index(), last, "the deletion's index is remembered");
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
            let txns = store.db.begin_read().unwrap();
            let meta = txns.open_table(META).unwrap();
            assert_eq!(meta.get(META_LAST_INDEX).unwrap().unwrap().value(), 200);
            drop(meta);
            drop(txns);
            let stats = store.stats();
            assert_eq!(stats.changes, 200);
            if shared {
                assert!(stats.commits < 200, "{stats:?}");
            } else {
                assert_eq!(stats.commits, 200, "one commit per change");
            }
        }
    }

    #[test]
    fn an_unknown_file_format_stops_the_open_with_a_clear_message() {
        let dir = tempfile::tempdir().unwrap();
        {
            let db = Database::create(dir.path().join(DATA_FILE)).unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(META)
                .unwrap()
                .insert(META_FORMAT, 99)
                .unwrap();
            txn.commit().unwrap();
        }
        let err = RedbStore::open(config(dir.path(), 1))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("file format 99"), "{err}");
        assert!(err.contains(DATA_FILE), "{err}");
        assert!(err.contains("Nothing in it was changed"), "{err}");
    }

    #[test]
    fn a_corrupt_record_stops_the_load_naming_the_allocation() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = open(dir.path(), 1);
            let txn = store.db.begin_write().unwrap();
            txn.open_table(ALLOCATIONS)
                .unwrap()
                .insert("broken", b"{not json".as_slice())
                .unwrap();
            txn.commit().unwrap();
        }
        let store = open(dir.path(), 1);
        let err = store.load().err().unwrap().to_string();
        assert!(err.contains("\"broken\""), "{err}");
        // Still there: nothing was discarded.
        assert!(store.load().is_err());
    }

    #[test]
    fn a_file_that_is_not_redb_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(DATA_FILE);
        std::fs::write(&path, vec![0x42u8; 8192]).unwrap();
        let err = RedbStore::open(config(dir.path(), 1))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains(DATA_FILE), "{err}");
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
