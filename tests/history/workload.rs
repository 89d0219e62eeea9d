//! The clients of the history test: workers that register allocations and
//! send reports with unique events through randomly chosen replicas, and
//! record every request (when it was sent, when it was answered, what the
//! answer was). A worker also checks read-your-writes after some of its
//! acknowledged reports, as docs/replicas.md words it.
//!
//! Allocation `h{k}` has one task per worker: worker `w` alone reports to
//! `h{k}/t{w}`, at most `MAX_EVENTS` events (so the server drops none and
//! every event can be looked for at the end), and then moves on to
//! `h{k+1}`. The workers' tasks share allocations, so their writes race
//! through different replicas on the same keys.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use serde::Serialize;
use serde_json::{Value, json};
use taskgate::lifecycle::MAX_EVENTS;

/// How long a client waits for any one answer. Longer than any fault
/// lasts, so a request sent to a paused replica is answered once it
/// resumes: a request given up while a replica still holds it could be
/// decided after more keyed writes than a task remembers (`MAX_KEYS`).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);

/// Attempts of one keyed report (the first and its retries).
const ATTEMPTS: usize = 4;

/// A write waits at most this long for its replica's view to reach it
/// (`REACH_TIMEOUT` in src/registry/replicated.rs); an answer that took
/// longer may have gone out without it, and read-your-writes is not
/// promised for it.
pub const REACH_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest wait of a blocking read on another replica.
const OTHER_WAIT: Duration = Duration::from_secs(2);

/// What the workers and the fault driver share.
pub struct Shared {
    /// Each replica's base URL now (a replica restarted after a SIGKILL
    /// listens on a new port). Written by the fault driver, read by the
    /// workers; a std `Mutex`, never held across an `.await`.
    pub urls: Mutex<Vec<String>>,
    /// Set when the workload should end; each worker finishes the report
    /// in hand (and its retries) first.
    pub stop: AtomicBool,
    /// Time zero of every recorded time.
    pub start: Instant,
    /// The wall time at `start` (the servers' times, `lost_at`, are wall
    /// times of the same machine).
    pub wall: time::OffsetDateTime,
    pub http: reqwest::Client,
}

impl Shared {
    pub fn url(&self, replica: usize) -> String {
        self.urls.lock().unwrap()[replica].clone()
    }

    pub fn set_url(&self, replica: usize, url: String) {
        self.urls.lock().unwrap()[replica] = url;
    }

    pub fn replicas(&self) -> usize {
        self.urls.lock().unwrap().len()
    }

    /// Microseconds since the start.
    pub fn now(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }
}

/// One request of a report, and what came of it.
#[derive(Clone, Debug, Serialize)]
pub struct Attempt {
    pub replica: usize,
    pub url: String,
    /// Microseconds since the start.
    pub sent: u64,
    pub done: u64,
    /// `200 index=…`, `503 store_unavailable`, `connection: …`, `timeout`.
    pub result: String,
}

/// How a report ended, as its sender knows it.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Outcome {
    /// 2xx: applied, at `index` (`X-Taskgate-Index`) or before it (an
    /// answer to a retry is the allocation as it is).
    Ok {
        index: u64,
        replica: usize,
        url: String,
        /// Microseconds from its attempt's request to its answer.
        took: u64,
    },
    /// 4xx: not applied.
    Failed { status: u16, code: String },
    /// No answer, 5xx or a broken connection on every attempt: it may or
    /// may not have been applied.
    Unknown,
}

/// A report with a unique event, sent to one task.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub worker: usize,
    pub alloc: String,
    pub task: String,
    /// The event's message, unique in the run (`w3/17`).
    pub message: String,
    /// Its `Idempotency-Key`, if it carried one (then it may be retried).
    pub key: Option<String>,
    /// Microseconds since the start: the first attempt was sent, the
    /// answer that ended it came (`None` for `Unknown`).
    pub invoked: u64,
    pub completed: Option<u64>,
    pub outcome: Outcome,
    pub attempts: Vec<Attempt>,
}

/// A registration that was answered with a 2xx.
#[derive(Clone, Debug, Serialize)]
pub struct Registration {
    pub worker: usize,
    pub alloc: String,
    pub replica: usize,
    pub status: u16,
    /// The answer's `create_index`.
    pub create_index: u64,
    pub at: u64,
}

/// What the read-your-writes checks found, besides violations.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ReadStats {
    /// Reads on the acknowledging replica that held the write.
    pub same_held: usize,
    /// Blocking reads on another replica answered with the write.
    pub other_held: usize,
    /// Blocking reads on another replica that waited their whole wait
    /// without reaching it (that replica was behind: paused, restarting,
    /// or its watch moving).
    pub other_waited_out: usize,
    /// Reads that got no answer (a replica down, paused or starting).
    pub no_answer: usize,
    /// Writes answered after `REACH_TIMEOUT` (read-your-writes is not
    /// promised for them).
    pub past_reach: usize,
}

/// Everything one worker recorded.
#[derive(Debug, Default, Serialize)]
pub struct Recorded {
    pub reports: Vec<Report>,
    pub registrations: Vec<Registration>,
    /// What broke a promise while the workload ran (read-your-writes, an
    /// answer without its own report, a refusal of a valid request).
    pub violations: Vec<String>,
    pub reads: ReadStats,
}

/// The allocation spec every worker registers: one task per worker.
pub fn spec(workers: usize) -> Value {
    let tasks: Vec<Value> = (0..workers)
        .map(|w| json!({"name": format!("t{w}")}))
        .collect();
    json!({ "tasks": tasks })
}

/// The run of `task` in an allocation view, if it has one.
pub fn run_of(alloc: &Value, task: &str) -> Option<String> {
    alloc["tasks"]
        .as_array()?
        .iter()
        .find(|t| t["name"] == task)?["run"]
        .as_str()
        .map(str::to_owned)
}

/// A response, read whole.
pub struct Answer {
    pub status: u16,
    pub index: Option<u64>,
    pub retry_after: Option<u64>,
    pub body: Value,
}

pub enum Sent {
    Answer(Answer),
    /// No answer: the connection failed, or the timeout passed.
    Lost {
        timed_out: bool,
        why: String,
    },
}

pub async fn send(req: reqwest::RequestBuilder) -> Sent {
    send_within(req, REQUEST_TIMEOUT).await
}

/// `send`, given at most `within` to answer.
pub async fn send_within(req: reqwest::RequestBuilder, within: Duration) -> Sent {
    let res = match req.timeout(within).send().await {
        Ok(res) => res,
        Err(e) => {
            return Sent::Lost {
                timed_out: e.is_timeout(),
                why: error_chain(&e),
            };
        }
    };
    let status = res.status().as_u16();
    let header = |name: &str| {
        res.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
    };
    let (index, retry_after) = (header("x-taskgate-index"), header("retry-after"));
    match res.bytes().await {
        Ok(bytes) => Sent::Answer(Answer {
            status,
            index,
            retry_after,
            body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        }),
        Err(e) => Sent::Lost {
            timed_out: e.is_timeout(),
            why: error_chain(&e),
        },
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// The messages of `task`'s events in an allocation's JSON.
pub fn events_of(alloc: &Value, task: &str) -> Option<Vec<String>> {
    let task = alloc["tasks"]
        .as_array()?
        .iter()
        .find(|t| t["name"] == task)?;
    Some(
        task["events"]
            .as_array()?
            .iter()
            .map(|e| e["message"].as_str().unwrap_or_default().to_owned())
            .collect(),
    )
}

pub struct Worker {
    id: usize,
    workers: usize,
    rng: fastrand::Rng,
    shared: Arc<Shared>,
    /// Events sent so far (the next one's number).
    sent: u64,
    /// The run of this worker's task in the allocation it reports to, once
    /// an answer named it: every later report names it (`Taskgate-Run`),
    /// as an agent's does (SEMANTICS, "Runs").
    run: Option<String>,
    rec: Recorded,
}

impl Worker {
    pub fn new(id: usize, workers: usize, seed: u64, shared: Arc<Shared>) -> Self {
        Self {
            id,
            workers,
            rng: fastrand::Rng::with_seed(seed),
            shared,
            sent: 0,
            run: None,
            rec: Recorded::default(),
        }
    }

    /// Reports until told to stop; returns what it recorded.
    pub async fn run(mut self) -> Recorded {
        let task = format!("t{}", self.id);
        // Bounded by the allocations a run can fill: each takes at least
        // one report, and the run ends long before.
        for k in 0..100_000 {
            if self.shared.stopped() {
                break;
            }
            let alloc = format!("h{k}");
            self.run = None;
            if !self.register(&alloc).await {
                break;
            }
            for _ in 0..MAX_EVENTS {
                if self.shared.stopped() {
                    break;
                }
                let timed_out = self.report(&alloc, &task).await;
                // A request given up on may still be decided by the
                // replica that holds it, after this task's later keyed
                // writes pushed its key out of what the record remembers:
                // this task gets no more writes.
                if timed_out {
                    break;
                }
            }
        }
        self.rec
    }

    /// A replica other than `not` (any, for `None`).
    fn pick(&mut self, not: Option<usize>) -> usize {
        let n = self.shared.replicas();
        match not {
            Some(r) if n > 1 => (r + 1 + self.rng.usize(..n - 1)) % n,
            _ => self.rng.usize(..n),
        }
    }

    /// Registers `alloc` (every worker does, before its first report
    /// there: the same spec is answered 200 once it exists). False if the
    /// run ended first.
    async fn register(&mut self, alloc: &str) -> bool {
        let body = spec(self.workers);
        let mut last = None;
        for _ in 0..1_000 {
            if self.shared.stopped() {
                return false;
            }
            let r = self.pick(last);
            last = Some(r);
            let url = self.shared.url(r);
            let at = self.shared.now();
            let req = self
                .shared
                .http
                .put(format!("{url}/v1/allocations/{alloc}"))
                .json(&body);
            match send(req).await {
                Sent::Answer(a) if a.status == 200 || a.status == 201 => {
                    self.rec.registrations.push(Registration {
                        worker: self.id,
                        alloc: alloc.to_owned(),
                        replica: r,
                        status: a.status,
                        create_index: a.body["create_index"].as_u64().unwrap_or(0),
                        at,
                    });
                    return true;
                }
                Sent::Answer(a) if a.status < 500 => {
                    self.rec.violations.push(format!(
                        "registering {alloc} through replica {r} ({url}) was refused: {} {}",
                        a.status, a.body
                    ));
                    return false;
                }
                Sent::Answer(a) => self.backoff(a.retry_after).await,
                Sent::Lost { .. } => self.backoff(None).await,
            }
        }
        false
    }

    /// A client's pause before it tries again (not a synchronization:
    /// any length would do).
    async fn backoff(&mut self, retry_after: Option<u64>) {
        let ms = retry_after.map_or(200, |s| (s * 1000).min(1000)) + self.rng.u64(..100);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

    /// Sends one report with a new event; true if an attempt was given
    /// up on after `REQUEST_TIMEOUT`.
    async fn report(&mut self, alloc: &str, task: &str) -> bool {
        let message = format!("w{}/{}", self.id, self.sent);
        self.sent += 1;
        // Most reports carry a key and are retried; the rest are sent
        // once (a lost answer leaves them unknown).
        let key = (self.rng.u8(..) < 180).then(|| format!("key-{message}"));
        let body = json!({"state": "running", "event": {"type": "Note", "message": message}});
        let tries = if key.is_some() { ATTEMPTS } else { 1 };
        let invoked = self.shared.now();
        let mut attempts = Vec::new();
        let mut outcome = Outcome::Unknown;
        let mut completed = None;
        let mut timed_out = false;
        let mut last = None;
        let mut attempt_no = 0;
        // Whether a refusal taught this report its run (that attempt
        // landed nothing).
        let mut learnt = false;
        while attempt_no < tries {
            attempt_no += 1;
            let r = self.pick(last);
            last = Some(r);
            let url = self.shared.url(r);
            let mut req = self
                .shared
                .http
                .put(format!("{url}/v1/allocations/{alloc}/tasks/{task}/state"))
                .json(&body);
            if let Some(key) = &key {
                req = req.header("idempotency-key", key);
            }
            if let Some(run) = &self.run {
                req = req.header("taskgate-run", run);
            }
            let sent = self.shared.now();
            let answer = send(req).await;
            let done = self.shared.now();
            let mut attempt = Attempt {
                replica: r,
                url: url.clone(),
                sent,
                done,
                result: String::new(),
            };
            match answer {
                Sent::Answer(a) if (200..300).contains(&a.status) => {
                    if self.run.is_none() {
                        self.run = run_of(&a.body, task);
                    }
                    let index = a.index.unwrap_or(0);
                    attempt.result = format!("{} index={index}", a.status);
                    attempts.push(attempt);
                    if !events_of(&a.body, task).is_some_and(|e| e.contains(&message)) {
                        self.rec.violations.push(format!(
                            "{alloc}/{task}: the 2xx answer to {message} from replica {r} ({url}) \
                             at index {index} does not hold it: {}",
                            a.body
                        ));
                    }
                    outcome = Outcome::Ok {
                        index,
                        replica: r,
                        url,
                        took: done - sent,
                    };
                    completed = Some(done);
                    break;
                }
                // The task runs under a run an earlier report of this
                // worker began, whose answer was lost: the refusal names
                // it and changed nothing; this report goes again under it.
                Sent::Answer(a)
                    if a.status == 409
                        && a.body["code"] == "task_claimed"
                        && self.run.is_none()
                        && a.body["run"].is_string() =>
                {
                    self.run = a.body["run"].as_str().map(str::to_owned);
                    attempt.result = "409 task_claimed (the run learnt)".to_owned();
                    attempts.push(attempt);
                    attempt_no -= 1;
                    learnt = true;
                }
                Sent::Answer(a) if a.status < 500 => {
                    let code = a.body["code"].as_str().unwrap_or_default().to_owned();
                    attempt.result = format!("{} {code}", a.status);
                    attempts.push(attempt);
                    self.rec.violations.push(format!(
                        "{alloc}/{task}: {message} through replica {r} ({url}) was refused: {} {}",
                        a.status, a.body
                    ));
                    // After an attempt that may have landed, a refusal
                    // does not say the event is absent.
                    if attempts.len() - usize::from(learnt) == 1 {
                        outcome = Outcome::Failed {
                            status: a.status,
                            code,
                        };
                        completed = Some(done);
                    }
                    break;
                }
                Sent::Answer(a) => {
                    let code = a.body["code"].as_str().unwrap_or_default();
                    attempt.result = format!("{} {code}", a.status);
                    attempts.push(attempt);
                    self.backoff(a.retry_after).await;
                }
                Sent::Lost { timed_out: t, why } => {
                    timed_out |= t;
                    attempt.result = if t { format!("timeout: {why}") } else { why };
                    attempts.push(attempt);
                    self.backoff(None).await;
                }
            }
        }
        let report = Report {
            worker: self.id,
            alloc: alloc.to_owned(),
            task: task.to_owned(),
            message,
            key,
            invoked,
            completed,
            outcome,
            attempts,
        };
        // About one acknowledged report in three is read back.
        if matches!(report.outcome, Outcome::Ok { .. }) && self.rng.u8(..3) == 0 {
            self.read_back(&report).await;
        }
        self.rec.reports.push(report);
        timed_out
    }

    /// Read-your-writes (docs/replicas.md, "What each read gives"): the
    /// acknowledging replica holds the write (unless it answered past
    /// `REACH_TIMEOUT`); another replica asked with `?index=W-1` answers
    /// with it, or waits out its whole wait.
    async fn read_back(&mut self, report: &Report) {
        let Outcome::Ok {
            index,
            replica,
            url,
            took,
        } = &report.outcome
        else {
            return;
        };
        let (alloc, task, message) = (&report.alloc, &report.task, &report.message);
        let what = format!("{message} (acknowledged by replica {replica} at index {index})");
        if Duration::from_micros(*took) >= REACH_TIMEOUT {
            self.rec.reads.past_reach += 1;
        } else {
            let req = self
                .shared
                .http
                .get(format!("{url}/v1/allocations/{alloc}"));
            match send(req).await {
                Sent::Answer(a) if a.status == 200 => {
                    let at = a.body["modify_index"].as_u64().unwrap_or(0);
                    let held = events_of(&a.body, task).is_some_and(|e| e.contains(message));
                    if at < *index || !held {
                        self.rec.violations.push(format!(
                            "read-your-writes: {alloc}/{task}: {what}: a read there ({url}) \
                             answered modify_index {at}, {}",
                            if held { "with it" } else { "without it" }
                        ));
                    } else {
                        self.rec.reads.same_held += 1;
                    }
                }
                // Down, paused, starting or behind a restart: no answer
                // to judge.
                _ => self.rec.reads.no_answer += 1,
            }
        }
        let other = self.pick(Some(*replica));
        let other_url = self.shared.url(other);
        let wait = OTHER_WAIT.as_millis();
        let req = self.shared.http.get(format!(
            "{other_url}/v1/allocations/{alloc}?index={}&wait={wait}ms",
            index - 1
        ));
        let asked = Instant::now();
        match send(req).await {
            Sent::Answer(a) if a.status == 200 => {
                let at = a.body["modify_index"].as_u64().unwrap_or(0);
                let held = events_of(&a.body, task).is_some_and(|e| e.contains(message));
                if at >= *index && held {
                    self.rec.reads.other_held += 1;
                } else if at < *index && asked.elapsed() >= OTHER_WAIT {
                    self.rec.reads.other_waited_out += 1;
                } else {
                    self.rec.violations.push(format!(
                        "read-your-writes: {alloc}/{task}: {what}: a blocking read on replica \
                         {other} ({other_url}) with ?index={} answered after {:?} with \
                         modify_index {at}, {}",
                        index - 1,
                        asked.elapsed(),
                        if held { "with it" } else { "without it" }
                    ));
                }
            }
            _ => self.rec.reads.no_answer += 1,
        }
    }
}
