//! The primitives of the stored form (`store/record.rs`): unsigned LEB128
//! varints, each in its shortest form; zigzag for signed ones; a string as
//! a varint length and UTF-8 bytes; a time as its unix seconds (zigzag),
//! nanoseconds and UTC offset in seconds (zigzag). Shared by the record
//! codec and the packed event histories it keeps (`lifecycle/history.rs`);
//! depends on nothing.

use time::OffsetDateTime;

#[inline]
pub fn put_varint(buf: &mut Vec<u8>, mut n: u64) {
    while n >= 0x80 {
        buf.push(n as u8 | 0x80);
        n >>= 7;
    }
    buf.push(n as u8);
}

#[inline]
pub fn put_zigzag(buf: &mut Vec<u8>, n: i64) {
    put_varint(buf, ((n << 1) ^ (n >> 63)) as u64);
}

#[inline]
pub fn put_str(buf: &mut Vec<u8>, s: &str) {
    put_varint(buf, s.len() as u64);
    buf.extend_from_slice(s.as_bytes());
}

#[inline]
pub fn put_time(buf: &mut Vec<u8>, t: OffsetDateTime) {
    put_zigzag(buf, t.unix_timestamp());
    put_varint(buf, u64::from(t.nanosecond()));
    put_zigzag(buf, i64::from(t.offset().whole_seconds()));
}

/// The time written as `secs`, `nanos`, `offset` (`put_time`).
pub fn time_of(secs: i64, nanos: u32, offset: i32, what: &str) -> Result<OffsetDateTime, String> {
    let offset =
        time::UtcOffset::from_whole_seconds(offset).map_err(|e| format!("bad {what}: {e}"))?;
    // From its date and time where it was given: near either end of the
    // years, a time's instant in UTC can lie past that end.
    let local = secs
        .checked_add(i64::from(offset.whole_seconds()))
        .ok_or_else(|| format!("bad {what}: out of range"))?;
    Ok(OffsetDateTime::from_unix_timestamp(local)
        .and_then(|t| t.replace_nanosecond(nanos))
        .map_err(|e| format!("bad {what}: {e}"))?
        .replace_offset(offset))
}

/// Reads what the `put_` functions wrote; every error names what was
/// being read.
pub struct Reader<'a> {
    pub bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    #[inline]
    pub fn byte(&mut self, what: &str) -> Result<u8, String> {
        let (&b, rest) = self
            .bytes
            .split_first()
            .ok_or_else(|| format!("cut short in {what}"))?;
        self.bytes = rest;
        Ok(b)
    }

    #[inline]
    pub fn varint(&mut self, what: &str) -> Result<u64, String> {
        let mut n = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte(what)?;
            let bits = u64::from(b & 0x7f);
            if shift == 63 && bits > 1 {
                break;
            }
            n |= bits << shift;
            if b & 0x80 == 0 {
                // One way to write each number: no high zero groups.
                if b == 0 && shift > 0 {
                    break;
                }
                return Ok(n);
            }
        }
        Err(format!(
            "{what} is not a 64-bit number in its shortest form"
        ))
    }

    #[inline]
    pub fn zigzag(&mut self, what: &str) -> Result<i64, String> {
        let n = self.varint(what)?;
        Ok((n >> 1) as i64 ^ -((n & 1) as i64))
    }

    /// A count of items each at least `min_bytes` long: never more than
    /// the bytes left could hold, so nothing is sized past them.
    #[inline]
    pub fn count(&mut self, what: &str, min_bytes: usize) -> Result<usize, String> {
        let n = self.varint(what)?;
        if n > (self.bytes.len() / min_bytes) as u64 {
            return Err(format!("{what} ({n}) is more than the record holds"));
        }
        Ok(n as usize)
    }

    #[inline]
    pub fn str(&mut self, what: &str) -> Result<&'a str, String> {
        let len = self.count(what, 1)?;
        let (s, rest) = self.bytes.split_at(len);
        self.bytes = rest;
        std::str::from_utf8(s).map_err(|_| format!("{what} is not UTF-8"))
    }

    pub fn time(&mut self, what: &str) -> Result<OffsetDateTime, String> {
        let (secs, nanos, offset) = self.time_parts(what)?;
        time_of(secs, nanos, offset, what)
    }

    /// A time's seconds, nanoseconds and offset as written (`put_time`).
    #[inline]
    pub fn time_parts(&mut self, what: &str) -> Result<(i64, u32, i32), String> {
        let secs = self.zigzag(what)?;
        let nanos = u32::try_from(self.varint(what)?).map_err(|_| format!("bad {what}"))?;
        let offset = i32::try_from(self.zigzag(what)?).map_err(|_| format!("bad {what}"))?;
        Ok((secs, nanos, offset))
    }
}

/// Damage for the stored form's property tests.
#[cfg(test)]
pub mod damage {
    use proptest::{prelude::*, sample::Index};

    /// Up to `n` edits (exclusive end), each a byte changed, inserted or
    /// removed.
    pub fn edits(n: std::ops::Range<usize>) -> impl Strategy<Value = Vec<(Index, u8, u8)>> {
        prop::collection::vec((any::<Index>(), any::<u8>(), 0..3u8), n)
    }

    /// `bytes` with `edits` applied in order (a removal that would leave
    /// nothing is skipped).
    pub fn apply(bytes: &mut Vec<u8>, edits: Vec<(Index, u8, u8)>) {
        for (at, value, kind) in edits {
            let i = at.index(bytes.len());
            match kind {
                0 => bytes[i] = value,
                1 => bytes.insert(i, value),
                _ if bytes.len() > 1 => {
                    bytes.remove(i);
                }
                _ => {}
            }
        }
    }
}
