//! Liveness under chaos (issue 43, part 6): agents of tasks under a 3 s
//! TTL that heartbeat every 0.5 s through random replicas while the fault
//! schedule runs, some of them falling silent at a moment drawn from the
//! seed. Every heartbeat is recorded (sent, answered, how); at the end the
//! final state is checked against docs/replicas.md, "Liveness":
//!
//! - no task is declared lost within its TTL after a heartbeat that was
//!   answered 2xx, outside the documented slack (the replica that answered
//!   it killed, paused or cut off from its first member before the lost
//!   decision: then two thirds of the TTL);
//! - a task that fell silent is lost, no later than its TTL and the
//!   decision's slack after its last heartbeat, or after the end of the
//!   faults that overlapped that time (nothing is decided while etcd has
//!   no quorum; a leader change or a run marked again gives a lease a TTL
//!   more);
//! - `Agent Lost` at most once per run, on every replica alike.

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, Instant},
};

use serde::Serialize;
use serde_json::{Value, json};

use super::{
    faults::{Done, Fault},
    workload::{Sent, Shared, run_of, send, send_within},
};

/// The TTL of the liveness tasks (the audit's).
pub const TTL: Duration = Duration::from_secs(3);
/// How often a live agent heartbeats (six a TTL).
pub const BEAT: Duration = Duration::from_millis(500);
/// How long a heartbeat may take to answer: a third of the TTL, as
/// `taskgate agent` gives it.
const BEAT_WITHIN: Duration = Duration::from_secs(1);

/// How late a silent task may be lost past its TTL when etcd works: etcd's
/// expiry check (0.5 s), the lost decision's grace (1 s,
/// `registry::GRACE`), the test cluster's election timeout that a leader
/// change adds to every lease (0.5 s), and a second for the decision's
/// write and the views.
pub const LATE: Duration = Duration::from_secs(3);

/// One heartbeat and its answer.
#[derive(Clone, Debug, Serialize)]
pub struct Beat {
    pub replica: usize,
    /// Microseconds since the start.
    pub sent: u64,
    pub done: u64,
    /// `204`, `503 store_unavailable`, `409 task_lost`, `timeout`, ...
    pub result: String,
}

impl Beat {
    fn taken(&self) -> bool {
        self.result.starts_with('2')
    }
}

/// What one agent did.
#[derive(Clone, Debug, Serialize)]
pub struct Agent {
    pub alloc: String,
    /// When its task was acknowledged `running` (microseconds).
    pub running: Option<u64>,
    /// When it meant to fall silent (`None`: it heartbeats to the end).
    pub silent_at: Option<u64>,
    pub beats: Vec<Beat>,
    /// What broke a promise while it ran (a refusal of a valid request).
    pub violations: Vec<String>,
}

/// The spec of a liveness task's allocation.
fn spec() -> Value {
    json!({"tasks": [{"name": "web", "liveness": {"ttl": format!("{}s", TTL.as_secs())}}]})
}

/// Runs agent `k`: registers `live{k}`, makes its task running, then
/// heartbeats every `BEAT` through a random replica until `stop` (or its
/// `silent_at`, or a 409 `task_lost`).
pub async fn agent(
    k: usize,
    seed: u64,
    silent_at: Option<Duration>,
    shared: Arc<Shared>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> Agent {
    let stopped = || stop.load(std::sync::atomic::Ordering::SeqCst);
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut rec = Agent {
        alloc: format!("live{k}"),
        running: None,
        silent_at: silent_at.map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX)),
        beats: Vec::new(),
        violations: Vec::new(),
    };
    let alloc = rec.alloc.clone();
    // Registered and running, whatever the faults: a client's retries.
    let mut run: Option<String> = None;
    let key = format!("live-running-{k}");
    for step in ["register", "running"] {
        loop {
            if stopped() {
                return rec;
            }
            let url = shared.url(rng.usize(..shared.replicas()));
            let req = match step {
                "register" => shared
                    .http
                    .put(format!("{url}/v1/allocations/{alloc}"))
                    .json(&spec()),
                _ => shared
                    .http
                    .put(format!("{url}/v1/allocations/{alloc}/tasks/web/state"))
                    .header("idempotency-key", &key)
                    .json(&json!({"state": "running"})),
            };
            match send(req).await {
                Sent::Answer(a) if (200..300).contains(&a.status) => {
                    if step == "running" {
                        run = run_of(&a.body, "web");
                        rec.running = Some(shared.now());
                    }
                    break;
                }
                // An earlier attempt landed; its answer was lost.
                Sent::Answer(a) if a.status == 409 && a.body["code"] == "task_claimed" => {
                    run = a.body["run"].as_str().map(str::to_owned);
                    rec.running = Some(shared.now());
                    break;
                }
                Sent::Answer(a) if a.status < 500 => {
                    rec.violations.push(format!(
                        "{alloc}: {step} through {url} was refused: {} {}",
                        a.status, a.body
                    ));
                    return rec;
                }
                // A client's pause before it tries again.
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }
    let silent = silent_at.map(|d| shared.start + d);
    let mut beats = tokio::time::interval(BEAT);
    beats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        beats.tick().await;
        if stopped() || silent.is_some_and(|at| Instant::now() >= at) {
            return rec;
        }
        let replica = rng.usize(..shared.replicas());
        let url = shared.url(replica);
        let mut req = shared
            .http
            .put(format!("{url}/v1/allocations/{alloc}/tasks/web/heartbeat"));
        if let Some(run) = &run {
            req = req.header("taskgate-run", run);
        }
        let sent = shared.now();
        let answer = send_within(req, BEAT_WITHIN).await;
        let done = shared.now();
        let (result, lost) = match answer {
            Sent::Answer(a) => {
                let code = a.body["code"].as_str().unwrap_or_default().to_owned();
                (
                    format!("{} {code}", a.status).trim().to_owned(),
                    code == "task_lost",
                )
            }
            Sent::Lost { timed_out, why } => (
                if timed_out {
                    "timeout".to_owned()
                } else {
                    format!("connection: {why}")
                },
                false,
            ),
        };
        rec.beats.push(Beat {
            replica,
            sent,
            done,
            result,
        });
        if lost {
            // An agent told its task is lost stops (the check says
            // whether it should have been).
            return rec;
        }
    }
}

/// A liveness task as a replica holds it at the end.
struct Held {
    lost_at: Option<u64>,
    /// `Agent Lost` events.
    lost_events: usize,
}

/// Microseconds since the start of an RFC 3339 time.
fn since_start(at: &str, wall: time::OffsetDateTime) -> Option<u64> {
    let t = time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339).ok()?;
    u64::try_from((t - wall).whole_microseconds()).ok()
}

fn held(alloc: &Value, wall: time::OffsetDateTime) -> Option<Held> {
    let task = alloc["tasks"].as_array()?.first()?;
    // A lost task is dead: `finished_at` is when it was declared lost.
    let lost = task["lost"] == true;
    Some(Held {
        lost_at: task["finished_at"]
            .as_str()
            .filter(|_| lost)
            .and_then(|t| since_start(t, wall)),
        lost_events: task["events"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["type"] == "Agent Lost")
            .count(),
    })
}

fn secs(us: u64) -> f64 {
    us as f64 / 1e6
}

fn us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Whether replica `r` was itself cut off in `[from, to]`: killed,
/// paused, or its first member's answers held back (docs/replicas.md: a
/// 2xx then promises two thirds of the TTL).
fn cut_off(faults: &[Done], r: usize, from: u64, to: u64) -> bool {
    faults.iter().any(|d| {
        let theirs = match d.step.fault {
            Fault::KillReplica { replica }
            | Fault::PauseReplica { replica }
            | Fault::StallAnswers { replica } => replica == r,
            _ => false,
        };
        theirs && d.began <= to && d.healed >= from
    })
}

/// The latest moment a task silent since `quiet` may be lost: its TTL and
/// `LATE` after it, or after the end of the faults overlapping that
/// window (each gives at most a TTL more once it is healed).
fn lost_by(faults: &[Done], quiet: u64) -> u64 {
    let mut from = quiet;
    loop {
        let by = from + us(TTL + LATE);
        let later = faults
            .iter()
            .filter(|d| d.began <= by && d.settled.unwrap_or(d.healed) >= from)
            .map(|d| d.settled.unwrap_or(d.healed))
            .max()
            .unwrap_or(from)
            .max(from);
        if later == from {
            return by;
        }
        from = later;
    }
}

/// Every violation of the liveness promises in the agents' records and
/// the replicas' final state (each replica's allocations by ID).
pub fn check(
    agents: &[Agent],
    faults: &[Done],
    replicas: &[BTreeMap<String, Value>],
    wall: time::OffsetDateTime,
) -> Vec<String> {
    let mut out = Vec::new();
    for agent in agents {
        out.extend(agent.violations.iter().cloned());
        let id = &agent.alloc;
        let Some(running) = agent.running else {
            continue;
        };
        let mut seen: Vec<(usize, Held)> = Vec::new();
        for (r, allocs) in replicas.iter().enumerate() {
            match allocs.get(id).and_then(|a| held(a, wall)) {
                Some(h) => seen.push((r, h)),
                None => out.push(format!("{id}: replica {r} does not hold it")),
            }
        }
        for (r, h) in &seen {
            let once = usize::from(h.lost_at.is_some());
            if h.lost_events != once {
                out.push(format!(
                    "{id}: replica {r} holds {} `Agent Lost` events for one run (lost: {})",
                    h.lost_events,
                    h.lost_at.is_some()
                ));
            }
        }
        let lost: Vec<Option<u64>> = seen.iter().map(|(_, h)| h.lost_at).collect();
        if lost.windows(2).any(|w| w[0] != w[1]) {
            out.push(format!(
                "{id}: the replicas disagree on when it was lost: {lost:?}"
            ));
        }
        let lost_at = lost.first().copied().flatten();
        // Not lost within a TTL of a heartbeat answered 2xx.
        if let Some(at) = lost_at {
            let early: Vec<&Beat> = agent
                .beats
                .iter()
                .filter(|b| b.taken() && b.sent < at)
                .filter(|b| {
                    let slack = if cut_off(faults, b.replica, b.sent, at) {
                        TTL / 3
                    } else {
                        Duration::ZERO
                    };
                    at < b.sent + us(TTL - slack)
                })
                .collect();
            if let Some(b) = early.last() {
                out.push(format!(
                    "{id}: declared lost at {:.3} s, {:.3} s after a heartbeat sent at {:.3} s \
                     that replica {} answered {} ({} such heartbeats within the TTL)",
                    secs(at),
                    secs(at - b.sent),
                    secs(b.sent),
                    b.replica,
                    b.result,
                    early.len()
                ));
            }
        }
        // A silent task is lost in time.
        if let Some(silent) = agent.silent_at {
            let quiet = agent
                .beats
                .iter()
                .map(|b| b.sent)
                .filter(|&s| s < silent)
                .max()
                .unwrap_or(running)
                .max(running);
            let by = lost_by(faults, quiet);
            match lost_at {
                None => out.push(format!(
                    "{id}: silent since {:.3} s and never declared lost",
                    secs(quiet)
                )),
                Some(at) if at > by => out.push(format!(
                    "{id}: silent since {:.3} s, declared lost at {:.3} s, later than {:.3} s \
                     (its TTL and {LATE:?} after it, or after the faults that overlapped)",
                    secs(quiet),
                    secs(at),
                    secs(by)
                )),
                Some(_) => {}
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    //! The liveness checker on made-up records.

    use super::*;
    use crate::faults::Step;

    fn wall() -> time::OffsetDateTime {
        time::macros::datetime!(2030-01-01 00:00 UTC)
    }

    fn at(s: f64) -> u64 {
        (s * 1e6) as u64
    }

    fn beat(replica: usize, sent: f64, result: &str) -> Beat {
        Beat {
            replica,
            sent: at(sent),
            done: at(sent) + 1000,
            result: result.into(),
        }
    }

    fn agent(beats: Vec<Beat>, silent_at: Option<f64>) -> Agent {
        Agent {
            alloc: "live0".into(),
            running: Some(at(1.0)),
            silent_at: silent_at.map(at),
            beats,
            violations: Vec::new(),
        }
    }

    /// Each replica holds `live0` lost at `lost` (seconds), with `events`
    /// `Agent Lost` events.
    fn replicas(lost: Option<f64>, events: usize) -> Vec<BTreeMap<String, Value>> {
        let lost_at = lost.map(|s| {
            (wall() + Duration::from_secs_f64(s))
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap()
        });
        let evs: Vec<Value> = (0..events).map(|_| json!({"type": "Agent Lost"})).collect();
        let a = json!({"tasks": [{
            "name": "web",
            "lost": lost.is_some(),
            "finished_at": lost_at,
            "events": evs,
        }]});
        (0..3)
            .map(|_| BTreeMap::from([("live0".to_owned(), a.clone())]))
            .collect()
    }

    fn fault(fault: Fault, began: f64, healed: f64) -> Done {
        Done {
            step: Step {
                fault,
                hold_ms: 0,
                calm_ms: 0,
            },
            began: at(began),
            healed: at(healed),
            settled: Some(at(healed + 0.5)),
            detail: String::new(),
        }
    }

    #[test]
    fn a_task_heard_to_the_end_and_a_silent_one_lost_in_time_pass() {
        let beats = (0..20)
            .map(|i| beat(i % 3, 2.0 + 0.5 * i as f64, "204"))
            .collect();
        assert_eq!(
            check(&[agent(beats, None)], &[], &replicas(None, 0), wall()),
            Vec::<String>::new()
        );
        let beats: Vec<Beat> = (0..4)
            .map(|i| beat(0, 2.0 + 0.5 * i as f64, "204"))
            .collect();
        // Silent after 3.5 s: lost between 6.5 s and 9.5 s.
        let a = agent(beats, Some(3.7));
        assert!(
            check(
                std::slice::from_ref(&a),
                &[],
                &replicas(Some(8.0), 1),
                wall()
            )
            .is_empty()
        );
        let late = check(&[a], &[], &replicas(Some(10.0), 1), wall());
        assert!(late[0].contains("later than 9.500 s"), "{late:?}");
    }

    #[test]
    fn a_loss_within_a_ttl_of_an_answered_heartbeat_is_named() {
        let beats = vec![beat(1, 2.0, "204"), beat(2, 2.5, "503 store_unavailable")];
        let v = check(
            &[agent(beats.clone(), None)],
            &[],
            &replicas(Some(4.0), 1),
            wall(),
        );
        assert!(
            v[0].contains("2.000 s after a heartbeat sent at 2.000 s that replica 1 answered 204"),
            "{v:?}"
        );
        // An answer of 503 promises nothing.
        let v = check(
            &[agent(beats[1..].to_vec(), None)],
            &[],
            &replicas(Some(4.0), 1),
            wall(),
        );
        assert!(v.is_empty(), "{v:?}");
        // The replica that answered was killed: two thirds of the TTL.
        let killed = [fault(Fault::KillReplica { replica: 1 }, 2.2, 4.0)];
        assert!(
            check(
                &[agent(beats.clone(), None)],
                &killed,
                &replicas(Some(4.1), 1),
                wall()
            )
            .is_empty()
        );
        let v = check(
            &[agent(beats, None)],
            &killed,
            &replicas(Some(3.9), 1),
            wall(),
        );
        assert_eq!(v.len(), 1, "{v:?}");
    }

    #[test]
    fn a_silent_task_never_lost_twice_lost_or_lost_late_is_named() {
        let a = agent(vec![beat(0, 2.0, "204")], Some(2.2));
        let v = check(std::slice::from_ref(&a), &[], &replicas(None, 0), wall());
        assert!(v[0].contains("never declared lost"), "{v:?}");
        let v = check(
            std::slice::from_ref(&a),
            &[],
            &replicas(Some(6.0), 2),
            wall(),
        );
        assert_eq!(v.len(), 3, "one per replica: {v:?}");
        assert!(v[0].contains("2 `Agent Lost` events"), "{v:?}");
        // A quorum lost over its TTL: lost by its end, a TTL and LATE.
        let quorum = [fault(Fault::LoseQuorum, 3.0, 9.0)];
        assert!(
            check(
                std::slice::from_ref(&a),
                &quorum,
                &replicas(Some(14.0), 1),
                wall()
            )
            .is_empty()
        );
        let v = check(&[a], &quorum, &replicas(Some(16.0), 1), wall());
        assert!(v[0].contains("later than 15.500 s"), "{v:?}");
    }
}
