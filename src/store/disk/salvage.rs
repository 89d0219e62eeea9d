//! `taskgate dump --salvage`: everything that can still be read from a
//! damaged data directory, copied into a new one.
//!
//! A start refuses a directory whose snapshot or log is damaged, rather
//! than drop acknowledged changes in silence. Salvage is the way on when
//! there is no backup: it reads the snapshot and every log segment past
//! damage (taking up again at the next record or frame that passes its
//! checksum), applies the log's changes in order over the snapshot's
//! records, decodes every record, and writes what survives as the first
//! snapshot of a new data directory. The damaged directory is only read,
//! never changed; the new one must not exist yet (or be empty). The report
//! says exactly what could not be read: which bytes of which file, which
//! allocation's record.

use std::{collections::BTreeMap, path::Path};

use super::{
    frame,
    fs::RealFs,
    log, recovery,
    snapshot::{self, SNAPSHOT_FILE, SnapshotWriter},
};
use crate::store::{StoreError, record};

/// What a salvage copied, and what it could not read.
#[derive(Debug, Default)]
pub struct SalvageReport {
    /// Allocations written to the new directory.
    pub allocations: usize,
    /// The highest global index seen (the new directory goes on from it).
    pub last_index: u64,
    /// One line per thing that could not be read, naming the file and the
    /// bytes, or the allocation.
    pub lost: Vec<String>,
}

fn io(path: &Path, what: &str, e: std::io::Error) -> StoreError {
    StoreError::Unusable(format!("cannot {what} {}: {e}", path.display()))
}

/// Copies what can be read of data directory `from` into the new data
/// directory `to`.
pub fn salvage(from: &Path, to: &Path) -> Result<SalvageReport, StoreError> {
    let _lock = recovery::lock_shared(from)?;
    prepare(from, to)?;
    let mut report = SalvageReport::default();
    // ID → newest record; `None` once deleted.
    let mut records: BTreeMap<String, Option<Vec<u8>>> = BTreeMap::new();
    let snapshot_path = from.join(SNAPSHOT_FILE);
    let mut folded = Some(0);
    match std::fs::read(&snapshot_path) {
        Ok(bytes) => {
            let s = snapshot::salvage(&bytes);
            describe(&mut report.lost, &snapshot_path, &s.unread);
            if let Some(why) = s.trailer {
                report
                    .lost
                    .push(format!("{}: {why}", snapshot_path.display()));
            }
            if s.folded.is_none() {
                report.lost.push(format!(
                    "{}: its header is damaged, so every log segment is replayed over it",
                    snapshot_path.display()
                ));
            }
            folded = s.folded;
            report.last_index = s.last_index;
            for (id, record) in s.records {
                records.insert(id.to_owned(), Some(record.to_vec()));
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(&snapshot_path, "read", e)),
    }
    let segments = log::list_segments(&RealFs, from).map_err(|e| io(from, "list", e))?;
    let mut lost_log_bytes = 0;
    let mut expected = folded.map(|f| f + 1);
    for (seq, path) in segments {
        if folded.is_some_and(|f| seq <= f) {
            continue;
        }
        if let Some(next) = expected.filter(|&next| next < seq) {
            report.lost.push(format!(
                "log segments {next} to {} are missing: their changes are lost",
                seq - 1
            ));
        }
        expected = Some(seq + 1);
        let bytes = std::fs::read(&path).map_err(|e| io(&path, "read", e))?;
        let read = log::salvage(&bytes, seq, None);
        for c in read.changes {
            records.insert(c.id.to_owned(), c.record.map(<[u8]>::to_vec));
            report.last_index = report.last_index.max(c.index);
        }
        let unread = read.unread;
        lost_log_bytes += unread.iter().map(|u| u.to - u.from).sum::<u64>();
        describe(&mut report.lost, &path, &unread);
    }
    let mut kept = Vec::new();
    for (id, record) in &records {
        let Some(record) = record else { continue };
        match record::decode(record) {
            Ok(a) if a.id.as_str() == id => {
                report.last_index = report.last_index.max(a.modify_index);
            }
            Ok(a) => {
                report.lost.push(format!(
                    "allocation {id:?}: its record is for allocation {:?}",
                    a.id
                ));
                continue;
            }
            Err(e) => {
                report
                    .lost
                    .push(format!("allocation {id:?}: its record is unreadable: {e}"));
                continue;
            }
        }
        kept.push((id, record));
    }
    // A lost change may have used indexes above the highest one read; the
    // new directory goes on past every index they could have used (one per
    // frame, and no frame is shorter than `log::MIN_CHANGE`), so no index a
    // client saw is handed out twice.
    let skipped = lost_log_bytes / log::MIN_CHANGE;
    if skipped > 0 {
        report.lost.push(format!(
            "indexes go on from {} ({skipped} above the highest one read, which the lost \
             changes of the log may have used)",
            report.last_index + skipped
        ));
    }
    report.last_index += skipped;
    // No log came before it: a chain of its own, which the first segment
    // written after it takes up (two salvaged directories' files do not
    // fit each other).
    let start = log::End {
        len: 0,
        chain: fastrand::u32(..),
    };
    let mut out = SnapshotWriter::create(&RealFs, to, 0, report.last_index, start)
        .map_err(|e| io(to, "write a snapshot in", e))?;
    for (id, record) in kept {
        out.put(id, record)
            .map_err(|e| io(to, "write a snapshot in", e))?;
        report.allocations += 1;
    }
    out.finish().map_err(|e| io(to, "write a snapshot in", e))?;
    Ok(report)
}

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
