//! What a 2xx to a sign of life promises with replicas on a store with
//! leases (docs/replicas.md, "Slack: what a 204 promises"): the task is not
//! declared lost within its TTL after it, whatever the store does to the
//! run's lease, unless the replica that answered died or could not reach
//! the store. Each test puts a sign of life and another replica's lost
//! decision in one order, on `Held` with paused time.

use super::*;
use crate::lifecycle::{EventInput, UNTIL_TOLD};

/// Another replica, which heard nothing of `t1`'s web run, declares it
/// lost now, on the record as the store holds it: its compare-and-swap,
/// which holds only while web's live key is gone (as etcd's). True if it
/// committed.
fn lost_elsewhere(store: &Held, now: Timestamp) -> bool {
    let mut s = store.0.lock().unwrap();
    if s.live.contains_key(&("t1".to_string(), "web".to_string())) {
        s.refused_live += 1;
        return false;
    }
    let (index, a) = s.records.get("t1").unwrap().clone();
    let placeholder = index + 1;
    let Some(mut next) = a.tick_lapsed(
        now,
        &|_| Some(UNTIL_TOLD),
        &|_| a.tasks[0].started_at,
        None,
        || placeholder,
    ) else {
        return false;
    };
    s.revision += 1;
    let revision = s.revision;
    next.restamp(placeholder, revision);
    s.records.insert("t1".into(), (revision, next.clone()));
    s.hold(Change::Put(Arc::new(next)));
    s.apply_live(
        &a.id,
        vec![LiveOp::End {
            task: TaskName::parse("web").unwrap(),
            lapsed: true,
        }],
    );
    true
}

/// The answer of a report sent in `report`, while the store hands its
/// changes over a millisecond at a time (bounded: a second).
async fn answer_of<T: Send + 'static>(store: &Held, report: tokio::task::JoinHandle<T>) -> T {
    for _ in 0..1_000 {
        if report.is_finished() {
            return report.await.unwrap();
        }
        run_for(store, std::time::Duration::from_millis(1)).await;
    }
    panic!("the report was not answered within a second");
}

/// Asserts that no replica of `replicas` holds `t1`'s web lost.
fn not_lost(replicas: &[&Registry]) {
    for x in replicas {
        assert!(!x.get("t1").unwrap().tasks[0].lost(), "lost after a 2xx");
    }
}

fn revision(store: &Held) -> u64 {
    store.0.lock().unwrap().revision
}

/// A report of web running, with an event: a change of the record.
fn running_with_event() -> Vec<(TaskName, TaskReport)> {
    let mut r = running();
    r[0].1.event = Some(EventInput {
        kind: "Checked".into(),
        time: None,
        message: "still here".into(),
        details: Default::default(),
    });
    r
}

/// `reports` for `t1` through `r`, from the agent of web's current run.
async fn report(
    r: Registry,
    reports: Vec<(TaskName, TaskReport)>,
) -> Result<Arc<Allocation>, RegistryError> {
    let run = r.get("t1").unwrap().tasks[0].run;
    r.report_as("t1", reports, None, run).await
}

/// A replica on `store` (its wall clock on tokio's) with `default` as its
/// `--default-liveness-ttl`.
fn replica(store: &Arc<Held>, default: Option<std::time::Duration>) -> Registry {
    let config = RegistryConfig {
        clock: super::super::clock::Clock::tokio(),
        default_liveness_ttl: default,
        ..RegistryConfig::default()
    };
    Registry::open(store.clone(), config).unwrap()
}

/// The 2xx given to a sign of life heard while this replica's view holds
/// the run's live key gone, and the other replicas' lost decision: it may
/// commit before this replica's mark again (it is due at the end of their
/// grace, and the sign may come just before). A heartbeat is not
/// acknowledged then (503, its sign heard): the 204 would promise a TTL
/// that no lease carries yet.
#[tokio::test(start_paused = true)]
async fn a_heartbeat_answered_while_the_live_key_is_gone_is_not_followed_by_a_loss() {
    let (store, r) = open();
    timed_running(&store, &r).await;
    tokio::time::sleep(TTL * 2).await;
    lease_ends(&store);
    run_for(&store, GRACE / 2).await;
    let answer = r.heartbeat("t1", "web");
    // Another replica's decision commits before this one's mark again.
    assert!(lost_elsewhere(&store, r.now()));
    run_for(&store, GRACE * 3).await;
    assert!(r.get("t1").unwrap().tasks[0].lost());
    assert!(
        matches!(answer, Err(RegistryError::LeaseEnded { .. })),
        "a heartbeat answered {:?} while no lease carried it, and its task lost right after",
        answer.map(|_| "204")
    );
}

/// A report that changes the record, heard while this replica's view holds
/// the run's live key gone, commits with the run marked again (one
/// transaction): another replica's lost decision, decided on the record
/// the report wrote, is refused, however soon after it comes.
#[tokio::test(start_paused = true)]
async fn a_report_answered_while_the_live_key_is_gone_is_not_followed_by_a_loss() {
    let (store, r) = open();
    timed_running(&store, &r).await;
    tokio::time::sleep(TTL * 2).await;
    lease_ends(&store);
    run_for(&store, GRACE / 2).await;
    let before = revision(&store);
    let report = {
        let r = r.clone();
        tokio::spawn(report(r, running_with_event()))
    };
    for _ in 0..1_000 {
        if revision(&store) != before {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_ne!(revision(&store), before, "the report committed");
    let lost = lost_elsewhere(&store, r.now());
    let answer = answer_of(&store, report).await;
    run_for(&store, GRACE * 3).await;
    assert!(answer.is_ok(), "{answer:?}");
    assert!(!lost, "a lost decision on the report's record was taken");
    assert!(!r.get("t1").unwrap().tasks[0].lost());
    assert!(live_lease(&store).is_some(), "the run is marked again");
}

/// A report that changes the record, heard near the end of the other
/// replicas' grace: this replica's mark again, decided on the record
/// before the report, is refused by the report's own write; the run is
/// still marked again before the others decide.
#[tokio::test(start_paused = true)]
async fn a_report_near_the_end_of_the_grace_keeps_its_run() {
    let store = Arc::new(Held::default());
    let (r, o) = (replica(&store, None), replica(&store, None));
    timed_running(&store, &r).await;
    tokio::time::sleep(TTL * 2).await;
    lease_ends(&store);
    run_for(&store, GRACE - std::time::Duration::from_millis(100)).await;
    delivered(&store, report(r.clone(), running_with_event()))
        .await
        .unwrap();
    run_for(&store, GRACE * 3).await;
    not_lost(&[&r, &o]);
}

/// A report that changes nothing (a running task reported running again)
/// is answered once the store confirms the record it was decided on is the
/// newest; heard while the run's live key is gone, that confirmation is
/// the run marked again: the other replicas' lost decision, landing while
/// the mark is on its way, makes the report decided again (409
/// `task_lost`), not answered 2xx and followed by the loss.
#[tokio::test(start_paused = true)]
async fn a_report_that_changes_nothing_while_the_live_key_is_gone_is_not_followed_by_a_loss() {
    let (store, r) = open();
    timed_running(&store, &r).await;
    tokio::time::sleep(TTL * 2).await;
    lease_ends(&store);
    run_for(&store, GRACE / 2).await;
    // This replica's marks are slow to land.
    store.0.lock().unwrap().stalled = true;
    let before = revision(&store);
    let report = {
        let r = r.clone();
        tokio::spawn(report(r, running()))
    };
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    assert_eq!(revision(&store), before, "a report that changes nothing");
    // The others' decision lands meanwhile.
    assert!(lost_elsewhere(&store, r.now()));
    store.0.lock().unwrap().stalled = false;
    let answer = answer_of(&store, report).await;
    assert!(r.get("t1").unwrap().tasks[0].lost());
    assert!(
        matches!(answer, Err(RegistryError::TaskLost { .. })),
        "a report answered {:?}, and its task lost right after",
        answer.map(|_| "2xx")
    );
}

/// A replica whose `--default-liveness-ttl` does not cover a task (another
/// replica's default started its run under a TTL: a rolling change of the
/// setting) renews the run's lease for the signs it hears, and counts them:
/// when the lease ends early, it marks the run again.
#[tokio::test(start_paused = true)]
async fn a_replica_without_the_task_s_ttl_marks_again_a_run_it_heard() {
    let store = Arc::new(Held::default());
    let (o, r) = (replica(&store, Some(TTL)), replica(&store, None));
    let oo = o.clone();
    delivered(&store, async move {
        oo.register(AllocId::parse("t1").unwrap(), web())
            .await
            .unwrap()
    })
    .await;
    let oo = o.clone();
    delivered(
        &store,
        async move { oo.report("t1", running()).await.unwrap() },
    )
    .await;
    assert_eq!(live_lease(&store), Some(1), "under the other's default");
    tokio::time::sleep(TTL * 2).await;
    let before = renewals(&store).len();
    r.heartbeat("t1", "web").unwrap();
    assert_eq!(renewals(&store)[before..], [1], "renewed for the sign");
    tokio::time::sleep(TTL / 2).await;
    lease_ends(&store);
    run_for(&store, GRACE * 3).await;
    not_lost(&[&r, &o]);
    assert!(live_lease(&store).is_some_and(|l| l != 1), "marked again");
}

/// A mark again refused because the record moved (another replica's
/// write landed between this view and the store) is tried again as soon
/// as the view holds the change that refused it: the other replicas
/// decide the run lost `GRACE` after they saw its live key go, and a
/// replica that waits a fixed pause after each refusal runs out of it
/// when writes keep landing.
#[tokio::test(start_paused = true)]
async fn a_mark_again_refused_by_record_changes_is_tried_again_within_the_grace() {
    let store = Arc::new(Held::default());
    let (r, o) = (replica(&store, None), replica(&store, None));
    timed_running(&store, &r).await;
    tokio::time::sleep(TTL / 2).await;
    r.heartbeat("t1", "web").unwrap();
    // The next five marks each lose to a change of the record.
    store.0.lock().unwrap().racing = 5;
    lease_ends(&store);
    run_for(&store, GRACE * 3).await;
    not_lost(&[&r, &o]);
    assert_eq!(store.0.lock().unwrap().racing, 0, "five marks refused");
    assert!(live_lease(&store).is_some(), "marked again");
}

/// A heartbeat heard while this replica's view lags the live key's end
/// renews the lease it still knows (etcd has ended it: nothing to renew),
/// and is answered 204: once the view catches up, the run is marked again,
/// before the replicas that saw the key go first end their grace.
#[tokio::test(start_paused = true)]
async fn a_sign_heard_on_a_view_behind_the_key_s_end_marks_the_run_again_once_it_catches_up() {
    let store = Arc::new(Held::default());
    let (r, o) = (replica(&store, None), replica(&store, None));
    timed_running(&store, &r).await;
    tokio::time::sleep(TTL * 2).await;
    lease_ends(&store);
    // `o` sees the key go; `r` does not yet, and hears the agent.
    store.deliver_to(1, revision(&store));
    tokio::time::sleep(GRACE / 2).await;
    r.heartbeat("t1", "web").unwrap();
    assert_eq!(renewals(&store).last(), Some(&1), "the lease it knows");
    run_for(&store, GRACE * 3).await;
    not_lost(&[&r, &o]);
    assert!(live_lease(&store).is_some_and(|l| l != 1), "marked again");
}

/// A sign heard while this replica's mark again (for a sign heard before)
/// is on its way is answered 503, and renews the new lease once the view
/// holds it: that lease was granted before the sign, so without that
/// renewal it would end less than a TTL after it.
#[tokio::test(start_paused = true)]
async fn a_sign_heard_while_a_mark_again_is_on_its_way_renews_the_new_lease() {
    let (store, r) = open();
    timed_running(&store, &r).await;
    tokio::time::sleep(TTL / 2).await;
    r.heartbeat("t1", "web").unwrap();
    store.0.lock().unwrap().stalled = true;
    lease_ends(&store);
    run_for(&store, GRACE / 2).await;
    assert_eq!(live_lease(&store), None, "the mark again is on its way");
    let granted = store.0.lock().unwrap().leases;
    let answer = r.heartbeat("t1", "web").map(|_| ());
    assert!(
        matches!(answer, Err(RegistryError::LeaseEnded { .. })),
        "{answer:?}"
    );
    let before = renewals(&store).len();
    store.0.lock().unwrap().stalled = false;
    run_for(&store, std::time::Duration::from_millis(10)).await;
    assert_eq!(live_lease(&store), Some(granted), "marked again");
    assert_eq!(
        renewals(&store)[before..],
        [granted],
        "the new lease renewed for the sign heard while it was on its way"
    );
    r.heartbeat("t1", "web").unwrap();
}

/// Two tasks whose leases end at once (a resumed leader revokes every
/// lease), each heard within its TTL by another replica: each replica
/// marks again the run it heard, and neither replica's lost decision
/// takes the run the other heard.
#[tokio::test(start_paused = true)]
async fn two_runs_whose_leases_end_at_once_are_each_marked_again_by_the_replica_that_heard_it() {
    let store = Arc::new(Held::default());
    let (r, o) = (replica(&store, None), replica(&store, None));
    let spec = || {
        let tasks = ["web", "db"].map(|n| {
            let mut t = TaskSpec::named(TaskName::parse(n).unwrap());
            t.liveness = Some(TTL);
            t
        });
        AllocSpec::new(tasks.to_vec(), &Limits::default()).unwrap()
    };
    let rr = r.clone();
    delivered(&store, async move {
        rr.register(AllocId::parse("t1").unwrap(), spec())
            .await
            .unwrap()
    })
    .await;
    let rr = r.clone();
    delivered(&store, async move {
        let mut both = running();
        both.push((TaskName::parse("db").unwrap(), both[0].1.clone()));
        rr.report("t1", both).await.unwrap()
    })
    .await;
    assert_eq!(store.0.lock().unwrap().live.len(), 2);
    tokio::time::sleep(TTL * 2).await;
    r.heartbeat("t1", "web").unwrap();
    o.heartbeat("t1", "db").unwrap();
    {
        let mut s = store.0.lock().unwrap();
        let keys: Vec<(String, String)> = s.live.keys().cloned().collect();
        s.live.clear();
        s.revision += 1;
        for (id, task) in keys {
            s.hold(Change::Liveness(Liveness::Live {
                id: AllocId::parse(&id).unwrap(),
                task: TaskName::parse(&task).unwrap(),
                lease: None,
            }));
        }
    }
    run_for(&store, GRACE * 3).await;
    for x in [&r, &o] {
        let a = x.get("t1").unwrap();
        assert!(!a.tasks[0].lost() && !a.tasks[1].lost(), "lost after a 204");
    }
    assert_eq!(store.0.lock().unwrap().live.len(), 2, "both marked again");
}

/// The report that began a run was answered 2xx: when the run's lease
/// ends early before any other sign, the replica that took that report
/// marks the run again.
#[tokio::test(start_paused = true)]
async fn a_run_whose_lease_ends_right_after_the_report_that_began_it_is_marked_again() {
    let store = Arc::new(Held::default());
    let (r, o) = (replica(&store, None), replica(&store, None));
    timed_running(&store, &r).await;
    tokio::time::sleep(GRACE).await;
    lease_ends(&store);
    run_for(&store, GRACE * 3).await;
    not_lost(&[&r, &o]);
}
