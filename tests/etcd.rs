//! Replicas over a real etcd cluster (`tests/common/etcd.rs`): writes
//! through one replica seen and waited on through another, concurrent
//! writers against one allocation through three replicas, compaction,
//! etcd failures, semaphores in the store (`mod semaphores`: watched
//! and listed across replicas, compare-and-swap, grants on a stale view),
//! and barriers met through three replicas (`mod barriers`).

mod common;

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use common::{
    etcd::{Cluster, available},
    stall::Stall,
};
use taskgate::{
    lifecycle::{
        AllocId, AllocSpec, EventInput, Hook, Lifecycle, Limits, RunState, TaskName, TaskReport,
        TaskSpec,
    },
    registry::{Registry, RegistryConfig, RegistryError, feed::Next},
    store::{
        StoreError, StoreHealth,
        etcd::{
            EtcdConfig, EtcdStore,
            client::{Client, Swapped},
        },
    },
};

const SETTLE: Duration = Duration::from_secs(10);

async fn replica(endpoints: Vec<String>, prefix: &str) -> Registry {
    replica_with(endpoints, prefix, Duration::from_secs(1)).await
}

async fn replica_with(endpoints: Vec<String>, prefix: &str, timeout: Duration) -> Registry {
    let config = EtcdConfig {
        prefix: prefix.into(),
        request_timeout: timeout,
        ..EtcdConfig::new(endpoints)
    };
    let store = EtcdStore::connect(&config).await.expect("connects");
    Registry::open(Arc::new(store), RegistryConfig::default()).expect("opens")
}

fn task(name: &str, hook: Option<Hook>) -> TaskSpec {
    TaskSpec {
        name: TaskName::parse(name).unwrap(),
        lifecycle: hook.map(|hook| Lifecycle {
            hook,
            sidecar: false,
        }),
        leader: false,
        readiness: false,
        liveness: None,
        depends_on: Vec::new(),
        acquire: Vec::new(),
        barrier: None,
    }
}

fn spec(tasks: Vec<TaskSpec>) -> AllocSpec {
    AllocSpec::new(tasks, &Limits::default()).unwrap()
}

fn report(state: RunState, message: &str) -> TaskReport {
    TaskReport {
        state,
        failed: false,
        ready: None,
        event: Some(EventInput {
            kind: "Note".into(),
            time: None,
            message: message.into(),
            details: BTreeMap::new(),
        }),
    }
}

/// A report that makes a task `running`, with no event.
fn running() -> TaskReport {
    TaskReport {
        event: None,
        ..report(RunState::Running, "")
    }
}

fn id(s: &str) -> AllocId {
    AllocId::parse(s).unwrap()
}

/// A run without etcd does not pass in silence: it says, where `cargo
/// test`'s output shows it, that the etcd tests did not run. (This test
/// runs one of them again, as a child, with no etcd on its PATH.)
#[test]
fn a_run_without_etcd_says_the_etcd_tests_were_skipped() {
    if std::env::var_os("TASKGATE_ETCD_SKIP_CHECK").is_some() {
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_report_through_one_replica_wakes_a_waiter_parked_on_another",
            "--test-threads=1",
        ])
        .env("PATH", "/nonexistent")
        .env_remove("TASKGATE_REQUIRE_ETCD")
        .env("TASKGATE_ETCD_SKIP_CHECK", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(err.matches(common::etcd::SKIPPED).count(), 1, "{err}");
    // What was captured stays captured: one line, not one per test.
    assert!(!err.contains(": skipped, no etcd"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_through_one_replica_wakes_a_waiter_parked_on_another() {
    if !available("a_report_through_one_replica_wakes_a_waiter_parked_on_another") {
        return;
    }
    let cluster = Cluster::start(3);
    let a = replica(cluster.endpoints(), "/t1/").await;
    let b = replica(cluster.endpoints(), "/t1/").await;
    let s = spec(vec![task("init", Some(Hook::Prestart)), task("web", None)]);
    let (registered, new) = a.register(id("web-1"), s.clone()).await.unwrap();
    assert!(new);
    assert_eq!(registered.create_index, registered.modify_index);
    assert!(registered.modify_index > 0, "an etcd revision");

    // B follows: once its view reached the registration, it holds the same
    // record, and registering the same spec there is idempotent.
    assert!(b.wait_view(registered.modify_index, SETTLE).await);
    assert_eq!(*b.get("web-1").unwrap(), *registered);
    let (again, new) = b.register(id("web-1"), s).await.unwrap();
    assert!(!new);
    assert_eq!(again.modify_index, registered.modify_index);
    let other = spec(vec![task("web", None)]);
    assert!(matches!(
        b.register(id("web-1"), other).await,
        Err(RegistryError::AllocationExists { .. })
    ));

    // `web` may not start before `init` finished: parked on B.
    let parked = {
        let b = b.clone();
        tokio::spawn(async move {
            b.wait_start("web-1", "web", Duration::from_secs(60), true)
                .await
        })
    };
    common::parked(&b, 1).await;
    let init = TaskName::parse("init").unwrap();
    let done = a
        .report("web-1", vec![(init, report(RunState::Dead, "done"))])
        .await
        .unwrap();
    let (seen, web) = tokio::time::timeout(SETTLE, parked)
        .await
        .expect("the waiter on B is woken by A's report")
        .unwrap()
        .unwrap();
    assert!(seen.allowed(web));
    assert_eq!(seen.modify_index, done.modify_index);
    assert_eq!(*seen, *done, "B holds exactly what A committed");

    // A deletion through B ends it on A too.
    let deleted = b.delete("web-1").await.unwrap();
    assert!(deleted > done.modify_index);
    assert!(a.wait_view(deleted, SETTLE).await);
    assert!(a.get("web-1").is_err());
    assert!(a.last_index() >= deleted && b.last_index() >= deleted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_on_three_replicas_lose_nothing_and_apply_nothing_twice() {
    if !available("concurrent_writers_on_three_replicas_lose_nothing_and_apply_nothing_twice") {
        return;
    }
    let cluster = Cluster::start(3);
    // Each replica on its own member first, so their writes race in etcd.
    let mut replicas = Vec::new();
    for i in 0..3 {
        let mut endpoints = cluster.endpoints();
        endpoints.rotate_left(i);
        replicas.push(replica(endpoints, "/t2/").await);
    }
    const TASKS: usize = 8;
    const PER_TASK: usize = 10; // MAX_EVENTS: every event stays in view
    let names: Vec<String> = (0..TASKS).map(|t| format!("t{t}")).collect();
    let s = spec(names.iter().map(|n| task(n, None)).collect());
    replicas[0].register(id("race"), s).await.unwrap();
    // Every task starts running (one run each, no event): the senders
    // below report under its run, as its agent does.
    let started = replicas[0]
        .report(
            "race",
            names
                .iter()
                .map(|n| (TaskName::parse(n).unwrap(), running()))
                .collect(),
        )
        .await
        .unwrap();
    let first = &started;

    // Two senders per task, on different replicas, five reports each.
    let mut senders = Vec::new();
    for (t, name) in names.iter().enumerate() {
        for half in 0..2 {
            let r = replicas[(t + half) % 3].clone();
            let name = TaskName::parse(name).unwrap();
            let run = started.tasks[t].run;
            assert!(run.is_some(), "{name} runs");
            senders.push(tokio::spawn(async move {
                let mut indexes = Vec::new();
                for k in 0..PER_TASK / 2 {
                    let message = format!("{name}/{half}/{k}");
                    loop {
                        match r
                            .report_as(
                                "race",
                                vec![(name.clone(), report(RunState::Running, &message))],
                                None,
                                run,
                            )
                            .await
                        {
                            Ok(a) => {
                                indexes.push((a.modify_index, message));
                                break;
                            }
                            // Nothing was written: trying again is what a
                            // client does after the 503.
                            Err(RegistryError::Contended(_)) => continue,
                            Err(e) => panic!("{message}: {e}"),
                        }
                    }
                }
                indexes
            }));
        }
    }
    let mut acked = Vec::new();
    for s in senders {
        let mine = s.await.unwrap();
        assert!(
            mine.windows(2).all(|w| w[0].0 < w[1].0),
            "one sender's indexes go up"
        );
        acked.extend(mine);
    }
    acked.sort_unstable();
    let mut indexes: Vec<u64> = acked.iter().map(|(i, _)| *i).collect();
    let n = indexes.len();
    indexes.dedup();
    assert_eq!(
        indexes.len(),
        n,
        "every acknowledged report is a commit of its own"
    );
    assert!(indexes[0] > first.modify_index);

    let last = *indexes.last().unwrap();
    let mut views = Vec::new();
    for r in &replicas {
        assert!(r.wait_view(last, SETTLE).await);
        views.push(r.get("race").unwrap());
    }
    assert_eq!(*views[0], *views[1]);
    assert_eq!(*views[0], *views[2]);
    let a = &views[0];
    assert_eq!(a.modify_index, last);
    for (t, name) in names.iter().enumerate() {
        let got: Vec<String> = a.tasks[t]
            .events
            .all()
            .iter()
            .map(|e| e.message.to_string())
            .collect();
        assert_eq!(got.len(), PER_TASK, "{name}: {got:?}");
        // A serial replay: the acknowledged reports to this task, applied
        // one by one in the order of their indexes, leave this history.
        let replayed: Vec<String> = acked
            .iter()
            .filter(|(_, m)| m.starts_with(&format!("{name}/")))
            .map(|(_, m)| m.clone())
            .collect();
        assert_eq!(got, replayed, "{name}");
        // A task's index is the revision of the write that last changed it.
        let last_write = acked
            .iter()
            .filter(|(_, m)| m.starts_with(&format!("{name}/")))
            .map(|(i, _)| *i)
            .max();
        assert_eq!(Some(a.tasks[t].modify_index), last_write, "{name}");
        for half in 0..2 {
            // Each sender's reports, once each, in the order it sent them.
            let mine: Vec<&String> = got
                .iter()
                .filter(|m| m.starts_with(&format!("{name}/{half}/")))
                .collect();
            let sent: Vec<String> = (0..PER_TASK / 2)
                .map(|k| format!("{name}/{half}/{k}"))
                .collect();
            assert_eq!(mine, sent.iter().collect::<Vec<_>>(), "{name}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_behind_a_compaction_lists_again_and_holds_what_etcd_holds() {
    if !available("a_replica_behind_a_compaction_lists_again_and_holds_what_etcd_holds") {
        return;
    }
    let cluster = Cluster::start(1);
    let a = replica(cluster.endpoints(), "/t3/").await;
    let s = spec(vec![task("web", None)]);
    for i in 0..5 {
        a.register(id(&format!("x{i}")), s.clone()).await.unwrap();
    }
    // B lists now, and follows only once the changes after its listing
    // are compacted away.
    let config = EtcdConfig {
        prefix: "/t3/".into(),
        ..EtcdConfig::new(cluster.endpoints())
    };
    let b_store = EtcdStore::connect(&config).await.unwrap();
    a.delete("x0").await.unwrap();
    a.register(id("x9"), s.clone()).await.unwrap();
    let web = TaskName::parse("web").unwrap();
    let changed = a
        .report("x1", vec![(web, report(RunState::Running, "up"))])
        .await
        .unwrap();
    let compacted = cluster.compact();
    let b = Registry::open(Arc::new(b_store), RegistryConfig::default()).unwrap();
    assert!(b.wait_view(compacted, SETTLE).await, "listed again");
    let ids = |r: &Registry| {
        r.list("", None, 100, |_| true)
            .0
            .iter()
            .map(|a| a.id.to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(ids(&b), ids(&a));
    assert_eq!(ids(&b), ["x1", "x2", "x3", "x4", "x9"]);
    assert_eq!(*b.get("x1").unwrap(), *changed);
    // Its event stream cannot tell the changes it listed over one by one:
    // a reader from before is told to resync.
    let mut stream = b.subscribe(1, String::new()).unwrap();
    let resync = tokio::time::timeout(SETTLE, stream.next(10))
        .await
        .expect("in time")
        .unwrap();
    assert!(
        matches!(resync, Next::Resync(i) if i >= compacted),
        "{resync:?}"
    );
    // And it follows on from there, the stream with it: A's changes in
    // B's stream at the indexes A answered.
    let deleted = a.delete("x2").await.unwrap();
    assert!(b.wait_view(deleted, SETTLE).await);
    assert!(b.get("x2").is_err());
    let changes = tokio::time::timeout(SETTLE, stream.next(10))
        .await
        .expect("in time")
        .unwrap();
    let Next::Changes(changes) = changes else {
        panic!("{changes:?}")
    };
    assert_eq!(changes.len(), 1);
    assert_eq!(
        (changes[0].index, changes[0].alloc_id.as_str()),
        (deleted, "x2")
    );
    assert!(changes[0].allocation.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_quorum_writes_are_refused_reads_answer_and_health_recovers() {
    if !available("without_a_quorum_writes_are_refused_reads_answer_and_health_recovers") {
        return;
    }
    let mut cluster = Cluster::start(3);
    let a = replica(cluster.endpoints(), "/t4/").await;
    let s = spec(vec![task("web", None)]);
    let (kept, _) = a.register(id("kept"), s.clone()).await.unwrap();
    assert!(wait_health(&a, |h| *h == StoreHealth::Ok).await);

    // Two of three members gone: no quorum.
    let leader = cluster.leader();
    let others: Vec<usize> = (0..3).filter(|&i| i != leader).collect();
    cluster.kill(leader);
    cluster.kill(others[0]);
    // 503 store_unavailable: refused, or (a member that did not answer
    // in time) not confirmed, which may have been applied.
    let refused = a.register(id("lost"), s.clone()).await;
    assert!(
        matches!(
            refused,
            Err(RegistryError::Store(
                StoreError::Unavailable(_) | StoreError::Uncertain(_)
            ))
        ),
        "{refused:?}"
    );
    assert_eq!(*a.get("kept").unwrap(), *kept, "reads answer from the view");
    assert!(
        wait_health(&a, |h| matches!(
            h,
            StoreHealth::Refusing {
                code: "store_unavailable",
                ..
            }
        ))
        .await
    );

    // Back: health and writes recover by themselves.
    cluster.restart(leader);
    cluster.restart(others[0]);
    cluster.wait_healthy(Duration::from_secs(30));
    assert!(wait_health(&a, |h| *h == StoreHealth::Ok).await);
    let (after, new) = a.register(id("after"), s).await.unwrap();
    assert!(new);
    assert!(after.modify_index > kept.modify_index);
    assert!(a.get("lost").is_err(), "a refused write left nothing");
}

/// A `taskgate serve --store etcd` process on `cluster` under `prefix`.
fn etcd_server(cluster: &Cluster, prefix: &str) -> common::process::Server {
    let endpoints = cluster.endpoints().join(",");
    common::process::Server::start(&[
        "--store",
        "etcd",
        "--etcd-endpoints",
        &endpoints,
        "--etcd-prefix",
        prefix,
    ])
}

/// One writer's reports after a failure under load: `acked` (message,
/// index) in the order the writer had them acknowledged, `tried_after` the
/// reports it tried after the last one (each a failure that may have
/// landed), against the allocation's index `now` and its task's event
/// `history`. No acknowledged change went back; the newest is still in the
/// history unless the reports tried after it can have pushed it out of the
/// last `MAX_EVENTS`; the acknowledged ones still there are in order.
fn acknowledged_are_kept(
    name: &str,
    acked: &[(String, u64)],
    tried_after: usize,
    now: u64,
    history: &[String],
) {
    let (newest, index) = acked.last().expect("acknowledged reports");
    assert!(now >= *index, "{name}: an acknowledged change went back");
    if tried_after < taskgate::lifecycle::MAX_EVENTS {
        assert!(
            history.contains(newest),
            "{name}: {newest} lost: {history:?}"
        );
    }
    let kept: Vec<&String> = acked
        .iter()
        .map(|(m, _)| m)
        .filter(|m| history.contains(m))
        .collect();
    let order: Vec<&String> = history.iter().filter(|m| kept.contains(m)).collect();
    assert_eq!(kept, order, "{name}");
}

/// Waits (bounded) until the replica's store health satisfies `ok`,
/// checking after each change the store could make: its link checks run
/// every two seconds.
async fn wait_health(r: &Registry, ok: impl Fn(&StoreHealth) -> bool) -> bool {
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    while tokio::time::Instant::now() < until {
        if ok(&r.store_health()) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Two `taskgate serve --store etcd` replicas; the five-task example's
/// agents each list both (half of them the doomed one first). One replica
/// is SIGKILLed while `web` runs: every agent fails over and the group
/// still finishes in lifecycle order.
#[test]
fn five_agents_finish_in_lifecycle_order_through_two_replicas_while_one_dies() {
    use common::agents::*;
    if !available("five_agents_finish_in_lifecycle_order_through_two_replicas_while_one_dies") {
        return;
    }
    let cluster = Cluster::start(3);
    let stays = etcd_server(&cluster, "/p5/");
    let dies = etcd_server(&cluster, "/p5/");
    let dir = tempfile::tempdir().unwrap();
    let spec = five_spec(dir.path());
    let lists = [
        format!("{},{}", dies.base, stays.base),
        format!("{},{}", stays.base, dies.base),
    ];
    let mut agents: Vec<Agent> = commands(dir.path())
        .into_iter()
        .enumerate()
        .map(|(i, (task, cmd))| agent(&lists[i % 2], "ha1", task, &spec, &[], &cmd))
        .collect();
    wait_log(dir.path(), "web-start", 1);
    drop(dies);
    std::fs::write(dir.path().join("finish"), "").unwrap();
    let codes = exits(&mut agents);
    // The sidecar is stopped by the server's order (122); every other
    // task ends by itself.
    assert_eq!(
        codes,
        [
            ("init", 0),
            ("proxy", 122),
            ("web", 0),
            ("announce", 0),
            ("cleanup", 0)
        ]
    );

    let log = log_lines(dir.path());
    assert!(pos(&log, "init-done") < pos(&log, "web-start"), "{log:?}");
    assert!(pos(&log, "web-start") < pos(&log, "web-done"), "{log:?}");
    assert_eq!(log.last().map(String::as_str), Some("cleanup"), "{log:?}");
    let base = &stays.base;
    assert!(started_at(base, "ha1", "proxy") < started_at(base, "ha1", "web"));
    assert!(started_at(base, "ha1", "web") < started_at(base, "ha1", "announce"));
    let done = get(base, "/v1/allocations/ha1");
    assert_eq!(done["coordinator_state"], "poststop");
    // Health says how far the replica's view has got.
    let health = get(base, "/v1/health");
    assert_eq!(health["view"]["state"], "synced", "{health}");
    assert!(
        health["view"]["index"].as_u64() >= done["modify_index"].as_u64(),
        "{health}"
    );
}

/// The member a replica's watch is on stops (SIGSTOP, longer than an
/// election) while another replica writes and etcd compacts: the stalled
/// replica notices, moves its watch to another member, finds its revision
/// compacted, lists again, and wakes exactly the waiter whose allocation
/// changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_member_and_a_compaction_during_parked_waits_wake_exactly_the_changed() {
    if !available("a_stalled_member_and_a_compaction_during_parked_waits_wake_exactly_the_changed")
    {
        return;
    }
    let cluster = Cluster::start(3);
    let endpoints = cluster.endpoints();
    let mut others = endpoints.clone();
    others.rotate_left(1);
    let a = replica(others, "/t6/").await;
    let b = replica(endpoints, "/t6/").await;
    let s = spec(vec![task("init", Some(Hook::Prestart)), task("web", None)]);
    let mut last = 0;
    for alloc in ["w1", "w2"] {
        last = a
            .register(id(alloc), s.clone())
            .await
            .unwrap()
            .0
            .modify_index;
    }
    assert!(b.wait_view(last, SETTLE).await);
    let park = |alloc: &'static str| {
        let b = b.clone();
        tokio::spawn(async move {
            b.wait_start(alloc, "web", Duration::from_secs(120), true)
                .await
        })
    };
    let (w1, w2) = (park("w1"), park("w2"));
    common::parked(&b, 2).await;

    cluster.pause(0);
    let init = TaskName::parse("init").unwrap();
    let done = a
        .report("w1", vec![(init, report(RunState::Dead, "done"))])
        .await
        .unwrap();
    // One more change, so the compaction passes the report's revision and
    // B cannot watch on from before it: it must list again.
    let (w3, _) = a.register(id("w3"), s.clone()).await.unwrap();
    let compacted = cluster.compact();
    assert!(compacted >= w3.modify_index && w3.modify_index > done.modify_index);

    let (seen, web) = tokio::time::timeout(Duration::from_secs(60), w1)
        .await
        .expect("the waiter on w1 is woken once B follows again")
        .unwrap()
        .unwrap();
    assert!(seen.allowed(web));
    assert_eq!(*seen, *done);
    assert!(
        !w2.is_finished(),
        "w2 did not change: its waiter stays parked"
    );
    assert!(b.last_index() >= compacted);
    assert!(b.wait_view(w3.modify_index, SETTLE).await);
    assert_eq!(*b.get("w3").unwrap(), *w3);
    assert!(wait_health(&b, |h| *h == StoreHealth::Ok).await);
    cluster.resume(0);
    w2.abort();
}

/// The etcd leader is SIGKILLed while three replicas take reports: writes
/// in flight then may fail (503, never a 2xx etcd did not commit), every
/// acknowledged one is in every replica's view afterwards, and no index
/// ever goes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_etcd_leader_killed_under_load_loses_no_acknowledged_change() {
    if !available("the_etcd_leader_killed_under_load_loses_no_acknowledged_change") {
        return;
    }
    let mut cluster = Cluster::start(3);
    let mut replicas = Vec::new();
    for i in 0..3 {
        let mut endpoints = cluster.endpoints();
        endpoints.rotate_left(i);
        replicas.push(replica(endpoints, "/t7/").await);
    }
    let s = spec(vec![task("web", None)]);
    const ALLOCS: usize = 12;
    let web = TaskName::parse("web").unwrap();
    // Each web runs (one run, no event) before the load: the writers
    // report under its run, as its agent does.
    let mut runs = Vec::new();
    for n in 0..ALLOCS {
        let r = &replicas[n % 3];
        r.register(id(&format!("k{n}")), s.clone()).await.unwrap();
        let a = r
            .report(&format!("k{n}"), vec![(web.clone(), running())])
            .await
            .unwrap();
        runs.push(a.tasks[0].run.expect("web runs"));
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for n in 0..ALLOCS {
        let (r, stop, run) = (replicas[n % 3].clone(), stop.clone(), runs[n]);
        writers.push(tokio::spawn(async move {
            // (message, index) of every acknowledged report, in order, and
            // the reports tried after the last acknowledged one.
            let mut acked: Vec<(String, u64)> = Vec::new();
            let mut tried_after = 0;
            let web = TaskName::parse("web").unwrap();
            let mut k = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let message = format!("k{n}/{k}");
                match r
                    .report_as(
                        &format!("k{n}"),
                        vec![(web.clone(), report(RunState::Running, &message))],
                        None,
                        Some(run),
                    )
                    .await
                {
                    Ok(a) => {
                        if let Some(&(_, before)) = acked.last() {
                            assert!(a.modify_index > before, "indexes only go up");
                        }
                        acked.push((message, a.modify_index));
                        tried_after = 0;
                    }
                    // 503s: refused, not confirmed (may have landed), the
                    // view behind, or contended.
                    Err(RegistryError::Store(
                        StoreError::Unavailable(_) | StoreError::Uncertain(_),
                    ))
                    | Err(RegistryError::Behind { .. })
                    | Err(RegistryError::Contended(_)) => tried_after += 1,
                    Err(e) => panic!("{message}: {e}"),
                }
                k += 1;
            }
            (acked, tried_after)
        }));
    }
    // Load before, during and after the election.
    let first = replicas[0].last_index();
    assert!(replicas[0].wait_view(first + 20, SETTLE).await);
    let leader = cluster.leader();
    cluster.kill(leader);
    let after = cluster.leader();
    assert_ne!(after, leader);
    let now = replicas[after].last_index();
    assert!(
        replicas[after]
            .wait_view(now + 20, Duration::from_secs(30))
            .await,
        "writes go on"
    );
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut last = 0;
    let mut acked = Vec::new();
    for w in writers {
        let mine = w.await.unwrap();
        last = last.max(mine.0.last().map_or(0, |&(_, i)| i));
        acked.push(mine);
    }
    assert!(acked.iter().all(|(mine, _)| !mine.is_empty()));
    for (n, (mine, tried_after)) in acked.iter().enumerate() {
        for r in &replicas {
            assert!(r.wait_view(last, SETTLE).await);
            let a = r.get(&format!("k{n}")).unwrap();
            let history: Vec<String> = a.tasks[0]
                .events
                .all()
                .iter()
                .map(|e| e.message.to_string())
                .collect();
            let mut once = history.clone();
            once.sort();
            once.dedup();
            assert_eq!(once.len(), history.len(), "k{n}: a report applied twice");
            acknowledged_are_kept(
                &format!("k{n}"),
                mine,
                *tried_after,
                a.modify_index,
                &history,
            );
        }
    }
}

/// Found by the container smoke run: in an image without certificate roots
/// the etcd client could not even be built ("builder error"), though plain
/// HTTP needs none. A replica there waits for its etcd (answering 503
/// `starting`) instead of exiting. Needs no etcd: the endpoint is a closed
/// port.
#[test]
fn a_replica_without_certificate_roots_waits_for_a_plain_http_etcd() {
    use std::{
        net::TcpListener,
        process::{Command, Stdio},
        time::Instant,
    };
    let port = |_| {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
    };
    let (listen, closed) = (port(0), port(1));
    let mut child = Command::new(env!("CARGO_BIN_EXE_taskgate"))
        .args(["serve", "--store", "etcd", "--listen", &listen.to_string()])
        .args(["--etcd-endpoints", &format!("http://{closed}")])
        .env("SSL_CERT_FILE", "/nonexistent")
        .env("SSL_CERT_DIR", "/nonexistent")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    let answer = loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
            panic!("the replica exited ({status}): {err}");
        }
        if std::net::TcpStream::connect(listen).is_ok() {
            let request = common::raw::request("GET", "/v1/health", None, b"");
            break common::raw::exchange(listen, &request);
        }
        assert!(Instant::now() < until, "the replica never listened");
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = child.kill();
    let _ = child.wait();
    answer.assert_problem(503, "starting");
}

/// Two `taskgate serve --store etcd` replicas take reports from eight
/// writers, each writer moving to the other replica when one fails it (as
/// `taskgate agent` does). One replica is SIGKILLed under that load: every
/// report a writer had acknowledged is in the survivor's view, and no
/// index went back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_under_load_loses_no_acknowledged_report() {
    if !available("a_replica_killed_under_load_loses_no_acknowledged_report") {
        return;
    }
    let cluster = Cluster::start(3);
    let (mut dies, stays) = (
        Some(etcd_server(&cluster, "/p8/")),
        etcd_server(&cluster, "/p8/"),
    );
    let bases = [dies.as_ref().unwrap().base.clone(), stays.base.clone()];
    let http = common::http();
    const WRITERS: usize = 8;
    // Each web runs (one run, no event) before the load: the writers
    // report under its run (`Taskgate-Run`), as its agent does.
    let mut runs = Vec::new();
    for w in 0..WRITERS {
        let spec = serde_json::json!({"tasks": [{"name": "web"}]});
        let put = http
            .put(format!("{}/v1/allocations/w{w}", bases[0]))
            .json(&spec)
            .send()
            .await
            .unwrap();
        assert_eq!(put.status(), 201);
        let started = http
            .put(format!("{}/v1/allocations/w{w}/tasks/web/state", bases[0]))
            .json(&serde_json::json!({"state": "running"}))
            .send()
            .await
            .unwrap();
        assert_eq!(started.status(), 200);
        let v: serde_json::Value = started.json().await.unwrap();
        runs.push(v["tasks"][0]["run"].as_str().expect("web runs").to_owned());
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Reports acknowledged so far, by all writers.
    let acked_total = Arc::new(tokio::sync::watch::Sender::new(0usize));
    let mut writers = Vec::new();
    for (w, run) in runs.into_iter().enumerate() {
        let (http, bases, stop, total) = (
            http.clone(),
            bases.clone(),
            stop.clone(),
            acked_total.clone(),
        );
        writers.push(tokio::spawn(async move {
            let (mut at, mut k) = (w % 2, 0);
            let (mut acked, mut tried_after): (Vec<(String, u64)>, usize) = (Vec::new(), 0);
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let message = format!("w{w}/{k}");
                k += 1;
                let body = serde_json::json!({"state": "running", "event": {"type": "Note", "message": message}});
                let sent = http
                    .put(format!("{}/v1/allocations/w{w}/tasks/web/state", bases[at]))
                    .header("taskgate-run", &run)
                    .json(&body)
                    .timeout(Duration::from_secs(10))
                    .send()
                    .await;
                match sent {
                    Ok(r) if r.status() == 200 => {
                        let v: serde_json::Value = r.json().await.unwrap();
                        let index = v["modify_index"].as_u64().unwrap();
                        if let Some(&(_, before)) = acked.last() {
                            assert!(index > before, "w{w}: an index went back");
                        }
                        acked.push((message, index));
                        tried_after = 0;
                        total.send_modify(|n| *n += 1);
                    }
                    Ok(r) if r.status().is_server_error() => {
                        tried_after += 1;
                        at = 1 - at;
                    }
                    Ok(r) => panic!("w{w}: {}", r.status()),
                    Err(_) => {
                        tried_after += 1;
                        at = 1 - at;
                    }
                }
            }
            (acked, tried_after)
        }));
    }
    let wait_for = |n: usize| {
        let mut total = acked_total.subscribe();
        async move {
            let reached = total.wait_for(|&t| t >= n);
            tokio::time::timeout(Duration::from_secs(60), reached)
                .await
                .expect("the load stalled")
                .unwrap();
        }
    };
    wait_for(200).await;
    drop(dies.take()); // SIGKILL, mid-load
    let after = *acked_total.borrow();
    wait_for(after + 200).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for (w, writer) in writers.into_iter().enumerate() {
        let (acked, tried_after) = writer.await.unwrap();
        let index = acked.last().expect("acknowledged reports").1;
        let v: serde_json::Value = http
            .get(format!(
                "{}/v1/allocations/w{w}/tasks/web?index={}&wait=10s",
                stays.base,
                index - 1
            ))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let history: Vec<String> = v["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["message"].as_str().unwrap().to_owned())
            .collect();
        let now = v["modify_index"].as_u64().unwrap();
        acknowledged_are_kept(&format!("w{w}"), &acked, tried_after, now, &history);
    }
}

/// A report that changes nothing on a replica's copy may change the newer
/// record etcd holds: replica A's member stops, B records `web` pending,
/// and A is told `web` is running — a no-op on A's stale copy. A asks
/// etcd, follows up to B's change, and applies the report: it is not lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_that_is_a_no_op_only_on_a_stale_copy_still_lands() {
    if !available("a_report_that_is_a_no_op_only_on_a_stale_copy_still_lands") {
        return;
    }
    let cluster = Cluster::start(3);
    let endpoints = cluster.endpoints();
    let mut others = endpoints.clone();
    others.rotate_left(1);
    let a = replica(endpoints, "/t9/").await;
    let b = replica(others, "/t9/").await;
    let s = spec(vec![task("web", None)]);
    a.register(id("s1"), s).await.unwrap();
    let web = TaskName::parse("web").unwrap();
    let bare = |state| TaskReport {
        state,
        failed: false,
        ready: None,
        event: None,
    };
    let running = a
        .report("s1", vec![(web.clone(), bare(RunState::Running))])
        .await
        .unwrap();
    assert!(b.wait_view(running.modify_index, SETTLE).await);

    cluster.pause(0); // A's member: A's view stops there
    let pending = b
        .report("s1", vec![(web.clone(), bare(RunState::Pending))])
        .await
        .unwrap();
    assert_eq!(
        a.get("s1").unwrap().tasks[0].state,
        RunState::Running,
        "A is behind"
    );
    let again = a
        .report("s1", vec![(web.clone(), bare(RunState::Running))])
        .await
        .unwrap();
    assert!(
        again.modify_index > pending.modify_index,
        "applied on B's record"
    );
    assert!(b.wait_view(again.modify_index, SETTLE).await);
    let seen = b.get("s1").unwrap();
    assert_eq!(seen.tasks[0].state, RunState::Running);
    assert_eq!(
        seen.tasks[0].restarts, 1,
        "B's pending counted, A's running applied"
    );
    cluster.resume(0);
}

/// A dependency across allocations on two replicas: the start condition
/// of `app/web` parked on replica B opens when `data/db`, reported through
/// replica A, becomes ready; the dependent's new version is written once
/// (both replicas see the change; the compare-and-swap keeps one write).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dependency_on_another_allocation_holds_across_replicas() {
    if !available("a_dependency_on_another_allocation_holds_across_replicas") {
        return;
    }
    let cluster = Cluster::start(3);
    let a = replica(cluster.endpoints(), "/dep/").await;
    let b = replica(cluster.endpoints(), "/dep/").await;
    let web = TaskSpec {
        depends_on: vec![taskgate::lifecycle::Dependency {
            task: TaskName::parse("db").unwrap(),
            allocation: Some(id("data")),
            condition: taskgate::lifecycle::Condition::Ready,
        }],
        ..task("web", None)
    };
    let (app, _) = b.register(id("app"), spec(vec![web])).await.unwrap();
    assert!(!app.allowed(0));
    let db = TaskSpec {
        readiness: true,
        ..task("db", None)
    };
    let (data, _) = a.register(id("data"), spec(vec![db])).await.unwrap();
    assert!(b.wait_view(data.modify_index, SETTLE).await);
    let parked = {
        let b = b.clone();
        tokio::spawn(async move {
            b.wait_start("app", "web", Duration::from_secs(60), true)
                .await
        })
    };
    common::parked(&b, 1).await;
    let db_name = TaskName::parse("db").unwrap();
    let up = a
        .report(
            "data",
            vec![(db_name.clone(), report(RunState::Running, "up"))],
        )
        .await
        .unwrap();
    // db's agent says it is ready, under its run.
    let ready = TaskReport {
        ready: Some(true),
        ..report(RunState::Running, "ready")
    };
    let done = a
        .report_as("data", vec![(db_name, ready)], None, up.tasks[0].run)
        .await
        .unwrap();
    let (seen, i) = tokio::time::timeout(SETTLE, parked)
        .await
        .expect("the waiter on B is woken once data/db is ready")
        .unwrap()
        .unwrap();
    assert!(seen.allowed(i));
    assert!(
        seen.modify_index > done.modify_index,
        "a new version of app"
    );
    // One write of the verdict, whichever replica made it: the timeline
    // of app has one entry saying it holds.
    assert!(a.wait_view(seen.modify_index, SETTLE).await);
    let on_a = a.get("app").unwrap();
    assert_eq!(*on_a, *seen, "both replicas hold the same version");
    let holds = a
        .timeline(&on_a)
        .into_iter()
        .filter(|e| {
            matches!(
                e.what,
                taskgate::registry::timeline::What::Dependency { holds: true, .. }
            )
        })
        .count();
    assert_eq!(holds, 1, "the verdict was written once");
}

/// Semaphores through three replicas (SEMANTICS "Semaphores": one grant is
/// made once whichever replica sees the change): twelve allocations, each
/// with a task acquiring `db` of limit 2, registered and ended through
/// different replicas while every replica's judge plans the grants. Each
/// task is granted once, in registration order, and the history every
/// replica publishes never has more than two holders at any index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_through_three_replicas_never_pass_the_limit_and_are_made_once() {
    if !available("grants_through_three_replicas_never_pass_the_limit_and_are_made_once") {
        return;
    }
    use taskgate::{
        lifecycle::SemName,
        registry::timeline::{SlotChange, What},
    };
    let cluster = Cluster::start(3);
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(replica(cluster.endpoints(), "/sem/").await);
    }
    let (made, _) = replicas[0]
        .put_semaphore(SemName::parse("db").unwrap(), 2, Duration::from_secs(600))
        .await
        .unwrap();
    for r in &replicas[1..] {
        assert!(r.wait_view(made.modify_index, SETTLE).await);
    }
    const JOBS: usize = 12;
    let job = TaskSpec {
        acquire: vec![SemName::parse("db").unwrap()],
        ..task("job", None)
    };
    for k in 0..JOBS {
        replicas[k % 3]
            .register(id(&format!("job-{k:02}")), spec(vec![job.clone()]))
            .await
            .unwrap();
    }
    let name = TaskName::parse("job").unwrap();
    let mut fences = Vec::new();
    for k in 0..JOBS {
        let alloc = format!("job-{k:02}");
        let granted = replicas[(k + 1) % 3]
            .wait_until(&alloc, SETTLE, |a| a.tasks[0].fence().is_some())
            .await
            .unwrap();
        let fence = granted.tasks[0]
            .fence()
            .unwrap_or_else(|| panic!("{alloc} was never granted"));
        fences.push(fence);
        let ending = &replicas[(k + 2) % 3];
        assert!(ending.wait_view(granted.modify_index, SETTLE).await);
        ending
            .report(&alloc, vec![(name.clone(), running())])
            .await
            .unwrap();
        ending
            .report(&alloc, vec![(name.clone(), report(RunState::Dead, "done"))])
            .await
            .unwrap();
    }
    assert!(
        fences.windows(2).all(|w| w[0] < w[1]),
        "granted in registration order, fences growing: {fences:?}"
    );
    let last = replicas[0]
        .last_index()
        .max(replicas[1].last_index())
        .max(replicas[2].last_index());
    for (n, r) in replicas.iter().enumerate() {
        assert!(r.wait_view(last, SETTLE).await);
        // Each task's slot, as [acquired, released) in indexes.
        let mut held = Vec::new();
        for (k, &fence) in fences.iter().enumerate() {
            let a = r.get(&format!("job-{k:02}")).unwrap();
            let slots: Vec<(u64, SlotChange)> = r
                .timeline(&a)
                .iter()
                .filter_map(|e| match &e.what {
                    What::Slot { change, .. } => Some((e.index, *change)),
                    _ => None,
                })
                .collect();
            assert_eq!(
                slots.iter().filter(|s| s.1 == SlotChange::Acquired).count(),
                1,
                "replica {n}: job-{k:02} was granted once: {slots:?}"
            );
            assert_eq!(
                slots[0].0, fence,
                "replica {n}: the fence is the grant's index"
            );
            held.push((slots[0].0, slots.get(1).map_or(u64::MAX, |s| s.0)));
        }
        for &(at, _) in &held {
            let holders = held
                .iter()
                .filter(|&&(from, to)| from <= at && at < to)
                .count();
            assert!(
                holders <= 2,
                "replica {n}: {holders} holders at index {at}: {held:?}"
            );
        }
    }
}

/// The messages of a task's events, in order.
fn messages(r: &Registry, alloc: &str, task: usize) -> Vec<String> {
    r.get(alloc).unwrap().tasks[task]
        .events
        .all()
        .iter()
        .map(|e| e.message.to_string())
        .collect()
}

/// Replica A and replica B on one allocation; A's first member (behind a
/// forwarder that can stall) applies what A sends and its answers stop
/// coming back. `timeout`: A's deadline per call.
async fn stalled_pair(
    cluster: &Cluster,
    prefix: &str,
    timeout: Duration,
) -> (Stall, Registry, Registry) {
    let endpoints = cluster.endpoints();
    let stall = Stall::start(&endpoints[0]);
    let a = replica_with(
        vec![
            stall.url.clone(),
            endpoints[1].clone(),
            endpoints[2].clone(),
        ],
        prefix,
        timeout,
    )
    .await;
    let b = replica(vec![endpoints[1].clone(), endpoints[2].clone()], prefix).await;
    let (made, _) = a
        .register(id("w1"), spec(vec![task("web", None)]))
        .await
        .unwrap();
    assert!(b.wait_view(made.modify_index, SETTLE).await);
    (stall, a, b)
}

/// A replica's compare-and-swap commits, its answer
/// does not come back within the deadline (the member paused on the way
/// back), another replica writes the same allocation meanwhile, and the
/// replica sends the transaction to the next member, whose compare fails.
/// The record's write marks say the change that moved the key was its own:
/// it answers with it and never decides again on top of it (the report's
/// event is in the record once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_whose_answer_was_lost_is_applied_once() {
    if !available("a_write_whose_answer_was_lost_is_applied_once") {
        return;
    }
    let cluster = Cluster::start(3);
    let (stall, a, b) = stalled_pair(&cluster, "/t10/", Duration::from_secs(2)).await;
    let web = TaskName::parse("web").unwrap();
    let seen = b.get("w1").unwrap().modify_index;

    stall.stall();
    let sent = {
        let (a, web) = (a.clone(), web.clone());
        tokio::spawn(async move {
            a.report("w1", vec![(web, report(RunState::Running, "once"))])
                .await
        })
    };
    // A's transaction is applied (B sees it) while A waits for the answer;
    // B writes on top of it, a report of the run A's report started,
    // before A's deadline passes.
    assert!(b.wait_view(seen + 1, SETTLE).await);
    assert_eq!(messages(&b, "w1", 0), ["once"]);
    let run = b.get("w1").unwrap().tasks[0].run;
    assert!(run.is_some(), "A's report started a run");
    b.report_as(
        "w1",
        vec![(web.clone(), report(RunState::Running, "from B"))],
        None,
        run,
    )
    .await
    .unwrap();
    let answer = sent.await.unwrap().expect("A's report is acknowledged");
    assert_eq!(
        answer.tasks[0]
            .events
            .all()
            .iter()
            .filter(|e| *e.message == *"once")
            .count(),
        1,
        "the answer holds the report once"
    );
    stall.release();
    let last = b.get("w1").unwrap().modify_index;
    assert!(a.wait_view(last, SETTLE).await);
    assert_eq!(messages(&b, "w1", 0), ["once", "from B"]);
    assert_eq!(messages(&a, "w1", 0), ["once", "from B"]);
}

/// When more writes followed a write whose answer was lost than a record
/// remembers (8), whether it was applied cannot be told: the replica says
/// so (503 `store_unavailable`, "may have been applied") rather than
/// deciding again; a deletion whose answer was lost is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_answer_past_what_the_record_remembers_is_unavailable_not_doubled() {
    if !available("a_lost_answer_past_what_the_record_remembers_is_unavailable_not_doubled") {
        return;
    }
    let cluster = Cluster::start(3);
    let (stall, a, b) = stalled_pair(&cluster, "/t11/", Duration::from_secs(4)).await;
    let web = TaskName::parse("web").unwrap();
    let seen = b.get("w1").unwrap().modify_index;

    stall.stall();
    let sent = {
        let (a, web) = (a.clone(), web.clone());
        tokio::spawn(async move {
            a.report("w1", vec![(web, report(RunState::Running, "once"))])
                .await
        })
    };
    assert!(b.wait_view(seen + 1, SETTLE).await);
    // Reports of the run A's report started, through B.
    let run = b.get("w1").unwrap().tasks[0].run;
    assert!(run.is_some(), "A's report started a run");
    for k in 0..9 {
        let m = format!("B{k}");
        b.report_as(
            "w1",
            vec![(web.clone(), report(RunState::Running, &m))],
            None,
            run,
        )
        .await
        .unwrap();
    }
    let refused = sent.await.unwrap().expect_err("cannot be told");
    assert!(
        matches!(&refused, RegistryError::Store(StoreError::Uncertain(m)) if m.contains("cannot be told")),
        "{refused}"
    );
    let got = messages(&b, "w1", 0);
    assert_eq!(got.iter().filter(|m| *m == "once").count(), 1, "{got:?}");
    stall.release();

    // A deletion whose answer is lost, sent by a replica whose first
    // member is the stalled one: the key is gone when the next member is
    // asked, so it is done (before: 404, as if someone else had deleted it).
    let endpoints = cluster.endpoints();
    let c = replica_with(
        vec![
            stall.url.clone(),
            endpoints[1].clone(),
            endpoints[2].clone(),
        ],
        "/t11/",
        Duration::from_secs(2),
    )
    .await;
    let last = b.get("w1").unwrap().modify_index;
    assert!(c.wait_view(last, SETTLE).await);
    stall.stall();
    let deleted = c.delete("w1").await.expect("the deletion is acknowledged");
    assert!(deleted > last);
    assert!(b.wait_view(deleted, SETTLE).await);
    assert!(b.get("w1").is_err());
}

/// A record this build cannot read (here, a record version from the
/// future): health names it, its requests are 503 `store_failed` at once,
/// the other allocations are served, a replica starts, and DELETE removes
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_record_is_named_refused_and_does_not_stop_a_start() {
    if !available("an_unreadable_record_is_named_refused_and_does_not_stop_a_start") {
        return;
    }
    let cluster = Cluster::start(1);
    let endpoints = cluster.endpoints();
    let a = replica(endpoints.clone(), "/t12/").await;
    let s = spec(vec![task("web", None)]);
    a.register(id("good"), s.clone()).await.unwrap();
    let (bad, _) = a.register(id("bad"), s).await.unwrap();

    let raw = Client::new(&EtcdConfig::new(endpoints.clone())).unwrap();
    let written = raw
        .swap(b"/t12/a/bad", Some(&[99, 1, 2, 3]), bad.modify_index)
        .await
        .unwrap();
    let Swapped::Done(index) = written else {
        panic!("the record moved")
    };
    assert!(a.wait_view(index, SETTLE).await);
    assert_eq!(
        a.store_health(),
        StoreHealth::Degraded(vec!["records_unreadable"])
    );
    assert_eq!(a.unreadable(100), ["bad"]);
    let web = TaskName::parse("web").unwrap();
    let refused = a
        .report("bad", vec![(web.clone(), report(RunState::Running, "x"))])
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, RegistryError::Unreadable { id, .. } if id == "bad"),
        "{refused:?}"
    );
    a.report("good", vec![(web.clone(), report(RunState::Running, "y"))])
        .await
        .unwrap();

    // A replica starts with it in the prefix, and serves the others.
    let b = replica(endpoints, "/t12/").await;
    assert_eq!(b.unreadable(100), ["bad"]);
    assert!(matches!(
        b.look_up("bad").await,
        Err(RegistryError::Unreadable { .. })
    ));
    assert_eq!(b.get("good").unwrap().tasks[0].state, RunState::Running);

    let deleted = b.delete("bad").await.unwrap();
    assert!(a.wait_view(deleted, SETTLE).await);
    assert_eq!(a.store_health(), StoreHealth::Ok);
    assert!(a.unreadable(100).is_empty());
    assert!(matches!(
        a.get("bad"),
        Err(RegistryError::AllocationNotFound(_))
    ));
}

/// A replica whose first member is paused (or cut off without a reset)
/// starts, writes, and follows another replica's writes through the
/// others: the watch is opened with a deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_first_member_is_left_for_the_healthy_ones() {
    if !available("a_paused_first_member_is_left_for_the_healthy_ones") {
        return;
    }
    let cluster = Cluster::start(3);
    let endpoints = cluster.endpoints();
    let b = replica(endpoints[1..].to_vec(), "/t13/").await;
    cluster.pause(0);
    let a = replica(endpoints.clone(), "/t13/").await;
    let (made, _) = a
        .register(id("p1"), spec(vec![task("web", None)]))
        .await
        .unwrap();
    assert!(b.wait_view(made.modify_index, SETTLE).await);
    let web = TaskName::parse("web").unwrap();
    let moved = b
        .report("p1", vec![(web, report(RunState::Running, "through B"))])
        .await
        .unwrap();
    assert!(a.wait_view(moved.modify_index, SETTLE).await, "A follows");
    assert_eq!(a.get("p1").unwrap().tasks[0].state, RunState::Running);
    assert!(wait_health(&a, |h| *h == StoreHealth::Ok).await);
    cluster.resume(0);
}

/// A task's history as replicas read it from etcd (kept as its stored
/// bytes until asked for): replica B, following A's writes, and replica
/// C, started after them, hold the events A wrote, times in other UTC
/// offsets and past 64-bit nanoseconds, and bodies said again, included;
/// B's timeline has each event once, as A's has; a restart order through
/// B (which grows the history it read) and a report through C are each
/// one more entry, the same on every replica that saw them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_history_read_from_etcd_is_the_events_written_on_every_replica() {
    use taskgate::registry::{RestartTarget, timeline::What};
    use time::macros::datetime;
    if !available("a_history_read_from_etcd_is_the_events_written_on_every_replica") {
        return;
    }
    let cluster = Cluster::start(3);
    let prefix = "/history/";
    let a = replica(cluster.endpoints(), prefix).await;
    let b = replica(cluster.endpoints(), prefix).await;
    let (web, side) = (
        TaskName::parse("web").unwrap(),
        TaskName::parse("side").unwrap(),
    );
    a.register(id("h"), spec(vec![task("web", None), task("side", None)]))
        .await
        .unwrap();
    let up = a
        .report(
            "h",
            vec![(web.clone(), running()), (side.clone(), running())],
        )
        .await
        .unwrap();
    let event = |kind: &str, time: time::OffsetDateTime| TaskReport {
        event: Some(EventInput {
            kind: kind.into(),
            time: Some(time),
            message: format!("{kind} here"),
            details: BTreeMap::from([("exit_code".to_owned(), "1".to_owned())]),
        }),
        ..running()
    };
    // Twelve events on web, its history full (the first two dropped).
    let t = datetime!(2026-11-29 10:00:00.25 UTC);
    let mut last = up.clone();
    for (kind, time) in [
        ("Started", t),
        ("Terminated", t + Duration::from_secs(1)),
        ("Started", t + Duration::from_secs(2)),
        ("Restarting", datetime!(2026-11-29 15:30 +05:30)),
        ("Started", datetime!(2300-01-01 0:00 UTC)),
        ("Started", datetime!(1500-06-01 12:00 -03:00)),
        ("Terminated", t + Duration::from_secs(3)),
        ("Restarting", datetime!(2026-11-29 15:30 +05:30)),
        ("Started", datetime!(1969-12-31 23:59:59.5 UTC)),
        ("Terminated", datetime!(2026-11-29 16:30 +06:30)),
        ("Started", t + Duration::from_secs(4)),
        ("Started", datetime!(2262-04-11 23:47:16.854775808 UTC)),
    ] {
        last = a
            .report_as(
                "h",
                vec![(web.clone(), event(kind, time))],
                None,
                up.tasks[0].run,
            )
            .await
            .unwrap();
    }
    let times = |x: &taskgate::lifecycle::Allocation, task: usize| -> Vec<String> {
        (x.tasks[task].events.all().iter())
            .map(|e| format!("{} {} {}", e.kind, e.time(), e.time().offset()))
            .collect()
    };
    let agent_events = |r: &Registry, x: &taskgate::lifecycle::Allocation| -> Vec<String> {
        r.timeline(x)
            .into_iter()
            .filter_map(|e| match e.what {
                What::Agent { task, ref event } => {
                    Some(format!("{task} {} {}", event.kind, e.time()))
                }
                _ => None,
            })
            .collect()
    };
    assert_eq!(last.tasks[0].events.len(), 10);
    assert!(b.wait_view(last.modify_index, SETTLE).await);
    let on_b = b.get("h").unwrap();
    assert_eq!(*on_b, *last, "B holds what A wrote");
    assert_eq!(times(&on_b, 0), times(&last, 0), "offsets kept");
    let on_a = a.get("h").unwrap();
    assert_eq!(agent_events(&b, &on_b), agent_events(&a, &on_a));
    assert_eq!(agent_events(&b, &on_b).len(), 12, "each event once");

    // A restart order through B: "Restart Signaled" ends web's history
    // (its oldest dropped), one restart order on each timeline.
    let (ordered, _) = b
        .restart("h", RestartTarget::Task(web.clone()), "from b")
        .await
        .unwrap();
    let web_events = ordered.tasks[0].events.all();
    assert_eq!(web_events.len(), 10);
    assert_eq!(web_events[..9], last.tasks[0].events.all()[1..]);
    assert_eq!(web_events[9].kind, taskgate::lifecycle::RESTART_EVENT);
    assert!(a.wait_view(ordered.modify_index, SETTLE).await);
    assert_eq!(*a.get("h").unwrap(), *ordered);
    for r in [&a, &b] {
        let x = r.get("h").unwrap();
        let orders: Vec<_> = (r.timeline(&x).into_iter())
            .filter_map(|e| match e.what {
                What::RestartOrder(o) => Some(o.event.message.to_string()),
                _ => None,
            })
            .collect();
        assert_eq!(orders, ["from b"]);
        assert_eq!(agent_events(r, &x).len(), 12, "none of web's again");
    }

    // C starts after it all, reads every history from etcd; a report
    // through it is its timeline's one agent event, and A's thirteenth.
    let c = replica(cluster.endpoints(), prefix).await;
    assert!(c.wait_view(ordered.modify_index, SETTLE).await);
    assert_eq!(*c.get("h").unwrap(), *ordered);
    let poked = c
        .report_as(
            "h",
            vec![(side, event("Poke", t))],
            None,
            ordered.tasks[1].run,
        )
        .await
        .unwrap();
    assert_eq!(times(&poked, 0), times(&ordered, 0));
    assert_eq!(agent_events(&c, &poked), [format!("1 Poke {t}")]);
    assert!(a.wait_view(poked.modify_index, SETTLE).await);
    assert_eq!(*a.get("h").unwrap(), *poked);
    assert_eq!(agent_events(&a, &poked).len(), 13);
}

// ---- liveness over etcd (docs/replicas.md, "Liveness") ----

/// A task under `ttl`, alone in its allocation.
fn timed(ttl: Duration) -> AllocSpec {
    let mut web = task("web", None);
    web.liveness = Some(ttl);
    spec(vec![web])
}

/// etcd checks for expired leases every 500 ms: a lease is revoked up to
/// that long after its TTL.
const EXPIRY_CHECK: Duration = Duration::from_millis(500);

/// How long a replica that heard nothing waits, once the live key went,
/// before it declares the run lost (`registry::GRACE`: a replica that
/// heard the agent marks the run again first).
const GRACE: Duration = taskgate::registry::GRACE;

fn now() -> time::OffsetDateTime {
    time::OffsetDateTime::now_utc()
}

/// Waits (bounded) until replica `r` holds `alloc`'s `web` lost; the record.
async fn wait_lost(r: &Registry, alloc: &str) -> Arc<taskgate::lifecycle::Allocation> {
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(a) = r.get(alloc)
            && a.tasks[0].lost()
        {
            return a;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "{alloc}/web never lost"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The `Agent Lost` events of `alloc`'s `web` on `r`.
fn lost_events(r: &Registry, alloc: &str) -> usize {
    r.get(alloc).unwrap().tasks[0]
        .events
        .all()
        .iter()
        .filter(|e| e.kind == taskgate::lifecycle::LOST_EVENT)
        .count()
}

/// Registers `alloc` (web under `ttl`) through `r` and reports web running;
/// the record.
async fn run_timed(r: &Registry, alloc: &str, ttl: Duration) -> u64 {
    r.register(id(alloc), timed(ttl)).await.unwrap();
    let web = TaskName::parse("web").unwrap();
    r.report(alloc, vec![(web, report(RunState::Running, "up"))])
        .await
        .unwrap()
        .modify_index
}

/// An agent reports through replica A, heartbeats there, then goes
/// silent: the task is lost within its TTL and etcd's expiry check (its
/// lease expires; every replica's watch sees the live key go; one of them
/// wins the write), with exactly one `Agent Lost` event, the same on all
/// three replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_agent_s_task_is_lost_once_within_its_ttl_on_every_replica() {
    if !available("a_silent_agent_s_task_is_lost_once_within_its_ttl_on_every_replica") {
        return;
    }
    const TTL: Duration = Duration::from_secs(2);
    let cluster = Cluster::start(3);
    let prefix = "/l1/";
    let a = replica(cluster.endpoints(), prefix).await;
    let b = replica(cluster.endpoints(), prefix).await;
    let c = replica(cluster.endpoints(), prefix).await;
    run_timed(&a, "s1", TTL).await;
    // Heartbeats through A, each more than a third of the TTL apart (so
    // each renews the lease at once), for two TTLs.
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        a.heartbeat("s1", "web").unwrap();
    }
    let last = now();
    for r in [&a, &b, &c] {
        assert!(!r.get("s1").unwrap().tasks[0].lost(), "alive while heard");
    }
    let lost = wait_lost(&a, "s1").await;
    let at = lost.tasks[0].lost_at().unwrap();
    let took = at - last;
    assert!(took >= TTL, "lost {took} after the last sign of life");
    assert!(
        took <= TTL + GRACE + Duration::from_secs(1) + EXPIRY_CHECK,
        "lost {took} after the last sign of life: more than the TTL, the grace, a second and \
         etcd's expiry check"
    );
    for r in [&a, &b, &c] {
        assert!(r.wait_view(lost.modify_index, SETTLE).await);
        let seen = r.get("s1").unwrap();
        assert!(seen.tasks[0].lost());
        assert_eq!(seen.tasks[0].lost_at(), Some(at), "one decision");
        assert_eq!(lost_events(r, "s1"), 1);
    }
    // Decided once: nothing after it.
    tokio::time::sleep(TTL).await;
    assert_eq!(a.get("s1").unwrap().modify_index, lost.modify_index);
}

/// Signs of life sent only to replica B keep alive a task that replica A
/// made running and would otherwise time out; once they stop, it is lost
/// on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signs_of_life_through_one_replica_keep_a_task_alive_on_all() {
    if !available("signs_of_life_through_one_replica_keep_a_task_alive_on_all") {
        return;
    }
    const TTL: Duration = Duration::from_secs(2);
    let cluster = Cluster::start(3);
    let prefix = "/l2/";
    let a = replica(cluster.endpoints(), prefix).await;
    let b = replica(cluster.endpoints(), prefix).await;
    let running = run_timed(&a, "s2", TTL).await;
    assert!(b.wait_view(running, SETTLE).await);
    // Three TTLs of heartbeats through B only, then a parked long-poll on
    // B for two more.
    for _ in 0..9 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        b.heartbeat("s2", "web").unwrap();
    }
    let (seen, _) = b
        .wait_task("s2", "web", running, TTL * 2, true)
        .await
        .unwrap();
    assert_eq!(
        seen.modify_index, running,
        "the wait timed out: nothing changed"
    );
    let last = now();
    for r in [&a, &b] {
        assert!(
            !r.get("s2").unwrap().tasks[0].lost(),
            "alive for five TTLs while B heard it"
        );
    }
    let lost = wait_lost(&a, "s2").await;
    let took = lost.tasks[0].lost_at().unwrap() - last;
    assert!(took >= TTL, "lost {took} after the last sign of life");
    assert!(
        took <= TTL + GRACE + Duration::from_secs(1) + EXPIRY_CHECK,
        "lost {took} after it"
    );
    assert!(b.wait_view(lost.modify_index, SETTLE).await);
    assert_eq!(lost_events(&b, "s2"), 1);
}

/// A replica restarted while a task's agent is silent does not restart
/// its clock: the task is lost one TTL after its last sign of life, not
/// one TTL after the restart, even when the replica that heard the agent
/// is gone too and only replicas started since are left (unlike the disk
/// store, where a restart gives every task a full TTL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_restarted_during_a_ttl_does_not_restart_its_clock() {
    if !available("a_replica_restarted_during_a_ttl_does_not_restart_its_clock") {
        return;
    }
    const TTL: Duration = Duration::from_secs(4);
    let cluster = Cluster::start(3);
    let prefix = "/l3/";
    let a = replica(cluster.endpoints(), prefix).await;
    let b = replica(cluster.endpoints(), prefix).await;
    let running = run_timed(&a, "s3", TTL).await;
    assert!(b.wait_view(running, SETTLE).await);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    b.heartbeat("s3", "web").unwrap();
    let last = now();
    // Half a TTL later both replicas go (B, which heard the agent, and A)
    // and two new ones start.
    tokio::time::sleep(TTL / 2).await;
    drop(a);
    drop(b);
    let restarted = now();
    let c = replica(cluster.endpoints(), prefix).await;
    let d = replica(cluster.endpoints(), prefix).await;
    assert!(!c.get("s3").unwrap().tasks[0].lost(), "not lost yet");
    let lost = wait_lost(&c, "s3").await;
    let at = lost.tasks[0].lost_at().unwrap();
    assert!(at - last >= TTL, "lost {} after the last sign", at - last);
    assert!(
        at - last <= TTL + GRACE + Duration::from_secs(1) + EXPIRY_CHECK,
        "lost {} after the last sign of life",
        at - last
    );
    assert!(
        at < restarted + TTL,
        "the restart gave the task a new TTL: lost {} after it",
        at - restarted
    );
    assert!(d.wait_view(lost.modify_index, SETTLE).await);
    assert_eq!(lost_events(&d, "s3"), 1);
}

/// The member a replica's lease keep-alive stream is on stops answering
/// (SIGSTOP; a follower, so etcd's leader keeps counting the leases down)
/// while its agent gives signs of life at its own pace, three a TTL: the
/// replica moves its renewals to another member before the lease runs
/// out (a renewal waits at most a third of the shortest TTL for its
/// answer), and the task is never lost. Tried three times, on a fresh replica each: where the stream moves after the
/// TTL, a lease expires in most tries, as etcd's expiry check falls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_keep_alive_member_loses_no_live_task() {
    if !available("a_paused_keep_alive_member_loses_no_live_task") {
        return;
    }
    // etcd's shortest lease in the test cluster (elections of 500 ms).
    const TTL: Duration = Duration::from_secs(1);
    let mut cluster = Cluster::start(3);
    let leader = cluster.leader();
    let f = (leader + 1) % 3;
    let g = (leader + 2) % 3;
    let all = cluster.endpoints();
    // A starts on follower `f` (its stream opens there); B stays off it.
    let on_f = vec![all[f].clone(), all[g].clone(), all[leader].clone()];
    let off_f = vec![all[leader].clone(), all[g].clone(), all[f].clone()];
    let prefix = "/l4/";
    let b = replica(off_f, prefix).await;
    let web = TaskName::parse("web").unwrap();
    for trial in 0..3 {
        let alloc = format!("k{trial}");
        let a = replica(on_f.clone(), prefix).await;
        let running = run_timed(&a, &alloc, TTL).await;
        assert!(b.wait_view(running, SETTLE).await);
        let mut beats = tokio::time::interval(TTL / 3);
        // A TTL of signs of life answered on `f`, then `f` stops.
        for _ in 0..3 {
            beats.tick().await;
            a.heartbeat(&alloc, "web").unwrap();
        }
        cluster.pause(f);
        // Four TTLs of signs of life through A while `f` is stopped: 503
        // while a renewal waits past its deadline (the stream moving),
        // taken again once it moved.
        let mut taken = Vec::new();
        for _ in 0..12 {
            beats.tick().await;
            let heard = a.heartbeat(&alloc, "web");
            let seen = b.get(&alloc).unwrap();
            assert!(
                matches!(
                    heard,
                    Ok(_) | Err(RegistryError::Unrenewed { .. } | RegistryError::LeaseEnded { .. })
                ) && !seen.tasks[0].lost(),
                "try {trial}: a live task was lost while the member its lease's renewals \
                 went to was stopped (heartbeat answered: {:?})",
                heard.err()
            );
            taken.push(heard.is_ok());
        }
        assert!(
            taken[6..].iter().all(|&t| t),
            "try {trial}: heartbeats not taken two TTLs after the stream moved: {taken:?}"
        );
        cluster.resume(f);
        cluster.wait_healthy(SETTLE);
        // Its agent finishes: no lost decision left behind.
        let done = a
            .report(&alloc, vec![(web.clone(), report(RunState::Dead, "done"))])
            .await
            .unwrap();
        assert!(b.wait_view(done.modify_index, SETTLE).await);
        assert!(!b.get(&alloc).unwrap().tasks[0].lost());
    }
}

/// The watch that follows the prefix, if it panics (here: in the follower
/// it hands a change to), is started again from the last revision it
/// handed over: the change arrives again, and the supervisor names the
/// task (`follower_restarted`, what health shows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_that_panics_is_started_again_from_where_it_was() {
    use std::sync::Mutex;

    use taskgate::store::{Change, Follower, Loaded, Op, Store, commit};
    use taskgate::supervise::Supervisor;

    if !available("a_watch_that_panics_is_started_again_from_where_it_was") {
        return;
    }
    /// Panics on the first change it is handed; keeps the IDs of the rest.
    #[derive(Default)]
    struct Once(Mutex<(bool, Vec<String>)>);
    impl Follower for Once {
        fn changed(&self, changes: Vec<Change>, _: u64) {
            let mut seen = self.0.lock().unwrap();
            for c in changes {
                if let Change::Put(a) = c {
                    if !std::mem::replace(&mut seen.0, true) {
                        drop(seen);
                        panic!("a test's panic in the follower");
                    }
                    seen.1.push(a.id.to_string());
                }
            }
        }
        fn resync(&self, _: Loaded) {}
    }
    let cluster = Cluster::start(1);
    let supervisor = Supervisor::new();
    let config = EtcdConfig {
        prefix: "/sup/".into(),
        ..EtcdConfig::new(cluster.endpoints())
    };
    let store = EtcdStore::connect_supervised(&config, supervisor.clone())
        .await
        .expect("connects");
    let follower = Arc::new(Once::default());
    let weak: std::sync::Weak<dyn Follower> =
        Arc::downgrade(&(follower.clone() as Arc<dyn Follower>));
    store.follow(store.load().unwrap().last_index, weak);
    let a = taskgate::lifecycle::Allocation::register(
        id("a1"),
        Arc::new(spec(vec![task("web", None)])),
        1,
        time::OffsetDateTime::now_utc(),
    );
    commit(&store, Op::Put(Arc::new(a))).await.unwrap();
    let deadline = tokio::time::Instant::now() + SETTLE;
    while follower.0.lock().unwrap().1.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never handed over again"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(follower.0.lock().unwrap().1, ["a1"]);
    assert_eq!(supervisor.problems(), ["follower_restarted"]);
}

// ---- semaphores in the etcd store ----

mod semaphores {
    use super::*;
    use taskgate::{
        lifecycle::{Allocation, SemName, Semaphore},
        store::{Append, AppendError, Change, Follower, Loaded, Op, Store, commit},
    };
    use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

    /// The index a change is decided with: above every other in it.
    const PLACEHOLDER: u64 = u64::MAX;

    /// Sends every change it is handed down a channel.
    struct Changes(UnboundedSender<Change>);

    impl Follower for Changes {
        fn changed(&self, changes: Vec<Change>, _: u64) {
            for c in changes {
                let _ = self.0.send(c);
            }
        }
        fn resync(&self, _: Loaded) {}
    }

    /// A replica's store on `prefix`, what it listed, and the changes its
    /// watch hands over (the follower kept alive with them).
    struct Replica {
        store: EtcdStore,
        listed: Loaded,
        changes: UnboundedReceiver<Change>,
        /// Changes handed over that no `next` took yet, in order.
        kept: std::collections::VecDeque<Change>,
        _follower: Arc<Changes>,
    }

    async fn connect(endpoints: Vec<String>, prefix: &str) -> Replica {
        let config = EtcdConfig {
            prefix: prefix.into(),
            ..EtcdConfig::new(endpoints)
        };
        let store = EtcdStore::connect(&config).await.expect("connects");
        let listed = store.load().unwrap();
        let (tx, changes) = unbounded_channel();
        let follower = Arc::new(Changes(tx));
        let weak: std::sync::Weak<dyn Follower> =
            Arc::downgrade(&(follower.clone() as Arc<dyn Follower>));
        store.follow(listed.last_index, weak);
        Replica {
            store,
            listed,
            changes,
            kept: Default::default(),
            _follower: follower,
        }
    }

    impl Replica {
        /// The first change its watch handed over that `pick` takes and no
        /// earlier call took (the others are kept for later calls).
        async fn next(&mut self, pick: impl Fn(&Change) -> bool) -> Change {
            if let Some(at) = self.kept.iter().position(&pick) {
                return self.kept.remove(at).unwrap();
            }
            tokio::time::timeout(SETTLE, async {
                loop {
                    let c = self.changes.recv().await.expect("the watch runs");
                    if pick(&c) {
                        return c;
                    }
                    self.kept.push_back(c);
                }
            })
            .await
            .expect("the change within SETTLE")
        }

        /// The next change of a semaphore its watch hands over.
        async fn next_semaphore(&mut self) -> Change {
            self.next(|c| matches!(c, Change::PutSemaphore(_) | Change::DeleteSemaphore { .. }))
                .await
        }

        /// The next allocation its watch hands over.
        async fn next_put(&mut self) -> Arc<Allocation> {
            match self.next(|c| matches!(c, Change::Put(_))).await {
                Change::Put(a) => a,
                _ => unreachable!("picked a put"),
            }
        }

        async fn append(
            &self,
            op: Op,
            expect: u64,
            grants: Vec<Arc<Semaphore>>,
        ) -> Result<u64, AppendError> {
            self.store
                .append(Append {
                    op,
                    expect,
                    live: Vec::new(),
                    grants,
                })
                .done
                .await
        }
    }

    fn semaphore(name: &str, limit: u32, create_index: u64, modify_index: u64) -> Semaphore {
        Semaphore {
            name: SemName::parse(name).unwrap(),
            limit,
            grant_timeout: Duration::from_secs(45),
            create_index,
            modify_index,
        }
    }

    fn create(name: &str, limit: u32) -> Op {
        Op::PutSemaphore(Arc::new(semaphore(name, limit, PLACEHOLDER, PLACEHOLDER)))
    }

    fn put_semaphore(change: Change) -> Arc<Semaphore> {
        match change {
            Change::PutSemaphore(s) => s,
            other => panic!("not a semaphore's put: {other:?}"),
        }
    }

    /// A registered allocation, as its registration is appended.
    fn registration(alloc: &str) -> Op {
        Op::Put(Arc::new(Allocation::register(
            id(alloc),
            Arc::new(spec(vec![task("web", None)])),
            PLACEHOLDER,
            time::OffsetDateTime::now_utc(),
        )))
    }

    /// The next version of `a`, as a change decided on it is appended.
    fn next(a: &Allocation) -> Op {
        let mut a = a.clone();
        a.modify_index = PLACEHOLDER;
        Op::Put(Arc::new(a))
    }

    /// Created on one replica, changed on another, deleted on the first:
    /// each watched by the other with its revision, and listed by a
    /// replica that starts after it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_semaphore_put_on_one_replica_is_watched_and_listed_by_another() {
        if !available("a_semaphore_put_on_one_replica_is_watched_and_listed_by_another") {
            return;
        }
        let cluster = Cluster::start(1);
        let mut a = connect(cluster.endpoints(), "/s1/").await;
        let mut b = connect(cluster.endpoints(), "/s1/").await;
        assert!(a.listed.semaphores.is_empty());

        let created = commit(&a.store, create("db", 2)).await.unwrap();
        let seen = put_semaphore(b.next_semaphore().await);
        assert_eq!(*seen, semaphore("db", 2, created, created));
        assert_eq!(*put_semaphore(a.next_semaphore().await), *seen);
        let c = connect(cluster.endpoints(), "/s1/").await;
        assert_eq!(c.listed.semaphores, [semaphore("db", 2, created, created)]);
        assert!(c.listed.last_index >= created);

        let changed = b
            .append(
                Op::PutSemaphore(Arc::new(semaphore("db", 5, created, PLACEHOLDER))),
                created,
                Vec::new(),
            )
            .await
            .unwrap();
        assert!(changed > created);
        let seen = put_semaphore(a.next_semaphore().await);
        assert_eq!(*seen, semaphore("db", 5, created, changed));

        let name = SemName::parse("db").unwrap();
        let deleted = a
            .append(Op::DeleteSemaphore(name.clone()), changed, Vec::new())
            .await
            .unwrap();
        b.next_semaphore().await; // the change
        match b.next_semaphore().await {
            Change::DeleteSemaphore { name: n, index } => {
                assert_eq!((n, index), (name, deleted));
            }
            other => panic!("not the deletion: {other:?}"),
        }
        let d = connect(cluster.endpoints(), "/s1/").await;
        assert!(d.listed.semaphores.is_empty());
        assert!(d.listed.last_index >= deleted);
    }

    /// A put of an allocation that grants a semaphore commits only while
    /// the semaphore is at the revision the grant was decided on, and
    /// moves it: a second grant decided on the same view (another
    /// replica's) is refused as a conflict whose index shows the moved
    /// semaphore, and one decided on its current revision commits.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_grant_decided_on_a_stale_semaphore_conflicts_one_on_its_current_revision_commits() {
        if !available(
            "a_grant_decided_on_a_stale_semaphore_conflicts_one_on_its_current_revision_commits",
        ) {
            return;
        }
        let cluster = Cluster::start(1);
        let mut endpoints = cluster.endpoints();
        let mut a = connect(endpoints.clone(), "/s2/").await;
        endpoints.reverse();
        let mut b = connect(endpoints, "/s2/").await;
        let created = commit(&a.store, create("db", 1)).await.unwrap();
        commit(&a.store, registration("x")).await.unwrap();
        commit(&a.store, registration("y")).await.unwrap();
        let view = put_semaphore(b.next_semaphore().await);
        assert_eq!(view.modify_index, created);
        let (x, y) = (b.next_put().await, b.next_put().await);
        a.next_semaphore().await;

        // Both replicas grant the one slot, each on the same view of it.
        let granted = a
            .append(next(&x), x.modify_index, vec![view.clone()])
            .await
            .unwrap();
        let refused = b.append(next(&y), y.modify_index, vec![view.clone()]).await;
        let Err(AppendError::Conflict { seen }) = refused else {
            panic!("the second grant on one view took: {refused:?}");
        };
        assert!(seen >= granted, "{seen} < {granted}");

        // The grant wrote the semaphore again: unchanged but for its
        // revision, which a replica's view follows up to `seen`.
        let moved = put_semaphore(b.next_semaphore().await);
        assert_eq!(*moved, semaphore("db", 1, created, granted));
        let x_granted = b.next_put().await;
        assert_eq!(x_granted.modify_index, granted, "x's grant");
        assert_eq!(*put_semaphore(a.next_semaphore().await), *moved);
        let c = connect(cluster.endpoints(), "/s2/").await;
        assert_eq!(c.listed.semaphores, [(*moved).clone()]);
        let y_now = c.listed.allocations.iter().find(|a| a.id.as_str() == "y");
        assert_eq!(
            y_now.unwrap().modify_index,
            y.modify_index,
            "the refused grant wrote nothing"
        );

        // Decided again on the semaphore as it is now: it commits, and
        // moves it again.
        let again = b
            .append(next(&y), y.modify_index, vec![moved.clone()])
            .await
            .unwrap();
        assert!(again > granted);
        assert_eq!(
            *put_semaphore(a.next_semaphore().await),
            semaphore("db", 1, created, again)
        );

        // The record, then the semaphore, changed since a grant was
        // decided on both: the conflict's index shows the semaphore too.
        let y_granted = b.next_put().await;
        assert_eq!(y_granted.modify_index, again);
        let y_moved = a.append(next(&y_granted), again, Vec::new()).await.unwrap();
        let sem_moved = a
            .append(
                Op::PutSemaphore(Arc::new(semaphore("db", 2, created, PLACEHOLDER))),
                again,
                Vec::new(),
            )
            .await
            .unwrap();
        assert!(sem_moved > y_moved);
        let stale = Arc::new(semaphore("db", 1, created, again));
        let refused = b.append(next(&y_granted), again, vec![stale]).await;
        assert!(
            matches!(refused, Err(AppendError::Conflict { seen }) if seen >= sem_moved),
            "{refused:?}"
        );

        // A semaphore deleted since the grant was decided: refused too.
        let deleted = a
            .append(
                Op::DeleteSemaphore(SemName::parse("db").unwrap()),
                sem_moved,
                Vec::new(),
            )
            .await
            .unwrap();
        let latest = Arc::new(semaphore("db", 2, created, sem_moved));
        let refused = a
            .append(next(&x_granted), x_granted.modify_index, vec![latest])
            .await;
        assert!(
            matches!(refused, Err(AppendError::Conflict { seen }) if seen >= deleted),
            "{refused:?}"
        );
    }

    /// Semaphores are written by compare-and-swap on their revision: a
    /// second creation of one conflicts (at the first's revision), and so
    /// do a change and a deletion decided on a revision it is no longer at.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_semaphore_created_twice_or_changed_on_a_stale_revision_conflicts() {
        if !available("a_semaphore_created_twice_or_changed_on_a_stale_revision_conflicts") {
            return;
        }
        let cluster = Cluster::start(1);
        let mut a = connect(cluster.endpoints(), "/s3/").await;
        let b = connect(cluster.endpoints(), "/s3/").await;
        let first = commit(&a.store, create("db", 2)).await.unwrap();
        let second = commit(&b.store, create("db", 3)).await;
        assert!(
            matches!(second, Err(AppendError::Conflict { seen }) if seen == first),
            "{second:?}"
        );
        let changed = b
            .append(
                Op::PutSemaphore(Arc::new(semaphore("db", 4, first, PLACEHOLDER))),
                first,
                Vec::new(),
            )
            .await
            .unwrap();
        let stale = a
            .append(
                Op::PutSemaphore(Arc::new(semaphore("db", 9, first, PLACEHOLDER))),
                first,
                Vec::new(),
            )
            .await;
        assert!(
            matches!(stale, Err(AppendError::Conflict { seen }) if seen == changed),
            "{stale:?}"
        );
        let name = SemName::parse("db").unwrap();
        let stale = a
            .append(Op::DeleteSemaphore(name.clone()), first, Vec::new())
            .await;
        assert!(
            matches!(stale, Err(AppendError::Conflict { seen }) if seen == changed),
            "{stale:?}"
        );
        // Only the first creation and the change took.
        assert_eq!(
            *put_semaphore(a.next_semaphore().await),
            semaphore("db", 2, first, first)
        );
        assert_eq!(
            *put_semaphore(a.next_semaphore().await),
            semaphore("db", 4, first, changed)
        );
        let deleted = a
            .append(Op::DeleteSemaphore(name.clone()), changed, Vec::new())
            .await
            .unwrap();
        // Gone: a deletion decided on it conflicts, at a revision past it.
        let again = b
            .append(Op::DeleteSemaphore(name), changed, Vec::new())
            .await;
        assert!(
            matches!(again, Err(AppendError::Conflict { seen }) if seen >= deleted),
            "{again:?}"
        );
    }

    /// A semaphore's record this build cannot read (here, of a format from
    /// the future) degrades health and is kept out of the view, listed or
    /// watched (handed over as a deletion); a readable record written
    /// over it (compared on the unreadable one's revision) clears both.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreadable_semaphore_record_is_left_out_of_the_view_and_degrades_health() {
        if !available("an_unreadable_semaphore_record_is_left_out_of_the_view_and_degrades_health")
        {
            return;
        }
        let cluster = Cluster::start(1);
        let endpoints = cluster.endpoints();
        let mut a = connect(endpoints.clone(), "/s4/").await;
        let made = commit(&a.store, create("db", 2)).await.unwrap();
        a.next_semaphore().await;
        let raw = Client::new(&EtcdConfig::new(endpoints.clone())).unwrap();
        let Swapped::Done(spoiled) = raw
            .swap(b"/s4/sem/db", Some(&[0x82, 1, 2, 3]), made)
            .await
            .unwrap()
        else {
            panic!("the record moved")
        };
        match a.next_semaphore().await {
            Change::DeleteSemaphore { name, index } => {
                assert_eq!((name.as_str(), index), ("db", spoiled));
            }
            other => panic!("not left out of the view: {other:?}"),
        }
        assert_eq!(
            a.store.health(),
            StoreHealth::Degraded(vec!["records_unreadable"])
        );
        let b = connect(endpoints, "/s4/").await;
        assert!(b.listed.semaphores.is_empty());
        assert_eq!(
            b.store.health(),
            StoreHealth::Degraded(vec!["records_unreadable"])
        );

        let mended = a
            .append(
                Op::PutSemaphore(Arc::new(semaphore("db", 7, made, PLACEHOLDER))),
                spoiled,
                Vec::new(),
            )
            .await
            .unwrap();
        assert_eq!(
            *put_semaphore(a.next_semaphore().await),
            semaphore("db", 7, made, mended)
        );
        assert_eq!(a.store.health(), StoreHealth::Ok);
    }
}

/// Barriers through three replicas (SEMANTICS "Barriers"; decided once on
/// the anchor, the first-registered member, and followed by every other
/// member by a write of its own): members registered, arriving and waited
/// on through different replicas.
mod barriers {
    use super::*;
    use taskgate::{
        lifecycle::{Allocation, BarrierSpec, Meet, SemName, StopKind},
        registry::{BarrierPhase, timeline::What},
    };

    /// A main task `worker` at barrier `name` of `size`, behind a prestart
    /// sidecar `side` (it arrives once `side` runs) when `gated`.
    fn member(name: &str, size: u16, timeout: Duration, gated: bool) -> AllocSpec {
        let worker = TaskSpec {
            barrier: Some(BarrierSpec {
                name: SemName::parse(name).unwrap(),
                size,
                timeout: Some(timeout),
            }),
            ..task("worker", None)
        };
        let mut tasks = vec![worker];
        if gated {
            let side = TaskSpec {
                lifecycle: Some(Lifecycle {
                    hook: Hook::Prestart,
                    sidecar: true,
                }),
                ..task("side", None)
            };
            tasks.insert(0, side);
        }
        spec(tasks)
    }

    /// The position of `worker` in `a`.
    fn worker(a: &Allocation) -> usize {
        a.position("worker").unwrap()
    }

    /// `alloc` as `r` holds it once `worker`'s barrier decided for it
    /// (bounded).
    async fn decided(r: &Registry, alloc: &str) -> Arc<Allocation> {
        let a = r
            .wait_until(alloc, SETTLE, |a| {
                a.tasks[worker(a)].meet().is_some_and(Meet::decided)
            })
            .await
            .unwrap();
        assert!(
            a.tasks[worker(&a)].meet().is_some_and(Meet::decided),
            "{alloc}'s barrier decided nothing for it within {SETTLE:?}: {:?}",
            a.tasks[worker(&a)].meet()
        );
        a
    }

    /// `a`'s timeline entries about its barrier: (opened, timed out, stop
    /// orders "Barrier Timeout").
    fn barrier_entries(r: &Registry, a: &Allocation) -> (usize, usize, usize) {
        let (mut open, mut closed, mut stop) = (0, 0, 0);
        for e in r.timeline(a) {
            match e.what {
                What::Barrier { opened: true, .. } => open += 1,
                What::Barrier { opened: false, .. } => closed += 1,
                What::StopOrder {
                    reason: StopKind::BarrierTimeout,
                    ..
                } => stop += 1,
                _ => {}
            }
        }
        (open, closed, stop)
    }

    /// Six members, each registered through one replica, its worker's
    /// start-condition poll parked on the next and its sidecar reported
    /// running through the third. The last arrival, through one replica,
    /// releases the polls parked on all three; every replica then holds
    /// every member passed at one time, with one "Barrier Open" in its
    /// timeline and no "Barrier Timeout".
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn members_through_three_replicas_are_released_together_on_every_replica() {
        if !available("members_through_three_replicas_are_released_together_on_every_replica") {
            return;
        }
        const SIZE: usize = 6;
        let cluster = Cluster::start(3);
        let mut replicas = Vec::new();
        for _ in 0..3 {
            replicas.push(replica(cluster.endpoints(), "/bar/").await);
        }
        let alloc = |k: usize| format!("gang-{k}");
        for k in 0..SIZE {
            let s = member("train", SIZE as u16, Duration::from_secs(600), true);
            replicas[k % 3].register(id(&alloc(k)), s).await.unwrap();
        }
        let last = replicas.iter().map(Registry::last_index).max().unwrap();
        let mut parked = Vec::new();
        for k in 0..SIZE {
            let r = replicas[(k + 1) % 3].clone();
            assert!(r.wait_view(last, SETTLE).await);
            parked.push(tokio::spawn(async move {
                r.wait_start(&alloc(k), "worker", Duration::from_secs(60), true)
                    .await
            }));
        }
        for r in &replicas {
            common::parked(r, SIZE / 3).await;
        }
        let side = TaskName::parse("side").unwrap();
        for k in 0..SIZE - 1 {
            replicas[(k + 2) % 3]
                .report(&alloc(k), vec![(side.clone(), running())])
                .await
                .unwrap();
        }
        // Every replica counts the five, and holds the barrier shut.
        for (n, r) in replicas.iter().enumerate() {
            let mut index = 0;
            for _ in 0..100 {
                let b = r.wait_barrier("train", index, SETTLE).await.unwrap();
                if matches!(b.phase, BarrierPhase::Gathering { arrived: 5, .. }) {
                    break;
                }
                assert!(
                    matches!(b.phase, BarrierPhase::Gathering { .. }),
                    "replica {n}: {:?} with 5 of {SIZE} arrived",
                    b.phase
                );
                index = b.changed;
            }
            let b = r.barrier("train").unwrap();
            assert!(
                matches!(b.phase, BarrierPhase::Gathering { arrived: 5, .. }),
                "replica {n}: {:?}",
                b.phase
            );
        }
        assert!(
            parked.iter().all(|p| !p.is_finished()),
            "no poll is answered before the last arrival"
        );

        // The last arrival, through replica 1.
        replicas[1]
            .report(&alloc(SIZE - 1), vec![(side, running())])
            .await
            .unwrap();
        for (k, p) in parked.into_iter().enumerate() {
            let (a, i) = tokio::time::timeout(SETTLE, p)
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "{}'s poll on replica {} was not woken",
                        alloc(k),
                        (k + 1) % 3
                    )
                })
                .unwrap()
                .unwrap();
            assert!(a.allowed(i), "{} released", alloc(k));
        }

        let mut opened = Vec::new();
        for (n, r) in replicas.iter().enumerate() {
            for k in 0..SIZE {
                let a = decided(r, &alloc(k)).await;
                match a.tasks[worker(&a)].meet() {
                    Some(Meet::Passed { at }) => opened.push(at),
                    other => panic!("replica {n}: {} stands {other:?}", alloc(k)),
                }
                assert_eq!(
                    barrier_entries(r, &a),
                    (1, 0, 0),
                    "replica {n}: {}'s timeline has one Barrier Open and no Barrier Timeout",
                    alloc(k)
                );
            }
            match r.barrier("train").unwrap().phase {
                BarrierPhase::Open(at) => opened.push(at),
                other => panic!("replica {n}: the barrier is {other:?}"),
            }
        }
        assert!(
            opened.windows(2).all(|w| w[0] == w[1]),
            "one opening, whichever replica wrote it: {opened:?}"
        );
    }

    /// A barrier of three with a timeout of one second: two members arrive
    /// through two replicas, and the third is registered through the
    /// third replica just before, at or just after the moment the timeout
    /// passes. Each round the barrier ends open for every member or timed
    /// out for every member (a third refused as `barrier_closed` only when
    /// it timed out), the same on every replica, and so does every
    /// member's timeline.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_timeout_racing_the_last_arrival_opens_for_all_or_times_out_for_all() {
        if !available("a_timeout_racing_the_last_arrival_opens_for_all_or_times_out_for_all") {
            return;
        }
        let cluster = Cluster::start(3);
        let mut replicas = Vec::new();
        for _ in 0..3 {
            replicas.push(replica(cluster.endpoints(), "/race/").await);
        }
        const TIMEOUT: Duration = Duration::from_secs(1);
        let (mut opened, mut timed_out) = (0, 0);
        // The last registration's start, from the moment the timeout
        // passes (milliseconds).
        for (round, offset) in [-40i64, -20, -10, -5, 0, 5, 10, 20, 40]
            .into_iter()
            .enumerate()
        {
            let name = format!("race-{round}");
            let alloc = |k: usize| format!("race-{round}-{k}");
            let s = member(&name, 3, TIMEOUT, false);
            let (first, _) = replicas[round % 3]
                .register(id(&alloc(0)), s.clone())
                .await
                .unwrap();
            let Some(Meet::Arrived { at }) = first.tasks[0].meet() else {
                panic!(
                    "a lone main task arrives as it registers: {:?}",
                    first.tasks[0].meet()
                );
            };
            replicas[(round + 1) % 3]
                .register(id(&alloc(1)), s.clone())
                .await
                .unwrap();
            // Real time: the timeout counts from the first arrival.
            let due = at + TIMEOUT + time::Duration::milliseconds(offset);
            let wait = (due - now()).try_into().unwrap_or(Duration::ZERO);
            tokio::time::sleep(wait).await;
            let third = replicas[(round + 2) % 3]
                .register(id(&alloc(2)), s.clone())
                .await;
            let members = match third {
                Ok(_) => 3,
                Err(RegistryError::BarrierClosed { .. }) => 2,
                Err(e) => panic!("round {round}: the third registration: {e}"),
            };
            let mut outcomes = Vec::new();
            for (n, r) in replicas.iter().enumerate() {
                for k in 0..members {
                    let a = decided(r, &alloc(k)).await;
                    let meet = a.tasks[0].meet().unwrap();
                    let entries = barrier_entries(r, &a);
                    match meet {
                        Meet::Passed { .. } => {
                            assert_eq!(
                                entries,
                                (1, 0, 0),
                                "round {round}, replica {n}, {}",
                                alloc(k)
                            );
                            assert!(a.allowed(0));
                        }
                        Meet::Closed { .. } => {
                            assert_eq!(
                                entries,
                                (0, 1, 1),
                                "round {round}, replica {n}, {}",
                                alloc(k)
                            );
                            assert!(!a.allowed(0) && a.order().is_stop());
                        }
                        Meet::Arrived { .. } => unreachable!("decided"),
                    }
                    outcomes.push(meet);
                }
                let phase = r.barrier(&name).unwrap().phase;
                outcomes.push(match phase {
                    BarrierPhase::Open(at) => Meet::Passed { at },
                    BarrierPhase::TimedOut(at) => Meet::Closed { at },
                    other => panic!("round {round}, replica {n}: {other:?}"),
                });
            }
            assert!(
                outcomes.windows(2).all(|w| w[0] == w[1]),
                "round {round} (offset {offset} ms, {members} members): one decision on every \
                 replica for every member: {outcomes:?}"
            );
            match outcomes[0] {
                Meet::Passed { .. } => {
                    assert_eq!(members, 3, "open with its three members");
                    opened += 1;
                }
                _ => timed_out += 1,
            }
        }
        eprintln!("the race ended open {opened} times and timed out {timed_out} times");
    }
}
