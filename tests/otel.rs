//! Traces (docs/operations.md, "Traces"): the real binary, configured by
//! `OTEL_*` variables only, exporting to an OTLP/HTTP receiver this test
//! runs on loopback (protobuf and JSON decoded with the OTLP types).

mod common;

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{body::Bytes, http::HeaderMap, routing::post};
use common::process::Server;
use opentelemetry_proto::tonic::{
    collector::trace::v1::ExportTraceServiceRequest,
    common::v1::{AnyValue, any_value::Value as Any},
};
use prost::Message;
use serde_json::{Value, json};
use tokio::sync::Notify;

/// One span as the receiver got it.
#[derive(Clone, Debug)]
struct Got {
    name: String,
    trace: String,
    id: String,
    parent: String,
    start: u64,
    end: u64,
    kind: i32,
    attrs: BTreeMap<String, String>,
    service: String,
}

impl Got {
    fn attr(&self, key: &str) -> &str {
        self.attrs.get(key).map_or("", String::as_str)
    }
}

/// An OTLP/HTTP receiver on loopback: every span it was sent, and how
/// many export requests came.
struct Receiver {
    addr: std::net::SocketAddr,
    spans: Arc<Mutex<Vec<Got>>>,
    requests: Arc<AtomicUsize>,
    changed: Arc<Notify>,
}

fn text(v: Option<&AnyValue>) -> String {
    match v.and_then(|v| v.value.as_ref()) {
        Some(Any::StringValue(s)) => s.clone(),
        Some(Any::IntValue(i)) => i.to_string(),
        Some(Any::BoolValue(b)) => b.to_string(),
        Some(Any::DoubleValue(d)) => d.to_string(),
        Some(Any::ArrayValue(a)) => a
            .values
            .iter()
            .map(|v| text(Some(v)))
            .collect::<Vec<_>>()
            .join(","),
        _ => String::new(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Receiver {
    async fn start() -> Self {
        let spans = Arc::new(Mutex::new(Vec::new()));
        let requests = Arc::new(AtomicUsize::new(0));
        let changed = Arc::new(Notify::new());
        let (kept, counted, told) = (spans.clone(), requests.clone(), changed.clone());
        let app = axum::Router::new().route(
            "/v1/traces",
            post(move |headers: HeaderMap, body: Bytes| async move {
                counted.fetch_add(1, Ordering::SeqCst);
                let json = headers
                    .get("content-type")
                    .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
                let request = if json {
                    serde_json::from_slice::<ExportTraceServiceRequest>(&body)
                        .expect("OTLP/JSON as the specification encodes it")
                } else {
                    ExportTraceServiceRequest::decode(body).expect("OTLP protobuf")
                };
                let mut got = Vec::new();
                for rs in request.resource_spans {
                    let service = rs
                        .resource
                        .iter()
                        .flat_map(|r| &r.attributes)
                        .find(|kv| kv.key == "service.name")
                        .map(|kv| text(kv.value.as_ref()))
                        .unwrap_or_default();
                    for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                        got.push(Got {
                            name: span.name,
                            trace: hex(&span.trace_id),
                            id: hex(&span.span_id),
                            parent: hex(&span.parent_span_id),
                            start: span.start_time_unix_nano,
                            end: span.end_time_unix_nano,
                            kind: span.kind,
                            attrs: span
                                .attributes
                                .iter()
                                .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
                                .collect(),
                            service: service.clone(),
                        });
                    }
                }
                kept.lock().unwrap().extend(got);
                told.notify_waiters();
                ""
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self {
            addr,
            spans,
            requests,
            changed,
        }
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn spans(&self) -> Vec<Got> {
        self.spans.lock().unwrap().clone()
    }

    /// Waits (at most a minute) until the spans received satisfy `done`.
    async fn wait_for(&self, what: &str, done: impl Fn(&[Got]) -> bool) -> Vec<Got> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let changed = self.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            let spans = self.spans();
            if done(&spans) {
                return spans;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                panic!("no {what} within a minute; got {spans:#?}");
            }
        }
    }
}

/// `taskgate serve --in-memory` with traces exported to `receiver` (and
/// `env` besides), started off the runtime's threads.
async fn traced(receiver: &Receiver, env: &[(&str, &str)]) -> Server {
    let endpoint = receiver.endpoint();
    let mut env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    env.push(("OTEL_EXPORTER_OTLP_ENDPOINT".into(), endpoint));
    // Batches go out every 100 ms unless a test says otherwise.
    if !env.iter().any(|(k, _)| k == "OTEL_BSP_SCHEDULE_DELAY") {
        env.push(("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into()));
    }
    tokio::task::spawn_blocking(move || {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        Server::start_env(&["--in-memory"], &env)
    })
    .await
    .unwrap()
}

/// Stops `server` with SIGTERM (a graceful stop, which flushes the
/// spans), off the runtime's threads: its last export needs the receiver.
async fn stop(server: Server) -> Vec<String> {
    let (status, lines) = tokio::task::spawn_blocking(move || server.stop())
        .await
        .unwrap();
    assert!(status.success(), "{status}: {lines:#?}");
    lines
}

async fn send(method: reqwest::Method, url: String, body: Option<Value>) -> Value {
    let mut req = common::http().request(method.clone(), &url);
    if let Some(body) = body {
        req = req.json(&body);
    }
    let res = req.send().await.unwrap();
    let status = res.status();
    let text = res.text().await.unwrap();
    assert!(status.is_success(), "{method} {url}: {status} {text}");
    serde_json::from_str(&text).unwrap_or(Value::Null)
}

/// Reports `state` for `task` of `alloc`.
async fn report(base: &str, alloc: &str, task: &str, state: &str) -> Value {
    let url = format!("{base}/v1/allocations/{alloc}/tasks/{task}/state");
    send(reqwest::Method::PUT, url, Some(json!({ "state": state }))).await
}

fn stage_of(v: &Value) -> &str {
    v["coordinator_state"].as_str().unwrap_or_default()
}

/// The README's five-task allocation `alloc` from registration to its
/// end (each stage entered by one report), with `b-<alloc>`, whose one
/// task depends on `web` running, registered first: it waits for that
/// (and the dependency holds from web's running report to its dead one).
async fn drive(base: &str, alloc: &str) {
    let dependent = json!({"tasks": [{"name": "app", "depends_on": [
        {"task": "web", "allocation": alloc, "condition": "running"}
    ]}]});
    let url = |id: &str| format!("{base}/v1/allocations/{id}");
    send(
        reqwest::Method::PUT,
        url(&format!("b-{alloc}")),
        Some(dependent),
    )
    .await;
    let a = send(reqwest::Method::PUT, url(alloc), Some(common::five_tasks())).await;
    assert_eq!(stage_of(&a), "prestart");
    report(base, alloc, "proxy", "running").await;
    report(base, alloc, "init", "running").await;
    assert_eq!(stage_of(&report(base, alloc, "init", "dead").await), "main");
    assert_eq!(
        stage_of(&report(base, alloc, "web", "running").await),
        "poststart"
    );
    report(base, alloc, "announce", "running").await;
    let a = report(base, alloc, "announce", "dead").await;
    assert_eq!(stage_of(&a), "wait_alloc");
    report(base, alloc, "web", "dead").await;
    assert_eq!(
        stage_of(&report(base, alloc, "proxy", "dead").await),
        "poststop"
    );
    report(base, alloc, "cleanup", "running").await;
    report(base, alloc, "cleanup", "dead").await;
}

/// The spans of `alloc`'s trace.
fn trace_of<'a>(spans: &'a [Got], alloc: &str) -> Vec<&'a Got> {
    let Some(root) = spans
        .iter()
        .find(|s| s.name == "allocation" && s.attr("taskgate.alloc_id") == alloc)
    else {
        return Vec::new();
    };
    let mut trace: Vec<&Got> = spans.iter().filter(|s| s.trace == root.trace).collect();
    trace.sort_by_key(|s| (s.start, s.end));
    trace
}

/// Whether the receiver holds `alloc`'s finished trace and the
/// dependent's wait.
fn arrived(spans: &[Got], alloc: &str) -> bool {
    let dependent = format!("b-{alloc}");
    !trace_of(spans, alloc).is_empty()
        && spans
            .iter()
            .any(|s| s.name == "wait dependency" && s.attr("taskgate.alloc_id") == dependent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocation_s_stages_and_waits_reach_the_collector_in_one_trace() {
    let receiver = Receiver::start().await;
    let server = traced(&receiver, &[]).await;
    drive(&server.base, "a1").await;
    let spans = receiver
        .wait_for("trace of a1", |spans| arrived(spans, "a1"))
        .await;

    // A span per request, named by its route, with the allocation and
    // the task of its path.
    let reports: Vec<&Got> = spans
        .iter()
        .filter(|s| s.name == "PUT /v1/allocations/{alloc_id}/tasks/{task}/state")
        .collect();
    assert!(
        reports.iter().any(|s| s.attr("taskgate.alloc_id") == "a1"
            && s.attr("taskgate.task") == "web"
            && s.attr("http.response.status_code") == "200"),
        "{reports:#?}"
    );
    let register = spans
        .iter()
        .find(|s| s.name == "PUT /v1/allocations/{alloc_id}" && s.attr("taskgate.alloc_id") == "a1")
        .expect("the registration's span");
    assert_eq!(register.kind, 2, "a server span");
    assert_eq!(register.attr("taskgate.task"), "");
    assert!(
        spans.iter().all(|s| s.service == "taskgate"),
        "the default service name"
    );

    // One trace for the allocation: its root, a span per stage in order,
    // each ending where the next begins, and the waits of the tasks
    // behind a closed gate.
    let trace = trace_of(&spans, "a1");
    let root = trace.iter().find(|s| s.name == "allocation").unwrap();
    assert_eq!(root.parent, "");
    assert_eq!(root.attr("taskgate.outcome"), "succeeded");
    assert!(
        trace
            .iter()
            .all(|s| s.name == "allocation" || s.parent == root.id)
    );
    let stages: Vec<&&Got> = trace
        .iter()
        .filter(|s| s.name.starts_with("stage "))
        .collect();
    let names: Vec<&str> = stages.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "stage prestart",
            "stage main",
            "stage poststart",
            "stage wait_alloc",
            "stage poststop"
        ]
    );
    for pair in stages.windows(2) {
        assert_eq!(pair[0].end, pair[1].start, "{pair:#?}");
        assert_eq!(
            pair[0].attr("taskgate.stage.next"),
            pair[1].attr("taskgate.stage")
        );
    }
    assert!(
        stages
            .iter()
            .all(|s| s.attr("taskgate.start_exact") == "true")
    );
    assert_eq!(
        stages[0].start, root.start,
        "prestart opens at registration"
    );
    assert_eq!(stages[4].end, root.end, "the allocation ends with poststop");
    assert_eq!(
        stages[0].attr("taskgate.waited_on"),
        "init",
        "the last it waited for"
    );
    assert_eq!(stages[4].attr("taskgate.stage.next"), "finished");

    let waits: BTreeMap<&str, &&Got> = trace
        .iter()
        .filter(|s| s.name == "wait gate")
        .map(|s| (s.attr("taskgate.task"), s))
        .collect();
    assert_eq!(
        waits.keys().copied().collect::<Vec<_>>(),
        ["announce", "cleanup", "web"]
    );
    let web = waits["web"];
    assert_eq!(web.attr("taskgate.gate"), "main");
    assert_eq!(
        (web.start, web.end),
        (root.start, stages[1].start),
        "registered to main"
    );
    assert_eq!(waits["announce"].end, stages[2].start);
    assert_eq!(waits["cleanup"].end, stages[4].start);

    // The dependent waited from its registration until web ran, in a
    // trace of its own.
    let dep = spans.iter().find(|s| s.name == "wait dependency").unwrap();
    assert_eq!(dep.attr("taskgate.alloc_id"), "b-a1");
    assert_eq!(dep.attr("taskgate.task"), "app");
    assert_eq!(dep.attr("taskgate.dependency"), "a1/web");
    assert_eq!(dep.attr("taskgate.dependency.condition"), "running");
    assert_ne!(dep.trace, root.trace);
    // From its registration, before a1's, to the change that judged it
    // (its own, right after web's running report).
    assert!(dep.start < root.start, "{dep:#?}");
    let web_running = stages[2].start;
    assert!(
        web_running <= dep.end && dep.end < stages[2].end,
        "{dep:#?}"
    );

    stop(server).await;
}

/// OTLP/JSON carries the same spans; the service is named as
/// `OTEL_SERVICE_NAME` says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_json_and_the_service_name_come_from_the_variables() {
    let receiver = Receiver::start().await;
    let server = traced(
        &receiver,
        &[
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
            ("OTEL_SERVICE_NAME", "gates-east"),
        ],
    )
    .await;
    drive(&server.base, "j1").await;
    let spans = receiver
        .wait_for("trace of j1", |spans| arrived(spans, "j1"))
        .await;
    assert!(spans.iter().all(|s| s.service == "gates-east"));
    let names: Vec<&str> = trace_of(&spans, "j1")
        .iter()
        .map(|s| s.name.as_str())
        .filter(|n| n.starts_with("stage "))
        .collect();
    assert_eq!(names.len(), 5, "{names:?}");
    assert!(
        spans
            .iter()
            .any(|s| s.attr("taskgate.task") == "cleanup" && s.name.starts_with("PUT "))
    );
    stop(server).await;
}

/// With batches due only in an hour, spans go out at the graceful stop's
/// flush, and only there: so `always_off`'s silence after that flush is
/// the sampler's, not a flush that never came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn always_off_sends_nothing_even_at_the_flush_of_a_graceful_stop() {
    let hour = ("OTEL_BSP_SCHEDULE_DELAY", "3600000");
    let on = Receiver::start().await;
    let server = traced(&on, &[hour, ("OTEL_TRACES_SAMPLER", "always_on")]).await;
    drive(&server.base, "f1").await;
    assert_eq!(
        on.requests.load(Ordering::SeqCst),
        0,
        "nothing before the stop"
    );
    stop(server).await;
    assert!(
        arrived(&on.spans(), "f1"),
        "the stop flushed: {:#?}",
        on.spans()
    );

    let off = Receiver::start().await;
    let server = traced(&off, &[hour, ("OTEL_TRACES_SAMPLER", "always_off")]).await;
    drive(&server.base, "f2").await;
    let lines = stop(server).await;
    assert!(lines.iter().any(|l| l.contains("traces on")), "{lines:#?}");
    assert_eq!(off.requests.load(Ordering::SeqCst), 0, "{:#?}", off.spans());
}

/// The batch processor's thread, as the kernel names it (15 bytes).
const EXPORTER_THREAD: &str = "OpenTelemetry.T";

/// The names of `pid`'s threads.
fn threads(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_owned())
        .collect()
}

/// Without an endpoint, traces are off: no exporter runs and nothing says
/// traces are on, whatever other `OTEL_*` variables say; with one, it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_endpoint_no_exporter_runs() {
    let server = Server::start_env(
        &["--in-memory"],
        &[
            ("OTEL_SERVICE_NAME", "nowhere"),
            ("OTEL_TRACES_SAMPLER", "always_on"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        ],
    );
    drive(&server.base, "n1").await;
    let names = threads(server.child.id());
    assert!(!names.iter().any(|n| n == EXPORTER_THREAD), "{names:?}");
    let lines = stop(server).await;
    assert!(!lines.iter().any(|l| l.contains("traces on")), "{lines:#?}");

    let receiver = Receiver::start().await;
    let server = traced(&receiver, &[]).await;
    let names = threads(server.child.id());
    assert!(names.iter().any(|n| n == EXPORTER_THREAD), "{names:?}");
    stop(server).await;
}

/// A setting this build cannot honour stops the start, naming the
/// variable and what to use instead.
#[test]
fn an_unsupported_setting_is_refused_at_start() {
    for (var, value, says) in [
        (
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "grpc",
            "OTEL_EXPORTER_OTLP_PROTOCOL=grpc is not supported",
        ),
        (
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "http/xml",
            "use http/protobuf",
        ),
        (
            "OTEL_TRACES_SAMPLER",
            "always_of",
            "OTEL_TRACES_SAMPLER=\"always_of\" is not supported",
        ),
        ("OTEL_TRACES_SAMPLER_ARG", "2", "must be a ratio"),
        ("OTEL_TRACES_EXPORTER", "zipkin", "OTLP only"),
    ] {
        let mut command = std::process::Command::new(common::process::taskgate_bin());
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("OTEL_") {
                command.env_remove(name);
            }
        }
        let sampler = if var == "OTEL_TRACES_SAMPLER_ARG" {
            "traceidratio"
        } else {
            "always_on"
        };
        let out = command
            .args(["serve", "--in-memory", "--listen", "127.0.0.1:0"])
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
            .env("OTEL_TRACES_SAMPLER", sampler)
            .env(var, value)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{var}={value} started");
        assert!(stderr.contains(says), "{var}={value}: {stderr}");
    }
}

/// Two replicas on one etcd, the allocation driven through both in turns:
/// each of its spans reaches the collector once, from the replica whose
/// write ended it, and the trace is whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_emit_each_allocation_span_once() {
    if !common::etcd::available("replicas_emit_each_allocation_span_once") {
        return;
    }
    let receiver = Receiver::start().await;
    let cluster = tokio::task::spawn_blocking(|| common::etcd::Cluster::start(1))
        .await
        .unwrap();
    let endpoints = cluster.endpoints().join(",");
    let start = |endpoints: String, endpoint: String| {
        tokio::task::spawn_blocking(move || {
            Server::start_env(
                &[
                    "--store",
                    "etcd",
                    "--etcd-endpoints",
                    &endpoints,
                    "--etcd-prefix",
                    "/otel/",
                ],
                &[
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
                    ("OTEL_BSP_SCHEDULE_DELAY", "100"),
                ],
            )
        })
    };
    let one = start(endpoints.clone(), receiver.endpoint()).await.unwrap();
    let two = start(endpoints, receiver.endpoint()).await.unwrap();
    let (a, b) = (one.base.clone(), two.base.clone());
    let at = |i: usize| if i.is_multiple_of(2) { &a } else { &b };
    let url = |i: usize, path: &str| format!("{}/v1/allocations/e1{path}", at(i));
    send(reqwest::Method::PUT, url(0, ""), Some(common::five_tasks())).await;
    let steps = [
        ("init", "running"),
        ("proxy", "running"),
        ("init", "dead"),
        ("web", "running"),
        ("announce", "dead"),
        ("web", "dead"),
        ("proxy", "dead"),
        ("cleanup", "dead"),
    ];
    for (i, (task, state)) in steps.into_iter().enumerate() {
        // Through the other replica than the step before; each replica's
        // view reaches the change before the next step is sent there.
        let body = json!({"state": state});
        let done = send(
            reqwest::Method::PUT,
            url(i + 1, &format!("/tasks/{task}/state")),
            Some(body),
        )
        .await;
        let index = done["modify_index"].as_u64().unwrap();
        let peer = format!("{}/v1/allocations/e1?index={}&wait=10s", at(i), index - 1);
        send(reqwest::Method::GET, peer, None).await;
    }
    // Registered through one replica, deleted in prestart through the
    // other: its trace ends there, sent by the deleting replica alone.
    let e2 = |base: &str| format!("{base}/v1/allocations/e2");
    send(reqwest::Method::PUT, e2(&a), Some(common::five_tasks())).await;
    send(reqwest::Method::DELETE, e2(&b), None).await;
    receiver
        .wait_for("traces of e1 and e2", |spans| {
            !trace_of(spans, "e1").is_empty() && !trace_of(spans, "e2").is_empty()
        })
        .await;
    stop(one).await;
    stop(two).await;
    let spans = receiver.spans();
    let mut deleted: Vec<(&str, &str)> = trace_of(&spans, "e2")
        .iter()
        .map(|s| (s.name.as_str(), s.attr("taskgate.deleted")))
        .collect();
    deleted.sort_unstable();
    assert_eq!(
        deleted,
        [("allocation", "true"), ("stage prestart", "")],
        "{spans:#?}"
    );
    let trace = trace_of(&spans, "e1");
    let count = |name: &str| trace.iter().filter(|s| s.name == name).count();
    for stage in ["prestart", "main", "poststart", "wait_alloc", "poststop"] {
        assert_eq!(count(&format!("stage {stage}")), 1, "{stage}: {trace:#?}");
    }
    assert_eq!(count("allocation"), 1, "{trace:#?}");
    let mut waited: Vec<&str> = trace
        .iter()
        .filter(|s| s.name == "wait gate")
        .map(|s| s.attr("taskgate.task"))
        .collect();
    waited.sort_unstable();
    assert_eq!(waited, ["announce", "cleanup", "web"], "{trace:#?}");
    assert_eq!(trace.len(), 9, "{trace:#?}");
    let mut ids: Vec<&str> = trace.iter().map(|s| s.id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), trace.len(), "a span sent twice: {trace:#?}");
}
