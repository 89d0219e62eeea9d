//! The history checker: what the clients recorded (every report, with
//! when it was sent, when it was answered and how) against what the
//! replicas and etcd hold at the end, once every fault is healed and every
//! replica's view has reached etcd's revision. Pure: it reads records and
//! returns violations, each a sentence naming the event, the replicas and
//! the indexes.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;
use serde_json::Value;
use taskgate::lifecycle::MAX_EVENTS;

use super::workload::{Outcome, Registration, Report, events_of};

/// etcd's allocation keys: ID → (create revision, mod revision).
pub type Keys = BTreeMap<String, (u64, u64)>;

/// What the system holds at the end.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Final {
    /// Each replica's allocations by ID, as `GET /v1/allocations/{id}`
    /// answers them, with the fields a replica may answer alone removed
    /// (`strip`).
    pub replicas: Vec<BTreeMap<String, Value>>,
    /// etcd's keys under the prefix: allocation ID → (create revision, mod
    /// revision).
    pub etcd: Keys,
    /// etcd's revision when it was read (every replica's view reached it).
    pub revision: u64,
}

/// Removes what a replica answers from its own knowledge rather than the
/// record: `last_seen`, the latest sign of life this replica has heard for
/// a task under a TTL (docs/api.md; the workload's tasks have none, so it
/// is null, but it is not the record's to compare).
pub fn strip(mut alloc: Value) -> Value {
    if let Some(tasks) = alloc["tasks"].as_array_mut() {
        for t in tasks {
            if let Some(t) = t.as_object_mut() {
                t.remove("last_seen");
            }
        }
    }
    alloc
}

/// The first place two JSON values differ, as a path.
fn differ(a: &Value, b: &Value, path: &str) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for k in x.keys().chain(y.keys()) {
                let (u, v) = (&x.get(k), &y.get(k));
                match (u, v) {
                    (Some(u), Some(v)) => {
                        if let Some(p) = differ(u, v, &format!("{path}.{k}")) {
                            return Some(p);
                        }
                    }
                    _ => return Some(format!("{path}.{k}: {u:?} vs {v:?}")),
                }
            }
            None
        }
        (Value::Array(x), Value::Array(y)) => {
            for (i, (u, v)) in x.iter().zip(y).enumerate() {
                if let Some(p) = differ(u, v, &format!("{path}[{i}]")) {
                    return Some(p);
                }
            }
            (x.len() != y.len()).then(|| format!("{path}: {} items vs {}", x.len(), y.len()))
        }
        _ => (a != b).then(|| format!("{path}: {a} vs {b}")),
    }
}

/// Every violation the final state and the history show. The
/// allocations of `others` (the liveness agents', `liveness.rs`) are
/// checked as every allocation is (the same on every replica, as etcd
/// holds them), not against the reports.
pub fn check(
    reports: &[Report],
    registrations: &[Registration],
    fin: &Final,
    others: &std::collections::BTreeSet<String>,
) -> Vec<String> {
    let mut out = Vec::new();
    same_everywhere(fin, &mut out);
    as_etcd_holds(fin, &mut out);
    registered_once(registrations, fin, &mut out);
    acknowledged_never_went_back(reports, fin, &mut out);
    real_time_order_of_indexes(reports, &mut out);
    // The events, on every replica; a violation seen on several is said
    // once, naming them.
    let mut seen: Vec<(String, Vec<usize>)> = Vec::new();
    for (r, allocs) in fin.replicas.iter().enumerate() {
        let mut mine = Vec::new();
        let allocs: BTreeMap<String, Value> = allocs
            .iter()
            .filter(|(id, _)| !others.contains(*id))
            .map(|(id, a)| (id.clone(), a.clone()))
            .collect();
        events(reports, registrations, &allocs, &mut mine);
        for v in mine {
            match seen.iter_mut().find(|(s, _)| *s == v) {
                Some((_, on)) => on.push(r),
                None => seen.push((v, vec![r])),
            }
        }
    }
    let all = fin.replicas.len();
    for (v, on) in seen {
        if on.len() == all {
            out.push(v);
        } else {
            out.push(format!("{v} (on replicas {on:?} only)"));
        }
    }
    out
}

/// The replicas answer the same allocations, identically.
fn same_everywhere(fin: &Final, out: &mut Vec<String>) {
    let Some(first) = fin.replicas.first() else {
        return;
    };
    for (r, other) in fin.replicas.iter().enumerate().skip(1) {
        for id in first.keys().chain(other.keys()) {
            match (first.get(id), other.get(id)) {
                (Some(a), Some(b)) => {
                    if let Some(at) = differ(a, b, id) {
                        out.push(format!(
                            "replicas 0 and {r} answer allocation {id} differently: {at}"
                        ));
                    }
                }
                (a, _) => out.push(format!(
                    "allocation {id} is on replica {} and not on replica {}",
                    if a.is_some() { 0 } else { r },
                    if a.is_some() { r } else { 0 },
                )),
            }
        }
    }
}

/// Each allocation's indexes are its key's revisions in etcd, and the
/// replicas hold exactly etcd's keys.
fn as_etcd_holds(fin: &Final, out: &mut Vec<String>) {
    for (r, allocs) in fin.replicas.iter().enumerate() {
        for (id, a) in allocs {
            let (modify, create) = (a["modify_index"].as_u64(), a["create_index"].as_u64());
            match fin.etcd.get(id) {
                None => out.push(format!(
                    "replica {r} holds allocation {id} (modify_index {modify:?}), etcd has no key \
                     for it"
                )),
                Some(&(c, m)) => {
                    if modify != Some(m) || create != Some(c) {
                        out.push(format!(
                            "replica {r}: allocation {id} has create_index {create:?} and \
                             modify_index {modify:?}; its key in etcd was created at revision {c} \
                             and modified at {m}"
                        ));
                    }
                }
            }
        }
        for id in fin.etcd.keys() {
            if !allocs.contains_key(id) {
                out.push(format!(
                    "etcd holds allocation {id}; replica {r} does not answer it"
                ));
            }
        }
    }
}

/// One 201 per allocation at most; every registration answered with the
/// allocation etcd created.
fn registered_once(registrations: &[Registration], fin: &Final, out: &mut Vec<String>) {
    let mut created: BTreeMap<&str, Vec<&Registration>> = BTreeMap::new();
    for g in registrations {
        if g.status == 201 {
            created.entry(&g.alloc).or_default().push(g);
        }
        match fin.etcd.get(&g.alloc) {
            Some(&(c, _)) if c == g.create_index => {}
            found => out.push(format!(
                "registering {} through replica {} was answered {} with create_index {}; etcd's \
                 key was created at revision {:?}",
                g.alloc,
                g.replica,
                g.status,
                g.create_index,
                found.map(|&(c, _)| c)
            )),
        }
    }
    for (alloc, regs) in created {
        if regs.len() > 1 {
            let by: Vec<String> = regs
                .iter()
                .map(|g| format!("worker {} through replica {}", g.worker, g.replica))
                .collect();
            out.push(format!(
                "allocation {alloc} was answered 201 (created) {} times: {}",
                regs.len(),
                by.join(", ")
            ));
        }
    }
}

/// An allocation's index now is at least every index a report to it was
/// acknowledged at.
fn acknowledged_never_went_back(reports: &[Report], fin: &Final, out: &mut Vec<String>) {
    for r in reports {
        let Outcome::Ok { index, replica, .. } = r.outcome else {
            continue;
        };
        if let Some(&(_, m)) = fin.etcd.get(&r.alloc)
            && m < index
        {
            out.push(format!(
                "{}/{}: {} was acknowledged by replica {replica} at index {index}; the \
                 allocation's key is now at revision {m}",
                r.alloc, r.task, r.message
            ));
        }
    }
}

fn secs(us: u64) -> f64 {
    us as f64 / 1e6
}

/// Real time: a report acknowledged before another was sent has the lower
/// index (etcd's revisions are one global order, and the second's commit
/// came after the first's answer), whichever allocations they were for.
fn real_time_order_of_indexes(reports: &[Report], out: &mut Vec<String>) {
    let mut acked: Vec<(u64, u64, &Report)> = reports
        .iter()
        .filter_map(|r| match (&r.outcome, r.completed) {
            (Outcome::Ok { index, .. }, Some(done)) => Some((done, *index, r)),
            _ => None,
        })
        .collect();
    acked.sort_by_key(|&(done, index, _)| (done, index));
    // The report with the highest index among those answered so far.
    let mut highest: Vec<usize> = Vec::with_capacity(acked.len());
    for (i, &(_, index, _)) in acked.iter().enumerate() {
        let best = match highest.last() {
            Some(&h) if acked[h].1 >= index => h,
            _ => i,
        };
        highest.push(best);
    }
    for &(_, index, b) in &acked {
        // The reports answered before `b` was sent.
        let before = acked.partition_point(|&(done, _, _)| done < b.invoked);
        if before == 0 {
            continue;
        }
        let (done, top, a) = acked[highest[before - 1]];
        if top >= index {
            out.push(format!(
                "real-time order: {} ({}/{}) was acknowledged at index {top} at {:.3} s, before \
                 {} ({}/{}) was sent at {:.3} s, which was acknowledged at index {index}",
                a.message,
                a.alloc,
                a.task,
                secs(done),
                b.message,
                b.alloc,
                b.task,
                secs(b.invoked)
            ));
        }
    }
}

/// How a report went, in a few words, for a violation's message.
fn told(r: &Report) -> String {
    let outcome = match &r.outcome {
        Outcome::Ok { index, replica, .. } => {
            format!("acknowledged by replica {replica} at index {index}")
        }
        Outcome::Failed { status, code } => format!("refused {status} {code}"),
        Outcome::Unknown => "never acknowledged".into(),
    };
    let tries: Vec<String> = r
        .attempts
        .iter()
        .map(|a| {
            format!(
                "replica {} at {:.3} s: {}",
                a.replica,
                secs(a.sent),
                a.result
            )
        })
        .collect();
    format!(
        "{outcome}, {} (attempts: {})",
        if r.key.is_some() {
            "keyed"
        } else {
            "without a key"
        },
        tries.join("; ")
    )
}

/// Every event is one that was sent to its task, once; every acknowledged
/// one is there, every refused one is not; acknowledged events of a task
/// are in the order they were acknowledged and sent.
fn events(
    reports: &[Report],
    registrations: &[Registration],
    allocs: &BTreeMap<String, Value>,
    out: &mut Vec<String>,
) {
    let by_message: HashMap<&str, &Report> =
        reports.iter().map(|r| (r.message.as_str(), r)).collect();
    let mut sent: BTreeMap<(&str, &str), Vec<&Report>> = BTreeMap::new();
    for r in reports {
        sent.entry((&r.alloc, &r.task)).or_default().push(r);
    }
    let registered: std::collections::BTreeSet<&str> =
        registrations.iter().map(|g| g.alloc.as_str()).collect();
    for (id, a) in allocs {
        let tried = registered.contains(id.as_str()) || reports.iter().any(|r| r.alloc == *id);
        if !tried {
            out.push(format!("allocation {id} was never registered by anyone"));
        }
        for t in a["tasks"].as_array().into_iter().flatten() {
            let task = t["name"].as_str().unwrap_or_default();
            let history = events_of(a, task).unwrap_or_default();
            if history.len() > MAX_EVENTS {
                out.push(format!(
                    "{id}/{task} holds {} events, more than MAX_EVENTS ({MAX_EVENTS})",
                    history.len()
                ));
            }
            for (pos, m) in history.iter().enumerate() {
                match by_message.get(m.as_str()) {
                    None => out.push(format!(
                        "{id}/{task}: event {m:?} (position {pos}) was never sent by anyone"
                    )),
                    Some(r) if (r.alloc.as_str(), r.task.as_str()) != (id.as_str(), task) => out
                        .push(format!(
                            "{id}/{task}: event {m:?} (position {pos}) was sent to {}/{}",
                            r.alloc, r.task
                        )),
                    Some(_) => {}
                }
            }
            let mine = sent
                .get(&(id.as_str(), task))
                .map(Vec::as_slice)
                .unwrap_or_default();
            if mine.len() > MAX_EVENTS {
                out.push(format!(
                    "the workload sent {} events to {id}/{task}, more than the {MAX_EVENTS} a task \
                     keeps: the check cannot see them all",
                    mine.len()
                ));
            }
            let position = |m: &str| -> Vec<usize> {
                history
                    .iter()
                    .enumerate()
                    .filter(|(_, h)| *h == m)
                    .map(|(i, _)| i)
                    .collect()
            };
            for r in mine {
                let at = position(&r.message);
                match (&r.outcome, at.len()) {
                    (_, n) if n > 1 => out.push(format!(
                        "{id}/{task}: event {} appears {n} times (positions {at:?}); it was {}",
                        r.message,
                        told(r)
                    )),
                    (Outcome::Ok { .. }, 0) => out.push(format!(
                        "{id}/{task}: event {} is lost; it was {}; the task's history: \
                         {history:?}",
                        r.message,
                        told(r)
                    )),
                    (Outcome::Failed { .. }, 1) => out.push(format!(
                        "{id}/{task}: event {} is there (position {}) though it was {}",
                        r.message,
                        at[0],
                        told(r)
                    )),
                    _ => {}
                }
            }
            // Real time within the task: acknowledged A answered before B
            // was sent comes first.
            for a in mine {
                let (Some(done), Some(&pa)) = (a.completed, position(&a.message).first()) else {
                    continue;
                };
                if !matches!(a.outcome, Outcome::Ok { .. }) {
                    continue;
                }
                for b in mine {
                    let Some(&pb) = position(&b.message).first() else {
                        continue;
                    };
                    if matches!(b.outcome, Outcome::Ok { .. }) && done < b.invoked && pb < pa {
                        out.push(format!(
                            "{id}/{task}: {} (acknowledged at {:.3} s) comes after {} (sent at \
                             {:.3} s) in the history {history:?}",
                            a.message,
                            secs(done),
                            b.message,
                            secs(b.invoked)
                        ));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The checker on small made-up histories: each violation it exists
    //! to catch, caught, and a clean history passing.

    use super::*;
    use serde_json::json;

    fn report(message: &str, invoked: u64, outcome: Outcome) -> Report {
        let completed = match outcome {
            Outcome::Unknown => None,
            _ => Some(invoked + 10),
        };
        Report {
            worker: 0,
            alloc: "h0".into(),
            task: "t0".into(),
            message: message.into(),
            key: Some(format!("key-{message}")),
            invoked,
            completed,
            outcome,
            attempts: Vec::new(),
        }
    }

    fn ok(index: u64) -> Outcome {
        Outcome::Ok {
            index,
            replica: 0,
            url: String::new(),
            took: 10,
        }
    }

    fn alloc(events: &[&str], modify: u64) -> Value {
        let events: Vec<Value> = events.iter().map(|m| json!({"message": m})).collect();
        json!({"id": "h0", "create_index": 2, "modify_index": modify,
               "tasks": [{"name": "t0", "events": events, "last_seen": null}]})
    }

    fn fin(events: &[&str], modify: u64) -> Final {
        let one: BTreeMap<String, Value> = [("h0".to_owned(), strip(alloc(events, modify)))].into();
        Final {
            replicas: vec![one.clone(), one.clone(), one],
            etcd: [("h0".to_owned(), (2, modify))].into(),
            revision: modify,
        }
    }

    fn history() -> Vec<Report> {
        vec![
            report("w0/0", 100, ok(3)),
            report("w0/1", 200, Outcome::Unknown),
            report("w0/2", 300, ok(5)),
        ]
    }

    #[test]
    fn a_clean_history_passes() {
        let v = check(
            &history(),
            &[],
            &fin(&["w0/0", "w0/1", "w0/2"], 5),
            &Default::default(),
        );
        assert!(v.is_empty(), "{v:#?}");
        // An unknown report may be absent too.
        let v = check(
            &history(),
            &[],
            &fin(&["w0/0", "w0/2"], 5),
            &Default::default(),
        );
        assert!(v.is_empty(), "{v:#?}");
    }

    #[test]
    fn a_duplicate_is_named() {
        let v = check(
            &history(),
            &[],
            &fin(&["w0/0", "w0/2", "w0/2"], 5),
            &Default::default(),
        );
        assert_eq!(v.len(), 1, "{v:#?}");
        assert!(
            v[0].contains("event w0/2 appears 2 times (positions [1, 2])"),
            "{v:#?}"
        );
        let v = check(
            &history(),
            &[],
            &fin(&["w0/0", "w0/1", "w0/1", "w0/2"], 5),
            &Default::default(),
        );
        assert!(v[0].contains("event w0/1 appears 2 times"), "{v:#?}");
    }

    #[test]
    fn a_lost_acknowledged_event_is_named() {
        let v = check(&history(), &[], &fin(&["w0/2"], 5), &Default::default());
        assert_eq!(v.len(), 1, "{v:#?}");
        assert!(v[0].contains("event w0/0 is lost"), "{v:#?}");
    }

    #[test]
    fn an_event_no_one_sent_is_named() {
        let v = check(
            &history(),
            &[],
            &fin(&["w0/0", "w9/9", "w0/2"], 5),
            &Default::default(),
        );
        assert_eq!(v.len(), 1, "{v:#?}");
        assert!(
            v[0].contains("\"w9/9\" (position 1) was never sent"),
            "{v:#?}"
        );
    }

    #[test]
    fn real_time_order_is_checked_in_the_history_and_the_indexes() {
        let v = check(
            &history(),
            &[],
            &fin(&["w0/2", "w0/0"], 5),
            &Default::default(),
        );
        assert_eq!(v.len(), 1, "{v:#?}");
        assert!(v[0].contains("w0/0 (acknowledged at"), "{v:#?}");
        let mut h = history();
        h[2].outcome = ok(2);
        let v = check(&h, &[], &fin(&["w0/0", "w0/2"], 5), &Default::default());
        assert_eq!(v.len(), 1, "{v:#?}");
        assert!(v[0].starts_with("real-time order: w0/0"), "{v:#?}");
    }

    #[test]
    fn replicas_that_differ_or_disagree_with_etcd_are_named() {
        let mut f = fin(&["w0/0", "w0/2"], 5);
        f.replicas[2] = [("h0".to_owned(), alloc(&["w0/0"], 4))].into();
        let v = check(&history(), &[], &f, &Default::default());
        assert!(
            v.iter()
                .any(|v| v.starts_with("replicas 0 and 2 answer allocation h0 differently")),
            "{v:#?}"
        );
        assert!(
            v.iter().any(|v| v.contains(
                "replica 2: allocation h0 has create_index Some(2) and modify_index Some(4)"
            )),
            "{v:#?}"
        );
        assert!(
            v.iter()
                .any(|v| v.contains("event w0/2 is lost") && v.ends_with("(on replicas [2] only)")),
            "{v:#?}"
        );
    }

    #[test]
    fn a_refused_report_that_landed_and_a_second_creation_are_named() {
        let mut h = history();
        h[1].outcome = Outcome::Failed {
            status: 404,
            code: "allocation_not_found".into(),
        };
        h[1].completed = Some(210);
        let g = |status| Registration {
            worker: 0,
            alloc: "h0".into(),
            replica: 1,
            status,
            create_index: 2,
            at: 0,
        };
        let v = check(
            &h,
            &[g(201), g(201), g(200)],
            &fin(&["w0/0", "w0/1", "w0/2"], 5),
            &Default::default(),
        );
        assert_eq!(v.len(), 2, "{v:#?}");
        assert!(v[0].contains("answered 201 (created) 2 times"), "{v:#?}");
        assert!(
            v[1].contains("event w0/1 is there (position 1) though it was refused 404"),
            "{v:#?}"
        );
    }
}
