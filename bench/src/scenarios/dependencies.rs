//! `taskgate-bench --scenarios dependencies`: the benchmark rows of issue
//! 35, in two parts that can also be run alone:
//!
//! - `dependencies-wake`: `--dependents` allocations, each with one task
//!   depending on the task of one of `--dependency-targets` target
//!   allocations (`running`), a start-condition long-poll parked on every
//!   dependent; each target's task is reported running in turn, and the
//!   time until each of its dependents' polls is answered is measured.
//! - `dependencies-base`: durable reports on allocations without
//!   dependencies, on `--base-server-bin` (the build before the third
//!   edition) and on this build, with and without a dependency graph held
//!   next to them, alternated.

use std::time::{Duration, Instant};

use super::{
    BenchConfig, Conn, FIVE_TASKS, Outcome, Proc, data_dir, drive_cpu, flip_web,
    liveness::{Compared, fresh_server, order},
    metric, percentile, register, send_each, serve_args,
};

/// A target allocation: one task.
const TARGET: &str = r#"{"tasks": [{"name": "db"}]}"#;

/// Dependent `i`'s spec: one task that may start once `db` of target
/// `tgt-{target}` runs.
fn dependent(target: usize) -> String {
    format!(
        r#"{{"tasks": [{{"name": "app", "depends_on": [{{"task": "db", "allocation": "tgt-{target}", "condition": "running"}}]}}]}}"#
    )
}

/// How long a waiter's poll asks to wait (the server's default maximum);
/// one that ends without being allowed polls again.
const WAIT: &str = "300s";

/// Registers the targets `tgt-*` and the dependents `dep-*` (dependent
/// `i` on target `i % targets`).
pub(super) async fn graph(
    addr: std::net::SocketAddr,
    targets: usize,
    dependents: usize,
    clients: usize,
) -> std::io::Result<()> {
    register(addr, "tgt", 0..targets, clients, TARGET).await?;
    let request = move |i: usize| {
        let path = format!("/v1/allocations/dep-{i}");
        ("PUT", path, dependent(i % targets))
    };
    send_each(
        addr,
        0..dependents,
        clients,
        request,
        &[200, 201],
        "register",
    )
    .await
}

/// Issue 35: a target's change wakes its dependents' parked polls with
/// p99 ≤ 50 ms. Durable server; every dependent's start-condition poll
/// parked on a connection of its own; the targets' tasks reported running
/// one after another, each once all of the previous one's dependents were
/// answered.
pub(super) async fn wake(config: &BenchConfig) -> std::io::Result<String> {
    let (targets, dependents) = (config.dependency_targets.max(1), config.dependents);
    // One connection per parked poll, here and in the server.
    let files = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    if dependents as u64 + 256 > files {
        return Err(std::io::Error::other(format!(
            "{dependents} parked polls need as many connections, and the open-files limit is \
             {files}: give fewer --dependents or raise `ulimit -n`"
        )));
    }
    let (dir, _guard) = data_dir(config, "dependencies")?;
    let dir = dir.to_string_lossy().into_owned();
    let server = Proc::start(&serve_args(&["--data-dir", dir.as_str()]))?;
    let addr = server.addr;
    let started = Instant::now();
    graph(addr, targets, dependents, config.clients).await?;
    let registered = started.elapsed();
    let rss_before = server.rss_kib().unwrap_or(0);

    // Park every dependent's poll; each says when it was allowed.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Instant)>();
    let mut waiters = Vec::with_capacity(dependents);
    for i in 0..dependents {
        let mut conn = Conn::open(addr).await?;
        let tx = tx.clone();
        waiters.push(tokio::spawn(async move {
            let path = format!("/v1/allocations/dep-{i}/tasks/app/start-condition?wait={WAIT}");
            loop {
                let status = conn.call("GET", &path, b"").await?;
                let at = Instant::now();
                if status != 200 {
                    return Err(std::io::Error::other(format!(
                        "dep-{i}'s start condition answered {status}: {}",
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
    let deadline = Instant::now() + Duration::from_secs(120);
    while metric(addr, "taskgate_waiters").await? < dependents as f64 {
        if Instant::now() > deadline {
            return Err(std::io::Error::other(
                "the dependents' polls never all parked",
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rss_parked = server.rss_kib().unwrap_or(0);

    let mut conn = Conn::open(addr).await?;
    let (mut from_report, mut from_answer) = (Vec::new(), Vec::new());
    let (mut last_of_target, mut acks) = (Vec::new(), Vec::new());
    for k in 0..targets {
        let expected = (k..dependents).step_by(targets).count();
        let sent = Instant::now();
        let status = conn
            .call(
                "PUT",
                &format!("/v1/allocations/tgt-{k}/tasks/db/state"),
                br#"{"state": "running"}"#,
            )
            .await?;
        let acked = Instant::now();
        if status != 200 {
            return Err(std::io::Error::other(format!(
                "tgt-{k}'s report answered {status}"
            )));
        }
        acks.push(acked - sent);
        let mut last = acked;
        for _ in 0..expected {
            let got = tokio::time::timeout(Duration::from_secs(60), rx.recv()).await;
            let Ok(Some((i, at))) = got else {
                return Err(std::io::Error::other(format!(
                    "tgt-{k}'s dependents were not all answered within 60 s"
                )));
            };
            if i % targets != k {
                return Err(std::io::Error::other(format!(
                    "dep-{i} was allowed before its target tgt-{} ran",
                    i % targets
                )));
            }
            from_report.push(at.saturating_duration_since(sent));
            from_answer.push(at.saturating_duration_since(acked));
            last = last.max(at);
        }
        last_of_target.push(last.saturating_duration_since(sent));
    }
    for w in waiters {
        w.await.map_err(std::io::Error::other)??;
    }
    for v in [
        &mut from_report,
        &mut from_answer,
        &mut last_of_target,
        &mut acks,
    ] {
        v.sort_unstable();
    }
    let ms = |v: &[Duration], p: f64| percentile(v, p).as_secs_f64() * 1e3;
    let per = dependents.div_ceil(targets);
    Ok(format!(
        "dependencies: {dependents} dependent allocations (one task each, depending on a \
         target's task `running`), {targets} targets (~{per} dependents each), durable; \
         registered in {registered:.1?}; every dependent's start-condition poll parked, one \
         connection each ({pw:.0} bytes of server memory per parked poll); each target's task \
         reported running in turn, after all of the last one's dependents were answered:\n\
         - report sent → a dependent's poll answered: p50 {a50:.1} ms, p99 {a99:.1} ms, max \
           {amax:.1} ms (target: p99 ≤ 50 ms)\n\
         - the target's report answered → a dependent's poll answered: p50 {b50:.1} ms, p99 \
           {b99:.1} ms, max {bmax:.1} ms\n\
         - the target's report itself: p50 {r50:.1} ms, p99 {r99:.1} ms; the last of a target's \
           dependents answered: p50 {l50:.1} ms, p99 {l99:.1} ms, max {lmax:.1} ms after the \
           report was sent",
        pw = (rss_parked.saturating_sub(rss_before) * 1024) as f64 / dependents.max(1) as f64,
        a50 = ms(&from_report, 0.5),
        a99 = ms(&from_report, 0.99),
        amax = ms(&from_report, 1.0),
        b50 = ms(&from_answer, 0.5),
        b99 = ms(&from_answer, 0.99),
        bmax = ms(&from_answer, 1.0),
        r50 = ms(&acks, 0.5),
        r99 = ms(&acks, 0.99),
        l50 = ms(&last_of_target, 0.5),
        l99 = ms(&last_of_target, 0.99),
        lmax = ms(&last_of_target, 1.0),
    ))
}

/// Issue 35: reports on allocations without dependencies are not slower
/// than before. Fresh durable servers in turns, `--rounds` times: the
/// base build and this build holding `--dependency-targets` +
/// `--dependents` allocations without dependencies, and this build holding
/// the same as a dependency graph (the reverse index filled); on each,
/// durable reports as the `durable` scenario sends them, on `--clients`
/// allocations of their own.
pub(super) async fn versus_base(config: &BenchConfig) -> std::io::Result<(Vec<Outcome>, String)> {
    let base = config.base_server_bin.clone().ok_or_else(|| {
        std::io::Error::other(
            "dependencies-base needs --base-server-bin (the build to compare with)",
        )
    })?;
    let this = super::server_bin()?;
    let (targets, dependents) = (config.dependency_targets.max(1), config.dependents);
    let rounds = config.rounds as usize;
    let sides = [
        (base.as_path(), false, "base build"),
        (this.as_path(), false, "this build"),
        (this.as_path(), true, "this build, dependency graph held"),
    ];
    let mut rows = Vec::new();
    let mut seen: [Compared; 3] = Default::default();
    for round in 0..rounds {
        for side in order(round, &[0usize, 1, 2]) {
            let (bin, deps, what) = sides[side];
            let (_guard, server) = fresh_server(config, bin, "dependencies-base")?;
            let (addr, clients) = (server.addr, config.clients);
            if deps {
                graph(addr, targets, dependents, clients).await?;
            } else {
                register(addr, "tgt", 0..targets, clients, TARGET).await?;
                register(addr, "dep", 0..dependents, clients, TARGET).await?;
            }
            register(addr, "bench", 0..clients, clients, FIVE_TASKS).await?;
            let name = format!("reports, durable, {what}, round {}", round + 1);
            let (o, cpu) =
                drive_cpu(&name, &server, clients, config.duration, "", flip_web).await?;
            seen[side].push(&o, cpu)?;
            rows.push(o);
        }
    }
    let [b, t, g] = &seen;
    let note = format!(
        "dependencies, reports on allocations without dependencies against {} ({rounds} \
         alternations, medians, fresh durable servers each holding {n} other allocations):\n\
         - {}\n- {}: {}\n- {} ({dependents} dependents on {targets} targets): {}",
        base.display(),
        b.describe("base"),
        t.describe("this build"),
        Compared::versus(b, t),
        g.describe("this build, the others a dependency graph"),
        Compared::versus(b, g),
        n = targets + dependents,
    );
    Ok((rows, note))
}
