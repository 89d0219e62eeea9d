//! Test helpers: an in-process router for `oneshot` handler tests, and a
//! real server on an OS-chosen loopback port for end-to-end tests.
#![allow(dead_code)]

pub mod agents;
pub mod etcd;
pub mod process;
pub mod proxy;
pub mod raw;
pub mod stall;

use std::{sync::Arc, time::Duration};

use axum::{
    Router,
    body::Body,
    http::{HeaderMap, Method, Request, StatusCode, header},
};
use http_body_util::BodyExt;
use serde_json::Value;
use taskgate::{
    app::Application,
    config::ServeConfig,
    http::{HttpConfig, app, auth::Auth},
    registry::{Registry, RegistryConfig},
    store::MemoryStore,
};
use tower::ServiceExt;

/// An HTTP client for tests. reqwest's rustls is built without a crypto
/// provider of its own: ring, as the server's, is installed first.
pub fn http() -> reqwest::Client {
    http_builder().build().expect("a client")
}

pub fn http_builder() -> reqwest::ClientBuilder {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
}

pub struct TestApp {
    pub router: Router,
    pub registry: Registry,
    pub store: Arc<MemoryStore>,
}

pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Value,
    pub raw: Vec<u8>,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The `X-Taskgate-Index` header.
    pub fn index(&self) -> u64 {
        self.header("x-taskgate-index")
            .expect("X-Taskgate-Index is present")
            .parse()
            .unwrap()
    }

    /// Asserts a problem+json answer with this status and code.
    #[track_caller]
    pub fn assert_problem(&self, status: u16, code: &str) {
        assert_eq!(self.status.as_u16(), status, "body: {}", self.body);
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "body: {}",
            self.body
        );
        assert_eq!(self.body["code"], code, "body: {}", self.body);
        assert_eq!(self.body["status"], status);
        assert_eq!(self.body["type"], format!("/errors#{code}"));
        assert!(self.body["title"].is_string());
        assert!(self.body["detail"].is_string());
    }

    /// The `errors[].field` values of a problem.
    pub fn error_fields(&self) -> Vec<String> {
        self.body["errors"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|e| e["field"].as_str().unwrap().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The run of task `name` in an allocation view (the answer to the
    /// report that made it `running`): what its agent sends back as
    /// `Taskgate-Run`.
    #[track_caller]
    pub fn run(&self, name: &str) -> String {
        self.task(name)["run"]
            .as_str()
            .unwrap_or_else(|| panic!("task {name} runs no run in {}", self.body))
            .to_owned()
    }

    /// A task view by name from an allocation view.
    pub fn task(&self, name: &str) -> &Value {
        self.body["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == name)
            .unwrap_or_else(|| panic!("no task {name} in {}", self.body))
    }
}

pub async fn test_app() -> TestApp {
    test_app_with(RegistryConfig::default(), HttpConfig::default()).await
}

pub async fn test_app_with(registry: RegistryConfig, http: HttpConfig) -> TestApp {
    test_app_auth(registry, http, Auth::default()).await
}

/// The secrets of `with_tokens`' agent, reader and operator.
pub const AGENT: &str = "agent-secret";
pub const READER: &str = "reader-secret";
pub const OPERATOR: &str = "operator-secret";

/// A router whose server has tokens: an agent's and a reader's (both for
/// every allocation), and the operator's (`AGENT`, `READER`, `OPERATOR`).
pub async fn with_tokens(config: RegistryConfig) -> TestApp {
    let tokens = serde_json::json!({"tokens": [
        {"name": "agent", "role": "agent", "sha256": sha256_hex(AGENT)},
        {"name": "reader", "role": "reader", "sha256": sha256_hex(READER)},
    ]});
    with_token_file(config, tokens, OPERATOR).await
}

/// How many requests a `/metrics` answer counts under this method, route
/// and status (0 if it names none).
pub fn requests_counted(metrics: &Answer, method: &str, route: &str, status: u16) -> u64 {
    let series = format!(
        "taskgate_http_request_duration_seconds_count{{method=\"{method}\",route=\"{route}\",status=\"{status}\"}} "
    );
    std::str::from_utf8(&metrics.raw)
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(&series))
        .map_or(0, |n| n.parse().unwrap())
}

/// A secret's SHA-256 in hex, as a token file holds it.
pub fn sha256_hex(secret: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(secret.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A router whose server has the tokens of `tokens` (a token file's JSON)
/// and the operator's secret `operator`.
pub async fn with_token_file(
    config: RegistryConfig,
    tokens: serde_json::Value,
    operator: &str,
) -> TestApp {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens.json");
    std::fs::write(&file, tokens.to_string()).unwrap();
    let auth = Auth::load(Some(&file), Some(operator)).unwrap();
    test_app_auth(config, HttpConfig::default(), auth).await
}

/// A registry whose wall clock follows tokio's (tests on paused time).
pub fn paused_clock() -> RegistryConfig {
    RegistryConfig {
        clock: taskgate::registry::Clock::tokio(),
        ..RegistryConfig::default()
    }
}

/// Lets the registry's timers and follower run until they park again.
pub async fn settle() {
    for _ in 0..64 {
        tokio::task::yield_now().await;
    }
}

/// The etcd endpoints the suites run against instead of the memory store
/// (`TASKGATE_TEST_ETCD=http://127.0.0.1:2379,...`; `.ci/run` sets it for a
/// second run of the API suites).
pub fn etcd_endpoints() -> Option<Vec<String>> {
    let list = std::env::var("TASKGATE_TEST_ETCD").ok()?;
    Some(list.split(',').map(str::to_owned).collect())
}

/// True when the suite runs on etcd: a test that cannot (it injects faults
/// into the memory store, or runs on tokio's paused clock, which would fire
/// the etcd client's timeouts at once) says so and does nothing.
pub fn on_etcd(test: &str, why: &str) -> bool {
    let on = etcd_endpoints().is_some();
    if on {
        eprintln!("{test}: {why}; not run on etcd");
    }
    on
}

/// A router over a registry on the memory store, or with
/// `TASKGATE_TEST_ETCD` a replica on etcd under a prefix of its own (the
/// memory store is then unused).
pub async fn test_app_auth(registry: RegistryConfig, http: HttpConfig, auth: Auth) -> TestApp {
    static APPS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let store = Arc::new(MemoryStore::new());
    let registry = match etcd_endpoints() {
        None => Registry::open(store.clone(), registry).unwrap(),
        Some(endpoints) => {
            let n = APPS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let prefix = format!(
                "/api-{}-{}-{n}/",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos()
            );
            let config = taskgate::store::etcd::EtcdConfig {
                prefix,
                ..taskgate::store::etcd::EtcdConfig::new(endpoints)
            };
            let etcd = taskgate::store::etcd::EtcdStore::connect(&config)
                .await
                .expect("the etcd of TASKGATE_TEST_ETCD answers");
            Registry::open(Arc::new(etcd), registry).unwrap()
        }
    };
    TestApp {
        router: app(registry.clone(), http, Arc::new(auth)),
        registry,
        store,
    }
}

impl TestApp {
    pub async fn send(&self, req: Request<Body>) -> Answer {
        let res = self.router.clone().oneshot(req).await.unwrap();
        let status = res.status();
        let headers = res.headers().clone();
        let raw = res.into_body().collect().await.unwrap().to_bytes().to_vec();
        let body = serde_json::from_slice(&raw).unwrap_or(Value::Null);
        Answer {
            status,
            headers,
            body,
            raw,
        }
    }

    /// A request with a JSON body (if any).
    pub async fn call(&self, method: &str, uri: &str, body: Option<Value>) -> Answer {
        self.call_with(method, uri, &[], body).await
    }

    /// `call`, with more headers (`Taskgate-Run`, `Authorization`, ...).
    pub async fn call_with(
        &self,
        method: &str,
        uri: &str,
        headers: &[(&str, &str)],
        body: Option<Value>,
    ) -> Answer {
        let mut req = Request::builder()
            .method(Method::from_bytes(method.as_bytes()).unwrap())
            .uri(uri);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let body = match body {
            Some(v) => {
                req = req.header(header::CONTENT_TYPE, "application/json");
                Body::from(v.to_string())
            }
            None => Body::empty(),
        };
        self.send(req.body(body).unwrap()).await
    }

    /// A request with a raw body and content type.
    pub async fn raw(
        &self,
        method: &str,
        uri: &str,
        ct: Option<&str>,
        body: impl Into<Body>,
    ) -> Answer {
        let mut req = Request::builder()
            .method(Method::from_bytes(method.as_bytes()).unwrap())
            .uri(uri);
        if let Some(ct) = ct {
            req = req.header(header::CONTENT_TYPE, ct);
        }
        self.send(req.body(body.into()).unwrap()).await
    }

    pub async fn get(&self, uri: &str) -> Answer {
        self.call("GET", uri, None).await
    }

    /// Registers the five-task allocation of the API documentation as `id`.
    pub async fn register_five(&self, id: &str) -> Answer {
        let a = self
            .call("PUT", &format!("/v1/allocations/{id}"), Some(five_tasks()))
            .await;
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
        a
    }

    pub async fn report(&self, id: &str, task: &str, body: Value) -> Answer {
        self.call(
            "PUT",
            &format!("/v1/allocations/{id}/tasks/{task}/state"),
            Some(body),
        )
        .await
    }

    /// `report`, from the agent of run `run` (`Taskgate-Run`): a task
    /// that is `running` is reported again by the agent that runs it.
    pub async fn report_in(&self, id: &str, task: &str, run: &str, body: Value) -> Answer {
        let req = Request::put(format!("/v1/allocations/{id}/tasks/{task}/state"))
            .header(header::CONTENT_TYPE, "application/json")
            .header("taskgate-run", run)
            .body(Body::from(body.to_string()))
            .unwrap();
        self.send(req).await
    }

    /// Opens `GET uri` as a stream (the event stream): its status and
    /// headers now, its lines as they come.
    pub async fn stream(&self, uri: &str) -> Lines {
        self.stream_req(Request::get(uri).body(Body::empty()).unwrap())
            .await
    }

    /// `stream` for a request of the caller's making.
    pub async fn stream_req(&self, req: Request<Body>) -> Lines {
        let res = self.router.clone().oneshot(req).await.unwrap();
        let status = res.status();
        let headers = res.headers().clone();
        Lines {
            status,
            headers,
            body: res.into_body(),
            buf: Vec::new(),
        }
    }

    /// Waits (bounded) until `n` requests are parked.
    pub async fn parked(&self, n: usize) {
        parked(&self.registry, n).await
    }
}

/// A streamed answer, read line by line.
pub struct Lines {
    pub status: StatusCode,
    pub headers: HeaderMap,
    body: Body,
    buf: Vec<u8>,
}

impl Lines {
    /// The next line as JSON, or `None` once the stream has ended. A line
    /// that does not come within a minute fails the test.
    pub async fn next(&mut self) -> Option<Value> {
        loop {
            if let Some(line) = take_line(&mut self.buf) {
                return Some(line);
            }
            let frame = tokio::time::timeout(Duration::from_secs(60), self.body.frame())
                .await
                .expect("a line within a minute");
            match frame {
                None => {
                    assert!(self.buf.is_empty(), "the stream ended mid-line");
                    return None;
                }
                Some(frame) => {
                    if let Ok(data) = frame.expect("the body reads").into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }

    /// The next line, which must come.
    pub async fn line(&mut self) -> Value {
        self.next().await.expect("the stream is open")
    }
}

/// The first whole line of a newline-delimited JSON stream read so far,
/// taken out of `buf`; `None` until a newline has come.
pub fn take_line(buf: &mut Vec<u8>) -> Option<Value> {
    let end = buf.iter().position(|&b| b == b'\n')?;
    let line: Vec<u8> = buf.drain(..=end).collect();
    Some(serde_json::from_slice(&line).expect("each line is JSON"))
}

/// Waits until `n` requests are parked in waits. Polls a readiness
/// condition, bounded: a bug fails the test instead of hanging it.
pub async fn parked(registry: &Registry, n: usize) {
    for _ in 0..2_000 {
        if registry.waiters() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("{n} waiters never parked (have {})", registry.waiters());
}

/// Waits until no request is parked (a stream's end is noticed by its
/// writer task, a moment after its client goes away). Bounded.
pub async fn unparked(registry: &Registry) {
    for _ in 0..2_000 {
        if registry.waiters() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("still {} waiters", registry.waiters());
}

/// Waits until at most `n` requests are parked. Bounded.
pub async fn unparked_to(registry: &Registry, n: usize) {
    for _ in 0..2_000 {
        if registry.waiters() <= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("still {} waiters, not {n}", registry.waiters());
}

/// The example allocation of the API documentation.
pub fn five_tasks() -> Value {
    serde_json::from_str(taskgate_testkit::FIVE_TASKS).expect("FIVE_TASKS is JSON")
}

/// A real server on 127.0.0.1 with an OS-chosen port, stopped by dropping
/// (or sending on) `stop`.
pub struct Server {
    pub base: String,
    pub registry: Registry,
    pub stop: Option<tokio::sync::oneshot::Sender<()>>,
    pub task: tokio::task::JoinHandle<std::io::Result<()>>,
}

pub async fn spawn_server() -> Server {
    let app = Application::build(ServeConfig::for_tests()).await.unwrap();
    let base = format!("http://{}", app.local_addr());
    let registry = app.registry().clone();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(app.run_until_stopped(async move {
        let _ = rx.await;
    }));
    Server {
        base,
        registry,
        stop: Some(tx),
        task,
    }
}
