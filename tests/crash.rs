//! Crash test: the real binary on a temporary data directory, driven by
//! concurrent clients, SIGKILLed at a random moment, restarted on the same
//! directory, and checked: every acknowledged change is there exactly,
//! nothing is half-applied, and indexes never go back. Repeated `KILLS`
//! times on one directory, so history accumulates across crashes.

mod common;

use std::{
    collections::BTreeMap,
    path::Path,
    sync::{Arc, Mutex},
    time::Duration,
};

use common::process::Server;

use serde_json::{Value, json};

const KILLS: usize = 40;
const CLIENTS: usize = 8;
const ALLOCS_PER_CLIENT: usize = 6;

/// Even rounds fold the store's log into the snapshot every 4 KiB, so
/// kills land before, during and after checkpoints; odd rounds keep the
/// default limit, so their changes live in the log alone until a later
/// round folds them.
fn start(dir: &Path, round: usize) -> Server {
    let limit = if round.is_multiple_of(2) {
        "4KiB"
    } else {
        "64MiB"
    };
    Server::start(&[
        "--data-dir",
        dir.to_str().unwrap(),
        "--store-log-limit",
        limit,
    ])
}

/// What the clients know: per allocation, the last acknowledged value and
/// whether a request on it was in flight when the server died.
#[derive(Clone, Debug, Default)]
struct Known {
    /// `None`: deleted (or never registered).
    acked: Option<Acked>,
    in_flight: bool,
}

#[derive(Clone, Debug)]
struct Acked {
    index: u64,
    state: String,
    /// Per task (name → state, failed, restarts, restart_generation,
    /// modify_index), when the answer carried the full view.
    tasks: Option<BTreeMap<String, Value>>,
}

fn acked_from_view(v: &Value) -> Acked {
    let tasks = v["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["name"].as_str().unwrap().to_owned(),
                json!([
                    t["state"],
                    t["failed"],
                    t["restarts"],
                    t["restart_generation"],
                    t["modify_index"]
                ]),
            )
        })
        .collect();
    Acked {
        index: v["modify_index"].as_u64().unwrap(),
        state: v["coordinator_state"].as_str().unwrap().to_owned(),
        tasks: Some(tasks),
    }
}

type Model = Arc<Mutex<BTreeMap<String, Known>>>;

const TASKS: [&str; 4] = ["init", "side", "web", "post"];

fn spec() -> Value {
    json!({"tasks": [
        {"name": "init", "lifecycle": {"hook": "prestart"}},
        {"name": "side", "lifecycle": {"hook": "prestart", "sidecar": true}},
        {"name": "web", "leader": true},
        {"name": "post", "lifecycle": {"hook": "poststop"}}
    ]})
}

/// One client: random operations on its own allocations until the server
/// stops answering. Returns the highest index it saw acknowledged.
async fn client(base: String, me: usize, seed: u64, model: Model) -> u64 {
    let http = common::http_builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut max_index = 0;
    loop {
        let id = format!("c{me}-{}", rng.usize(..ALLOCS_PER_CLIENT));
        let exists = model
            .lock()
            .unwrap()
            .get(&id)
            .is_some_and(|k| k.acked.is_some());
        let url = format!("{base}/v1/allocations/{id}");
        let states = ["pending", "running", "dead"];
        let req = if !exists {
            http.put(&url).json(&spec())
        } else {
            match rng.u8(..10) {
                0..=4 => {
                    let mut tasks = serde_json::Map::new();
                    for t in TASKS {
                        if rng.bool() {
                            let state = states[rng.usize(..3)];
                            tasks.insert(t.into(), json!({"state": state, "failed": state == "dead" && rng.u8(..4) == 0}));
                        }
                    }
                    http.post(format!("{url}/task-states"))
                        .json(&json!({"tasks": tasks}))
                }
                5 => http
                    .put(format!("{url}/tasks/{}/state", TASKS[rng.usize(..4)]))
                    .json(
                        &json!({"state": states[rng.usize(..3)], "event": {"type": "Crash Test"}}),
                    ),
                6 => http.post(format!("{url}/restart")).json(&json!({})),
                7 => http
                    .post(format!("{url}/restart"))
                    .json(&json!({"all_tasks": true})),
                8 => http.post(format!("{url}/restore")).json(
                    &json!({"tasks": {"init": {"state": "dead"}, "side": {"state": "running"}}}),
                ),
                _ => http.delete(&url),
            }
        };
        model
            .lock()
            .unwrap()
            .entry(id.clone())
            .or_default()
            .in_flight = true;
        let Ok(res) = req.send().await else {
            return max_index;
        };
        let status = res.status().as_u16();
        let index = res
            .headers()
            .get("x-taskgate-index")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let Ok(body) = res.bytes().await else {
            return max_index;
        };
        let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        assert!(status < 500, "server error {status}: {body}");
        let mut m = model.lock().unwrap();
        let known = m.get_mut(&id).unwrap();
        known.in_flight = false;
        match status {
            200 | 201 if body["tasks"].is_array() => known.acked = Some(acked_from_view(&body)),
            200 if body["restarted"].is_array() => {
                // The answer has no task views: keep the known ones only
                // when nothing changed (a restart that closes gates touches
                // tasks even when it restarts none).
                let index = body["index"].as_u64().unwrap();
                let tasks = known
                    .acked
                    .as_ref()
                    .filter(|a| a.index == index)
                    .and_then(|a| a.tasks.clone());
                known.acked = Some(Acked {
                    index: body["index"].as_u64().unwrap(),
                    state: body["coordinator_state"].as_str().unwrap().to_owned(),
                    tasks,
                });
            }
            204 => known.acked = None,
            // Refused restarts (409) change nothing.
            409 => {}
            other => panic!("unexpected {other}: {body}"),
        }
        max_index = max_index.max(index.unwrap_or(0));
    }
}

/// Checks every allocation against what was acknowledged, then adopts what
/// the server holds (an unacknowledged change may or may not have landed).
async fn verify(base: &str, model: &Model) {
    let http = common::http();
    let entries: Vec<(String, Known)> = model.lock().unwrap().clone().into_iter().collect();
    for (id, known) in entries {
        let res = http
            .get(format!("{base}/v1/allocations/{id}"))
            .send()
            .await
            .unwrap();
        let status = res.status().as_u16();
        let body: Value = res.json().await.unwrap();
        let now = (status == 200).then(|| acked_from_view(&body));
        let same = match (&known.acked, &now) {
            (None, None) => true,
            (Some(a), Some(n)) => {
                a.index == n.index
                    && a.state == n.state
                    && a.tasks.as_ref().is_none_or(|t| Some(t) == n.tasks.as_ref())
            }
            _ => false,
        };
        if !same {
            assert!(
                known.in_flight,
                "{id}: acknowledged {:?}, recovered {now:?} ({body})",
                known.acked
            );
            // The in-flight change landed: it must be newer, never older.
            if let (Some(a), Some(n)) = (&known.acked, &now) {
                assert!(n.index > a.index, "{id}: index went back: {a:?} -> {n:?}");
            }
        }
        if let Some(n) = &now {
            // A stable coordinator: the recovered record is self-consistent.
            assert!(n.tasks.as_ref().unwrap().len() == TASKS.len());
        }
        model.lock().unwrap().insert(
            id,
            Known {
                acked: now,
                in_flight: false,
            },
        );
    }
}

async fn healthy(base: &str) {
    let http = common::http();
    for _ in 0..600 {
        if let Ok(res) = http.get(format!("{base}/v1/health")).send().await
            && res.status() == 200
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the server never became healthy");
}

/// The sequence number of the oldest store log segment in `dir`.
fn oldest_segment(dir: &Path) -> u64 {
    taskgate::store::log_segments(dir)
        .unwrap()
        .first()
        .expect("the store keeps a log segment")
        .0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_changes_survive_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let model: Model = Arc::default();
    let mut rng = fastrand::Rng::with_seed(0x7a5c_9a7e);
    let mut max_acked = 0u64;
    let mut oldest_log_segment = 0;
    for round in 0..KILLS {
        let mut server = start(dir.path(), round);
        healthy(&server.base).await;
        verify(&server.base, &model).await;

        // Indexes never go back: a new change gets a newer index than any
        // acknowledged before the crash.
        let probe = common::http()
            .put(format!("{}/v1/allocations/probe-{round}", server.base))
            .json(&spec())
            .send()
            .await
            .unwrap();
        assert_eq!(probe.status(), 201);
        let probe_index: u64 = probe.headers()["x-taskgate-index"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            probe_index > max_acked,
            "index {probe_index} after {max_acked} was acknowledged"
        );
        max_acked = probe_index;

        let clients: Vec<_> = (0..CLIENTS)
            .map(|me| tokio::spawn(client(server.base.clone(), me, rng.u64(..), model.clone())))
            .collect();
        tokio::time::sleep(Duration::from_millis(rng.u64(30..250))).await;
        server.child.kill().expect("SIGKILL");
        server.child.wait().unwrap();
        oldest_log_segment = oldest_log_segment.max(oldest_segment(dir.path()));
        for c in clients {
            max_acked = max_acked.max(c.await.expect("client"));
        }
    }
    // Final check after the last crash, then a clean stop.
    let mut server = start(dir.path(), KILLS);
    healthy(&server.base).await;
    verify(&server.base, &model).await;
    let live = model
        .lock()
        .unwrap()
        .values()
        .filter(|k| k.acked.is_some())
        .count();
    assert!(live > 0, "the clients did some work");
    assert!(
        oldest_log_segment > 1,
        "checkpoints folded log segments into the snapshot and removed them"
    );
    eprintln!("{KILLS} kills; last index {max_acked}; {live} allocations live");
    server.terminate();
    let exit = server.child.wait().unwrap();
    assert!(exit.success(), "SIGTERM exits 0, got {exit:?}");
}
