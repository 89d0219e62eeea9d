//! The frame both of the store's files are made of: the log holds one per
//! append (`log.rs`), the snapshot one per record (`snapshot.rs`). This
//! file owns its encoding, the checks that read it back, and the two ways
//! of reading past damage (what counts as a torn append; where salvage
//! may take up again).
//!
//! ```text
//! frame = len: u32 | crc: u32 | chain: u32 | payload (len bytes)       (little-endian)
//!   crc   = crc32(len | payload)
//!   chain = crc32(previous frame's chain | len | crc)
//!           (before a file's first frame: the crc32 its header ends with)
//!
//!   file:  | header (crc h) | len crc chain | payload | len crc chain | payload | ...
//!                    \________________/ \_____________________/
//!                     chain₁ = crc32(h | len₁ crc₁)   chain₂ = crc32(chain₁ | len₂ crc₂)
//! ```
//!
//! `crc` vouches for a frame's bytes, `chain` for its place: every head is
//! tied to all the heads before it and to its file's header, so a frame
//! copied from elsewhere (another file, an older snapshot, another place
//! in the same file) does not read back here, and a damaged payload costs
//! that frame alone (the heads around it still link, which proves where
//! the next one starts). The chain covers the heads only, so it is cheap
//! to recompute when a checkpoint copies a record into a new snapshot.

/// Bytes of a frame's head.
pub const HEAD: usize = 12;
/// No record comes near this; a larger length is damage, not a frame.
pub const MAX_PAYLOAD: usize = 1 << 30;
/// The unit a disk writes whole or not at all, in the file's own offsets.
pub const SECTOR: usize = 512;

/// A stretch of a file that could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unread {
    pub from: u64,
    pub to: u64,
}

/// Checks the first bytes of a `what` (a log segment, a snapshot) against
/// `magic`, whose last byte is the only format this build reads: an error
/// naming the format they name if it is another, or saying that they are
/// not a `what`'s.
pub fn magic(bytes: &[u8], magic: &[u8; 8], what: &str) -> Result<(), String> {
    let (name, format) = magic.split_at(magic.len() - 1);
    match bytes.get(..magic.len()) {
        Some(m) if m == magic => Ok(()),
        Some(m) if m.starts_with(name) => Err(format!(
            "its header says {what} format {}, but this taskgate reads format {} only (the \
             format is byte {})",
            m[name.len()],
            format[0],
            name.len()
        )),
        _ => Err(format!(
            "it does not start like a taskgate {what} (bytes 0 to {})",
            magic.len() - 1
        )),
    }
}

/// crc32 of `a` followed by `b`.
pub fn crc_of(a: &[u8], b: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(a);
    h.update(b);
    h.finalize()
}

/// The chain value of a head (`len | crc`) that follows `previous`.
pub fn chain(previous: u32, len_crc: &[u8]) -> u32 {
    crc_of(&previous.to_le_bytes(), len_crc)
}

/// Writes the head of `frame` (`HEAD` bytes, then the payload) to follow
/// `previous`; returns its chain.
pub fn seal(frame: &mut [u8], previous: u32) -> u32 {
    let len = u32::try_from(frame.len() - HEAD).expect("a frame is far below 4 GiB");
    frame[..4].copy_from_slice(&len.to_le_bytes());
    let crc = crc_of(&frame[..4], &frame[HEAD..]);
    frame[4..8].copy_from_slice(&crc.to_le_bytes());
    relink(frame, previous)
}

/// Rewrites the chain of a frame whose length and checksum are written
/// (a record copied from another file) to follow `previous`; returns it.
pub fn relink(frame: &mut [u8], previous: u32) -> u32 {
    let linked = chain(previous, &frame[..8]);
    frame[8..HEAD].copy_from_slice(&linked.to_le_bytes());
    linked
}

/// A frame's head as it reads.
#[derive(Clone, Copy, Debug)]
pub struct Head {
    pub len: usize,
    pub crc: u32,
    pub chain: u32,
}

impl Head {
    /// The head at the start of `bytes` (at least `HEAD` of them).
    pub fn read(bytes: &[u8]) -> Self {
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4"));
        Self {
            len: u32_at(0) as usize,
            crc: u32_at(4),
            chain: u32_at(8),
        }
    }

    /// Whether it follows a frame whose chain is `previous`.
    pub fn links(&self, previous: u32) -> bool {
        let mut len_crc = [0; 8];
        len_crc[..4].copy_from_slice(&(self.len as u32).to_le_bytes());
        len_crc[4..].copy_from_slice(&self.crc.to_le_bytes());
        chain(previous, &len_crc) == self.chain
    }

    /// Whether `payload` is the one it vouches for.
    pub fn fits(&self, payload: &[u8]) -> bool {
        payload.len() == self.len && crc_of(&(self.len as u32).to_le_bytes(), payload) == self.crc
    }
}

/// The head at `at` in `bytes`, if the file holds all of it.
fn head_at(bytes: &[u8], at: usize) -> Option<Head> {
    bytes.get(at..at.checked_add(HEAD)?).map(Head::read)
}

/// Where a frame at `at` with head `h` ends, if its length is possible.
fn end_of(at: usize, h: &Head) -> Option<usize> {
    (h.len <= MAX_PAYLOAD).then(|| at + HEAD + h.len)
}

/// Whether a sector of the file that meets `from..to` reads as zeros
/// from the frame starting at `start` on: all of it, or its part after
/// `start` (the first sector of an append also holds the end of the
/// append before it, which is as the last sync left it), up to the end of
/// the file. A sector the disk never wrote reads so; a written frame
/// rarely holds an aligned sector of zeros.
pub fn lost_sector(bytes: &[u8], start: usize, from: usize, to: usize) -> bool {
    let to = to.min(bytes.len());
    let mut sector = from / SECTOR * SECTOR;
    while sector < to {
        let chunk = &bytes[sector.max(start)..(sector + SECTOR).min(bytes.len())];
        if !chunk.is_empty() && chunk.iter().all(|&b| b == 0) {
            return true;
        }
        sector += SECTOR;
    }
    false
}

/// How a file's frames must end for a run of them to be believed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndsAt {
    /// Exactly at this offset, with this chain: what the next log
    /// segment's header, or the snapshot's trailer, says.
    Vouched { at: usize, chain: u32 },
    /// At the end of the file, where its last frame may be cut short (the
    /// newest log segment, whose last append a crash may have cut), or at
    /// a frame boundary followed only by zeros (written ahead of the
    /// appends, `log::Segment::append`).
    File,
}

impl EndsAt {
    fn limit(self, bytes: &[u8]) -> usize {
        match self {
            EndsAt::Vouched { at, .. } => at.min(bytes.len()),
            EndsAt::File => bytes.len(),
        }
    }
}

/// Where the zeros at the end of `bytes` start (its length if it does not
/// end in one).
pub fn zeros_from(bytes: &[u8]) -> usize {
    bytes.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1)
}

/// Whether the frames from `at` on link, each to the one before, and end
/// as `end` says, the first passing its checksum (nothing before vouches
/// for it). Looks at heads only past the first: O(frames).
fn run_from(bytes: &[u8], at: usize, end: EndsAt) -> bool {
    run_from_with(bytes, at, end, zeros_from(bytes))
}

/// `run_from`, where the zeros at the end of the file start at `zeros`.
fn run_from_with(bytes: &[u8], at: usize, end: EndsAt, zeros: usize) -> bool {
    let limit = end.limit(bytes);
    let Some(first) = head_at(bytes, at) else {
        return false;
    };
    let Some(mut pos) = end_of(at, &first).filter(|&e| e <= limit) else {
        return false;
    };
    if !first.fits(&bytes[at + HEAD..pos]) {
        return false;
    }
    let mut previous = first.chain;
    loop {
        if pos == limit {
            return match end {
                EndsAt::Vouched { at, chain } => pos == at && previous == chain,
                EndsAt::File => true,
            };
        }
        let Some(h) = head_at(bytes, pos).filter(|h| h.links(previous)) else {
            // A head cut short at the end of the file, or zeros written
            // ahead from here to it.
            return end == EndsAt::File && (pos + HEAD > limit || pos >= zeros);
        };
        match end_of(pos, &h) {
            Some(e) if e <= limit => pos = e,
            // Cut short by the end of the file: what a torn append leaves.
            _ => return end == EndsAt::File,
        }
        previous = h.chain;
    }
}

/// The first offset in `from..` at which a run of frames starts that ends
/// as `end` says (`run_from`).
fn find_run(bytes: &[u8], from: usize, end: EndsAt) -> Option<usize> {
    let limit = end.limit(bytes);
    // No frame starts in the zeros at the end of the file (a frame's
    // payload holds bytes that are not zero).
    let zeros = zeros_from(bytes);
    let mut last = limit.saturating_sub(HEAD - 1);
    if end == EndsAt::File {
        last = last.min(zeros);
    }
    (from..last).find(|&q| {
        // Cheap checks first: most offsets fail on the length alone.
        let Some(h) = head_at(bytes, q) else {
            return false;
        };
        let Some(e) = end_of(q, &h).filter(|&e| e <= limit) else {
            return false;
        };
        let next_links = e == limit
            || head_at(bytes, e).is_some_and(|n| n.links(h.chain))
            || (end == EndsAt::File && e >= zeros);
        next_links && run_from_with(bytes, q, end, zeros)
    })
}

/// Whether a bad frame at `at` in the newest log segment is an append a
/// crash cut (a torn tail), or damage to what was acknowledged. An append
/// is acknowledged only after its `fdatasync`, so only the last one can be
/// unfinished, and it is one frame: its sectors reach the disk whole or
/// not at all and in no promised order (as etcd's WAL assumes), and the
/// file's length may stop anywhere inside it. So it is torn if:
///
/// - it is cut short by the end of the file (its head, or its payload
///   after a head that links); or
/// - its head links, its payload fails its checksum, a sector after its
///   head reads as zeros (`lost_sector`), and nothing but zeros follows
///   it; or
/// - its head does not link, a sector it lies in reads as zeros, and no run of
///   linked frames starts after it and reaches the end of the file, or the
///   zeros written ahead before it (acknowledged frames after it would: a
///   zeroed block in the middle of the log is damage, not a tear).
///
/// `previous` is the chain of the frame before it.
pub fn torn_at(bytes: &[u8], at: usize, previous: u32) -> bool {
    let Some(h) = head_at(bytes, at) else {
        return true;
    };
    if h.links(previous) {
        // The head reads whole, so the sectors it lies in were written:
        // only the sectors after them can have been lost.
        let payload = (at + HEAD).next_multiple_of(SECTOR);
        return match end_of(at, &h) {
            Some(end) if end > bytes.len() => true,
            // Zeros after it hold nothing: space the file was given for
            // the append.
            Some(end) => {
                lost_sector(bytes, at, payload, end) && bytes[end..].iter().all(|&b| b == 0)
            }
            None => false,
        };
    }
    lost_sector(bytes, at, at, at + HEAD) && find_run(bytes, at + 1, EndsAt::File).is_none()
}

/// What salvage can prove of a file's frames.
#[derive(Debug, Default)]
pub struct Salvaged<'a> {
    /// Every frame whose head links to the file's chain and whose payload
    /// passes its checksum: its offset and payload.
    pub frames: Vec<(usize, &'a [u8])>,
    /// The stretches whose frames could not be taken.
    pub unread: Vec<Unread>,
    /// Whether the frames end as `end` said (a vouched end: exactly there,
    /// with that chain).
    pub ends_as_vouched: bool,
}

/// Reads the frames of `bytes` from `at` (right after the header whose
/// crc is `seed`) as far as they can be proven:
///
/// - a frame whose head links is where it says, so when only its payload
///   is damaged, that frame alone is lost and the next is read;
/// - a frame whose head does not link, but whose stated end is where the
///   next head links to its stated chain (or the vouched end is), is
///   where it says: lost alone too if it fails its checksum (its length
///   or checksum was damaged), taken if it passes (only what it follows
///   was unknown: a damaged header);
/// - otherwise the chain is broken there: reading takes up again at the
///   first later offset from which frames link to the file's vouched end
///   (`EndsAt`), and never inside the stated extent of the frame it stopped
///   at. A frame inside another's payload (an agent may write one in an
///   event message) links neither to its surroundings nor to the end.
///   The one way left for one: its container is the newest segment's last
///   frame, the container's own length is what was damaged (so its extent
///   is unknown), and the frame's bytes end exactly where the file does,
///   its payload decoding as a change whose record decodes too.
pub fn salvage(bytes: &[u8], at: usize, seed: u32, end: EndsAt) -> Salvaged<'_> {
    let limit = end.limit(bytes);
    let mut out = Salvaged::default();
    let lost = |out: &mut Salvaged<'_>, from: usize, to: usize| {
        if from < to {
            match out.unread.last_mut() {
                Some(u) if u.to == from as u64 => u.to = to as u64,
                _ => out.unread.push(Unread {
                    from: from as u64,
                    to: to as u64,
                }),
            }
        }
    };
    let (mut pos, mut previous) = (at, seed);
    while pos < limit {
        let Some(h) = head_at(bytes, pos).filter(|_| pos + HEAD <= limit) else {
            lost(&mut out, pos, limit);
            pos = limit;
            break;
        };
        let stated = end_of(pos, &h).filter(|&e| e <= limit);
        let vouched_by_next = |e: usize| {
            (e == limit
                && end
                    == EndsAt::Vouched {
                        at: e,
                        chain: h.chain,
                    })
                || head_at(bytes, e).is_some_and(|n| e + HEAD <= limit && n.links(h.chain))
        };
        match stated {
            Some(e) if h.links(previous) => {
                if h.fits(&bytes[pos + HEAD..e]) {
                    out.frames.push((pos, &bytes[pos + HEAD..e]));
                } else {
                    lost(&mut out, pos, e);
                }
                (pos, previous) = (e, h.chain);
            }
            // Linked, but running past the end: cut short.
            None if h.links(previous) => {
                lost(&mut out, pos, limit);
                pos = limit;
            }
            // The next head links to this one's chain: it is where it
            // says. Either its length or checksum was damaged (it is lost
            // alone), or only what it follows is unknown (a damaged
            // header): then it passes its checksum, and is taken.
            Some(e) if vouched_by_next(e) => {
                if h.fits(&bytes[pos + HEAD..e]) {
                    out.frames.push((pos, &bytes[pos + HEAD..e]));
                } else {
                    lost(&mut out, pos, e);
                }
                (pos, previous) = (e, h.chain);
            }
            _ => {
                // The frame here may itself start a run (it is at a
                // boundary; only what came before it is unknown); else
                // the first after its stated extent that does.
                let from = stated.unwrap_or(pos + 1).max(pos + 1);
                let found = if run_from(bytes, pos, end) {
                    Some(pos)
                } else {
                    find_run(bytes, from, end)
                };
                match found {
                    Some(q) => {
                        lost(&mut out, pos, q);
                        // The run vouches for its first frame, which
                        // passed its checksum.
                        let first = head_at(bytes, q).expect("a run starts with a head");
                        let e = q + HEAD + first.len;
                        out.frames.push((q, &bytes[q + HEAD..e]));
                        (pos, previous) = (e, first.chain);
                    }
                    None => {
                        lost(&mut out, pos, limit);
                        pos = limit;
                    }
                }
            }
        }
    }
    out.ends_as_vouched = match end {
        EndsAt::Vouched { at, chain } => pos == at && previous == chain && bytes.len() == at,
        EndsAt::File => true,
    };
    if limit < bytes.len() {
        lost(&mut out, limit, bytes.len());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEED: u32 = 0x5eed;

    /// A file of a 4-byte header and frames with these payloads.
    fn file(payloads: &[&[u8]]) -> (Vec<u8>, u32) {
        let mut bytes = b"HEAD".to_vec();
        let mut previous = SEED;
        for p in payloads {
            let mut f = vec![0; HEAD];
            f.extend_from_slice(p);
            previous = seal(&mut f, previous);
            bytes.extend_from_slice(&f);
        }
        (bytes, previous)
    }

    fn taken<'a>(s: &Salvaged<'a>) -> Vec<&'a [u8]> {
        s.frames.iter().map(|&(_, p)| p).collect()
    }

    #[test]
    fn a_frame_links_to_the_one_before_and_fits_its_payload() {
        let (bytes, last) = file(&[b"one", b"two"]);
        let first = Head::read(&bytes[4..]);
        assert!(first.links(SEED) && !first.links(SEED ^ 1));
        assert!(first.fits(b"one") && !first.fits(b"onE") && !first.fits(b"on"));
        let second = Head::read(&bytes[4 + HEAD + 3..]);
        assert!(second.links(first.chain) && second.chain == last);
        // A copy keeps its length and checksum, and links anew.
        let mut copy = bytes[4..4 + HEAD + 3].to_vec();
        let chain = relink(&mut copy, 77);
        assert!(Head::read(&copy).links(77) && Head::read(&copy).chain == chain);
    }

    #[test]
    fn salvage_reads_every_whole_file_to_its_vouched_end() {
        let (bytes, last) = file(&[b"one", b"two", b"three"]);
        let end = EndsAt::Vouched {
            at: bytes.len(),
            chain: last,
        };
        let s = salvage(&bytes, 4, SEED, end);
        assert_eq!(taken(&s), [&b"one"[..], b"two", b"three"]);
        assert!(s.unread.is_empty() && s.ends_as_vouched);
        // Cut at a frame boundary: every frame left is proven, but the end
        // is not the one vouched for.
        let cut = bytes.len() - HEAD - 5;
        let s = salvage(&bytes[..cut], 4, SEED, end);
        assert_eq!(taken(&s), [&b"one"[..], b"two"]);
        assert!(!s.ends_as_vouched);
        // Another end vouched for.
        let other = EndsAt::Vouched {
            at: bytes.len(),
            chain: last ^ 1,
        };
        assert!(!salvage(&bytes, 4, SEED, other).ends_as_vouched);
    }

    #[test]
    fn a_damaged_payload_or_checksum_loses_its_frame_alone() {
        let (good, last) = file(&[b"first", b"second", b"third"]);
        let end = EndsAt::Vouched {
            at: good.len(),
            chain: last,
        };
        let second = 4 + HEAD + 5;
        // A byte of the payload, then a byte of the crc field: the heads
        // around it still prove where the next frame starts.
        for at in [second + HEAD + 2, second + 5] {
            let mut bad = good.clone();
            bad[at] ^= 0x08;
            let s = salvage(&bad, 4, SEED, end);
            assert_eq!(taken(&s), [&b"first"[..], b"third"], "byte {at}");
            let lost = Unread {
                from: second as u64,
                to: (second + HEAD + 6) as u64,
            };
            assert_eq!(s.unread, [lost], "byte {at}");
            assert!(s.ends_as_vouched);
        }
    }

    #[test]
    fn past_a_broken_chain_only_a_run_to_the_vouched_end_is_taken() {
        let payloads: Vec<Vec<u8>> = (0..6u8).map(|i| vec![i + 1; 20]).collect();
        let refs: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
        let (good, last) = file(&refs);
        let end = EndsAt::Vouched {
            at: good.len(),
            chain: last,
        };
        let size = HEAD + 20;
        // The third frame's chain field damaged: nothing links to it.
        let mut bad = good.clone();
        bad[4 + 2 * size + 9] ^= 0x40;
        let s = salvage(&bad, 4, SEED, end);
        assert_eq!(taken(&s), [refs[0], refs[1], refs[3], refs[4], refs[5]]);
        assert_eq!(s.unread.len(), 1);
        assert_eq!(s.unread[0].from, (4 + 2 * size) as u64);
        assert_eq!(s.unread[0].to, (4 + 3 * size) as u64);
        assert!(s.ends_as_vouched);
        // Vouched for another end, the run does not count: all lost.
        let elsewhere = EndsAt::Vouched {
            at: good.len(),
            chain: last ^ 1,
        };
        let s = salvage(&bad, 4, SEED, elsewhere);
        assert_eq!(taken(&s), [refs[0], refs[1]]);
    }

    /// An agent's event message is part of a record, so it can hold bytes
    /// that read as a frame (with its checksum right). With the chain
    /// broken before it, such a frame is not taken: it does not start a
    /// run to the file's end, and it lies inside the damaged frame's
    /// stated extent.
    #[test]
    fn a_frame_inside_another_frames_payload_is_never_taken() {
        let mut fake = vec![0; HEAD];
        fake.extend_from_slice(b"DELETE someone else's allocation");
        seal(&mut fake, 12345);
        let mut message = b"an innocent event: ".to_vec();
        message.extend_from_slice(&fake);
        message.extend_from_slice(b" (the rest of the record)");
        for payloads in [
            vec![&b"before"[..], &message, b"after"],
            // The last frame of the file: nothing vouches for what follows.
            vec![&b"before"[..], &message],
        ] {
            let (good, last) = file(&payloads);
            let at = 4 + HEAD + 6;
            // Its length, its checksum, its chain.
            for field in [0, 1, 4, 9] {
                let mut bad = good.clone();
                bad[at + field] ^= 0x10;
                for end in [
                    EndsAt::File,
                    EndsAt::Vouched {
                        at: good.len(),
                        chain: last,
                    },
                ] {
                    let s = salvage(&bad, 4, SEED, end);
                    assert!(
                        !taken(&s).iter().any(|p| p.starts_with(b"DELETE")),
                        "{field} {end:?}: {:?}",
                        s.frames
                    );
                }
            }
        }
    }
}
