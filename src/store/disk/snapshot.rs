//! The disk store's base: every record, in ID order, in one file that each
//! checkpoint writes anew.
//!
//! A checkpoint reads the current snapshot front to back, merges the log's
//! changes in (sorted by ID), writes the result to `taskgate.snapshot.new`,
//! makes it durable and renames it over `taskgate.snapshot`: a crash at any
//! moment leaves the replaced snapshot or the new one, whole, and the log
//! segments are removed only after the rename is durable. Every byte is
//! read and written sequentially: a B-tree rewrites a page for nearly
//! every record a checkpoint changes once the records no longer share
//! pages (measured: see BENCHMARKS.md).
//!
//! This build writes and reads format 2 (integers little-endian):
//!
//! ```text
//! snapshot = header record* trailer
//! header   = magic "TGSNAP\0\x02" | folded: u64 | last_index: u64
//!          | log_len: u64 | log_chain: u32 | crc32(the 36 bytes before): u32
//! record   = frame (frame.rs: len | crc | chain | payload), chained from the header's crc32
//! payload  = id_len: u8 | id | record (record.rs; a semaphore's under the
//!            id `~s/<name>`, after every allocation's)
//! trailer  = "TGSNAPND" | records: u64 | chain: u32 (the last record's; the header's
//!            crc32 if there is none) | crc32(the 20 bytes before): u32
//! ```
//!
//! `folded` is the last log segment whose changes the snapshot holds, and
//! `log_len` and `log_chain` say where that segment ended (its length and
//! its last frame's chain, `log::End`): the next segment's header says the
//! same, which ties the snapshot to the log that follows it — an older
//! snapshot, or one of another data directory, does not fit the log. A
//! snapshot written by `dump --salvage` folded nothing, and has a random
//! `log_chain` that the first segment written after it takes up.
//! `last_index` is the highest global index committed up to it (deletions
//! included).
//!
//! The records' chain runs from the header to the trailer, so the trailer
//! checks the whole file: a record copied from an older snapshot (even a
//! whole block of them at the same place) does not link to the record
//! before it, and the start names the byte where that happens. IDs are
//! strictly increasing; a file that breaks any of this, or whose trailer
//! is missing, damaged or counts differently, is damaged. A snapshot
//! whose magic names another format is refused: its header says which
//! format, and the refusal which one this build reads.

use std::{
    io::{self, BufReader, BufWriter, Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
};

use super::{
    frame::{self, Head},
    fs::{Fs, FsFile, Open},
    log::{End, Overlay},
};

/// The snapshot's name inside the data directory.
pub const SNAPSHOT_FILE: &str = "taskgate.snapshot";
/// Where a checkpoint writes the next snapshot before renaming it.
pub const NEXT_FILE: &str = "taskgate.snapshot.new";
/// The snapshot a checkpoint replaced, kept under this name by `finish`
/// so that the rename does not free its blocks all at once; the
/// checkpoint thread removes it with `log::remove_gently`.
pub const OLD_FILE: &str = "taskgate.snapshot.old";
/// A snapshot's first bytes; the last is its format.
const MAGIC: [u8; 8] = *b"TGSNAP\0\x02";
const END: [u8; 8] = *b"TGSNAPND";
const HEADER: usize = 40;
const TRAILER: usize = 24;
const IO_BUFFER: usize = 1 << 20;
/// A checkpoint makes what it wrote durable every this many bytes instead
/// of all at the end: a large snapshot flushed in one go holds the disk,
/// and every log append's fsync behind it. Larger steps delay the log's
/// commits more, smaller ones make checkpoints longer (measured: see
/// BENCHMARKS.md, "Older results").
const SYNC_EVERY: u64 = 1 << 20;

/// A snapshot's header and trailer, read and checked.
struct Bounds {
    folded: u64,
    last_index: u64,
    /// Where the log segment it folded ended.
    log_end: End,
    /// The chain its records start from and must end with.
    seed: u32,
    chain: u32,
    /// Records the trailer states.
    records: u64,
    /// Where the records start and end.
    first: usize,
    end: usize,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Checks a snapshot's header (its first `HEADER` bytes, or fewer if the
/// file is shorter) and trailer (its last `TRAILER` bytes) for a file of
/// `len` bytes.
fn bounds(header: &[u8], trailer: &[u8], len: u64) -> Result<Bounds, String> {
    frame::magic(header, &MAGIC, "snapshot")?;
    if len < (HEADER + TRAILER) as u64 {
        return Err(format!(
            "it is {len} bytes long, shorter than a header and a trailer"
        ));
    }
    if crc32fast::hash(&header[..36]) != u32_at(header, 36) {
        return Err(
            "its header is damaged: bytes 0 to 35 do not match their checksum (at byte 36)".into(),
        );
    }
    if trailer[..8] != END {
        return Err(format!(
            "it does not end with a trailer (at byte {}): was it cut short?",
            len - TRAILER as u64
        ));
    }
    if crc32fast::hash(&trailer[..20]) != u32_at(trailer, 20) {
        return Err(format!(
            "its trailer (at byte {}) is damaged",
            len - TRAILER as u64
        ));
    }
    Ok(Bounds {
        folded: u64_at(header, 8),
        last_index: u64_at(header, 16),
        log_end: End {
            len: u64_at(header, 24),
            chain: u32_at(header, 32),
        },
        seed: u32_at(header, 36),
        chain: u32_at(trailer, 16),
        records: u64_at(trailer, 8),
        first: HEADER,
        end: usize::try_from(len).unwrap_or(usize::MAX) - TRAILER,
    })
}

/// A snapshot being read, one record at a time.
pub struct Snapshot {
    pub folded: u64,
    pub last_index: u64,
    /// Where the log segment it folded ended.
    pub log_end: End,
    reader: BufReader<Box<dyn FsFile>>,
    /// Offset of the next record; the records end at `end`.
    pos: u64,
    end: u64,
    /// Records the trailer states, and records read so far.
    stated: u64,
    read: u64,
    /// The chain of the last record read, and the one the trailer states.
    chain: u32,
    last_chain: u32,
    /// The current record's whole frame, and where its payload and the
    /// end of its ID are in it.
    frame: Vec<u8>,
    payload: usize,
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
        let mut header = vec![0u8; HEADER.min(len as usize)];
        file.read_exact(&mut header)?;
        let mut trailer = vec![0u8; TRAILER.min(len as usize)];
        file.seek(SeekFrom::Start(len - trailer.len() as u64))?;
        file.read_exact(&mut trailer)?;
        let b = bounds(&header, &trailer, len).map_err(damaged)?;
        file.seek(SeekFrom::Start(b.first as u64))?;
        Ok(Some(Self {
            folded: b.folded,
            last_index: b.last_index,
            log_end: b.log_end,
            reader: BufReader::with_capacity(IO_BUFFER, file),
            pos: b.first as u64,
            end: b.end as u64,
            stated: b.records,
            read: 0,
            chain: b.seed,
            last_chain: b.chain,
            frame: Vec::new(),
            payload: 0,
            id_end: 0,
            previous: Vec::new(),
        }))
    }

    /// How many records the snapshot holds, as its trailer says (checked
    /// only once they are read), but never more than its bytes could hold:
    /// callers size buffers by it.
    pub fn records(&self) -> u64 {
        self.stated
            .min((self.end - HEADER as u64) / (frame::HEAD as u64 + 1))
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
            if self.chain != self.last_chain {
                return Err(damaged(format!(
                    "its last record (ending at byte {at}) is not the one its trailer \
                     names: records are missing or were changed"
                )));
            }
            return Ok(false);
        }
        let head = frame::HEAD;
        if self.end - self.pos < head as u64 {
            return Err(fail("is cut short"));
        }
        // The previous ID, for the order check, before the new frame is
        // read over it.
        self.previous.clear();
        if self.read > 0 {
            self.previous
                .extend_from_slice(&self.frame[self.payload + 1..self.id_end]);
        }
        self.frame.clear();
        self.frame.resize(head, 0);
        self.reader.read_exact(&mut self.frame)?;
        let h = Head::read(&self.frame);
        if !h.links(self.chain) {
            return Err(fail(
                "does not follow the record before it (its head is damaged, or it was \
                 not written in this file: a block of another snapshot?)",
            ));
        }
        if h.len > frame::MAX_PAYLOAD || (self.end - self.pos - head as u64) < h.len as u64 {
            return Err(fail("has an impossible length"));
        }
        self.frame.resize(head + h.len, 0);
        self.reader.read_exact(&mut self.frame[head..])?;
        let payload = &self.frame[head..];
        if !h.fits(payload) {
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
        self.payload = head;
        self.id_end = head + 1 + id_len;
        self.pos += (head + h.len) as u64;
        self.read += 1;
        self.chain = h.chain;
        Ok(true)
    }

    /// The current record's allocation ID.
    pub fn id(&self) -> &str {
        std::str::from_utf8(&self.frame[self.payload + 1..self.id_end]).expect("checked on read")
    }

    /// The current record (`record.rs`).
    pub fn record(&self) -> &[u8] {
        &self.frame[self.id_end..]
    }

    /// The current record's payload (ID and record), as a writer copies
    /// it, and its head's length and checksum, to reuse.
    fn raw(&self) -> (&[u8], [u8; 8]) {
        let len_crc = self.frame[..8].try_into().expect("8 bytes");
        (&self.frame[self.payload..], len_crc)
    }
}

/// The next snapshot, written to `NEXT_FILE` and renamed into place by
/// `finish`.
pub struct SnapshotWriter<'f> {
    fs: &'f dyn Fs,
    dir: PathBuf,
    out: BufWriter<Box<dyn FsFile>>,
    records: u64,
    /// The last record's chain (the header's crc32 before any).
    chain: u32,
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
    /// Starts the next snapshot, replacing an unfinished one: it folds the
    /// log up to segment `folded`, which ended at `log_end`.
    pub fn create(
        fs: &'f dyn Fs,
        dir: &Path,
        folded: u64,
        last_index: u64,
        log_end: End,
    ) -> io::Result<Self> {
        let file = fs.open(&dir.join(NEXT_FILE), Open::Truncate)?;
        let mut out = BufWriter::with_capacity(IO_BUFFER, file);
        let mut header = [0u8; HEADER];
        header[..8].copy_from_slice(&MAGIC);
        header[8..16].copy_from_slice(&folded.to_le_bytes());
        header[16..24].copy_from_slice(&last_index.to_le_bytes());
        header[24..32].copy_from_slice(&log_end.len.to_le_bytes());
        header[32..36].copy_from_slice(&log_end.chain.to_le_bytes());
        let crc = crc32fast::hash(&header[..36]);
        header[36..40].copy_from_slice(&crc.to_le_bytes());
        out.write_all(&header)?;
        Ok(Self {
            fs,
            dir: dir.to_owned(),
            out,
            records: 0,
            chain: crc,
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
        buf.extend_from_slice(&[0; frame::HEAD]);
        buf.push(id_len);
        buf.extend_from_slice(id.as_bytes());
        buf.extend_from_slice(record);
        self.chain = frame::seal(buf, self.chain);
        self.out.write_all(buf)?;
        let n = buf.len();
        self.wrote(n)
    }

    /// Appends a record read from the snapshot before (ID and record, as
    /// `Snapshot::raw` gives them): it keeps its checksum, and only its
    /// chain is computed anew.
    fn put_raw(&mut self, payload: &[u8], len_crc: [u8; 8]) -> io::Result<()> {
        let mut head = [0u8; frame::HEAD];
        head[..8].copy_from_slice(&len_crc);
        self.chain = frame::relink(&mut head, self.chain);
        self.out.write_all(&head)?;
        self.out.write_all(payload)?;
        self.wrote(frame::HEAD + payload.len())
    }

    /// Writes the trailer, makes the file durable and renames it over the
    /// current snapshot, durably. The replaced snapshot stays as
    /// `OLD_FILE` (a second name, linked before the rename) for its
    /// blocks to be freed gently.
    pub fn finish(mut self) -> io::Result<Written> {
        let mut trailer = [0u8; TRAILER];
        trailer[..8].copy_from_slice(&END);
        trailer[8..16].copy_from_slice(&self.records.to_le_bytes());
        trailer[16..20].copy_from_slice(&self.chain.to_le_bytes());
        let crc = crc32fast::hash(&trailer[..20]);
        trailer[20..24].copy_from_slice(&crc.to_le_bytes());
        self.out.write_all(&trailer)?;
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
    /// Where the log segment it folded ended, if the header says.
    pub log_end: Option<End>,
    /// Every record that can be proven: (offset, ID, record).
    pub records: Vec<(usize, &'a str, &'a [u8])>,
    /// The stretches that could not be read.
    pub unread: Vec<frame::Unread>,
    /// What the trailer says is wrong with the whole: missing (the file
    /// was cut short, or its end is damaged), or a count that differs
    /// from the records read.
    pub trailer: Option<String>,
}

/// Reads a snapshot's bytes as `Snapshot` does, but past damage, as
/// `frame::salvage` reads frames (to the end its trailer vouches for).
pub fn salvage(bytes: &[u8]) -> Salvaged<'_> {
    let mut out = Salvaged {
        folded: None,
        last_index: 0,
        log_end: None,
        records: Vec::new(),
        unread: Vec::new(),
        trailer: None,
    };
    let header_ok = bytes.len() >= HEADER
        && bytes.starts_with(&MAGIC)
        && crc32fast::hash(&bytes[..36]) == u32_at(bytes, 36);
    if header_ok {
        out.folded = Some(u64_at(bytes, 8));
        out.last_index = u64_at(bytes, 16);
        out.log_end = Some(End {
            len: u64_at(bytes, 24),
            chain: u32_at(bytes, 32),
        });
    } else {
        out.unread.push(frame::Unread {
            from: 0,
            to: HEADER.min(bytes.len()) as u64,
        });
    }
    let trailer = &bytes[bytes.len().saturating_sub(TRAILER)..];
    let trailer_ok = bytes.len() >= HEADER + TRAILER
        && trailer[..8] == END
        && crc32fast::hash(&trailer[..20]) == u32_at(trailer, 20);
    let end = if trailer_ok {
        bytes.len() - TRAILER
    } else {
        bytes.len()
    };
    let records = &bytes[..end.max(HEADER.min(bytes.len()))];
    let seed = if header_ok { u32_at(bytes, 36) } else { 0 };
    let vouched = if trailer_ok {
        frame::EndsAt::Vouched {
            at: end,
            chain: u32_at(trailer, 16),
        }
    } else {
        frame::EndsAt::File
    };
    let read = frame::salvage(records, HEADER.min(records.len()), seed, vouched);
    out.unread.extend(read.unread);
    for (at, payload) in read.frames {
        match split_record(payload) {
            Some((id, record)) => out.records.push((at, id, record)),
            // Passes its checks but is no record: lost all the same.
            None => out.unread.push(frame::Unread {
                from: at as u64,
                to: (at + frame::HEAD + payload.len()) as u64,
            }),
        }
    }
    out.unread.sort_by_key(|u| u.from);
    if !trailer_ok {
        out.trailer = Some("it has no trailer: it was cut short, or its end is damaged".into());
    } else {
        let stated = u64_at(trailer, 8);
        if stated != out.records.len() as u64 {
            out.trailer = Some(format!(
                "its trailer counts {stated} records, {} were read",
                out.records.len()
            ));
        }
    }
    out
}

/// A record's payload as its ID and record.
fn split_record(payload: &[u8]) -> Option<(&str, &[u8])> {
    let id_len = *payload.first()? as usize;
    let id = std::str::from_utf8(payload.get(1..1 + id_len)?).ok()?;
    Some((id, &payload[1 + id_len..]))
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
/// to segment `sealed`, which ended at `log_end`.
pub fn fold(
    fs: &dyn Fs,
    dir: &Path,
    overlay: &Overlay,
    sealed: u64,
    log_end: End,
) -> io::Result<Written> {
    fold_sorted(
        fs,
        dir,
        &sorted(overlay),
        overlay.last_index,
        sealed,
        log_end,
    )
}

/// `fold` of changes already sorted by ID (newer than the snapshot), the
/// highest index among them being `last_index`.
pub fn fold_sorted(
    fs: &dyn Fs,
    dir: &Path,
    changes: &[(&str, Option<&[u8]>)],
    last_index: u64,
    sealed: u64,
    log_end: End,
) -> io::Result<Written> {
    let mut base = Snapshot::open(fs, dir)?;
    let last_index = base.as_ref().map_or(0, |b| b.last_index).max(last_index);
    let created = SnapshotWriter::create(fs, dir, sealed, last_index, log_end);
    let written = created.and_then(|mut out| {
        merge(base.as_mut(), changes, |merged| match merged {
            Merged::Kept(kept) => {
                let (payload, len_crc) = kept.raw();
                out.put_raw(payload, len_crc)
            }
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
            .map(|id| (id.as_str(), Some("record-1")))
            .collect();
        fold(&RealFs, dir, &overlay(&changes, n as u64), 1, End::NONE).unwrap();
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
        assert_eq!(
            fold(&RealFs, dir.path(), &first, 1, End::NONE)
                .unwrap()
                .records,
            3
        );
        let second = overlay(&[("c", Some("c2")), ("a", None), ("d", Some("d2"))], 7);
        let written = fold(&RealFs, dir.path(), &second, 2, End::NONE).unwrap();
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
        fold(
            &RealFs,
            dir.path(),
            &overlay(&[("e", Some("e3"))], 5),
            3,
            End::NONE,
        )
        .unwrap();
        let s = Snapshot::open(&RealFs, dir.path()).unwrap().unwrap();
        assert_eq!((s.folded, s.last_index), (3, 7));
        assert!(!dir.path().join(NEXT_FILE).exists());
    }

    #[test]
    fn the_replaced_snapshot_keeps_a_name_of_its_own_until_removed() {
        let dir = tempfile::tempdir().unwrap();
        let old = dir.path().join(OLD_FILE);
        fold(
            &RealFs,
            dir.path(),
            &overlay(&[("a", Some("a1"))], 1),
            1,
            End::NONE,
        )
        .unwrap();
        assert!(!old.exists(), "nothing was replaced");
        let first = std::fs::read(dir.path().join(SNAPSHOT_FILE)).unwrap();
        fold(
            &RealFs,
            dir.path(),
            &overlay(&[("b", Some("b2"))], 2),
            2,
            End::NONE,
        )
        .unwrap();
        assert_eq!(std::fs::read(&old).unwrap(), first);
        assert_eq!(contents(dir.path()), pairs(&[("a", "a1"), ("b", "b2")]));
        // Not removed in between (a failed removal): the next checkpoint
        // drops that name and keeps the one it replaces.
        let second = std::fs::read(dir.path().join(SNAPSHOT_FILE)).unwrap();
        fold(
            &RealFs,
            dir.path(),
            &overlay(&[("a", None)], 3),
            3,
            End::NONE,
        )
        .unwrap();
        assert_eq!(std::fs::read(&old).unwrap(), second);
        assert_eq!(contents(dir.path()), pairs(&[("b", "b2")]));
        super::super::log::remove_gently(&RealFs, &old).unwrap();
        assert!(!old.exists());
        assert_eq!(contents(dir.path()), pairs(&[("b", "b2")]));
    }

    #[test]
    fn an_unfinished_next_snapshot_changes_nothing_and_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        fold(
            &RealFs,
            dir.path(),
            &overlay(&[("a", Some("a1"))], 1),
            1,
            End::NONE,
        )
        .unwrap();
        // A checkpoint that crashed before its rename.
        let mut w = SnapshotWriter::create(&RealFs, dir.path(), 2, 2, End::NONE).unwrap();
        w.put("a", b"never renamed").unwrap();
        drop(w);
        assert_eq!(contents(dir.path()), pairs(&[("a", "a1")]));
        fold(
            &RealFs,
            dir.path(),
            &overlay(&[("b", Some("b2"))], 2),
            2,
            End::NONE,
        )
        .unwrap();
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
        let err = fold(
            &RealFs,
            dir.path(),
            &overlay(&[("new", Some("x"))], 51),
            2,
            End::NONE,
        )
        .unwrap_err();
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
        // A trailer (its checksum right) claiming an absurd count is not
        // believed before the records are read (the store sizes its load
        // by it).
        let mut bad = good.clone();
        let t = good.len() - TRAILER;
        bad[t + 8..t + 16].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
        let crc = crc32fast::hash(&bad[t..t + 20]);
        bad[t + 20..].copy_from_slice(&crc.to_le_bytes());
        std::fs::write(&path, &bad).unwrap();
        let s = Snapshot::open(&RealFs, dir.path()).unwrap().unwrap();
        assert!(s.records() <= good.len() as u64, "{}", s.records());
        assert!(read_all().is_err());
        for cut in [good.len() - 1, good.len() - TRAILER, HEADER + 3, 10] {
            std::fs::write(&path, &good[..cut]).unwrap();
            assert!(read_all().is_err(), "a cut at byte {cut} went unnoticed");
        }
    }

    /// A block of an older snapshot copied over the same place in the
    /// current one — whole records, each passing its own checksum, in ID
    /// order, as many as before — is found, at the first record that did
    /// not follow the one before it in this file.
    #[test]
    fn a_block_of_an_older_snapshot_is_found_where_it_starts() {
        let dir = tempfile::tempdir().unwrap();
        let path = snapshot_of(dir.path(), 300);
        let older = std::fs::read(&path).unwrap();
        // The same records but one, changed in place (same length).
        let changed = overlay(&[("alloc-150", Some("record-2"))], 301);
        fold(&RealFs, dir.path(), &changed, 2, End { len: 99, chain: 7 }).unwrap();
        let current = std::fs::read(&path).unwrap();
        assert_eq!(older.len(), current.len());
        let block = 4096..8192;
        assert!(current.len() > block.end + TRAILER);
        let mut mixed = current.clone();
        mixed[block.clone()].copy_from_slice(&older[block.clone()]);
        std::fs::write(&path, &mixed).unwrap();
        let mut base = Snapshot::open(&RealFs, dir.path()).unwrap().unwrap();
        let err = load(Some(&mut base), &[], |_, _| Ok(())).unwrap_err();
        let err = err.to_string();
        assert!(
            err.contains("does not follow the record before it"),
            "{err}"
        );
        let at: usize = err
            .split("the record at byte ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap();
        assert!(block.contains(&at), "{err}");
        // Its log position is what the checkpoint said.
        std::fs::write(&path, &current).unwrap();
        let s = Snapshot::open(&RealFs, dir.path()).unwrap().unwrap();
        assert_eq!(s.log_end, End { len: 99, chain: 7 });
        assert_eq!((s.folded, s.last_index), (2, 301));
    }

    /// A snapshot whose magic names another format is refused, saying
    /// which format it names and which this build reads; salvage reads
    /// no header from it.
    #[test]
    fn a_snapshot_of_another_format_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = snapshot_of(dir.path(), 3);
        let good = std::fs::read(&path).unwrap();
        for v in [0, 1, 3, 0xff] {
            let mut bytes = good.clone();
            bytes[7] = v;
            std::fs::write(&path, &bytes).unwrap();
            let err = Snapshot::open(&RealFs, dir.path())
                .err()
                .unwrap()
                .to_string();
            assert!(
                err.contains(&format!(
                    "snapshot format {v}, but this taskgate reads format 2 only"
                )),
                "{err}"
            );
            assert_eq!(salvage(&bytes).folded, None, "format {v}");
        }
    }
}
