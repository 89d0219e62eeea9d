//! The agent's calls to the server, retried with backoff until they go
//! through: a report is idempotent, so sending it twice is safe.

use std::{path::Path, time::Duration};

use serde_json::Value;

use super::AgentConfig;
use crate::client::Endpoint;

/// How long a long-poll asks the server to wait.
const POLL_WAIT: &str = "60s";
/// How long a request may take before it is retried: the poll plus slack.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(90);
const BACKOFF_START: Duration = Duration::from_millis(20);
const BACKOFF_CAP: Duration = Duration::from_secs(10);
/// Failures to reach any server in a row, or for how long, before the log
/// says what to check.
const HINT_AFTER_FAILURES: u32 = 5;
const HINT_AFTER: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The allocation does not exist (any more).
    #[error("the allocation is gone")]
    Gone,
    /// A request the server will never accept (bad token, bad spec, ...).
    #[error("{0}")]
    Fatal(String),
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
}

/// The answer to "may I start?" (decoded whole: every field is required).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct StartCondition {
    pub allowed: bool,
    pub desired: String,
    pub coordinator_state: String,
    /// `succeeded` or `failed` once the allocation is in `poststop`.
    pub outcome: Option<String>,
    pub failed_tasks: Vec<String>,
}

/// What the server answered a call.
enum Answer {
    /// A 2xx, with its body.
    Taken(Value),
    /// A 4xx the caller asked to see rather than fail on.
    Refused { code: String, detail: String },
}

/// Failures to reach any server, counted to say once per episode what to
/// check (an episode ends when a server answers anything).
#[derive(Debug, Default)]
struct Unreachable {
    failures: u32,
    since: Option<std::time::Instant>,
    said: bool,
}

impl Unreachable {
    /// A request got no answer at `now`: the failures so far, when it is
    /// time to say what to check (once an episode).
    fn failed(&mut self, now: std::time::Instant) -> Option<u32> {
        self.failures += 1;
        let since = *self.since.get_or_insert(now);
        let due = self.failures >= HINT_AFTER_FAILURES || now - since >= HINT_AFTER;
        if due && !self.said {
            self.said = true;
            return Some(self.failures);
        }
        None
    }

    fn reached(&mut self) {
        *self = Self::default();
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
    /// long-poll and a report may fail side by side).
    unreachable: std::sync::Mutex<Unreachable>,
    token: Option<String>,
    alloc: String,
    task: String,
}

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
}

#[derive(Debug, serde::Deserialize)]
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
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("cannot read the token file {}: {e}", path.display()))?;
                let secret = text.lines().next().unwrap_or_default().trim().to_owned();
                if secret.is_empty() {
                    return Err(format!("the token file {} is empty", path.display()));
                }
                Some(secret)
            }
            None => config.token.as_ref().map(|t| t.0.clone()),
        };
        Ok(Self {
            give_up_at: Default::default(),
            endpoints: config
                .server
                .iter()
                .map(|url| Endpoint::new(url, config.ca_cert.as_deref()))
                .collect::<Result<_, _>>()?,
            current: Default::default(),
            unreachable: Default::default(),
            token,
            alloc: config.alloc.clone(),
            task: config.task.clone(),
        })
    }

    /// Sends until the server answers something final. Network errors, 5xx
    /// (503 included), 409 and 429 are retried with exponential backoff and
    /// jitter (20 ms doubling to 10 s), after a network error or a 5xx at
    /// the next server of the list; other 4xx are fatal, except a missing
    /// or deleted allocation, which ends the agent quietly.
    async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, ApiError> {
        match self.call_unless(method, path, body, &[]).await? {
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
                return Err(ApiError::Fatal(format!(
                    "{method} {path}: the server did not take it within --shutdown-timeout; \
                     the task is stopped, but the server may still show it running"
                )));
            }
            let timeout = left.map_or(REQUEST_TIMEOUT, |l| l.min(REQUEST_TIMEOUT));
            let at = self.current.load(Ordering::Relaxed) % self.endpoints.len();
            let answer = self.endpoints[at]
                .request(
                    method,
                    path,
                    self.token.as_deref(),
                    body,
                    // The agent reads nothing of a write's answer but its
                    // status: the small one will do.
                    if body.is_some() { MINIMAL } else { &[] },
                    timeout,
                )
                .await;
            // Unreachable or unavailable (5xx): the next try goes to the
            // next server, if there are several.
            if answer.as_ref().map_or(true, |(status, _)| *status >= 500) {
                self.current
                    .store((at + 1) % self.endpoints.len(), Ordering::Relaxed);
            }
            let problem = match answer {
                Ok((status, body)) if status < 300 => {
                    self.reached();
                    return Ok(Answer::Taken(
                        serde_json::from_slice(&body).unwrap_or(Value::Null),
                    ));
                }
                Ok((status, body)) => {
                    self.reached();
                    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                    let code = text(&v, "code");
                    if status == 410 || code == "allocation_not_found" {
                        return Err(ApiError::Gone);
                    }
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
                    if (400..500).contains(&status) && status != 409 && status != 429 {
                        return Err(ApiError::Fatal(format!(
                            "{method} {path}: {status} {code}: {}",
                            text(&v, "detail")
                        )));
                    }
                    format!("{status} {code}")
                }
                Err(e) => {
                    self.unreached(&e);
                    e
                }
            };
            let mut sleep = backoff.mul_f64(0.5 + fastrand::f64());
            if let Some(at) = self.give_up_at.get() {
                sleep = sleep.min(at.saturating_duration_since(tokio::time::Instant::now()));
            }
            tracing::warn!(%problem, retry_in = ?sleep, "{method} {path} did not go through; retrying");
            tokio::time::sleep(sleep).await;
            backoff = (backoff * 2).min(BACKOFF_CAP);
        }
    }

    /// A server answered: an episode of failures, if any, is over.
    fn reached(&self) {
        self.unreachable
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .reached();
    }

    /// A request got no answer; says once an episode what to check.
    fn unreached(&self, problem: &str) {
        let failures = self
            .unreachable
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .failed(std::time::Instant::now());
        let Some(failures) = failures else {
            return;
        };
        let urls: Vec<&str> = self.endpoints.iter().map(|e| e.url.as_str()).collect();
        tracing::warn!(
            "could not reach the server at {}: {failures} tries in a row got no answer (the last: \
             {problem}). Check that the server is running and listens there; that the URL is \
             right, its scheme included: an https:// URL for a plain-HTTP server fails in the TLS \
             handshake, an http:// URL for a TLS server gets no HTTP answer; and for https, that \
             --ca-cert names the CA that signed the server's certificate. The agent keeps trying \
             and says this again only after it has reached the server.",
            urls.join(", ")
        );
    }

    fn alloc_path(&self) -> String {
        format!("/v1/allocations/{}", self.alloc)
    }

    fn task_path(&self) -> String {
        format!("/v1/allocations/{}/tasks/{}", self.alloc, self.task)
    }

    pub async fn register(&self, file: &Path) -> Result<(), ApiError> {
        let text = std::fs::read_to_string(file)
            .map_err(|e| ApiError::Fatal(format!("cannot read {}: {e}", file.display())))?;
        let spec: Value = serde_json::from_str(&text)
            .map_err(|e| ApiError::Fatal(format!("{} is not JSON: {e}", file.display())))?;
        loop {
            let path = self.alloc_path();
            let put = self.call_unless("PUT", &path, Some(&spec), &["allocation_exists"]);
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

    pub async fn report(&self, body: &Value) -> Result<(), ApiError> {
        self.call("PUT", &format!("{}/state", self.task_path()), Some(body))
            .await
            .map(|_| ())
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
        decode(&path, v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// What to check is said after five failures in a row or thirty
    /// seconds of them, once, and again only after a server answered.
    #[test]
    fn what_to_check_is_said_once_an_episode() {
        let t0 = std::time::Instant::now();
        let mut u = Unreachable::default();
        let said: Vec<_> = (0..8).map(|_| u.failed(t0)).collect();
        assert_eq!(said.iter().flatten().collect::<Vec<_>>(), [&5], "{said:?}");
        assert_eq!(said.iter().position(Option::is_some), Some(4));
        u.reached();
        assert_eq!(u.failed(t0), None, "a new episode starts from none");
        assert_eq!(
            u.failed(t0 + HINT_AFTER),
            Some(2),
            "or after thirty seconds"
        );
        assert_eq!(u.failed(t0 + HINT_AFTER * 2), None);
    }

    /// An answer that lacks a field the agent acts on (here `desired`,
    /// renamed) is an error, not "run"; a whole one reads as it is.
    #[test]
    fn answers_are_read_whole_or_refused() {
        let task = json!({"name": "web", "stage": "main", "readiness": false, "state": "running",
            "desired": "stop", "stop_reason": {"type": "Leader Task Dead", "task": null},
            "restart_generation": 2, "modify_index": 9, "allowed": true});
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
            "outcome": null, "failed_tasks": []});
        assert!(decode::<StartCondition>("GET start-condition", start.clone()).is_err());
        let mut whole = start;
        whole["allowed"] = json!(true);
        let sc: StartCondition = decode("GET start-condition", whole.clone()).unwrap();
        assert!(sc.allowed && sc.outcome.is_none());
        // A task's readiness is read, never assumed absent.
        let mut without = task.clone();
        without.as_object_mut().unwrap().remove("readiness");
        let alloc = json!({"modify_index": 4, "coordinator_state": "main", "tasks": [without]});
        assert!(decode::<AllocationWire>("GET allocation", alloc).is_err());
        let alloc = json!({"modify_index": 4, "coordinator_state": "main", "tasks": [task]});
        let a: AllocationWire = decode("GET allocation", alloc).unwrap();
        assert_eq!(a.tasks[0].name, "web");
    }
}
