//! The writer: one thread, one log append and one `fdatasync` per batch
//! of changes (group commit), and the rollovers and checkpoints it starts.

use std::{
    path::PathBuf,
    sync::{
        Arc, Mutex, OnceLock, PoisonError, Weak,
        mpsc::{self, Receiver},
    },
    time::{Duration, Instant},
};

use super::{
    LOG_SLACK, Msg, SNAPSHOT_RATIO, StoreStats,
    checkpoint::{Checkpointer, Job},
    fs::Fs,
    log, manifest,
};
use crate::{
    metrics::Metrics,
    store::{AppendError, Follower, StoreError, StoreHealth},
    supervise::{MAX_RESTARTS, Supervisor},
};

/// What is wrong with the store's background work, shared between the
/// writer (which keeps it) and `DiskStore::health`.
#[derive(Debug, Default)]
pub(super) struct Trouble {
    /// Why the log takes no more changes, after a failed append: for good,
    /// until a restart recovers from the log.
    pub(super) write: Option<String>,
    /// The last checkpoint's error, while checkpoints fail.
    pub(super) checkpoint: Option<String>,
    /// The last error starting a new log segment, while that fails.
    pub(super) rollover: Option<String>,
    /// The log not yet folded reached its ceiling: changes are refused
    /// admission until a checkpoint succeeds.
    pub(super) full: bool,
}

impl Trouble {
    /// Why a change is refused admission now, if it is.
    pub(super) fn refusal(&self) -> Option<StoreError> {
        if let Some(why) = &self.write {
            return Some(StoreError::Io(why.clone()));
        }
        self.full.then(|| {
            StoreError::Unavailable(
                "the store log reached its ceiling of bytes not yet folded into the snapshot, \
                 because checkpoints fail; writes are refused until one succeeds"
                    .into(),
            )
        })
    }

    pub(super) fn health(&self) -> StoreHealth {
        if let Some(cause) = &self.write {
            return StoreHealth::Refusing {
                code: "write_failed",
                cause: cause.clone(),
            };
        }
        if self.full {
            return StoreHealth::Refusing {
                code: "log_full",
                cause: format!(
                    "the store log reached its ceiling; checkpoints fail: {}",
                    self.checkpoint
                        .as_deref()
                        .unwrap_or("(no checkpoint has failed)")
                ),
            };
        }
        let mut codes = Vec::new();
        if self.checkpoint.is_some() {
            codes.push("checkpoints_failing");
        }
        if self.rollover.is_some() {
            codes.push("log_rollover_failing");
        }
        if codes.is_empty() {
            StoreHealth::Ok
        } else {
            StoreHealth::Degraded(codes)
        }
    }
}

/// How long the writer waits before trying a failed checkpoint or
/// rollover again, at first and at most (doubling in between): a
/// checkpoint reads the whole unfolded log back, so failing ones tried
/// after every commit would take most of the disk's time.
pub(super) const RETRY_FIRST: Duration = Duration::from_secs(1);

pub(super) const RETRY_MAX: Duration = Duration::from_secs(60);

/// How often the writer, idle, looks at its checkpoint thread.
pub(super) const CHECK_EVERY: Duration = Duration::from_secs(1);

/// How often the writer, idle, looks for the answer of a checkpoint that
/// tries again.
pub(super) const RETRY_POLL: Duration = Duration::from_millis(10);

/// The single writer: one log append and one `fdatasync` per batch.
pub(super) struct Writer {
    pub(super) fs: Arc<dyn Fs>,
    pub(super) dir: PathBuf,
    pub(super) segment: log::Segment,
    /// Bytes of the current segment.
    pub(super) log_bytes: u64,
    /// Sealed segments not folded yet, and their bytes.
    pub(super) sealed: Vec<(u64, u64, log::End)>,
    pub(super) log_limit: u64,
    /// Unfolded log past which writes are refused.
    pub(super) log_ceiling: u64,
    /// The checkpoint thread (`None` only while it is started again).
    pub(super) checkpointer: Option<Checkpointer>,
    /// The last segment folded into the snapshot, and the one the job in
    /// flight folds.
    pub(super) folded: u64,
    pub(super) folding: u64,
    /// The snapshot's size (see `SNAPSHOT_RATIO`).
    pub(super) snapshot_bytes: u64,
    pub(super) in_flight: bool,
    /// Shared with `DiskStore::health`.
    pub(super) trouble: Arc<Mutex<Trouble>>,
    /// When a failed checkpoint or rollover is tried again, and the wait
    /// after the next failure.
    pub(super) retry_at: Option<Instant>,
    pub(super) retry_first: Duration,
    pub(super) backoff: Duration,
    pub(super) max_batch: usize,
    pub(super) stats: Arc<Mutex<StoreStats>>,
    pub(super) metrics: Option<Arc<Metrics>>,
    /// Handed every durable batch before its changes are answered.
    pub(super) follower: Arc<OnceLock<Weak<dyn Follower>>>,
    /// Told when the checkpoint thread is started again.
    pub(super) supervisor: Supervisor,
}

impl Writer {
    pub(super) fn run(&mut self, queue: &Receiver<Msg>) {
        let mut batch = Vec::with_capacity(self.max_batch);
        let mut buf = Vec::new();
        let mut acks = Vec::new();
        let mut changes = Vec::new();
        loop {
            // While something failed, wake up to try it again (and to
            // collect the try's answer) even if no change comes.
            let at = self.wake_at();
            let first = queue.recv_timeout(at.saturating_duration_since(Instant::now()));
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
            let mut last = 0;
            // The whole batch is one frame: one append, which a crash
            // leaves whole or torn, never half of its changes whole.
            log::begin(&mut buf);
            for msg in batch.drain(..) {
                match msg {
                    Msg::Change {
                        bytes,
                        change,
                        index,
                        ack,
                    } => {
                        buf.extend_from_slice(&bytes);
                        changes.push(change);
                        acks.push((index, ack));
                        last = index;
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
                    drop(s);
                    if let Some(f) = self.follower.get().and_then(Weak::upgrade) {
                        f.changed(std::mem::take(&mut changes), last);
                    }
                }
                changes.clear();
                for (index, ack) in acks.drain(..) {
                    let _ = ack.send(match &result {
                        Ok(()) => Ok(index),
                        Err(e) => Err(AppendError::Store(e.clone())),
                    });
                }
                self.maintain();
            }
            if let Some(closed) = closing {
                // The newest segment keeps its zeros written ahead, closed
                // cleanly or not: the next start holds it to them, and cuts
                // them once it has started the next segment.
                let _ = closed.send(());
                return;
            }
        }
    }

    /// Ends the checkpoint thread after its job, and waits for it.
    pub(super) fn stop_checkpointer(&mut self) {
        if let Some(c) = self.checkpointer.take()
            && !c.stop()
        {
            tracing::error!("the checkpoint thread panicked");
        }
    }

    /// When to look at the background work without a change to commit:
    /// the next try of what failed, or soon after a try is in flight.
    fn wake_at(&self) -> Instant {
        if let Some(at) = self.retry_at {
            return at;
        }
        let t = self.trouble();
        let retrying = t.checkpoint.is_some() || t.rollover.is_some() || t.full;
        if retrying && self.in_flight {
            return Instant::now() + RETRY_POLL;
        }
        // Idle, it still looks at its checkpoint thread now and then.
        Instant::now() + CHECK_EVERY
    }

    fn trouble(&self) -> std::sync::MutexGuard<'_, Trouble> {
        self.trouble.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The log not folded yet: the sealed segments and the current one.
    fn unfolded(&self) -> u64 {
        self.sealed.iter().map(|(_, b, _)| b).sum::<u64>() + self.log_bytes
    }

    /// Appends one frame. Past the log's ceiling the frame is still
    /// written (it was admitted before the log got there): the ceiling
    /// refuses admission to the changes after it.
    pub(super) fn append(&mut self, buf: &mut [u8]) -> Result<(), StoreError> {
        if let Some(why) = &self.trouble().write {
            return Err(StoreError::Io(why.clone()));
        }
        match self.segment.append(buf) {
            Ok(()) => {
                self.log_bytes += buf.len() as u64;
                let unfolded = self.unfolded();
                if unfolded > self.log_ceiling {
                    let mut t = self.trouble();
                    if !t.full {
                        t.full = true;
                        tracing::error!(
                            unfolded_bytes = unfolded,
                            ceiling = self.log_ceiling,
                            "the store log reached its ceiling because checkpoints fail; writes are \
                             refused until a checkpoint succeeds"
                        );
                    }
                }
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
        if self.checkpointer.as_ref().is_some_and(|c| !c.alive()) {
            return self.checkpointer_gone();
        }
        if self.in_flight {
            let Some(c) = &self.checkpointer else {
                return self.checkpointer_gone();
            };
            let answer = match c.done.try_recv() {
                Ok(answer) => Ok(answer),
                Err(mpsc::TryRecvError::Empty)
                    if self.log_bytes < self.limit().saturating_mul(LOG_SLACK) =>
                {
                    Err(false)
                }
                Err(mpsc::TryRecvError::Empty) => c.done.recv().map_err(|_| true),
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
        // After a failed append the segment's end is not known (part of
        // the append may be there), so no next segment may vouch for it:
        // the log stays as it is until a restart recovers from it.
        if self.trouble().write.is_some() {
            return;
        }
        // Start the next segment (unless this one is empty: a retry of a
        // failed checkpoint alone), which vouches for where this one ends,
        // and name it in the manifest; only then cut this one's zeros
        // (sealed), and fold everything sealed.
        if self.log_bytes > log::Segment::HEADER_LEN {
            let end = self.segment.end();
            let seq = self.segment.seq + 1;
            let next = log::Segment::create(&*self.fs, &self.dir, seq, end, self.segment.ahead())
                .and_then(|next| match manifest::write(&*self.fs, &self.dir, seq) {
                    Ok(()) => Ok(next),
                    Err(e) => {
                        // The manifest may name the new segment all the
                        // same (renamed, its directory's sync failed): it
                        // names this one again, durably, before the new one
                        // goes and this one takes appends again. If that
                        // fails too, the log takes nothing more until a
                        // restart, which finds the new segment unused.
                        drop(next);
                        match manifest::write(&*self.fs, &self.dir, self.segment.seq) {
                            Ok(()) => {
                                let _ = self.fs.remove_file(&log::segment_path(&self.dir, seq));
                            }
                            Err(again) => {
                                let why = format!(
                                    "naming the store log's newest segment failed ({again}); \
                                     no change is accepted until taskgate is restarted"
                                );
                                tracing::error!(error = %again, "store manifest write failed; the store takes no more changes");
                                self.trouble().write = Some(why);
                            }
                        }
                        Err(e)
                    }
                });
            let next = match next {
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
            let mut sealed = std::mem::replace(&mut self.segment, next);
            if let Err(e) = sealed.seal() {
                tracing::warn!(error = %e, "cannot cut the zeros written ahead off a sealed store log segment; the next start does");
            }
            self.sealed.push((sealed.seq, self.log_bytes, end));
            self.log_bytes = self.segment.len;
        }
        let Some(&(last, _, end)) = self.sealed.last() else {
            self.retry_at = None;
            return;
        };
        let job = Job { sealed: last, end };
        match self.checkpointer.as_ref().map(|c| c.jobs.send(job)) {
            Some(Ok(())) => {
                self.in_flight = true;
                self.folding = last;
                // Tried: the next try comes with the answer.
                self.retry_at = None;
            }
            _ => self.checkpointer_gone(),
        }
    }

    /// The checkpoint thread is gone (it panicked): it is started again,
    /// and the job it was on is tried again after the usual wait. One that
    /// keeps panicking, or cannot be started, stops the server.
    fn checkpointer_gone(&mut self) {
        self.in_flight = false;
        if let Some(dead) = self.checkpointer.take() {
            dead.stop();
        }
        let in_a_row = self.supervisor.restarted("checkpoint");
        let started = (in_a_row < MAX_RESTARTS)
            .then(|| {
                Checkpointer::start(
                    self.fs.clone(),
                    self.dir.clone(),
                    self.folded,
                    self.stats.clone(),
                    self.metrics.clone(),
                )
            })
            .transpose();
        match started {
            Ok(Some(c)) => {
                tracing::error!("the checkpoint thread panicked; it is started again");
                self.checkpointer = Some(c);
                self.failed(true);
            }
            Ok(None) => self.supervisor.stop(format!(
                "the store's checkpoint thread panicked {in_a_row} times in a row"
            )),
            Err(e) => self.supervisor.stop(format!(
                "the store's checkpoint thread cannot be started again: {e}"
            )),
        }
    }

    /// A checkpoint's answer.
    fn finished(&mut self, answer: Result<u64, String>) {
        match answer {
            Ok(bytes) => {
                self.snapshot_bytes = bytes;
                self.folded = self.folding;
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
