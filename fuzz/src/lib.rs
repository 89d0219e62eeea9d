//! Fuzz targets, shared by the cargo-fuzz harness (`fuzz/harness/`) and
//! the regression tests that replay every input it ever found
//! (`tests/fuzz.rs` over `fuzz/regressions/`). A crate of its own, so the
//! service's library carries none of it. Each function takes arbitrary bytes and
//! panics when an invariant breaks; it must never panic otherwise.

use std::sync::Arc;

use axum::{
    body::Body,
    http::{Request, header},
};
use serde_json::Value;
use tower::Service;

use taskgate::{
    http::{HttpConfig, app, auth::Auth},
    lifecycle::{
        AllocId, AllocSpec, Allocation, Condition, CoordState, Deadlines, Dependency, Hook,
        Lifecycle, Limits, RestartMode, RunState, Step, TaskName, TaskReport, TaskSpec,
    },
    registry::{Registry, RegistryConfig},
    store::MemoryStore,
};
use taskgate_testkit::FIVE_TASKS;

/// The write routes a fuzzed body is sent to.
pub const WRITES: [(&str, &str); 6] = [
    ("PUT", "/v1/allocations/a1"),
    ("PUT", "/v1/allocations/new"),
    ("PUT", "/v1/allocations/a1/tasks/web/state"),
    ("POST", "/v1/allocations/a1/task-states"),
    ("POST", "/v1/allocations/a1/restore"),
    ("POST", "/v1/allocations/a1/restart"),
];

/// the codes the API documents for each status.
fn documented(status: u16, code: &str) -> bool {
    matches!(
        (status, code),
        (400, "invalid_json" | "invalid_request")
            | (404, "allocation_not_found" | "task_not_found" | "not_found")
            | (405, "method_not_allowed")
            | (
                409,
                "allocation_exists" | "task_not_running" | "allocation_finished"
            )
            | (413, "payload_too_large")
            | (415, "unsupported_media_type")
    )
}

/// Percent-encodes every byte that is not unreserved, so any bytes make a
/// valid URI.
pub fn encode(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|&b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// One request built from `data`, checked by [`check_request`]. The first
/// byte picks the request: a write with the rest as its JSON body, or a
/// read with the rest as a path segment and query string.
pub fn request(data: &[u8]) {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let (method, uri, body) = match pick % 9 {
        w @ 0..=5 => (
            WRITES[w as usize].0,
            WRITES[w as usize].1.to_owned(),
            rest.to_vec(),
        ),
        k => {
            let split = rest.iter().position(|&b| b == b'?').unwrap_or(rest.len());
            let (segment, query) = rest.split_at(split);
            // The query keeps its own bytes except those a URI cannot
            // hold, so parameter syntax (`&`, `=`, `%`) gets through.
            let query: String = query
                .iter()
                .map(|&b| {
                    if b.is_ascii_graphic() && b != b'#' {
                        (b as char).to_string()
                    } else {
                        format!("%{b:02X}")
                    }
                })
                .collect();
            let query = if query.contains("wait=") {
                query
            } else if query.is_empty() {
                "?wait=1ms".to_owned()
            } else {
                format!("{query}&wait=1ms")
            };
            let uri = match k {
                6 => format!("/v1/allocations/{}{query}", encode(segment)),
                7 => format!("/v1/allocations/a1/tasks/{}{query}", encode(segment)),
                _ => format!("/v1/allocations{}", query.replace("wait=", "w=")),
            };
            ("GET", uri, Vec::new())
        }
    };
    // A long wait someone asked for is legitimate; it is not what this
    // target looks for. A URI the HTTP parser would refuse never
    // reaches the router.
    if (uri.contains("wait=") && !uri.contains("wait=1ms"))
        || uri.parse::<axum::http::Uri>().is_err()
    {
        return;
    }
    check_request(method, &uri, body);
}

/// Sends one request (JSON content type) through the whole router of an
/// in-memory app in which `a1` (the five-task example) was just registered
/// afresh, and panics unless the answer keeps the contract: no 5xx; a 4xx
/// is problem+json with a code the API documents for its status and changed
/// nothing; a 2xx other than 204 has a JSON body, and a write is accepted
/// only with an object body (or, for a restart, none); the app still
/// answers its health check.
pub fn check_request(method: &str, uri: &str, body: Vec<u8>) {
    // One runtime and one app per thread (building the router renders the
    // OpenAPI document, which would dominate each run).
    thread_local! {
        static RT: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        static APP: axum::Router = {
            let registry = Registry::open(Arc::new(MemoryStore::new()), RegistryConfig::default())
                .expect("an empty store opens");
            app(registry, HttpConfig::default(), Arc::new(Auth::default()))
        };
    }
    let router = APP.with(Clone::clone);
    RT.with(|rt| rt.block_on(check_on(router, method, uri, body)));
}

async fn check_on(router: axum::Router, method: &str, uri: &str, body: Vec<u8>) {
    let send = |method: &str, uri: &str, body: Vec<u8>| {
        let req = Request::builder()
            .method(method)
            .uri(uri)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body))
            .expect("a valid request");
        let mut router = router.clone();
        async move {
            let res = router.call(req).await.expect("infallible");
            let status = res.status().as_u16();
            let ct = res
                .headers()
                .get(header::CONTENT_TYPE)
                .map(|v| v.to_str().unwrap_or_default().to_owned());
            let body = axum::body::to_bytes(res.into_body(), usize::MAX)
                .await
                .expect("a body");
            (status, ct, body)
        }
    };
    // Start from a fresh `a1` (and no `new`) whatever earlier runs did.
    for id in ["a1", "new"] {
        let (status, _, _) = send("DELETE", &format!("/v1/allocations/{id}"), Vec::new()).await;
        assert!(status == 204 || status == 404, "DELETE {id}: {status}");
    }
    let (status, _, _) = send("PUT", "/v1/allocations/a1", FIVE_TASKS.into()).await;
    assert_eq!(status, 201);
    let (_, _, before) = send("GET", "/v1/allocations/a1", Vec::new()).await;

    let (status, ct, answer) = send(method, uri, body.clone()).await;
    assert!(status < 500, "{method} {uri}: {status}");
    if status >= 400 {
        assert_eq!(
            ct.as_deref(),
            Some("application/problem+json"),
            "{method} {uri}"
        );
        let problem: Value = serde_json::from_slice(&answer).expect("a JSON problem");
        let code = problem["code"].as_str().unwrap_or_default();
        assert!(
            documented(status, code),
            "{method} {uri}: {status} {problem}"
        );
        assert_eq!(problem["status"], status);
        let (_, _, after) = send("GET", "/v1/allocations/a1", Vec::new()).await;
        assert_eq!(before, after, "{method} {uri} was refused but changed a1");
    } else {
        if status != 204 {
            assert!(
                serde_json::from_slice::<Value>(&answer).is_ok(),
                "{method} {uri}: a {status} without a JSON body"
            );
        }
        if method != "GET" && !(body.is_empty() && uri.ends_with("/restart")) {
            let accepted: Result<serde_json::Map<String, Value>, _> = serde_json::from_slice(&body);
            assert!(
                accepted.is_ok(),
                "{method} {uri} accepted a body that is not an object"
            );
        }
    }
    let (status, _, _) = send("GET", "/v1/health", Vec::new()).await;
    assert_eq!(status, 200, "unhealthy after {method} {uri}");
}

/// A random allocation (from the first byte and one byte per task: stages,
/// a leader, readiness, a TTL, a dependency on an earlier task; deadlines
/// from the first byte) driven by operations (three bytes each: reports,
/// restores, restarts, and time passing with the allocation looked at),
/// checked after every step against the invariants of docs/lifecycle.md.
pub fn lifecycle(data: &[u8]) {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let n = 1 + usize::from(first % 7);
    if rest.len() < n {
        return;
    }
    let (task_bytes, ops) = rest.split_at(n);
    let mut leader = false;
    let tasks: Vec<TaskSpec> = task_bytes
        .iter()
        .enumerate()
        .map(|(i, &b)| {
            let lifecycle = match b % 6 {
                0 | 1 => None,
                2 => Some((Hook::Prestart, false)),
                3 => Some((Hook::Prestart, true)),
                4 => Some((Hook::Poststart, b & 0x40 != 0)),
                _ => Some((Hook::Poststop, false)),
            };
            let is_leader = b & 0x80 != 0 && !leader;
            leader |= is_leader;
            let stage_takes_readiness = matches!(lifecycle, None | Some((Hook::Prestart, true)));
            TaskSpec {
                name: TaskName::parse(&format!("t{i}")).expect("a valid name"),
                lifecycle: lifecycle.map(|(hook, sidecar)| Lifecycle { hook, sidecar }),
                leader: is_leader,
                readiness: stage_takes_readiness && b & 0x20 != 0,
                liveness: (b & 0x10 != 0).then(|| std::time::Duration::from_secs(10)),
                depends_on: Vec::new(),
                acquire: Vec::new(),
                barrier: None,
            }
        })
        .collect();
    // A dependency of each task on the one before it, where the rules let
    // it be (`b & 0x08`), on a condition from the byte.
    let mut tasks = tasks;
    for i in 1..n {
        let b = task_bytes[i];
        if b & 0x08 == 0 {
            continue;
        }
        let condition = [
            Condition::Running,
            Condition::Ready,
            Condition::Succeeded,
            Condition::Dead,
        ][usize::from(b >> 6)];
        let mut with = tasks.clone();
        with[i].depends_on.push(Dependency {
            task: tasks[i - 1].name.clone(),
            allocation: None,
            condition,
        });
        if AllocSpec::new(with.clone(), &Limits::default()).is_ok() {
            tasks = with;
        }
    }
    let mut deadlines = Deadlines::default();
    for (bit, state) in Deadlines::STATES.into_iter().enumerate() {
        if first & (0x08 << bit) != 0 {
            deadlines.set(
                state,
                Some(std::time::Duration::from_secs(30 + 15 * bit as u64)),
            );
        }
    }
    let spec =
        AllocSpec::with_deadlines(tasks, deadlines, &Limits::default()).expect("a valid spec");
    let mut now = time::OffsetDateTime::UNIX_EPOCH;
    let mut index = 1u64;
    let mut a = Allocation::register(
        AllocId::parse("a").expect("an ID"),
        Arc::new(spec),
        index,
        now,
    );
    check(&a);
    for op in ops.chunks_exact(3) {
        let (kind, task, what) = (op[0], usize::from(op[1]) % n, op[2]);
        let state = match what % 3 {
            0 => RunState::Pending,
            1 => RunState::Running,
            _ => RunState::Dead,
        };
        let report = TaskReport {
            state,
            failed: state == RunState::Dead && what & 0x80 != 0,
            // `ready: true` only with running, as validation requires.
            ready: match (what >> 2) % 3 {
                0 => None,
                1 => Some(state == RunState::Running),
                _ => Some(false),
            },
            event: None,
        };
        let before = a.state;
        let next_index = || {
            index += 1;
            index
        };
        let (next, back_to, step) = match kind % 10 {
            // Time passes (up to 255 s) and the allocation is looked at:
            // no sign of life but its reports.
            8 | 9 => {
                now += std::time::Duration::from_secs(u64::from(what));
                let seen = |_| None;
                let due = a.wake_at(&seen, None).is_some_and(|at| at <= now);
                let next = a.tick(now, &seen, None, next_index);
                assert_eq!(next.is_some(), due, "a tick changes exactly what is due");
                (next, None, Step::Report)
            }
            0..=4 => (
                a.report(&[(task, report)], now, next_index),
                None,
                Step::Report,
            ),
            5 => (
                a.restore(&[(task, report)], now, next_index),
                Some(CoordState::Prestart),
                Step::Restore,
            ),
            6 => (
                a.restart(RestartMode::Task(task), "fuzz", now, next_index)
                    .ok()
                    .and_then(|(next, _)| next),
                None,
                Step::Restart(RestartMode::Task(task)),
            ),
            _ => {
                let mode = if what & 1 == 0 {
                    RestartMode::Running
                } else {
                    RestartMode::AllTasks
                };
                let back = (mode == RestartMode::AllTasks).then_some(CoordState::Init);
                (
                    a.restart(mode, "fuzz", now, next_index)
                        .ok()
                        .and_then(|(next, _)| next),
                    back,
                    Step::Restart(mode),
                )
            }
        };
        if let Some(next) = next {
            assert!(next.modify_index > a.modify_index, "an index went back");
            // Forward only, except back to where a restart or restore
            // starts over.
            let from = back_to.map_or(before, |b| b.min(before));
            assert!(
                next.state >= from,
                "{before:?} went back to {:?}",
                next.state
            );
            if let Err(broken) = a.check_step(&next, step) {
                panic!("{broken}: {a:?} → {next:?}");
            }
            a = next;
        }
        check(&a);
    }
}

fn check(a: &Allocation) {
    if let Err(broken) = a.check_invariants() {
        panic!("{broken}: {a:?}");
    }
}
