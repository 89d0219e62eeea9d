//! The manifest: which log segment is the newest, recorded outside the
//! segments. A segment's header vouches for the end of the one before it,
//! and the snapshot for the log it folded; nothing inside the log can
//! vouch for the newest segment, so without this a removed newest
//! segment, or every segment after a snapshot, would read as a shorter
//! history. With it, a start refuses them, naming what is missing.
//!
//! ```text
//! <data dir>/taskgate.manifest = magic "TGMANI\0\x01" | newest: u64 | crc32(the 16 bytes before): u32
//! ```
//!
//! It is replaced (written under `MANIFEST_TEMP`, made durable, renamed,
//! the directory made durable) each time a segment is started, after the
//! segment is durable under its name and before anything is appended to
//! it: a segment newer than the manifest names never held an acknowledged
//! change.

use std::{io::Write, path::Path};

use super::{
    frame,
    fs::{Fs, Open},
};

/// The manifest's name in the data directory.
pub const MANIFEST_FILE: &str = "taskgate.manifest";
/// Where it is written before it is renamed.
pub const MANIFEST_TEMP: &str = "taskgate.manifest.new";
const MAGIC: [u8; 8] = *b"TGMANI\0\x01";
const LEN: usize = 20;

/// The newest segment the manifest in `dir` names: `None` if there is no
/// manifest; an error naming the byte if it does not read back.
pub fn read(fs: &dyn Fs, dir: &Path) -> Result<Option<u64>, String> {
    let path = dir.join(MANIFEST_FILE);
    if !fs.exists(&path) {
        return Ok(None);
    }
    let bytes = fs.read(&path).map_err(|e| format!("cannot be read: {e}"))?;
    frame::magic(&bytes, &MAGIC, "manifest")?;
    if bytes.len() != LEN {
        return Err(format!(
            "it is {} bytes long, where a manifest is {LEN}",
            bytes.len()
        ));
    }
    let crc = u32::from_le_bytes(bytes[16..].try_into().expect("4 bytes"));
    if crc32fast::hash(&bytes[..16]) != crc {
        return Err("it is damaged: bytes 8 to 15 do not match its checksum (byte 16)".into());
    }
    Ok(Some(u64::from_le_bytes(
        bytes[8..16].try_into().expect("8 bytes"),
    )))
}

/// Records durably that segment `newest` is the log's newest.
pub fn write(fs: &dyn Fs, dir: &Path, newest: u64) -> std::io::Result<()> {
    let mut bytes = [0u8; LEN];
    bytes[..8].copy_from_slice(&MAGIC);
    bytes[8..16].copy_from_slice(&newest.to_le_bytes());
    let crc = crc32fast::hash(&bytes[..16]);
    bytes[16..].copy_from_slice(&crc.to_le_bytes());
    let temp = dir.join(MANIFEST_TEMP);
    let written = (|| {
        let mut f = fs.open(&temp, Open::Truncate)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        drop(f);
        fs.rename(&temp, &dir.join(MANIFEST_FILE))?;
        fs.sync_dir(dir)
    })();
    if written.is_err() {
        let _ = fs.remove_file(&temp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::disk::fs::RealFs;

    #[test]
    fn a_manifest_reads_back_and_every_flipped_bit_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read(&RealFs, dir.path()), Ok(None));
        write(&RealFs, dir.path(), 7).unwrap();
        write(&RealFs, dir.path(), 8).unwrap();
        assert_eq!(read(&RealFs, dir.path()), Ok(Some(8)));
        assert!(!dir.path().join(MANIFEST_TEMP).exists());
        let path = dir.path().join(MANIFEST_FILE);
        let whole = std::fs::read(&path).unwrap();
        for bit in 0..whole.len() * 8 {
            let mut b = whole.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            std::fs::write(&path, &b).unwrap();
            let err = read(&RealFs, dir.path()).unwrap_err();
            assert!(err.contains("byte"), "bit {bit}: {err}");
        }
        std::fs::write(&path, &whole[..12]).unwrap();
        assert!(read(&RealFs, dir.path()).is_err());
    }
}
