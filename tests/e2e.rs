//! End-to-end over a real socket: a server on an OS-chosen loopback port
//! and HTTP/1.1 clients. Waits are bounded by `tokio::time::timeout`, so a
//! bug fails a test instead of hanging it.

mod common;

use std::time::Duration;

use common::{five_tasks, parked, spawn_server};
use serde_json::{Value, json};

const BOUND: Duration = Duration::from_secs(20);

async fn json_of(res: reqwest::Response) -> (u16, Value) {
    let status = res.status().as_u16();
    (status, res.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_parked_before_a_change_are_answered_right_after_it() {
    let server = spawn_server().await;
    let http = common::http();
    let base = server.base.clone();
    let reg = http
        .put(format!("{base}/v1/allocations/a1"))
        .json(&five_tasks())
        .send()
        .await
        .unwrap();
    assert_eq!(reg.status(), 201);
    let index: u64 = reg.headers()["x-taskgate-index"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();

    let mut waits = Vec::new();
    for path in [
        "/tasks/web/start-condition?wait=300s".to_owned(),
        "/tasks/web/start-condition?wait=300s".to_owned(),
        "/tasks/proxy/start-condition?wait=300s".to_owned(),
        format!("/tasks/web?index={index}&wait=300s"),
        format!("?index={index}&wait=300s"),
    ] {
        let url = format!("{base}/v1/allocations/a1{path}");
        let http = http.clone();
        waits.push(tokio::spawn(async move {
            json_of(http.get(url).send().await.unwrap()).await
        }));
    }
    // proxy is allowed at once; the four others park.
    parked(&server.registry, 4).await;
    assert!(!waits[0].is_finished());

    let report = http
        .post(format!("{base}/v1/allocations/a1/task-states"))
        .json(&json!({"tasks": {"init": {"state": "dead"}, "proxy": {"state": "running"}}}))
        .send()
        .await
        .unwrap();
    assert_eq!(report.status(), 200);
    let acked: u64 = report.headers()["x-taskgate-index"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();

    let mut answers = Vec::new();
    for w in waits {
        answers.push(
            tokio::time::timeout(BOUND, w)
                .await
                .expect("answered")
                .unwrap(),
        );
    }
    for (status, body) in &answers[..2] {
        assert_eq!(*status, 200);
        assert_eq!(body["allowed"], true);
        assert_eq!(body["coordinator_state"], "main");
        assert_eq!(body["index"].as_u64().unwrap(), acked);
    }
    assert_eq!(answers[2].1["allowed"], true);
    assert_eq!(
        answers[3].1["allowed"], true,
        "web's gate opened: its task view changed"
    );
    assert_eq!(answers[4].1["modify_index"].as_u64().unwrap(), acked);
    assert_eq!(server.registry.waiters(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_allocation_ends_waits_with_410() {
    let server = spawn_server().await;
    let http = common::http();
    let base = server.base.clone();
    http.put(format!("{base}/v1/allocations/gone"))
        .json(&five_tasks())
        .send()
        .await
        .unwrap();
    let waits: Vec<_> = [
        "/tasks/web/start-condition?wait=300s",
        "?index=999&wait=300s",
    ]
    .into_iter()
    .map(|p| {
        let url = format!("{base}/v1/allocations/gone{p}");
        let http = http.clone();
        tokio::spawn(async move { json_of(http.get(url).send().await.unwrap()).await })
    })
    .collect();
    parked(&server.registry, 2).await;
    let del = http
        .delete(format!("{base}/v1/allocations/gone"))
        .send()
        .await
        .unwrap();
    assert_eq!(del.status(), 204);
    for w in waits {
        let (status, body) = tokio::time::timeout(BOUND, w)
            .await
            .expect("answered")
            .unwrap();
        assert_eq!(status, 410);
        assert_eq!(body["code"], "allocation_deleted");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_wait_is_a_200_with_allowed_false() {
    let server = spawn_server().await;
    let http = common::http();
    let base = server.base.clone();
    http.put(format!("{base}/v1/allocations/a1"))
        .json(&five_tasks())
        .send()
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let res = http
        .get(format!(
            "{base}/v1/allocations/a1/tasks/web/start-condition?wait=300ms"
        ))
        .send()
        .await
        .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300));
    let (status, body) = json_of(res).await;
    assert_eq!(status, 200);
    assert_eq!(body["allowed"], false);
    assert_eq!(body["desired"], "run");
    assert_eq!(body["waiting_on"], json!(["init", "proxy"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_answers_parked_waits_with_503_and_stops_the_server() {
    let mut server = spawn_server().await;
    let http = common::http();
    let base = server.base.clone();
    http.put(format!("{base}/v1/allocations/a1"))
        .json(&five_tasks())
        .send()
        .await
        .unwrap();
    let waits: Vec<_> = (0..3)
        .map(|_| {
            let http = http.clone();
            let url = format!("{base}/v1/allocations/a1/tasks/web/start-condition?wait=300s");
            tokio::spawn(async move { http.get(url).send().await.unwrap() })
        })
        .collect();
    parked(&server.registry, 3).await;
    server.stop.take().unwrap().send(()).unwrap();
    for w in waits {
        let res = tokio::time::timeout(BOUND, w)
            .await
            .expect("answered")
            .unwrap();
        assert_eq!(res.status(), 503);
        assert_eq!(res.headers()["retry-after"], "1");
        let body: Value = res.json().await.unwrap();
        assert_eq!(body["code"], "shutting_down");
    }
    let stopped = tokio::time::timeout(BOUND, server.task)
        .await
        .expect("server stopped");
    assert!(stopped.unwrap().is_ok());
}

/// A store whose load waits until the test lets it go.
struct GatedStore {
    inner: taskgate::store::MemoryStore,
    gate: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
}

impl taskgate::store::Store for GatedStore {
    fn load(&self) -> Result<taskgate::store::Loaded, taskgate::store::StoreError> {
        let _ = self.gate.lock().unwrap().recv();
        self.inner.load()
    }

    fn follow(&self, from: u64, follower: std::sync::Weak<dyn taskgate::store::Follower>) {
        self.inner.follow(from, follower)
    }

    fn append(&self, append: taskgate::store::Append) -> taskgate::store::Appended {
        self.inner.append(append)
    }

    fn id(&self) -> &str {
        self.inner.id()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_503_starting_until_the_store_is_loaded() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (release, gate) = std::sync::mpsc::channel();
    let store = std::sync::Arc::new(GatedStore {
        inner: taskgate::store::MemoryStore::new(),
        gate: std::sync::Mutex::new(gate),
    });
    let building = tokio::spawn(taskgate::app::Application::build_on(
        listener,
        taskgate::config::ServeConfig::for_tests(),
        std::sync::Arc::new(taskgate::http::auth::Auth::default()),
        move |_| Ok(store as std::sync::Arc<dyn taskgate::store::Store>),
    ));
    let http = common::http();
    let res = tokio::time::timeout(BOUND, http.get(format!("{base}/v1/health")).send())
        .await
        .expect("answered while loading")
        .unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(res.headers()["retry-after"], "1");
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["code"], "starting");
    assert!(!building.is_finished());

    release.send(()).unwrap();
    let app = tokio::time::timeout(BOUND, building)
        .await
        .expect("built")
        .unwrap()
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(app.run_until_stopped(async move {
        let _ = stopped.await;
    }));
    let res = http.get(format!("{base}/v1/health")).send().await.unwrap();
    assert_eq!(res.status(), 200);
    stop.send(()).unwrap();
    serving.await.unwrap().unwrap();
}

#[tokio::test]
async fn an_open_server_on_a_non_loopback_address_refuses_to_start() {
    let mut config = taskgate::config::ServeConfig::for_tests();
    config.listen = "0.0.0.0:0".parse().unwrap();
    let err = taskgate::app::Application::build(config.clone())
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("--insecure-no-auth") && err.contains("--token-file"),
        "{err}"
    );
    // Configuring a token is what the refusal asks for; on loopback (the
    // only address a test may bind) such a server starts.
    let mut config = taskgate::config::ServeConfig::for_tests();
    config.operator_token = Some(taskgate::config::Secret("s3cret".into()));
    assert!(
        !format!("{config:?}").contains("s3cret"),
        "secrets never show in Debug"
    );
    assert!(taskgate::app::Application::build(config).await.is_ok());
}

/// A task the server cannot go on without, ended (here: its supervisor told
/// so, as the disk writer's panic does): parked waits are answered 503
/// `shutting_down`, and the server stops with an error (taskgate exits
/// non-zero, for whatever restarts it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vital_task_that_ends_stops_the_server_with_an_error() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (tell, told) = std::sync::mpsc::channel();
    let app = taskgate::app::Application::build_on(
        listener,
        taskgate::config::ServeConfig::for_tests(),
        std::sync::Arc::new(taskgate::http::auth::Auth::default()),
        move |opening: taskgate::app::Opening| {
            tell.send(opening.supervisor.clone()).unwrap();
            Ok(std::sync::Arc::new(taskgate::store::MemoryStore::new())
                as std::sync::Arc<dyn taskgate::store::Store>)
        },
    )
    .await
    .unwrap();
    let supervisor = told.recv().unwrap();
    let registry = app.registry().clone();
    let serving = tokio::spawn(app.run_until_stopped(std::future::pending()));
    let http = common::http();
    let created = http
        .put(format!("{base}/v1/allocations/a1"))
        .json(&five_tasks())
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    let wait = {
        let http = http.clone();
        let url = format!("{base}/v1/allocations/a1/tasks/web/start-condition?wait=60s");
        tokio::spawn(async move { http.get(url).send().await.unwrap() })
    };
    parked(&registry, 1).await;
    supervisor.stop("the task `store_writer` panicked".into());
    let answered = tokio::time::timeout(BOUND, wait)
        .await
        .expect("answered")
        .unwrap();
    assert_eq!(answered.status(), 503);
    let body: Value = answered.json().await.unwrap();
    assert_eq!(body["code"], "shutting_down");
    let stopped = tokio::time::timeout(BOUND, serving)
        .await
        .expect("the server stopped")
        .unwrap();
    let err = stopped.expect_err("stopped with an error").to_string();
    assert!(err.contains("store_writer"), "{err}");
}
