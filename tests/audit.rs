//! Through the public API only: what a client sees of the write path's
//! failures.

use std::sync::Arc;

use axum::body::Body;
use http_body_util::BodyExt;
use taskgate::{
    http::{HttpConfig, auth::Auth},
    lifecycle::{AllocId, AllocSpec, Limits, TaskName, TaskSpec},
    registry::{Registry, RegistryConfig},
    store::{DiskStore, DiskStoreConfig, Store},
};
use tower::ServiceExt;

/// A report that reaches the server after its disk store was closed (the
/// shutdown grace over, `App::run_until_stopped` closes the store while
/// requests may still run; or the store's writer died) must be answered
/// 503 `shutting_down` (`StoreError::Closed`), as the `Store` contract
/// says ("Later appends fail with `Closed`"). The write path panics on the
/// closed store's answer (`record: None`); the client gets a 500.
#[tokio::test]
async fn a_report_after_the_store_closed_is_answered_503_shutting_down() {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> =
        Arc::new(DiskStore::open(DiskStoreConfig::new(dir.path().to_owned())).unwrap());
    let registry = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
    let spec = AllocSpec::new(
        vec![TaskSpec::named(TaskName::parse("web").unwrap())],
        &Limits::default(),
    )
    .unwrap();
    registry
        .register(AllocId::parse("a").unwrap(), spec)
        .await
        .unwrap();
    store.close().unwrap();

    let router = taskgate::http::app(registry, HttpConfig::default(), Arc::new(Auth::default()));
    let response = router
        .oneshot(
            axum::http::Request::put("/v1/allocations/a/tasks/web/state")
                .header("content-type", "application/json")
                .body(Body::from(r#"{"state":"running"}"#))
                .unwrap(),
        )
        .await
        .unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let body = String::from_utf8_lossy(&body);
    assert!(
        status == 503 && body.contains("shutting_down"),
        "{status}: {body}"
    );
}
