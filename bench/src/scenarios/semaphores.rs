//! `taskgate-bench --scenarios semaphores`: a slot handed over in a long
//! line. `--semaphore-queued` one-task allocations acquire one semaphore
//! of `--semaphore-limit` slots, each with its start-condition long-poll
//! parked on a connection of its own, as an agent parks it; the holders
//! run. Then, `--semaphore-handovers` times, one after another: the oldest
//! holder is reported `dead`, and the time until the next task's parked
//! poll is answered (allowed) is measured; that task is reported
//! `running` and becomes a holder in turn.
//!
//! The number that counts is from the dead report's answer to the woken
//! poll's answer (the grant is the judge's own change after the report's,
//! and goes through the same write path).

use std::{
    collections::VecDeque,
    time::{Duration, Instant},
};

use super::{BenchConfig, Conn, Proc, data_dir, metric, percentile, register, serve_args};

/// The semaphore every allocation acquires.
const SEMAPHORE: &str = "bench-slots";

/// One task acquiring it.
const SPEC: &str = r#"{"tasks": [{"name": "job", "acquire": ["bench-slots"]}]}"#;

/// How long a poll asks to wait (the server's default maximum); one that
/// ends without being allowed polls again.
const WAIT: &str = "300s";

/// Reports `state` for `job` of `sem-{i}`.
async fn report(conn: &mut Conn, i: usize, state: &str) -> std::io::Result<()> {
    let body = format!(r#"{{"state": "{state}"}}"#);
    let status = conn
        .call(
            "PUT",
            &format!("/v1/allocations/sem-{i}/tasks/job/state"),
            body.as_bytes(),
        )
        .await?;
    if status != 200 {
        return Err(std::io::Error::other(format!(
            "sem-{i}'s {state} report answered {status}: {}",
            String::from_utf8_lossy(&conn.body)
        )));
    }
    Ok(())
}

pub(super) async fn handover(config: &BenchConfig) -> std::io::Result<String> {
    let (queued, limit) = (config.semaphore_queued, config.semaphore_limit.max(1));
    let handovers = config.semaphore_handovers;
    if queued < limit + handovers {
        return Err(std::io::Error::other(format!(
            "{handovers} hand-overs on a semaphore of {limit} slots need at least {} \
             allocations in line (--semaphore-queued)",
            limit + handovers
        )));
    }
    let files = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    if queued as u64 + 256 > files {
        return Err(std::io::Error::other(format!(
            "{queued} parked polls need as many connections, and the open-files limit is \
             {files}: give fewer --semaphore-queued or raise `ulimit -n`"
        )));
    }
    let (dir, _guard) = data_dir(config, "semaphores")?;
    let dir = dir.to_string_lossy().into_owned();
    let server = Proc::start(&serve_args(&["--data-dir", dir.as_str()]))?;
    let addr = server.addr;

    // A grant timeout longer than the run: no grant lapses in it.
    let mut conn = Conn::open(addr).await?;
    let body = format!(r#"{{"limit": {limit}, "grant_timeout": "1h"}}"#);
    let status = conn
        .call(
            "PUT",
            &format!("/v1/semaphores/{SEMAPHORE}"),
            body.as_bytes(),
        )
        .await?;
    if status != 201 {
        return Err(std::io::Error::other(format!(
            "creating the semaphore answered {status}: {}",
            String::from_utf8_lossy(&conn.body)
        )));
    }
    let started = Instant::now();
    register(addr, "sem", 0..queued, config.clients, SPEC).await?;
    let registered = started.elapsed();

    // Park every task's poll; each says when it was allowed.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Instant)>();
    let mut waiters = Vec::with_capacity(queued);
    for i in 0..queued {
        let mut conn = Conn::open(addr).await?;
        let tx = tx.clone();
        waiters.push(tokio::spawn(async move {
            let path = format!("/v1/allocations/sem-{i}/tasks/job/start-condition?wait={WAIT}");
            loop {
                let status = conn.call("GET", &path, b"").await?;
                let at = Instant::now();
                if status != 200 {
                    return Err(std::io::Error::other(format!(
                        "sem-{i}'s start condition answered {status}: {}",
                        String::from_utf8_lossy(&conn.body)
                    )));
                }
                if String::from_utf8_lossy(&conn.body).contains(r#""allowed":true"#) {
                    let _ = tx.send((i, at));
                    return Ok::<_, std::io::Error>(());
                }
            }
        }));
    }
    drop(tx);
    // The first `limit` were granted as they registered: their polls
    // answer at once, and their agents start them.
    let mut holders = VecDeque::with_capacity(limit);
    for _ in 0..limit {
        let got = tokio::time::timeout(Duration::from_secs(60), rx.recv()).await;
        let Ok(Some((i, _))) = got else {
            return Err(std::io::Error::other(
                "the first holders' polls were not answered within 60 s",
            ));
        };
        report(&mut conn, i, "running").await?;
        holders.push_back(i);
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while metric(addr, "taskgate_waiters").await? < (queued - limit) as f64 {
        if Instant::now() > deadline {
            return Err(std::io::Error::other("the queued polls never all parked"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let (mut from_report, mut from_answer, mut acks) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..handovers {
        let gone = holders.pop_front().expect("limit ≥ 1 holders");
        let sent = Instant::now();
        report(&mut conn, gone, "dead").await?;
        let acked = Instant::now();
        let got = tokio::time::timeout(Duration::from_secs(60), rx.recv()).await;
        let Ok(Some((next, at))) = got else {
            return Err(std::io::Error::other(format!(
                "no task was granted within 60 s of sem-{gone}'s dead report"
            )));
        };
        from_report.push(at.saturating_duration_since(sent));
        from_answer.push(at.saturating_duration_since(acked));
        acks.push(acked - sent);
        report(&mut conn, next, "running").await?;
        holders.push_back(next);
    }
    // One grant per slot freed: the semaphore shows `limit` holders and
    // the rest in line, and no other poll was answered.
    let status = conn
        .call("GET", &format!("/v1/semaphores/{SEMAPHORE}"), b"")
        .await?;
    let line = conn.json()?;
    let count = |key: &str| line[key].as_array().map_or(0, Vec::len);
    if status != 200
        || count("holders") != limit
        || count("queue") != queued - limit - handovers
        || rx.try_recv().is_ok()
    {
        return Err(std::io::Error::other(format!(
            "after the hand-overs the semaphore answered {status} with {} holders and {} in \
             line (expected {limit} and {})",
            count("holders"),
            count("queue"),
            queued - limit - handovers
        )));
    }
    for w in &waiters {
        w.abort();
    }
    drop(server);
    for v in [&mut from_report, &mut from_answer, &mut acks] {
        v.sort_unstable();
    }
    let ms = |v: &[Duration], p: f64| percentile(v, p).as_secs_f64() * 1e3;
    Ok(format!(
        "semaphores: {queued} one-task allocations acquiring one semaphore of {limit} slots, \
         durable; registered in {registered:.1?}; every start-condition poll parked, one \
         connection each; {handovers} hand-overs one after another (the oldest holder \
         reported dead, the next task's poll answered, that task reported running):\n\
         - the dead report answered → the next task's poll answered: p50 {b50:.2} ms, p99 \
           {b99:.2} ms, max {bmax:.2} ms (target: p99 ≤ 10 ms)\n\
         - the dead report sent → the next task's poll answered: p50 {a50:.2} ms, p99 \
           {a99:.2} ms, max {amax:.2} ms\n\
         - the dead report itself: p50 {r50:.2} ms, p99 {r99:.2} ms",
        b50 = ms(&from_answer, 0.5),
        b99 = ms(&from_answer, 0.99),
        bmax = ms(&from_answer, 1.0),
        a50 = ms(&from_report, 0.5),
        a99 = ms(&from_report, 0.99),
        amax = ms(&from_report, 1.0),
        r50 = ms(&acks, 0.5),
        r99 = ms(&acks, 0.99),
    ))
}
