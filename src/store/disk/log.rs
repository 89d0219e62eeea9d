//! The disk store's write-ahead log.
//!
//! Every group commit is one append — one frame (`frame.rs`) — and one
//! `fdatasync` to the current segment: sequential, and as cheap with a
//! million allocations as with ten. Sealed segments are folded into the
//! snapshot by a checkpoint (`checkpoint.rs`, `snapshot.rs`); recovery
//! (`recovery.rs`) replays the segments not folded yet over what the
//! snapshot holds.
//!
//! A segment is a file `taskgate.wal.<seq>` (20 decimal digits). It is
//! written under a temporary name with its header, made durable and only
//! then renamed into place, so a segment under its real name is never
//! shorter than its header. This build writes and reads format 3
//! (integers little-endian):
//!
//! ```text
//! segment = header frame*
//! header  = magic "TGWAL\0\0\x03" | seq: u64 | previous_len: u64 | previous_chain: u32
//!         | crc32(the 28 bytes before): u32
//! frame   = len: u32 | crc: u32 | chain: u32 | payload          one per append (frame.rs)
//! payload = change+
//! change  = len: u32 (of what follows) | kind: u8 (1 put, 2 delete) | index: u64
//!         | id_len: u8 | id | record (put only: record.rs, as the snapshot holds it)
//! ```
//!
//! `id` is the allocation's ID, or for a semaphore `~s/<name>` (its record
//! then a semaphore's: `record::encode_semaphore`).
//!
//! `previous_len` and `previous_chain` say where the segment before ended:
//! its length and its last frame's chain (its header's crc32 if it has
//! none) — or, after a checkpoint folded it, what the snapshot says it
//! folded. So every sealed segment's end is vouched for by the next
//! header: frames lost from the end of a sealed segment, even cut exactly
//! at a frame boundary, are found, and a segment of another history does
//! not follow. The first frame's chain starts from the header's crc32,
//! which covers all of this.
//!
//! The requester encodes its change on its own thread; the writer joins
//! the changes of a batch into one frame, so an append is one frame
//! whatever it holds. That is what makes a torn append recognizable:
//!
//! ```text
//!   ... | frame n: acknowledged, whole   | frame n+1: the append a crash cut            |EOF
//!       | head | payload ............... | head | payload ............................ |
//!   sectors lost (in any order):         | head | pay 000000000000000 ad .. 00000000|     a sector reads as zeros
//!   its head's sector lost:              |0000000000000000| payload .............. |
//! ```
//!
//! The file runs ahead of the appends in zeros (`WRITE_AHEAD`): an
//! `fdatasync` into blocks already written writes no inode. Zeros from the
//! end of the last good frame to the end of the file are not a frame
//! (`Replayed::spare`); a sealed segment, and one closed cleanly, is cut at
//! its last frame (`Segment::seal`), and a start cuts what a crash left.
//!
//! An append is acknowledged only after its `fdatasync`, so only the last
//! frame of the newest segment can be unfinished, and the disk may have
//! written any of its sectors and not others, in no promised order (as
//! etcd's WAL assumes); the zeros after it were durable before it was
//! written, so the file never ends inside it. A bad frame is torn when it
//! touches a sector of zeros and nothing acknowledged can follow it (`frame::torn_at` says exactly what that
//! means). Any other bad frame is damage to acknowledged changes, and the
//! store refuses to start (`recovery.rs`).
//!
//! A segment whose magic names another format is refused, as damage is:
//! its header says which format, and the refusal which one this build
//! reads.

use std::{
    collections::HashMap,
    io::{self, Seek, Write},
    path::{Path, PathBuf},
    time::Duration,
};

use super::{
    frame::{self, HEAD, Head},
    fs::{Fs, FsFile, Open},
};

/// Segment files are named this plus their sequence number.
pub const SEGMENT_PREFIX: &str = "taskgate.wal.";
/// Where a segment is written before it is renamed to its real name.
pub const SEGMENT_TEMP: &str = "taskgate.wal.new";
/// Where the bytes cut from a torn tail are kept: the segment's name plus
/// this (and `.1`, `.2`, ... if that name is taken).
pub const BROKEN_SUFFIX: &str = ".broken";
/// A segment's first bytes; the last is its format.
const MAGIC: [u8; 8] = *b"TGWAL\0\0\x03";
const HEADER: usize = 32;
/// A change's bytes before its ID: `len | kind | index | id_len`.
const CHANGE_HEAD: usize = 4 + 1 + 8 + 1;
/// The fewest bytes of the log one change can take (a deletion of a
/// one-byte ID): a stretch of `n` lost bytes held at most `n / MIN_CHANGE`.
pub const MIN_CHANGE: u64 = (CHANGE_HEAD + 1) as u64;
const PUT: u8 = 1;
const DELETE: u8 = 2;

/// The newest change of each allocation since the last checkpoint:
/// `Some(record)` for a put, `None` for a deletion.
#[derive(Clone, Debug, Default)]
pub struct Overlay {
    /// foldhash: a start puts every change of the log here.
    pub changes: HashMap<String, Option<Vec<u8>>, foldhash::fast::RandomState>,
    /// The highest global index among them (deletions included).
    pub last_index: u64,
}

impl Overlay {
    pub fn apply(&mut self, id: String, record: Option<Vec<u8>>, index: u64) {
        self.changes.insert(id, record);
        self.last_index = self.last_index.max(index);
    }
}

/// Where a segment ended: its length and its last frame's chain. A
/// segment's header records its predecessor's; a snapshot records the last
/// segment it folded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct End {
    pub len: u64,
    pub chain: u32,
}

impl End {
    /// Before the first segment of a data directory: nothing.
    pub const NONE: End = End { len: 0, chain: 0 };
}

/// What is wrong when a segment whose header says the segment before it
/// ended at `stated` follows one that ended at `actual`: `None` if
/// nothing.
pub fn mismatch(stated: End, actual: End) -> Option<String> {
    if stated == actual {
        return None;
    }
    Some(if actual.len < stated.len {
        format!(
            "the log before it ends at byte {}, but its header says at byte {}: the \
             appends between are missing (a sealed segment cut short)",
            actual.len, stated.len
        )
    } else if actual.len > stated.len {
        format!(
            "the log before it ends at byte {}, but its header says at byte {}",
            actual.len, stated.len
        )
    } else {
        format!(
            "the log before it ends at byte {} with another append than its header names: \
             they are not of one history",
            actual.len
        )
    })
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

/// Starts an append: a frame's head, to fill once its changes follow
/// (`Segment::append`).
pub fn begin(buf: &mut Vec<u8>) {
    buf.clear();
    buf.extend_from_slice(&[0; HEAD]);
}

/// Appends one change to `buf`.
pub fn change(buf: &mut Vec<u8>, id: &str, index: u64, record: Option<&[u8]>) {
    change_with(buf, id, index, record.is_some(), |buf| {
        if let Some(r) = record {
            buf.extend_from_slice(r);
        }
    });
}

/// Appends a change whose record (for a put) `fill` writes in place, so a
/// record is encoded straight into the bytes the writer appends.
pub fn change_with(
    buf: &mut Vec<u8>,
    id: &str,
    index: u64,
    put: bool,
    fill: impl FnOnce(&mut Vec<u8>),
) {
    let id_len = u8::try_from(id.len()).expect("allocation IDs are at most 128 bytes");
    let start = buf.len();
    buf.extend_from_slice(&[0; 4]);
    buf.push(if put { PUT } else { DELETE });
    buf.extend_from_slice(&index.to_le_bytes());
    buf.push(id_len);
    buf.extend_from_slice(id.as_bytes());
    if put {
        fill(buf);
    }
    let len = u32::try_from(buf.len() - start - 4).expect("a record is far below 4 GiB");
    buf[start..start + 4].copy_from_slice(&len.to_le_bytes());
}

fn header(seq: u64, previous: End) -> [u8; HEADER] {
    let mut header = [0u8; HEADER];
    header[..8].copy_from_slice(&MAGIC);
    header[8..16].copy_from_slice(&seq.to_le_bytes());
    header[16..24].copy_from_slice(&previous.len.to_le_bytes());
    header[24..28].copy_from_slice(&previous.chain.to_le_bytes());
    let crc = crc32fast::hash(&header[..28]);
    header[28..32].copy_from_slice(&crc.to_le_bytes());
    header
}

/// A segment's header, read and checked.
#[derive(Clone, Copy, Debug)]
pub struct Header {
    /// What its first frame's chain follows.
    pub seed: u32,
    /// Where the segment before it ended.
    pub previous: End,
}

/// Reads segment `seq`'s header from its bytes: an error if it is not a
/// segment's, of another format, damaged, or another segment's.
pub fn read_header(bytes: &[u8], seq: u64) -> Result<Header, String> {
    let short = || {
        format!(
            "it is {} bytes long, shorter than a segment header",
            bytes.len()
        )
    };
    if bytes.len() < MAGIC.len() && MAGIC.starts_with(bytes) {
        return Err(short());
    }
    frame::magic(bytes, &MAGIC, "log segment")?;
    if bytes.len() < HEADER {
        return Err(short());
    }
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4"));
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
    let seed = crc32fast::hash(&bytes[..28]);
    if u32_at(28) != seed {
        return Err(
            "its header is damaged: bytes 0 to 27 do not match their checksum (at byte 28)".into(),
        );
    }
    let stated = u64_at(8);
    if stated != seq {
        return Err(format!(
            "its header says segment {stated} (at byte 8), but its name says {seq}"
        ));
    }
    Ok(Header {
        seed,
        previous: End {
            len: u64_at(16),
            chain: u32_at(24),
        },
    })
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
    /// The chain of the last good frame (the header's crc32 before any):
    /// with `valid_len`, where the segment ends.
    pub chain: u32,
    /// Where the segment before it ended, as its header says.
    pub previous: End,
    /// Zeros from the end of the last good frame to the end of the file,
    /// not counted as a bad frame: space written ahead of the appends
    /// (`Segment::append`), or an append none of whose sectors reached the
    /// disk. Only the newest segment may have them (every other was cut
    /// at its last frame when sealed); recovery cuts them off.
    pub spare: u64,
}

impl Replayed {
    /// Where the segment ends, as far as it read back.
    pub fn end(&self) -> End {
        End {
            len: self.valid_len,
            chain: self.chain,
        }
    }
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
    /// The end of the file cuts it short (its head, or the payload its
    /// head states): not what a crash leaves in a segment written ahead
    /// (`Segment::append`).
    pub cut: bool,
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
    let header = read_header(bytes, seq)?;
    let mut pos = HEADER;
    let mut previous = header.seed;
    let mut frames = 0;
    let bad = loop {
        let rest = &bytes[pos..];
        if rest.iter().all(|&b| b == 0) {
            break None;
        }
        let bad = |what: &str| Bad {
            at: pos as u64,
            bytes: rest.len() as u64,
            what: what.into(),
            torn: frame::torn_at(bytes, pos, previous),
            cut: false,
        };
        let Some(h) = rest.get(..HEAD).map(Head::read) else {
            break Some(Bad {
                cut: true,
                ..bad("is cut short in its head")
            });
        };
        if !h.links(previous) {
            break Some(bad(
                "has a damaged head (its length or checksums do not match the frame before)",
            ));
        }
        if h.len > frame::MAX_PAYLOAD {
            break Some(bad("has an impossible length"));
        }
        let Some(payload) = rest.get(HEAD..HEAD + h.len) else {
            break Some(Bad {
                cut: true,
                ..bad("is cut short")
            });
        };
        if !h.fits(payload) {
            break Some(bad("fails its checksum"));
        }
        changes(payload, &mut each)
            .map_err(|e| format!("the append at byte {pos} is damaged: {e}"))?;
        previous = h.chain;
        pos += HEAD + h.len;
        frames += 1;
    };
    Ok(Replayed {
        valid_len: pos as u64,
        frames,
        spare: if bad.is_none() {
            (bytes.len() - pos) as u64
        } else {
            0
        },
        bad,
        chain: previous,
        previous: header.previous,
    })
}

/// Where the append holding byte `at` of a segment (`bytes`) starts.
pub fn append_of(bytes: &[u8], at: u64) -> u64 {
    let mut pos = HEADER;
    while let Some(h) = bytes.get(pos..pos + HEAD).map(Head::read) {
        let end = pos + HEAD + h.len;
        if at < end as u64 || h.len == 0 {
            break;
        }
        pos = end;
    }
    pos as u64
}

/// Hands each change of a frame's payload to `each`.
fn changes<'a>(
    mut payload: &'a [u8],
    mut each: impl FnMut(&'a str, u64, Option<&'a [u8]>),
) -> Result<(), &'static str> {
    if payload.is_empty() {
        return Err("it holds no change");
    }
    while !payload.is_empty() {
        let len = payload.get(..4).ok_or("a change is cut short")?;
        let len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
        let change = payload
            .get(4..4 + len)
            .ok_or("a change runs past its append")?;
        let (id, index, record) = parse(change)?;
        each(id, index, record);
        payload = &payload[4 + len..];
    }
    Ok(())
}

/// One change's fields (without its length): `kind | index | id_len | id
/// | record`.
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

/// One change salvage found, where it lies.
#[derive(Debug)]
pub struct Found<'a> {
    /// The offset of the frame that holds it.
    pub at: u64,
    pub id: &'a str,
    pub index: u64,
    pub record: Option<&'a [u8]>,
}

/// What salvage read of one segment.
#[derive(Debug, Default)]
pub struct Salvaged<'a> {
    /// Every change it can prove, in the order they lie.
    pub changes: Vec<Found<'a>>,
    /// The stretches it could not.
    pub unread: Vec<frame::Unread>,
    /// Where its proven frames end (their length and last chain).
    pub end: End,
    /// Whether the segment ends as `vouched` said.
    pub ends_as_vouched: bool,
    /// Where the segment before it ended, if its header reads back.
    pub previous: Option<End>,
}

/// Every change of segment `seq` that can be proven, however damaged it is
/// (`taskgate dump --salvage`): frames are read as `frame::salvage` reads
/// them (a frame is taken only if its chain links, or if it starts a run
/// of linked frames to the segment's vouched end), to `vouched` (what the
/// next segment's header says of this one's end; `None` for the newest,
/// read to the end of the file). A damaged header is read past as far as
/// can be: its frames are then only taken from a run.
pub fn salvage(bytes: &[u8], seq: u64, vouched: Option<End>) -> Salvaged<'_> {
    let end = match vouched {
        Some(e) => frame::EndsAt::Vouched {
            at: usize::try_from(e.len).unwrap_or(usize::MAX),
            chain: e.chain,
        },
        None => frame::EndsAt::File,
    };
    let mut out = Salvaged::default();
    let seed = match read_header(bytes, seq) {
        Ok(h) => {
            out.previous = Some(h.previous);
            h.seed
        }
        Err(_) => {
            // The header is lost, or of another format: only runs can be
            // taken.
            out.unread.push(frame::Unread {
                from: 0,
                to: HEADER.min(bytes.len()) as u64,
            });
            0
        }
    };
    let read = frame::salvage(bytes, HEADER.min(bytes.len()), seed, end);
    let mut last = End {
        len: HEADER as u64,
        chain: seed,
    };
    for &(at, payload) in &read.frames {
        let mut found = Vec::new();
        let parsed = changes(payload, |id, index, record| {
            found.push((id, index, record));
        });
        let end = (at + HEAD + payload.len()) as u64;
        if parsed.is_err() {
            // Passes its checks but does not parse: lost all the same.
            out.unread.push(frame::Unread {
                from: at as u64,
                to: end,
            });
            continue;
        }
        let h = Head::read(&bytes[at..]);
        last = End {
            len: end,
            chain: h.chain,
        };
        out.changes
            .extend(found.into_iter().map(|(id, index, record)| Found {
                at: at as u64,
                id,
                index,
                record,
            }));
    }
    // Zeros at the end of the file were written ahead of the appends
    // (`Segment::append`), or never written: a stretch that could not be
    // read ends at its last byte that is not zero.
    let len = bytes.len() as u64;
    out.unread
        .extend(read.unread.into_iter().filter_map(|mut u| {
            if u.to == len {
                u.to = u.from + frame::zeros_from(&bytes[u.from as usize..]) as u64;
            }
            (u.to > u.from).then_some(u)
        }));
    out.unread.sort_by_key(|u| u.from);
    out.end = last;
    out.ends_as_vouched = read.ends_as_vouched;
    out
}

/// Where each append of a segment starts (its whole frames, read by
/// their heads alone).
#[cfg(test)]
pub fn frame_starts(bytes: &[u8]) -> Vec<usize> {
    let mut at = HEADER;
    let mut starts = Vec::new();
    while at + HEAD <= bytes.len() {
        starts.push(at);
        at += HEAD + Head::read(&bytes[at..]).len;
    }
    starts
}

/// One append of one change, ready for `Segment::append`.
#[cfg(test)]
pub fn one_append(id: &str, index: u64, record: Option<&[u8]>) -> Vec<u8> {
    let mut buf = Vec::new();
    begin(&mut buf);
    change(&mut buf, id, index, record);
    buf
}

/// Appends to segment `path` what a crash in the middle of appending the
/// changes in `changes` (built by `change`) may leave: after its last
/// frame, its frame's first `keep` bytes (less than all of it, taken back
/// to a sector boundary of the file or to the frame's start), then
/// `zeros` zero bytes; the file no shorter than it was nor than the
/// frame's end (the zeros written ahead of it).
#[cfg(test)]
pub fn append_unfinished(path: &Path, changes: &[u8], keep: usize, zeros: usize) {
    let mut bytes = std::fs::read(path).unwrap();
    let seq = u64::from_le_bytes(bytes[8..16].try_into().unwrap());
    let r = replay_with(&bytes, seq, |_, _, _| {}).unwrap();
    assert!(r.bad.is_none(), "appended after a whole segment");
    let was = bytes.len();
    bytes.truncate(r.valid_len as usize);
    let mut frame = Vec::new();
    begin(&mut frame);
    frame.extend_from_slice(changes);
    frame::seal(&mut frame, r.chain);
    // Into zeros written ahead (durable before the append is written, past
    // its end): whole sectors of it reached the disk, the rest reads as
    // zeros.
    let start = bytes.len();
    let end = (start + keep.min(frame.len() - 1)) / frame::SECTOR * frame::SECTOR;
    bytes.extend_from_slice(&frame[..end.saturating_sub(start)]);
    let len = (bytes.len() + zeros).max(was).max(start + frame.len() + 1);
    bytes.resize(len, 0);
    std::fs::write(path, bytes).unwrap();
}

/// The segment being appended to.
pub struct Segment {
    file: Box<dyn FsFile>,
    pub seq: u64,
    /// Bytes written, header included.
    pub len: u64,
    /// The chain of the last frame written (the header's crc32 before
    /// the first).
    chain: u32,
    /// The file's length: `len` and the zeros written ahead of the appends.
    file_len: u64,
    /// How far ahead (`WRITE_AHEAD` unless set).
    ahead: u64,
}

/// How far ahead of the appends a segment's file is written with zeros.
/// An `fdatasync` of a file that grew must write its inode too, a second
/// I/O waited on per commit; into blocks already written it need not
/// (measured: see BENCHMARKS.md, "The disk path with events, and record
/// format 5"). A segment is created with zeros up to the first multiple
/// of it past its header; the append that reaches the written end writes
/// zeros up to the multiple past the next, in its own `fdatasync`.
///
/// So the file is always longer than its last acknowledged append, by
/// zeros, up to a multiple of it (`written_ahead`): a crash can only tear
/// the append that was writing past that end, and a segment shorter than
/// that was cut by something else (`recovery::scan_log` refuses it).
pub const WRITE_AHEAD: u64 = 1 << 20;

/// How long the writer, writing zeros `ahead`, had made a segment holding
/// an append that ends at `end` (or its header, if it ends there) before
/// writing that append: the least length the newest segment has after a
/// crash, whatever the crash tore.
pub fn written_ahead(end: u64, ahead: u64) -> u64 {
    (end + 1).next_multiple_of(ahead.max(1))
}

/// Zeros to write ahead from.
static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];

impl Segment {
    /// Bytes of an empty segment.
    pub const HEADER_LEN: u64 = HEADER as u64;

    /// Creates segment `seq` in `dir`, following a segment that ended at
    /// `previous`, writing zeros `ahead` of its appends: written under
    /// `SEGMENT_TEMP` with its header and zeros up to `written_ahead`,
    /// made durable, renamed to its name, the directory made durable. A
    /// crash at any point leaves no segment or all of that.
    pub fn create(
        fs: &dyn Fs,
        dir: &Path,
        seq: u64,
        previous: End,
        ahead: u64,
    ) -> io::Result<Self> {
        let temp = dir.join(SEGMENT_TEMP);
        let file = fs.open(&temp, Open::Truncate)?;
        let header = header(seq, previous);
        let ahead = ahead.max(1);
        let mut segment = Self {
            file,
            seq,
            len: Self::HEADER_LEN,
            chain: u32::from_le_bytes(header[28..32].try_into().expect("4 bytes")),
            file_len: Self::HEADER_LEN,
            ahead,
        };
        let to = written_ahead(Self::HEADER_LEN, ahead);
        let written = segment
            .file
            .write_all(&header)
            .and_then(|()| segment.write_zeros(to))
            .and_then(|()| segment.file.sync_all())
            .and_then(|()| segment.file.seek(io::SeekFrom::Start(Self::HEADER_LEN)))
            .map(drop)
            .and_then(|()| fs.rename(&temp, &segment_path(dir, seq)))
            .and_then(|()| fs.sync_dir(dir));
        if let Err(e) = written {
            // Nothing was ever appended to it: a later try creates it anew.
            // Renamed already (the directory's sync failed), it goes too;
            // if it comes back after a crash, a start sees that it is one
            // the writer never used (`recovery::scan_log`).
            let _ = fs.remove_file(&temp);
            let _ = fs.remove_file(&segment_path(dir, seq));
            return Err(e);
        }
        segment.file_len = to;
        Ok(segment)
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
            file_len: len,
            ahead: WRITE_AHEAD,
        })
    }

    /// How far ahead of the appends it writes zeros.
    pub fn ahead(&self) -> u64 {
        self.ahead
    }

    /// Where the segment ends now.
    pub fn end(&self) -> End {
        End {
            len: self.len,
            chain: self.chain,
        }
    }

    /// Appends one frame: `frame` is `begin` followed by the changes
    /// (`change_with`); its head is filled in here, linked to the
    /// segment's last frame, and it is written and made durable.
    pub fn append(&mut self, frame: &mut [u8]) -> io::Result<()> {
        let chain = frame::seal(frame, self.chain);
        let end = self.len + frame.len() as u64;
        if end >= self.file_len {
            // Zeros past this append's end, written ahead and made durable
            // before the append is written into them: the appends after it
            // land in blocks already written, and the file is always
            // longer than any append in it, whole or torn (what recovery
            // holds it to). If they cannot be written (a full disk), the
            // append fails: the file's end is not known.
            let to = written_ahead(end, self.ahead) + self.ahead;
            self.write_zeros(to)?;
            self.file.sync_data()?;
            self.file_len = to;
            self.file.seek(io::SeekFrom::Start(self.len))?;
        }
        self.file.write_all(frame)?;
        self.file.sync_data()?;
        self.len = end;
        self.chain = chain;
        Ok(())
    }

    /// Writes zeros from the end of what was written ahead up to `to`.
    fn write_zeros(&mut self, to: u64) -> io::Result<()> {
        self.file.seek(io::SeekFrom::Start(self.file_len))?;
        let mut left = to - self.file_len;
        while left > 0 {
            let n = left.min(ZEROS.len() as u64) as usize;
            self.file.write_all(&ZEROS[..n])?;
            left -= n as u64;
        }
        Ok(())
    }

    /// Cuts the zeros written ahead off the end, durably, so the segment
    /// ends where its last frame does: before a newer segment is started
    /// (whose header vouches for this one's length) and the checkpoint
    /// reads it.
    pub fn seal(&mut self) -> io::Result<()> {
        if self.file_len > self.len {
            self.file.set_len(self.len)?;
            self.file.sync_all()?;
            self.file_len = self.len;
        }
        Ok(())
    }
}

/// Copies what follows the first `len` bytes of segment `path`, up to
/// its last byte that is not zero, to a file of its own beside it
/// (`BROKEN_SUFFIX`), durably. Returns that file's path. The segment is
/// not changed: it is cut (`cut`) once a newer segment vouches for where
/// it ends.
pub fn keep_aside(fs: &dyn Fs, path: &Path, len: u64) -> io::Result<PathBuf> {
    let bytes = fs.read(path)?;
    let tail = bytes.get(len as usize..).unwrap_or_default();
    // Zeros after the last byte that is not, written ahead of the appends
    // (or never written), hold nothing to keep.
    let tail = &tail[..frame::zeros_from(tail)];
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
    Ok(aside)
}

/// Cuts segment `path` back to its first `len` bytes, durably.
pub fn cut(fs: &dyn Fs, path: &Path, len: u64) -> io::Result<()> {
    let mut file = fs.open(path, Open::Append)?;
    file.set_len(len)?;
    file.sync_all()
}

/// How much of a file `remove_gently` frees at a time, and its pause
/// after each slice.
const SHRINK_STEP: u64 = 16 << 20;
const SHRINK_PAUSE: Duration = Duration::from_millis(5);

/// Removes a file a slice at a time, for the files a checkpoint leaves
/// behind (the replaced snapshot, the folded segments). Freeing blocks is
/// journaled, and on ext4 mounted with `discard` the journal commit that
/// frees them also trims them: a large file unlinked at once holds the
/// log's concurrent `fdatasync`s far longer than one cut back in slices
/// with a pause between (measured: see BENCHMARKS.md;
/// `scripts/remove-stall.py`). A file that has another name is only
/// unlinked: its blocks are not this name's to free (a checkpoint that
/// stopped between linking the replaced snapshot and renaming the new one
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

    type Change<'a> = (&'a str, u64, Option<&'a [u8]>);

    /// Segment `seq` in `dir` holding `changes`, appended in batches of
    /// `per_append` (one frame each); returns its bytes.
    fn segment_in(dir: &Path, seq: u64, changes: &[Change<'_>], per_append: usize) -> Vec<u8> {
        let mut s = Segment::create(&RealFs, dir, seq, End::NONE, WRITE_AHEAD).unwrap();
        for batch in changes.chunks(per_append.max(1)) {
            let mut buf = Vec::new();
            begin(&mut buf);
            for (id, index, record) in batch {
                change(&mut buf, id, *index, *record);
            }
            s.append(&mut buf).unwrap();
        }
        // Zeros written ahead of the appends, cut off by sealing.
        let ahead = std::fs::read(segment_path(dir, seq)).unwrap();
        assert!(ahead.len() as u64 > s.len);
        assert!(ahead[s.len as usize..].iter().all(|&b| b == 0));
        s.seal().unwrap();
        let bytes = std::fs::read(segment_path(dir, seq)).unwrap();
        assert_eq!(bytes.len() as u64, s.len);
        assert_eq!(bytes, ahead[..bytes.len()]);
        bytes
    }

    fn segment(dir: &Path, seq: u64, changes: &[Change<'_>]) -> Vec<u8> {
        segment_in(dir, seq, changes, 1)
    }

    /// `n` puts of records of `size` bytes, `per_append` to an append.
    fn many(dir: &Path, n: u64, size: usize, per_append: usize) -> Vec<u8> {
        let ids: Vec<String> = (0..n).map(|i| format!("alloc-{i}")).collect();
        let record = vec![0x5a; size];
        let changes: Vec<_> = ids
            .iter()
            .zip(1..)
            .map(|(id, i)| (id.as_str(), i, Some(&record[..])))
            .collect();
        segment_in(dir, 1, &changes, per_append)
    }

    #[test]
    fn appends_replay_in_order_and_the_newest_change_wins() {
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
            (bytes.len() as u64, 2, None),
            "two appends"
        );
        // The last frame's chain (one deletion of "b": 15 bytes).
        let last_chain = &bytes[bytes.len() - 15 - 4..][..4];
        assert_eq!(r.chain.to_le_bytes(), last_chain);
        assert_eq!(r.previous, End::NONE);
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
    fn a_header_records_where_the_segment_before_ended() {
        let dir = tempfile::tempdir().unwrap();
        let first = segment(dir.path(), 1, &[("a", 1, Some(b"x"))]);
        let end = replay(&first, 1, &mut Overlay::default()).unwrap().end();
        assert_eq!(end.len, first.len() as u64);
        let second = Segment::create(&RealFs, dir.path(), 2, end, WRITE_AHEAD).unwrap();
        assert_eq!(second.end().len, Segment::HEADER_LEN);
        let bytes = std::fs::read(segment_path(dir.path(), 2)).unwrap();
        let r = replay(&bytes, 2, &mut Overlay::default()).unwrap();
        assert_eq!(r.previous, end);
        // Every byte of the header is checked.
        for at in 0..HEADER {
            let mut bad = bytes.clone();
            bad[at] ^= 0x20;
            assert!(read_header(&bad, 2).is_err(), "byte {at}");
        }
    }

    #[test]
    fn an_unfinished_append_at_every_cut_is_torn_and_keeps_the_appends_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = segment(
            dir.path(),
            1,
            &[("a", 1, Some(b"first")), ("b", 2, Some(b"second"))],
        );
        let first_end = HEADER + HEAD + CHANGE_HEAD + 1 + 5;
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
        let good = many(dir.path(), 12, 40, 3);
        let frames = replay(&good, 1, &mut Overlay::default()).unwrap().frames;
        assert_eq!(frames, 4);
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
    fn zeros_to_the_end_are_torn_or_spare_a_zeroed_block_before_good_appends_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let good = many(dir.path(), 40, 300, 1);
        assert!(good.len() > 3 * 4096);
        // A 4 KiB block zeroed in the middle: appends follow it, whether
        // the block starts in a payload or takes a head with it.
        for from in [4096, frame_starts(&good)[10] / 512 * 512] {
            let mut bad = good.clone();
            bad[from..from + 4096].fill(0);
            let r = replay(&bad, 1, &mut Overlay::default()).unwrap();
            let b = r.bad.unwrap();
            assert!(!b.torn, "zeros from {from}: {b:?}");
            assert!(b.at < from as u64 + 4096, "{b:?}");
        }
        // Zeros from a sector inside the last frame to the end: space the
        // file had been given but the append never filled. From the
        // frame's start: no frame at all, zeros written ahead (spare).
        let r = replay(&good, 1, &mut Overlay::default()).unwrap();
        assert!(r.bad.is_none());
        assert_eq!(r.spare, 0);
        let last = *frame_starts(&good).last().unwrap();
        let inside = (last + HEAD).next_multiple_of(512);
        assert!(inside < good.len());
        let mut bad = good.clone();
        bad[inside..].fill(0);
        let r = replay(&bad, 1, &mut Overlay::default()).unwrap();
        let b = r.bad.unwrap();
        assert!(b.torn, "zeros from {inside}: {b:?}");
        assert_eq!((r.valid_len, r.spare), (last as u64, 0));
        let mut bad = good.clone();
        bad[last..].fill(0);
        let r = replay(&bad, 1, &mut Overlay::default()).unwrap();
        assert!(r.bad.is_none(), "{:?}", r.bad);
        assert_eq!(r.valid_len, last as u64);
        assert_eq!(r.spare, (good.len() - last) as u64);
        // From inside the append before it: that one was acknowledged.
        let mut bad = good.clone();
        bad[last - 1..].fill(0);
        assert!(
            !replay(&bad, 1, &mut Overlay::default())
                .unwrap()
                .bad
                .unwrap()
                .torn
        );
        let mut longer = good.clone();
        longer.resize(good.len() + 8192, 0);
        let r = replay(&longer, 1, &mut Overlay::default()).unwrap();
        assert_eq!((r.frames, r.valid_len), (40, good.len() as u64));
        assert!(r.bad.is_none());
        assert_eq!(r.spare, 8192);
    }

    /// etcd's rule: the last append of the newest segment is torn if any
    /// of its sectors reads as zeros, wherever it lies in it (the disk
    /// wrote a later sector but not that one), its head's included; not if
    /// a whole append follows, nor if it is damaged some other way.
    #[test]
    fn a_last_append_with_any_sector_lost_is_torn() {
        let dir = tempfile::tempdir().unwrap();
        // Ten appends of four ~600-byte changes: each spans several sectors.
        let good = many(dir.path(), 40, 600, 4);
        let frames = frame_starts(&good);
        let last = *frames.last().unwrap();
        assert!(good.len() - last > 4 * 512);
        let sectors = |from: usize, to: usize| {
            (from / 512..to.div_ceil(512))
                .map(|k| k * 512)
                .collect::<Vec<_>>()
        };
        for sector in sectors(last, good.len()) {
            let mut bad = good.clone();
            let end = (sector + 512).min(good.len());
            bad[sector..end].fill(0);
            if bad[..last] != good[..last] {
                continue; // that sector also held the append before
            }
            let r = replay(&bad, 1, &mut Overlay::default()).unwrap();
            let b = r
                .bad
                .unwrap_or_else(|| panic!("sector {sector}: unnoticed"));
            assert!(b.torn, "sector {sector}: {b:?}");
            assert_eq!(r.valid_len, last as u64, "sector {sector}");
        }
        // The same sectors lost in the append before the last: a whole
        // append follows, so it is damage.
        let before = frames[frames.len() - 2];
        for sector in sectors(before + 512, last - 512) {
            let mut bad = good.clone();
            bad[sector..sector + 512].fill(0);
            let r = replay(&bad, 1, &mut Overlay::default()).unwrap();
            assert!(!r.bad.unwrap().torn, "sector {sector}");
        }
        // A flipped byte in the last append, with no sector of zeros.
        let mut bad = good.clone();
        bad[good.len() - 700] ^= 0x01;
        let r = replay(&bad, 1, &mut Overlay::default()).unwrap();
        assert!(!r.bad.unwrap().torn);
    }

    /// Out of order and cut short at once, as `fs::sim` tears appends:
    /// any set of the last append's sectors lost, the file ending anywhere
    /// in it. Always torn (or, all of it zeros, spare), and what was
    /// acknowledged before stays.
    #[test]
    fn any_sectors_of_the_last_append_lost_and_any_cut_is_torn() {
        let dir = tempfile::tempdir().unwrap();
        let good = many(dir.path(), 12, 500, 4);
        let frames = frame_starts(&good);
        let last = *frames.last().unwrap();
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..2000 {
            let cut = rng.usize(last + 1..=good.len());
            let mut bad = good[..cut].to_vec();
            let mut at = last;
            while at < bad.len() {
                let end = (at + 1).next_multiple_of(512).min(bad.len());
                if rng.bool() {
                    bad[at..end].fill(0);
                }
                at = end;
            }
            let r = replay(&bad, 1, &mut Overlay::default()).unwrap();
            if bad == good {
                continue;
            }
            assert_eq!(r.valid_len, last as u64);
            match r.bad {
                Some(b) => assert!(b.torn, "cut at {cut}: {b:?}"),
                // Every byte of it lost: zeros, as if written ahead.
                None => {
                    assert!(bad[last..].iter().all(|&b| b == 0), "cut at {cut}");
                    assert_eq!(r.spare, (bad.len() - last) as u64);
                }
            }
        }
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
        let first = HEAD + CHANGE_HEAD + 2;
        let mut swapped = a[..HEADER].to_vec();
        swapped.extend_from_slice(&a[HEADER + first..]);
        swapped.extend_from_slice(&a[HEADER..HEADER + first]);
        let r = replay(&swapped, 1, &mut Overlay::default()).unwrap();
        assert_eq!(r.frames, 0);
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

    /// A header whose magic names another format is refused, saying which
    /// format it names and which this build reads: by a replay (a start,
    /// a checkpoint), and by salvage, which counts it unread.
    #[test]
    fn a_header_of_another_format_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let good = segment(dir.path(), 1, &[("a", 1, Some(b"x")), ("b", 2, None)]);
        for v in [0, 1, 2, 4, 0xff] {
            let mut bytes = good.clone();
            bytes[7] = v;
            let err = replay(&bytes, 1, &mut Overlay::default()).unwrap_err();
            assert!(
                err.contains(&format!(
                    "log segment format {v}, but this taskgate reads format 3 only"
                )),
                "{err}"
            );
            let s = salvage(&bytes, 1, None);
            assert_eq!(s.previous, None, "format {v}");
            assert_eq!(s.unread[0].from, 0, "format {v}: its header unread");
        }
    }

    #[test]
    fn an_append_that_passes_its_checks_but_does_not_parse_is_damage() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = segment(dir.path(), 1, &[]);
        let seed = read_header(&bytes, 1).unwrap().seed;
        for (what, edit) in [
            (
                "unknown kind",
                Box::new(|b: &mut Vec<u8>| b[HEAD + 4] = 9) as Box<dyn Fn(&mut Vec<u8>)>,
            ),
            (
                "runs past its append",
                Box::new(|b: &mut Vec<u8>| b[HEAD] += 1),
            ),
            (
                "holds no change",
                Box::new(|b: &mut Vec<u8>| b.truncate(HEAD)),
            ),
        ] {
            let mut f = Vec::new();
            begin(&mut f);
            change(&mut f, "a", 1, None);
            edit(&mut f);
            frame::seal(&mut f, seed);
            let mut all = bytes.clone();
            all.extend_from_slice(&f);
            let err = replay(&all, 1, &mut Overlay::default()).unwrap_err();
            assert!(err.contains(what), "{err}");
        }
    }

    #[test]
    fn a_cut_keeps_what_it_cut_beside_the_segment() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = segment(dir.path(), 1, &[("a", 1, Some(b"x")), ("b", 2, Some(b"y"))]);
        let path = segment_path(dir.path(), 1);
        let aside = keep_aside(&RealFs, &path, 30).unwrap();
        assert_eq!(
            aside,
            dir.path().join(format!("{SEGMENT_PREFIX}{:020}.broken", 1))
        );
        assert_eq!(std::fs::read(&aside).unwrap(), &bytes[30..]);
        assert_eq!(std::fs::read(&path).unwrap(), bytes, "kept aside, not cut");
        cut(&RealFs, &path, 30).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), &bytes[..30]);
        // Kept aside again (a start that failed after it): the first copy stays.
        let again = keep_aside(&RealFs, &path, 28).unwrap();
        assert_ne!(again, aside);
        assert_eq!(std::fs::read(&again).unwrap(), &bytes[28..30]);
        assert_eq!(std::fs::read(&aside).unwrap(), &bytes[30..]);
        assert_eq!(
            list_segments(&RealFs, dir.path()).unwrap().len(),
            1,
            "not a segment"
        );
    }

    // ---- zeros written ahead of the appends: what they must not hide ----

    /// A block zeroed in the middle of the newest segment, acknowledged
    /// appends after it: damage, not a tear (the test above), also in the
    /// file as a crash leaves it while appends are written ahead in zeros:
    /// the run of acknowledged frames after the block ends in the zeros,
    /// not at the end of the file, and still counts (else `torn_at` calls
    /// it torn and a start cuts every append after the block).
    #[test]
    fn a_zeroed_block_before_good_appends_is_not_torn_with_zeros_written_ahead() {
        let dir = tempfile::tempdir().unwrap();
        let good = many(dir.path(), 40, 300, 1);
        // From the head of frame 10 (its sector as a lost sector reads,
        // the end of frame 9 kept) over the next 4 KiB.
        let from = frame_starts(&good)[10];
        let to = from.next_multiple_of(512) + 4096;
        let mut bad = good.clone();
        bad[from..to].fill(0);
        let r = replay(&bad, 1, &mut Overlay::default()).unwrap();
        let b = r.bad.unwrap();
        assert_eq!(b.at, from as u64);
        assert!(!b.torn, "sealed length: damage");
        // As a crash leaves the newest segment: zeros written ahead.
        bad.resize(bad.len() + 2048, 0);
        let r = replay(&bad, 1, &mut Overlay::default()).unwrap();
        let b = r.bad.unwrap();
        assert!(
            !b.torn,
            "zeros written ahead after it: {b:?}, {} bytes of acknowledged appends after the block",
            good.len() - to
        );
    }

    /// Salvage of the same: the frames after the zeroed block form a run
    /// that ends where the appends end, not where the file does.
    #[test]
    fn salvage_reads_the_appends_after_a_zeroed_block_with_zeros_written_ahead() {
        let dir = tempfile::tempdir().unwrap();
        let good = many(dir.path(), 40, 300, 1);
        let from = frame_starts(&good)[10];
        let to = from.next_multiple_of(512) + 4096;
        let mut bad = good.clone();
        bad[from..to].fill(0);
        let sealed = salvage(&bad, 1, None).changes.len();
        bad.resize(bad.len() + 2048, 0);
        let ahead = salvage(&bad, 1, None);
        assert_eq!(
            ahead.changes.len(),
            sealed,
            "changes salvaged: sealed length {sealed}, zeros written ahead {}; unread {:?}",
            ahead.changes.len(),
            ahead.unread
        );
    }

    /// A disk that fills up partway through the zeros written ahead (the
    /// first 64 KiB written, the next write ENOSPC): the append goes on,
    /// but the segment's idea of its file's length is its last frame's end
    /// while the file runs 64 KiB further, so sealing cuts nothing: a
    /// sealed segment that does not end at its last frame.
    #[test]
    fn zeros_partly_written_ahead_are_cut_by_seal() {
        use crate::store::fs::sim::{self, SimFs};
        let fs = SimFs::new();
        let dir = Path::new("/d");
        fs.create_dir_all(dir).unwrap();
        let mut s = Segment::create(&fs, dir, 1, End::NONE, 256 * 1024).unwrap();
        let mut writes = 0;
        fs.fail_with(move |op, _: &Path| {
            if op == sim::Op::Write {
                writes += 1;
                if writes == 2 {
                    return Some(io::Error::from_raw_os_error(28));
                }
            }
            None
        });
        let mut f = one_append("a", 1, Some(b"rec"));
        s.append(&mut f).unwrap();
        fs.heal();
        s.seal().unwrap();
        let bytes = fs.contents(&segment_path(dir, 1)).unwrap();
        assert_eq!(
            bytes.len() as u64,
            s.len,
            "sealed, the segment ends at its last frame"
        );
    }
}
