//! Recovery: what a start reads, checks and only then tidies.
//!
//! A start reads the snapshot, the manifest and every log segment the
//! snapshot has not folded, up to the newest the manifest names, decodes
//! every record, and refuses the directory, naming the file and the byte
//! (or the file that is missing), if anything does not read back. Only
//! once all of it has been read does it change anything: the torn tail of
//! the newest segment is kept beside it (as `<segment>.broken`), segments
//! the snapshot already folded, segments never used and unfinished
//! temporary files are removed; once the next segment is started, what
//! follows the last append of the ones before it is cut off.

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
};

use super::{
    LOCK_FILE,
    fs::{Fs, RealFs},
    log::{self, Overlay},
    manifest::{self, MANIFEST_FILE, MANIFEST_TEMP},
    semaphore_name,
    snapshot::{self, NEXT_FILE, OLD_FILE, SNAPSHOT_FILE, Snapshot},
    unusable, unusable_log,
};
use crate::{
    lifecycle::Allocation,
    store::{Loaded, StoreError, identity::STORE_ID_FILE, record},
};

/// The file of the pre-release store (redb), which no release reads.
pub const REDB_FILE: &str = "taskgate.redb";

/// A directory holding only a pre-release store is refused and named: read
/// as an empty store, its allocations would be lost without a word. The
/// first release's format (the snapshot and its log) is the baseline.
pub(super) fn refuse_pre_release(dir: &Path) -> Result<(), StoreError> {
    if dir.join(REDB_FILE).exists() && !dir.join(SNAPSHOT_FILE).exists() {
        return Err(StoreError::Unusable(format!(
            "{} holds a store of taskgate's pre-release format ({REDB_FILE}), which this \
             taskgate does not read; move the directory away to start with an empty store",
            dir.display()
        )));
    }
    Ok(())
}

/// Where the log the snapshot in `dir` folded ends: the last segment it
/// folded, and where that segment ended, or no log at all without a
/// snapshot. A snapshot that is missing while the one it replaced is
/// still there, or while the log starts past segment 1, is a lost
/// snapshot, not an empty store (see `scan_log`).
pub(super) fn snapshot_folded(fs: &dyn Fs, dir: &Path) -> Result<Folded, StoreError> {
    let path = dir.join(SNAPSHOT_FILE);
    let none = Folded {
        seq: 0,
        end: log::End::NONE,
    };
    match Snapshot::open(fs, dir) {
        Ok(Some(s)) => Ok(Folded {
            seq: s.folded,
            end: s.log_end,
        }),
        Ok(None) if fs.exists(&dir.join(OLD_FILE)) => Err(unusable(
            &path,
            format!(
                "it is missing, but the snapshot it replaced ({OLD_FILE}) is there: a snapshot \
                 is only ever replaced by a rename, so it was removed by something else"
            ),
        )),
        Ok(None) => Ok(none),
        Err(e) => Err(unusable(&path, format!("cannot be read: {e}"))),
    }
}

/// How far the snapshot folded the log.
#[derive(Clone, Copy, Debug)]
pub(super) struct Folded {
    /// The last segment it folded (0: none).
    pub(super) seq: u64,
    /// Where that segment ended, as the snapshot says.
    pub(super) end: log::End,
}

/// What the log holds, read without changing anything, and what a start
/// must then tidy (`apply`, then `cut_older` once the next segment is
/// started).
pub(super) struct Recovery {
    pub(super) overlay: Overlay,
    /// Bytes of the live segments, up to their last good frame.
    pub(super) log_bytes: u64,
    /// The sequence number of the segment to write next.
    pub(super) next_seq: u64,
    /// Segments the snapshot already folded (a checkpoint stopped before
    /// removing them).
    pub(super) folded: Vec<PathBuf>,
    /// The newest segment's torn tail: the segment and where to cut it.
    pub(super) torn: Option<(PathBuf, log::Bad, u64)>,
    /// Segments with bytes after their last good frame that no history
    /// holds (zeros written ahead, a torn tail, the rest of a cut a start
    /// did not finish), and where to cut them: once a newer segment's
    /// header vouches for that end.
    pub(super) leftovers: Vec<(PathBuf, u64)>,
    /// Where the log ends once the torn tail is cut: what the next
    /// segment's header records.
    pub(super) end: log::End,
    /// Segments newer than the manifest names: started, never used (a
    /// crash or a failure before the manifest named them), removed.
    pub(super) unused: Vec<PathBuf>,
}

/// A segment before the newest whose end, where its last good frame ends,
/// the next segment's header has yet to vouch for.
struct Unvouched {
    path: PathBuf,
    end: log::End,
    /// What follows that end: a bad frame, or zeros (their count).
    bad: Option<log::Bad>,
    spare: u64,
}

/// Replays the log segments `folded` does not cover into an overlay. They
/// must run on from `folded + 1` with no gap to the newest the manifest
/// names (`manifest`: segments after it never took an append), each
/// beginning where its header says the one before it ended (the first:
/// where the snapshot says the log it folded ended), so a sealed segment
/// that lost appends at its end, even cut at a frame boundary, is found.
/// The newest may end in a torn append (`log.rs` says what counts as
/// torn), and must be as long as the writer made it, zeros written
/// `ahead` included (`log::written_ahead`), so a newest segment cut
/// short is found too. Anything else stops the start, naming the file
/// and the offset.
pub(super) fn scan_log(
    fs: &dyn Fs,
    dir: &Path,
    folded: Folded,
    manifest: Option<u64>,
    ahead: u64,
) -> Result<Recovery, StoreError> {
    let snapshot_end = folded.end;
    let folded = folded.seq;
    if folded == u64::MAX {
        return Err(unusable(
            &dir.join(SNAPSHOT_FILE),
            "it says it folded the log up to the last segment number there can be",
        ));
    }
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
        leftovers: Vec::new(),
        end: snapshot_end,
        unused: Vec::new(),
    };
    let manifest_path = dir.join(MANIFEST_FILE);
    if manifest.is_none() {
        let held = [dir.join(SNAPSHOT_FILE), dir.join(STORE_ID_FILE)]
            .into_iter()
            .find(|p| fs.exists(p));
        if let Some(held) = held {
            return Err(StoreError::Unusable(format!(
                "{}: it is missing, but {} is there. The manifest names the store log's \
                 newest segment: without it, whether segments were removed cannot be told. \
                 Nothing was changed. Restore the data directory from a backup as a whole, or \
                 copy what can be read with `taskgate dump --salvage`",
                manifest_path.display(),
                held.display()
            )));
        }
    }
    if let Some(m) = manifest.filter(|&m| m <= folded) {
        return Err(unusable(
            &dir.join(SNAPSHOT_FILE),
            format!(
                "it says it folded the log up to segment {folded}, but the manifest {} names \
                 segment {m} as the newest: the two are not of one history",
                manifest_path.display()
            ),
        ));
    }
    let (done, mut live): (Vec<_>, Vec<_>) = log::list_segments(fs, dir)
        .map_err(dir_error)?
        .into_iter()
        .partition(|(seq, _)| *seq <= folded);
    recovery.folded = done.into_iter().map(|(_, path)| path).collect();
    // The manifest names a segment before anything is appended to it.
    let named = manifest.unwrap_or(0);
    while let Some((seq, path)) = live.last().filter(|(seq, _)| *seq > named) {
        let content = fs
            .read(path)
            .map_err(|e| unusable_log(path, format!("cannot be read: {e}")))?;
        if !never_used(&content, *seq) {
            return Err(match manifest {
                Some(m) => unusable_log(
                    path,
                    format!(
                        "it holds appends, but the manifest {} names segment {m} as the \
                         newest: a segment takes appends only once the manifest names it",
                        manifest_path.display()
                    ),
                ),
                None => StoreError::Unusable(format!(
                    "{}: it is missing, but the store log holds appends ({}). The manifest \
                     names the log's newest segment: without it, whether segments were \
                     removed cannot be told. Nothing was changed. Restore the data directory \
                     from a backup as a whole, or copy what can be read with `taskgate dump \
                     --salvage`",
                    manifest_path.display(),
                    path.display()
                )),
            });
        }
        recovery.unused.push(path.clone());
        live.pop();
    }
    // The newest the manifest names is there (and the others, below).
    let newest_seq = live.last().map_or(folded, |(seq, _)| *seq);
    if let Some(m) = manifest.filter(|&m| newest_seq < m) {
        let from = newest_seq + 1;
        let mut why = if from == m {
            format!(
                "it is missing, and the manifest {} names it as the log's newest segment",
                manifest_path.display()
            )
        } else {
            format!(
                "it is missing, with segments {from} to {}, and the manifest {} names it as \
                 the log's newest segment",
                m - 1,
                manifest_path.display()
            )
        };
        if folded == 0 && from == 1 && m > 1 {
            why.push_str(&format!(
                "; the snapshot {} that folded the segments before is missing too",
                dir.join(SNAPSHOT_FILE).display()
            ));
        }
        return Err(unusable_log(&log::segment_path(dir, m), why));
    }
    let count = live.len();
    let mut before: Option<Unvouched> = None;
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
        let r = log::replay(&content, seq, &mut recovery.overlay)
            .map_err(|e| unusable_log(&path, e))?;
        match before.take() {
            None => follows_snapshot(dir, &path, r.previous, snapshot_end)?,
            Some(before) => {
                follows(&before, &path, r.previous)?;
                if before.bad.is_some() || before.spare > 0 {
                    recovery.leftovers.push((before.path, before.end.len));
                }
            }
        }
        recovery.next_seq = seq + 1;
        recovery.log_bytes += r.valid_len;
        recovery.end = r.end();
        if i + 1 < count {
            before = Some(Unvouched {
                path,
                end: r.end(),
                bad: r.bad,
                spare: r.spare,
            });
            continue;
        }
        // The newest: its writer made it longer than any append in it
        // before writing that append (zeros ahead), so a crash leaves it
        // at least that long, and no append of it cut short by its end.
        let need = log::written_ahead(r.valid_len, ahead);
        let cut = r.bad.as_ref().is_some_and(|b| b.cut);
        if (content.len() as u64) < need || cut {
            return Err(unusable_log(
                &path,
                format!(
                    "it is {} bytes long, but its writer had written it out to at least byte \
                     {need} (zeros ahead of its appends) before writing {}: it was cut short, \
                     and acknowledged appends from byte {} on may be missing. `taskgate dump \
                     --salvage` copies what can be read to a new directory",
                    content.len(),
                    if cut {
                        "the append it ends inside"
                    } else {
                        "its appends"
                    },
                    r.valid_len,
                ),
            ));
        }
        if r.spare > 0 {
            recovery.leftovers.push((path.clone(), r.valid_len));
        }
        let Some(bad) = r.bad else { continue };
        if !bad.torn {
            return Err(unusable_log(&path, damaged_at(&bad, false)));
        }
        recovery.leftovers.push((path.clone(), r.valid_len));
        recovery.torn = Some((path, bad, r.valid_len));
    }
    Ok(recovery)
}

/// Why a segment is refused for the bad frame `bad`.
fn damaged_at(bad: &log::Bad, newer_follow: bool) -> String {
    format!(
        "it is damaged at byte {}: the frame there {}; the {} bytes from there on cannot be \
         read{}. `taskgate dump --salvage` copies what can be read to a new directory",
        bad.at,
        bad.what,
        bad.bytes,
        if newer_follow {
            ", and newer segments follow it"
        } else {
            ""
        }
    )
}

/// Whether segment `seq` (its bytes) holds no frame (and nothing
/// damaged): one started and never used.
fn never_used(content: &[u8], seq: u64) -> bool {
    log::replay_with(content, seq, |_, _, _| {}).is_ok_and(|r| r.frames == 0 && r.bad.is_none())
}

/// Checks that segment `path`, whose header says the log before it ended
/// at `stated`, follows the segment `before` that ended where it says
/// (what lies after that end in `before`, zeros or a torn append, is not
/// in the history). Damage, if any, is at the end of that segment: it is
/// the one named.
fn follows(before: &Unvouched, path: &Path, stated: log::End) -> Result<(), StoreError> {
    let end = before.end;
    if stated == end {
        return Ok(());
    }
    let next = path.display();
    let why = if let Some(bad) = &before.bad {
        damaged_at(bad, true)
    } else if before.spare > 0 && end.len < stated.len {
        format!(
            "it is damaged at byte {}: the {} bytes from there on read as zeros, and newer \
             segments follow it. `taskgate dump --salvage` copies what can be read to a new \
             directory",
            end.len, before.spare
        )
    } else if end.len < stated.len {
        format!(
            "it ends at byte {}, but the segment after it ({next}) says it ended at byte {}: \
             the {} bytes of acknowledged appends from byte {} on are missing (a sealed \
             segment was cut short)",
            end.len,
            stated.len,
            stated.len - end.len,
            end.len
        )
    } else if end.len > stated.len {
        format!(
            "it ends at byte {}, but the segment after it ({next}) says it ended at byte {}: \
             the bytes from byte {} on were never part of it",
            end.len, stated.len, stated.len
        )
    } else {
        format!(
            "its last append (ending at byte {}) is not the one the segment after it \
             ({next}) names: the two are not of one history (a segment copied from \
             elsewhere?)",
            end.len
        )
    };
    Err(unusable_log(&before.path, why))
}

/// Checks that the first segment the snapshot has not folded, `path`,
/// whose header says the log before it ended at `stated`, follows the log
/// the snapshot folded (which ended at `folded`).
fn follows_snapshot(
    dir: &Path,
    path: &Path,
    stated: log::End,
    folded: log::End,
) -> Result<(), StoreError> {
    if stated == folded {
        return Ok(());
    }
    let snapshot = dir.join(SNAPSHOT_FILE);
    Err(unusable_log(
        path,
        format!(
            "its header (at byte 16) says the log before it ended at byte {} (chain {:08x}), \
             but the snapshot {} says the log it folded ended at byte {} (chain {:08x}): the \
             snapshot and the log are not of one history (an older snapshot with a newer log, \
             or files of two data directories)",
            stated.len,
            stated.chain,
            snapshot.display(),
            folded.len,
            folded.chain
        ),
    ))
}

impl Recovery {
    /// Tidies the data directory once everything in it has been read:
    /// keeps the newest segment's torn tail beside it (as
    /// `<segment>.broken`), and removes the segments already folded,
    /// segments started and never used, an unfinished snapshot, segment
    /// and manifest. No segment is cut here: a segment shorter than what
    /// its writer made durable is refused (`scan_log`), so it is cut
    /// (`cut_older`) only once a newer segment vouches for where it ends.
    pub(super) fn apply(&self, fs: &dyn Fs, dir: &Path) -> Result<(), StoreError> {
        let mut aside = None;
        if let Some((path, bad, len)) = &self.torn {
            let names_before = fs.list(dir).unwrap_or_default();
            let kept = log::keep_aside(fs, path, *len)
                .map_err(|e| aside_failed(fs, dir, path, &names_before, e))?;
            tracing::warn!(
                segment = %path.display(),
                at = bad.at,
                bytes = bad.bytes,
                kept_in = %kept.display(),
                "an unfinished append at the end of the store log (the frame there {}; it was \
                 never acknowledged) is kept aside and cut off",
                bad.what
            );
            aside = Some(kept);
        }
        self.remove(fs, dir).inspect_err(|_| {
            // Refused after all: the copy goes too (the segment still
            // holds what it copied), so the start changed nothing it
            // needed to.
            if let Some(kept) = &aside
                && fs.remove_file(kept).is_ok()
            {
                let _ = fs.sync_dir(dir);
            }
        })
    }

    /// Removes the segments already folded, segments started and never
    /// used, and unfinished `.new` files.
    fn remove(&self, fs: &dyn Fs, dir: &Path) -> Result<(), StoreError> {
        // What is removed holds nothing the store needs: a failure here is
        // the file system's (mend it), not damage.
        let cannot = |path: &Path, e: std::io::Error| {
            StoreError::Unusable(format!(
                "cannot remove {}, which holds nothing the store needs: {e}. {}; the \
                 directory holds every acknowledged change",
                path.display(),
                mend(&e)
            ))
        };
        let mut removed = false;
        for path in self.unused.iter().chain(&self.folded) {
            fs.remove_file(path).map_err(|e| cannot(path, e))?;
            removed = true;
        }
        // A checkpoint, a segment's or the manifest's creation that stopped
        // before its rename: incomplete, never used.
        for name in [NEXT_FILE, log::SEGMENT_TEMP, MANIFEST_TEMP] {
            let path = dir.join(name);
            match fs.remove_file(&path) {
                Ok(()) => removed = true,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(cannot(&path, e)),
            }
        }
        if removed {
            fs.sync_dir(dir).map_err(|e| {
                StoreError::Unusable(format!(
                    "cannot sync the data directory {}: {e}. {}; the directory holds every \
                     acknowledged change",
                    dir.display(),
                    mend(&e)
                ))
            })?;
        }
        Ok(())
    }

    /// Cuts what no history holds off the segments before the one just
    /// started (whose header vouches for where the newest of them ends):
    /// zeros written ahead, a torn tail. Only tidying: a segment left
    /// uncut reads the same.
    pub(super) fn cut_older(&self, fs: &dyn Fs) {
        for (path, len) in &self.leftovers {
            if let Err(e) = log::cut(fs, path, *len) {
                tracing::warn!(segment = %path.display(), at = len, error = %e, "cannot cut what follows the last append of a store log segment; the next start tries again");
            }
        }
    }
}

/// What an operator does about a file system error that stopped a start
/// before or after it changed anything; the data is not damaged.
pub(super) fn mend(e: &std::io::Error) -> &'static str {
    if e.kind() == std::io::ErrorKind::StorageFull {
        "The file system is full: free space on it and start again"
    } else {
        "Mend that (the data directory must take writes) and start again"
    }
}

/// Why a start could not keep the torn tail of segment `path` aside. The
/// log is not damaged: what stopped the start is the file system (full,
/// read-only, failing), so the answer says to mend that and start again,
/// not to restore a backup. A `.broken` file the copy began (empty or
/// partial) is removed, so the start has changed nothing.
fn aside_failed(
    fs: &dyn Fs,
    dir: &Path,
    path: &Path,
    names_before: &[std::ffi::OsString],
    e: std::io::Error,
) -> StoreError {
    let what = format!(
        "store log segment {}: it ends in an unfinished append (never acknowledged), which a \
         start keeps aside in a `{}` file before cutting it off; that failed ({e}). {}",
        path.display(),
        log::BROKEN_SUFFIX,
        mend(&e)
    );
    let mut prefix = path.file_name().unwrap_or_default().to_owned();
    prefix.push(log::BROKEN_SUFFIX);
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
pub(super) fn load_with(fs: &dyn Fs, dir: &Path, overlay: &Overlay) -> Result<Loaded, StoreError> {
    let path = dir.join(SNAPSHOT_FILE);
    let io = |e: std::io::Error| unusable(&path, format!("cannot be read: {e}"));
    let mut base = Snapshot::open(fs, dir).map_err(io)?;
    let stored_index = base.as_ref().map_or(0, |b| b.last_index);
    // The log's changes are newer than the snapshot's records: merged in ID
    // order, a logged record replaces the snapshot's, a logged deletion
    // drops it.
    let changes = snapshot::sorted(overlay);
    let stored = base.as_ref().map_or(0, Snapshot::records);
    let folded = base.as_ref().map_or(0, |b| b.folded);
    let mut loader = Loader::new(&path, usize::try_from(stored).unwrap_or(0) + changes.len());
    loader.logged = Some(Box::new(move |key| {
        locate(fs, dir, folded, key).filter(|_| overlay.changes.contains_key(key))
    }));
    let mut failed = None;
    // The semaphores' records, kept apart from the allocations' and
    // decoded here (a few): their keys sort after every allocation's, so
    // a bad allocation record is still the first one named.
    let mut semaphores = Vec::new();
    let read = snapshot::load(base.as_mut(), &changes, |id, record| {
        if let Some(name) = semaphore_name(id) {
            semaphores.push((id.to_owned(), name.to_owned(), record.to_vec()));
            return Ok(());
        }
        loader.push(id.to_owned(), record.to_vec()).map_err(|e| {
            failed = Some(e);
            std::io::Error::other("a record did not decode")
        })
    });
    if let Err(e) = read {
        // The records read before the files failed come first in key
        // order: a bad one among them is named, whether or not a thread
        // has decoded it yet.
        return Err(failed
            .or_else(|| loader.finish().err())
            .unwrap_or_else(|| io(e)));
    }
    let allocations = loader.finish()?;
    let semaphores = semaphores
        .into_iter()
        .map(|(key, name, bytes)| {
            let bad = |what: String| match locate(fs, dir, folded, &key)
                .filter(|_| overlay.changes.contains_key(&key))
            {
                Some((segment, at)) => {
                    unusable_log(&segment, format!("in the append at byte {at}, {what}"))
                }
                None => unusable(&path, what),
            };
            let s = record::decode_semaphore(&bytes).map_err(|e| {
                bad(format!(
                    "the record of semaphore {name:?} is unreadable: {e}"
                ))
            })?;
            if s.name.as_str() != name {
                return Err(bad(format!(
                    "the record under {key:?} is for semaphore {:?}",
                    s.name
                )));
            }
            Ok(s)
        })
        .collect::<Result<_, _>>()?;
    Ok(Loaded {
        allocations,
        last_index: stored_index.max(overlay.last_index),
        semaphores,
        ..Default::default()
    })
}

/// Where the newest record of allocation `key` lies in the log segments
/// after `folded`: the segment, and the byte its append starts at. Only
/// for naming a bad record: it reads the log again.
fn locate(fs: &dyn Fs, dir: &Path, folded: u64, key: &str) -> Option<(PathBuf, u64)> {
    let mut found = None;
    for (seq, path) in log::list_segments(fs, dir).ok()? {
        let Ok(bytes) = fs.read(&path) else { continue };
        if seq <= folded {
            continue;
        }
        let start = bytes.as_ptr() as usize;
        let mut at = None;
        let _ = log::replay_with(&bytes, seq, |id, _, record| {
            if id == key {
                // Where in the file: the record is a slice of it.
                at = record.map(|r| (r.as_ptr() as usize - start) as u64);
            }
        });
        if let Some(at) = at {
            found = Some((path, log::append_of(&bytes, at)));
        }
    }
    found
}

/// A shared lock on `dir`, held while reading it from outside a store: a
/// checkpoint must not replace the files midway. Refused while a taskgate
/// has the directory open. A directory no store has opened has no lock
/// file (`None`); nothing is created in it.
pub(in crate::store) fn lock_shared(dir: &Path) -> Result<Option<std::fs::File>, StoreError> {
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
    let (_, recovery) = scan(&RealFs, dir, log::WRITE_AHEAD)?;
    load_with(&RealFs, dir, &recovery.overlay)
}

/// What the snapshot says it folded, and the log read against it and the
/// manifest (`scan_log`), with segments written `ahead`.
pub(super) fn scan(fs: &dyn Fs, dir: &Path, ahead: u64) -> Result<(Folded, Recovery), StoreError> {
    let folded = snapshot_folded(fs, dir)?;
    let manifest = manifest::read(fs, dir).map_err(|e| {
        StoreError::Unusable(format!(
            "{}: {e}. Nothing was changed. The data directory must be restored from a backup \
             as a whole, or what can be read copied with `taskgate dump --salvage`",
            dir.join(MANIFEST_FILE).display()
        ))
    })?;
    Ok((folded, scan_log(fs, dir, folded, manifest, ahead)?))
}

/// Decodes loaded records in chunks on every core while the records
/// after them are read: decoding is most of a recovery, and reading the
/// files (one thread) does not wait for it, nor it for the reading.
pub(super) struct Loader<'a> {
    path: &'a Path,
    /// Where a record the log holds lies (the segment, the byte of its
    /// append), to name that and not the snapshot when it is bad.
    logged: Option<Locate<'a>>,
    raw: Raw,
    allocations: Vec<Allocation>,
    specs: crate::lifecycle::SpecInterner,
    /// Chunks for the decoding threads, numbered; bounded, so that the
    /// reading stays a few chunks ahead and no more.
    jobs: Option<mpsc::SyncSender<(usize, Raw)>>,
    done: mpsc::Receiver<(usize, Decoded)>,
    workers: Vec<std::thread::JoinHandle<()>>,
    /// Chunks sent, chunks kept, and decoded chunks that came before an
    /// earlier one.
    sent: usize,
    taken: usize,
    early: std::collections::BTreeMap<usize, Decoded>,
    /// Set when the loader is dropped before `finish` (a bad record, or
    /// files that cannot be read): the threads leave the chunks still
    /// queued, and `drop` waits for them to end.
    stop: Arc<AtomicBool>,
}

/// A chunk of records as read, each with its key.
type Raw = Vec<(String, Vec<u8>)>;

/// Where the log holds the record of an allocation, if it does.
type Locate<'a> = Box<dyn Fn(&str) -> Option<(PathBuf, u64)> + 'a>;

/// A chunk's records decoded, each with its key.
type Decoded = Vec<(String, Result<Allocation, String>)>;

impl<'a> Loader<'a> {
    const CHUNK: usize = 16_384;

    fn new(path: &'a Path, capacity: usize) -> Self {
        Self::with_decoder(path, capacity, record::decode)
    }

    /// `new`, with records decoded by `decode`.
    fn with_decoder(
        path: &'a Path,
        capacity: usize,
        decode: fn(&[u8]) -> Result<Allocation, String>,
    ) -> Self {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let stop = Arc::new(AtomicBool::new(false));
        let (jobs, queue) = mpsc::sync_channel::<(usize, Raw)>(threads);
        let queue = Arc::new(Mutex::new(queue));
        let (out, done) = mpsc::channel();
        let workers = (0..threads)
            .map(|_| {
                let (queue, out, stop) = (queue.clone(), out.clone(), stop.clone());
                std::thread::spawn(move || {
                    loop {
                        let job = queue.lock().unwrap_or_else(PoisonError::into_inner).recv();
                        let Ok((n, raw)) = job else {
                            return;
                        };
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                        let decoded: Decoded = raw
                            .into_iter()
                            .map(|(key, bytes): (String, Vec<u8>)| {
                                let a = decode(&bytes);
                                (key, a)
                            })
                            .collect();
                        if out.send((n, decoded)).is_err() {
                            return;
                        }
                    }
                })
            })
            .collect();
        Self {
            path,
            logged: None,
            raw: Vec::with_capacity(Self::CHUNK),
            allocations: Vec::with_capacity(capacity),
            specs: Default::default(),
            jobs: Some(jobs),
            done,
            workers,
            sent: 0,
            taken: 0,
            early: Default::default(),
            stop,
        }
    }

    /// Takes the records in key order.
    fn push(&mut self, key: String, bytes: Vec<u8>) -> Result<(), StoreError> {
        self.raw.push((key, bytes));
        if self.raw.len() == Self::CHUNK {
            self.send()?;
        }
        Ok(())
    }

    /// Hands the records taken so far to the decoding threads, and takes
    /// in what they have decoded meanwhile.
    fn send(&mut self) -> Result<(), StoreError> {
        let raw = std::mem::replace(&mut self.raw, Vec::with_capacity(Self::CHUNK));
        let jobs = self.jobs.as_ref().expect("jobs are sent until `finish`");
        if jobs.send((self.sent, raw)).is_err() {
            return Err(self.lost());
        }
        self.sent += 1;
        while let Ok((n, decoded)) = self.done.try_recv() {
            self.take(n, decoded)?;
        }
        Ok(())
    }

    /// Keeps a decoded chunk, in chunk order.
    fn take(&mut self, n: usize, decoded: Decoded) -> Result<(), StoreError> {
        self.early.insert(n, decoded);
        while let Some(decoded) = self.early.remove(&self.taken) {
            for (key, result) in decoded {
                let bad = |what: String| match self.logged.as_ref().and_then(|at| at(&key)) {
                    Some((segment, at)) => {
                        unusable_log(&segment, format!("in the append at byte {at}, {what}"))
                    }
                    None => unusable(self.path, what),
                };
                let mut a = result.map_err(|e| {
                    bad(format!(
                        "the record of allocation {key:?} is unreadable: {e}"
                    ))
                })?;
                if a.id.as_str() != key {
                    return Err(bad(format!(
                        "the record under {key:?} is for allocation {:?}",
                        a.id
                    )));
                }
                a.spec = self.specs.share(a.spec);
                self.allocations.push(a);
            }
            self.taken += 1;
        }
        Ok(())
    }

    fn finish(mut self) -> Result<Vec<Allocation>, StoreError> {
        if !self.raw.is_empty() {
            self.send()?;
        }
        // No more chunks: the threads end once the queue is empty.
        self.jobs = None;
        while self.taken < self.sent {
            let Ok((n, decoded)) = self.done.recv() else {
                return Err(self.lost());
            };
            self.take(n, decoded)?;
        }
        for w in std::mem::take(&mut self.workers) {
            let _ = w.join();
        }
        Ok(std::mem::take(&mut self.allocations))
    }

    /// A decoding thread died: only a panic ends one early.
    fn lost(&self) -> StoreError {
        unusable(self.path, "a thread decoding its records failed".to_owned())
    }
}

/// A load that stops early (a bad record, files that cannot be read)
/// leaves no thread behind decoding what no one will take: the threads
/// skip what is still queued, and have ended when the load answers.
impl Drop for Loader<'_> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.jobs = None;
        for w in std::mem::take(&mut self.workers) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifecycle::AllocId;

    fn record(id: &str) -> Vec<u8> {
        let spec = Arc::new(super::super::tests::spec());
        let a = Allocation::register(
            AllocId::parse(id).unwrap(),
            spec,
            1,
            time::OffsetDateTime::UNIX_EPOCH,
        );
        record::encode(&a)
    }

    /// Keys for three and a half chunks, in key order.
    fn keys() -> Vec<String> {
        (0..Loader::CHUNK * 7 / 2)
            .map(|i| format!("a{i:06}"))
            .collect()
    }

    #[test]
    fn records_decoded_on_other_threads_come_back_in_key_order() {
        let path = Path::new("/data/taskgate.snapshot");
        let mut loader = Loader::new(path, 0);
        for key in keys() {
            let bytes = record(&key);
            loader.push(key, bytes).unwrap();
        }
        let ids: Vec<String> = loader
            .finish()
            .unwrap()
            .iter()
            .map(|a| a.id.to_string())
            .collect();
        assert_eq!(ids, keys());
    }

    /// Pushes `n` records under the key "a" (`bad(i)` for the i-th, if
    /// any, else a good one) until one is refused; then finishes. The
    /// error if any, and a pointer the decoding threads each hold.
    fn load_a(
        loader: Loader<'_>,
        n: usize,
        bad: impl Fn(usize) -> Option<Vec<u8>>,
    ) -> (Result<usize, StoreError>, std::sync::Weak<AtomicBool>) {
        let mut loader = loader;
        let threads = Arc::downgrade(&loader.stop);
        let good = record("a");
        for i in 0..n {
            let bytes = bad(i).unwrap_or_else(|| good.clone());
            if let Err(e) = loader.push("a".to_owned(), bytes) {
                return (Err(e), threads);
            }
        }
        (loader.finish().map(|a| a.len()), threads)
    }

    /// A load refused at a bad record leaves no thread behind decoding
    /// what nobody will take: all of them have ended when it answers.
    #[test]
    fn a_refused_load_leaves_no_decoding_thread_behind() {
        let path = Path::new("/data/taskgate.snapshot");
        for at in [0, Loader::CHUNK * 2 + 1] {
            let (got, threads) = load_a(Loader::new(path, 0), Loader::CHUNK * 16, |i| {
                (i == at).then(|| vec![0xee])
            });
            let said = got.unwrap_err().to_string();
            assert!(said.contains("\"a\" is unreadable"), "{said}");
            assert_eq!(threads.strong_count(), 0, "threads still decoding");
        }
    }

    /// An empty store: nothing, and no thread left.
    #[test]
    fn an_empty_load_is_empty_and_leaves_no_thread() {
        let path = Path::new("/data/taskgate.snapshot");
        let (got, threads) = load_a(Loader::new(path, 0), 0, |_| None);
        assert_eq!(got.unwrap(), 0);
        assert_eq!(threads.strong_count(), 0);
    }

    /// A decoding thread that panics fails the load, wherever its chunk
    /// is; it neither hangs nor leaves the other threads behind.
    #[test]
    fn a_panic_while_decoding_fails_the_load_without_hanging() {
        fn decode(bytes: &[u8]) -> Result<Allocation, String> {
            assert_ne!(bytes, b"panic", "a decoding bug");
            record::decode(bytes)
        }
        let path = Path::new("/data/taskgate.snapshot");
        let n = Loader::CHUNK * 3 + 1;
        for at in [0, Loader::CHUNK + 5, n - 1] {
            let loader = Loader::with_decoder(path, 0, decode);
            let (got, threads) = load_a(loader, n, |i| (i == at).then(|| b"panic".to_vec()));
            let said = got.unwrap_err().to_string();
            assert!(
                said.contains("a thread decoding its records failed"),
                "{said}"
            );
            assert_eq!(threads.strong_count(), 0);
        }
    }

    /// The snapshot fails to read (a record damaged) after a bad record
    /// was read: the bad record, first in key order, is the one named, as
    /// when a chunk was decoded before reading on, whichever thread has
    /// decoded it by then.
    #[test]
    fn a_bad_record_read_before_a_damaged_one_is_the_one_named() {
        let dir = tempfile::tempdir().unwrap();
        let keys: Vec<String> = (0..Loader::CHUNK + 100)
            .map(|i| format!("a{i:06}"))
            .collect();
        let (bad, damaged) = (5, Loader::CHUNK + 50);
        let mut overlay = Overlay::default();
        for (i, key) in keys.iter().enumerate() {
            let bytes = if i == bad { vec![0xee] } else { record(key) };
            overlay.apply(key.clone(), Some(bytes), 1);
        }
        snapshot::fold(&RealFs, dir.path(), &overlay, 1, log::End::NONE).unwrap();
        let path = dir.path().join(SNAPSHOT_FILE);
        let mut file = std::fs::read(&path).unwrap();
        let id = keys[damaged].as_bytes();
        let at = file.windows(id.len()).position(|w| w == id).unwrap();
        file[at + id.len() + 1] ^= 0xff;
        std::fs::write(&path, file).unwrap();
        let said = match load_with(&RealFs, dir.path(), &Overlay::default()) {
            Ok(_) => panic!("a damaged snapshot was taken"),
            Err(e) => e.to_string(),
        };
        assert!(
            said.contains(&format!("allocation {:?} is unreadable", keys[bad])),
            "{said}"
        );
    }

    /// Whichever thread decodes which chunk first, the refusal names the
    /// first bad record in key order: here one of the third chunk, with a
    /// bad one in the second and one in the last after it.
    #[test]
    fn the_first_bad_record_in_key_order_is_the_one_named() {
        let keys = keys();
        let first = Loader::CHUNK * 3 / 2;
        let misfiled = Loader::CHUNK * 5 / 2;
        let path = Path::new("/data/taskgate.snapshot");
        let mut loader = Loader::new(path, 0);
        let mut refused = None;
        for (i, key) in keys.iter().enumerate() {
            let bytes = match i {
                _ if i == first => vec![record::RECORD_VERSION, 0xff],
                _ if i == misfiled => record("elsewhere"),
                _ if i > misfiled => vec![0xee],
                _ => record(key),
            };
            if let Err(e) = loader.push(key.clone(), bytes) {
                refused = Some(e);
                break;
            }
        }
        let e = match refused {
            Some(e) => e,
            None => match loader.finish() {
                Ok(_) => panic!("bad records were taken"),
                Err(e) => e,
            },
        };
        let said = e.to_string();
        assert!(
            said.contains(&format!("allocation {:?} is unreadable", keys[first])),
            "{said}"
        );
    }
}
