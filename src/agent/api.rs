//! The agent's calls to the server, retried with backoff until they go
//! through. A report carries an `Idempotency-Key`, the same on each of its
//! tries: one that landed before its answer was lost is not applied again.
//!
//! A 404 is a deletion only from the store the agent saw its allocation in
//! (`X-Taskgate-Store`), at an index at least the last it saw: a server
//! with another store (a wrong `--data-dir`, an emptied one) or one that
//! went back in time (an old backup) is not telling the agent to kill its
//! workload.

use std::{path::Path, time::Duration};

use serde_json::Value;

use super::AgentConfig;
use crate::client::Endpoint;

/// How long a long-poll asks the server to wait.
const POLL_WAIT: &str = "60s";
/// How long a request may take before it is retried: the poll plus slack.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(90);
/// Retries wait 20 ms, doubling up to 10 s; each wait is a random time
/// between half its step and the whole step, so that agents that lost the
/// server together do not come back together, and none waits longer than
/// the cap.
const BACKOFF_START: Duration = Duration::from_millis(20);
const BACKOFF_CAP: Duration = Duration::from_secs(10);

/// The wait before a retry at backoff step `step`, for `r` in [0, 1).
fn backoff_wait(step: Duration, r: f64) -> Duration {
    step.min(BACKOFF_CAP).mul_f64(0.5 + 0.5 * r)
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The allocation does not exist (any more).
    #[error("the allocation is gone")]
    Gone,
    /// The server declared the task lost (its TTL passed without a sign of
    /// life): its process must stop, and no report of it is taken.
    #[error("the server declared the task lost{}", .lost_at.as_deref().map(|t| format!(" at {t}")).unwrap_or_default())]
    Lost { lost_at: Option<String> },
    /// A request the server will never accept (bad token, bad spec, ...).
    #[error("{0}")]
    Fatal(String),
    /// No server took a request within `--shutdown-timeout` after the
    /// agent was told to stop.
    #[error("{0}")]
    Unreachable(String),
    /// The run this agent names is not the task's current one (409
    /// `run_superseded`): a restart order, a deletion and registration, or
    /// an operator replaced it. Its process must stop; nothing more is
    /// reported.
    #[error("the server no longer has this agent's run as the task's current one (current run: {})", .current.as_deref().unwrap_or("none"))]
    Superseded { current: Option<String> },
    /// Another agent runs the task (409 `task_claimed`).
    #[error("another agent runs the task, under run {run} (last sign of life: {})", .last_seen.as_deref().unwrap_or("none seen by the server"))]
    Claimed {
        run: String,
        last_seen: Option<String>,
    },
    /// The task is dead, and no order has reopened it (409 `task_dead`).
    #[error("the task is dead{} and no order has reopened it", .finished_at.as_deref().map(|t| format!(" since {t}")).unwrap_or_default())]
    Dead { finished_at: Option<String> },
}

impl ApiError {
    /// The refusals of SEMANTICS "Runs", read from a 409's problem.
    fn of_run(code: &str, v: &Value) -> Option<Self> {
        let field = |k: &str| v[k].as_str().map(str::to_owned);
        match code {
            "run_superseded" => Some(Self::Superseded {
                current: field("current_run"),
            }),
            "task_claimed" => Some(Self::Claimed {
                run: field("run").unwrap_or_default(),
                last_seen: field("last_seen"),
            }),
            "task_dead" => Some(Self::Dead {
                finished_at: field("finished_at"),
            }),
            _ => None,
        }
    }
}

/// What the agent reads of its task view.
#[derive(Debug, Clone)]
pub struct TaskInfo {
    pub stage: String,
    pub readiness: bool,
    pub state: String,
    pub desired: String,
    pub stop_reason: Option<String>,
    pub restart_generation: u64,
    pub modify_index: u64,
    pub coordinator_state: String,
    /// The liveness TTL the task runs under, if any.
    pub ttl: Option<Duration>,
    /// The task's current run.
    pub run: Option<String>,
}

/// The stop reason of a lost task.
pub const AGENT_LOST: &str = "Agent Lost";

/// The answer to "may I start?", decoded whole: a missing field is an
/// error, but an `Option` reads a missing one as `None`.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct StartCondition {
    pub allowed: bool,
    pub desired: String,
    pub coordinator_state: String,
    /// The task's state and current run: a task `running` under a run
    /// that is not this agent's is another agent's.
    pub state: String,
    pub run: Option<String>,
    /// The allocation's registration: another than the one the agent
    /// first saw means it was deleted and registered again.
    pub create_index: u64,
    /// `succeeded` or `failed` once the allocation is in `poststop`.
    pub outcome: Option<String>,
    pub failed_tasks: Vec<String>,
    #[serde(default)]
    stop_reason: Option<StopReasonWire>,
}

impl StartCondition {
    /// Whether the task is told to stop because it was declared lost.
    pub fn lost(&self) -> bool {
        self.stop_reason
            .as_ref()
            .is_some_and(|r| r.kind == AGENT_LOST)
    }
}

/// What the server answered a call.
enum Answer {
    /// A 2xx, with its body.
    Taken(Value),
    /// A 4xx the caller asked to see rather than fail on.
    Refused { code: String, detail: String },
}

/// Requests that got no answer in a row (a network error, a timeout, a
/// 5xx), from every call: an outage, said once when it begins and once
/// when a server answers again.
#[derive(Debug, Default)]
struct Outage {
    failures: u32,
    since: Option<std::time::Instant>,
}

impl Outage {
    /// A request got no answer at `now`: whether an outage begins with it.
    fn failed(&mut self, now: std::time::Instant) -> bool {
        self.failures += 1;
        let begins = self.since.is_none();
        self.since.get_or_insert(now);
        begins
    }

    /// A server answered at `now`: the failed requests and how long the
    /// outage lasted, if one has ended.
    fn answered(&mut self, now: std::time::Instant) -> Option<(u32, Duration)> {
        let since = self.since.take()?;
        Some((std::mem::take(&mut self.failures), now - since))
    }
}

/// The agent's token: given, or read from a file at each request, so a
/// token the platform renews in place (a Kubernetes projected
/// service-account token, a Nomad workload identity file: JWTs that expire)
/// is sent as renewed. The file is read rather than its metadata compared:
/// a renewal of the same length within one tick of the file system's clock,
/// or one whose modification time is set back (`cp -p`), changes nothing a
/// `stat` shows, and a token file is a few hundred bytes.
enum TokenSource {
    Given(Option<std::sync::Arc<str>>),
    File {
        path: std::path::PathBuf,
        /// The token last read from it, and whether the last read failed
        /// (said once at warn, until one succeeds).
        read: std::sync::Mutex<(std::sync::Arc<str>, bool)>,
    },
}

/// A token file's token: its first line, trimmed.
fn read_token(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the token file {}: {e}", path.display()))?;
    let secret = text.lines().next().unwrap_or_default().trim();
    if secret.is_empty() {
        return Err(format!("the token file {} is empty", path.display()));
    }
    Ok(secret.to_owned())
}

impl TokenSource {
    fn file(path: &Path) -> Result<Self, String> {
        Ok(Self::File {
            path: path.to_owned(),
            read: std::sync::Mutex::new((read_token(path)?.into(), false)),
        })
    }

    /// The token to send now: the file's. One that cannot be read (or is
    /// empty) leaves the last token in use, said once at warn.
    fn current(&self) -> Option<std::sync::Arc<str>> {
        let (path, read) = match self {
            Self::Given(token) => return token.clone(),
            Self::File { path, read } => (path, read),
        };
        let mut read = read.lock().expect("token lock");
        match read_token(path) {
            Ok(token) => {
                if *token != *read.0 {
                    tracing::debug!(file = %path.display(), "the token file holds a new token");
                    read.0 = token.into();
                }
                read.1 = false;
            }
            Err(e) if !read.1 => {
                tracing::warn!("{e}; sending the token read before");
                read.1 = true;
            }
            Err(_) => {}
        }
        Some(read.0.clone())
    }
}

/// `Prefer: return=minimal` (RFC 7240) on writes.
const MINIMAL: &[(&str, &str)] = &[("prefer", "return=minimal")];

pub struct Api {
    /// Set when the agent is told to stop: calls give up at this instant
    /// (`--shutdown-timeout` after the signal) instead of retrying on.
    pub give_up_at: std::sync::Arc<std::sync::OnceLock<tokio::time::Instant>>,
    /// The servers, tried in turn from `current`.
    endpoints: Vec<Endpoint>,
    current: std::sync::atomic::AtomicUsize,
    /// The requests that got no answer in a row, from every call (the
    /// long-poll, a report and a heartbeat may fail side by side).
    outage: std::sync::Mutex<Outage>,
    token: TokenSource,
    alloc: String,
    task: String,
    /// The store the allocation was seen in (`X-Taskgate-Store`), and the
    /// highest index seen of it: a 404 is a deletion only from that store,
    /// at that index or later.
    seen: std::sync::Mutex<Seen>,
    /// The task's current run under this agent (from the answer to the
    /// report that started it), sent as `Taskgate-Run` on every request
    /// about the task until a report ends it.
    run: std::sync::Mutex<Option<Run>>,
    /// The registration of the allocation the agent first saw
    /// (`create_index`).
    registration: std::sync::OnceLock<u64>,
}

#[derive(Debug, Default)]
struct Seen {
    store: Option<String>,
    index: u64,
    /// A 404 from another store (or an earlier state of this one) was
    /// logged in this episode (one ends when the allocation is seen again).
    astray_said: bool,
}

/// A run of the task under this agent: its ID, and the index of the
/// change that began it (a view at that index or later shows the run, or
/// that it ended).
#[derive(Debug, Clone)]
struct Run {
    id: String,
    since: u64,
}

/// The store's ID on every answer.
const STORE_HEADER: &str = "x-taskgate-store";
const INDEX_HEADER: &str = "x-taskgate-index";
/// The run an agent names on every request about its task.
const RUN_HEADER: &str = "taskgate-run";

fn text(v: &Value, key: &str) -> String {
    v[key].as_str().unwrap_or_default().to_owned()
}

/// A task as the server shows it, as far as the agent reads it. Every
/// field is required: an answer without one (a server of another version,
/// a renamed field) is an error, never read as "run" or "no stop order".
#[derive(Debug, serde::Deserialize)]
struct TaskWire {
    name: String,
    stage: String,
    readiness: bool,
    state: String,
    desired: String,
    stop_reason: Option<StopReasonWire>,
    restart_generation: u64,
    modify_index: u64,
    run: Option<String>,
    /// Missing or `null`: the task runs under no TTL.
    #[serde(default)]
    liveness: Option<LivenessWire>,
}

#[derive(Debug, Clone, serde::Deserialize)]
struct LivenessWire {
    ttl: String,
}

#[derive(Debug, Clone, serde::Deserialize)]
struct StopReasonWire {
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Debug, serde::Deserialize)]
struct TaskDetailWire {
    #[serde(flatten)]
    task: TaskWire,
    coordinator_state: String,
}

#[derive(Debug, serde::Deserialize)]
struct AllocationWire {
    modify_index: u64,
    create_index: u64,
    coordinator_state: String,
    tasks: Vec<TaskWire>,
}

impl TaskWire {
    fn info(self, coordinator_state: String) -> TaskInfo {
        TaskInfo {
            stage: self.stage,
            readiness: self.readiness,
            state: self.state,
            desired: self.desired,
            stop_reason: self.stop_reason.map(|r| r.kind),
            restart_generation: self.restart_generation,
            modify_index: self.modify_index,
            coordinator_state,
            ttl: self
                .liveness
                .and_then(|l| crate::units::parse_duration(&l.ttl).ok()),
            run: self.run,
        }
    }
}

/// Gives every task of a registration spec that declares no liveness the
/// TTL `ttl`.
fn with_ttl(spec: &mut Value, ttl: Duration) {
    let shown = crate::units::format_duration(ttl);
    for task in spec["tasks"].as_array_mut().into_iter().flatten() {
        if let Some(t) = task.as_object_mut()
            && t.get("liveness").is_none_or(Value::is_null)
        {
            t.insert("liveness".into(), serde_json::json!({"ttl": shown}));
        }
    }
}

/// Reads an answer as `T`, or says what it lacked.
fn decode<T: serde::de::DeserializeOwned>(what: &str, v: Value) -> Result<T, ApiError> {
    serde_json::from_value(v).map_err(|e| {
        ApiError::Fatal(format!(
            "the server's answer to {what} is not what this agent understands ({e}); is it \
             another version of taskgate?"
        ))
    })
}

impl Api {
    pub fn new(config: &AgentConfig) -> Result<Self, String> {
        let token = match &config.token_file {
            Some(path) => TokenSource::file(path)?,
            None => TokenSource::Given(config.token.as_ref().map(|t| t.0.as_str().into())),
        };
        Ok(Self {
            give_up_at: Default::default(),
            endpoints: config
                .server
                .iter()
                .map(|url| Endpoint::new(url, config.ca_cert.as_deref()))
                .collect::<Result<_, _>>()?,
            current: Default::default(),
            outage: Default::default(),
            token,
            alloc: config.alloc.clone(),
            task: config.task.clone(),
            seen: Default::default(),
            run: Default::default(),
            registration: Default::default(),
        })
    }

    /// Sends until the server answers something final. Network errors, 5xx
    /// (503 included) and 429 are retried with exponential backoff and
    /// jitter (`backoff_wait`), after a network error or a 5xx at
    /// the next server of the list; other 4xx are fatal (a 409 too: a
    /// dependency cycle or a spec conflict is not fixed by waiting), except
    /// a missing or deleted allocation, which ends the agent quietly, and a
    /// lost task.
    async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, ApiError> {
        self.call_keyed(method, path, body, None).await
    }

    /// `call` with an `Idempotency-Key`, the same on every try.
    async fn call_keyed(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        key: Option<&str>,
    ) -> Result<Value, ApiError> {
        match self.call_unless(method, path, body, &[], key).await? {
            Answer::Taken(v) => Ok(v),
            Answer::Refused { code, detail } => Err(ApiError::Fatal(format!(
                "{method} {path}: {code}: {detail}"
            ))),
        }
    }

    /// `call`, but a 4xx whose code is in `refusals` is an answer.
    async fn call_unless(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        refusals: &[&str],
        key: Option<&str>,
    ) -> Result<Answer, ApiError> {
        use std::sync::atomic::Ordering;
        let mut backoff = BACKOFF_START;
        loop {
            // Stopping: what is left of --shutdown-timeout bounds each try.
            let left = self
                .give_up_at
                .get()
                .map(|at| at.saturating_duration_since(tokio::time::Instant::now()));
            if left == Some(Duration::ZERO) {
                return Err(ApiError::Unreachable(format!(
                    "{method} {path}: no server took it within --shutdown-timeout; the task \
                     is stopped, but the server may still show it running"
                )));
            }
            let timeout = left.map_or(REQUEST_TIMEOUT, |l| l.min(REQUEST_TIMEOUT));
            let at = self.current.load(Ordering::Relaxed) % self.endpoints.len();
            // The agent reads nothing of a write's answer but its status:
            // the small one will do.
            let mut headers: Vec<(&str, &str)> = Vec::new();
            if body.is_some() {
                headers.extend_from_slice(MINIMAL);
            }
            if let Some(key) = key {
                headers.push(("idempotency-key", key));
            }
            let run = self.run().filter(|_| path.starts_with(&self.task_path()));
            if let Some(run) = &run {
                headers.push((RUN_HEADER, run));
            }
            let answer = self.endpoints[at]
                .send(
                    method,
                    path,
                    self.token.current().as_deref(),
                    body,
                    &headers,
                    timeout,
                )
                .await;
            // Unreachable or unavailable (5xx): the next try goes to the
            // next server, if there are several.
            if answer.as_ref().map_or(true, |r| r.status >= 500) {
                self.current
                    .store((at + 1) % self.endpoints.len(), Ordering::Relaxed);
            }
            let problem = match answer {
                Ok(reply) if reply.status < 300 => {
                    self.answered(at);
                    if path.starts_with(&self.alloc_path()) {
                        self.saw(&reply);
                    }
                    return Ok(Answer::Taken(
                        serde_json::from_slice(&reply.body).unwrap_or(Value::Null),
                    ));
                }
                Ok(reply) if reply.status >= 500 => {
                    let problem = format!(
                        "{} {}",
                        reply.status,
                        text(
                            &serde_json::from_slice(&reply.body).unwrap_or(Value::Null),
                            "code"
                        )
                    );
                    self.unanswered(at, &problem);
                    problem
                }
                Ok(reply) => {
                    self.answered(at);
                    let status = reply.status;
                    let v: Value = serde_json::from_slice(&reply.body).unwrap_or(Value::Null);
                    let code = text(&v, "code");
                    if code == "task_lost" {
                        return Err(ApiError::Lost {
                            lost_at: v["lost_at"].as_str().map(str::to_owned),
                        });
                    }
                    if let Some(refusal) = ApiError::of_run(&code, &v) {
                        return Err(refusal);
                    }
                    if status == 410 {
                        return Err(ApiError::Gone);
                    }
                    if code == "allocation_not_found" {
                        match self.not_found(at, &reply).await {
                            Some(gone) => return Err(gone),
                            None => "404 allocation_not_found from another store".to_owned(),
                        }
                    } else {
                        if (400..500).contains(&status) && refusals.contains(&code.as_str()) {
                            let detail = text(&v, "detail");
                            return Ok(Answer::Refused { code, detail });
                        }
                        if status == 401 {
                            return Err(ApiError::Fatal(format!(
                                "{method} {path}: 401 {code}: the server did not accept the \
                             token; give an agent token with --token or TASKGATE_TOKEN, or \
                             a file holding it with --token-file or TASKGATE_TOKEN_FILE"
                            )));
                        }
                        if status == 403 {
                            return Err(ApiError::Fatal(format!(
                                "{method} {path}: 403 {code}: the token may not do this; the \
                             agent needs a token of role agent or operator whose prefixes \
                             cover allocation {:?} (the server's --token-file)",
                                self.alloc
                            )));
                        }
                        if (400..500).contains(&status) && status != 429 {
                            return Err(ApiError::Fatal(format!(
                                "{method} {path}: {status} {code}: {}",
                                text(&v, "detail")
                            )));
                        }
                        format!("{status} {code}")
                    }
                }
                Err(e) => {
                    self.unanswered(at, &e);
                    e
                }
            };
            let mut sleep = backoff_wait(backoff, fastrand::f64());
            if let Some(at) = self.give_up_at.get() {
                sleep = sleep.min(at.saturating_duration_since(tokio::time::Instant::now()));
            }
            // An outage is said once, when it begins: a line per retry
            // would fill the log while the server is down.
            tracing::debug!(%problem, retry_in = ?sleep, "{method} {path} did not go through; retrying");
            tokio::time::sleep(sleep).await;
            backoff = (backoff * 2).min(BACKOFF_CAP);
        }
    }

    /// An answer about the allocation: the store it lives in, and how far
    /// it has got.
    fn saw(&self, reply: &crate::client::Reply) {
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(store) = reply.header(STORE_HEADER) {
            if seen.store.as_deref() != Some(store) {
                seen.store = Some(store.to_owned());
                seen.index = 0;
            }
            seen.astray_said = false;
        }
        if let Some(index) = reply.header(INDEX_HEADER).and_then(|i| i.parse().ok()) {
            seen.index = seen.index.max(index);
        }
    }

    /// A 404 `allocation_not_found` from server `at`: `Some(Gone)` if it is
    /// a deletion (the store the allocation was seen in, at an index at
    /// least the last one seen, or an allocation never seen at all), `None`
    /// if it comes from another store or an earlier state of this one (the
    /// workload keeps running; said once an episode).
    async fn not_found(&self, at: usize, reply: &crate::client::Reply) -> Option<ApiError> {
        let (known, index) = {
            let seen = self
                .seen
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            (seen.store.clone(), seen.index)
        };
        let Some(known) = known else {
            // Never seen: not there (the caller says what to check).
            return Some(ApiError::Gone);
        };
        let url = &self.endpoints[at].url;
        let why = match reply.header(STORE_HEADER) {
            Some(store) if store == known => {
                // The same store: deleted, unless it went back in time.
                match self.store_index(at).await {
                    Some(now) if now >= index => return Some(ApiError::Gone),
                    Some(now) => format!(
                        "answers for the store the allocation was seen in, {known}, but at \
                         index {now}, before {index}, the last one seen: it went back in time \
                         (restored from an older backup?)"
                    ),
                    None => return None,
                }
            }
            Some(store) => format!(
                "answers for store {store}, not {known}, where the allocation was seen: is \
                 its --data-dir (or --etcd-prefix) the right one?"
            ),
            None => format!(
                "names no store (X-Taskgate-Store), while the allocation was seen in {known}: \
                 is it a taskgate server, or one behind a proxy that drops the header?"
            ),
        };
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !seen.astray_said {
            seen.astray_said = true;
            tracing::error!(
                "the server at {url} does not know allocation {:?}, but it {why}. This is not \
                 taken for a deletion: the task keeps running, and the agent keeps asking.",
                self.alloc
            );
        }
        None
    }

    /// The index a server's store has reached (a listing's
    /// `X-Taskgate-Index`), asked of server `at`.
    async fn store_index(&self, at: usize) -> Option<u64> {
        let path = format!("/v1/allocations?prefix={}&per_page=1", self.alloc);
        let reply = self.endpoints[at]
            .send(
                "GET",
                &path,
                self.token.current().as_deref(),
                None,
                &[],
                REQUEST_TIMEOUT,
            )
            .await
            .ok()?;
        if reply.status != 200 {
            return None;
        }
        reply.header(INDEX_HEADER)?.parse().ok()
    }

    /// Server `at` answered: an outage, if there was one, is over (said
    /// once).
    fn answered(&self, at: usize) {
        let ended = self
            .outage
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .answered(std::time::Instant::now());
        if let Some((failures, lasted)) = ended {
            tracing::info!(
                "the server at {} answers again: {failures} tries got no answer over {lasted:.1?}",
                self.endpoints[at].url
            );
        }
    }

    /// A request to server `at` got no answer, or a 5xx: an outage begins
    /// with the first, which says what to check.
    fn unanswered(&self, at: usize, problem: &str) {
        let begins = self
            .outage
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .failed(std::time::Instant::now());
        if !begins {
            return;
        }
        let urls: Vec<&str> = self.endpoints.iter().map(|e| e.url.as_str()).collect();
        tracing::warn!(
            "the server stopped answering: {} got no answer from {} ({problem}). Check that \
             the server is running and listens there; that the URL is right, its scheme \
             included: an https:// URL for a plain-HTTP server fails in the TLS handshake, an \
             http:// URL for a TLS server gets no HTTP answer; and for https, that --ca-cert \
             names the CA that signed the server's certificate. The agent keeps trying (the \
             next server, if there are several; waits of up to {BACKOFF_CAP:?}) and says when \
             a server answers again.",
            self.endpoints[at].url,
            urls.join(", ")
        );
    }

    fn alloc_path(&self) -> String {
        format!("/v1/allocations/{}", self.alloc)
    }

    fn task_path(&self) -> String {
        format!("/v1/allocations/{}/tasks/{}", self.alloc, self.task)
    }

    /// Registers the allocation from `file`; with `ttl`, every task of it
    /// that declares no liveness runs under that TTL (each agent of the
    /// group given the same flag registers the same spec).
    pub async fn register(&self, file: &Path, ttl: Option<Duration>) -> Result<(), ApiError> {
        let text = std::fs::read_to_string(file)
            .map_err(|e| ApiError::Fatal(format!("cannot read {}: {e}", file.display())))?;
        let mut spec: Value = serde_json::from_str(&text)
            .map_err(|e| ApiError::Fatal(format!("{} is not JSON: {e}", file.display())))?;
        if let Some(ttl) = ttl {
            with_ttl(&mut spec, ttl);
        }
        loop {
            let path = self.alloc_path();
            let put = self.call_unless("PUT", &path, Some(&spec), &["allocation_exists"], None);
            if let Answer::Taken(_) = put.await? {
                // Registered by this agent or another one of the group.
                return Ok(());
            }
            let stored = match self.call("GET", &self.alloc_path(), None).await {
                Ok(stored) => stored,
                // Deleted since: registering again will do.
                Err(ApiError::Gone) => continue,
                Err(e) => return Err(e),
            };
            let mut differences = super::spec_diff::differences(&spec, &stored);
            if differences.is_empty() {
                differences.push(format!(
                    "in a field this agent does not compare (see `taskgate alloc status {}`)",
                    self.alloc
                ));
            }
            return Err(ApiError::Fatal(format!(
                "allocation {:?} is registered with another spec than {}: {}. Delete it first \
                 (`taskgate alloc delete {}`) or give another --alloc",
                self.alloc,
                file.display(),
                differences.join("; "),
                self.alloc
            )));
        }
    }

    /// Reports the task's state, with a key of its own that every retry
    /// of it repeats.
    pub async fn report(&self, body: &Value) -> Result<(), ApiError> {
        let key = format!("{:032x}", fastrand::u128(..));
        let path = format!("{}/state", self.task_path());
        let answer = self
            .call_keyed("PUT", &path, Some(body), Some(&key))
            .await?;
        // The answer names the task's run (`null` once it left `running`):
        // the agent sends it from now on. An answer without one (a server
        // of the third edition) leaves the agent sending none.
        if let Some(run) = answer.get("run") {
            let mut mine = self
                .run
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            *mine = run.as_str().map(|id| Run {
                id: id.to_owned(),
                since: match &*mine {
                    Some(r) if r.id == id => r.since,
                    _ => answer["index"].as_u64().unwrap_or(0),
                },
            });
        }
        Ok(())
    }

    /// The run this agent runs the task under, if any.
    pub fn run(&self) -> Option<String> {
        self.run
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(|r| r.id.clone())
    }

    /// Whether view `t` shows this agent's run ended by someone else: a
    /// view at or after the change that began it, which names another run
    /// or none. (An older view, from a replica behind, says nothing.)
    pub fn superseded(&self, t: &TaskInfo) -> bool {
        let mine = self
            .run
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        mine.as_ref()
            .is_some_and(|r| t.modify_index >= r.since && t.run.as_deref() != Some(&r.id))
    }

    /// Whether `create_index` is the registration the agent first saw (the
    /// first one seen is): another means the allocation was deleted and
    /// registered again, which is not the agent's.
    fn same_registration(&self, create_index: u64) -> bool {
        *self.registration.get_or_init(|| create_index) == create_index
    }

    /// A sign of life for the task, tried once and for at most `within`
    /// (a third of the TTL): a heartbeat that does not get through is
    /// replaced by the next (and the parked long-poll is one meanwhile).
    /// Only a lost task is an error.
    pub async fn heartbeat(&self, within: Duration) -> Result<(), ApiError> {
        use std::sync::atomic::Ordering;
        let at = self.current.load(Ordering::Relaxed) % self.endpoints.len();
        let path = format!("{}/heartbeat", self.task_path());
        let run = self.run();
        let headers: Vec<(&str, &str)> = run.iter().map(|r| (RUN_HEADER, r.as_str())).collect();
        let reply = self.endpoints[at]
            .send(
                "PUT",
                &path,
                self.token.current().as_deref(),
                None,
                &headers,
                within,
            )
            .await;
        match &reply {
            Ok(r) if r.status < 500 => self.answered(at),
            Ok(r) => self.unanswered(at, &r.status.to_string()),
            Err(e) => self.unanswered(at, e),
        }
        match reply {
            Ok(r) if r.status == 409 => {
                let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
                let code = text(&v, "code");
                if code == "task_lost" {
                    return Err(ApiError::Lost {
                        lost_at: v["lost_at"].as_str().map(str::to_owned),
                    });
                }
                if let Some(refusal) = ApiError::of_run(&code, &v) {
                    return Err(refusal);
                }
                Ok(())
            }
            Ok(r) if r.status >= 300 => {
                tracing::debug!(status = r.status, "a heartbeat was not taken");
                Ok(())
            }
            Ok(_) => Ok(()),
            Err(e) => {
                tracing::debug!(error = %e, "a heartbeat got no answer");
                Ok(())
            }
        }
    }

    /// The task view; with `index` > 0 a blocking query for a newer one.
    pub async fn task(&self, index: u64) -> Result<TaskInfo, ApiError> {
        let path = if index == 0 {
            self.task_path()
        } else {
            format!("{}?index={index}&wait={POLL_WAIT}", self.task_path())
        };
        let v = self.call("GET", &path, None).await?;
        let t: TaskDetailWire = decode(&path, v)?;
        Ok(t.task.info(t.coordinator_state))
    }

    /// This task as seen in its allocation's view; with `index` > 0 a
    /// blocking query on the allocation, so it also wakes when the
    /// coordinator moves without touching this task (a dead task waiting
    /// for `poststop`). Returns the allocation's index too.
    pub async fn task_in_allocation(&self, index: u64) -> Result<(TaskInfo, u64), ApiError> {
        let path = if index == 0 {
            self.alloc_path()
        } else {
            format!("{}?index={index}&wait={POLL_WAIT}", self.alloc_path())
        };
        let v = self.call("GET", &path, None).await?;
        let a: AllocationWire = decode(&path, v)?;
        if !self.same_registration(a.create_index) {
            return Err(self.registered_again());
        }
        let task = a
            .tasks
            .into_iter()
            .find(|t| t.name == self.task)
            .ok_or_else(|| {
                ApiError::Fatal(format!("task {:?} is not in the allocation", self.task))
            })?;
        Ok((task.info(a.coordinator_state), a.modify_index))
    }

    pub async fn start_condition(&self) -> Result<StartCondition, ApiError> {
        let path = format!("{}/start-condition?wait={POLL_WAIT}", self.task_path());
        let v = self.call("GET", &path, None).await?;
        let sc: StartCondition = decode(&path, v)?;
        if !self.same_registration(sc.create_index) {
            return Err(self.registered_again());
        }
        Ok(sc)
    }

    /// The allocation was deleted and registered again (another
    /// `create_index`): this agent's task was the earlier registration's.
    fn registered_again(&self) -> ApiError {
        tracing::info!(
            alloc = %self.alloc,
            "the allocation was deleted and registered again: this agent's task was the \
             earlier registration's"
        );
        ApiError::Gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A token file that changes is read again (a platform renewing a
    /// workload identity); one that goes away or is emptied leaves the
    /// last token in use.
    #[test]
    fn a_changed_token_file_is_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        let replace = |text: &str| {
            let tmp = dir.path().join("token.tmp");
            std::fs::write(&tmp, text).unwrap();
            std::fs::rename(&tmp, &path).unwrap();
        };
        replace("first\n");
        let source = TokenSource::file(&path).unwrap();
        assert_eq!(source.current().as_deref(), Some("first"));
        replace("second\n");
        assert_eq!(source.current().as_deref(), Some("second"));
        replace("");
        assert_eq!(source.current().as_deref(), Some("second"));
        std::fs::remove_file(&path).unwrap();
        assert_eq!(source.current().as_deref(), Some("second"));
        replace("third");
        assert_eq!(source.current().as_deref(), Some("third"));
        assert!(TokenSource::file(&dir.path().join("none")).is_err());
    }

    /// A token rewritten in place with one of the same length, its
    /// modification time set back (as `cp -p`, `rsync -t` or `touch -r`
    /// do, or a file system whose clock ticks coarsely), is read again.
    #[test]
    fn a_token_rewritten_in_place_with_its_old_mtime_is_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "first-token\n").unwrap();
        let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
        let source = TokenSource::file(&path).unwrap();
        assert_eq!(source.current().as_deref(), Some("first-token"));
        std::fs::write(&path, "renewed-tok\n").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        assert_eq!(source.current().as_deref(), Some("renewed-tok"));
    }

    /// An outage is said when its first request gets no answer, and its
    /// end once, with how many tries failed over how long; the next one
    /// is said again.
    #[test]
    fn an_outage_is_said_when_it_begins_and_when_it_ends() {
        let t0 = std::time::Instant::now();
        let mut o = Outage::default();
        assert_eq!(o.answered(t0), None, "no outage, nothing to say");
        let begins: Vec<bool> = (0..5).map(|_| o.failed(t0)).collect();
        assert_eq!(begins, [true, false, false, false, false]);
        let later = t0 + Duration::from_secs(7);
        assert_eq!(o.answered(later), Some((5, Duration::from_secs(7))));
        assert_eq!(o.answered(later), None, "said once");
        assert!(o.failed(later), "the next outage is said again");
    }

    /// The waits double from 20 ms, each between half its step and the
    /// step, and none is longer than the 10 s the documentation names.
    #[test]
    fn backoff_waits_stay_within_their_step_and_the_cap() {
        let mut step = BACKOFF_START;
        for _ in 0..20 {
            for r in [0.0, 0.5, 0.999_999] {
                let wait = backoff_wait(step, r);
                assert!(wait >= step.min(BACKOFF_CAP) / 2, "{wait:?} at {step:?}");
                assert!(wait <= step.min(BACKOFF_CAP), "{wait:?} at {step:?}");
            }
            step = (step * 2).min(BACKOFF_CAP);
        }
        assert_eq!(step, Duration::from_secs(10));
        assert!(backoff_wait(step, 0.999_999) <= Duration::from_secs(10));
    }

    /// An answer that lacks a field the agent acts on (here `desired`,
    /// renamed) is an error, not "run"; a whole one reads as it is.
    #[test]
    fn answers_are_read_whole_or_refused() {
        let task = json!({"name": "web", "stage": "main", "readiness": false, "state": "running",
            "desired": "stop", "stop_reason": {"type": "Leader Task Dead", "task": null},
            "restart_generation": 2, "modify_index": 9, "allowed": true, "run": "12"});
        let detail = {
            let mut d = task.clone();
            d["coordinator_state"] = json!("main");
            d["alloc_modify_index"] = json!(9);
            d
        };
        let t: TaskDetailWire = decode("GET task", detail.clone()).unwrap();
        let info = t.task.info(t.coordinator_state);
        assert_eq!(info.desired, "stop");
        assert_eq!(info.stop_reason.as_deref(), Some("Leader Task Dead"));
        assert_eq!((info.restart_generation, info.modify_index), (2, 9));
        let mut renamed = detail;
        renamed["desired_state"] = renamed["desired"].take();
        renamed.as_object_mut().unwrap().remove("desired");
        let Err(ApiError::Fatal(e)) = decode::<TaskDetailWire>("GET task", renamed) else {
            panic!("an answer without `desired` was taken");
        };
        assert!(e.contains("desired"), "{e}");
        let start = json!({"allowed": "yes", "desired": "run", "coordinator_state": "main",
            "outcome": null, "failed_tasks": [], "state": "pending", "run": null,
            "create_index": 3});
        assert!(decode::<StartCondition>("GET start-condition", start.clone()).is_err());
        let mut whole = start;
        whole["allowed"] = json!(true);
        let sc: StartCondition = decode("GET start-condition", whole.clone()).unwrap();
        assert!(sc.allowed && sc.outcome.is_none());
        // A task's readiness is read, never assumed absent.
        let mut without = task.clone();
        without.as_object_mut().unwrap().remove("readiness");
        let alloc = json!({"modify_index": 4, "create_index": 3, "coordinator_state": "main",
            "tasks": [without]});
        assert!(decode::<AllocationWire>("GET allocation", alloc).is_err());
        let alloc = json!({"modify_index": 4, "create_index": 3, "coordinator_state": "main",
            "tasks": [task]});
        let a: AllocationWire = decode("GET allocation", alloc).unwrap();
        assert_eq!(a.tasks[0].name, "web");
    }
}
