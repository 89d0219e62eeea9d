//! The stored form of an allocation record, versioned on its own so the
//! files outlive changes to the in-memory types. Version 1 is JSON: slower
//! than a binary encoding, but a human can read what the snapshot
//! (`snapshot.rs`) and the log (`wal.rs`) hold; both carry these bytes as
//! they are.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::lifecycle::{
    AllocId, AllocSpec, Allocation, CoordState, Limits, TaskSpec, TaskStatus, Timestamp,
};

/// The record format this build writes and reads.
pub const RECORD_VERSION: u32 = 1;

#[derive(Serialize)]
struct RecordOut<'a> {
    v: u32,
    id: &'a AllocId,
    tasks: &'a [TaskSpec],
    state: CoordState,
    status: &'a [TaskStatus],
    create_index: u64,
    modify_index: u64,
    created_at: Timestamp,
    modified_at: Timestamp,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RecordIn {
    v: u32,
    id: AllocId,
    tasks: Vec<TaskSpec>,
    state: CoordState,
    status: Vec<TaskStatus>,
    create_index: u64,
    modify_index: u64,
    created_at: Timestamp,
    modified_at: Timestamp,
}

#[derive(Deserialize)]
struct VersionOnly {
    v: u32,
}

#[cfg(test)]
pub fn encode(a: &Allocation) -> Vec<u8> {
    let mut buf = Vec::new();
    encode_into(a, &mut buf);
    buf
}

/// Appends the record of `a` to `buf`.
pub fn encode_into(a: &Allocation, buf: &mut Vec<u8>) {
    let out = RecordOut {
        v: RECORD_VERSION,
        id: &a.id,
        tasks: a.spec.tasks(),
        state: a.state,
        status: &a.tasks,
        create_index: a.create_index,
        modify_index: a.modify_index,
        created_at: a.created_at,
        modified_at: a.modified_at,
    };
    serde_json::to_writer(buf, &out).expect("an allocation record always serializes");
}

/// Decodes a stored record exactly as it was (no re-evaluation). One parse
/// for a record of this version; the version alone is read only to explain
/// a record that does not decode.
pub fn decode(bytes: &[u8]) -> Result<Allocation, String> {
    let version_error = |version: u32| {
        format!("record format version {version}, but this taskgate reads version {RECORD_VERSION}")
    };
    let r: RecordIn = match serde_json::from_slice::<RecordIn>(bytes) {
        Ok(r) if r.v == RECORD_VERSION => r,
        Ok(r) => return Err(version_error(r.v)),
        Err(e) => {
            return Err(match serde_json::from_slice::<VersionOnly>(bytes) {
                Ok(v) if v.v != RECORD_VERSION => version_error(v.v),
                Ok(_) => format!("bad record: {e}"),
                Err(e) => format!("not a taskgate record: {e}"),
            });
        }
    };
    if r.tasks.len() != r.status.len() {
        return Err(format!(
            "{} tasks but {} task states",
            r.tasks.len(),
            r.status.len()
        ));
    }
    // Stored specs were validated when registered; check them again so a
    // damaged record cannot break the coordinator's assumptions. The limit
    // on the task count is not re-applied: a record registered under a
    // larger configured limit stays readable.
    let limits = Limits {
        max_tasks: usize::MAX,
        ..Limits::default()
    };
    let spec = AllocSpec::new(r.tasks, &limits)
        .map_err(|e| format!("invalid task spec: {}", e[0].message))?;
    Ok(Allocation::from_parts(
        r.id,
        Arc::new(spec),
        r.state,
        r.status,
        r.create_index,
        r.modify_index,
        r.created_at,
        r.modified_at,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifecycle::{Hook, Lifecycle, RunState, TaskName, TaskReport};
    use time::macros::datetime;

    fn sample() -> Allocation {
        let spec = AllocSpec::new(
            vec![
                TaskSpec {
                    name: TaskName::parse("init").unwrap(),
                    lifecycle: Some(Lifecycle {
                        hook: Hook::Prestart,
                        sidecar: false,
                    }),
                    leader: false,
                },
                TaskSpec {
                    name: TaskName::parse("web").unwrap(),
                    lifecycle: None,
                    leader: true,
                },
            ],
            &Limits::default(),
        )
        .unwrap();
        let now = datetime!(2026-11-21 10:00:00.123456789 UTC);
        let a = Allocation::register(AllocId::parse("a1").unwrap(), Arc::new(spec), 3, now);
        let report = TaskReport {
            state: RunState::Dead,
            failed: false,
            event: None,
        };
        a.report(&[(0, report)], now, || 4).unwrap()
    }

    #[test]
    fn a_record_round_trips_exactly() {
        let a = sample();
        assert_eq!(decode(&encode(&a)).unwrap(), a);
    }

    #[test]
    fn an_unknown_version_is_refused_by_name() {
        let mut v: serde_json::Value = serde_json::from_slice(&encode(&sample())).unwrap();
        v["v"] = 2.into();
        let err = decode(&serde_json::to_vec(&v).unwrap()).unwrap_err();
        assert!(err.contains("version 2"), "{err}");
        assert!(decode(b"\x00garbage").is_err());
    }

    #[test]
    fn a_record_is_not_reevaluated_on_load() {
        // A stored state that evaluation would move on is kept as stored.
        let mut a = sample();
        a.state = CoordState::Prestart;
        let back = decode(&encode(&a)).unwrap();
        assert_eq!(back.state, CoordState::Prestart);
    }
}
