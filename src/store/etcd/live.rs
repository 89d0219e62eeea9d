//! A task's liveness keys in etcd (docs/replicas.md, "Liveness"): two
//! keys per run of a task under a TTL, both written in the transaction
//! that makes the task `running` and removed in the one that ends its run
//! (or deletes its allocation).
//!
//! ```text
//! <prefix>live/<alloc>/<task>       empty, under the run's lease
//! <prefix>live/<alloc>/<task>/run   the run's mark: {"run": started_at ns,
//!                                   "ttl_ms": TTL, "lease": lease ID}
//! ```
//!
//! The live key goes by itself when its lease expires; the mark stays. So
//! a mark without its live key is a run whose agent fell silent for the
//! lease's TTL, as etcd measured it, and no replica's clock or memory is
//! needed to tell. A running task with no mark for its run (it started
//! before its TTL applied: a default turned on later) is not taken for a
//! silent one: a replica marks it then
//! (`Leases::mark`). Neither allocation IDs nor task names may hold
//! a `/`, so the two keys of a task never meet another task's.

use std::time::Duration;

use super::client::KeyValue;
use crate::{
    lifecycle::{AllocId, TaskName},
    store::{Lease, Liveness, Mark},
};

/// The name of a run's mark, under its task's live key.
const MARK: &[u8] = b"/run";

/// `<prefix>live/<alloc>/`: every liveness key of an allocation.
pub(super) fn of_alloc(live: &[u8], id: &AllocId) -> Vec<u8> {
    let mut key = live.to_vec();
    key.extend_from_slice(id.as_str().as_bytes());
    key.push(b'/');
    key
}

/// `<prefix>live/<alloc>/<task>`: the live key, under the run's lease.
pub(super) fn live_key(live: &[u8], id: &AllocId, task: &TaskName) -> Vec<u8> {
    let mut key = of_alloc(live, id);
    key.extend_from_slice(task.as_str().as_bytes());
    key
}

/// `<prefix>live/<alloc>/<task>/run`: the run's mark.
pub(super) fn mark_key(live: &[u8], id: &AllocId, task: &TaskName) -> Vec<u8> {
    let mut key = live_key(live, id, task);
    key.extend_from_slice(MARK);
    key
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Stored {
    run: i64,
    ttl_ms: u64,
    lease: Lease,
}

pub(super) fn encode(mark: &Mark) -> Vec<u8> {
    serde_json::to_vec(&Stored {
        run: mark.run,
        ttl_ms: u64::try_from(mark.ttl.as_millis()).unwrap_or(u64::MAX),
        lease: mark.lease,
    })
    .expect("three integers encode")
}

fn decode(value: &[u8]) -> Option<Mark> {
    let s: Stored = serde_json::from_slice(value).ok()?;
    Some(Mark {
        run: s.run,
        ttl: Duration::from_millis(s.ttl_ms),
        lease: s.lease,
    })
}

/// What a key under `<prefix>live/` says, written (`deleted` false) or
/// removed; `None` for a key that names no task's liveness (logged).
pub(super) fn read(live: &[u8], kv: &KeyValue, deleted: bool) -> Option<Liveness> {
    let rest = kv.key.get(live.len()..)?;
    let rest = std::str::from_utf8(rest).ok()?;
    let (alloc, rest) = rest.split_once('/')?;
    let id = AllocId::parse(alloc).ok()?;
    let (task, is_mark) = match rest.split_once('/') {
        Some((task, "run")) => (task, true),
        Some(_) => return None,
        None => (rest, false),
    };
    let task = TaskName::parse(task).ok()?;
    Some(if is_mark {
        let mark = if deleted {
            None
        } else {
            match decode(&kv.value) {
                Some(m) => Some(m),
                None => {
                    // Taken as no mark: the run is marked again, which
                    // restarts its clock once rather than losing it.
                    tracing::warn!(
                        key = %String::from_utf8_lossy(&kv.key),
                        "a run's mark in etcd cannot be read; taken as absent"
                    );
                    None
                }
            }
        };
        Liveness::Mark { id, task, mark }
    } else {
        let lease = (!deleted).then_some(kv.lease);
        Liveness::Live { id, task, lease }
    })
}

/// A lease's TTL in etcd's whole seconds: `ttl` rounded up, at least one.
pub fn lease_seconds(ttl: Duration) -> i64 {
    let ms = ttl.as_millis();
    i64::try_from(ms.div_ceil(1000).max(1)).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(key: &str, value: &[u8], lease: i64) -> KeyValue {
        KeyValue {
            key: key.as_bytes().to_vec(),
            mod_revision: 7,
            value: value.to_vec(),
            lease,
        }
    }

    #[test]
    fn keys_name_their_task_and_nothing_else() {
        let live = b"/p/live/";
        let (id, task) = (
            AllocId::parse("web-1").unwrap(),
            TaskName::parse("a.b").unwrap(),
        );
        assert_eq!(live_key(live, &id, &task), b"/p/live/web-1/a.b");
        assert_eq!(mark_key(live, &id, &task), b"/p/live/web-1/a.b/run");
        let mark = Mark {
            run: 1_700_000_000_123_456_789,
            ttl: Duration::from_millis(2500),
            lease: 0x1234,
        };
        let read_back = read(live, &kv("/p/live/web-1/a.b/run", &encode(&mark), 0), false);
        assert_eq!(
            read_back,
            Some(Liveness::Mark {
                id: id.clone(),
                task: task.clone(),
                mark: Some(mark)
            })
        );
        assert_eq!(
            read(live, &kv("/p/live/web-1/a.b", b"", 99), false),
            Some(Liveness::Live {
                id: id.clone(),
                task: task.clone(),
                lease: Some(99)
            })
        );
        assert_eq!(
            read(live, &kv("/p/live/web-1/a.b", b"", 0), true),
            Some(Liveness::Live {
                id,
                task,
                lease: None
            })
        );
        for other in [
            "/p/live/web-1",
            "/p/live/web-1/a/b",
            "/p/live/w b/a",
            "/p/live/x/a/run/x",
        ] {
            assert_eq!(read(live, &kv(other, b"", 0), false), None, "{other}");
        }
    }

    #[test]
    fn leases_are_whole_seconds_rounded_up() {
        assert_eq!(lease_seconds(Duration::from_millis(1)), 1);
        assert_eq!(lease_seconds(Duration::from_secs(1)), 1);
        assert_eq!(lease_seconds(Duration::from_millis(1001)), 2);
        assert_eq!(lease_seconds(Duration::from_millis(2500)), 3);
        assert_eq!(lease_seconds(Duration::from_secs(86_400)), 86_400);
    }
}
