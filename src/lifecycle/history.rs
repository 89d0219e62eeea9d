//! A task's event history (`Events`), and its stored form.
//!
//! A store's start reads every history of every allocation: at a million
//! allocations with full histories, fifty million events naming four
//! million distinct bodies, and finding each body in the process's table
//! (`intern.rs`) was two thirds of the start (BENCHMARKS.md, "Restart
//! time"). So a history read from a store is kept as it was stored,
//! checked but not made into events (`Repr::Packed`), until something
//! asks for its events: a view made from it decodes it (and drops what it
//! decoded), a report to its task makes a new history of events, and a
//! record written from it copies the bytes as they are.
//!
//! The stored form of one history (`store/record.rs` embeds it in a task):
//!
//! ```text
//! history = count: varint | event*
//! event   = 0 | type: str | message: str | details: varint | (key: str | value: str)*
//!             | time                           (a body not written before)
//!         | number: varint | time              (1 ≤ number ≤ bodies written so far)
//! ```
//!
//! Bodies are numbered from 1 in the order the history writes them, and
//! no body is written twice: a history has one encoding, so two stored
//! histories are the same events exactly when their bytes are equal.

use std::{borrow::Cow, sync::Arc};

use super::{Event, EventBody, MAX_EVENTS, Timestamp};
use crate::wire::{Reader, put_str, put_time, put_varint, put_zigzag, time_of};

/// A task's most recent events, oldest first, at most `MAX_EVENTS` (a
/// stored one is kept as stored, even past it).
///
/// Shared between the versions of a record: every report makes a new
/// version of its allocation, and copying each task's history into it
/// would copy and free every event of every task (measured: see
/// BENCHMARKS.md, "Event histories, interned"). Here a version copies one
/// pointer per task, and adding an event copies the history's events (a
/// body pointer and a time each), never a string. Empty histories hold no
/// heap block at all.
#[derive(Clone, Default)]
pub struct Events(Repr);

#[derive(Clone, Default)]
enum Repr {
    #[default]
    Empty,
    /// Events made in this process.
    Made(Arc<[Event]>),
    /// A history as a store holds it (`Events::write`), checked when read
    /// (`Events::read`); never empty.
    Stored(Arc<[u8]>),
}

impl Events {
    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::Empty => 0,
            Repr::Made(e) => e.len(),
            Repr::Stored(bytes) => Reader { bytes }
                .varint("")
                .expect("a history checked when read") as usize,
        }
    }

    pub fn is_empty(&self) -> bool {
        matches!(self.0, Repr::Empty)
    }

    /// The events, oldest first: borrowed if made here, decoded (and
    /// dropped with the answer) if kept as stored.
    pub fn all(&self) -> Cow<'_, [Event]> {
        match &self.0 {
            Repr::Empty => Cow::Borrowed(&[]),
            Repr::Made(e) => Cow::Borrowed(e),
            Repr::Stored(bytes) => {
                let mut events = Vec::new();
                read(&mut Reader { bytes }, Some(&mut events))
                    .expect("a history checked when read");
                Cow::Owned(events)
            }
        }
    }

    pub fn last(&self) -> Option<Event> {
        self.all().last().cloned()
    }

    /// The newest event of this type.
    pub fn last_of(&self, kind: &str) -> Option<Event> {
        self.all().iter().rev().find(|e| e.kind == kind).cloned()
    }

    /// The same history by its pointer, or by its stored bytes: true
    /// means the same events, false says nothing.
    fn same(&self, other: &Events) -> bool {
        match (&self.0, &other.0) {
            (Repr::Empty, Repr::Empty) => true,
            (Repr::Made(a), Repr::Made(b)) => Arc::ptr_eq(a, b),
            (Repr::Stored(a), Repr::Stored(b)) => Arc::ptr_eq(a, b) || a == b,
            _ => false,
        }
    }

    /// The events of this history that `prev`, an earlier version of it,
    /// did not have, oldest first: what follows the longest end of `prev`
    /// this history starts with. Versions a process made share their
    /// events (a pointer compare), versions read from a store compare by
    /// their bytes; else by value.
    pub fn added_since(&self, prev: &Events) -> Vec<Event> {
        // The same history (a task the change did not touch): nothing,
        // without comparing its events one by one.
        if self.same(prev) {
            return Vec::new();
        }
        let (now, before) = (self.all(), prev.all());
        let kept = (0..=before.len().min(now.len()))
            .rev()
            .find(|&k| before[before.len() - k..] == now[..k])
            .unwrap_or(0);
        now[kept..].to_vec()
    }

    /// Appends an event, dropping the oldest beyond `MAX_EVENTS`.
    pub fn push(&mut self, event: Event) {
        let old = self.all();
        let keep = old.len().min(MAX_EVENTS - 1);
        let next: Arc<[Event]> = old[old.len() - keep..]
            .iter()
            .cloned()
            .chain([event])
            .collect();
        self.0 = Repr::Made(next);
    }

    /// Appends the stored form of this history to `buf`: the bytes it
    /// was read from, if it was.
    pub fn write(&self, buf: &mut Vec<u8>) {
        let events = match &self.0 {
            Repr::Empty => &[][..],
            Repr::Made(events) => events,
            Repr::Stored(bytes) => return buf.extend_from_slice(bytes),
        };
        put_varint(buf, events.len() as u64);
        let mut bodies = Bodies::default();
        // The text-only bodies of events whose body holds their time, kept
        // alive while their pointers are the numbers' keys.
        let mut held = Vec::new();
        for event in events {
            let text = if event.utc_nanos().is_some() {
                event.body()
            } else {
                held.push(event.text_body());
                &held[held.len() - 1]
            };
            match bodies.number(text) {
                Some(n) => put_varint(buf, n),
                None => {
                    buf.push(0);
                    put_str(buf, &event.kind);
                    put_str(buf, &event.message);
                    put_varint(buf, event.details.len() as u64);
                    for (key, value) in event.details.iter() {
                        put_str(buf, key);
                        put_str(buf, value);
                    }
                }
            }
            // `put_time(buf, event.time())`, the same bytes; for a time
            // held as UTC nanoseconds (nearly all), without building the
            // date.
            match event.utc_nanos() {
                Some(nanos) => {
                    put_zigzag(buf, nanos.div_euclid(1_000_000_000));
                    put_varint(buf, nanos.rem_euclid(1_000_000_000) as u64);
                    put_zigzag(buf, 0);
                }
                None => put_time(buf, event.time()),
            }
        }
    }

    /// Reads a stored history from `r` and checks all of it, as making
    /// its events would, without making them: an error here is the only
    /// one its events can have.
    pub fn read(r: &mut Reader<'_>) -> Result<Events, String> {
        let start = r.bytes;
        read(r, None)?;
        let bytes = &start[..start.len() - r.bytes.len()];
        Ok(if bytes == [0] {
            Events::default()
        } else {
            Events(Repr::Stored(Arc::from(bytes)))
        })
    }

    /// `read`, with the events made now.
    #[cfg(test)]
    pub fn read_made(r: &mut Reader<'_>) -> Result<Events, String> {
        let mut events = Vec::new();
        read(r, Some(&mut events))?;
        Ok(events.into_iter().collect())
    }

    /// The events, if made in this process.
    #[cfg(test)]
    pub fn made(&self) -> Option<&Arc<[Event]>> {
        match &self.0 {
            Repr::Made(e) => Some(e),
            _ => None,
        }
    }

    /// Whether the events are kept as stored (not made yet).
    #[cfg(test)]
    pub fn is_stored(&self) -> bool {
        matches!(self.0, Repr::Stored(_))
    }
}

/// Reads a stored history: into `made` if given (the bytes were checked
/// before: a body written twice is not looked for), else checked only.
fn read<'a>(r: &mut Reader<'a>, mut made: Option<&mut Vec<Event>>) -> Result<(), String> {
    // An event takes at least 4 bytes: a body's number and a time.
    let n = r.count("the event count", 4)?;
    if let Some(made) = made.as_deref_mut() {
        made.reserve_exact(n);
    }
    // The bodies written so far: made, or (when checking) their bytes.
    let mut bodies: Vec<Arc<EventBody>> = Vec::new();
    let mut written = Written::default();
    // One event's details, reused from event to event.
    let mut details: Vec<(&str, &str)> = Vec::new();
    for _ in 0..n {
        let number = r.varint("an event body")?;
        let body = if number == 0 {
            let start = r.bytes;
            let kind = r.str("an event type")?;
            let message = r.str("an event message")?;
            let n_details = r.count("the details count", 2)?;
            details.clear();
            for _ in 0..n_details {
                let key = r.str("a details key")?;
                let value = r.str("a details value")?;
                if details.last().is_some_and(|(last, _)| *last >= key) {
                    return Err(format!("details key {key:?} out of order"));
                }
                details.push((key, value));
            }
            if made.is_some() {
                bodies.push(EventBody::of_text(kind, message, &details));
                bodies.last()
            } else {
                written.add(&start[..start.len() - r.bytes.len()])?;
                None
            }
        } else {
            let defined = if made.is_some() {
                bodies.len()
            } else {
                written.len()
            };
            let i = usize::try_from(number - 1)
                .ok()
                .filter(|&i| i < defined)
                .ok_or_else(|| format!("event body {number} of the {defined} written before it"))?;
            bodies.get(i)
        };
        let at = At::read(r)?;
        if let (Some(made), Some(body)) = (made.as_deref_mut(), body) {
            made.push(at.event(body.clone()));
        }
    }
    Ok(())
}

/// An event's time as read: UTC nanoseconds since 1970 (nearly every
/// one), without the date arithmetic of a `Timestamp` (a store's start
/// reads fifty million of them at a million allocations), or as given.
enum At {
    Utc(i64),
    Given(Timestamp),
}

impl At {
    fn read(r: &mut Reader<'_>) -> Result<At, String> {
        let (secs, nanos, offset) = r.time_parts("an event time")?;
        let utc = (offset == 0 && nanos < 1_000_000_000)
            .then(|| {
                secs.checked_mul(1_000_000_000)?
                    .checked_add(i64::from(nanos))
            })
            .flatten();
        match utc {
            Some(at) if at != Event::IN_BODY => Ok(At::Utc(at)),
            _ => time_of(secs, nanos, offset, "an event time").map(At::Given),
        }
    }

    fn event(self, body: Arc<EventBody>) -> Event {
        match self {
            At::Utc(at) => Event::at_utc_nanos(body, at),
            At::Given(t) => Event::with_body(body, t),
        }
    }
}

/// The bodies a history being checked has written, as their bytes (one
/// encoding each: two bodies say the same exactly when their bytes are
/// equal), to refuse one written twice.
#[derive(Default)]
struct Written<'a> {
    bodies: Vec<&'a [u8]>,
    /// Past `SCAN` bodies, all of them.
    set: Option<foldhash::HashSet<&'a [u8]>>,
}

impl<'a> Written<'a> {
    fn len(&self) -> usize {
        self.bodies.len()
    }

    fn add(&mut self, body: &'a [u8]) -> Result<(), String> {
        let seen = match &mut self.set {
            Some(set) => !set.insert(body),
            None => self.bodies.contains(&body),
        };
        if let Some(n) = seen.then(|| self.bodies.iter().position(|b| *b == body)) {
            return Err(format!(
                "event body {} written again",
                n.map_or(0, |n| n + 1)
            ));
        }
        self.bodies.push(body);
        if self.set.is_none() && self.bodies.len() > SCAN {
            self.set = Some(self.bodies.iter().copied().collect());
        }
        Ok(())
    }
}

/// Up to this many bodies are looked up by a scan (a history's few).
const SCAN: usize = 32;

/// The event bodies a history has written so far, each numbered from 1 in
/// the order written: an event whose body is one of them is written as
/// its number. Bodies are told apart by their pointer (the process shares
/// each distinct text, `Event::text_body`), so a body that several events
/// say (each `Restarting`, `Started` of a restarting task) is written
/// once, and no text twice: a history has one encoding.
#[derive(Default)]
struct Bodies {
    written: Vec<*const EventBody>,
    /// Past `SCAN` bodies, each pointer's number.
    numbers: Option<foldhash::HashMap<*const EventBody, u64>>,
}

impl Bodies {
    /// The number of `body` if written already; else `None`, and it is
    /// numbered next (the caller writes it).
    fn number(&mut self, body: &Arc<EventBody>) -> Option<u64> {
        let ptr = Arc::as_ptr(body);
        let found = match &self.numbers {
            Some(numbers) => numbers.get(&ptr).copied(),
            None => self
                .written
                .iter()
                .position(|&p| p == ptr)
                .map(|i| i as u64 + 1),
        };
        if found.is_none() {
            self.written.push(ptr);
            let n = self.written.len() as u64;
            match &mut self.numbers {
                Some(numbers) => {
                    numbers.insert(ptr, n);
                }
                None if self.written.len() > SCAN => {
                    self.numbers = Some(
                        self.written
                            .iter()
                            .enumerate()
                            .map(|(i, &p)| (p, i as u64 + 1))
                            .collect(),
                    );
                }
                None => {}
            }
        }
        found
    }
}

/// A history exactly as given (a stored record's), even past `MAX_EVENTS`.
impl FromIterator<Event> for Events {
    fn from_iter<I: IntoIterator<Item = Event>>(iter: I) -> Self {
        let events: Arc<[Event]> = iter.into_iter().collect();
        Self(if events.is_empty() {
            Repr::Empty
        } else {
            Repr::Made(events)
        })
    }
}

impl PartialEq for Events {
    fn eq(&self, other: &Self) -> bool {
        // The common case, a task a change did not touch, is one pointer
        // compare.
        self.same(other) || (self.len() == other.len() && self.all() == other.all())
    }
}

impl Eq for Events {}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.all().iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use time::macros::datetime;

    use super::*;
    use crate::lifecycle::Details;

    /// A history with what its stored form has ways to write: a body said
    /// again (by its number), details, a time in another offset (its body
    /// holds it) and one past 64-bit nanoseconds.
    fn history() -> Vec<Event> {
        let t = datetime!(2026-11-29 10:00:00.25 UTC);
        let exit = Details::from_pairs([("exit_code", "1"), ("signal", "0")]);
        vec![
            Event::new("Started", t, "", Details::default()),
            Event::new("Terminated", t, "Exit Code: 1", exit),
            Event::new(
                "Started",
                t + time::Duration::SECOND,
                "",
                Details::default(),
            ),
            Event::new(
                "Restarting",
                datetime!(2026-11-29 15:30 +05:30),
                "",
                Details::default(),
            ),
            Event::new(
                "Started",
                datetime!(2300-01-01 0:00 UTC),
                "",
                Details::default(),
            ),
        ]
    }

    fn stored(events: &[Event]) -> (Vec<u8>, Events) {
        let mut bytes = Vec::new();
        events.iter().cloned().collect::<Events>().write(&mut bytes);
        let read = Events::read(&mut Reader { bytes: &bytes }).unwrap();
        (bytes, read)
    }

    /// A stored history is kept as its bytes, and reads, compares,
    /// grows and writes as the events it holds.
    #[test]
    fn a_stored_history_is_the_events_it_holds() {
        let events = history();
        let made: Events = events.iter().cloned().collect();
        let (bytes, read) = stored(&events);
        assert!(read.is_stored());
        assert_eq!(read.len(), 5);
        assert!(!read.is_empty());
        assert_eq!(&*read.all(), &events[..]);
        assert_eq!(read, made);
        assert_eq!(made, read);
        assert_eq!(read.last().unwrap().kind, "Started");
        assert_eq!(read.last_of("Restarting").unwrap(), events[3]);
        // Written again as the bytes it was read from.
        let mut again = Vec::new();
        read.write(&mut again);
        assert_eq!(again, bytes);
        // Versions: the same bytes are no change; a report adds one event.
        let (_, copy) = stored(&events);
        assert!(copy.added_since(&read).is_empty());
        assert!(made.added_since(&read).is_empty());
        let mut next = read.clone();
        let new = Event::new(
            "Killed",
            datetime!(2026-11-29 11:00 UTC),
            "",
            Details::default(),
        );
        next.push(new.clone());
        assert!(next.made().is_some(), "a report makes its events");
        assert_eq!(next.added_since(&read), std::slice::from_ref(&new));
        let (_, stored_next) = stored(&next.all());
        assert_eq!(stored_next.added_since(&read), [new]);
        assert_ne!(stored_next, read);
        // Nothing stored is no block at all.
        let (bytes, empty) = stored(&[]);
        assert_eq!(bytes, [0]);
        assert!(empty.is_empty() && !empty.is_stored());
    }

    proptest! {
        /// Whatever a history's check lets through makes its events
        /// without a panic, as the events it was written from: the bytes
        /// are their one encoding. A damaged history is refused when read,
        /// never when its events are asked for.
        #[test]
        fn a_checked_history_always_makes_its_events(
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0..3u8), 0..6)
        ) {
            let (mut bytes, _) = stored(&history());
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
            let mut r = Reader { bytes: &bytes };
            let checked = Events::read(&mut r);
            let rest = r.bytes.len();
            let mut r = Reader { bytes: &bytes };
            let made = Events::read_made(&mut r);
            if let Ok(checked) = checked {
                let made = made.expect("a checked history makes its events");
                prop_assert_eq!(rest, r.bytes.len());
                prop_assert_eq!(checked.len(), made.len());
                prop_assert_eq!(&*checked.all(), &*made.all());
                let mut again = Vec::new();
                made.write(&mut again);
                prop_assert_eq!(&again[..], &bytes[..bytes.len() - rest]);
            }
        }
    }
}
