//! `taskgate-bench soak-client`: one client process of the soak test
//! (`tests/soak.rs`). It owns a set of allocations and drives mixed traffic
//! at a server for a bounded time: single and batch reports, restarts of
//! every mode, restores, deletions and re-registrations, parked waiters
//! (blocking queries and start-condition long-polls) and waiters abandoned
//! mid-wait. Every write to an allocation comes from one writer task, so
//! its acknowledged history is a sequence: the client replays it on the
//! pure lifecycle model and checks each answer against the model. At the
//! end it prints one JSON summary on stdout: request and status counts,
//! mismatches, and the last acknowledged view of every allocation (which
//! the server's final state must equal).

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use clap::Args;
use serde_json::{Value, json};
use tokio::{io::AsyncWriteExt, net::TcpStream, sync::Mutex};

use crate::scenarios::{Conn, FIVE_TASKS};
use taskgate::{
    http::dto::RegisterBody,
    lifecycle::{
        AllocId, AllocSpec, Allocation, Limits, Refusal, RestartError, RestartMode, RunState,
        TaskReport,
    },
};

#[derive(Debug, Clone, Args)]
pub struct SoakConfig {
    /// The server, `HOST:PORT` (plain HTTP on loopback).
    #[arg(long)]
    pub server: SocketAddr,
    /// This client's number; its allocations are `soak-N-I`.
    #[arg(long)]
    pub client: u32,
    /// Allocations this client owns.
    #[arg(long, default_value_t = 40)]
    pub allocations: usize,
    /// Writer tasks (each owns a share of the allocations).
    #[arg(long, default_value_t = 4)]
    pub writers: usize,
    /// Tasks that park waiters (half) and that abandon them (half).
    #[arg(long, default_value_t = 16)]
    pub waiters: usize,
    /// How long to drive traffic.
    #[arg(long, default_value = "60s", value_parser = taskgate::units::parse_duration)]
    pub duration: Duration,
    /// Seed of the random choices.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

const TASKS: [&str; 5] = ["init", "proxy", "web", "announce", "cleanup"];

/// The spec of the example body, decoded and checked as the server does.
fn spec() -> AllocSpec {
    serde_json::from_str::<RegisterBody>(FIVE_TASKS)
        .expect("the example decodes")
        .into_spec(
            &Limits::default(),
            &taskgate::lifecycle::AllocId::parse("soak").expect("an ID"),
        )
        .expect("the example is a valid spec")
}

/// What the whole client counted.
#[derive(Default)]
struct Tally {
    requests: u64,
    statuses: BTreeMap<u16, u64>,
    mismatches: Vec<String>,
}

impl Tally {
    fn count(&mut self, status: u16) {
        self.requests += 1;
        *self.statuses.entry(status).or_default() += 1;
    }

    fn mismatch(&mut self, what: String) {
        if self.mismatches.len() < 50 {
            self.mismatches.push(what);
        }
    }
}

/// One owned allocation: the model replayed from acknowledged writes and
/// the last acknowledged view (`None` once deleted).
struct Owned {
    id: String,
    model: Option<Allocation>,
    view: Option<Value>,
}

pub async fn run(config: SoakConfig) -> std::io::Result<()> {
    let tally = Arc::new(Mutex::new(Tally::default()));
    let end = Instant::now() + config.duration;
    let spec = Arc::new(spec());
    let model_index = Arc::new(AtomicU64::new(1));

    let mut writers = Vec::new();
    for w in 0..config.writers {
        let ids: Vec<String> = (w..config.allocations)
            .step_by(config.writers)
            .map(|i| format!("soak-{}-{i}", config.client))
            .collect();
        let (tally, spec, model_index) = (tally.clone(), spec.clone(), model_index.clone());
        let seed = config.seed ^ (u64::from(config.client) << 32) ^ w as u64;
        let addr = config.server;
        writers.push(tokio::spawn(async move {
            writer(addr, ids, spec, model_index, tally, end, seed).await
        }));
    }
    let mut others = Vec::new();
    for k in 0..config.waiters {
        let (tally, addr) = (tally.clone(), config.server);
        let seed = config.seed ^ 0xfeed ^ (u64::from(config.client) << 16) ^ k as u64;
        let allocations = config.allocations;
        let client = config.client;
        others.push(tokio::spawn(async move {
            if k % 2 == 0 {
                park(addr, client, allocations, tally, end, seed).await
            } else {
                abandon(addr, client, allocations, end, seed).await
            }
        }));
    }
    let mut owned = Vec::new();
    for w in writers {
        owned.extend(w.await.map_err(std::io::Error::other)??);
    }
    for o in others {
        o.await.map_err(std::io::Error::other)??;
    }
    let tally = tally.lock().await;
    let allocations: Vec<Value> = owned
        .iter()
        .map(|o| json!({"id": o.id, "view": o.view}))
        .collect();
    let summary = json!({
        "client": config.client,
        "requests": tally.requests,
        "statuses": tally.statuses.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
        "mismatches": tally.mismatches,
        "allocations": allocations,
    });
    println!("{summary}");
    Ok(())
}

/// One write, as sent and as the model sees it.
enum Op {
    Report(usize, TaskReport),
    Batch(Vec<(usize, TaskReport)>),
    Restore(Vec<(usize, TaskReport)>),
    Restart(RestartMode),
    Delete,
}

fn random_report(rng: &mut fastrand::Rng) -> TaskReport {
    let state = match rng.u8(0..10) {
        0..=2 => RunState::Pending,
        3..=6 => RunState::Running,
        _ => RunState::Dead,
    };
    TaskReport {
        state,
        failed: state == RunState::Dead && rng.u8(0..4) == 0,
        ready: None,
        event: None,
    }
}

fn report_json(r: &TaskReport) -> Value {
    json!({"state": r.state.as_str(), "failed": r.failed})
}

fn reports_json(reports: &[(usize, TaskReport)]) -> Value {
    let tasks: serde_json::Map<String, Value> = reports
        .iter()
        .map(|(i, r)| (TASKS[*i].to_owned(), report_json(r)))
        .collect();
    json!({ "tasks": tasks })
}

fn random_op(rng: &mut fastrand::Rng) -> Op {
    match rng.u8(0..100) {
        0..=49 => Op::Report(rng.usize(0..TASKS.len()), random_report(rng)),
        50..=69 => {
            let a = rng.usize(0..TASKS.len());
            let b = (a + rng.usize(1..TASKS.len())) % TASKS.len();
            Op::Batch(vec![(a, random_report(rng)), (b, random_report(rng))])
        }
        70..=77 => Op::Restore(vec![(0, random_report(rng)), (2, random_report(rng))]),
        78..=85 => Op::Restart(RestartMode::Running),
        86..=91 => Op::Restart(RestartMode::Task(rng.usize(0..TASKS.len()))),
        92..=96 => Op::Restart(RestartMode::AllTasks),
        _ => Op::Delete,
    }
}

/// The model's verdict on an operation.
struct Verdict {
    status: u16,
    /// The next model, when the operation changes anything.
    next: Option<Allocation>,
    /// The problem code of a refusal.
    code: Option<&'static str>,
    /// The tasks a restart tells to restart.
    restarted: Vec<&'static str>,
}

fn expect(model: &Allocation, op: &Op, next_index: &AtomicU64) -> Verdict {
    let now = time::OffsetDateTime::now_utc();
    let idx = || next_index.fetch_add(1, Ordering::Relaxed);
    let changed = |next| Verdict {
        status: 200,
        next,
        code: None,
        restarted: Vec::new(),
    };
    let refused = |code| Verdict {
        status: 409,
        next: None,
        code: Some(code),
        restarted: Vec::new(),
    };
    // A header-less report is refused as the server refuses it (SEMANTICS,
    // "Runs"): `running` again for a running task is another agent's
    // claim; leaving `dead` needs an order.
    // The server judges a batch's entries in the body's order, the order
    // its JSON object's keys are sent in.
    let judged = |rs: &[(usize, TaskReport)]| {
        let body = reports_json(rs);
        let sent = body["tasks"].as_object().expect("an object").keys();
        let refusal = sent
            .filter_map(|name| rs.iter().find(|(i, _)| TASKS[*i] == name))
            .find_map(|(i, r)| model.check_report(*i, r, None).err());
        match refusal {
            None => changed(model.report(rs, now, idx)),
            Some(Refusal::Claimed { .. }) => refused("task_claimed"),
            Some(Refusal::Dead { .. }) => refused("task_dead"),
            Some(other) => panic!("the soak's reports meet no {other:?}"),
        }
    };
    match op {
        Op::Report(i, r) => judged(&[(*i, r.clone())]),
        Op::Batch(rs) => judged(rs),
        Op::Restore(rs) => changed(model.restore(rs, now, idx)),
        Op::Restart(mode) => match model.restart(*mode, "soak", now, idx) {
            Ok((next, chosen)) => Verdict {
                restarted: chosen.into_iter().map(|i| TASKS[i]).collect(),
                ..changed(next)
            },
            Err(RestartError::AllocationFinished) => refused("allocation_finished"),
            Err(RestartError::TaskNotRunning(_)) => refused("task_not_running"),
        },
        Op::Delete => Verdict {
            status: 204,
            ..changed(None)
        },
    }
}

/// Compares the server's view with the model: coordinator state and each
/// task's state, failed, restarts and restart generation.
fn compare(view: &Value, model: &Allocation) -> Result<(), String> {
    let state = model.state.as_str();
    if view["coordinator_state"] != state {
        return Err(format!(
            "coordinator_state {} (model: {state})",
            view["coordinator_state"]
        ));
    }
    for (i, t) in model.tasks.iter().enumerate() {
        let v = &view["tasks"][i];
        let want = json!({
            "name": TASKS[i], "state": t.state.as_str(), "failed": t.failed,
            "restarts": t.restarts, "restart_generation": t.restart_generation,
        });
        let got = json!({
            "name": v["name"], "state": v["state"], "failed": v["failed"],
            "restarts": v["restarts"], "restart_generation": v["restart_generation"],
        });
        if want != got {
            return Err(format!("task {got} (model: {want})"));
        }
    }
    Ok(())
}

async fn writer(
    addr: SocketAddr,
    ids: Vec<String>,
    spec: Arc<AllocSpec>,
    model_index: Arc<AtomicU64>,
    tally: Arc<Mutex<Tally>>,
    end: Instant,
    seed: u64,
) -> std::io::Result<Vec<Owned>> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut conn = Conn::open(addr).await?;
    let mut owned: Vec<Owned> = ids
        .into_iter()
        .map(|id| Owned {
            id,
            model: None,
            view: None,
        })
        .collect();
    let register = |o: &mut Owned| {
        let id = AllocId::parse(&o.id).expect("a valid ID");
        let index = model_index.fetch_add(1, Ordering::Relaxed);
        o.model = Some(Allocation::register(
            id,
            spec.clone(),
            index,
            time::OffsetDateTime::now_utc(),
        ));
    };
    let body = FIVE_TASKS;
    for o in &mut owned {
        let status = conn
            .call("PUT", &format!("/v1/allocations/{}", o.id), body.as_bytes())
            .await?;
        tally.lock().await.count(status);
        if status != 201 {
            return Err(std::io::Error::other(format!(
                "registration answered {status}"
            )));
        }
        register(o);
        o.view = Some(conn.json()?);
    }
    while Instant::now() < end {
        let pick = rng.usize(0..owned.len());
        let o = &mut owned[pick];
        let path = format!("/v1/allocations/{}", o.id);
        let Some(model) = &o.model else {
            // Deleted: register it again, fresh.
            let status = conn.call("PUT", &path, body.as_bytes()).await?;
            tally.lock().await.count(status);
            if status == 201 {
                register(o);
                o.view = Some(conn.json()?);
            } else {
                tally
                    .lock()
                    .await
                    .mismatch(format!("{}: re-registration answered {status}", o.id));
            }
            continue;
        };
        let op = random_op(&mut rng);
        let (method, target, payload) = match &op {
            Op::Report(i, r) => (
                "PUT",
                format!("{path}/tasks/{}/state", TASKS[*i]),
                report_json(r),
            ),
            Op::Batch(rs) => ("POST", format!("{path}/task-states"), reports_json(rs)),
            Op::Restore(rs) => ("POST", format!("{path}/restore"), reports_json(rs)),
            Op::Restart(RestartMode::Task(i)) => (
                "POST",
                format!("{path}/restart"),
                json!({"task": TASKS[*i], "reason": "soak"}),
            ),
            Op::Restart(RestartMode::AllTasks) => (
                "POST",
                format!("{path}/restart"),
                json!({"all_tasks": true, "reason": "soak"}),
            ),
            Op::Restart(RestartMode::Running) => {
                ("POST", format!("{path}/restart"), json!({"reason": "soak"}))
            }
            Op::Delete => ("DELETE", path.clone(), Value::Null),
        };
        let payload = if payload.is_null() {
            Vec::new()
        } else {
            payload.to_string().into_bytes()
        };
        let status = conn.call(method, &target, &payload).await?;
        let verdict = expect(model, &op, &model_index);
        tally.lock().await.count(status);
        if status != verdict.status {
            tally.lock().await.mismatch(format!(
                "{}: {method} {target} answered {status}, the model expects {}: {}",
                o.id,
                verdict.status,
                String::from_utf8_lossy(&conn.body)
            ));
            // The model can no longer follow this allocation; stop
            // checking it rather than report every later step.
            o.model = None;
            o.view = None;
            continue;
        }
        let answer = if status == 204 {
            Value::Null
        } else {
            conn.json()?
        };
        if let Some(next) = verdict.next {
            o.model = Some(next);
        }
        let mut problems = Vec::new();
        match status {
            204 => {
                o.model = None;
                o.view = None;
                continue;
            }
            409 => {
                if answer["code"].as_str() != verdict.code {
                    problems.push(format!("409 {answer} (model: {:?})", verdict.code));
                }
            }
            _ if matches!(op, Op::Restart(_)) => {
                if answer["restarted"] != json!(verdict.restarted) {
                    problems.push(format!(
                        "restarted {} (model: {:?})",
                        answer["restarted"], verdict.restarted
                    ));
                }
            }
            _ => o.view = Some(answer),
        }
        if matches!(op, Op::Restart(_)) {
            // A restart answers a summary; the view comes from a read,
            // which nothing else can change meanwhile.
            let status = conn.call("GET", &path, b"").await?;
            tally.lock().await.count(status);
            o.view = Some(conn.json()?);
        }
        if let (Some(model), Some(view)) = (&o.model, &o.view)
            && let Err(e) = compare(view, model)
        {
            problems.push(e);
        }
        for p in problems {
            tally
                .lock()
                .await
                .mismatch(format!("{}: after {method} {target}: {p}", o.id));
        }
    }
    Ok(owned)
}

/// Parks blocking queries and start-condition long-polls on this client's
/// allocations, one at a time per task, until the end.
async fn park(
    addr: SocketAddr,
    client: u32,
    allocations: usize,
    tally: Arc<Mutex<Tally>>,
    end: Instant,
    seed: u64,
) -> std::io::Result<()> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut conn = Conn::open(addr).await?;
    while Instant::now() < end {
        let id = format!("soak-{client}-{}", rng.usize(0..allocations));
        let task = TASKS[rng.usize(0..TASKS.len())];
        let path = if rng.bool() {
            format!("/v1/allocations/{id}/tasks/{task}/start-condition?wait=1s")
        } else {
            let status = conn
                .call("GET", &format!("/v1/allocations/{id}"), b"")
                .await?;
            tally.lock().await.count(status);
            let index = if status == 200 {
                conn.json()?["modify_index"].as_u64().unwrap_or(0)
            } else {
                0
            };
            format!("/v1/allocations/{id}?index={index}&wait=1s")
        };
        let status = conn.call("GET", &path, b"").await?;
        tally.lock().await.count(status);
    }
    Ok(())
}

/// Opens long-polls and walks away from them after a moment, without
/// reading an answer.
async fn abandon(
    addr: SocketAddr,
    client: u32,
    allocations: usize,
    end: Instant,
    seed: u64,
) -> std::io::Result<()> {
    let mut rng = fastrand::Rng::with_seed(seed);
    while Instant::now() < end {
        let id = format!("soak-{client}-{}", rng.usize(0..allocations));
        let task = TASKS[rng.usize(0..TASKS.len())];
        let mut stream = TcpStream::connect(addr).await?;
        let req = format!(
            "GET /v1/allocations/{id}/tasks/{task}/start-condition?wait=30s HTTP/1.1\r\nHost: localhost\r\n\r\n"
        );
        stream.write_all(req.as_bytes()).await?;
        // Walking away is the behaviour under test, not synchronization.
        tokio::time::sleep(Duration::from_millis(rng.u64(1..200))).await;
        drop(stream);
    }
    Ok(())
}
