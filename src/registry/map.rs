//! Allocation ID → handle.

use std::{
    collections::{BTreeSet, HashSet},
    ops::Bound,
    sync::Arc,
};

use super::handle::Handle;
use crate::lifecycle::AllocId;

/// Allocation ID → handle: a hash map for the lookup every request makes
/// (constant time, where a B-tree of a million string keys costs dozens of
/// cache misses), and the IDs in order for listing.
#[derive(Default)]
pub(super) struct AllocMap {
    /// Keyed by the ID each handle holds (`ByHandleId`): the table holds
    /// one pointer per allocation, and a lookup reads the ID from the
    /// handle it goes on to use.
    /// foldhash, seeded per process: several times SipHash's speed on
    /// IDs, which clients still cannot aim collisions at.
    by_id: HashSet<ByHandleId, foldhash::fast::RandomState>,
    ids: BTreeSet<AllocId>,
}

/// A handle in the registry's map, hashed and compared by its ID.
struct ByHandleId(Arc<Handle>);

impl std::hash::Hash for ByHandleId {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // As the `str` it is looked up by hashes (`Borrow` requires it).
        self.0.id().hash(state);
    }
}

impl PartialEq for ByHandleId {
    fn eq(&self, other: &Self) -> bool {
        self.0.id() == other.0.id()
    }
}

impl Eq for ByHandleId {}

impl std::borrow::Borrow<str> for ByHandleId {
    fn borrow(&self) -> &str {
        self.0.id()
    }
}

impl AllocMap {
    /// From entries in ID order (as stores load them).
    // A handle is hashed by its ID, which never changes (its other fields
    // are the mutable part).
    #[allow(clippy::mutable_key_type)]
    pub(super) fn from_sorted(entries: impl Iterator<Item = (AllocId, Arc<Handle>)>) -> Self {
        let mut by_id = HashSet::with_hasher(foldhash::fast::RandomState::default());
        let ids = entries
            .map(|(id, handle)| {
                by_id.insert(ByHandleId(handle));
                id
            })
            .collect();
        Self { by_id, ids }
    }

    pub(super) fn get(&self, id: &str) -> Option<&Arc<Handle>> {
        self.by_id.get(id).map(|h| &h.0)
    }

    /// Adds `handle` (for `id`, which it holds), replacing one there.
    pub(super) fn insert(&mut self, id: AllocId, handle: Arc<Handle>) {
        debug_assert_eq!(handle.id(), id.as_str());
        if self.by_id.replace(ByHandleId(handle)).is_none() {
            self.ids.insert(id);
        }
    }

    pub(super) fn remove(&mut self, id: &str) {
        if self.by_id.remove(id) {
            self.ids.remove(id);
        }
    }

    pub(super) fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Makes the ID index agree with the handles again (after a panic
    /// between updating one and the other).
    pub(super) fn repair(&mut self) {
        self.ids = self
            .by_id
            .iter()
            .filter_map(|h| AllocId::parse(h.0.id()).ok())
            .collect();
    }

    /// How many IDs start with `prefix`, counted up to `limit`.
    pub(super) fn count_prefix(&self, prefix: &str, limit: usize) -> usize {
        self.ids
            .range::<str, _>((Bound::Included(prefix), Bound::Unbounded))
            .take_while(|id| id.as_str().starts_with(prefix))
            .take(limit)
            .count()
    }

    /// Entries in ID order from `from` (inclusive).
    pub(super) fn range_from<'a>(
        &'a self,
        from: &str,
    ) -> impl Iterator<Item = (&'a AllocId, &'a Arc<Handle>)> {
        self.ids
            .range::<str, _>((Bound::Included(from), Bound::Unbounded))
            .map(|id| {
                (
                    id,
                    &self.by_id.get(id.as_str()).expect("ids and by_id agree").0,
                )
            })
    }
}

#[cfg(test)]
impl AllocMap {
    /// Inserts `handle` into the hash map only (as a writer that dies half
    /// way would).
    pub(super) fn insert_handle_only(&mut self, handle: Arc<Handle>) {
        self.by_id.insert(ByHandleId(handle));
    }

    /// Whether the two structures hold the same allocations.
    pub(super) fn agrees(&self) -> bool {
        self.ids.len() == self.by_id.len()
    }
}
