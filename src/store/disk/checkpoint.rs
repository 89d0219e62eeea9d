//! Checkpoints: the sealed log folded into the next snapshot, on a thread
//! of its own at the lowest priority, and what they replaced removed.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, PoisonError,
        mpsc::{self, Receiver, Sender, SyncSender},
    },
    thread::JoinHandle,
    time::Instant,
};

use super::{
    StoreStats,
    fs::{Fs, RealFs},
    log::{self, Overlay},
    snapshot::{self, OLD_FILE},
};
use crate::{metrics::Metrics, store::StoreError};

/// A checkpoint to write: every segment up to `sealed` (and after the
/// last one folded) into the next snapshot.
pub(super) struct Job {
    pub(super) sealed: u64,
    /// Where the writer sealed segment `sealed`: its last segment read
    /// back must end there, or appends were lost from it.
    pub(super) end: log::End,
}

/// The checkpoint thread and the writer's ends of its channels.
pub(super) struct Checkpointer {
    /// One job at a time: the writer sends the next only once it has the
    /// last one's answer.
    pub(super) jobs: SyncSender<Job>,
    /// One answer per job: the new snapshot's size, or why it failed.
    pub(super) done: Receiver<Result<u64, String>>,
    thread: JoinHandle<()>,
}

impl Checkpointer {
    /// Starts the thread, the segments up to `folded` being in the
    /// snapshot.
    pub(super) fn start(
        fs: Arc<dyn Fs>,
        dir: PathBuf,
        folded: u64,
        stats: Arc<Mutex<StoreStats>>,
        metrics: Option<Arc<Metrics>>,
    ) -> std::io::Result<Self> {
        let (jobs, jobs_rx) = mpsc::sync_channel(1);
        let (done, done_rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("taskgate-checkpoint".into())
            .spawn(move || {
                checkpointer(
                    &*fs,
                    &dir,
                    folded,
                    &jobs_rx,
                    &done,
                    &stats,
                    metrics.as_deref(),
                );
            })?;
        Ok(Self {
            jobs,
            done: done_rx,
            thread,
        })
    }

    /// Whether the thread still runs.
    pub(super) fn alive(&self) -> bool {
        !self.thread.is_finished()
    }

    /// Ends the thread after the job it is on, and waits for it; whether
    /// it ended without a panic.
    pub(super) fn stop(self) -> bool {
        drop(self.jobs);
        self.thread.join().is_ok()
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
        match checkpoint(fs, dir, folded, job.sealed, Some(job.end)) {
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
pub(super) fn checkpoint(
    fs: &dyn Fs,
    dir: &Path,
    folded: u64,
    sealed: u64,
    sealed_end: Option<log::End>,
) -> std::io::Result<(snapshot::Written, usize)> {
    let segments = (folded + 1..=sealed)
        .map(|seq| {
            fs.read(&log::segment_path(dir, seq))
                .map(|bytes| (seq, bytes))
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut newest: HashMap<&str, Option<&[u8]>> = HashMap::new();
    let mut last_index = 0;
    // Where the log before the first of them ended, as the snapshot says.
    let mut before = match snapshot::Snapshot::open(fs, dir)? {
        Some(base) => base.log_end,
        None => log::End::NONE,
    };
    for (seq, bytes) in &segments {
        let damaged = |what: String| {
            std::io::Error::other(format!(
                "{}: {what}",
                log::segment_path(dir, *seq).display()
            ))
        };
        let replayed = log::replay_with(bytes, *seq, |id, index, record| {
            newest.insert(id, record);
            last_index = last_index.max(index);
        })
        .map_err(damaged)?;
        // What follows the last good frame (zeros a seal did not cut, a
        // torn tail a start did not) holds nothing, if the header after
        // it vouches for that end: a checkpoint never folds a log whose
        // parts do not vouch for each other (what it wrote would hide that
        // for good).
        if let Some(why) = log::mismatch(replayed.previous, before) {
            return Err(damaged(why));
        }
        before = replayed.end();
    }
    // The last segment: no header after it vouches for its end yet, the
    // writer does.
    if let Some(why) = sealed_end.and_then(|end| log::mismatch(end, before)) {
        return Err(std::io::Error::other(format!(
            "{}: sealed at byte {}, but {why}",
            log::segment_path(dir, sealed).display(),
            sealed_end.map_or(0, |e| e.len),
        )));
    }
    let changes = sort_changes(newest);
    let written = snapshot::fold_sorted(fs, dir, &changes, last_index, sealed, before)?;
    Ok((written, changes.len()))
}

/// The changes in ID order. Their IDs lie scattered over the segments
/// read back, so comparing the strings themselves misses the cache on most
/// compares (measured: see BENCHMARKS.md). Each ID is sorted by its first
/// 16 bytes as a number, computed once, which orders like the bytes
/// (zero-padded: a shorter ID that is a prefix of another sorts first
/// either way); only IDs that share those bytes are compared in full.
pub(super) fn sort_changes<'a>(
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
    /// snapshot it replaced, dropping the changes after). Returns the
    /// records the snapshot holds.
    pub fn fold(&mut self, changes: FoldChanges) -> Result<u64, StoreError> {
        self.sealed += 1;
        let written = snapshot::fold(&RealFs, &self.dir, &changes.0, self.sealed, log::End::NONE)
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

/// Removes what a checkpoint replaced: the replaced snapshot and the
/// segments up to `sealed`, a slice at a time (`log::remove_gently`). A
/// failure is only logged: the next checkpoint or the next open removes
/// them.
pub(super) fn remove_folded(fs: &dyn Fs, dir: &Path, sealed: u64) {
    if let Err(e) = log::remove_gently(fs, &dir.join(OLD_FILE)) {
        tracing::warn!(error = %e, "cannot remove the replaced snapshot; the next checkpoint removes it");
    }
    let result = log::list_segments(fs, dir).and_then(|segments| {
        for (_, path) in segments.iter().filter(|(seq, _)| *seq <= sealed) {
            log::remove_gently(fs, path)?;
        }
        Ok(())
    });
    if let Err(e) = result {
        tracing::warn!(error = %e, "cannot remove folded store log segments; the next start removes them");
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

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
