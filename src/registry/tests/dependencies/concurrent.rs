//! Dependencies judged while writes race: a target's change that lands
//! while a dependent's record is being committed still reaches the
//! dependent, and two registrations racing cannot close a cycle.

use std::sync::{Mutex, atomic::AtomicUsize};

use super::*;

/// A memory store whose appends of one allocation's records wait for a
/// permit once the gate is closed: the window a slow disk (fsync) or a slow
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
    fn close(&self, alloc: &str) {
        let sem = Arc::new(tokio::sync::Semaphore::new(0));
        *self.gate.lock().unwrap() = Some((alloc.to_owned(), sem));
    }

    fn open(&self) {
        if let Some((_, sem)) = self.gate.lock().unwrap().take() {
            sem.add_permits(1_000);
        }
    }

    /// Waits (bounded) until `n` commits wait at the gate.
    async fn until_held(&self, n: usize) {
        for _ in 0..10_000 {
            if self.held.load(Ordering::SeqCst) >= n {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("no commit reached the gate");
    }
}

impl Store for Gated {
    fn load(&self) -> Result<crate::store::Loaded, StoreError> {
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
            _ => return self.inner.append(append),
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

/// The verdict on the first dependency of the first task.
fn why(a: &Allocation) -> Option<Why> {
    a.tasks[0].deps()[0].why()
}

/// A change of the target that lands while a dependent's registration is
/// being committed reaches the dependent: it is allowed once the target
/// runs.
#[tokio::test]
async fn a_target_change_during_a_dependent_s_registration_reaches_it() {
    let store = Gated::new();
    let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
    r.register(id("data"), spec(&[("db", None)])).await.unwrap();
    store.close("app");
    let registering = {
        let r = r.clone();
        tokio::spawn(async move { r.register(id("app"), depends("web", "data", "db")).await })
    };
    // app's verdict is decided (pending); its commit waits at the gate.
    store.until_held(1).await;
    r.report("data", report("db", RunState::Running))
        .await
        .unwrap();
    store.open();
    registering.await.unwrap().unwrap();
    until(&r, "app", |a| a.allowed(0)).await;
}

/// A target deleted while a dependent's registration is being committed
/// blocks the dependent: its verdict becomes not registered.
#[tokio::test]
async fn a_target_deleted_during_a_dependent_s_registration_blocks_it() {
    let store = Gated::new();
    let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
    r.register(id("data"), spec(&[("db", None)])).await.unwrap();
    r.report("data", report("db", RunState::Running))
        .await
        .unwrap();
    store.close("app");
    let registering = {
        let r = r.clone();
        tokio::spawn(async move { r.register(id("app"), depends("web", "data", "db")).await })
    };
    // app's verdict is decided (holds); its commit waits at the gate.
    store.until_held(1).await;
    r.delete("data").await.unwrap();
    store.open();
    registering.await.unwrap().unwrap();
    let app = until(&r, "app", |a| why(a) == Some(Why::NotRegistered)).await;
    assert!(!app.allowed(0));
}

/// A target that goes back to pending while its dependent's new verdict
/// (holds) is being committed blocks the dependent again.
#[tokio::test]
async fn a_target_that_flips_back_while_its_dependent_is_written_blocks_it_again() {
    let store = Gated::new();
    let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
    r.register(id("data"), spec(&[("db", None)])).await.unwrap();
    r.register(id("app"), depends("web", "data", "db"))
        .await
        .unwrap();
    until(&r, "app", |a| why(a) == Some(Why::Pending)).await;
    store.close("app");
    // db runs: app's new verdict (holds) is decided and waits at the gate.
    let first = {
        let r = r.clone();
        tokio::spawn(async move { r.report("data", report("db", RunState::Running)).await })
    };
    store.until_held(1).await;
    // db goes back to pending. Its report is answered once app is judged
    // again, which waits for the write held at the gate: it runs beside
    // the test.
    let second = {
        let r = r.clone();
        tokio::spawn(async move { r.report("data", report("db", RunState::Pending)).await })
    };
    until(&r, "data", |a| a.tasks[0].state == RunState::Pending).await;
    store.open();
    first.await.unwrap().unwrap();
    second.await.unwrap().unwrap();
    let app = until(&r, "app", |a| why(a) == Some(Why::Pending)).await;
    assert!(!app.allowed(0));
}

/// Two registrations racing on one server (the first's commit not yet
/// done) cannot close a cycle: the second is refused with it.
#[tokio::test(start_paused = true)]
async fn two_racing_registrations_cannot_close_a_cycle() {
    let store = Gated::new();
    let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
    store.close("a");
    let first = {
        let r = r.clone();
        tokio::spawn(async move { r.register(id("a"), depends("web", "b", "db")).await })
    };
    store.until_held(1).await;
    let second = {
        let r = r.clone();
        tokio::spawn(async move { r.register(id("b"), depends("db", "a", "web")).await })
    };
    // Every task runs as far as it can: the paused clock moves only once
    // all of them wait.
    tokio::time::sleep(Duration::from_millis(1)).await;
    store.open();
    first.await.unwrap().unwrap();
    let second = second.await.unwrap();
    assert!(
        matches!(second, Err(RegistryError::DependencyCycle { .. })),
        "b closes a/web -> b/db -> a/web, yet it was taken: {:?}",
        second.map(|(a, _)| a.id.to_string())
    );
}
