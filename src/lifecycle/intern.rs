//! Strings and event bodies stored once per process.
//!
//! Agents send the same few event types, messages and details again and
//! again (`Started`, `Terminated` / `Exit Code: 0`, `exit_code` = `0`), for
//! every task of every allocation. Each distinct type, message and
//! details key is kept once (`Sym`), and so is each distinct body of an
//! event — its type, message and details (`EventBody`) — so an event in a
//! task's history is a pointer to its body and a time.
//!
//! Reference-counted: a table holds one reference of each entry, and
//! entries nobody else holds are dropped from it once it has doubled since
//! the last sweep, so what is no longer used is freed (the sweep's cost is
//! paid over the inserts that doubled the table).

use std::{
    borrow::Borrow,
    hash::{BuildHasher, Hash, Hasher},
    sync::{Arc, LazyLock, Mutex, PoisonError},
};

/// A table of shared values, in shards that lock apart: a store's records
/// are decoded on every core, and each interns every string it holds.
struct Table<T: ?Sized> {
    /// foldhash, seeded per process: several times SipHash's speed on
    /// these short keys, and clients still cannot aim collisions at it.
    hasher: foldhash::fast::RandomState,
    shards: Box<[Mutex<Shard<T>>]>,
}

struct Shard<T: ?Sized> {
    /// Each entry with its hash, so growing the table reads no entry.
    set: hashbrown::HashTable<(u64, Arc<T>)>,
    /// The size at which the shard is swept next.
    sweep_at: usize,
}

/// Shards per table (a power of two).
const SHARDS: usize = 64;

/// The shard of a value with this hash, from bits its table does not use:
/// a table finds a slot by the hash's low bits and tells the entries in a
/// group apart by its top seven (hashbrown's tag). Shards picked by the
/// top bits left all of a shard's entries two tags, and a lookup compared
/// about half the entries of each group it probed.
fn shard_of(hash: u64) -> usize {
    (hash >> 40) as usize % SHARDS
}

/// Shard sizes below which a shard is never swept.
const SWEEP_FROM: usize = 256;

impl<T: ?Sized + Hash + Eq> Table<T> {
    fn new() -> Self {
        Self {
            hasher: foldhash::fast::RandomState::default(),
            shards: (0..SHARDS)
                .map(|_| {
                    Mutex::new(Shard {
                        set: hashbrown::HashTable::new(),
                        sweep_at: SWEEP_FROM,
                    })
                })
                .collect(),
        }
    }

    /// The shared value equal to `key`, made by `make` if there is none.
    #[cfg(test)]
    fn get<Q>(&self, key: &Q, make: impl FnOnce() -> Arc<T>) -> Arc<T>
    where
        Arc<T>: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        self.get_hashed(self.hasher.hash_one(key), key, make)
    }

    /// `get` with the key's hash (by `self.hasher`).
    fn get_hashed<Q>(&self, hash: u64, key: &Q, make: impl FnOnce() -> Arc<T>) -> Arc<T>
    where
        Arc<T>: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        self.get_by(hash, |v| as_key::<T, Q>(v) == key, make)
    }

    /// The shared value whose hash is `hash` and for which `same` holds,
    /// made by `make` if there is none.
    fn get_by(
        &self,
        hash: u64,
        same: impl Fn(&Arc<T>) -> bool,
        make: impl FnOnce() -> Arc<T>,
    ) -> Arc<T> {
        let shard = &self.shards[shard_of(hash)];
        let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, found)) = shard.set.find(hash, |(h, v)| *h == hash && same(v)) {
            return found.clone();
        }
        let made = make();
        shard
            .set
            .insert_unique(hash, (hash, made.clone()), |(h, _)| *h);
        if shard.set.len() >= shard.sweep_at {
            // Only the table can hand out a new reference, and only under
            // this lock: an entry held by the table alone stays unused.
            let before = shard.set.len();
            shard.set.retain(|(_, v)| Arc::strong_count(v) > 1);
            let after = shard.set.len();
            // Next when it has doubled, or, if this sweep freed little (what
            // is held stays held), when it has grown four times: a sweep
            // reads every entry.
            let factor = if after > before / 4 * 3 { 4 } else { 2 };
            shard.sweep_at = SWEEP_FROM.max(factor * after);
        }
        made
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).set.len())
            .sum()
    }
}

/// A table entry as the key it is looked up by.
fn as_key<T: ?Sized, Q: ?Sized>(v: &Arc<T>) -> &Q
where
    Arc<T>: Borrow<Q>,
{
    v.borrow()
}

static STRINGS: LazyLock<Table<str>> = LazyLock::new(Table::new);
static BODIES: LazyLock<Table<EventBody>> = LazyLock::new(Table::new);

/// A string stored once per process.
#[derive(Clone)]
pub struct Sym(Arc<str>);

/// Slots of each thread's cache of recently interned values.
const CACHED: usize = 512;

thread_local! {
    /// The strings and bodies this thread interned last, by hash: the same
    /// few (`Started`, `exit_code`, ...) come again and again, and finding
    /// them here takes neither a shard's lock (whose cache line both cores
    /// would pass back and forth while a store loads) nor a probe into a
    /// table of millions.
    static RECENT_STRINGS: std::cell::RefCell<Vec<Option<Arc<str>>>> =
        std::cell::RefCell::new(vec![None; CACHED]);
    static RECENT_BODIES: std::cell::RefCell<Vec<Option<Arc<EventBody>>>> =
        std::cell::RefCell::new(vec![None; CACHED]);
}

/// `table.get`, through this thread's cache `recent`.
fn cached<T, Q>(
    recent: &'static std::thread::LocalKey<std::cell::RefCell<Vec<Option<Arc<T>>>>>,
    table: &Table<T>,
    key: &Q,
    make: impl FnOnce() -> Arc<T>,
) -> Arc<T>
where
    T: ?Sized + Hash + Eq,
    Arc<T>: Borrow<Q>,
    Q: ?Sized + Hash + Eq,
{
    let hash = table.hasher.hash_one(key);
    let slot = hash as usize % CACHED;
    let found = recent.with_borrow(|r| {
        r[slot]
            .as_ref()
            .filter(|v| as_key::<T, Q>(v) == key)
            .cloned()
    });
    if let Some(found) = found {
        return found;
    }
    let got = table.get_hashed(hash, key, make);
    recent.with_borrow_mut(|r| r[slot] = Some(got.clone()));
    got
}

impl Sym {
    pub fn new(s: &str) -> Self {
        Self(cached(&RECENT_STRINGS, &STRINGS, s, || Arc::from(s)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for Sym {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

/// By identity: equal strings are one allocation. The table drops a
/// string only when nobody else holds it, so no two live `Sym`s ever hold
/// equal text in two places.
impl PartialEq for Sym {
    fn eq(&self, other: &Self) -> bool {
        let same = Arc::ptr_eq(&self.0, &other.0);
        debug_assert_eq!(same, self.0 == other.0, "one allocation per string");
        same
    }
}

impl Eq for Sym {}

impl PartialEq<str> for Sym {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for Sym {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

/// By identity, as `eq`: a body's hash reads no string.
impl Hash for Sym {
    fn hash<H: Hasher>(&self, state: &mut H) {
        std::ptr::hash(Arc::as_ptr(&self.0), state);
    }
}

impl std::fmt::Debug for Sym {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.0, f)
    }
}

impl std::fmt::Display for Sym {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl serde::Serialize for Sym {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

/// What an event says, without its time: stored once however many events
/// say it (`EventBody::new`). Not `Clone`: every body comes from the table,
/// so two live bodies with the same text and time are one pointer, which
/// a stored record relies on to write each text once (`store/record.rs`).
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct EventBody {
    /// The event type (`Started`, `Terminated`, `Restart Signaled`, ...).
    pub kind: Sym,
    pub message: Sym,
    pub details: super::Details,
    /// The time of the events that say this, for times an `Event` does
    /// not hold itself (`Event::time`): rare, and a body apiece.
    pub(in crate::lifecycle) when: Option<Box<super::Timestamp>>,
}

impl EventBody {
    /// The shared body with these parts.
    pub fn new(kind: &str, message: &str, details: super::Details) -> Arc<Self> {
        // A new body copies the details' pointers.
        Self::find(kind, message, || details.iter(), None, || details.clone())
    }

    /// The shared body with this text, as a stored record holds it
    /// (`details` sorted by key, keys distinct): what a store's load does
    /// for each of its millions of events. Found by its text, so a body
    /// that exists costs a hash and a compare, and none of its strings is
    /// looked up or counted (a string's count is shared by every core).
    pub fn of_text(kind: &str, message: &str, details: &[(&str, &str)]) -> Arc<Self> {
        let pairs = || details.iter().copied();
        Self::find(kind, message, pairs, None, || {
            super::Details::from_pairs(pairs())
        })
    }

    /// The shared body saying what this one says, with the time `when`
    /// (`None`: without one).
    pub(in crate::lifecycle) fn at(self: Arc<Self>, when: Option<super::Timestamp>) -> Arc<Self> {
        if same_time(self.when.as_deref(), when.as_ref()) {
            return self;
        }
        Self::find(
            &self.kind,
            &self.message,
            || self.details.iter(),
            when,
            || self.details.clone(),
        )
    }

    /// The shared body with this text (details as `pairs` gives them, in
    /// key order) and time `when`, found by their hash; made with
    /// `details` if there is none.
    fn find<'a, I: Iterator<Item = (&'a str, &'a str)>>(
        kind: &str,
        message: &str,
        pairs: impl Fn() -> I,
        when: Option<super::Timestamp>,
        details: impl FnOnce() -> super::Details,
    ) -> Arc<Self> {
        let hash = text_hash(kind, message, pairs(), when.as_ref());
        let same = |b: &Self| {
            let mut given = pairs();
            *b.kind == *kind
                && *b.message == *message
                && b.details.iter().all(|pair| given.next() == Some(pair))
                && given.next().is_none()
                && same_time(b.when.as_deref(), when.as_ref())
        };
        body(hash, same, || Self {
            kind: Sym::new(kind),
            message: Sym::new(message),
            details: details(),
            when: when.map(Box::new),
        })
    }
}

/// A body's hash, from its text: the same for a body made from a report
/// and one read from a record.
fn text_hash<'a>(
    kind: &str,
    message: &str,
    details: impl Iterator<Item = (&'a str, &'a str)>,
    when: Option<&super::Timestamp>,
) -> u64 {
    let mut h = BODIES.hasher.build_hasher();
    kind.hash(&mut h);
    message.hash(&mut h);
    for (key, value) in details {
        key.hash(&mut h);
        value.hash(&mut h);
    }
    when.map(|t| (t.unix_timestamp_nanos(), t.offset()))
        .hash(&mut h);
    h.finish()
}

/// The same instant written the same way: times compare by instant
/// alone, and a body keeps its events' offset as given.
fn same_time(a: Option<&super::Timestamp>, b: Option<&super::Timestamp>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a == b && a.offset() == b.offset(),
        (a, b) => a.is_none() && b.is_none(),
    }
}

/// The shared body with hash `hash` for which `same` holds, through this
/// thread's cache, then the table; made by `make` if there is none.
fn body(
    hash: u64,
    same: impl Fn(&EventBody) -> bool,
    make: impl FnOnce() -> EventBody,
) -> Arc<EventBody> {
    let slot = hash as usize % CACHED;
    let found = RECENT_BODIES.with_borrow(|r| r[slot].as_ref().filter(|b| same(b)).cloned());
    if let Some(found) = found {
        return found;
    }
    let got = BODIES.get_by(hash, |b| same(b), || Arc::new(make()));
    RECENT_BODIES.with_borrow_mut(|r| r[slot] = Some(got.clone()));
    got
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shard's entries keep every tag their table tells them apart by:
    /// the shard depends on neither the hash's top seven bits nor the low
    /// ones a table of a million slots uses, and every shard is used.
    #[test]
    fn the_shard_leaves_the_tables_bits_alone() {
        let mut used = [false; SHARDS];
        let mut rng = fastrand::Rng::with_seed(3);
        for _ in 0..10_000 {
            let h = rng.u64(..);
            used[shard_of(h)] = true;
            assert_eq!(shard_of(h), shard_of(h ^ (0x7f << 57)), "{h:#x}: top bits");
            assert_eq!(
                shard_of(h),
                shard_of(h ^ ((1 << 20) - 1)),
                "{h:#x}: low bits"
            );
        }
        assert!(used.iter().all(|u| *u), "every shard is used");
    }

    #[test]
    fn equal_strings_and_bodies_are_one_allocation() {
        let a = Sym::new("Started");
        let b = Sym::new(&String::from("Started"));
        assert!(Arc::ptr_eq(&a.0, &b.0));
        let details = |v: &str| super::super::Details::from_pairs([("exit_code", v)]);
        let x = EventBody::new("Terminated", "Exit Code: 0", details("0"));
        let y = EventBody::new("Terminated", "Exit Code: 0", details("0"));
        let z = EventBody::new("Terminated", "Exit Code: 0", details("1"));
        assert!(Arc::ptr_eq(&x, &y));
        assert!(!Arc::ptr_eq(&x, &z));
        assert_eq!(x.details.get("exit_code"), Some("0"));
    }

    #[test]
    fn a_body_from_its_text_is_the_one_body_with_that_text() {
        let details = super::super::Details::from_pairs([("a", "1"), ("b", "2")]);
        let x = EventBody::new("Terminated", "Exit Code: 2", details);
        for _ in 0..2 {
            // Once made (or found in the table), once from this thread's cache.
            let y = EventBody::of_text("Terminated", "Exit Code: 2", &[("a", "1"), ("b", "2")]);
            assert!(Arc::ptr_eq(&x, &y));
        }
        // Any part different is another body, never the cached one.
        type Text<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)]);
        let differs: [Text<'_>; 5] = [
            ("Terminated", "Exit Code: 3", &[("a", "1"), ("b", "2")]),
            ("Killed", "Exit Code: 2", &[("a", "1"), ("b", "2")]),
            ("Terminated", "Exit Code: 2", &[("a", "1")]),
            ("Terminated", "Exit Code: 2", &[("a", "1"), ("b", "3")]),
            ("Terminated", "Exit Code: 2", &[("a", "1"), ("c", "2")]),
        ];
        for (kind, message, details) in differs {
            let z = EventBody::of_text(kind, message, details);
            assert!(!Arc::ptr_eq(&x, &z), "{kind} {message} {details:?}");
            assert_eq!((&*z.kind, &*z.message), (kind, message));
            assert!(z.details.iter().eq(details.iter().copied()));
        }
    }

    type Text = (String, String, Vec<(String, String)>);

    /// Texts of few letters, often empty: many with the same
    /// concatenation split differently (`ab`+`c`, `a`+`bc`, ``+`abc`).
    fn any_text() -> impl proptest::strategy::Strategy<Value = Text> {
        use proptest::prelude::*;
        let s = || "[ab]{0,3}";
        (
            s(),
            s(),
            proptest::collection::btree_map(s(), s(), 0..4)
                .prop_map(|d| d.into_iter().collect::<Vec<_>>()),
        )
    }

    fn of_text((kind, message, details): &Text) -> Arc<EventBody> {
        let pairs: Vec<(&str, &str)> = details
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        EventBody::of_text(kind, message, &pairs)
    }

    fn new((kind, message, details): &Text) -> Arc<EventBody> {
        EventBody::new(
            kind,
            message,
            super::super::Details::from_pairs(details.clone()),
        )
    }

    fn says(b: &EventBody, (kind, message, details): &Text) -> bool {
        *b.kind == **kind
            && *b.message == **message
            && b.details
                .iter()
                .eq(details.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            && b.when.is_none()
    }

    proptest::proptest! {
        /// Bodies made either way are one allocation exactly when their
        /// texts are equal, and each says its own text: never one with
        /// the same letters split otherwise, whatever the cache holds.
        #[test]
        fn a_body_is_its_text_whichever_way_it_is_made(
            texts in proptest::collection::vec(any_text(), 1..12)
        ) {
            let bodies: Vec<(Arc<EventBody>, Arc<EventBody>)> =
                texts.iter().map(|t| (of_text(t), new(t))).collect();
            for (t, (x, y)) in texts.iter().zip(&bodies) {
                proptest::prop_assert!(Arc::ptr_eq(x, y), "{:?}", t);
                proptest::prop_assert!(says(x, t), "{:?} says {:?}", t, x);
                // Again, now from this thread's cache.
                proptest::prop_assert!(Arc::ptr_eq(x, &of_text(t)));
                proptest::prop_assert!(Arc::ptr_eq(x, &new(t)));
            }
            for (s, (a, _)) in texts.iter().zip(&bodies) {
                for (t, (b, _)) in texts.iter().zip(&bodies) {
                    proptest::prop_assert_eq!(Arc::ptr_eq(a, b), s == t, "{:?} {:?}", s, t);
                    proptest::prop_assert_eq!(**a == **b, s == t);
                }
            }
        }
    }

    #[test]
    fn the_same_letters_split_otherwise_are_another_body() {
        type Parts<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)]);
        let texts: [Parts<'_>; 8] = [
            ("ab", "c", &[]),
            ("a", "bc", &[]),
            ("", "abc", &[]),
            ("abc", "", &[]),
            ("", "", &[("ab", "c")]),
            ("", "", &[("a", "bc")]),
            ("", "", &[("", "abc")]),
            ("", "", &[("a", ""), ("b", "c")]),
        ];
        let bodies: Vec<Arc<EventBody>> = texts
            .iter()
            .map(|(k, m, d)| EventBody::of_text(k, m, d))
            .collect();
        for (i, a) in bodies.iter().enumerate() {
            let (k, m, d) = texts[i];
            assert!((&*a.kind, &*a.message) == (k, m) && a.details.iter().eq(d.iter().copied()));
            for (j, b) in bodies.iter().enumerate() {
                assert_eq!(Arc::ptr_eq(a, b), i == j, "{:?} {:?}", texts[i], texts[j]);
            }
        }
    }

    #[test]
    fn entries_nobody_holds_are_freed_by_a_later_sweep() {
        let table: Table<str> = Table::new();
        let kept: Vec<Arc<str>> = (0..10)
            .map(|i| {
                let s = format!("kept {i}");
                table.get(s.as_str(), || Arc::from(s.as_str()))
            })
            .collect();
        for i in 0..8 * SHARDS * SWEEP_FROM {
            let s = format!("dropped {i}");
            drop(table.get(s.as_str(), || Arc::from(s.as_str())));
        }
        // Swept whenever it doubled: never more than twice what is held
        // plus what came since the last sweep.
        assert!(table.len() <= 3 * SHARDS * SWEEP_FROM, "{}", table.len());
        for (i, k) in kept.iter().enumerate() {
            let again = table.get(format!("kept {i}").as_str(), || unreachable!());
            assert!(Arc::ptr_eq(k, &again), "held entries stay");
        }
    }
}
