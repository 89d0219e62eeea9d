//! A task's event history (`Events`), and the stored form of a record's
//! histories.
//!
//! A store's start reads every history of every allocation: at a million
//! allocations with full histories, fifty million events naming four
//! million distinct bodies, and finding each body in the process's table
//! (`intern.rs`) was two thirds of the start (BENCHMARKS.md, "Restart
//! time"). So the histories of a record read from a store are kept as
//! they were stored, checked but not made into events (`Repr::Stored`),
//! until something asks for a task's events: a view made from it decodes
//! them (and drops what it decoded), a report to the task makes a new
//! history of events, and the record written again unchanged copies the
//! bytes as they are.
//!
//! The stored form (`store/record.rs` embeds one history in each task):
//!
//! ```text
//! history = count: varint | event*
//! event   = 0 | type: str | message: str | details: varint | (key: str | value: str)*
//!             | time                           (a body not written before)
//!         | number: varint | time              (1 ≤ number ≤ bodies written so far)
//! ```
//!
//! Agents send the same few bodies to every task of an allocation and
//! again on each restart, so bodies are numbered across the record: from
//! 1, in the order the record's histories write them, each written once
//! (in whichever task says it first). A record's histories have one
//! encoding: two records' histories whose bytes are equal are the same
//! events. (Not the other way round: events compare their times by the
//! instant, and two offsets of one instant are written apart.)

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
    /// The history of the task at this position in a stored record (not
    /// empty).
    Stored(Arc<Stored>, u32),
}

/// The histories of a stored record as stored, in task order, checked
/// when read (`HistoriesReader`).
pub struct Stored {
    bytes: Box<[u8]>,
    /// Where each task's history ends in `bytes`.
    ends: Box<[u32]>,
}

impl Stored {
    /// The bytes of the histories of the tasks up to `task`, and where
    /// the last one starts.
    fn upto(&self, task: u32) -> (&[u8], usize) {
        let i = task as usize;
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        (&self.bytes[..self.ends[i] as usize], start)
    }

    /// Calls `each` with every event of `task`'s history: its body's
    /// text as written (`Text`) and its time's bytes.
    fn walk<'a>(&'a self, task: u32, mut each: impl FnMut(Text<'a>, usize, &'a [u8])) {
        let (bytes, start) = self.upto(task);
        let mut r = Reader { bytes };
        let mut bodies: Vec<&'a [u8]> = Vec::new();
        while !r.bytes.is_empty() {
            let mine = bytes.len() - r.bytes.len() >= start;
            let n = r.varint("").expect(CHECKED);
            for _ in 0..n {
                let number = r.varint("").expect(CHECKED) as usize;
                let body = if number == 0 {
                    let text = r.bytes;
                    Text::skip(&mut r);
                    bodies.push(&text[..text.len() - r.bytes.len()]);
                    bodies.len()
                } else {
                    number
                };
                let time = r.bytes;
                r.time_parts("").expect(CHECKED);
                if mine {
                    let time = &time[..time.len() - r.bytes.len()];
                    each(Text(bodies[body - 1]), body, time);
                }
            }
        }
    }
}

const CHECKED: &str = "a stored history is checked when read";

/// A body's text as a history writes it: type, message, details.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Text<'a>(&'a [u8]);

impl<'a> Text<'a> {
    /// Reads past one, checking it.
    fn read(r: &mut Reader<'a>) -> Result<(), String> {
        r.str("an event type")?;
        r.str("an event message")?;
        let n = r.count("the details count", 2)?;
        let mut last: Option<&str> = None;
        for _ in 0..n {
            let key = r.str("a details key")?;
            r.str("a details value")?;
            if last.is_some_and(|last| last >= key) {
                return Err(format!("details key {key:?} out of order"));
            }
            last = Some(key);
        }
        Ok(())
    }

    fn skip(r: &mut Reader<'a>) {
        Self::read(r).expect(CHECKED);
    }

    /// The shared body it says.
    fn body(self) -> Arc<EventBody> {
        let mut r = Reader { bytes: self.0 };
        let kind = r.str("").expect(CHECKED);
        let message = r.str("").expect(CHECKED);
        let n = r.varint("").expect(CHECKED) as usize;
        let details: Vec<(&str, &str)> = (0..n)
            .map(|_| (r.str("").expect(CHECKED), r.str("").expect(CHECKED)))
            .collect();
        EventBody::of_text(kind, message, &details)
    }

    /// The text of `event`'s body, written into `buf`.
    fn write(buf: &mut Vec<u8>, event: &Event) {
        put_str(buf, &event.kind);
        put_str(buf, &event.message);
        put_varint(buf, event.details.len() as u64);
        for (key, value) in event.details.iter() {
            put_str(buf, key);
            put_str(buf, value);
        }
    }
}

impl Events {
    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::Empty => 0,
            Repr::Made(e) => e.len(),
            Repr::Stored(s, task) => {
                let (bytes, start) = s.upto(*task);
                Reader {
                    bytes: &bytes[start..],
                }
                .varint("")
                .expect(CHECKED) as usize
            }
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
            Repr::Stored(s, task) => {
                // Each body once, however many of the events say it.
                let mut made: Vec<Option<Arc<EventBody>>> = Vec::new();
                let mut events = Vec::new();
                s.walk(*task, |text, number, time| {
                    if made.len() < number {
                        made.resize(number, None);
                    }
                    let body = made[number - 1].get_or_insert_with(|| text.body());
                    let at = At::read(&mut Reader { bytes: time }).expect(CHECKED);
                    events.push(at.event(body.clone()));
                });
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
            (Repr::Stored(a, i), Repr::Stored(b, j)) => {
                i == j && (Arc::ptr_eq(a, b) || a.upto(*i) == b.upto(*j))
            }
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

    /// Makes the events now if kept as stored (`Allocation::settle_histories`).
    pub fn make(&mut self) {
        if self.is_stored() {
            *self = self.all().iter().cloned().collect();
        }
    }

    /// Whether the events are kept as stored (not made yet).
    pub fn is_stored(&self) -> bool {
        matches!(self.0, Repr::Stored(..))
    }

    /// The events, if made in this process.
    #[cfg(test)]
    pub fn made(&self) -> Option<&Arc<[Event]>> {
        match &self.0 {
            Repr::Made(e) => Some(e),
            _ => None,
        }
    }
}

/// Reads a record's histories, one per task in order, and checks all of
/// them as making their events would, without making them: an error
/// here is the only one their events can have. `finish` gives each
/// task's history.
#[derive(Default)]
pub struct HistoriesReader<'a> {
    bytes: Vec<u8>,
    ends: Vec<u32>,
    written: Numbered<Text<'a>>,
}

impl<'a> HistoriesReader<'a> {
    /// Reads the next task's history from `r`.
    pub fn read(&mut self, r: &mut Reader<'a>) -> Result<(), String> {
        let start = r.bytes;
        // An event takes at least 4 bytes: a body's number and a time.
        let n = r.count("the event count", 4)?;
        for _ in 0..n {
            let number = r.varint("an event body")?;
            if number == 0 {
                let text = r.bytes;
                Text::read(r)?;
                let text = Text(&text[..text.len() - r.bytes.len()]);
                if let Some(n) = self.written.number(&text) {
                    return Err(format!("event body {n} written again"));
                }
            } else if number > self.written.len() as u64 {
                return Err(format!(
                    "event body {number} of the {} written before it",
                    self.written.len()
                ));
            }
            At::read(r)?;
        }
        self.bytes
            .extend_from_slice(&start[..start.len() - r.bytes.len()]);
        let end = u32::try_from(self.bytes.len())
            .map_err(|_| "histories past 4 GiB in one record".to_owned())?;
        self.ends.push(end);
        Ok(())
    }

    /// Each task's history, in the order read.
    pub fn finish(self) -> Vec<Events> {
        let stored = Arc::new(Stored {
            bytes: self.bytes.into_boxed_slice(),
            ends: self.ends.into_boxed_slice(),
        });
        (0..stored.ends.len() as u32)
            .map(|task| {
                let (bytes, start) = stored.upto(task);
                if bytes[start..] == [0] {
                    Events::default()
                } else {
                    Events(Repr::Stored(stored.clone(), task))
                }
            })
            .collect()
    }
}

/// Writes a record's histories, one per task in order (`write`): as
/// they were read if the record holds them all so, else numbering each
/// body across the record.
pub struct HistoriesWriter<'a> {
    /// The record's histories as read, if it holds each of them so.
    stored: Option<&'a Stored>,
    /// Whether any history is kept as stored (its bodies are then told
    /// apart by their text, not their pointer).
    any_stored: bool,
    pointers: Numbered<*const EventBody>,
    texts: Numbered<Vec<u8>>,
    /// The text-only bodies of events whose body holds their time, kept
    /// alive while their pointers are the numbers' keys.
    held: Vec<Arc<EventBody>>,
}

impl<'a> HistoriesWriter<'a> {
    /// For a record whose tasks' histories are `histories`, in order.
    pub fn new<'h>(histories: impl Iterator<Item = &'h Events> + Clone) -> Self
    where
        'h: 'a,
    {
        let any_stored = histories.clone().any(|h| matches!(h.0, Repr::Stored(..)));
        // All as read: each task's own, of one record of this many tasks;
        // a task empty now was empty then (else its bodies, which later
        // tasks may name, would go unwritten).
        let mut first: Option<&'a Arc<Stored>> = None;
        let mut as_read = true;
        let mut count = 0;
        for (i, h) in histories.clone().enumerate() {
            count += 1;
            match &h.0 {
                Repr::Stored(s, task) => {
                    as_read &= *task as usize == i && first.is_none_or(|f| Arc::ptr_eq(f, s));
                    first = Some(s);
                }
                Repr::Made(_) => as_read = false,
                Repr::Empty => {}
            }
        }
        let stored = first
            .filter(|s| as_read && s.ends.len() == count)
            .filter(|s| {
                histories.enumerate().all(|(i, h)| {
                    let (bytes, start) = s.upto(i as u32);
                    !h.is_empty() || bytes[start..] == [0]
                })
            })
            .map(|s| &**s);
        Self {
            stored,
            any_stored,
            pointers: Numbered::default(),
            texts: Numbered::default(),
            held: Vec::new(),
        }
    }

    /// Appends the stored form of the history of task `task`,
    /// `events`, to `buf`.
    pub fn write(&mut self, task: usize, events: &'a Events, buf: &mut Vec<u8>) {
        if let Some(s) = self.stored {
            let (bytes, start) = s.upto(task as u32);
            return buf.extend_from_slice(&bytes[start..]);
        }
        put_varint(buf, events.len() as u64);
        match &events.0 {
            Repr::Empty => {}
            Repr::Made(events) => {
                for event in events.iter() {
                    self.event(buf, event);
                }
            }
            Repr::Stored(s, task) => s.walk(*task, |text, _, time| {
                match self.texts.number(text.0) {
                    Some(n) => put_varint(buf, n),
                    None => {
                        buf.push(0);
                        buf.extend_from_slice(text.0);
                    }
                }
                buf.extend_from_slice(time);
            }),
        }
    }

    fn event(&mut self, buf: &mut Vec<u8>, event: &Event) {
        let found = if self.any_stored {
            // Told apart by text: a stored history's bodies have no
            // pointer yet.
            let at = buf.len();
            Text::write(buf, event);
            let found = self.texts.number(&buf[at..]);
            if found.is_some() {
                buf.truncate(at);
            } else {
                buf.insert(at, 0);
            }
            found
        } else {
            let text = if event.utc_nanos().is_some() {
                event.body()
            } else {
                self.held.push(event.text_body());
                &self.held[self.held.len() - 1]
            };
            let found = self.pointers.number(&Arc::as_ptr(text));
            if found.is_none() {
                buf.push(0);
                Text::write(buf, event);
            }
            found
        };
        if let Some(n) = found {
            put_varint(buf, n);
        }
        // `put_time(buf, event.time())`, the same bytes; for a time held
        // as UTC nanoseconds (nearly all), without building the date.
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

/// An event's time as read: UTC nanoseconds since 1970 (nearly every
/// one), without the date arithmetic of a `Timestamp`, or as given.
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

/// Up to this many bodies are looked up by a scan (a record's few).
const SCAN: usize = 32;

/// The bodies a record has written so far, each numbered from 1 in the
/// order written: an event whose body is one of them is written as its
/// number, and a record read that writes one twice is damage (one
/// encoding). Told apart by their pointer when every history is made
/// (the process shares each distinct text, `Event::text_body`), else by
/// their text (two bodies say the same exactly when their bytes are
/// equal), so a body several tasks say (every task's `Received`, `Task
/// Setup`, `Started`) is written once.
struct Numbered<K> {
    written: Vec<K>,
    /// Past `SCAN` bodies, each one's number.
    numbers: Option<foldhash::HashMap<K, u64>>,
}

impl<K> Default for Numbered<K> {
    fn default() -> Self {
        Self {
            written: Vec::new(),
            numbers: None,
        }
    }
}

impl<K: Eq + std::hash::Hash + Clone> Numbered<K> {
    fn len(&self) -> usize {
        self.written.len()
    }

    /// The number of `body` if written already; else `None`, and it is
    /// numbered next (the caller writes it).
    fn number<Q>(&mut self, body: &Q) -> Option<u64>
    where
        K: std::borrow::Borrow<Q>,
        Q: Eq + std::hash::Hash + ToOwned<Owned = K> + ?Sized,
    {
        let found = match &self.numbers {
            Some(numbers) => numbers.get(body).copied(),
            None => (self.written.iter())
                .position(|k| k.borrow() == body)
                .map(|i| i as u64 + 1),
        };
        if found.is_none() {
            self.written.push(body.to_owned());
            let n = self.written.len() as u64;
            match &mut self.numbers {
                Some(numbers) => {
                    numbers.insert(body.to_owned(), n);
                }
                None if self.written.len() > SCAN => {
                    self.numbers = Some((self.written.iter().cloned()).zip(1..).collect());
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
    use crate::{lifecycle::Details, wire::damage};

    /// One history written as a record of one task writes it.
    trait WriteOne {
        fn write(&self, buf: &mut Vec<u8>);
    }

    impl WriteOne for Events {
        fn write(&self, buf: &mut Vec<u8>) {
            HistoriesWriter::new(std::iter::once(self)).write(0, self, buf);
        }
    }

    /// One history read as a record of one task reads it, kept as stored.
    fn read_one(r: &mut Reader<'_>) -> Result<Events, String> {
        let mut reading = HistoriesReader::default();
        reading.read(r)?;
        Ok(reading.finish().pop().expect("one task's"))
    }

    /// `read_one`, with the events made at once.
    fn read_made(r: &mut Reader<'_>) -> Result<Events, String> {
        Ok(read_one(r)?.all().iter().cloned().collect())
    }

    /// `tasks`' histories written as one record writes them, and read
    /// back, kept as stored.
    fn record(tasks: &[Events]) -> (Vec<u8>, Vec<Events>) {
        let mut bytes = Vec::new();
        let mut writing = HistoriesWriter::new(tasks.iter());
        for (i, h) in tasks.iter().enumerate() {
            writing.write(i, h, &mut bytes);
        }
        let mut r = Reader { bytes: &bytes };
        let mut reading = HistoriesReader::default();
        for _ in tasks {
            reading.read(&mut r).unwrap();
        }
        assert!(r.bytes.is_empty());
        let read = reading.finish();
        (bytes, read)
    }

    /// Histories across tasks: a body one task wrote is a number in the
    /// next; written again as read, with any of them made into events
    /// (a record written after a report to one of its tasks), and with
    /// a task emptied (its bodies then written where next said).
    #[test]
    fn a_record_s_histories_number_bodies_across_tasks_made_or_stored() {
        let events = history();
        let tasks: Vec<Events> = vec![
            events[..2].iter().cloned().collect(),
            Events::default(),
            events.iter().cloned().collect(),
        ];
        let (bytes, read) = record(&tasks);
        let started = bytes.windows(7).filter(|w| *w == b"Started");
        assert_eq!(started.count(), 1, "written once in the record");
        assert!(read[0].is_stored() && read[1].is_empty() && read[2].is_stored());
        assert_eq!(read, tasks);
        assert_eq!(record(&read).0, bytes, "as read");
        for made in 0..3 {
            let mut some = read.clone();
            some[made] = some[made].all().iter().cloned().collect();
            assert_eq!(record(&some).0, bytes, "task {made} made");
        }
        // A first task emptied: the last writes what it named.
        let mut emptied = read.clone();
        emptied[0] = Events::default();
        let (again, back) = record(&emptied);
        assert_eq!(back, emptied);
        assert_eq!(back[2].all()[..], events[..]);
        assert_ne!(again, bytes);
        // The same histories read from another record's bytes: the same.
        let (_, other) = record(&tasks);
        for (a, b) in read.iter().zip(&other) {
            assert!(a.added_since(b).is_empty() && a == b);
        }
    }

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

    /// `events` written, and read back.
    fn stored_of(events: &Events) -> (Vec<u8>, Events) {
        let mut bytes = Vec::new();
        events.write(&mut bytes);
        let read = read_one(&mut Reader { bytes: &bytes }).unwrap();
        (bytes, read)
    }

    fn stored(events: &[Event]) -> (Vec<u8>, Events) {
        let mut bytes = Vec::new();
        events.iter().cloned().collect::<Events>().write(&mut bytes);
        let read = read_one(&mut Reader { bytes: &bytes }).unwrap();
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

    /// Forty bodies, then each said again: past the scans (`Numbered`)
    /// of the writer and of the check, which then look bodies up by hash.
    fn past_the_scan() -> Vec<Event> {
        let t = datetime!(2026-11-29 12:00 UTC);
        (0..40)
            .chain((0..40).rev())
            .enumerate()
            .map(|(n, i)| {
                let at = t + time::Duration::seconds(n as i64);
                Event::new(&format!("k{i}"), at, "", Details::default())
            })
            .collect()
    }

    /// What a history read from `bytes` is, if it is read at all: the
    /// events making them would make, written again as the bytes read,
    /// made or not (their one encoding).
    fn read_as_made(bytes: &[u8]) -> Result<Events, String> {
        let mut r = Reader { bytes };
        let checked = read_one(&mut r)?;
        let read = &bytes[..bytes.len() - r.bytes.len()];
        let made = read_made(&mut Reader { bytes })
            .unwrap_or_else(|e| panic!("checked, but its events cannot be made: {e}"));
        assert_eq!(checked.len(), made.len());
        assert_eq!(&*checked.all(), &*made.all());
        let (mut again, mut made_again) = (Vec::new(), Vec::new());
        checked.write(&mut again);
        made.write(&mut made_again);
        assert_eq!(again, read);
        assert_eq!(made_again, read, "one encoding");
        Ok(checked)
    }

    /// Past the scans, each body is written once and said by its number
    /// after, and a body written twice or a number not written yet is
    /// still refused when read.
    #[test]
    fn a_history_past_the_scan_writes_each_body_once_and_refuses_one_written_twice() {
        let events = past_the_scan();
        let (bytes, read) = stored(&events);
        assert_eq!(&*read.all(), &events[..]);
        for i in 0..40 {
            let mut body = vec![0];
            put_str(&mut body, &format!("k{i}"));
            put_str(&mut body, "");
            body.push(0);
            let found = bytes.windows(body.len()).filter(|w| *w == body);
            assert_eq!(found.count(), 1, "k{i}");
        }
        read_as_made(&bytes).unwrap();
        // By hand: the forty bodies, then a last event.
        let t = datetime!(2026-11-29 12:00 UTC);
        let with_last = |last: &[u8]| {
            let mut b = Vec::new();
            put_varint(&mut b, 41);
            for i in 0..40 {
                b.push(0);
                put_str(&mut b, &format!("k{i}"));
                put_str(&mut b, "");
                b.push(0);
                put_time(&mut b, t);
            }
            b.extend_from_slice(last);
            put_time(&mut b, t);
            b
        };
        let last = read_as_made(&with_last(&[36])).unwrap().last().unwrap();
        assert_eq!(last.kind, "k35");
        let mut again = vec![0];
        put_str(&mut again, "k35");
        put_str(&mut again, "");
        again.push(0);
        let e = read_one(&mut Reader {
            bytes: &with_last(&again),
        })
        .unwrap_err();
        assert!(e.contains("event body 36 written again"), "{e}");
        let e = read_one(&mut Reader {
            bytes: &with_last(&[41]),
        })
        .unwrap_err();
        assert!(
            e.contains("event body 41 of the 40 written before it"),
            "{e}"
        );
    }

    /// Readers on several threads make a stored history's events at
    /// once, while other bodies are made and swept from the table: each
    /// text is one body across all of them, so a history grown from any
    /// readers' events writes each text once, and reads back.
    #[test]
    fn readers_on_several_threads_make_one_body_per_text() {
        let t = datetime!(2026-11-29 10:00 UTC);
        let events: Vec<Event> = (0..40)
            .map(|i| {
                let at = t + time::Duration::seconds(i);
                Event::new(
                    &format!("read-at-once-{}", i % 12),
                    at,
                    "",
                    Details::default(),
                )
            })
            .collect();
        let (bytes, stored) = stored(&events);
        drop(events);
        let made: Vec<Vec<Event>> = std::thread::scope(|s| {
            s.spawn(|| {
                for i in 0..20_000 {
                    drop(EventBody::of_text(&format!("churn-{i}"), "", &[]));
                }
            });
            let readers: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        (0..50)
                            .flat_map(|_| stored.all().into_owned())
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            readers.into_iter().map(|r| r.join().unwrap()).collect()
        });
        let all: Vec<&Event> = made.iter().flatten().collect();
        for e in &all {
            let first = all.iter().find(|f| f.kind == e.kind).unwrap();
            assert!(Arc::ptr_eq(e.body(), first.body()), "{}", e.kind);
        }
        let mixed: Events = (0..40).map(|i| made[i % 4][i].clone()).collect();
        let mut again = Vec::new();
        mixed.write(&mut again);
        assert_eq!(again, bytes);
        assert_eq!(read_as_made(&again).unwrap(), stored);
    }

    /// A history with every way of writing an event, past the scans, cut
    /// at every length (refused) and with each byte changed: refused
    /// when read, or read as making its events reads them, and written
    /// again as read.
    #[test]
    fn every_cut_and_changed_byte_of_a_history_is_refused_or_made_as_read() {
        let mut events = history();
        events.extend(past_the_scan());
        let (bytes, _) = stored(&events);
        for len in 0..bytes.len() {
            let cut = read_one(&mut Reader {
                bytes: &bytes[..len],
            });
            assert!(cut.is_err(), "cut at {len}");
        }
        for at in 0..bytes.len() {
            for flip in [1, 2, 4, 8, 0x10, 0x20, 0x40, 0x80, 0xff] {
                let mut changed = bytes.clone();
                changed[at] ^= flip;
                let _ = read_as_made(&changed);
            }
        }
    }

    /// Whether `tasks` are the histories of one record as `read` was
    /// read, each at its position, in a record of as many tasks (an empty
    /// one empty in both): only then are they copied as read.
    fn own(tasks: &[Events], read: &[Events]) -> bool {
        tasks.len() == read.len()
            && tasks.iter().any(Events::is_stored)
            && tasks.iter().zip(read).all(|(t, r)| match (&t.0, &r.0) {
                (Repr::Empty, Repr::Empty) => true,
                (Repr::Stored(a, i), Repr::Stored(b, j)) => Arc::ptr_eq(a, b) && i == j,
                _ => false,
            })
    }

    const TEXTS: [&str; 4] = ["Started", "Terminated", "Restarting", "Restart Signaled"];

    /// Event `(text, time)` of a few texts and times: times in other
    /// offsets (one the same instant as another) and past 64-bit
    /// nanoseconds, whose bodies hold them.
    fn pooled(&(text, time): &(usize, usize)) -> Event {
        let times = [
            datetime!(2026-11-29 10:00:00.25 UTC),
            datetime!(2026-11-29 10:00:01 UTC),
            datetime!(2026-11-29 15:30 +05:30),
            // The same instant in another offset.
            datetime!(2026-11-29 11:00 +01:00),
            datetime!(2300-01-01 0:00 UTC),
            datetime!(1500-06-01 12:00 +05:30),
        ];
        let details = Details::from_pairs([("n", text.to_string())]);
        Event::new(TEXTS[text], times[time], "", details)
    }

    proptest! {
        /// Whatever a history's check lets through makes its events
        /// without a panic, as the events it was written from: the bytes
        /// are their one encoding. A damaged history is refused when read,
        /// never when its events are asked for.
        #[test]
        fn a_checked_history_always_makes_its_events(
            edits in damage::edits(0..6)
        ) {
            let (mut bytes, _) = stored(&history());
            damage::apply(&mut bytes, edits);
            let mut r = Reader { bytes: &bytes };
            let checked = read_one(&mut r);
            let rest = r.bytes.len();
            let mut r = Reader { bytes: &bytes };
            let made = read_made(&mut r);
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

        /// A history kept as stored and the same history made here
        /// (a fresh block, so compared by value) read, compare, grow and
        /// write alike, whatever they hold (texts said again, times in
        /// other offsets and past 64-bit nanoseconds, more than
        /// `MAX_EVENTS`) and whatever is added to them.
        #[test]
        fn a_stored_history_reads_compares_grows_and_writes_as_the_made_one(
            held in prop::collection::vec((0..4usize, 0..6usize), 0..14),
            added in prop::collection::vec((0..4usize, 0..6usize), 0..4),
        ) {
            let (texts, event) = (TEXTS, pooled);
            let fresh = |e: &Events| e.all().iter().cloned().collect::<Events>();
            let held: Vec<Event> = held.iter().map(event).collect();
            let (bytes, stored) = stored(&held);
            let made: Events = held.iter().cloned().collect();
            prop_assert_eq!(stored.is_stored(), !held.is_empty());
            prop_assert_eq!(stored.len(), made.len());
            prop_assert_eq!(stored.is_empty(), made.is_empty());
            prop_assert_eq!(&*stored.all(), &*made.all());
            prop_assert_eq!(&stored, &made);
            prop_assert_eq!(&made, &stored);
            prop_assert_eq!(stored.last(), made.last());
            for kind in texts {
                prop_assert_eq!(stored.last_of(kind), made.last_of(kind));
            }
            let mut again = Vec::new();
            made.write(&mut again);
            prop_assert_eq!(&again, &bytes);
            let (mut grown_stored, mut grown_made) = (stored.clone(), made.clone());
            for e in added.iter().map(event) {
                grown_stored.push(e.clone());
                grown_made.push(e);
            }
            prop_assert_eq!(&*grown_stored.all(), &*grown_made.all());
            let (grown_bytes, grown_read) = stored_of(&grown_made);
            let mut again = Vec::new();
            grown_stored.write(&mut again);
            prop_assert_eq!(&again, &grown_bytes);
            // What a version added since the one before, as made here.
            let added_made = fresh(&grown_made).added_since(&fresh(&made));
            for (now, before) in [
                (&grown_stored, &stored),
                (&grown_read, &stored),
                (&grown_read, &made),
                (&grown_made, &stored),
            ] {
                prop_assert_eq!(&now.added_since(before), &added_made);
                prop_assert_eq!(now == before, fresh(now) == fresh(before));
            }
            prop_assert!(stored.added_since(&stored.clone()).is_empty());
            prop_assert!(grown_read.added_since(&stored_of(&grown_made).1).is_empty());
        }
    }
    proptest! {
        /// Histories from two records (one read twice, as two replicas
        /// read the same bytes), made or not, grown, emptied, at other
        /// positions, in records of other task counts: copied as read
        /// exactly when they are one record's own (`own`), and whatever
        /// the mix written, read back, compared and grown as the events
        /// they hold, in their one encoding.
        #[test]
        fn any_mix_of_histories_writes_compares_and_grows_as_its_events(
            a in prop::collection::vec(prop::collection::vec((0..4usize, 0..6usize), 0..5), 3),
            b in prop::collection::vec(prop::collection::vec((0..4usize, 0..6usize), 0..5), 3),
            picks in prop::collection::vec(
                (prop_oneof![3 => Just(0usize), 4 => 0..7usize], 0..3usize),
                1..5,
            ),
            at_own_positions in any::<bool>(),
            b_renames_a in any::<bool>(),
            added in (0..4usize, 0..6usize),
        ) {
            let of = |h: &[Vec<(usize, usize)>]| -> Vec<Events> {
                h.iter().map(|h| h.iter().map(pooled).collect()).collect()
            };
            // The same bytes but for the texts: a history naming only
            // bodies earlier tasks wrote is the same bytes in both
            // records, and other events.
            let b = if b_renames_a {
                let rename = |h: &Vec<(usize, usize)>| h.iter().map(|&(t, at)| ((t + 1) % 4, at)).collect();
                a.iter().map(rename).collect()
            } else {
                b
            };
            let (a_made, b_made) = (of(&a), of(&b));
            let (a_bytes, a1) = record(&a_made);
            let (_, a2) = record(&a_made);
            let (_, b1) = record(&b_made);
            let added = pooled(&added);
            let grown = |e: &Events| {
                let mut e = e.clone();
                e.push(added.clone());
                e
            };
            let fresh = |e: &Events| e.all().iter().cloned().collect::<Events>();
            prop_assert_eq!(&a_bytes, &record(&a1).0);
            let check = |tasks: &[Events]| -> Result<(), TestCaseError> {
                let made: Vec<Events> = tasks.iter().map(fresh).collect();
                let copies = HistoriesWriter::new(tasks.iter()).stored.is_some();
                prop_assert_eq!(copies, [&a1, &a2, &b1].iter().any(|r| own(tasks, r)));
                let (bytes, back) = record(tasks);
                prop_assert_eq!(&bytes, &record(&made).0, "one encoding");
                prop_assert_eq!(&record(&back).0, &bytes, "as read");
                prop_assert_eq!(&back, &made);
                for (i, t) in tasks.iter().enumerate() {
                    prop_assert_eq!(t.len(), made[i].len());
                    prop_assert_eq!(t.is_empty(), made[i].is_empty());
                    prop_assert_eq!(&*t.all(), &*made[i].all());
                    for (j, u) in tasks.iter().enumerate() {
                        let (mi, mj) = (fresh(&made[i]), fresh(&made[j]));
                        prop_assert_eq!(t == u, mi == mj, "tasks {} and {}", i, j);
                        prop_assert_eq!(t == &back[j], mi == mj);
                        let since = mi.added_since(&mj);
                        prop_assert_eq!(&t.added_since(u), &since, "tasks {} and {}", i, j);
                        prop_assert_eq!(&back[i].added_since(u), &since);
                        prop_assert_eq!(&t.added_since(&back[j]), &since);
                    }
                    let (g, gm) = (grown(t), grown(&made[i]));
                    prop_assert_eq!(&*g.all(), &*gm.all());
                    prop_assert_eq!(g.added_since(t), gm.added_since(&fresh(&made[i])));
                }
                Ok(())
            };
            let sources = [&a1, &a2, &b1, &a_made, &b_made];
            let tasks: Vec<Events> = (picks.iter().enumerate())
                .map(|(i, &(source, at))| {
                    let at = if at_own_positions { i % 3 } else { at };
                    match source {
                        5 => Events::default(),
                        6 => grown(&a1[at]),
                        s => sources[s][at].clone(),
                    }
                })
                .collect();
            check(&tasks)?;
            // The record as read, and each way it can stop being so.
            check(&a1)?;
            for k in 0..3 {
                for with in [fresh(&a1[k]), a2[k].clone(), Events::default(), grown(&a1[k])] {
                    let mut some = a1.clone();
                    some[k] = with;
                    check(&some)?;
                }
            }
            check(&a1[..2])?;
            check(&[a1.clone(), vec![Events::default()]].concat())?;
            check(&[a1.clone(), vec![a1[0].clone()]].concat())?;
            check(&a1.iter().rev().cloned().collect::<Vec<_>>())?;
        }

        /// A record's histories, a body the first task writes named by
        /// number in the last, with bytes changed, inserted or removed:
        /// refused when read, or each task's events are made (no panic)
        /// and the histories written again, kept as stored or made, are
        /// the bytes read.
        #[test]
        fn damaged_histories_across_tasks_are_refused_when_read_or_make_their_events(
            edits in damage::edits(1..6)
        ) {
            let events = history();
            let tasks: Vec<Events> = vec![
                events[..2].iter().cloned().collect(),
                Events::default(),
                events.iter().cloned().collect(),
            ];
            let (mut bytes, _) = record(&tasks);
            damage::apply(&mut bytes, edits);
            let mut r = Reader { bytes: &bytes };
            let mut reading = HistoriesReader::default();
            if (0..3).try_for_each(|_| reading.read(&mut r)).is_ok() {
                let read_bytes = &bytes[..bytes.len() - r.bytes.len()];
                let read = reading.finish();
                let made: Vec<Events> = read
                    .iter()
                    .map(|h| {
                        let all = h.all();
                        assert_eq!(h.len(), all.len());
                        all.iter().cloned().collect()
                    })
                    .collect();
                let mut again = Vec::new();
                let mut writing = HistoriesWriter::new(read.iter());
                for (i, h) in read.iter().enumerate() {
                    writing.write(i, h, &mut again);
                }
                prop_assert_eq!(&again[..], read_bytes, "as read");
                prop_assert_eq!(&record(&made).0[..], read_bytes, "made");
                prop_assert_eq!(&read, &made);
            }
        }
    }
}
