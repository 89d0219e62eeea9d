//! The lifecycle coordinator, pure and synchronous.
//!
//! This folder owns every rule of `docs/lifecycle.md`: stages, the coordinator
//! state machine, the gate table, task-report rules, stop orders, restart
//! planning, restore and `waiting_on`. It must not touch tokio, axum, the
//! store or any I/O: time and indexes come in as arguments, so every
//! decision is a plain function of its inputs and is unit-tested here.
//!
//! ```text
//!   register ──▶ init ──(all pending)──▶ prestart ──(ephemerals ok, sidecars up)──▶ main
//!                 ▲                                                                  │
//!                 │ all-tasks restart                              (no main pending) │
//!                 │                                                                  ▼
//!              any state ──(every non-poststop task dead)──▶ poststop ◀── wait_alloc ◀── poststart
//!                                                                (poststart ephemerals dead)
//!
//!  gates open per state   pre_eph  pre_side  main  post_eph  post_side  poststop
//!      init                  .        .       .       .         .          .
//!      prestart              O        O       .       .         .          .
//!      main                  .        O       O       .         .          .
//!      poststart             .        O       O       O         O          .
//!      wait_alloc            .        O       O       .         O          .
//!      poststop              .        .       .       .         .          O
//! ```
//!
//! A restore jumps to `prestart` and evaluates; nothing else moves backwards.

#[macro_use]
mod names;
mod alloc;
mod barrier;
mod coordinator;
mod deps;
mod history;
mod ids;
mod intern;
mod orders;
mod semaphore;
mod spec;
mod task;
mod trouble;

pub use alloc::{
    Allocation, LapsedAt, Overdue, RESTART_EVENT, Refusal, RestartError, RestartMode, SeenAt,
    StageClocks, Step, StopError, UNTIL_TOLD, WRITE_MARKS, WriteMark,
};
pub use barrier::{BARRIER_TIMEOUT_RANGE, BarrierSpec, Meet, SIZE_RANGE};
pub use coordinator::{
    CoordState, WaitFor, evaluate, gates, next_state, wait_for, waiting, waiting_on,
};
pub use deps::{
    Condition, Cycles, DepState, Dependency, MAX_DEPENDENCIES, Node, Positions, Target, Walk, Why,
    cycles, judge as judge_dependency, walk,
};
pub use history::{Events, HistoriesReader, HistoriesWriter};
pub use ids::{AllocId, IdError, SemName, TaskName};
pub use intern::{EventBody, Sym};
pub use names::UnknownName;
pub use orders::{Desired, DesiredKind, Outcome, StopKind, StopReason, desired_states};
pub use semaphore::{
    DEFAULT_GRANT_TIMEOUT, GRANT_TIMEOUT_RANGE, Hold, LIMIT_RANGE, MAX_ACQUIRE, Semaphore,
};
pub use spec::{
    AllocSpec, DEADLINE_RANGE, Deadlines, Hook, Lifecycle, SpecInterner, Stage, TTL_RANGE, TaskSpec,
};
pub use task::{
    Details, Event, EventInput, IdemKey, KeySeen, LOST_EVENT, MAX_KEYS, RunState, TaskExtra,
    TaskReport, TaskStatus,
};
pub use trouble::{ListState, Trouble, TroubleKind};

/// Where in a request a rule was broken, and how. The `field` is a path into
/// the request body (`tasks[1].name`, `tasks.web.event.message`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Size limits on what clients may put into an allocation (DESIGN.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Tasks per allocation.
    pub max_tasks: usize,
    /// Bytes in one event message (and in a restart reason).
    pub max_event_message: usize,
    /// Entries in one event's `details`.
    pub max_event_details: usize,
    /// Bytes in one `details` key, and in one value.
    pub max_detail_key: usize,
    pub max_detail_value: usize,
    /// Bytes in one whole event: its type, message, and every `details`
    /// key and value. With `MAX_EVENTS` kept per task, this bounds what one
    /// task's history can hold.
    pub max_event_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_tasks: 256,
            max_event_message: 4096,
            max_event_details: MAX_EVENT_DETAILS,
            max_detail_key: 128,
            max_detail_value: 1024,
            max_event_bytes: 8192,
        }
    }
}

/// Entries in one event's `details` by default; request decoding stops at
/// the first entry past it.
pub const MAX_EVENT_DETAILS: usize = 32;

/// Events kept per task; the oldest is dropped first.
pub const MAX_EVENTS: usize = 10;

/// Bytes in an event type.
pub const MAX_EVENT_TYPE: usize = 64;

/// Timestamps are UTC instants, rendered as RFC 3339.
pub type Timestamp = time::OffsetDateTime;

#[cfg(test)]
mod properties;
#[cfg(test)]
mod scenarios;
