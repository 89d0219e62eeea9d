//! The disk store's write-ahead log.
//!
//! Every group commit is one append and one `fdatasync` to the current
//! segment: sequential, and as cheap with a million allocations as with
//! ten. Sealed segments are folded into the snapshot by a checkpoint
//! thread (see `disk.rs`, `snapshot.rs`); recovery replays the segments
//! not folded yet over what the snapshot holds.
//!
//! A segment is a file `taskgate.wal.<seq>` (20 decimal digits): a 16-byte
//! header (magic, then `seq` as u64 LE), then frames:
//!
//! ```text
//! len: u32 LE | crc32(payload): u32 LE | payload (len bytes)
//! payload = kind: u8 (1 put, 2 delete) | index: u64 LE | id_len: u8 | id | record (put only)
//! ```
//!
//! The record is the same encoding the snapshot holds (`record.rs`).
//! A crash can leave the end of the newest segment half-written; that tail
//! was never acknowledged (acks follow the `fdatasync`) and is cut off on
//! open. Anything else that does not read back stops the start.

use std::{
    collections::HashMap,
    fs::{File, OpenOptions},
    io::{self, Write},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    time::Duration,
};

/// Segment files are named this plus their sequence number.
pub const SEGMENT_PREFIX: &str = "taskgate.wal.";
const MAGIC: [u8; 8] = *b"TGWAL\0\0\x01";
const HEADER: usize = 16;
const FRAME_HEAD: usize = 8;
/// No record comes near this; a larger length is damage, not a record.
const MAX_PAYLOAD: usize = 1 << 30;
const PUT: u8 = 1;
const DELETE: u8 = 2;

/// The newest change of each allocation since the last checkpoint:
/// `Some(record)` for a put, `None` for a deletion.
#[derive(Clone, Debug, Default)]
pub struct Overlay {
    pub changes: HashMap<String, Option<Vec<u8>>>,
    /// The highest global index among them (deletions included).
    pub last_index: u64,
}

impl Overlay {
    pub fn apply(&mut self, id: String, record: Option<Vec<u8>>, index: u64) {
        self.changes.insert(id, record);
        self.last_index = self.last_index.max(index);
    }
}

pub fn segment_path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("{SEGMENT_PREFIX}{seq:020}"))
}

/// The segments in `dir`, oldest first.
pub fn list_segments(dir: &Path) -> io::Result<Vec<(u64, PathBuf)>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(seq) = name
            .to_str()
            .and_then(|n| n.strip_prefix(SEGMENT_PREFIX))
            .filter(|s| s.len() == 20 && s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|s| s.parse().ok())
        else {
            continue;
        };
        found.push((seq, entry.path()));
    }
    found.sort_unstable_by_key(|(seq, _)| *seq);
    Ok(found)
}

/// Appends one change as a frame to `buf`.
pub fn frame(buf: &mut Vec<u8>, id: &str, index: u64, record: Option<&[u8]>) {
    frame_with(buf, id, index, record.is_some(), |buf| {
        if let Some(r) = record {
            buf.extend_from_slice(r);
        }
    });
}

/// Appends a frame whose record (for a put) `fill` writes in place, so a
/// record is encoded straight into its frame, with no copy.
pub fn frame_with(
    buf: &mut Vec<u8>,
    id: &str,
    index: u64,
    put: bool,
    fill: impl FnOnce(&mut Vec<u8>),
) {
    let id_len = u8::try_from(id.len()).expect("allocation IDs are at most 128 bytes");
    let start = buf.len();
    buf.extend_from_slice(&[0; FRAME_HEAD]);
    buf.push(if put { PUT } else { DELETE });
    buf.extend_from_slice(&index.to_le_bytes());
    buf.push(id_len);
    buf.extend_from_slice(id.as_bytes());
    if put {
        fill(buf);
    }
    let payload = &buf[start + FRAME_HEAD..];
    let len = u32::try_from(payload.len()).expect("a record is far below 4 GiB");
    let crc = crc32fast::hash(payload);
    buf[start..start + 4].copy_from_slice(&len.to_le_bytes());
    buf[start + 4..start + FRAME_HEAD].copy_from_slice(&crc.to_le_bytes());
}

/// What replaying one segment found.
#[derive(Debug, PartialEq, Eq)]
pub struct Replayed {
    /// Bytes up to the end of the last whole frame (0: not even a whole
    /// header).
    pub valid_len: u64,
    /// Bytes after it: an unfinished append (or damage).
    pub torn: u64,
    pub frames: u64,
}

/// Replays the frames of segment `seq` (its whole content) into `overlay`.
/// Stops at the first frame that is incomplete or fails its checksum and
/// says where; a frame that passes its checksum but does not parse is
/// damage and an error.
pub fn replay(bytes: &[u8], seq: u64, overlay: &mut Overlay) -> Result<Replayed, String> {
    replay_with(bytes, seq, |id, index, record| {
        overlay.apply(id.to_owned(), record.map(<[u8]>::to_vec), index);
    })
}

/// `replay`, handing each change to `each` as it lies in `bytes` (ID,
/// index, record for a put), with no copy.
pub fn replay_with<'a>(
    bytes: &'a [u8],
    seq: u64,
    mut each: impl FnMut(&'a str, u64, Option<&'a [u8]>),
) -> Result<Replayed, String> {
    if bytes.len() < HEADER {
        return Ok(Replayed {
            valid_len: 0,
            torn: bytes.len() as u64,
            frames: 0,
        });
    }
    if bytes[..8] != MAGIC {
        return Err("it does not start like a taskgate log segment".into());
    }
    let stated = u64::from_le_bytes(bytes[8..HEADER].try_into().expect("8 bytes"));
    if stated != seq {
        return Err(format!("its header says segment {stated}"));
    }
    let mut pos = HEADER;
    let mut frames = 0;
    while let Some(head) = bytes.get(pos..pos + FRAME_HEAD) {
        let len = u32::from_le_bytes(head[..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(head[4..].try_into().expect("4 bytes"));
        let start = pos + FRAME_HEAD;
        let Some(payload) = bytes.get(start..start.saturating_add(len)) else {
            break;
        };
        if len > MAX_PAYLOAD || crc32fast::hash(payload) != crc {
            break;
        }
        let (id, index, record) =
            parse(payload).map_err(|e| format!("the change at byte {pos} is damaged: {e}"))?;
        each(id, index, record);
        pos = start + len;
        frames += 1;
    }
    Ok(Replayed {
        valid_len: pos as u64,
        torn: (bytes.len() - pos) as u64,
        frames,
    })
}

fn parse(payload: &[u8]) -> Result<(&str, u64, Option<&[u8]>), &'static str> {
    let (&kind, rest) = payload.split_first().ok_or("empty")?;
    let index = rest.get(..8).ok_or("too short")?;
    let index = u64::from_le_bytes(index.try_into().expect("8 bytes"));
    let (&id_len, rest) = rest[8..].split_first().ok_or("too short")?;
    let id = rest.get(..id_len as usize).ok_or("too short")?;
    let id = std::str::from_utf8(id).map_err(|_| "the allocation ID is not UTF-8")?;
    let record = &rest[id_len as usize..];
    match kind {
        PUT => Ok((id, index, Some(record))),
        DELETE if record.is_empty() => Ok((id, index, None)),
        DELETE => Err("a deletion carries a record"),
        _ => Err("unknown kind of change"),
    }
}

/// The segment being appended to.
pub struct Segment {
    file: File,
    pub seq: u64,
    /// Bytes written, header included.
    pub len: u64,
}

impl Segment {
    /// Bytes of an empty segment.
    pub const HEADER_LEN: u64 = HEADER as u64;

    /// Creates segment `seq` in `dir`, header written and durable, the
    /// directory entry too.
    pub fn create(dir: &Path, seq: u64) -> io::Result<Self> {
        let path = segment_path(dir, seq);
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)?;
        let mut header = [0u8; HEADER];
        header[..8].copy_from_slice(&MAGIC);
        header[8..].copy_from_slice(&seq.to_le_bytes());
        let written = file
            .write_all(&header)
            .and_then(|()| file.sync_all())
            .and_then(|()| sync_dir(dir));
        if let Err(e) = written {
            // Nothing was ever appended to it: gone, a later try can
            // create it again.
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
        Ok(Self {
            file,
            seq,
            len: Self::HEADER_LEN,
        })
    }

    /// Segment `seq` in `dir` opened for reading only, so appends fail.
    #[cfg(test)]
    pub fn read_only(dir: &Path, seq: u64) -> io::Result<Self> {
        let file = File::open(segment_path(dir, seq))?;
        let len = file.metadata()?.len();
        Ok(Self { file, seq, len })
    }

    /// Appends `bytes` (whole frames) and makes them durable.
    pub fn append(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.file.write_all(bytes)?;
        self.file.sync_data()?;
        self.len += bytes.len() as u64;
        Ok(())
    }
}

/// Makes creations and removals in `dir` durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// How much of a file `remove_gently` frees at a time, and its pause
/// after each slice.
const SHRINK_STEP: u64 = 16 << 20;
const SHRINK_PAUSE: Duration = Duration::from_millis(5);

/// Removes a file a slice at a time, for the files a checkpoint leaves
/// behind (the replaced snapshot, the folded segments: up to ~1 GB at a
/// million allocations). Freeing blocks is journaled, and on ext4 mounted
/// with `discard` the journal commit that frees them also trims them, so
/// unlinking a 780 MB file at once held concurrent `fdatasync`s for 43–83
/// ms in seven runs; cut back 16 MiB at a time with 5 ms between slices,
/// 4–12 ms in five of seven and 29 and 61 ms in the others
/// (`scripts/remove-stall.py`; 8 MiB slices were no better). In the
/// server at a million allocations, the worst report at a fixed 10,000/s
/// went from 157 to 11 ms. A file that has another name is
/// only unlinked: its blocks are not this name's to free (a checkpoint that
/// stopped between linking the old snapshot and renaming the new one
/// leaves the current snapshot under both names). Sleeps: call it from a
/// background thread.
pub fn remove_gently(path: &Path) -> io::Result<()> {
    match OpenOptions::new().write(true).open(path) {
        Ok(file) => {
            let meta = file.metadata()?;
            if meta.nlink() == 1 {
                let mut len = meta.len();
                while len > SHRINK_STEP {
                    len -= SHRINK_STEP;
                    file.set_len(len)?;
                    std::thread::sleep(SHRINK_PAUSE);
                }
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Cuts a segment back to `len` bytes, durably.
pub fn truncate(path: &Path, len: u64) -> io::Result<()> {
    let file = OpenOptions::new().write(true).open(path)?;
    file.set_len(len)?;
    file.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remove_gently_removes_a_file_but_never_frees_another_names_blocks() {
        let dir = tempfile::tempdir().unwrap();
        // Longer than three slices, so it is cut back before the unlink.
        let big = dir.path().join("big");
        std::fs::File::create(&big)
            .unwrap()
            .set_len(3 * SHRINK_STEP + 5)
            .unwrap();
        remove_gently(&big).unwrap();
        assert!(!big.exists());
        // A file with a second name (the current snapshot, linked by a
        // checkpoint that stopped before its rename): only this name goes.
        let kept = dir.path().join("kept");
        let mut content = vec![7u8; 2 * SHRINK_STEP as usize];
        content.extend_from_slice(b"the end");
        std::fs::write(&kept, &content).unwrap();
        let other = dir.path().join("other");
        std::fs::hard_link(&kept, &other).unwrap();
        remove_gently(&other).unwrap();
        assert!(!other.exists());
        assert!(std::fs::read(&kept).unwrap() == content, "untouched");
        // Already gone: nothing to do.
        remove_gently(&other).unwrap();
    }

    fn segment(dir: &Path, seq: u64, changes: &[(&str, u64, Option<&[u8]>)]) -> PathBuf {
        let mut s = Segment::create(dir, seq).unwrap();
        let mut buf = Vec::new();
        for (id, index, record) in changes {
            frame(&mut buf, id, *index, *record);
        }
        s.append(&buf).unwrap();
        segment_path(dir, seq)
    }

    #[test]
    fn frames_replay_in_order_and_the_newest_change_wins() {
        let dir = tempfile::tempdir().unwrap();
        let path = segment(
            dir.path(),
            7,
            &[
                ("a", 1, Some(b"one")),
                ("b", 2, Some(b"two")),
                ("a", 3, Some(b"three")),
                ("b", 4, None),
            ],
        );
        let bytes = std::fs::read(&path).unwrap();
        let mut o = Overlay::default();
        let r = replay(&bytes, 7, &mut o).unwrap();
        assert_eq!(
            r,
            Replayed {
                valid_len: bytes.len() as u64,
                torn: 0,
                frames: 4
            }
        );
        assert_eq!(o.changes["a"].as_deref(), Some(&b"three"[..]));
        assert_eq!(o.changes["b"], None);
        assert_eq!(o.last_index, 4);
        assert_eq!(list_segments(dir.path()).unwrap(), vec![(7, path)]);
    }

    #[test]
    fn replay_stops_at_an_unfinished_append_at_every_cut() {
        let dir = tempfile::tempdir().unwrap();
        let path = segment(
            dir.path(),
            1,
            &[("a", 1, Some(b"first")), ("b", 2, Some(b"second"))],
        );
        let bytes = std::fs::read(&path).unwrap();
        let first_end = HEADER + FRAME_HEAD + 1 + 8 + 1 + 1 + 5;
        for cut in 0..bytes.len() {
            let mut o = Overlay::default();
            let r = replay(&bytes[..cut], 1, &mut o).unwrap();
            let expect = if cut < HEADER {
                0
            } else if cut < first_end {
                HEADER
            } else {
                first_end
            };
            assert_eq!(r.valid_len, expect as u64, "cut at {cut}");
            assert_eq!(r.torn, (cut - expect) as u64, "cut at {cut}");
            assert_eq!(o.changes.contains_key("a"), cut >= first_end);
            assert!(!o.changes.contains_key("b"));
        }
    }

    #[test]
    fn a_flipped_bit_ends_the_replay_at_that_frame() {
        let dir = tempfile::tempdir().unwrap();
        let path = segment(dir.path(), 1, &[("a", 1, Some(b"x")), ("b", 2, Some(b"y"))]);
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        let mut o = Overlay::default();
        let r = replay(&bytes, 1, &mut o).unwrap();
        assert_eq!(r.frames, 1);
        assert!(r.torn > 0);
        assert!(!o.changes.contains_key("b"));
    }

    #[test]
    fn a_foreign_file_or_a_misnamed_segment_is_an_error() {
        let mut o = Overlay::default();
        let err = replay(&[0x42; 64], 1, &mut o).unwrap_err();
        assert!(err.contains("does not start like"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let bytes = std::fs::read(segment(dir.path(), 3, &[])).unwrap();
        let err = replay(&bytes, 4, &mut o).unwrap_err();
        assert!(err.contains("segment 3"), "{err}");
    }

    #[test]
    fn a_frame_with_a_good_checksum_that_does_not_parse_is_damage() {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = std::fs::read(segment(dir.path(), 1, &[])).unwrap();
        let payload = [9u8, 0, 0, 0, 0, 0, 0, 0, 1, 1, b'a'];
        bytes.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
        bytes.extend_from_slice(&payload);
        let err = replay(&bytes, 1, &mut Overlay::default()).unwrap_err();
        assert!(err.contains("unknown kind"), "{err}");
    }
}
