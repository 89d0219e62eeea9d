//! Faults an outside audit of the third edition found (dependencies,
//! liveness, deadlines, the timer heap, idempotency keys): each test
//! asserts the promise as documented, and each failed on the code audited
//! before its fix.

mod common;

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use taskgate::{
    lifecycle::{
        AllocId, AllocSpec, Allocation, Condition, CoordState, Deadlines, Dependency, Limits,
        RunState, TaskName, TaskReport, TaskSpec, Why,
    },
    registry::{Clock, Registry, RegistryConfig, RegistryError},
    store::{Append, Appended, Follower, Loaded, MemoryStore, Op, Store, StoreError},
};

// ---------------------------------------------------------------- helpers

fn id(s: &str) -> AllocId {
    AllocId::parse(s).unwrap()
}

fn name(s: &str) -> TaskName {
    TaskName::parse(s).unwrap()
}

fn dep(alloc: &str, task: &str, condition: Condition) -> Dependency {
    Dependency {
        task: name(task),
        allocation: Some(id(alloc)),
        condition,
    }
}

fn task(n: &str, deps: Vec<Dependency>) -> TaskSpec {
    TaskSpec {
        depends_on: deps,
        ..TaskSpec::named(name(n))
    }
}

fn spec(tasks: Vec<TaskSpec>) -> AllocSpec {
    AllocSpec::new(tasks, &Limits::default()).unwrap()
}

fn report(t: &str, state: RunState) -> Vec<(TaskName, TaskReport)> {
    vec![(
        name(t),
        TaskReport {
            state,
            failed: false,
            ready: None,
            event: None,
        },
    )]
}

async fn settle() {
    for _ in 0..2_000 {
        tokio::task::yield_now().await;
    }
}

/// A memory store whose appends of one allocation's records wait for a
/// permit while a gate is set: the window a slow disk (fsync) or a slow
/// etcd opens between a registry decision and its publication.
struct Gated {
    inner: Arc<MemoryStore>,
    gate: Mutex<Option<(String, Arc<tokio::sync::Semaphore>)>>,
    held: AtomicUsize,
}

impl Gated {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            inner: Arc::new(MemoryStore::new()),
            gate: Mutex::new(None),
            held: AtomicUsize::new(0),
        })
    }

    /// From now on, every commit of a record of `alloc` waits for a permit.
    fn close(&self, alloc: &str) -> Arc<tokio::sync::Semaphore> {
        let sem = Arc::new(tokio::sync::Semaphore::new(0));
        *self.gate.lock().unwrap() = Some((alloc.to_owned(), sem.clone()));
        sem
    }

    fn open(&self) {
        if let Some((_, sem)) = self.gate.lock().unwrap().take() {
            sem.add_permits(1_000);
        }
    }

    async fn until_held(&self, n: usize) {
        for _ in 0..100_000 {
            if self.held.load(Ordering::SeqCst) >= n {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("no commit reached the gate");
    }
}

impl Store for Gated {
    fn load(&self) -> Result<Loaded, StoreError> {
        self.inner.load()
    }

    fn id(&self) -> &str {
        self.inner.id()
    }

    fn follow(&self, from: u64, follower: std::sync::Weak<dyn Follower>) {
        self.inner.follow(from, follower)
    }

    /// A gated record is appended once a permit comes: its index comes
    /// with the commit, as etcd's does.
    fn append(&self, append: Append) -> Appended {
        let (record, wait) = match &append.op {
            Op::Put(a) => match &*self.gate.lock().unwrap() {
                Some((alloc, sem)) if a.id.as_str() == alloc => (a.clone(), sem.clone()),
                _ => return self.inner.append(append),
            },
            Op::Delete(_) => return self.inner.append(append),
        };
        self.held.fetch_add(1, Ordering::SeqCst);
        let inner = self.inner.clone();
        Appended {
            record: Some(record),
            stamped: false,
            done: Box::pin(async move {
                wait.acquire().await.expect("never closed").forget();
                inner.append(append).done.await
            }),
        }
    }
}

fn why(a: &Allocation, i: usize) -> Vec<Option<Why>> {
    a.tasks[i].deps().iter().map(|d| d.why()).collect()
}

// ------------------------------------------------- F1: stale verdict at registration

/// lifecycle.md: "Dependencies are level-triggered like gates: judged on
/// every change of the states they name, here or in the other allocation".
///
/// A dependent's verdicts are judged before its registration commits, but
/// it enters the reverse index only after: a change of the target that
/// lands in between is judged for nobody, and the dependent keeps the
/// verdict from before it for good (until the target changes again, which
/// for `succeeded`/`dead` targets is never).
#[tokio::test]
async fn f1_a_target_change_during_a_dependents_registration_is_seen() {
    let store = Gated::new();
    let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
    r.register(id("data"), spec(vec![task("db", vec![])]))
        .await
        .unwrap();
    let gate = store.close("app");
    let registering = {
        let r = r.clone();
        tokio::spawn(async move {
            r.register(
                id("app"),
                spec(vec![task(
                    "web",
                    vec![dep("data", "db", Condition::Running)],
                )]),
            )
            .await
        })
    };
    // app's verdicts are decided ("pending"); its commit is on its way.
    store.until_held(1).await;
    r.report("data", report("db", RunState::Running))
        .await
        .unwrap();
    drop(gate);
    store.open();
    registering.await.unwrap().unwrap();
    settle().await;
    let data = r.get("data").unwrap();
    let app = r.get("app").unwrap();
    assert_eq!(data.tasks[0].state, RunState::Running);
    assert!(
        app.allowed(0),
        "data/db is running, yet app/web is blocked by {:?} (stale verdict, never judged again)",
        why(&app, 0)
    );
}

/// The same window with a deletion: the dependent is judged "holds"
/// (target running), the target is deleted before the dependent's commit
/// ends, and the dependent stays allowed on a target that does not exist
/// (lifecycle.md: "deleting it makes it so again", i.e. not_registered).
#[tokio::test]
async fn f1b_a_target_deleted_during_a_dependents_registration_blocks_it() {
    let store = Gated::new();
    let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
    r.register(id("data"), spec(vec![task("db", vec![])]))
        .await
        .unwrap();
    r.report("data", report("db", RunState::Running))
        .await
        .unwrap();
    let _gate = store.close("app");
    let registering = {
        let r = r.clone();
        tokio::spawn(async move {
            r.register(
                id("app"),
                spec(vec![task(
                    "web",
                    vec![dep("data", "db", Condition::Running)],
                )]),
            )
            .await
        })
    };
    store.until_held(1).await;
    r.delete("data").await.unwrap();
    store.open();
    registering.await.unwrap().unwrap();
    settle().await;
    assert!(r.get("data").is_err(), "data is deleted");
    let app = r.get("app").unwrap();
    assert!(
        !app.allowed(0),
        "data is deleted, yet app/web is allowed (verdicts {:?})",
        why(&app, 0)
    );
}

// ------------------------------- F2: a flip-back during a dependent's write

/// lifecycle.md: "A task is allowed only while its stage's gate is open
/// and every dependency holds".
///
/// `resolve` compares the dependent's *published* verdicts with the
/// target's new state without its lock. While a first re-judgment (target
/// running: holds) is being committed, the target goes back to pending;
/// the second re-judgment compares "pending" with the still-published
/// "pending", finds no change and returns. The first write then lands:
/// the dependent is allowed while its target is pending, for good.
#[tokio::test]
async fn f2_a_target_that_flips_back_while_its_dependent_is_written_blocks_it_again() {
    let store = Gated::new();
    let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
    r.register(id("data"), spec(vec![task("db", vec![])]))
        .await
        .unwrap();
    r.register(
        id("app"),
        spec(vec![task(
            "web",
            vec![dep("data", "db", Condition::Running)],
        )]),
    )
    .await
    .unwrap();
    settle().await;
    assert_eq!(why(&r.get("app").unwrap(), 0), [Some(Why::Pending)]);
    let _gate = store.close("app");
    // db runs: app's new verdict (holds) is decided and being committed.
    let first = {
        let r = r.clone();
        tokio::spawn(async move { r.report("data", report("db", RunState::Running)).await })
    };
    store.until_held(1).await;
    // db goes back to pending (its agent restarts it, or an operator's
    // all-tasks restart makes it stale: the same verdict, "pending"). Its
    // report is answered once app is judged again, which waits for the
    // write held at the gate: it runs beside the test.
    let second = {
        let r = r.clone();
        tokio::spawn(async move { r.report("data", report("db", RunState::Pending)).await })
    };
    for _ in 0..100_000 {
        if r.get("data").unwrap().tasks[0].state == RunState::Pending {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(r.get("data").unwrap().tasks[0].state, RunState::Pending);
    store.open();
    first.await.unwrap().unwrap();
    second.await.unwrap().unwrap();
    settle().await;
    let data = r.get("data").unwrap();
    let app = r.get("app").unwrap();
    assert_eq!(data.tasks[0].state, RunState::Pending);
    assert!(
        !app.allowed(0),
        "data/db is pending, yet app/web is allowed (verdicts {:?})",
        why(&app, 0)
    );
}

// ------------------------------------ F3: a cycle forms on one server

/// lifecycle.md: "a cycle ... through allocations the server holds 409
/// dependency_cycle"; "A cycle that forms anyway (registrations racing on
/// two replicas)". On one server, two registrations racing (the first's
/// commit not yet done) both pass the check: the cycle forms without a
/// 409 on a single server.
#[tokio::test]
async fn f3_two_racing_registrations_on_one_server_cannot_close_a_cycle() {
    let store = Gated::new();
    let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
    let _gate = store.close("a");
    let first = {
        let r = r.clone();
        tokio::spawn(async move {
            r.register(
                id("a"),
                spec(vec![task("web", vec![dep("b", "db", Condition::Running)])]),
            )
            .await
        })
    };
    store.until_held(1).await;
    // b's registration waits for a's to end (both depend on another
    // allocation): then it sees a, and the cycle it would close.
    let second = {
        let r = r.clone();
        tokio::spawn(async move {
            r.register(
                id("b"),
                spec(vec![task("db", vec![dep("a", "web", Condition::Running)])]),
            )
            .await
        })
    };
    settle().await;
    store.open();
    first.await.unwrap().unwrap();
    let second = second.await.unwrap();
    settle().await;
    assert!(
        matches!(second, Err(RegistryError::DependencyCycle { .. })),
        "b closes a/web -> b/db -> a/web on one server, yet it was taken: {:?}; \
         shown afterwards: a {:?}, b {:?}",
        second.map(|(a, _)| a.id.to_string()),
        why(&r.get("a").unwrap(), 0),
        why(&r.get("b").unwrap(), 0)
    );
}

// ------------------------ F4, F5: a cycle hidden behind a large graph

/// lifecycle.md: a cycle "through allocations the server holds" is 409;
/// "never a silent hang". A search for one used to give up after 10,000
/// tasks and say "no cycle" (the cycle was taken and shown as `pending`),
/// and cost seconds of CPU per registration. Now a registration whose
/// dependencies reach more than `MAX_REACH` tasks is refused outright, so
/// no cycle hides behind a graph too large to search, and every search is
/// bounded by it.
#[tokio::test]
async fn f4_a_registration_that_reaches_too_far_is_refused_not_taken_blindly() {
    use taskgate::registry::MAX_REACH;
    let r = Registry::open(Arc::new(MemoryStore::new()), RegistryConfig::default()).unwrap();
    const WIDE: usize = 200;
    // Layers of 200 chains: l(k) depends task by task on l(k+1).
    let mut refused = None;
    for k in (1..50).rev() {
        let tasks = (0..WIDE)
            .map(|j| {
                let deps = if k + 1 < 50 {
                    vec![dep(
                        &format!("l{}", k + 1),
                        &format!("t{j}"),
                        Condition::Running,
                    )]
                } else {
                    vec![]
                };
                task(&format!("t{j}"), deps)
            })
            .collect();
        match r.register(id(&format!("l{k}")), spec(tasks)).await {
            Ok(_) => {}
            Err(e) => {
                refused = Some((k, e));
                break;
            }
        }
    }
    let (k, e) = refused.expect("a layer reaching past the limit is refused");
    let RegistryError::Invalid(errors) = e else {
        panic!("refused with {e:?}");
    };
    assert!(
        errors[0]
            .message
            .contains(&format!("more than {MAX_REACH} tasks")),
        "{errors:?}"
    );
    assert!((50 - k) * WIDE > MAX_REACH, "refused only past the limit");
    assert!(r.get(&format!("l{k}")).is_err(), "nothing registered");
}

// ------------------------------------------- F6: the timer heap grows

fn paused_config() -> RegistryConfig {
    RegistryConfig {
        clock: Clock::tokio(),
        ..RegistryConfig::default()
    }
}

/// operations.md: "All timers live in one heap inside the server (one
/// entry per allocation that has a TTL or a deadline, none for the
/// others)". A deleted allocation's entry stayed (with the handle's memory
/// block, through its Weak) until its moment, up to 7 days: 5,000 of them
/// for no allocation. Now the heap is swept of what no allocation waits
/// for as it doubles: its size stays within a constant floor here.
#[tokio::test(start_paused = true)]
async fn f6a_deleted_allocations_leave_the_timer_heap() {
    let r = Registry::open(Arc::new(MemoryStore::new()), paused_config()).unwrap();
    let mut d = Deadlines::default();
    d.set(CoordState::Main, Some(Duration::from_secs(7 * 24 * 3600)));
    let timed =
        AllocSpec::with_deadlines(vec![task("web", vec![])], d, &Limits::default()).unwrap();
    for _ in 0..5_000 {
        r.register(id("churn"), timed.clone()).await.unwrap();
        r.delete("churn").await.unwrap();
    }
    assert_eq!(r.len(), 0);
    assert!(
        r.timer_entries() <= 1_024,
        "{} heap entries for {} allocations",
        r.timer_entries(),
        r.len()
    );
}

/// The same for one live allocation: a crash-looping task under a short
/// TTL next to a long deadline pushes one more far entry each time it
/// stops running (an entry is never moved, only pushed earlier).
#[tokio::test(start_paused = true)]
async fn f6b_a_crash_looping_task_does_not_grow_the_heap() {
    let r = Registry::open(Arc::new(MemoryStore::new()), paused_config()).unwrap();
    let mut d = Deadlines::default();
    d.set(CoordState::Main, Some(Duration::from_secs(7 * 24 * 3600)));
    let short = TaskSpec {
        liveness: Some(Duration::from_secs(1)),
        ..task("flaky", vec![])
    };
    let s =
        AllocSpec::with_deadlines(vec![short, task("web", vec![])], d, &Limits::default()).unwrap();
    r.register(id("a"), s).await.unwrap();
    for _ in 0..3_000 {
        r.report("a", report("flaky", RunState::Running))
            .await
            .unwrap();
        r.report("a", report("flaky", RunState::Pending))
            .await
            .unwrap();
        tokio::time::advance(Duration::from_millis(1_100)).await;
        settle().await;
    }
    let a = r.get("a").unwrap();
    assert_eq!(a.state, CoordState::Main, "main's 7-day deadline runs");
    assert!(
        r.timer_entries() <= 1_024,
        "{} heap entries for one allocation",
        r.timer_entries()
    );
}

// ------------------- F7: a read-only token keeps a dead agent's task alive

mod reader {
    use super::common::{Answer, TestApp, test_app_auth};
    use axum::{
        body::Body,
        http::{Request, header},
    };
    use serde_json::{Value, json};
    use std::{sync::Arc, time::Duration};
    use taskgate::{http::HttpConfig, http::auth::Auth, registry::RegistryConfig};

    fn hex_sha256(secret: &str) -> String {
        use sha2::Digest;
        sha2::Sha256::digest(secret.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    async fn call(
        app: &TestApp,
        token: &str,
        method: &str,
        uri: &str,
        body: Option<Value>,
    ) -> Answer {
        let mut req = Request::builder()
            .method(method)
            .uri(uri)
            .header(header::AUTHORIZATION, format!("Bearer {token}"));
        let body = match body {
            Some(v) => {
                req = req.header(header::CONTENT_TYPE, "application/json");
                Body::from(v.to_string())
            }
            None => Body::empty(),
        };
        app.send(req.body(body).unwrap()).await
    }

    /// lifecycle.md, Liveness: "While such a task is running, its agent
    /// gives a sign of life at least once per TTL"; SEMANTICS: "its task
    /// must not stay running forever". A task query counted as a sign of
    /// life whoever asked: a `reader` token (which may not report nor
    /// heartbeat) long-polling a task kept it `running` after its agent
    /// died. Now only a caller that may act for the task keeps it alive.
    #[tokio::test(start_paused = true)]
    async fn f7_a_reader_token_watching_a_task_does_not_keep_its_dead_agent_alive() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tokens.json");
        let tokens = json!({"tokens": [
            {"name": "reader", "role": "reader", "sha256": hex_sha256("reader-secret")},
            {"name": "agent", "role": "agent", "sha256": hex_sha256("agent-secret")},
        ]});
        std::fs::write(&file, tokens.to_string()).unwrap();
        let auth = Auth::load(Some(&file), Some("op")).unwrap();
        let config = RegistryConfig {
            clock: taskgate::registry::Clock::tokio(),
            ..RegistryConfig::default()
        };
        let app = Arc::new(test_app_auth(config, HttpConfig::default(), auth).await);
        let spec = json!({"tasks": [{"name": "web", "liveness": {"ttl": "1s"}}]});
        for alloc in ["watched", "agent-watched"] {
            let a = call(
                &app,
                "op",
                "PUT",
                &format!("/v1/allocations/{alloc}"),
                Some(spec.clone()),
            )
            .await;
            assert_eq!(a.status, 201, "{}", a.body);
            let a = call(
                &app,
                "op",
                "PUT",
                &format!("/v1/allocations/{alloc}/tasks/web/state"),
                Some(json!({"state": "running"})),
            )
            .await;
            assert_eq!(a.status, 200, "{}", a.body);
        }
        // The agents die here. A reader watches one task, an agent token the
        // other.
        let hb = call(
            &app,
            "reader-secret",
            "PUT",
            "/v1/allocations/watched/tasks/web/heartbeat",
            None,
        )
        .await;
        assert_eq!(hb.status, 403);
        let watch = |token: &'static str, alloc: &'static str| {
            let app = app.clone();
            tokio::spawn(async move {
                loop {
                    let uri = format!("/v1/allocations/{alloc}/tasks/web?index=999999&wait=2s");
                    let a = call(&app, token, "GET", &uri, None).await;
                    if a.status != 200 {
                        return;
                    }
                }
            })
        };
        let reader = watch("reader-secret", "watched");
        let agent = watch("agent-secret", "agent-watched");
        for _ in 0..50 {
            tokio::time::advance(Duration::from_millis(100)).await;
            for _ in 0..64 {
                tokio::task::yield_now().await;
            }
        }
        let watched = call(&app, "op", "GET", "/v1/allocations/watched/tasks/web", None).await;
        let by_agent = call(
            &app,
            "op",
            "GET",
            "/v1/allocations/agent-watched/tasks/web",
            None,
        )
        .await;
        reader.abort();
        agent.abort();
        assert_eq!(
            watched.body["lost"], true,
            "5 TTLs with only a reader watching: lost: {}",
            watched.body
        );
        assert_eq!(
            by_agent.body["lost"], false,
            "its agent's token long-polling keeps it alive: {}",
            by_agent.body
        );
    }
}

// ------------- F8: `ready` on a registered target that declares no readiness

/// SEMANTICS, Dependencies: "`ready` (running and ready; the target must
/// declare `readiness` where that can be checked at registration)". The
/// target allocation is held by the server, so it can be checked; the
/// registration is taken and the task waits `not_ready` forever.
#[tokio::test]
async fn f8_ready_on_a_held_target_without_readiness_is_refused() {
    let r = Registry::open(Arc::new(MemoryStore::new()), RegistryConfig::default()).unwrap();
    r.register(id("db-7"), spec(vec![task("db", vec![])]))
        .await
        .unwrap();
    let app = r
        .register(
            id("app"),
            spec(vec![task("web", vec![dep("db-7", "db", Condition::Ready)])]),
        )
        .await;
    r.report("db-7", report("db", RunState::Running))
        .await
        .unwrap();
    settle().await;
    let shown = r.get("app").ok().map(|a| why(&a, 0));
    let Err(RegistryError::Invalid(errors)) = app else {
        panic!("taken; app/web waits on db-7/db ready forever: {shown:?}");
    };
    assert_eq!(errors[0].field, "tasks[0].depends_on[0]");
    assert!(
        errors[0].message.contains("declares no readiness"),
        "{errors:?}"
    );
}

// -------------------- F9: one Idempotency-Key on two tasks is applied twice

/// lifecycle.md: "The same key with another request is 422
/// idempotency_key_reused". The request hash of a single report leaves
/// out the task (and the allocation), and keys are kept per task: the same
/// key and body sent to another task is applied as new.
#[tokio::test]
async fn f9_a_key_reused_on_another_task_is_422() {
    let app = common::test_app().await;
    let spec = serde_json::json!({"tasks": [{"name": "a"}, {"name": "b"}]});
    let put = app.call("PUT", "/v1/allocations/k", Some(spec)).await;
    assert_eq!(put.status, 201);
    let mut statuses = Vec::new();
    for t in ["a", "b"] {
        let req = axum::http::Request::builder()
            .method("PUT")
            .uri(format!("/v1/allocations/k/tasks/{t}/state"))
            .header("content-type", "application/json")
            .header("idempotency-key", "same-key")
            .body(axum::body::Body::from(r#"{"state": "running"}"#))
            .unwrap();
        statuses.push(app.send(req).await.status.as_u16());
    }
    assert_eq!(statuses, [200, 422], "the second request reused the key");
}

// ------------- F10: a stored start time near the end of time panics the load

/// A store that loads what the test gives it.
struct Preloaded(Mutex<Option<Loaded>>);

impl Store for Preloaded {
    fn load(&self) -> Result<Loaded, StoreError> {
        Ok(self.0.lock().unwrap().take().unwrap_or_default())
    }
    fn id(&self) -> &str {
        "0123456789abcdef0123456789abcdef"
    }
    fn follow(&self, _: u64, _: std::sync::Weak<dyn Follower>) {}
    fn append(&self, _: Append) -> Appended {
        unreachable!("nothing is written")
    }
}

/// record.rs reads any `started_at` the time crate can hold (to the year
/// 9999); `Allocation::ttl_ends` added the TTL with `+`, which panics past
/// the end of time: a damaged or hostile record (a running task under a
/// TTL, started at 9999-12-31T23:59:59) killed the server at load.
#[test]
fn f10_a_record_started_at_the_end_of_time_does_not_panic_the_load() {
    use taskgate::lifecycle::{Desired, TaskStatus};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let t = TaskSpec {
        liveness: Some(Duration::from_secs(30)),
        ..task("web", vec![])
    };
    let s = Arc::new(spec(vec![t]));
    let end = time::macros::datetime!(9999-12-31 23:59:59 UTC);
    let status = TaskStatus {
        state: RunState::Running,
        started_at: Some(end),
        ..TaskStatus::new(1)
    };
    let now = time::OffsetDateTime::now_utc();
    let a = Allocation::from_parts(
        id("a"),
        s,
        CoordState::WaitAlloc,
        vec![status],
        Some(Desired::Run),
        1,
        1,
        now,
        now,
    );
    let store = Arc::new(Preloaded(Mutex::new(Some(Loaded {
        allocations: vec![a],
        last_index: 1,
        ..Default::default()
    }))));
    let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rt.block_on(async { Registry::open(store, RegistryConfig::default()).map(|_| ()) })
    }));
    assert!(
        opened.is_ok(),
        "a record the decoder takes panicked the load: a time past the end of time is \
         saturated, never added with a panic"
    );
}

// ---- F11: a second stage deadline replaces the failed tasks of the first

/// lifecycle.md, Deadlines: the stop order "Deadline Exceeded" is sticky
/// ("never replacing an earlier order") and "its outcome will be failed
/// with failed_tasks the tasks the stage waited on at that moment". After
/// prestart's deadline (side never ready) the order names prestart, but
/// once main's deadline passes too, `failed_tasks` lists main's tasks
/// only: the sidecar that failed prestart is gone from the outcome.
#[test]
fn f11_a_second_deadline_keeps_the_first_one_s_failed_tasks() {
    use taskgate::lifecycle::{Hook, Lifecycle};
    let t0 = time::macros::datetime!(2026-11-25 10:00 UTC);
    let at = |s: u64| t0 + Duration::from_secs(s);
    let side = TaskSpec {
        lifecycle: Some(Lifecycle {
            hook: Hook::Prestart,
            sidecar: true,
        }),
        readiness: true,
        ..task("side", vec![])
    };
    let mut d = Deadlines::default();
    d.set(CoordState::Prestart, Some(Duration::from_secs(10)));
    d.set(CoordState::Main, Some(Duration::from_secs(10)));
    let s =
        AllocSpec::with_deadlines(vec![side, task("web", vec![])], d, &Limits::default()).unwrap();
    let a = Allocation::register(id("a"), Arc::new(s), 1, t0);
    let r = |state, ready| TaskReport {
        state,
        failed: false,
        ready,
        event: None,
    };
    let a = a
        .report(&[(0, r(RunState::Running, None))], at(1), || 2)
        .unwrap();
    // Prestart's deadline: side was never ready.
    let a = a.tick(at(10), &|_| None, None, || 3).unwrap();
    assert_eq!(
        a.order().reason().unwrap().stage,
        Some(CoordState::Prestart)
    );
    // It becomes ready just after: main opens (web is told to stop, and
    // its agent is slow to say so), main's deadline passes too.
    let a = a
        .report(&[(0, r(RunState::Running, Some(true)))], at(11), || 4)
        .unwrap();
    assert_eq!(a.state, CoordState::Main);
    let a = a.tick(at(21), &|_| None, None, || 5).unwrap();
    // Everything dies; the allocation ends.
    let a = a
        .report(
            &[(0, r(RunState::Dead, None)), (1, r(RunState::Dead, None))],
            at(22),
            || 6,
        )
        .unwrap();
    let (_, failed) = a.outcome().unwrap();
    let failed: Vec<_> = failed.iter().map(|t| t.to_string()).collect();
    assert_eq!(
        a.order().reason().unwrap().stage,
        Some(CoordState::Prestart),
        "the order names prestart"
    );
    assert!(
        failed.contains(&"side".to_owned()),
        "prestart failed on side, yet failed_tasks = {failed:?}"
    );
}
