//! The agent's calls to the server, retried with backoff until they go
//! through: a report is idempotent, so sending it twice is safe.

use std::{path::Path, time::Duration};

use serde_json::Value;

use super::AgentConfig;
use crate::net::Endpoint;

/// How long a long-poll asks the server to wait.
const POLL_WAIT: &str = "60s";
/// How long a request may take before it is retried: the poll plus slack.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(90);
const BACKOFF_START: Duration = Duration::from_millis(20);
const BACKOFF_CAP: Duration = Duration::from_secs(10);

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
    pub state: String,
    pub desired: String,
    pub stop_reason: Option<String>,
    pub restart_generation: u64,
    pub modify_index: u64,
    pub coordinator_state: String,
}

/// The answer to "may I start?".
#[derive(Debug, Clone)]
pub struct StartCondition {
    pub allowed: bool,
    pub desired: String,
    pub coordinator_state: String,
}

pub struct Api {
    endpoint: Endpoint,
    token: Option<String>,
    alloc: String,
    task: String,
}

fn text(v: &Value, key: &str) -> String {
    v[key].as_str().unwrap_or_default().to_owned()
}

fn parse_task(v: &Value) -> TaskInfo {
    TaskInfo {
        stage: text(v, "stage"),
        state: text(v, "state"),
        desired: text(v, "desired"),
        stop_reason: v["stop_reason"]["type"].as_str().map(str::to_owned),
        restart_generation: v["restart_generation"].as_u64().unwrap_or(0),
        modify_index: v["modify_index"].as_u64().unwrap_or(0),
        coordinator_state: text(v, "coordinator_state"),
    }
}

impl Api {
    pub fn new(config: &AgentConfig) -> Result<Self, String> {
        Ok(Self {
            endpoint: Endpoint::new(&config.server, config.ca_cert.as_deref())?,
            token: config.token.as_ref().map(|t| t.0.clone()),
            alloc: config.alloc.clone(),
            task: config.task.clone(),
        })
    }

    /// Sends until the server answers something final. Network errors, 5xx
    /// (503 included), 409 and 429 are retried with exponential backoff and
    /// jitter (20 ms doubling to 10 s); other 4xx are fatal, except a
    /// missing or deleted allocation, which ends the agent quietly.
    async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, ApiError> {
        let mut backoff = BACKOFF_START;
        loop {
            let answer = self
                .endpoint
                .request(method, path, self.token.as_deref(), body, REQUEST_TIMEOUT)
                .await;
            let problem = match answer {
                Ok((status, body)) if status < 300 => {
                    return Ok(serde_json::from_slice(&body).unwrap_or(Value::Null));
                }
                Ok((status, body)) => {
                    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                    let code = text(&v, "code");
                    if status == 410 || code == "allocation_not_found" {
                        return Err(ApiError::Gone);
                    }
                    if (400..500).contains(&status) && status != 409 && status != 429 {
                        return Err(ApiError::Fatal(format!(
                            "{method} {path}: {status} {code}: {}",
                            text(&v, "detail")
                        )));
                    }
                    format!("{status} {code}")
                }
                Err(e) => e,
            };
            let sleep = backoff.mul_f64(0.5 + fastrand::f64());
            tracing::warn!(%problem, retry_in = ?sleep, "{method} {path} did not go through; retrying");
            tokio::time::sleep(sleep).await;
            backoff = (backoff * 2).min(BACKOFF_CAP);
        }
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
        match self.call("PUT", &self.alloc_path(), Some(&spec)).await {
            // Registered by this agent or another one of the group.
            Ok(_) => Ok(()),
            Err(e) => Err(e),
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
        Ok(parse_task(&v))
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
        let alloc_index = v["modify_index"].as_u64().unwrap_or(0);
        let task = v["tasks"]
            .as_array()
            .and_then(|ts| ts.iter().find(|t| t["name"] == self.task.as_str()))
            .ok_or_else(|| {
                ApiError::Fatal(format!("task {:?} is not in the allocation", self.task))
            })?;
        let mut info = parse_task(task);
        info.coordinator_state = text(&v, "coordinator_state");
        Ok((info, alloc_index))
    }

    pub async fn start_condition(&self) -> Result<StartCondition, ApiError> {
        let path = format!("{}/start-condition?wait={POLL_WAIT}", self.task_path());
        let v = self.call("GET", &path, None).await?;
        Ok(StartCondition {
            allowed: v["allowed"].as_bool().unwrap_or(false),
            desired: text(&v, "desired"),
            coordinator_state: text(&v, "coordinator_state"),
        })
    }
}
