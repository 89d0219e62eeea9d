//! The disk store's base: every record, in ID order, in one file that each
//! checkpoint writes anew.
//!
//! A checkpoint reads the current snapshot front to back, merges the log's
//! changes in (sorted by ID), writes the result to `taskgate.snapshot.new`,
//! makes it durable and renames it over `taskgate.snapshot`: a crash at any
//! moment leaves the old snapshot or the new one, whole, and the log
//! segments are removed only after the rename is durable. Every byte is
//! read and written sequentially; a B-tree (redb, before) rewrote a 4 KiB
//! page for nearly every record a checkpoint changed once the records no
//! longer shared pages, which made checkpoints cost 3–4 times as much CPU
//! per change at a million allocations.
//!
//! Layout (integers little-endian):
//!
//! ```text
//! header  = magic "TGSNAP\0\x01" | folded: u64 | last_index: u64 | crc32(the 24 bytes before): u32 | 0: u32
//! record  = len: u32 | crc32(payload): u32 | payload = id_len: u8 | id | record (record.rs)
//! trailer = "TGSNAPND" | records: u64
//! ```
//!
//! `folded` is the last log segment whose changes the snapshot holds;
//! `last_index` the highest global index committed up to it (deletions
//! included). IDs are strictly increasing; a file that breaks any of this,
//! or whose trailer is missing or counts differently, is damaged.

use std::{
    io::{self, BufReader, BufWriter, Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
};

use super::{
    frame,
    fs::{Fs, FsFile, Open},
    log::Overlay,
};

/// The snapshot's name inside the data directory.
pub const SNAPSHOT_FILE: &str = "taskgate.snapshot";
/// Where a checkpoint writes the next snapshot before renaming it.
pub const NEXT_FILE: &str = "taskgate.snapshot.new";
/// The snapshot a checkpoint replaced, kept under this name by `finish`
/// so that the rename does not free its blocks all at once; the
/// checkpoint thread removes it with `log::remove_gently`.
pub const OLD_FILE: &str = "taskgate.snapshot.old";
const MAGIC: [u8; 8] = *b"TGSNAP\0\x01";
const END: [u8; 8] = *b"TGSNAPND";
const HEADER: usize = 32;
const TRAILER: usize = 16;
const FRAME_HEAD: usize = 8;
/// No record comes near this (the log's bound too); a larger length is
/// damage, not a record. A frame is also never longer than what is left of
/// the file.
const MAX_PAYLOAD: usize = 1 << 30;
const IO_BUFFER: usize = 1 << 20;
/// A checkpoint makes what it wrote durable every this many bytes instead
/// of all at the end: a snapshot of a million records is ~780 MB, and
/// flushed in one go it held the disk (and every log append's fsync
/// behind it) for over a second. At a million allocations, 16 MiB chunks
/// still left reports' p99 at 11 ms against 4 ms at a thousand; 4 MiB,
/// 5.3–5.8 ms. With compact records (a snapshot of ~130 MB), 4 MiB chunks
/// still put 3.0–6.7% of the log's commits over 0.5 ms in windows with
/// two checkpoints (2.5% with none); 1 MiB, 1.4–2.2%; 256 KiB, 3.2%, and
/// the checkpoints took longer (BENCHMARKS.md).
const SYNC_EVERY: u64 = 1 << 20;

/// A snapshot being read, one record at a time.
pub struct Snapshot {
    pub folded: u64,
    pub last_index: u64,
    reader: BufReader<Box<dyn FsFile>>,
    /// Offset of the next record; the records end at `end`.
    pos: u64,
    end: u64,
    /// Records the trailer states, and records read so far.
    stated: u64,
    read: u64,
    /// The current record's whole frame, and the end of its ID in it.
    frame: Vec<u8>,
    id_end: usize,
    previous: Vec<u8>,
}

fn damaged(what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

impl Snapshot {
    /// The snapshot in `dir`, header and trailer checked; `None` if there
    /// is none.
    pub fn open(fs: &dyn Fs, dir: &Path) -> io::Result<Option<Self>> {
        let path = dir.join(SNAPSHOT_FILE);
        let mut file = match fs.open(&path, Open::Read) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let len = file.len()?;
        if len < (HEADER + TRAILER) as u64 {
            return Err(damaged(format!(
                "it is {len} bytes long, shorter than a header and a trailer"
            )));
        }
        let mut header = [0u8; HEADER];
        file.read_exact(&mut header)?;
        if header[..8] != MAGIC {
            return Err(damaged("it does not start like a taskgate snapshot"));
        }
        let u64_at = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
        let crc = u32::from_le_bytes(header[24..28].try_into().unwrap());
        if crc32fast::hash(&header[..24]) != crc || header[28..] != [0; 4] {
            return Err(damaged("its header is damaged"));
        }
        let mut trailer = [0u8; TRAILER];
        file.seek(SeekFrom::Start(len - TRAILER as u64))?;
        file.read_exact(&mut trailer)?;
        if trailer[..8] != END {
            return Err(damaged(
                "it does not end with a trailer (was it cut short?)",
            ));
        }
        file.seek(SeekFrom::Start(HEADER as u64))?;
        Ok(Some(Self {
            folded: u64_at(&header, 8),
            last_index: u64_at(&header, 16),
            reader: BufReader::with_capacity(IO_BUFFER, file),
            pos: HEADER as u64,
            end: len - TRAILER as u64,
            stated: u64_at(&trailer, 8),
            read: 0,
            frame: Vec::new(),
            id_end: 0,
            previous: Vec::new(),
        }))
    }

    /// How many records the snapshot holds, as its trailer says (checked
    /// only once they are read), but never more than its bytes could hold:
    /// callers size buffers by it.
    pub fn records(&self) -> u64 {
        self.stated
            .min((self.end - HEADER as u64) / (FRAME_HEAD as u64 + 1))
    }

    /// Reads the next record; `false` after the last one.
    pub fn advance(&mut self) -> io::Result<bool> {
        let at = self.pos;
        let fail = |what: &str| damaged(format!("the record at byte {at} {what}"));
        if self.pos == self.end {
            if self.read != self.stated {
                return Err(damaged(format!(
                    "it holds {} records and its trailer says {}",
                    self.read, self.stated
                )));
            }
            return Ok(false);
        }
        if self.end - self.pos < FRAME_HEAD as u64 {
            return Err(fail("is cut short"));
        }
        let mut head = [0u8; FRAME_HEAD];
        self.reader.read_exact(&mut head)?;
        let len = u32::from_le_bytes(head[..4].try_into().unwrap()) as usize;
        let crc = u32::from_le_bytes(head[4..].try_into().unwrap());
        if len > MAX_PAYLOAD || (self.end - self.pos - FRAME_HEAD as u64) < len as u64 {
            return Err(fail("has an impossible length"));
        }
        // The previous ID, for the order check, before the new frame is
        // read over it.
        self.previous.clear();
        if self.read > 0 {
            self.previous
                .extend_from_slice(&self.frame[FRAME_HEAD + 1..self.id_end]);
        }
        self.frame.clear();
        self.frame.extend_from_slice(&head);
        self.frame.resize(FRAME_HEAD + len, 0);
        self.reader.read_exact(&mut self.frame[FRAME_HEAD..])?;
        let payload = &self.frame[FRAME_HEAD..];
        if crc32fast::hash(payload) != crc {
            return Err(fail("fails its checksum"));
        }
        let id_len = *payload.first().ok_or_else(|| fail("is empty"))? as usize;
        if payload.len() < 1 + id_len {
            return Err(fail("is shorter than its ID"));
        }
        let id = &payload[1..1 + id_len];
        if std::str::from_utf8(id).is_err() {
            return Err(fail("has an ID that is not UTF-8"));
        }
        if self.read > 0 && self.previous.as_slice() >= id {
            return Err(fail("is out of ID order"));
        }
        self.id_end = FRAME_HEAD + 1 + id_len;
        self.pos += (FRAME_HEAD + len) as u64;
        self.read += 1;
        Ok(true)
    }

    /// The current record's allocation ID.
    pub fn id(&self) -> &str {
        std::str::from_utf8(&self.frame[FRAME_HEAD + 1..self.id_end]).expect("checked on read")
    }

    /// The current record (`record.rs`).
    pub fn record(&self) -> &[u8] {
        &self.frame[self.id_end..]
    }

    /// The current record's whole frame, as a writer copies it.
    fn raw(&self) -> &[u8] {
        &self.frame
    }
}

/// The next snapshot, written to `NEXT_FILE` and renamed into place by
/// `finish`.
pub struct SnapshotWriter<'f> {
    fs: &'f dyn Fs,
    dir: PathBuf,
    out: BufWriter<Box<dyn FsFile>>,
    records: u64,
    scratch: Vec<u8>,
    /// Bytes written since the last `sync_data`, and in all.
    unsynced: u64,
    bytes: u64,
}

/// What a finished snapshot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Written {
    pub records: u64,
    pub bytes: u64,
}

impl<'f> SnapshotWriter<'f> {
    /// Starts the next snapshot, replacing an unfinished one.
    pub fn create(fs: &'f dyn Fs, dir: &Path, folded: u64, last_index: u64) -> io::Result<Self> {
        let file = fs.open(&dir.join(NEXT_FILE), Open::Truncate)?;
        let mut out = BufWriter::with_capacity(IO_BUFFER, file);
        let mut header = [0u8; HEADER];
        header[..8].copy_from_slice(&MAGIC);
        header[8..16].copy_from_slice(&folded.to_le_bytes());
        header[16..24].copy_from_slice(&last_index.to_le_bytes());
        let crc = crc32fast::hash(&header[..24]);
        header[24..28].copy_from_slice(&crc.to_le_bytes());
        out.write_all(&header)?;
        Ok(Self {
            fs,
            dir: dir.to_owned(),
            out,
            records: 0,
            scratch: Vec::new(),
            unsynced: HEADER as u64,
            bytes: HEADER as u64,
        })
    }

    /// Counts `n` bytes written; flushes and syncs every `SYNC_EVERY`.
    fn wrote(&mut self, n: usize) -> io::Result<()> {
        self.records += 1;
        self.unsynced += n as u64;
        self.bytes += n as u64;
        if self.unsynced >= SYNC_EVERY {
            self.out.flush()?;
            self.out.get_mut().sync_data()?;
            self.unsynced = 0;
        }
        Ok(())
    }

    /// Appends a record; IDs must come in increasing order.
    pub fn put(&mut self, id: &str, record: &[u8]) -> io::Result<()> {
        let id_len = u8::try_from(id.len()).expect("allocation IDs are at most 128 bytes");
        let buf = &mut self.scratch;
        buf.clear();
        buf.extend_from_slice(&[0; FRAME_HEAD]);
        buf.push(id_len);
        buf.extend_from_slice(id.as_bytes());
        buf.extend_from_slice(record);
        let len = u32::try_from(buf.len() - FRAME_HEAD).expect("a record is far below 4 GiB");
        let crc = crc32fast::hash(&buf[FRAME_HEAD..]);
        buf[..4].copy_from_slice(&len.to_le_bytes());
        buf[4..FRAME_HEAD].copy_from_slice(&crc.to_le_bytes());
        self.out.write_all(buf)?;
        let n = buf.len();
        self.wrote(n)
    }

    fn put_raw(&mut self, frame: &[u8]) -> io::Result<()> {
        self.out.write_all(frame)?;
        self.wrote(frame.len())
    }

    /// Writes the trailer, makes the file durable and renames it over the
    /// current snapshot, durably. The replaced snapshot stays as
    /// `OLD_FILE` (a second name, linked before the rename) for its
    /// blocks to be freed gently.
    pub fn finish(mut self) -> io::Result<Written> {
        self.out.write_all(&END)?;
        self.out.write_all(&self.records.to_le_bytes())?;
        let mut file = self.out.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        drop(file);
        let fs = self.fs;
        let (current, old) = (self.dir.join(SNAPSHOT_FILE), self.dir.join(OLD_FILE));
        // One left by a checkpoint whose removal failed: only a name to
        // drop (unlinking never touches another name's blocks).
        match fs.remove_file(&old) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        match fs.hard_link(&current, &old) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        fs.rename(&self.dir.join(NEXT_FILE), &current)?;
        fs.sync_dir(&self.dir)?;
        Ok(Written {
            records: self.records,
            bytes: self.bytes + TRAILER as u64,
        })
    }
}

/// What can still be read of a snapshot, however damaged it is
/// (`taskgate dump --salvage`).
pub struct Salvaged<'a> {
    /// The header's facts, if the header reads back.
    pub folded: Option<u64>,
    pub last_index: u64,
    /// Every record that passes its checksum: (ID, record).
    pub records: Vec<(&'a str, &'a [u8])>,
    /// The stretches that could not be read.
    pub unread: Vec<frame::Unread>,
    /// What the trailer says is wrong with the whole: missing (the file
    /// was cut short, or its end is damaged), or a count that differs
    /// from the records read.
    pub trailer: Option<String>,
}

/// Reads a snapshot's bytes as `Snapshot` does, but past a bad record
/// takes up again at the next offset where a whole record passes its
/// checksum.
pub fn salvage(bytes: &[u8]) -> Salvaged<'_> {
    let mut out = Salvaged {
        folded: None,
        last_index: 0,
        records: Vec::new(),
        unread: Vec::new(),
        trailer: None,
    };
    let header_ok = bytes.len() >= HEADER
        && bytes[..8] == MAGIC
        && crc32fast::hash(&bytes[..24]).to_le_bytes() == bytes[24..28];
    if header_ok {
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
        out.folded = Some(u64_at(8));
        out.last_index = u64_at(16);
    } else {
        out.unread.push(frame::Unread {
            from: 0,
            to: HEADER.min(bytes.len()) as u64,
        });
    }
    let trailer = bytes.len() >= HEADER + TRAILER && bytes[bytes.len() - TRAILER..][..8] == END;
    let end = if trailer {
        bytes.len() - TRAILER
    } else {
        bytes.len()
    };
    let mut pos = HEADER;
    let mut skipping = None;
    while pos < end {
        let record = bytes.get(pos..pos + FRAME_HEAD).and_then(|h| {
            let len = u32::from_le_bytes(h[..4].try_into().unwrap()) as usize;
            let crc = u32::from_le_bytes(h[4..].try_into().unwrap());
            let payload =
                bytes[..end].get(pos + FRAME_HEAD..(pos + FRAME_HEAD).checked_add(len)?)?;
            (crc32fast::hash(payload) == crc).then_some(())?;
            let id_len = *payload.first()? as usize;
            let id = std::str::from_utf8(payload.get(1..1 + id_len)?).ok()?;
            Some((id, &payload[1 + id_len..], FRAME_HEAD + len))
        });
        match record {
            Some((id, record, len)) => {
                if let Some(from) = skipping.take() {
                    out.unread.push(frame::Unread {
                        from,
                        to: pos as u64,
                    });
                }
                out.records.push((id, record));
                pos += len;
            }
            None => {
                skipping.get_or_insert(pos as u64);
                pos += 1;
            }
        }
    }
    if let Some(from) = skipping {
        out.unread.push(frame::Unread {
            from,
            to: end as u64,
        });
    }
    if !trailer {
        out.trailer = Some("it has no trailer: it was cut short, or its end is damaged".into());
    } else {
        let stated = u64::from_le_bytes(bytes[bytes.len() - 8..].try_into().unwrap());
        if stated != out.records.len() as u64 {
            out.trailer = Some(format!(
                "its trailer counts {stated} records, {} were read",
                out.records.len()
            ));
        }
    }
    out
}

/// The newest change of every allocation in `changes`, sorted by ID.
pub fn sorted(overlay: &Overlay) -> Vec<(&str, Option<&[u8]>)> {
    let mut changes: Vec<_> = overlay
        .changes
        .iter()
        .map(|(id, r)| (id.as_str(), r.as_deref()))
        .collect();
    changes.sort_unstable_by(|a, b| a.0.cmp(b.0));
    changes
}

/// One record of a merge, in ID order.
enum Merged<'a> {
    /// A record of the snapshot no change touches (its whole frame at
    /// hand, to copy as it is).
    Kept(&'a Snapshot),
    /// A change's record (ID, record).
    Put(&'a str, &'a [u8]),
}

/// Walks the snapshot in `dir` (if any) merged with `changes` (sorted by
/// ID, newer than the snapshot), handing every record that results to
/// `each`. Deletions drop the record.
fn merge(
    base: Option<&mut Snapshot>,
    changes: &[(&str, Option<&[u8]>)],
    mut each: impl FnMut(Merged<'_>) -> io::Result<()>,
) -> io::Result<()> {
    // A put, as its record; a deletion has none.
    fn put<'a>(&(id, record): &(&'a str, Option<&'a [u8]>)) -> Option<Merged<'a>> {
        record.map(|r| Merged::Put(id, r))
    }
    let mut changes = changes.iter().peekable();
    if let Some(base) = base {
        while base.advance()? {
            let id = base.id();
            while let Some(change) = changes.next_if(|(cid, _)| *cid < id) {
                put(change).map_or(Ok(()), &mut each)?;
            }
            match changes.next_if(|(cid, _)| *cid == id) {
                Some(change) => put(change).map_or(Ok(()), &mut each)?,
                None => each(Merged::Kept(base))?,
            }
        }
    }
    changes.filter_map(put).try_for_each(each)
}

/// A checkpoint: the snapshot in `dir` with `overlay`'s changes merged in,
/// written as the next snapshot, which records that the log is folded up
/// to segment `sealed`.
pub fn fold(fs: &dyn Fs, dir: &Path, overlay: &Overlay, sealed: u64) -> io::Result<Written> {
    fold_sorted(fs, dir, &sorted(overlay), overlay.last_index, sealed)
}

/// `fold` of changes already sorted by ID (newer than the snapshot), the
/// highest index among them being `last_index`.
pub fn fold_sorted(
    fs: &dyn Fs,
    dir: &Path,
    changes: &[(&str, Option<&[u8]>)],
    last_index: u64,
    sealed: u64,
) -> io::Result<Written> {
    let mut base = Snapshot::open(fs, dir)?;
    let last_index = base.as_ref().map_or(0, |b| b.last_index).max(last_index);
    let written = SnapshotWriter::create(fs, dir, sealed, last_index).and_then(|mut out| {
        merge(base.as_mut(), changes, |merged| match merged {
            Merged::Kept(kept) => out.put_raw(kept.raw()),
            Merged::Put(id, record) => out.put(id, record),
        })?;
        out.finish()
    });
    if written.is_err() {
        // Whatever stopped it (a full disk, say), the unfinished snapshot
        // is of no use: give its space back now, not at the next start.
        let _ = fs.remove_file(&dir.join(NEXT_FILE));
    }
    written
}

/// Every record the snapshot in `dir` holds merged with `changes` (sorted,
/// newer), in ID order, to `each`.
pub fn load(
    base: Option<&mut Snapshot>,
    changes: &[(&str, Option<&[u8]>)],
    mut each: impl FnMut(&str, &[u8]) -> io::Result<()>,
) -> io::Result<()> {
    merge(base, changes, |merged| match merged {
        Merged::Kept(kept) => each(kept.id(), kept.record()),
        Merged::Put(id, record) => each(id, record),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fs::RealFs;

    fn overlay(changes: &[(&str, Option<&str>)], last_index: u64) -> Overlay {
        let mut o = Overlay::default();
        for (id, r) in changes {
            o.apply((*id).to_owned(), r.map(|r| r.as_bytes().to_vec()), 0);
        }
        o.last_index = last_index;
        o
    }

    fn contents(dir: &Path) -> Vec<(String, String)> {
        let mut base = Snapshot::open(&RealFs, dir).unwrap();
        let mut out = Vec::new();
        load(base.as_mut(), &[], |id, r| {
            out.push((id.to_owned(), String::from_utf8(r.to_vec()).unwrap()));
            Ok(())
        })
        .unwrap();
        out
    }

    /// A snapshot in `dir` of `n` records `alloc-00`, `alloc-01`, ...;
    /// returns its path.
    fn snapshot_of(dir: &Path, n: usize) -> PathBuf {
        let ids: Vec<String> = (0..n).map(|i| format!("alloc-{i:02}")).collect();
        let changes: Vec<_> = ids
            .iter()
            .map(|id| (id.as_str(), Some("{\"v\":1}")))
            .collect();
        fold(&RealFs, dir, &overlay(&changes, n as u64), 1).unwrap();
        dir.join(SNAPSHOT_FILE)
    }

    fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
        items
            .iter()
            .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
            .collect()
    }

    #[test]
    fn checkpoints_merge_changes_in_id_order_and_keep_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        assert!(Snapshot::open(&RealFs, dir.path()).unwrap().is_none());
        let first = overlay(
            &[("b", Some("b1")), ("a", Some("a1")), ("d", Some("d1"))],
            3,
        );
        assert_eq!(fold(&RealFs, dir.path(), &first, 1).unwrap().records, 3);
        let second = overlay(&[("c", Some("c2")), ("a", None), ("d", Some("d2"))], 7);
        let written = fold(&RealFs, dir.path(), &second, 2).unwrap();
        assert_eq!(written.records, 3);
        let len = std::fs::metadata(dir.path().join(SNAPSHOT_FILE))
            .unwrap()
            .len();
        assert_eq!(written.bytes, len);
        assert_eq!(
            contents(dir.path()),
            pairs(&[("b", "b1"), ("c", "c2"), ("d", "d2")])
        );
        let s = Snapshot::open(&RealFs, dir.path()).unwrap().unwrap();
        assert_eq!((s.folded, s.last_index), (2, 7));
        // The index never goes back, even if a checkpoint's changes are
        // older than what a deletion already used.
        fold(&RealFs, dir.path(), &overlay(&[("e", Some("e3"))], 5), 3).unwrap();
        let s = Snapshot::open(&RealFs, dir.path()).unwrap().unwrap();
        assert_eq!((s.folded, s.last_index), (3, 7));
        assert!(!dir.path().join(NEXT_FILE).exists());
    }

    #[test]
    fn the_replaced_snapshot_keeps_a_name_of_its_own_until_removed() {
        let dir = tempfile::tempdir().unwrap();
        let old = dir.path().join(OLD_FILE);
        fold(&RealFs, dir.path(), &overlay(&[("a", Some("a1"))], 1), 1).unwrap();
        assert!(!old.exists(), "nothing was replaced");
        let first = std::fs::read(dir.path().join(SNAPSHOT_FILE)).unwrap();
        fold(&RealFs, dir.path(), &overlay(&[("b", Some("b2"))], 2), 2).unwrap();
        assert_eq!(std::fs::read(&old).unwrap(), first);
        assert_eq!(contents(dir.path()), pairs(&[("a", "a1"), ("b", "b2")]));
        // Not removed in between (a failed removal): the next checkpoint
        // drops that name and keeps the one it replaces.
        let second = std::fs::read(dir.path().join(SNAPSHOT_FILE)).unwrap();
        fold(&RealFs, dir.path(), &overlay(&[("a", None)], 3), 3).unwrap();
        assert_eq!(std::fs::read(&old).unwrap(), second);
        assert_eq!(contents(dir.path()), pairs(&[("b", "b2")]));
        super::super::log::remove_gently(&RealFs, &old).unwrap();
        assert!(!old.exists());
        assert_eq!(contents(dir.path()), pairs(&[("b", "b2")]));
    }

    #[test]
    fn an_unfinished_next_snapshot_changes_nothing_and_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        fold(&RealFs, dir.path(), &overlay(&[("a", Some("a1"))], 1), 1).unwrap();
        // A checkpoint that crashed before its rename.
        let mut w = SnapshotWriter::create(&RealFs, dir.path(), 2, 2).unwrap();
        w.put("a", b"never renamed").unwrap();
        drop(w);
        assert_eq!(contents(dir.path()), pairs(&[("a", "a1")]));
        fold(&RealFs, dir.path(), &overlay(&[("b", Some("b2"))], 2), 2).unwrap();
        assert_eq!(contents(dir.path()), pairs(&[("a", "a1"), ("b", "b2")]));
    }

    #[test]
    fn a_checkpoint_over_a_damaged_snapshot_fails_and_leaves_it_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = snapshot_of(dir.path(), 50);
        let mut bytes = std::fs::read(&path).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x01;
        std::fs::write(&path, &bytes).unwrap();
        let err = fold(&RealFs, dir.path(), &overlay(&[("new", Some("x"))], 51), 2).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
        assert!(!dir.path().join(NEXT_FILE).exists(), "its space given back");
        assert_eq!(std::fs::read(&path).unwrap(), bytes, "left as it was");
    }

    /// Whatever byte of the file is damaged, reading it fails (never a
    /// silently different set of records).
    #[test]
    fn any_flipped_bit_or_cut_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let path = snapshot_of(dir.path(), 20);
        let good = std::fs::read(&path).unwrap();
        let read_all = || -> io::Result<usize> {
            let mut base = Snapshot::open(&RealFs, dir.path())?.expect("a snapshot");
            let mut n = 0;
            load(Some(&mut base), &[], |_, _| {
                n += 1;
                Ok(())
            })?;
            Ok(n)
        };
        assert_eq!(read_all().unwrap(), 20);
        for at in (0..good.len()).step_by(7) {
            let mut bad = good.clone();
            bad[at] ^= 0x10;
            std::fs::write(&path, &bad).unwrap();
            assert!(
                read_all().is_err(),
                "a flipped bit at byte {at} went unnoticed"
            );
        }
        // A trailer claiming an absurd count is not believed before the
        // records are read (the store sizes its load by it).
        let mut bad = good.clone();
        let at = good.len() - 1;
        bad[at] ^= 0x80;
        std::fs::write(&path, &bad).unwrap();
        let s = Snapshot::open(&RealFs, dir.path()).unwrap().unwrap();
        assert!(s.records() <= good.len() as u64, "{}", s.records());
        assert!(read_all().is_err());
        for cut in [good.len() - 1, good.len() - TRAILER, HEADER + 3, 10] {
            std::fs::write(&path, &good[..cut]).unwrap();
            assert!(read_all().is_err(), "a cut at byte {cut} went unnoticed");
        }
    }
}
