//! Barriers: tasks of several allocations start together, or not at all
//! (docs/lifecycle.md, "Barriers"). A task spec names its barrier and the
//! barrier's size; the task's record says where it stands with it
//! (`Meet`). The registry decides openings and timeouts
//! (`registry/gates.rs`); this file holds the values only.

use std::time::Duration;

use super::{SemName, Timestamp};

/// Fewest and most members a barrier may have.
pub const SIZE_RANGE: (u16, u16) = (2, 1000);

/// Shortest and longest time a barrier may gather.
pub const BARRIER_TIMEOUT_RANGE: (Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(7 * 24 * 3600));

/// A task's `barrier`, as registered.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BarrierSpec {
    /// Names as allocation IDs (and semaphores) have.
    pub name: SemName,
    /// How many tasks open it, together.
    pub size: u16,
    /// How long it may gather, from the earliest arrival among the
    /// members counted, before every member's allocation is told to stop;
    /// `None`: for ever.
    pub timeout: Option<Duration>,
}

/// Where a member stands with its barrier (kept in its record; none for a
/// member that has not arrived).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Meet {
    /// Otherwise allowed since `at`: counted among the arrived.
    Arrived { at: Timestamp },
    /// The barrier opened at `at`: the member is never held by it again.
    Passed { at: Timestamp },
    /// The barrier timed out at `at` before it opened: the member never
    /// passes it.
    Closed { at: Timestamp },
}

impl Meet {
    /// Whether the barrier decided (opened or timed out) for this member.
    pub fn decided(self) -> bool {
        !matches!(self, Meet::Arrived { .. })
    }
}
