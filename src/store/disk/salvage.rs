//! `taskgate dump --salvage`: everything that can still be proven of a
//! damaged data directory, copied into a new one.
//!
//! A start refuses a directory whose snapshot or log is damaged, rather
//! than drop acknowledged changes in silence. Salvage is the way on when
//! there is no backup, as named steps:
//!
//! 1. **Read** the snapshot and every log segment past damage, taking a
//!    frame only where it can be proven (`frame::salvage`): its chain
//!    links, or it starts a run of linked frames to the end its file's
//!    neighbour vouches for (the next segment's header, the snapshot's
//!    trailer). A frame that lies inside another's payload — an agent can
//!    write one in an event message — is never taken.
//! 2. **Merge by index**: the newest version of each allocation (and of
//!    each semaphore, under its key `~s/<name>`) wins, wherever it lies
//!    (snapshot, any segment, even one the snapshot folded), a deletion
//!    included.
//! 3. **Judge**: an allocation's last index is proven only if nothing was
//!    lost after its newest version (one allocation's changes are written
//!    in index order, so anything lost after it could have been newer).
//!    Every allocation it cannot prove is listed.
//! 4. **Write** what survives, decoded, as the first snapshot of a new data
//!    directory, whose indexes go on past any a lost change could have
//!    used.
//!
//! The damaged directory is only read, never changed; the new one must not
//! exist yet (or be empty). The report says exactly what could not be
//! read (which bytes of which file, which allocation's record) and which
//! allocations may have lost their last changes.

use std::{collections::BTreeMap, path::Path};

use super::{
    frame,
    fs::RealFs,
    log, manifest, recovery, semaphore_name,
    snapshot::{self, SNAPSHOT_FILE, SnapshotWriter},
};
use crate::store::{StoreError, record};

/// What a salvage copied, and what it could not read.
#[derive(Debug, Default)]
pub struct SalvageReport {
    /// Allocations written to the new directory.
    pub allocations: usize,
    /// Semaphores written to the new directory.
    pub semaphores: usize,
    /// The highest global index seen (the new directory goes on from it).
    pub last_index: u64,
    /// One line per thing that could not be read, naming the file and the
    /// bytes, or the allocation or semaphore.
    pub lost: Vec<String>,
    /// One line per allocation (or semaphore) whose last index could not
    /// be proven: its newest version salvaged (or its deletion) may be
    /// older than what it had, because something after it was lost.
    pub unproven: Vec<String>,
}

impl SalvageReport {
    /// Everything was read, and every allocation's last index proven.
    pub fn whole(&self) -> bool {
        self.lost.is_empty() && self.unproven.is_empty()
    }
}

fn io(path: &Path, what: &str, e: std::io::Error) -> StoreError {
    StoreError::Unusable(format!("cannot {what} {}: {e}", path.display()))
}

/// Where something lies in the history the files hold, oldest first: the
/// segments the snapshot folded, the snapshot, the segments after it.
/// (For a snapshot whose header is lost: before every segment.)
type Position = (u64, u64);

/// What a record's key names.
enum Named<'a> {
    Allocation(&'a str),
    Semaphore(&'a str),
}

impl<'a> Named<'a> {
    fn of(key: &'a str) -> Self {
        semaphore_name(key).map_or(Self::Allocation(key), Self::Semaphore)
    }

    /// The index of the record `bytes` under this key, or what is wrong
    /// with it (said after "its record").
    fn index_of(&self, bytes: &[u8]) -> Result<u64, String> {
        match *self {
            Self::Allocation(id) => match record::decode(bytes) {
                Ok(a) if a.id.as_str() == id => Ok(a.modify_index),
                Ok(a) => Err(format!("is for allocation {:?}", a.id)),
                Err(e) => Err(format!("is unreadable: {e}")),
            },
            Self::Semaphore(name) => match record::decode_semaphore(bytes) {
                Ok(s) if s.name.as_str() == name => Ok(s.modify_index),
                Ok(s) => Err(format!("is for semaphore {:?}", s.name)),
                Err(e) => Err(format!("is unreadable: {e}")),
            },
        }
    }
}

impl std::fmt::Display for Named<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Allocation(id) => write!(f, "allocation {id:?}"),
            Self::Semaphore(name) => write!(f, "semaphore {name:?}"),
        }
    }
}

/// The newest version of one allocation (or semaphore) found so far.
struct Version {
    index: u64,
    /// Its record, or `None`: deleted.
    record: Option<Vec<u8>>,
    at: Position,
}

/// Copies what can be proven of data directory `from` into the new data
/// directory `to`.
pub fn salvage(from: &Path, to: &Path) -> Result<SalvageReport, StoreError> {
    let _lock = recovery::lock_shared(from)?;
    prepare(from, to)?;
    let mut report = SalvageReport::default();
    let mut newest: BTreeMap<String, Version> = BTreeMap::new();
    let keep = |newest: &mut BTreeMap<String, Version>, id: &str, v: Version| match newest.get(id) {
        Some(have) if have.index > v.index || (have.index == v.index && have.at > v.at) => {}
        _ => {
            newest.insert(id.to_owned(), v);
        }
    };
    // Where log bytes were lost (in history order), and how many.
    let mut lost_at: Vec<Position> = Vec::new();
    let mut lost_log_bytes = 0;

    // 1. Read: the snapshot.
    let snapshot_path = from.join(SNAPSHOT_FILE);
    let folded;
    let mut snapshot_end = None;
    match std::fs::read(&snapshot_path) {
        Ok(bytes) => {
            let s = snapshot::salvage(&bytes);
            describe(&mut report.lost, &snapshot_path, &s.unread);
            if let Some(why) = &s.trailer {
                report
                    .lost
                    .push(format!("{}: {why}", snapshot_path.display()));
            }
            if s.folded.is_none() {
                report.lost.push(format!(
                    "{}: its header is damaged, so every log segment is read with it",
                    snapshot_path.display()
                ));
            }
            describe_ids(&mut report.lost, &s);
            folded = s.folded;
            snapshot_end = s.log_end;
            report.last_index = s.last_index;
            let at = (folded.unwrap_or(0), u64::MAX);
            for (_, id, bytes) in s.records {
                let named = Named::of(id);
                match named.index_of(bytes) {
                    Ok(index) => keep(
                        &mut newest,
                        id,
                        Version {
                            index,
                            record: Some(bytes.to_vec()),
                            at,
                        },
                    ),
                    Err(why) => report
                        .lost
                        .push(format!("{named}: its record in the snapshot {why}")),
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => folded = Some(0),
        Err(e) => return Err(io(&snapshot_path, "read", e)),
    }

    // 1. Read: the log, every segment (those the snapshot folded too, if
    // it cannot say which it folded), each to the end its successor's
    // header vouches for.
    let mut segments = Vec::new();
    for (seq, path) in log::list_segments(&RealFs, from).map_err(|e| io(from, "list", e))? {
        if folded.is_some_and(|f| seq <= f) {
            continue;
        }
        let bytes = std::fs::read(&path).map_err(|e| io(&path, "read", e))?;
        segments.push((seq, path, bytes));
    }
    let mut expected = folded.map(|f| f + 1);
    for (i, (seq, path, bytes)) in segments.iter().enumerate() {
        let seq = *seq;
        if let Some(next) = expected.filter(|&next| next < seq) {
            report.lost.push(format!(
                "log segments {next} to {} are missing: their changes are lost",
                seq - 1
            ));
            lost_at.push((next, 0));
        }
        expected = Some(seq + 1);
        let next = segments.get(i + 1).filter(|(n, _, _)| *n == seq + 1);
        let vouched = next
            .and_then(|(n, _, b)| log::read_header(b, *n).ok())
            .map(|h| h.previous);
        let read = log::salvage(bytes, seq, vouched);
        for c in &read.changes {
            keep(
                &mut newest,
                c.id,
                Version {
                    index: c.index,
                    record: c.record.map(<[u8]>::to_vec),
                    at: (seq, c.at),
                },
            );
            report.last_index = report.last_index.max(c.index);
        }
        lost_log_bytes += read.unread.iter().map(|u| u.to - u.from).sum::<u64>();
        lost_at.extend(read.unread.iter().map(|u| (seq, u.from)));
        describe(&mut report.lost, path, &read.unread);
        if let (Some(stated), false) = (vouched, read.ends_as_vouched) {
            let end = read.end.len.min(bytes.len() as u64);
            report.lost.push(format!(
                "{}: the segment after it says it ended at byte {}, but what can be read of \
                 it ends at byte {end}: the appends between are lost",
                path.display(),
                stated.len
            ));
            lost_at.push((seq, end));
            lost_log_bytes += stated.len.saturating_sub(end);
        }
        if folded.is_some_and(|f| seq == f + 1)
            && let Some(why) = read
                .previous
                .zip(snapshot_end)
                .and_then(|(s, f)| log::mismatch(s, f))
        {
            report.lost.push(format!(
                "{}: it does not follow the snapshot ({why}): changes between them may be lost",
                path.display()
            ));
            lost_at.push((seq, 0));
        }
    }

    // The segments after the last one read that the manifest names: lost
    // whole (a start refuses the directory for them).
    let last_read = segments.last().map(|(seq, _, _)| *seq);
    match manifest::read(&RealFs, from) {
        Ok(Some(m)) => {
            let next = last_read.or(folded).unwrap_or(0) + 1;
            if next <= m {
                let named = log::segment_path(from, m).display().to_string();
                let which = if next == m {
                    format!("log segment {named} is")
                } else {
                    format!(
                        "log segments {} to {named} are",
                        log::segment_path(from, next).display()
                    )
                };
                report.lost.push(format!(
                    "{which} missing ({} names segment {m} as the newest): their changes \
                     are lost",
                    from.join(manifest::MANIFEST_FILE).display()
                ));
                lost_at.push((next, 0));
                lost_log_bytes += (m + 1 - next) * MISSING_SEGMENT_BYTES;
            }
        }
        Ok(None) if last_read.is_some() || folded.is_some_and(|f| f > 0) => {
            report.lost.push(format!(
                "{} is missing: whether newer log segments were removed with it cannot be \
                 told, and their changes would be lost",
                from.join(manifest::MANIFEST_FILE).display()
            ));
            lost_at.push((last_read.unwrap_or(0) + 1, 0));
            lost_log_bytes += MISSING_SEGMENT_BYTES;
        }
        Ok(None) => {}
        Err(e) => {
            report.lost.push(format!(
                "{}: {e}: whether newer log segments were removed cannot be told",
                from.join(manifest::MANIFEST_FILE).display()
            ));
            lost_at.push((last_read.unwrap_or(0) + 1, 0));
            lost_log_bytes += MISSING_SEGMENT_BYTES;
        }
    }

    // 3. Judge: nothing lost may lie after an allocation's (or a
    // semaphore's) newest version.
    let last_lost = lost_at.iter().max().copied();
    let mut kept = Vec::new();
    for (id, v) in &newest {
        let named = Named::of(id);
        if last_lost.is_some_and(|l| l > v.at) {
            report.unproven.push(match v.record {
                Some(_) => format!(
                    "{named}: salvaged at index {}, but what was lost after it may have held \
                     newer changes",
                    v.index
                ),
                None => format!(
                    "{named}: deleted at index {}, but what was lost after it may have {} it \
                     again",
                    v.index,
                    match named {
                        Named::Allocation(_) => "registered",
                        Named::Semaphore(_) => "created",
                    }
                ),
            });
        }
        let Some(record) = &v.record else { continue };
        match named.index_of(record) {
            Ok(index) => {
                report.last_index = report.last_index.max(index);
                kept.push((id, record, matches!(named, Named::Semaphore(_))));
            }
            Err(why) => report.lost.push(format!("{named}: its record {why}")),
        }
    }
    if last_lost.is_some() {
        report.unproven.push(
            "and any allocation or semaphore whose changes all lay in what was lost: its ID \
             or name cannot be read"
                .into(),
        );
    }
    // A lost change may have used indexes above the highest one read; the
    // new directory goes on past every index they could have used (one per
    // change, and no change is shorter than `log::MIN_CHANGE`), so no index
    // a client saw is handed out twice.
    let skipped = lost_log_bytes / log::MIN_CHANGE;
    if skipped > 0 {
        report.lost.push(format!(
            "indexes go on from {} ({skipped} above the highest one read, which the lost \
             changes of the log may have used)",
            report.last_index + skipped
        ));
    }
    report.last_index += skipped;

    // 4. Write.
    // No log came before it: a chain of its own, which the first segment
    // written after it takes up (two salvaged directories' files do not
    // fit each other).
    let start = log::End {
        len: 0,
        chain: fastrand::u32(..),
    };
    let mut out = SnapshotWriter::create(&RealFs, to, 0, report.last_index, start)
        .map_err(|e| io(to, "write a snapshot in", e))?;
    for (id, record, semaphore) in kept {
        out.put(id, record)
            .map_err(|e| io(to, "write a snapshot in", e))?;
        if semaphore {
            report.semaphores += 1;
        } else {
            report.allocations += 1;
        }
    }
    out.finish().map_err(|e| io(to, "write a snapshot in", e))?;
    // The first segment, following the snapshot, named in the manifest:
    // a directory as a first start leaves it.
    log::Segment::create(&RealFs, to, 1, start, log::WRITE_AHEAD)
        .and_then(|_| manifest::write(&RealFs, to, 1))
        .map_err(|e| io(to, "start the log in", e))?;
    Ok(report)
}

/// The log bytes a missing segment may have held, for the indexes its
/// changes may have used: more than a segment grows to (the log's
/// ceiling is 1 GiB by default).
const MISSING_SEGMENT_BYTES: u64 = 1 << 32;

/// Checks that `to` is a new place (not `from`, absent or empty) and
/// creates it.
fn prepare(from: &Path, to: &Path) -> Result<(), StoreError> {
    let same = |a: &Path, b: &Path| -> bool {
        match (a.canonicalize(), b.canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        }
    };
    if same(from, to) {
        return Err(StoreError::Unusable(
            "salvage never works in place: name a new directory to copy into".into(),
        ));
    }
    match std::fs::read_dir(to).map(|mut entries| entries.next().is_some()) {
        Ok(true) => {
            return Err(StoreError::Unusable(format!(
                "{} is not empty: salvage copies into a new directory",
                to.display()
            )));
        }
        Ok(false) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(to, "read", e)),
    }
    std::fs::create_dir_all(to).map_err(|e| io(to, "create", e))
}

/// Which allocations a lost stretch of the snapshot can have held: the
/// records are in key order, so only those whose keys sort between the
/// records around it (semaphores' keys, `~s/<name>`, after every
/// allocation's).
fn describe_ids(lost: &mut Vec<String>, s: &snapshot::Salvaged<'_>) {
    // The header's own stretch (from byte 0) held no record.
    for u in s.unread.iter().filter(|u| u.from > 0) {
        let before = s.records.iter().rev().find(|r| (r.0 as u64) < u.from);
        let after = s.records.iter().find(|r| r.0 as u64 >= u.to);
        let which = match (before, after) {
            (Some(b), Some(a)) => format!("whose keys sort after {:?} and before {:?}", b.1, a.1),
            (Some(b), None) => format!("whose keys sort after {:?}", b.1),
            (None, Some(a)) => format!("whose keys sort before {:?}", a.1),
            (None, None) => "of any ID".into(),
        };
        lost.push(format!(
            "snapshot bytes {} to {}: they may have held the records of allocations (or \
             semaphores) {which}, which are lost unless the log holds them",
            u.from, u.to
        ));
    }
}

fn describe(lost: &mut Vec<String>, path: &Path, unread: &[frame::Unread]) {
    for u in unread {
        lost.push(format!(
            "{}: bytes {} to {} ({} bytes) could not be read",
            path.display(),
            u.from,
            u.to,
            u.to - u.from
        ));
    }
}
