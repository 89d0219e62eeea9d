//! Where the registry reads the time, and times as the atomics of the
//! signs of life keep them.

use time::OffsetDateTime;

use crate::lifecycle::Timestamp;

/// Where the registry reads the time. Tests run it on tokio's clock, which
/// `tokio::time::pause` stops and `advance` moves; the server reads the
/// system's.
#[derive(Clone)]
pub struct Clock(ClockKind);

#[derive(Clone)]
enum ClockKind {
    System,
    /// The wall time at `base`, moved on by tokio's clock since.
    Tokio {
        wall: OffsetDateTime,
        base: tokio::time::Instant,
    },
}

impl Clock {
    pub fn system() -> Self {
        Self(ClockKind::System)
    }

    /// Wall time that follows tokio's clock (for tests with paused time).
    pub fn tokio() -> Self {
        Self(ClockKind::Tokio {
            wall: OffsetDateTime::now_utc(),
            base: tokio::time::Instant::now(),
        })
    }

    pub fn now(&self) -> Timestamp {
        match &self.0 {
            ClockKind::System => OffsetDateTime::now_utc(),
            ClockKind::Tokio { wall, base } => *wall + base.elapsed(),
        }
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::system()
    }
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            ClockKind::System => f.write_str("Clock::system"),
            ClockKind::Tokio { .. } => f.write_str("Clock::tokio"),
        }
    }
}

/// A time as the nanoseconds since the Unix epoch that fit an `i64`
/// (until the year 2262), saturating.
pub(crate) fn nanos(t: Timestamp) -> i64 {
    i64::try_from(t.unix_timestamp_nanos()).unwrap_or(if t.year() < 1970 {
        i64::MIN + 1
    } else {
        i64::MAX - 1
    })
}

pub(crate) fn from_nanos(n: i64) -> Timestamp {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(n)).unwrap_or(OffsetDateTime::UNIX_EPOCH)
}
