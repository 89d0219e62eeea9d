//! The disk store's write-ahead log.
//!
//! Every group commit is one append and one `fdatasync` to the current
//! segment: sequential, and as cheap with a million allocations as with
//! ten. Sealed segments are folded into the snapshot by a checkpoint
//! thread (see `disk.rs`, `snapshot.rs`); recovery replays the segments
//! not folded yet over what the snapshot holds.
//!
//! A segment is a file `taskgate.wal.<seq>` (20 decimal digits). It is
//! written under a temporary name with its header, made durable and only
//! then renamed into place, so a segment under its real name is never
//! shorter than its header. Format 2 (integers little-endian):
//!
//! ```text
//! header  = magic "TGWAL\0\0\x02" | seq: u64 | crc32(the 16 bytes before): u32 | 0: u32
//! frame   = len: u32 | crc: u32 | chain: u32 | payload (len bytes)
//!   crc   = crc32(len | payload)
//!   chain = crc32(previous chain | len | crc); before the first frame, the header's crc32
//! payload = kind: u8 (1 put, 2 delete) | index: u64 LE | id_len: u8 | id | record (put only)
//! ```
//!
//! The record is the same encoding the snapshot holds (`record.rs`). The
//! requester computes `crc` on its own thread; the writer links each frame
//! to the one before it (`chain`), which checks the frame's length on its
//! own and ties every frame to its place in its segment.
//!
//! Replaying tells a torn tail from damage, as etcd's WAL does: an append
//! is acknowledged only after its `fdatasync`, so a crash can leave only
//! the end of the newest segment unfinished, and what it leaves is an
//! append cut short, or the append's sectors that never reached the disk
//! read as zeros to the end of the file. So a bad frame counts as torn
//! only when it is the last thing in the file: too short for its head, a
//! sound head whose payload runs past the end, or zeros from the frame's
//! start (or from a sector boundary inside it) to the end of the file. Any
//! other bad frame is damage to acknowledged changes, and the store
//! refuses to start (`disk.rs`).
//!
//! Format 1 (`"TGWAL\0\0\x01"`, a 16-byte header and `len | crc32(payload)`
//! frame heads, no chain) is still read, so a log written by an earlier
//! build replays; new segments are always format 2.

use std::{
    collections::HashMap,
    io::{self, Write},
    path::{Path, PathBuf},
    time::Duration,
};

use super::fs::{Fs, FsFile, Open};

/// Segment files are named this plus their sequence number.
pub const SEGMENT_PREFIX: &str = "taskgate.wal.";
/// Where a segment is written before it is renamed to its real name.
pub const SEGMENT_TEMP: &str = "taskgate.wal.new";
/// Where the bytes cut from a torn tail are kept: the segment's name plus
/// this (and `.1`, `.2`, ... if that name is taken).
pub const BROKEN_SUFFIX: &str = ".broken";
const MAGIC_V1: [u8; 8] = *b"TGWAL\0\0\x01";
const MAGIC: [u8; 8] = *b"TGWAL\0\0\x02";
const HEADER_V1: usize = 16;
const HEADER: usize = 24;
const HEAD_V1: usize = 8;
const HEAD: usize = 12;
/// The shortest frame there is (a deletion of a one-byte ID, format 1).
pub const MIN_FRAME: u64 = (HEAD_V1 + 1 + 8 + 1 + 1) as u64;
/// No record comes near this; a larger length is damage, not a record.
const MAX_PAYLOAD: usize = 1 << 30;
/// The unit a disk writes whole or not at all: an append that reached the
/// disk in part ends in zeros from a multiple of it.
const SECTOR: usize = 512;
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
pub fn list_segments(fs: &dyn Fs, dir: &Path) -> io::Result<Vec<(u64, PathBuf)>> {
    let mut found = Vec::new();
    for name in fs.list(dir)? {
        let Some(seq) = name
            .to_str()
            .and_then(|n| n.strip_prefix(SEGMENT_PREFIX))
            .filter(|s| s.len() == 20 && s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|s| s.parse().ok())
        else {
            continue;
        };
        found.push((seq, dir.join(name)));
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
/// record is encoded straight into its frame, with no copy. Its chain is
/// left for the writer (`Segment::append`).
pub fn frame_with(
    buf: &mut Vec<u8>,
    id: &str,
    index: u64,
    put: bool,
    fill: impl FnOnce(&mut Vec<u8>),
) {
    let id_len = u8::try_from(id.len()).expect("allocation IDs are at most 128 bytes");
    let start = buf.len();
    buf.extend_from_slice(&[0; HEAD]);
    buf.push(if put { PUT } else { DELETE });
    buf.extend_from_slice(&index.to_le_bytes());
    buf.push(id_len);
    buf.extend_from_slice(id.as_bytes());
    if put {
        fill(buf);
    }
    let len = u32::try_from(buf.len() - start - HEAD).expect("a record is far below 4 GiB");
    let len = len.to_le_bytes();
    let crc = frame_sum(true, &len, &buf[start + HEAD..]);
    buf[start..start + 4].copy_from_slice(&len);
    buf[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// crc32 of `a` followed by `b`.
fn crc_of(a: &[u8], b: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(a);
    h.update(b);
    h.finalize()
}

/// A frame's checksum: of its length and payload (format 2), of its
/// payload alone (format 1).
fn frame_sum(v2: bool, len: &[u8], payload: &[u8]) -> u32 {
    if v2 {
        crc_of(len, payload)
    } else {
        crc32fast::hash(payload)
    }
}

/// The chain value of a frame head (`len | crc`) following `previous`.
fn chain(previous: u32, len_crc: &[u8]) -> u32 {
    crc_of(&previous.to_le_bytes(), len_crc)
}

/// Writes the chain of every frame in `frames` (whole frames, as
/// `frame_with` builds them), the first following `previous`; returns the
/// last frame's chain.
fn link(frames: &mut [u8], mut previous: u32) -> u32 {
    let mut pos = 0;
    while pos < frames.len() {
        let len = u32::from_le_bytes(frames[pos..pos + 4].try_into().expect("4 bytes"));
        previous = chain(previous, &frames[pos..pos + 8]);
        frames[pos + 8..pos + HEAD].copy_from_slice(&previous.to_le_bytes());
        pos += HEAD + len as usize;
    }
    previous
}

fn header(seq: u64) -> [u8; HEADER] {
    let mut header = [0u8; HEADER];
    header[..8].copy_from_slice(&MAGIC);
    header[8..16].copy_from_slice(&seq.to_le_bytes());
    let crc = crc32fast::hash(&header[..16]);
    header[16..20].copy_from_slice(&crc.to_le_bytes());
    header
}

/// What replaying one segment found.
#[derive(Debug, PartialEq, Eq)]
pub struct Replayed {
    /// Bytes up to the end of the last good frame.
    pub valid_len: u64,
    pub frames: u64,
    /// The first frame that did not read back, if any: everything from it
    /// on was not replayed.
    pub bad: Option<Bad>,
    /// The chain of the last good frame (format 2).
    pub chain: u32,
}

/// A frame that did not read back.
#[derive(Debug, PartialEq, Eq)]
pub struct Bad {
    /// Where it starts.
    pub at: u64,
    /// Bytes from it to the end of the file.
    pub bytes: u64,
    /// What is wrong with it.
    pub what: String,
    /// It looks like an append a crash left unfinished (see the module's
    /// documentation); only at the end of the newest segment is that what
    /// it is.
    pub torn: bool,
}

#[cfg(test)]
impl Replayed {
    /// Bytes after the last good frame.
    pub fn torn(&self) -> u64 {
        self.bad.as_ref().map_or(0, |b| b.bytes)
    }
}

/// Replays the frames of segment `seq` (its whole content) into `overlay`.
pub fn replay(bytes: &[u8], seq: u64, overlay: &mut Overlay) -> Result<Replayed, String> {
    replay_with(bytes, seq, |id, index, record| {
        overlay.apply(id.to_owned(), record.map(<[u8]>::to_vec), index);
    })
}

/// `replay`, handing each change to `each` as it lies in `bytes` (ID,
/// index, record for a put), with no copy. Stops at the first frame that
/// does not read back and says where and whether it looks torn; a header
/// that is not this segment's, or a frame that passes its checks but does
/// not parse, is an error.
pub fn replay_with<'a>(
    bytes: &'a [u8],
    seq: u64,
    mut each: impl FnMut(&'a str, u64, Option<&'a [u8]>),
) -> Result<Replayed, String> {
    let v2 = bytes.starts_with(&MAGIC);
    let (header, head) = match () {
        () if v2 => (HEADER, HEAD),
        () if bytes.starts_with(&MAGIC_V1) => (HEADER_V1, HEAD_V1),
        () if bytes.len() < MAGIC.len() && MAGIC.starts_with(bytes) => {
            return Err(format!(
                "it is {} bytes long, shorter than a segment header",
                bytes.len()
            ));
        }
        () => return Err("it does not start like a taskgate log segment".into()),
    };
    if bytes.len() < header {
        return Err(format!(
            "it is {} bytes long, shorter than a segment header",
            bytes.len()
        ));
    }
    let stated = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
    let mut previous = 0;
    if v2 {
        previous = crc32fast::hash(&bytes[..16]);
        if bytes[16..20] != previous.to_le_bytes() || bytes[20..24] != [0; 4] {
            return Err("its header is damaged".into());
        }
    }
    if stated != seq {
        return Err(format!("its header says segment {stated}"));
    }
    let mut pos = header;
    let mut frames = 0;
    // Where the zeros at the end of the file start (its length if it does
    // not end in zeros): a torn append leaves zeros from a sector boundary
    // (or from where it began) to the end, never data after them.
    let zeros_from = bytes.len() - bytes.iter().rev().take_while(|&&b| b == 0).count();
    let bad = loop {
        let rest = &bytes[pos..];
        if rest.is_empty() {
            break None;
        }
        // The bad frame at `pos`, which would end at `end`: torn if what
        // is left of it runs out at the end of the file or turns to zeros
        // for good before it ends.
        let bad = |what: &str, end: usize| {
            let zeros = if zeros_from <= pos {
                pos
            } else {
                zeros_from.next_multiple_of(SECTOR)
            };
            Bad {
                at: pos as u64,
                bytes: rest.len() as u64,
                what: what.into(),
                torn: end > bytes.len() || (zeros < bytes.len() && zeros <= end),
            }
        };
        let Some(h) = rest.get(..head) else {
            break Some(bad("is cut short in its head", usize::MAX));
        };
        let len = u32::from_le_bytes(h[..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes"));
        if v2 {
            let linked = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes"));
            if chain(previous, &h[..8]) != linked {
                break Some(bad(
                    "has a damaged head (its length or checksums do not match the frame before)",
                    pos + head,
                ));
            }
            previous = linked;
        } else if len > rest.len() {
            // Format 1 cannot tell a damaged length from an append that
            // stopped midway.
            break Some(bad("is cut short", usize::MAX));
        }
        if len > MAX_PAYLOAD {
            break Some(bad("has an impossible length", pos + head));
        }
        let Some(payload) = rest.get(head..head + len) else {
            // A sound head whose payload runs past the end: the append
            // stopped midway.
            break Some(bad("is cut short", usize::MAX));
        };
        if frame_sum(v2, &rest[..4], payload) != crc {
            break Some(bad("fails its checksum", pos + head + len));
        }
        let (id, index, record) =
            parse(payload).map_err(|e| format!("the change at byte {pos} is damaged: {e}"))?;
        each(id, index, record);
        pos += head + len;
        frames += 1;
    };
    Ok(Replayed {
        valid_len: pos as u64,
        frames,
        bad,
        chain: previous,
    })
}

/// A stretch of a file that could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unread {
    pub from: u64,
    pub to: u64,
}

/// Every change of a segment that can still be read, however damaged it
/// is (`taskgate dump --salvage`): frames are read as `replay_with` reads
/// them, and past a bad one the next offset at which a whole frame passes
/// its checksum and parses is taken up again (its chain is not checked:
/// the frames before it are lost). Returns the stretches skipped; the
/// header may be damaged too (its bytes are then skipped like the rest).
pub fn salvage_with<'a>(
    bytes: &'a [u8],
    mut each: impl FnMut(&'a str, u64, Option<&'a [u8]>),
) -> Vec<Unread> {
    let v1 = bytes.starts_with(&MAGIC_V1);
    let (mut pos, head) = if v1 {
        (HEADER_V1, HEAD_V1)
    } else {
        (HEADER, HEAD)
    };
    let mut unread: Vec<Unread> = Vec::new();
    if !v1 && !bytes.starts_with(&MAGIC) {
        unread.push(Unread {
            from: 0,
            to: (pos.min(bytes.len())) as u64,
        });
    }
    let mut skipping: Option<usize> = None;
    while pos < bytes.len() {
        let frame = bytes.get(pos..pos + head).and_then(|h| {
            let len = u32::from_le_bytes(h[..4].try_into().expect("4 bytes")) as usize;
            let crc = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes"));
            let payload = bytes.get(pos + head..(pos + head).checked_add(len)?)?;
            (frame_sum(!v1, &bytes[pos..pos + 4], payload) == crc).then_some(())?;
            parse(payload).ok().map(|change| (change, head + len))
        });
        match frame {
            Some(((id, index, record), len)) => {
                if let Some(from) = skipping.take() {
                    unread.push(Unread {
                        from: from as u64,
                        to: pos as u64,
                    });
                }
                each(id, index, record);
                pos += len;
            }
            None => {
                skipping.get_or_insert(pos);
                pos += 1;
            }
        }
    }
    if let Some(from) = skipping {
        unread.push(Unread {
            from: from as u64,
            to: bytes.len() as u64,
        });
    }
    unread
}

/// Appends to segment `path` what a crash in the middle of appending
/// `frame` (built by `frame_with`) may leave: its first `keep` bytes
/// (less than all of it), then `zeros` zero bytes (sectors the append was
/// given that never reached the disk: with zeros, `keep` is taken back to
/// a sector boundary of the file or to the frame's start).
#[cfg(test)]
pub fn append_unfinished(path: &Path, frame: &mut [u8], keep: usize, zeros: usize) {
    let mut bytes = std::fs::read(path).unwrap();
    let seq = u64::from_le_bytes(bytes[8..16].try_into().unwrap());
    let r = replay_with(&bytes, seq, |_, _, _| {}).unwrap();
    assert!(r.bad.is_none(), "appended after a whole segment");
    link(frame, r.chain);
    let mut keep = keep.min(frame.len() - 1);
    if zeros > 0 {
        let end = (bytes.len() + keep) / SECTOR * SECTOR;
        keep = end.saturating_sub(bytes.len()).min(keep);
    }
    bytes.extend_from_slice(&frame[..keep]);
    bytes.resize(bytes.len() + zeros, 0);
    std::fs::write(path, bytes).unwrap();
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
    file: Box<dyn FsFile>,
    pub seq: u64,
    /// Bytes written, header included.
    pub len: u64,
    /// The chain of the last frame written (the header's checksum before
    /// the first).
    chain: u32,
}

impl Segment {
    /// Bytes of an empty segment.
    pub const HEADER_LEN: u64 = HEADER as u64;

    /// Creates segment `seq` in `dir`: written under `SEGMENT_TEMP` with its
    /// header, made durable, renamed to its name, the directory made
    /// durable. A crash at any point leaves no segment or a whole header.
    pub fn create(fs: &dyn Fs, dir: &Path, seq: u64) -> io::Result<Self> {
        let temp = dir.join(SEGMENT_TEMP);
        let mut file = fs.open(&temp, Open::Truncate)?;
        let header = header(seq);
        let written = file
            .write_all(&header)
            .and_then(|()| file.sync_all())
            .and_then(|()| fs.rename(&temp, &segment_path(dir, seq)))
            .and_then(|()| fs.sync_dir(dir));
        if let Err(e) = written {
            // Nothing was ever appended to it: a later try creates it anew.
            let _ = fs.remove_file(&temp);
            return Err(e);
        }
        Ok(Self {
            file,
            seq,
            len: Self::HEADER_LEN,
            chain: crc32fast::hash(&header[..16]),
        })
    }

    /// Segment `seq` in `dir` opened for reading only, so appends fail.
    #[cfg(test)]
    pub fn read_only(dir: &Path, seq: u64) -> io::Result<Self> {
        let file = Box::new(std::fs::File::open(segment_path(dir, seq))?);
        let len = FsFile::len(&*file)?;
        Ok(Self {
            file,
            seq,
            len,
            chain: 0,
        })
    }

    /// Links `frames` (whole frames, as `frame_with` builds them) to the
    /// segment's last frame, appends them and makes them durable.
    pub fn append(&mut self, frames: &mut [u8]) -> io::Result<()> {
        let chain = link(frames, self.chain);
        self.file.write_all(frames)?;
        self.file.sync_data()?;
        self.len += frames.len() as u64;
        self.chain = chain;
        Ok(())
    }
}

/// Cuts segment `path` back to its first `len` bytes, durably, after
/// copying what is cut to a file of its own beside it (`BROKEN_SUFFIX`),
/// durably too. Returns that file's path.
pub fn cut(fs: &dyn Fs, path: &Path, len: u64) -> io::Result<PathBuf> {
    let bytes = fs.read(path)?;
    let tail = bytes.get(len as usize..).unwrap_or_default();
    let mut n = 0;
    let (aside, mut out) = loop {
        let mut name = path.as_os_str().to_owned();
        name.push(BROKEN_SUFFIX);
        if n > 0 {
            name.push(format!(".{n}"));
        }
        let aside = PathBuf::from(name);
        match fs.open(&aside, Open::CreateNew) {
            Ok(file) => break (aside, file),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
            Err(e) => return Err(e),
        }
    };
    out.write_all(tail)?;
    out.sync_all()?;
    if let Some(dir) = path.parent() {
        fs.sync_dir(dir)?;
    }
    let mut file = fs.open(path, Open::Append)?;
    file.set_len(len)?;
    file.sync_all()?;
    Ok(aside)
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
pub fn remove_gently(fs: &dyn Fs, path: &Path) -> io::Result<()> {
    match fs.open(path, Open::Append) {
        Ok(mut file) => {
            if file.links()? == 1 {
                let mut len = file.len()?;
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
    match fs.remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fs::RealFs;

    #[test]
    fn remove_gently_removes_a_file_but_never_frees_another_names_blocks() {
        let dir = tempfile::tempdir().unwrap();
        // Longer than three slices, so it is cut back before the unlink.
        let big = dir.path().join("big");
        std::fs::File::create(&big)
            .unwrap()
            .set_len(3 * SHRINK_STEP + 5)
            .unwrap();
        remove_gently(&RealFs, &big).unwrap();
        assert!(!big.exists());
        // A file with a second name (the current snapshot, linked by a
        // checkpoint that stopped before its rename): only this name goes.
        let kept = dir.path().join("kept");
        let mut content = vec![7u8; 2 * SHRINK_STEP as usize];
        content.extend_from_slice(b"the end");
        std::fs::write(&kept, &content).unwrap();
        let other = dir.path().join("other");
        std::fs::hard_link(&kept, &other).unwrap();
        remove_gently(&RealFs, &other).unwrap();
        assert!(!other.exists());
        assert!(std::fs::read(&kept).unwrap() == content, "untouched");
        // Already gone: nothing to do.
        remove_gently(&RealFs, &other).unwrap();
    }

    /// Segment `seq` in `dir` holding `changes`, appended in batches of
    /// `per_append`; returns its bytes.
    fn segment_in(
        dir: &Path,
        seq: u64,
        changes: &[(&str, u64, Option<&[u8]>)],
        per_append: usize,
    ) -> Vec<u8> {
        let mut s = Segment::create(&RealFs, dir, seq).unwrap();
        for batch in changes.chunks(per_append.max(1)) {
            let mut buf = Vec::new();
            for (id, index, record) in batch {
                frame(&mut buf, id, *index, *record);
            }
            s.append(&mut buf).unwrap();
        }
        let bytes = std::fs::read(segment_path(dir, seq)).unwrap();
        assert_eq!(bytes.len() as u64, s.len);
        bytes
    }

    fn segment(dir: &Path, seq: u64, changes: &[(&str, u64, Option<&[u8]>)]) -> Vec<u8> {
        segment_in(dir, seq, changes, 1)
    }

    /// `n` puts of records of `size` bytes, in two appends.
    fn many(dir: &Path, n: u64, size: usize) -> Vec<u8> {
        let ids: Vec<String> = (0..n).map(|i| format!("alloc-{i}")).collect();
        let record = vec![0x5a; size];
        let changes: Vec<_> = ids
            .iter()
            .zip(1..)
            .map(|(id, i)| (id.as_str(), i, Some(&record[..])))
            .collect();
        segment_in(dir, 1, &changes, changes.len() / 2)
    }

    #[test]
    fn frames_replay_in_order_and_the_newest_change_wins() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = segment_in(
            dir.path(),
            7,
            &[
                ("a", 1, Some(b"one")),
                ("b", 2, Some(b"two")),
                ("a", 3, Some(b"three")),
                ("b", 4, None),
            ],
            3,
        );
        let mut o = Overlay::default();
        let r = replay(&bytes, 7, &mut o).unwrap();
        assert_eq!(
            (r.valid_len, r.frames, r.bad),
            (bytes.len() as u64, 4, None)
        );
        // The last frame's chain (a deletion of "b": 11 bytes of payload).
        let last_chain = &bytes[bytes.len() - 11 - 4..][..4];
        assert_eq!(r.chain.to_le_bytes(), last_chain);
        assert_eq!(o.changes["a"].as_deref(), Some(&b"three"[..]));
        assert_eq!(o.changes["b"], None);
        assert_eq!(o.last_index, 4);
        assert_eq!(
            list_segments(&RealFs, dir.path()).unwrap(),
            vec![(7, segment_path(dir.path(), 7))]
        );
        assert!(!dir.path().join(SEGMENT_TEMP).exists());
    }

    #[test]
    fn an_unfinished_append_at_every_cut_is_torn_and_keeps_the_frames_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = segment(
            dir.path(),
            1,
            &[("a", 1, Some(b"first")), ("b", 2, Some(b"second"))],
        );
        let first_end = HEADER + HEAD + 1 + 8 + 1 + 1 + 5;
        for cut in 0..bytes.len() {
            let mut o = Overlay::default();
            let r = replay(&bytes[..cut], 1, &mut o);
            if cut < HEADER {
                let err = r.unwrap_err();
                assert!(
                    err.contains("shorter than a segment header"),
                    "{cut}: {err}"
                );
                continue;
            }
            let r = r.unwrap();
            let expect = if cut < first_end { HEADER } else { first_end };
            assert_eq!(r.valid_len, expect as u64, "cut at {cut}");
            assert_eq!(r.torn(), (cut - expect) as u64, "cut at {cut}");
            if let Some(bad) = &r.bad {
                assert!(bad.torn, "cut at {cut}: {bad:?}");
            }
            assert_eq!(o.changes.contains_key("a"), cut >= first_end);
            assert!(!o.changes.contains_key("b"));
        }
    }

    /// A flipped bit anywhere (length, checksums, payload, of any frame,
    /// the last included) is damage, never a torn tail: recovery refuses
    /// to start instead of dropping acknowledged changes.
    #[test]
    fn no_flipped_bit_looks_like_a_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let good = many(dir.path(), 12, 40);
        let frames = replay(&good, 1, &mut Overlay::default()).unwrap().frames;
        assert_eq!(frames, 12);
        for at in 0..good.len() {
            for bit in [0x01, 0x80] {
                let mut bad = good.clone();
                bad[at] ^= bit;
                match replay(&bad, 1, &mut Overlay::default()) {
                    Err(e) => assert!(at < HEADER, "byte {at}: {e}"),
                    Ok(r) => {
                        let b = r.bad.unwrap_or_else(|| panic!("byte {at} unnoticed"));
                        assert!(!b.torn, "byte {at}: {b:?}");
                        assert!(b.at <= at as u64 && r.valid_len == b.at, "{b:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn zeros_to_the_end_are_torn_a_zeroed_block_before_good_frames_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let good = many(dir.path(), 40, 300);
        assert!(good.len() > 3 * 4096);
        // A 4 KiB block zeroed in the middle: frames follow it.
        let mut bad = good.clone();
        bad[4096..8192].fill(0);
        let r = replay(&bad, 1, &mut Overlay::default()).unwrap();
        let b = r.bad.unwrap();
        assert!(!b.torn, "{b:?}");
        assert!(b.at < 4096, "{b:?}");
        // Zeros from a frame boundary, or from inside a frame, to the end:
        // space the file had been given but the append never filled.
        let r = replay(&good, 1, &mut Overlay::default()).unwrap();
        assert!(r.bad.is_none());
        // A frame boundary (the append began there), and sector boundaries.
        let boundary = replay(&good[..good.len() - 1000], 1, &mut Overlay::default())
            .unwrap()
            .valid_len as usize;
        let aligned = |at: usize| at.next_multiple_of(SECTOR);
        for from in [
            boundary,
            aligned(good.len() - 4096),
            aligned(good.len() - 1000),
        ] {
            let mut bad = good.clone();
            bad[from..].fill(0);
            let r = replay(&bad, 1, &mut Overlay::default()).unwrap();
            let b = r.bad.unwrap();
            assert!(b.torn, "zeros from {from}: {b:?}");
            assert!(r.valid_len <= from as u64);
        }
        let mut longer = good.clone();
        longer.resize(good.len() + 8192, 0);
        let r = replay(&longer, 1, &mut Overlay::default()).unwrap();
        assert_eq!((r.frames, r.valid_len), (40, good.len() as u64));
        assert!(r.bad.unwrap().torn);
    }

    #[test]
    fn a_last_frame_zeroed_from_a_sector_boundary_is_torn_a_damaged_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        // Two frames of 2 KiB records: each spans whole sectors.
        let good = many(dir.path(), 2, 2048);
        let first_end = HEADER + HEAD + 1 + 8 + 1 + "alloc-0".len() + 2048;
        let sector = first_end.next_multiple_of(SECTOR);
        for from in [sector, sector + SECTOR, good.len() - 1] {
            let mut bad = good.clone();
            bad[from..].fill(0);
            let r = replay(&bad, 1, &mut Overlay::default()).unwrap();
            assert_eq!(r.frames, 1);
            let b = r.bad.unwrap();
            assert_eq!(b.at, first_end as u64);
            // The last byte alone is no sector of its own.
            assert_eq!(b.torn, from < good.len() - 1, "zeros from {from}: {b:?}");
        }
        // A zeroed sector with data after it: damage, even in the last frame.
        let mut bad = good.clone();
        bad[sector..sector + SECTOR].fill(0);
        let r = replay(&bad, 1, &mut Overlay::default()).unwrap();
        assert_eq!(r.frames, 1);
        assert!(!r.bad.unwrap().torn);
    }

    #[test]
    fn frames_are_tied_to_their_segment_and_their_place_in_it() {
        let dir = tempfile::tempdir().unwrap();
        let a = segment(dir.path(), 1, &[("a", 1, Some(b"x")), ("b", 2, Some(b"y"))]);
        let b = segment(dir.path(), 2, &[("c", 3, Some(b"x")), ("d", 4, Some(b"y"))]);
        // The second segment's frames after the first's header: a frame
        // from elsewhere (a stale block) does not read as this segment's.
        let mut mixed = a[..HEADER].to_vec();
        mixed.extend_from_slice(&b[HEADER..]);
        let r = replay(&mixed, 1, &mut Overlay::default()).unwrap();
        assert_eq!(r.frames, 0);
        assert!(!r.bad.unwrap().torn);
        // Two frames swapped.
        let first = HEAD + 1 + 8 + 1 + 1 + 1;
        let mut swapped = a[..HEADER].to_vec();
        swapped.extend_from_slice(&a[HEADER + first..]);
        swapped.extend_from_slice(&a[HEADER..HEADER + first]);
        let r = replay(&swapped, 1, &mut Overlay::default()).unwrap();
        assert_eq!(r.frames, 0);
    }

    #[test]
    fn a_log_of_the_first_format_still_replays() {
        let mut bytes = MAGIC_V1.to_vec();
        bytes.extend_from_slice(&3u64.to_le_bytes());
        for (kind, index, id, record) in [(PUT, 5u64, "a", &b"rec"[..]), (DELETE, 6, "b", b"")] {
            let mut payload = vec![kind];
            payload.extend_from_slice(&index.to_le_bytes());
            payload.push(id.len() as u8);
            payload.extend_from_slice(id.as_bytes());
            payload.extend_from_slice(record);
            bytes.extend_from_slice(&(payload.len() as u32).to_le_bytes());
            bytes.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
            bytes.extend_from_slice(&payload);
        }
        let mut o = Overlay::default();
        let r = replay(&bytes, 3, &mut o).unwrap();
        assert_eq!((r.frames, r.bad), (2, None));
        assert_eq!(o.changes["a"].as_deref(), Some(&b"rec"[..]));
        assert_eq!(o.changes["b"], None);
        assert_eq!(o.last_index, 6);
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        let r = replay(&bytes, 3, &mut o).unwrap();
        assert!(!r.bad.unwrap().torn);
    }

    #[test]
    fn a_foreign_file_or_a_misnamed_or_damaged_header_is_an_error() {
        let mut o = Overlay::default();
        let err = replay(&[0x42; 64], 1, &mut o).unwrap_err();
        assert!(err.contains("does not start like"), "{err}");
        let err = replay(&[], 1, &mut o).unwrap_err();
        assert!(err.contains("0 bytes long"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = segment(dir.path(), 3, &[]);
        let err = replay(&bytes, 4, &mut o).unwrap_err();
        assert!(err.contains("segment 3"), "{err}");
        bytes[12] ^= 4;
        let err = replay(&bytes, 3, &mut o).unwrap_err();
        assert!(err.contains("header is damaged"), "{err}");
    }

    #[test]
    fn a_frame_that_passes_its_checks_but_does_not_parse_is_damage() {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = segment(dir.path(), 1, &[]);
        let mut buf = Vec::new();
        frame(&mut buf, "a", 1, None);
        buf[HEAD] = 9; // unknown kind
        let sum = frame_sum(true, &buf[..4], &buf[HEAD..]);
        buf[4..8].copy_from_slice(&sum.to_le_bytes());
        link(&mut buf, crc32fast::hash(&bytes[..16]));
        bytes.extend_from_slice(&buf);
        let err = replay(&bytes, 1, &mut Overlay::default()).unwrap_err();
        assert!(err.contains("unknown kind"), "{err}");
    }

    #[test]
    fn a_cut_keeps_what_it_cut_beside_the_segment() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = segment(dir.path(), 1, &[("a", 1, Some(b"x")), ("b", 2, Some(b"y"))]);
        let path = segment_path(dir.path(), 1);
        let aside = cut(&RealFs, &path, 30).unwrap();
        assert_eq!(
            aside,
            dir.path().join(format!("{SEGMENT_PREFIX}{:020}.broken", 1))
        );
        assert_eq!(std::fs::read(&aside).unwrap(), &bytes[30..]);
        assert_eq!(std::fs::read(&path).unwrap(), &bytes[..30]);
        // Cut again (a start that failed after cutting): the first copy stays.
        let again = cut(&RealFs, &path, 28).unwrap();
        assert_ne!(again, aside);
        assert_eq!(std::fs::read(&again).unwrap(), &bytes[28..30]);
        assert_eq!(std::fs::read(&aside).unwrap(), &bytes[30..]);
        assert_eq!(
            list_segments(&RealFs, dir.path()).unwrap().len(),
            1,
            "not a segment"
        );
    }
}
