//! `taskgate-bench --scenarios etcd`: replicas on a three-member etcd
//! cluster on this machine, measured against etcd itself in the same run.
//!
//! - Reports through three replicas (each on its own member first), the
//!   `durable` scenario's traffic, alternated in rounds with etcd's own
//!   compare-and-swap transactions (the same client library, the same
//!   record as value, one key per client): the ratio is the store's
//!   overhead on top of etcd.
//! - Cross-replica wake latency: reports through replica A at a fixed rate,
//!   each answered to a blocking query parked on replica B; the time from
//!   A's answer to B's.
//! - A replica joining a prefix that holds `--etcd-sync-allocations`
//!   allocations: the time until its health is 200, and its memory.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use super::{BenchConfig, Conn, FIVE_TASKS, Outcome, Proc, serve_args};
use taskgate::store::etcd::{
    EtcdConfig,
    client::{Client, Swapped},
};
use taskgate_testkit::cluster::Cluster;

/// Rounds of (etcd's own transactions, reports through the replicas).
const ROUNDS: usize = 2;
/// Reports per second through replica A in the wake measurement, and the
/// allocations they are spread over (one waiter on B each).
const WAKE_RATE: f64 = 1000.0;
const WAKE_ALLOCATIONS: usize = 50;

pub(super) async fn scenario(config: &BenchConfig) -> std::io::Result<(Vec<Outcome>, String)> {
    let cluster = tokio::task::spawn_blocking(|| Cluster::start(3))
        .await
        .map_err(std::io::Error::other)?;
    let endpoints = cluster.endpoints();
    let replica = |i: usize, prefix: &str| {
        let mut eps = endpoints.clone();
        let n = eps.len();
        eps.rotate_left(i % n);
        let eps = eps.join(",");
        Proc::start(&serve_args(&[
            "--store",
            "etcd",
            "--etcd-endpoints",
            &eps,
            "--etcd-prefix",
            prefix,
        ]))
    };
    let replicas = [
        replica(0, "/bench/")?,
        replica(1, "/bench/")?,
        replica(2, "/bench/")?,
    ];
    let addrs: Vec<SocketAddr> = replicas.iter().map(|r| r.addr).collect();
    super::register(
        addrs[0],
        "bench",
        0..config.clients,
        config.clients,
        FIVE_TASKS,
    )
    .await?;
    // One client per replica's member order, as the replicas have: etcd's
    // own run spreads over the members exactly as the replicas do (a
    // follower forwards to the leader what it is sent).
    let clients: Vec<Arc<Client>> = (0..replicas.len())
        .map(|i| {
            let mut eps = endpoints.clone();
            let n = eps.len();
            eps.rotate_left(i % n);
            Client::new(&EtcdConfig::new(eps))
                .map(Arc::new)
                .map_err(std::io::Error::other)
        })
        .collect::<Result<_, _>>()?;
    let client = &clients[0];
    // One report first, so etcd's own run writes a record of the size the
    // measured reports write.
    let mut conn = Conn::open(addrs[0]).await?;
    conn.call(
        "PUT",
        "/v1/allocations/bench-0/tasks/web/state",
        br#"{"state": "running"}"#,
    )
    .await?;
    let key = b"/bench/a/bench-0";
    let mut end = key.to_vec();
    end.push(0);
    let record = client
        .range(key, &end, 0, 1)
        .await
        .map_err(std::io::Error::other)?
        .kvs
        .pop()
        .map(|kv| kv.value)
        .ok_or_else(|| std::io::Error::other("the registered record is not in etcd"))?;

    let mut rows = Vec::new();
    let (mut own, mut watched, mut ours) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let o = transactions(&clients, &record, config, round, false).await?;
        own.push(o.rate());
        rows.push(o);
        let o = transactions(&clients, &record, config, round, true).await?;
        watched.push(o.rate());
        rows.push(o);
        let o = super::drive_on(
            &format!("reports through 3 replicas on etcd, round {}", round + 1),
            &addrs,
            config.clients,
            config.duration,
            super::flip_web,
        )
        .await?;
        ours.push(o.rate());
        rows.push(o);
    }
    let ratio = |of: &[f64]| -> Vec<String> {
        own.iter()
            .zip(of)
            .map(|(e, t)| format!("{:.0}%", 100.0 * t / e))
            .collect()
    };
    let (ratios, watched) = (ratio(&ours), ratio(&watched));
    let wake = wake(addrs[0], addrs[1], config.duration).await?;
    let sync = sync(&replicas, &endpoints, config).await?;
    let note = format!(
        "etcd: three members on this machine, record of {} bytes; reports through three \
         replicas against etcd's own compare-and-swap transactions, round by round: {} \
         (target ≥ 70%; etcd's own run spreads its clients over the members as the \
         replicas do). etcd's own transactions while three watches (one per replica) \
         follow their prefix: {} of its rate without them — the share of the gap that is \
         etcd sending every change to every replica.\n\n{wake}\n\n{sync}",
        record.len(),
        ratios.join(", "),
        watched.join(", ")
    );
    drop(cluster);
    Ok((rows, note))
}

/// etcd's own transactions: `--clients` loops, each a compare-and-swap of
/// `record` on a key of its own, as a replica commits a report; loop `c`
/// uses `clients[c % n]` (the replicas' member orders).
///
/// With `watched`, three watches on the keys' prefix (one per member order,
/// as the replicas' are) read every change meanwhile.
async fn transactions(
    clients: &[Arc<Client>],
    record: &[u8],
    config: &BenchConfig,
    round: usize,
    watched: bool,
) -> std::io::Result<Outcome> {
    let prefix = format!("/bench-raw/{round}/{watched}/").into_bytes();
    let mut watches = Vec::new();
    let seen: Arc<Vec<std::sync::atomic::AtomicU64>> = Arc::new(
        (0..clients.len())
            .map(|_| std::sync::atomic::AtomicU64::new(0))
            .collect(),
    );
    if watched {
        let end = taskgate::store::etcd::prefix_end(&prefix);
        for (i, client) in clients.iter().enumerate() {
            let mut w = client
                .watch(&prefix, &end, 0)
                .await
                .map_err(std::io::Error::other)?;
            let seen = seen.clone();
            watches.push(tokio::spawn(async move {
                while let Ok(Some(r)) = w.next().await {
                    seen[i].fetch_add(r.events.len() as u64, std::sync::atomic::Ordering::Relaxed);
                }
            }));
        }
    }
    let warmup = Duration::from_secs(1);
    let measure_from = Instant::now() + warmup;
    let end = measure_from + config.duration;
    let mut tasks = Vec::new();
    for c in 0..config.clients {
        let (client, record, prefix) = (
            clients[c % clients.len()].clone(),
            record.to_vec(),
            prefix.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut key = prefix.clone();
            key.extend_from_slice(c.to_string().as_bytes());
            let mut expect = 0;
            let (mut ok, mut errors, mut lat) = (0u64, 0u64, Vec::new());
            loop {
                let sent = Instant::now();
                if sent >= end {
                    break;
                }
                let done = match client.swap(&key, Some(&record), expect).await {
                    Ok(Swapped::Done(revision)) => {
                        expect = revision;
                        true
                    }
                    Ok(Swapped::Conflict { now, .. }) => {
                        expect = now;
                        false
                    }
                    Err(_) => false,
                };
                if sent >= measure_from {
                    lat.push(sent.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
                    if done {
                        ok += 1;
                    } else {
                        errors += 1;
                    }
                }
            }
            (ok, errors, lat)
        }));
    }
    let mut out = Outcome {
        name: format!(
            "etcd's own compare-and-swap transactions{}, round {}",
            if watched {
                ", three prefix watches"
            } else {
                ""
            },
            round + 1
        ),
        requests: 0,
        errors: 0,
        elapsed: config.duration,
        latencies_us: Vec::new(),
    };
    for t in tasks {
        let (ok, errors, lat) = t.await.map_err(std::io::Error::other)?;
        out.requests += ok;
        out.errors += errors;
        out.latencies_us.extend(lat);
    }
    // The watches read every change until the last transaction is done
    // (stopped earlier, etcd would have had no watcher to send to).
    for w in watches {
        w.abort();
    }
    if watched {
        let seen: Vec<u64> = seen
            .iter()
            .map(|n| n.load(std::sync::atomic::Ordering::Relaxed))
            .collect();
        if seen.iter().any(|&n| n < out.requests) {
            return Err(std::io::Error::other(format!(
                "a watch missed changes: {seen:?} of at least {} transactions",
                out.requests
            )));
        }
    }
    out.latencies_us.sort_unstable();
    Ok(out)
}

/// Reports through `a` at `WAKE_RATE`, each allocation watched by a
/// blocking query on `b`: the time from `a`'s answer to `b`'s.
async fn wake(a: SocketAddr, b: SocketAddr, duration: Duration) -> std::io::Result<String> {
    super::register(a, "wake", 0..WAKE_ALLOCATIONS, 16, FIVE_TASKS).await?;
    // index → when A answered it / when B's waiter answered it.
    let acked: Arc<Mutex<HashMap<u64, Instant>>> = Arc::default();
    let woken: Arc<Mutex<HashMap<u64, Instant>>> = Arc::default();
    let end = Instant::now() + duration;
    let mut waiters = Vec::new();
    for i in 0..WAKE_ALLOCATIONS {
        let woken = woken.clone();
        waiters.push(tokio::spawn(async move {
            let mut conn = Conn::open(b).await?;
            let mut index = 0;
            // Until the writers are done, plus time for the last answer.
            while Instant::now() < end + Duration::from_secs(2) {
                let path = format!("/v1/allocations/wake-{i}?index={index}&wait=3s");
                if conn.call("GET", &path, b"").await? != 200 {
                    return Err(std::io::Error::other("a blocking query on B failed"));
                }
                let at = Instant::now();
                let seen = conn.json()?["modify_index"].as_u64().unwrap_or(0);
                if seen > index {
                    if index > 0 {
                        woken.lock().expect("not poisoned").insert(seen, at);
                    }
                    index = seen;
                }
            }
            Ok::<_, std::io::Error>(())
        }));
    }
    // Let every waiter park on its first answer before the writes start.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let period = Duration::from_secs_f64(WAKE_ALLOCATIONS as f64 / WAKE_RATE);
    let mut writers = Vec::new();
    for i in 0..WAKE_ALLOCATIONS {
        let acked = acked.clone();
        writers.push(tokio::spawn(async move {
            let mut conn = Conn::open(a).await?;
            // Spread over the period, so the rate is even.
            let mut next =
                tokio::time::Instant::now() + period.mul_f64(i as f64 / WAKE_ALLOCATIONS as f64);
            let mut n = 0u64;
            while Instant::now() < end {
                tokio::time::sleep_until(next).await;
                next += period;
                let state = if n.is_multiple_of(2) {
                    "running"
                } else {
                    "pending"
                };
                n += 1;
                let path = format!("/v1/allocations/wake-{i}/tasks/web/state");
                let body = format!(r#"{{"state": "{state}"}}"#);
                if conn.call("PUT", &path, body.as_bytes()).await? != 200 {
                    continue;
                }
                let at = Instant::now();
                if let Some(index) = conn.json()?["modify_index"].as_u64() {
                    acked.lock().expect("not poisoned").insert(index, at);
                }
            }
            Ok::<_, std::io::Error>(())
        }));
    }
    for w in writers {
        w.await.map_err(std::io::Error::other)??;
    }
    for w in waiters {
        w.await.map_err(std::io::Error::other)??;
    }
    let acked = acked.lock().expect("not poisoned");
    let woken = woken.lock().expect("not poisoned");
    let mut lat: Vec<Duration> = acked
        .iter()
        .filter_map(|(index, at)| woken.get(index).map(|w| w.saturating_duration_since(*at)))
        .collect();
    lat.sort_unstable();
    let missed = acked.len() - lat.len();
    let ms = |p: f64| super::percentile(&lat, p).as_secs_f64() * 1000.0;
    Ok(format!(
        "etcd wake: {} reports through replica A at {WAKE_RATE:.0}/s over {WAKE_ALLOCATIONS} \
         allocations, each watched by a blocking query on replica B: from A's answer to B's, \
         p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms (target p99 ≤ 50 ms); {missed} answered \
         on B only together with a later change of the same allocation",
        acked.len(),
        ms(0.5),
        ms(0.99),
        ms(1.0),
    ))
}

/// Fills a prefix through the replicas, then starts one more replica on it
/// and measures its initial sync and memory.
async fn sync(
    replicas: &[Proc],
    endpoints: &[String],
    config: &BenchConfig,
) -> std::io::Result<String> {
    let n = config.etcd_sync_allocations;
    let per = n.div_ceil(replicas.len());
    let mut fills = Vec::new();
    for (i, r) in replicas.iter().enumerate() {
        let (addr, clients) = (r.addr, config.clients);
        let ids = (i * per)..((i + 1) * per).min(n);
        fills.push(tokio::spawn(async move {
            super::register(addr, "sync", ids, clients, FIVE_TASKS).await
        }));
    }
    let filled = Instant::now();
    for f in fills {
        f.await.map_err(std::io::Error::other)??;
    }
    let fill_rate = n as f64 / filled.elapsed().as_secs_f64();
    let eps = endpoints.join(",");
    let started = Instant::now();
    let joined = Proc::start(&serve_args(&[
        "--store",
        "etcd",
        "--etcd-endpoints",
        &eps,
        "--etcd-prefix",
        "/bench/",
    ]))?;
    let took = super::healthy(&joined, started).await?;
    let rss = joined.rss_kib().unwrap_or(0) as f64 / 1024.0;
    Ok(format!(
        "etcd sync: a replica joining a prefix of {n} five-task allocations (plus the \
         scenario's own): healthy after {:.2} s, {rss:.0} MiB resident (the prefix was filled \
         through three replicas at {fill_rate:.0} registrations/s)",
        took.as_secs_f64()
    ))
}
