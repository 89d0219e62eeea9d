//! Store identity: a data directory (or an etcd prefix) gets an ID when it
//! is first used, and every answer of the server carries it
//! (`X-Taskgate-Store`). A client that saw an allocation in one store can
//! then tell "deleted" (a 404 from that store) from "this is not the
//! store I was talking to" (another ID: a wrong `--data-dir`, an emptied
//! directory, another deployment's prefix).
//!
//! ```text
//! <data dir>/store-id = 32 lowercase hex digits | "\n"
//! ```

use std::path::Path;

use super::{
    StoreError,
    fs::{Fs, Open},
};

/// The file that holds a data directory's ID.
pub const STORE_ID_FILE: &str = "store-id";

/// A new ID: 128 random bits, in hex. Unique, not secret.
pub fn new_id() -> String {
    format!("{:032x}", fastrand::u128(..))
}

/// Whether `s` is an ID as `new_id` writes them.
pub fn is_id(s: &str) -> bool {
    s.len() == 32 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The data directory's ID, if it has one; an error if its file is
/// damaged.
pub(crate) fn read(fs: &dyn Fs, dir: &Path) -> Result<Option<String>, StoreError> {
    let path = dir.join(STORE_ID_FILE);
    if !fs.exists(&path) {
        return Ok(None);
    }
    let bytes = fs
        .read(&path)
        .map_err(|e| StoreError::Unusable(format!("cannot read {}: {e}", path.display())))?;
    let text = std::str::from_utf8(&bytes).unwrap_or_default();
    let id = text.strip_suffix('\n').unwrap_or(text);
    if !is_id(id) {
        let bad = bytes
            .iter()
            .position(|&b| !matches!(b, b'0'..=b'9' | b'a'..=b'f'))
            .filter(|&at| at < 32)
            .unwrap_or(32);
        return Err(StoreError::Unusable(format!(
            "{} is damaged at byte {bad}: it should hold the directory's store ID (32 hex \
             digits and a newline), got {} bytes. Nothing was changed. Restore it from a \
             backup of the directory, or remove it to give the directory a new ID (clients \
             then take this for another store)",
            path.display(),
            bytes.len()
        )));
    }
    Ok(Some(id.to_owned()))
}

/// Gives the data directory a new ID, durably (the file, then the
/// directory entry).
pub(crate) fn create(fs: &dyn Fs, dir: &Path) -> Result<String, StoreError> {
    let path = dir.join(STORE_ID_FILE);
    let id = new_id();
    let tmp = dir.join(format!("{STORE_ID_FILE}.tmp"));
    let write = || -> std::io::Result<()> {
        let mut f = fs.open(&tmp, Open::Truncate)?;
        std::io::Write::write_all(&mut f, format!("{id}\n").as_bytes())?;
        f.sync_all()?;
        drop(f);
        fs.rename(&tmp, &path)?;
        fs.sync_dir(dir)
    };
    write().map_err(|e| {
        // A half-written file would only be overwritten by the next start;
        // nothing of it stays behind.
        let _ = fs.remove_file(&tmp);
        StoreError::Unusable(format!(
            "cannot write the store ID to {}: {e}",
            path.display()
        ))
    })?;
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fs::RealFs;

    #[test]
    fn a_directory_keeps_the_id_it_was_given_and_a_damaged_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read(&RealFs, dir.path()).unwrap(), None);
        let id = create(&RealFs, dir.path()).unwrap();
        assert!(is_id(&id), "{id}");
        assert_eq!(
            read(&RealFs, dir.path()).unwrap(),
            Some(id.clone()),
            "read back"
        );
        let other = tempfile::tempdir().unwrap();
        assert_ne!(create(&RealFs, other.path()).unwrap(), id);
        std::fs::write(dir.path().join(STORE_ID_FILE), b"0123not an id\n").unwrap();
        let err = read(&RealFs, dir.path()).unwrap_err().to_string();
        assert!(err.contains("store-id is damaged at byte 4"), "{err}");
        assert!(!dir.path().join("store-id.tmp").exists());
    }
}
