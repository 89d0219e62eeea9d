//! Our own history checker (issue 33, item 7): three `taskgate serve
//! --store etcd` replicas on a real three-member etcd, clients sending
//! reports with unique events through random replicas, and faults on a
//! schedule drawn from a seed — SIGKILL and SIGSTOP of replicas and of
//! members, lost quorum (killed, or paused with the leader for longer than
//! a TTL), the leader paused past a TTL, compaction, a member's answers to
//! a replica held back past its deadline (writes that commit unanswered).
//! Beside them, liveness agents heartbeat tasks under a 3 s TTL through
//! random replicas, some falling silent (`history/liveness.rs`). At the
//! end, with everything healed and every replica's view at etcd's
//! revision, the history is checked (`history/check.rs`): nothing
//! acknowledged lost, nothing twice, nothing that no one sent, real-time
//! order kept, the replicas identical and equal to etcd's revisions,
//! read-your-writes as docs/replicas.md promises; and liveness: no task
//! lost within its TTL after an answered heartbeat (outside the documented
//! slack), every silent task lost in time, `Agent Lost` once per run on
//! every replica.
//!
//! A tier of its own in `.ci/run` (about three minutes):
//! `cargo test --locked --test history -- --ignored`. The seed is printed;
//! `TASKGATE_HISTORY_SEED=<seed>` replays the same schedule and the same
//! client choices (the timings, and so the interleavings, differ). On a
//! violation the whole history, the final state and every process's log
//! are written to `$TASKGATE_CI_LOGS/history-<seed>/` (else
//! `target/tmp/history-<seed>/`).

#[path = "history/check.rs"]
mod check;
mod common;
#[path = "history/faults.rs"]
mod faults;
#[path = "history/liveness.rs"]
mod liveness;
#[path = "history/workload.rs"]
mod workload;

use std::{
    collections::{BTreeMap, BTreeSet},
    io::Write,
    path::PathBuf,
    process::{Command, Stdio},
    sync::{Arc, Mutex, atomic::AtomicBool},
    time::{Duration, Instant},
};

use common::{
    etcd::{Cluster, available},
    stall::Stall,
};
use faults::{PREFIX, Rig};
use serde_json::{Value, json};
use workload::{Outcome, Recorded, Shared, Worker};

/// Client workers: each one request at a time.
const WORKERS: usize = 6;

/// Each kind of fault this many times in a run; with the lengths
/// `faults::schedule` draws, about two minutes in all.
const ROUNDS: usize = 3;

/// How long the replicas may take, once everything is healed, to reach
/// etcd's revision and answer the same.
const CONVERGE: Duration = Duration::from_secs(60);

const REPLICAS: usize = 3;

/// Liveness agents (`liveness.rs`), and how many of them fall silent.
const LIVE_AGENTS: usize = 6;
const SILENT: usize = 2;

/// Says `line` where a reader of `cargo test`'s output sees it, passing or
/// not (`eprintln!` in a test is captured).
fn say(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

fn seed() -> u64 {
    match std::env::var("TASKGATE_HISTORY_SEED") {
        Ok(s) => s.trim().parse().expect("TASKGATE_HISTORY_SEED is a number"),
        Err(_) => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos();
            // Folded to a number one can type back.
            (nanos as u64 ^ u64::from(std::process::id())) % 1_000_000_000
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the history tier of .ci/run, about three minutes: cargo test --test history -- --ignored"]
async fn replicas_under_faults_keep_a_history_that_checks() {
    if !available("replicas_under_faults_keep_a_history_that_checks") {
        return;
    }
    let began = Instant::now();
    let seed = seed();
    say(&format!(
        "history: seed {seed} (TASKGATE_HISTORY_SEED={seed} replays its schedule)"
    ));
    let mut rng = fastrand::Rng::with_seed(seed);
    let steps = faults::schedule(&mut rng, ROUNDS, REPLICAS, 3);

    let cluster = tokio::task::block_in_place(|| Cluster::start(3));
    let stalls: Vec<_> = (0..REPLICAS)
        .map(|r| Stall::start(&cluster.endpoints()[r % 3]))
        .collect();
    let servers: Vec<_> = (0..REPLICAS)
        .map(|r| tokio::task::block_in_place(|| Rig::start_replica(&cluster, &stalls[r], r)))
        .collect();
    let shared = Arc::new(Shared {
        urls: Mutex::new(servers.iter().map(|s| s.base.clone()).collect()),
        stop: AtomicBool::new(false),
        start: Instant::now(),
        wall: time::OffsetDateTime::now_utc(),
        http: common::http(),
    });
    let mut rig = Rig {
        cluster,
        servers: servers.into_iter().map(Some).collect(),
        logs: vec![Vec::new(); REPLICAS],
        stalls,
        shared: shared.clone(),
    };
    assert!(
        rig.settle(Duration::from_secs(30)).await,
        "the replicas start healthy"
    );

    let workers: Vec<_> = (0..WORKERS)
        .map(|w| tokio::spawn(Worker::new(w, WORKERS, rng.u64(..), shared.clone()).run()))
        .collect();
    // Liveness agents: heartbeats every 0.5 s through random replicas,
    // to the end (past the final read), or until a moment drawn from the
    // seed for the first `SILENT`.
    let live_stop = Arc::new(AtomicBool::new(false));
    let agents: Vec<_> = (0..LIVE_AGENTS)
        .map(|k| {
            let silent = (k < SILENT).then(|| Duration::from_secs(rng.u64(15..=75)));
            tokio::spawn(liveness::agent(
                k,
                rng.u64(..),
                silent,
                shared.clone(),
                live_stop.clone(),
            ))
        })
        .collect();
    // Load before the first fault, as between the others.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let done = rig.run(&steps).await;
    shared.stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut recorded = Recorded::default();
    for w in workers {
        let mine = w.await.expect("a worker panicked");
        recorded.reports.extend(mine.reports);
        recorded.registrations.extend(mine.registrations);
        recorded.violations.extend(mine.violations);
        let (r, m) = (&mut recorded.reads, mine.reads);
        r.same_held += m.same_held;
        r.other_held += m.other_held;
        r.other_waited_out += m.other_waited_out;
        r.no_answer += m.no_answer;
        r.past_reach += m.past_reach;
    }
    let workload_ended = shared.now();

    for d in &done {
        say(&format!(
            "history: at {:6.1} s {} ({:.1} s); {}",
            d.began as f64 / 1e6,
            d.detail,
            (d.healed - d.began) as f64 / 1e6,
            match d.settled {
                Some(s) => format!("healthy {:.1} s after", (s - d.healed) as f64 / 1e6),
                None => "NOT healthy again within 30 s".into(),
            }
        ));
    }
    let mut violations = recorded.violations.clone();
    for d in done.iter().filter(|d| d.settled.is_none()) {
        violations.push(format!(
            "after \"{}\" (healed at {:.1} s) etcd and the replicas were not all healthy within \
             30 s (health recovers by itself: docs/replicas.md)",
            d.detail,
            d.healed as f64 / 1e6
        ));
    }

    // The silent agents' tasks lost (bounded: the check says whether in
    // time) before the final read.
    let silent: Vec<String> = (0..SILENT).map(|k| format!("live{k}")).collect();
    all_lost(&rig, &silent, CONVERGE).await;
    let fin = match converge(&rig).await {
        Ok(fin) => fin,
        Err(why) => {
            violations.push(format!(
                "the replicas did not converge within {CONVERGE:?} of the end: {why}"
            ));
            check::Final::default()
        }
    };
    live_stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut lives = Vec::new();
    for a in agents {
        lives.push(a.await.expect("a liveness agent panicked"));
    }
    let live_ids: BTreeSet<String> = lives.iter().map(|a| a.alloc.clone()).collect();
    if !fin.replicas.is_empty() {
        violations.extend(check::check(
            &recorded.reports,
            &recorded.registrations,
            &fin,
            &live_ids,
        ));
        violations.extend(liveness::check(&lives, &done, &fin.replicas, shared.wall));
    }

    let count =
        |f: &dyn Fn(&Outcome) -> bool| recorded.reports.iter().filter(|r| f(&r.outcome)).count();
    let retried = recorded
        .reports
        .iter()
        .filter(|r| r.attempts.len() > 1)
        .count();
    say(&format!(
        "history: {} reports in {:.1} s: {} acknowledged, {} refused, {} unknown; {} retried; \
         {} registrations answered; {} allocations; etcd at revision {}",
        recorded.reports.len(),
        workload_ended as f64 / 1e6,
        count(&|o| matches!(o, Outcome::Ok { .. })),
        count(&|o| matches!(o, Outcome::Failed { .. })),
        count(&|o| matches!(o, Outcome::Unknown)),
        retried,
        recorded.registrations.len(),
        fin.etcd.len(),
        fin.revision,
    ));
    // The faults did what they were for: watches lost and moved, views
    // listed again after a compaction.
    let logs = rig.all_logs();
    let lines = |what: &str| -> Vec<usize> {
        logs.iter()
            .map(|log| log.iter().filter(|l| l.contains(what)).count())
            .collect()
    };
    say(&format!(
        "history: each replica's watch lost {:?} times, listed again after a compaction {:?} \
         times, found a write whose answer was lost applied by its write mark {:?} times; of \
         the unknown reports, {} landed",
        lines("the watch on etcd is lost"),
        lines("the watch fell behind a compaction"),
        lines("a write whose answer was lost had been applied"),
        landed_unknown(&recorded, &fin),
    ));
    let beats: Vec<&liveness::Beat> = lives.iter().flat_map(|a| &a.beats).collect();
    // Heartbeats by how they were answered (`204`, `503`, `timeout`, ...).
    let mut answers: BTreeMap<&str, usize> = BTreeMap::new();
    for b in &beats {
        let how = b.result.split([' ', ':']).next().unwrap_or_default();
        *answers.entry(how).or_default() += 1;
    }
    let lost_tasks = fin.replicas.first().map_or(0, |allocs| {
        live_ids
            .iter()
            .filter(|id| {
                allocs
                    .get(*id)
                    .is_some_and(|a| a["tasks"][0]["lost"] == true)
            })
            .count()
    });
    say(&format!(
        "history: liveness: {} heartbeats, answered {answers:?}; {lost_tasks} of {LIVE_AGENTS} \
         tasks lost ({SILENT} fell silent); runs marked again after their lease ended early, by \
         replica: {:?}",
        beats.len(),
        lines("the lease of a run ended while this replica heard its agent"),
    ));
    let reads = &recorded.reads;
    say(&format!(
        "history: read-your-writes: {} held on the acknowledging replica, {} on another \
         (?index=W-1), {} waited out there, {} unanswered, {} writes answered past REACH_TIMEOUT",
        reads.same_held,
        reads.other_held,
        reads.other_waited_out,
        reads.no_answer,
        reads.past_reach
    ));
    say(&format!(
        "history: {} violations; {:.1} s in all",
        violations.len(),
        began.elapsed().as_secs_f64()
    ));

    if !violations.is_empty() {
        let dir = dump(seed, &rig, &recorded, &lives, &done, &fin, &violations);
        let shown: Vec<&String> = violations.iter().take(30).collect();
        panic!(
            "{} violations (seed {seed}; the history, the final state and the logs are in {}):\n{}",
            violations.len(),
            dir.display(),
            shown
                .iter()
                .map(|v| format!("- {v}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

/// Waits (bounded) until replica 0 holds each of `ids` lost.
async fn all_lost(rig: &Rig, ids: &[String], within: Duration) {
    let until = Instant::now() + within;
    for id in ids {
        while Instant::now() < until {
            let url = format!("{}/v1/allocations/{id}", rig.shared.url(0));
            if let Ok((200, _, body)) = get(rig, &url).await
                && body["tasks"][0]["lost"] == true
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// How many reports never acknowledged are in the final history.
fn landed_unknown(recorded: &Recorded, fin: &check::Final) -> usize {
    let Some(allocs) = fin.replicas.first() else {
        return 0;
    };
    recorded
        .reports
        .iter()
        .filter(|r| r.outcome == Outcome::Unknown)
        .filter(|r| {
            allocs
                .get(&r.alloc)
                .and_then(|a| workload::events_of(a, &r.task))
                .is_some_and(|e| e.contains(&r.message))
        })
        .count()
}

/// Waits (bounded) until every replica's view is at etcd's revision, then
/// reads what each replica and etcd hold; again if anything moved while it
/// read (a request a replica held may still land).
async fn converge(rig: &Rig) -> Result<check::Final, String> {
    let until = Instant::now() + CONVERGE;
    loop {
        let why = match snapshot(rig).await {
            Ok(fin) => return Ok(fin),
            Err(why) => why,
        };
        if Instant::now() >= until {
            return Err(why);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn snapshot(rig: &Rig) -> Result<check::Final, String> {
    let (revision, etcd) = tokio::task::block_in_place(|| etcd_keys(&rig.cluster))?;
    let at = views(rig).await?;
    if at.iter().any(|&v| v != revision) {
        return Err(format!(
            "the replicas' views are at {at:?}, etcd at revision {revision}"
        ));
    }
    let mut replicas = Vec::new();
    for r in 0..REPLICAS {
        replicas.push(allocations(rig, r).await?);
    }
    let (again, _) = tokio::task::block_in_place(|| etcd_keys(&rig.cluster))?;
    if again != revision || views(rig).await? != at {
        return Err(format!(
            "etcd moved from revision {revision} while it was read"
        ));
    }
    Ok(check::Final {
        replicas,
        etcd,
        revision,
    })
}

async fn get(rig: &Rig, url: &str) -> Result<(u16, reqwest::header::HeaderMap, Value), String> {
    let res = rig
        .shared
        .http
        .get(url)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let (status, headers) = (res.status().as_u16(), res.headers().clone());
    let body = res.json().await.map_err(|e| format!("{url}: {e}"))?;
    Ok((status, headers, body))
}

/// Each replica's view index (`/v1/health`).
async fn views(rig: &Rig) -> Result<Vec<u64>, String> {
    let mut out = Vec::new();
    for r in 0..REPLICAS {
        let url = format!("{}/v1/health", rig.shared.url(r));
        match get(rig, &url).await? {
            (200, _, body) => out.push(body["view"]["index"].as_u64().unwrap_or(0)),
            (status, _, body) => return Err(format!("replica {r}: {status} {body}")),
        }
    }
    Ok(out)
}

/// Every allocation replica `r` answers, by ID.
async fn allocations(rig: &Rig, r: usize) -> Result<BTreeMap<String, Value>, String> {
    let base = rig.shared.url(r);
    let mut ids = Vec::new();
    let mut next: Option<String> = None;
    for _ in 0..100 {
        let mut url = format!("{base}/v1/allocations?per_page=1000");
        if let Some(token) = &next {
            url.push_str(&format!("&next_token={token}"));
        }
        let (status, headers, body) = get(rig, &url).await?;
        if status != 200 {
            return Err(format!("replica {r}: {url}: {status} {body}"));
        }
        ids.extend(
            body.as_array()
                .into_iter()
                .flatten()
                .filter_map(|a| a["id"].as_str().map(str::to_owned)),
        );
        next = headers
            .get("x-taskgate-nexttoken")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        if next.is_none() {
            break;
        }
    }
    let mut out = BTreeMap::new();
    for id in ids {
        let url = format!("{base}/v1/allocations/{id}");
        match get(rig, &url).await? {
            (200, _, body) => {
                out.insert(id, check::strip(body));
            }
            (status, _, body) => return Err(format!("replica {r}: {url}: {status} {body}")),
        }
    }
    Ok(out)
}

/// etcd's revision and its allocation keys under the prefix (ID →
/// (create revision, mod revision)), through `etcdctl` (a linearizable
/// read).
fn etcd_keys(cluster: &Cluster) -> Result<(u64, check::Keys), String> {
    let keys = format!("{PREFIX}a/");
    let out = Command::new("etcdctl")
        .args(["--endpoints", &cluster.endpoints().join(",")])
        .args(["--command-timeout=5s", "get", "--prefix", &keys])
        .args(["--keys-only", "-w", "fields"])
        .env("ETCDCTL_API", "3")
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("etcdctl: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "etcdctl get: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    // `"Field" : value` lines: the header's, then each key's.
    let mut revision = None;
    let mut found = BTreeMap::new();
    let mut key: Option<String> = None;
    let mut create = 0;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some((field, value)) = line.split_once(" : ") else {
            continue;
        };
        let number = || {
            value
                .trim()
                .parse::<u64>()
                .map_err(|e| format!("{line}: {e}"))
        };
        match field.trim().trim_matches('"') {
            "Revision" => revision = Some(number()?),
            "Key" => {
                let k = value.trim().trim_matches('"');
                key = Some(k.strip_prefix(&keys).unwrap_or(k).to_owned());
            }
            "CreateRevision" => create = number()?,
            "ModRevision" => {
                let id = key.take().ok_or_else(|| format!("{line} before a key"))?;
                found.insert(id, (create, number()?));
            }
            _ => {}
        }
    }
    let revision = revision.ok_or("no revision in etcdctl's answer")?;
    Ok((revision, found))
}

/// Writes everything a reader of a failure needs; returns the directory.
fn dump(
    seed: u64,
    rig: &Rig,
    recorded: &Recorded,
    lives: &[liveness::Agent],
    done: &[faults::Done],
    fin: &check::Final,
    violations: &[String],
) -> PathBuf {
    let root = std::env::var_os("TASKGATE_CI_LOGS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    let dir = root.join(format!("history-{seed}"));
    std::fs::create_dir_all(&dir).expect("the history's directory");
    let write = |name: &str, text: String| {
        std::fs::write(dir.join(name), text).expect("the history is written");
    };
    let mut reports = recorded.reports.clone();
    reports.sort_by_key(|r| r.invoked);
    let history = json!({
        "seed": seed,
        "violations": violations,
        "faults": done,
        "reads": recorded.reads,
        "registrations": recorded.registrations,
        "reports": reports,
        "liveness": lives,
    });
    write(
        "history.json",
        serde_json::to_string_pretty(&history).unwrap(),
    );
    write("final.json", serde_json::to_string_pretty(fin).unwrap());
    for (r, log) in rig.all_logs().iter().enumerate() {
        write(&format!("replica-{r}.log"), log.join("\n"));
    }
    write("etcd.log", rig.cluster.logs());
    dir
}
