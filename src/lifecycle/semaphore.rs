//! Semaphores: at most `limit` tasks at once, across allocations
//! (docs/lifecycle.md, "Semaphores"). A semaphore is a named server object;
//! a task spec names the ones it acquires (`acquire`), and the task's
//! record says where it stands with them (`Hold`). The registry decides
//! the grants (`registry/gates.rs`); this file holds the values only.

use std::time::Duration;

use super::{SemName, Timestamp};

/// Fewest and most slots a semaphore may have.
pub const LIMIT_RANGE: (u32, u32) = (1, 10_000);

/// Shortest and longest time a granted task may take to become `running`.
pub const GRANT_TIMEOUT_RANGE: (Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(24 * 3600));

/// The grant timeout of a semaphore created without one.
pub const DEFAULT_GRANT_TIMEOUT: Duration = Duration::from_secs(60);

/// Most semaphores one task may acquire.
pub const MAX_ACQUIRE: usize = 4;

/// A semaphore as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Semaphore {
    pub name: SemName,
    /// How many tasks may hold it at once.
    pub limit: u32,
    /// How long a granted task may take to become `running` before its
    /// grant lapses (it goes to the back of the queue).
    pub grant_timeout: Duration,
    /// The index of the change that created it.
    pub create_index: u64,
    /// The index of the change that last wrote it. On a store several
    /// replicas write, every grant of it writes it again (so that two
    /// grants decided on one view cannot both take): then it moves with
    /// each grant too.
    pub modify_index: u64,
}

impl Semaphore {
    /// Replaces the index `from` with `to` where a change stamped it (its
    /// `modify_index`, and its `create_index` when it was created by it).
    pub fn restamp(&mut self, from: u64, to: u64) {
        for index in [&mut self.create_index, &mut self.modify_index] {
            if *index == from {
                *index = to;
            }
        }
    }
}

/// Where a task that acquires semaphores stands with them (kept in its
/// record; none for a task that is not in line).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    /// Otherwise allowed since the change at index `since` (made at
    /// `at`): in line for every semaphore it names. The queues are ordered
    /// by `since`, the same order in every semaphore.
    Queued { since: u64, at: Timestamp },
    /// Granted all of its semaphores by the change at index `fence` (each
    /// semaphore's fence for this grant: the store's index grows with every
    /// change and is never reused), at `at`.
    Granted { fence: u64, at: Timestamp },
}
