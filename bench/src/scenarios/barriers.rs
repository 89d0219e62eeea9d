//! `taskgate-bench --scenarios barriers`: a barrier of `--barrier-size`
//! members opening (issue 44). Each member is the main task `job` of an
//! allocation of its own, behind a prestart sidecar `proxy`: `job` arrives
//! at the barrier once its `proxy` runs. Every `job`'s start-condition
//! long-poll is parked on a connection of its own, as an agent parks it;
//! every `proxy` but the last is reported running. Then the last `proxy`'s
//! `running` report (the last arrival) is sent, and the time until every
//! parked poll answered `allowed: true` is measured. `--rounds` rounds,
//! each on a barrier of its own (new allocations, a new name), on one
//! durable server.
//!
//! Opening is two steps through the one write path: the decision written
//! to the anchor (the first-registered member), then every other member
//! following it by a write of its own allocation. The first answer is the
//! anchor's poll, so its time and the last answer's tell the two apart.

use std::time::{Duration, Instant};

use super::{
    BenchConfig, Conn, Cpu, Proc, data_dir, metric, percentile, register, send_each, serve_args,
};

/// How long a poll asks to wait (the server's default maximum); one that
/// ends without being allowed polls again.
const WAIT: &str = "300s";

/// How long any one step may take before the round is called failed.
const STEP: Duration = Duration::from_secs(120);

/// Reports `proxy` of `alloc` running.
async fn arrive(conn: &mut Conn, alloc: &str) -> std::io::Result<()> {
    let path = format!("/v1/allocations/{alloc}/tasks/proxy/state");
    let status = conn.call("PUT", &path, br#"{"state": "running"}"#).await?;
    if status != 200 {
        return Err(std::io::Error::other(format!(
            "{alloc}'s proxy running report answered {status}: {}",
            String::from_utf8_lossy(&conn.body)
        )));
    }
    Ok(())
}

/// Waits (blocking queries on the barrier) until `arrived` of its members
/// count as arrived.
async fn wait_arrived(conn: &mut Conn, name: &str, arrived: u64) -> std::io::Result<()> {
    let deadline = Instant::now() + STEP;
    let mut index = 0;
    loop {
        let path = format!("/v1/barriers/{name}?index={index}&wait=10s");
        let status = conn.call("GET", &path, b"").await?;
        let view = conn.json()?;
        if status != 200 || view["state"] != "gathering" {
            return Err(std::io::Error::other(format!(
                "barrier {name} answered {status} before its last arrival: {view}"
            )));
        }
        if view["arrived"].as_u64() == Some(arrived) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(std::io::Error::other(format!(
                "barrier {name} counted {} arrived, not {arrived}, after {STEP:?}",
                view["arrived"]
            )));
        }
        index = view["modify_index"].as_u64().unwrap_or(0);
    }
}

/// One round's times, from the last arrival's report sent.
struct Round {
    /// Its answer.
    ack: Duration,
    /// Every poll's answer, sorted.
    answers: Vec<Duration>,
    /// CPU from the report sent to the last answer: the server's and this
    /// process's (which shares the cores).
    cpu: Cpu,
}

/// One round: `size` allocations `gang-{round}-{i}` at barrier
/// `bench-gang-{round}`.
async fn round(config: &BenchConfig, server: &Proc, round: u32) -> std::io::Result<Round> {
    let (addr, size) = (server.addr, config.barrier_size);
    let name = format!("bench-gang-{round}");
    let prefix = format!("gang-{round}");
    // A timeout longer than any round: the barrier can only open.
    let spec = format!(
        r#"{{"tasks": [
  {{"name": "proxy", "lifecycle": {{"hook": "prestart", "sidecar": true}}}},
  {{"name": "job", "barrier": {{"name": "{name}", "size": {size}, "timeout": "1h"}}}}]}}"#
    );
    register(addr, &prefix, 0..size, config.clients, &spec).await?;

    // Park every member's poll; each says when it was allowed.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let mut polls = Vec::with_capacity(size);
    for i in 0..size {
        let mut conn = Conn::open(addr).await?;
        let (tx, prefix) = (tx.clone(), prefix.clone());
        polls.push(tokio::spawn(async move {
            let path =
                format!("/v1/allocations/{prefix}-{i}/tasks/job/start-condition?wait={WAIT}");
            loop {
                let status = conn.call("GET", &path, b"").await?;
                let at = Instant::now();
                if status != 200 {
                    return Err(std::io::Error::other(format!(
                        "{prefix}-{i}'s start condition answered {status}: {}",
                        String::from_utf8_lossy(&conn.body)
                    )));
                }
                if String::from_utf8_lossy(&conn.body).contains(r#""allowed":true"#) {
                    let _ = tx.send(at);
                    return Ok::<_, std::io::Error>(());
                }
            }
        }));
    }
    drop(tx);
    let deadline = Instant::now() + STEP;
    while metric(addr, "taskgate_waiters").await? < size as f64 {
        if Instant::now() > deadline {
            return Err(std::io::Error::other("the members' polls never all parked"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Every member but the last arrives.
    let path = {
        let prefix = prefix.clone();
        move |i| format!("/v1/allocations/{prefix}-{i}/tasks/proxy/state")
    };
    let running = move |i| ("PUT", path(i), r#"{"state": "running"}"#.to_owned());
    send_each(
        addr,
        0..size - 1,
        config.clients,
        running,
        &[200],
        "a proxy's running report",
    )
    .await?;
    let mut conn = Conn::open(addr).await?;
    wait_arrived(&mut conn, &name, (size - 1) as u64).await?;
    if let Ok(at) = rx.try_recv() {
        return Err(std::io::Error::other(format!(
            "a member's poll was allowed {at:?} before the last arrival"
        )));
    }

    // The last arrival.
    let before = Cpu::sample(server.child.id())?;
    let sent = Instant::now();
    arrive(&mut conn, &format!("{prefix}-{}", size - 1)).await?;
    let ack = sent.elapsed();
    let mut answers = Vec::with_capacity(size);
    while answers.len() < size {
        match tokio::time::timeout(STEP, rx.recv()).await {
            Ok(Some(at)) => answers.push(at.saturating_duration_since(sent)),
            _ => {
                for p in polls {
                    if p.is_finished() {
                        p.await.map_err(std::io::Error::other)??;
                    }
                }
                return Err(std::io::Error::other(format!(
                    "{} of {size} polls were allowed within {STEP:?} of the last arrival",
                    answers.len()
                )));
            }
        }
    }
    let cpu = Cpu::sample(server.child.id())?.since(before);
    let status = conn
        .call("GET", &format!("/v1/barriers/{name}"), b"")
        .await?;
    let view = conn.json()?;
    if status != 200 || view["state"] != "open" {
        return Err(std::io::Error::other(format!(
            "after every member was allowed, barrier {name} answered {status}: state {}",
            view["state"]
        )));
    }
    answers.sort_unstable();
    Ok(Round { ack, answers, cpu })
}

pub(super) async fn opening(config: &BenchConfig) -> std::io::Result<String> {
    let size = config.barrier_size;
    if !(2..=1000).contains(&size) {
        return Err(std::io::Error::other(format!(
            "--barrier-size {size}: a barrier has 2 to 1000 members"
        )));
    }
    let files = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    if size as u64 + 256 > files {
        return Err(std::io::Error::other(format!(
            "{size} parked polls need as many connections, and the open-files limit is \
             {files}: give a smaller --barrier-size or raise `ulimit -n`"
        )));
    }
    let (dir, _guard) = data_dir(config, "barriers")?;
    let dir = dir.to_string_lossy().into_owned();
    let server = Proc::start(&serve_args(&["--data-dir", dir.as_str()]))?;
    let mut rounds = Vec::new();
    for r in 0..config.rounds {
        rounds.push(round(config, &server, r).await?);
    }
    drop(server);

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let list = |f: &dyn Fn(&Round) -> Duration| {
        rounds
            .iter()
            .map(|r| format!("{:.1}", ms(f(r))))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut lasts: Vec<Duration> = rounds.iter().map(|r| percentile(&r.answers, 1.0)).collect();
    lasts.sort_unstable();
    Ok(format!(
        "barriers: {size} two-task allocations (a prestart sidecar, a main task at the barrier), \
         durable; every main task's start-condition poll parked, one connection each; the last \
         sidecar's running report (the last arrival) → every poll answered allowed; {} rounds, \
         each on a barrier of its own (ms per round):\n\
         - the last arrival sent → the last poll answered: {} (median {:.1} ms; target: all \
           within 100 ms)\n\
         - the last arrival answered → the last poll answered: {}\n\
         - the last arrival sent → the polls' p50: {}; the first (the anchor's decision): {}\n\
         - the last arrival's report itself: {}\n\
         - CPU in that window (clock ticks of 10 ms): the server's request threads {}; its \
           store writer {}; this process (the clients) {}",
        rounds.len(),
        list(&|r| percentile(&r.answers, 1.0)),
        ms(percentile(&lasts, 0.5)),
        list(&|r| percentile(&r.answers, 1.0).saturating_sub(r.ack)),
        list(&|r| percentile(&r.answers, 0.5)),
        list(&|r| r.answers[0]),
        list(&|r| r.ack),
        list(&|r| Duration::from_secs_f64(r.cpu.requests)),
        list(&|r| Duration::from_secs_f64(r.cpu.writer)),
        list(&|r| Duration::from_secs_f64(r.cpu.client)),
    ))
}
