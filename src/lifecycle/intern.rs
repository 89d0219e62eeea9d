//! Strings and event bodies stored once per process.
//!
//! Agents send the same few event types, messages and details again and
//! again (`Started`, `Terminated` / `Exit Code: 0`, `exit_code` = `0`), for
//! every task of every allocation. Each distinct string is kept once
//! (`Sym`), and so is each distinct body of an event — its type, message
//! and details (`EventBody`) — so an event in a task's history is a
//! pointer to its body and a time.
//!
//! Reference-counted: a table holds one reference of each entry, and
//! entries nobody else holds are dropped from it once it has doubled since
//! the last sweep, so what is no longer used is freed (the sweep's cost is
//! paid over the inserts that doubled the table).

use std::{
    borrow::Borrow,
    collections::HashSet,
    hash::{Hash, Hasher},
    sync::{Arc, LazyLock, Mutex, PoisonError},
};

/// A table of shared values.
struct Table<T: ?Sized> {
    set: Mutex<Entries<T>>,
}

struct Entries<T: ?Sized> {
    set: HashSet<Arc<T>>,
    /// The table's size after the last sweep.
    swept: usize,
}

/// Sizes below which a table is never swept.
const SWEEP_FROM: usize = 4096;

impl<T: ?Sized + Hash + Eq> Table<T> {
    fn new() -> Self {
        Self {
            set: Mutex::new(Entries {
                set: HashSet::new(),
                swept: 0,
            }),
        }
    }

    /// The shared value equal to `key`, made by `make` if there is none.
    fn get<Q>(&self, key: &Q, make: impl FnOnce() -> Arc<T>) -> Arc<T>
    where
        Arc<T>: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        let mut e = self.set.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(found) = e.set.get(key) {
            return found.clone();
        }
        let made = make();
        e.set.insert(made.clone());
        if e.set.len() >= SWEEP_FROM.max(2 * e.swept) {
            // Only the table can hand out a new reference, and only under
            // this lock: an entry held by the table alone stays unused.
            e.set.retain(|v| Arc::strong_count(v) > 1);
            e.swept = e.set.len();
        }
        made
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.set
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .set
            .len()
    }
}

static STRINGS: LazyLock<Table<str>> = LazyLock::new(Table::new);
static BODIES: LazyLock<Table<EventBody>> = LazyLock::new(Table::new);

/// A string stored once per process.
#[derive(Clone)]
pub struct Sym(Arc<str>);

impl Sym {
    pub fn new(s: &str) -> Self {
        Self(STRINGS.get(s, || Arc::from(s)))
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

impl PartialEq for Sym {
    fn eq(&self, other: &Self) -> bool {
        // Equal strings are one allocation, but a string the table swept
        // and made again can meet an old copy: compare the text then.
        Arc::ptr_eq(&self.0, &other.0) || self.0 == other.0
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

impl Hash for Sym {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.hash(state);
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
/// say it (`EventBody::new`).
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct EventBody {
    /// The event type (`Started`, `Terminated`, `Restart Signaled`, ...).
    pub kind: Sym,
    pub message: Sym,
    pub details: super::Details,
}

impl EventBody {
    /// The shared body with these parts.
    pub fn new(kind: &str, message: &str, details: super::Details) -> Arc<Self> {
        let body = Self {
            kind: Sym::new(kind),
            message: Sym::new(message),
            details,
        };
        // Looked up by value: the parts are shared already, so a body that
        // exists costs its lookup and nothing else.
        BODIES.get(&body, || Arc::new(body_clone(&body)))
    }
}

/// The table keeps its own copy of a new body (its parts are shared, so
/// this copies pointers).
fn body_clone(b: &EventBody) -> EventBody {
    EventBody {
        kind: b.kind.clone(),
        message: b.message.clone(),
        details: b.details.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn entries_nobody_holds_are_freed_by_a_later_sweep() {
        let table: Table<str> = Table::new();
        let kept: Vec<Arc<str>> = (0..10)
            .map(|i| {
                let s = format!("kept {i}");
                table.get(s.as_str(), || Arc::from(s.as_str()))
            })
            .collect();
        for i in 0..3 * SWEEP_FROM {
            let s = format!("dropped {i}");
            drop(table.get(s.as_str(), || Arc::from(s.as_str())));
        }
        // Swept whenever it doubled: never more than twice what is held
        // plus what came since the last sweep.
        assert!(table.len() <= 2 * SWEEP_FROM, "{}", table.len());
        for (i, k) in kept.iter().enumerate() {
            let again = table.get(format!("kept {i}").as_str(), || unreachable!());
            assert!(Arc::ptr_eq(k, &again), "held entries stay");
        }
    }
}
