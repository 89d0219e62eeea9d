//! Upgrading a data directory written by taskgate up to 0.1 with a redb
//! file (`taskgate.redb`, file format 1 or 2) to the snapshot
//! (`snapshot.rs`).
//!
//! On open, a directory with a redb file and no snapshot is migrated: the
//! file's records and facts are written as the first snapshot (durably,
//! renamed into place like every snapshot), and only then is the redb file
//! renamed `taskgate.redb.migrated`, kept as a backup for the operator to
//! remove. A crash in between leaves both: the snapshot wins and the rename
//! is done again. The log segments carry on unchanged: format 2 recorded
//! how far it had folded them, and the snapshot takes that over.

use std::path::Path;

use redb::{
    Database, DatabaseError, ReadableDatabase, ReadableTable, ReadableTableMetadata,
    TableDefinition, TableError,
};

use super::{
    StoreError,
    fs::{Fs, RealFs},
    snapshot::{SNAPSHOT_FILE, SnapshotWriter},
};

/// The redb file's name inside the data directory.
pub const REDB_FILE: &str = "taskgate.redb";
/// What a migrated redb file is renamed to.
pub const MIGRATED_FILE: &str = "taskgate.redb.migrated";

/// allocation ID → record (see `record.rs`).
const ALLOCATIONS: TableDefinition<&str, &[u8]> = TableDefinition::new("allocations");
/// Store-wide facts: the file format, the last global index, and the last
/// log segment folded into the file.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const META_FORMAT: &str = "format";
const META_LAST_INDEX: &str = "last_index";
const META_LOG_FOLDED: &str = "log_folded";
/// Format 1: records only. Format 2: records plus the log they fold.
const FORMATS: [u64; 2] = [1, 2];

fn unusable(path: &Path, what: impl std::fmt::Display) -> StoreError {
    StoreError::Unusable(format!(
        "data file {}: {what}. Nothing in it was changed. If it is damaged, restore it \
         from a backup, or move it away to start with an empty store.",
        path.display()
    ))
}

/// Migrates `dir`'s redb file, if there is one. Returns whether it did.
pub fn redb_to_snapshot(dir: &Path) -> Result<bool, StoreError> {
    let path = dir.join(REDB_FILE);
    if !path.exists() {
        return Ok(false);
    }
    if !dir.join(SNAPSHOT_FILE).exists() {
        write_snapshot(dir, &path)?;
    }
    std::fs::rename(&path, dir.join(MIGRATED_FILE))
        .and_then(|()| RealFs.sync_dir(dir))
        .map_err(|e| unusable(&path, format!("cannot be renamed after its migration: {e}")))?;
    tracing::info!(
        from = %path.display(),
        kept_as = %dir.join(MIGRATED_FILE).display(),
        "migrated the redb data file to a snapshot; the old file is kept as a backup"
    );
    Ok(true)
}

/// Opens the redb file read-only; a file that needs recovery (taskgate 0.1
/// stopped uncleanly) is refused that way, and is opened for writing
/// instead, which lets redb repair it first.
fn write_snapshot(dir: &Path, path: &Path) -> Result<(), StoreError> {
    let in_use = || {
        unusable(
            path,
            "is in use by another process (is another taskgate running on this directory?)",
        )
    };
    let mut builder = Database::builder();
    builder.set_cache_size(16 << 20);
    match builder.open_read_only(path) {
        Ok(db) => migrate_from(&db, dir, path),
        Err(DatabaseError::DatabaseAlreadyOpen) => Err(in_use()),
        Err(read_only) => match builder.open(path) {
            Ok(db) => {
                tracing::warn!(
                    file = %path.display(),
                    error = %read_only,
                    "the redb data file needed recovery before its migration; redb repaired it"
                );
                migrate_from(&db, dir, path)
            }
            Err(DatabaseError::DatabaseAlreadyOpen) => Err(in_use()),
            Err(_) => Err(unusable(path, format!("cannot be opened: {read_only}"))),
        },
    }
}

fn migrate_from(db: &impl ReadableDatabase, dir: &Path, path: &Path) -> Result<(), StoreError> {
    let io = |e: &dyn std::fmt::Display| unusable(path, format!("cannot be read: {e}"));
    let txn = db.begin_read().map_err(|e| io(&e))?;
    let (format, last_index, folded) = match txn.open_table(META) {
        Ok(meta) => {
            let get = |k| -> Result<Option<u64>, StoreError> {
                Ok(meta.get(k).map_err(|e| io(&e))?.map(|v| v.value()))
            };
            (
                get(META_FORMAT)?,
                get(META_LAST_INDEX)?.unwrap_or(0),
                get(META_LOG_FOLDED)?.unwrap_or(0),
            )
        }
        Err(TableError::TableDoesNotExist(_)) => (None, 0, 0),
        Err(e) => return Err(io(&e)),
    };
    let table = match txn.open_table(ALLOCATIONS) {
        Ok(t) => Some(t),
        Err(TableError::TableDoesNotExist(_)) => None,
        Err(e) => return Err(io(&e)),
    };
    match format {
        Some(f) if FORMATS.contains(&f) => {}
        Some(other) => {
            return Err(unusable(
                path,
                format!(
                    "it has file format {other}, and this taskgate migrates formats 1 and 2 \
                     (was it written by a newer taskgate?)"
                ),
            ));
        }
        None if table
            .as_ref()
            .map_or(Ok(false), |t| t.is_empty().map(|empty| !empty))
            .map_err(|e| io(&e))? =>
        {
            return Err(unusable(path, "it holds records but no format marker"));
        }
        None => {}
    }
    let mut out = SnapshotWriter::create(&RealFs, dir, folded, last_index)
        .map_err(|e| unusable(path, format!("cannot be migrated to a snapshot: {e}")))?;
    if let Some(table) = table {
        for entry in table.iter().map_err(|e| io(&e))? {
            let (key, value) = entry.map_err(|e| io(&e))?;
            out.put(key.value(), value.value())
                .map_err(|e| unusable(path, format!("cannot be migrated to a snapshot: {e}")))?;
        }
    }
    out.finish()
        .map_err(|e| unusable(path, format!("cannot be migrated to a snapshot: {e}")))?;
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A redb file as taskgate 0.1 wrote it: `format` (if any), the last
    /// index, how far the log was folded, and records.
    pub fn write_redb(dir: &Path, format: Option<u64>, folded: u64, records: &[(&str, &[u8])]) {
        let db = Database::create(dir.join(REDB_FILE)).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut meta = txn.open_table(META).unwrap();
            if let Some(f) = format {
                meta.insert(META_FORMAT, f).unwrap();
            }
            meta.insert(META_LAST_INDEX, 9).unwrap();
            meta.insert(META_LOG_FOLDED, folded).unwrap();
            let mut table = txn.open_table(ALLOCATIONS).unwrap();
            for (id, r) in records {
                table.insert(*id, *r).unwrap();
            }
        }
        txn.commit().unwrap();
    }

    /// The file of a taskgate 0.1 killed while it ran: a copy taken while
    /// the database is open, after a commit.
    #[test]
    fn a_redb_file_that_needs_recovery_is_repaired_and_migrated() {
        let (live, dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let db = Database::create(live.path().join(REDB_FILE)).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut meta = txn.open_table(META).unwrap();
            meta.insert(META_FORMAT, 2).unwrap();
            meta.insert(META_LAST_INDEX, 7).unwrap();
            txn.open_table(ALLOCATIONS)
                .unwrap()
                .insert("a", b"{}".as_slice())
                .unwrap();
        }
        txn.commit().unwrap();
        let crashed = dir.path().join(REDB_FILE);
        std::fs::copy(live.path().join(REDB_FILE), &crashed).unwrap();
        drop(db);
        assert!(
            Database::builder().open_read_only(&crashed).is_err(),
            "the copy needs recovery, so the migration takes its second way"
        );
        assert!(redb_to_snapshot(dir.path()).unwrap());
        let mut s = super::super::snapshot::Snapshot::open(&RealFs, dir.path())
            .unwrap()
            .unwrap();
        assert_eq!((s.records(), s.last_index), (1, 7));
        assert!(s.advance().unwrap());
        assert_eq!((s.id(), s.record()), ("a", b"{}".as_slice()));
        assert!(dir.path().join(MIGRATED_FILE).exists());
    }

    #[test]
    fn an_unknown_redb_format_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        write_redb(dir.path(), Some(99), 0, &[("a", b"{}")]);
        let before = std::fs::read(dir.path().join(REDB_FILE)).unwrap();
        let err = redb_to_snapshot(dir.path()).unwrap_err().to_string();
        assert!(err.contains("file format 99"), "{err}");
        assert!(err.contains(REDB_FILE), "{err}");
        assert!(err.contains("Nothing in it was changed"), "{err}");
        assert_eq!(std::fs::read(dir.path().join(REDB_FILE)).unwrap(), before);
        assert!(!dir.path().join(SNAPSHOT_FILE).exists());
    }

    #[test]
    fn a_file_that_is_not_redb_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(REDB_FILE);
        std::fs::write(&path, vec![0x42u8; 8192]).unwrap();
        let err = redb_to_snapshot(dir.path()).unwrap_err().to_string();
        assert!(err.contains(REDB_FILE), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), vec![0x42u8; 8192]);
        assert!(!dir.path().join(SNAPSHOT_FILE).exists());
    }
}
