//! `taskgate-bench --scenarios dependencies-hostile`: the benchmark row of
//! issue 43, part 4 (one tenant stalls everyone). An agent token limited
//! to its own prefix registers the audit's dependency graph
//! (`taskgate_testkit::graph::Shape::FULL`: a chain of 960 tasks, a target
//! depending on its head, 8 allocations of 256 tasks with 16 dependencies
//! each on the target) and then reports on the target's tasks, one after
//! another (at least `--hostile-reports`, and until `--duration` has
//! passed), while another token's allocations take paced reports and
//! `GET /v1/health` is asked, paced too. What is measured is
//! what the other tenant sees meanwhile: p50, p99 and max of its reports
//! and of health (target: p99 ≤ 50 ms), timed from when each request was
//! due, so a stall is charged to every request that queued behind it.
//!
//! Sides, each on a fresh durable server: `--base-server-bin` (if given),
//! this build with its default limits (which refuse most of the graph),
//! and this build with its dependency limits raised so that the whole
//! graph is held (the cost of judging it), also `--in-memory` (the same
//! without writing each dependent's new versions to a disk).

use std::{
    sync::{Arc, OnceLock},
    time::{Duration, Instant},
};

use taskgate_testkit::graph::Shape;

use super::{BenchConfig, Conn, FIVE_TASKS, Proc, data_dir, flip_web, paced_while, percentile};

/// The hostile tenant's secret, and its SHA-256 for the token file.
const TENANT: &str = "Authorization: Bearer bench-hostile-tenant\r\n";
const TENANT_SHA256: &str = "2d432613b3c38589963d1b64c0fa73c810add396e3558cdaefba142b45fa4575";
/// The other tenant's.
const OTHER: &str = "Authorization: Bearer bench-other-tenant\r\n";
const OTHER_SHA256: &str = "179e8b5e14d1cbb8ec46e1160a29d47a93bbfa8c63c5c656dc1c5a4e4ffa2fdb";

/// The hostile tenant's prefix, and the other's.
const PREFIX: &str = "evil-";
const GOOD: &str = "good-";

/// The other tenant's connections for its reports, each to an allocation
/// of its own (`good-{c}`, one agent each), and for health.
const REPORTERS: usize = 4;
const CHECKERS: usize = 2;

/// Paced load of the other tenant: reports per second (over 4
/// connections) and health checks per second (over 2).
const REPORT_RATE: f64 = 100.0;
const HEALTH_RATE: f64 = 20.0;

/// The flags that raise this build's dependency limits above the graph.
const RAISED: &[&str] = &[
    "--max-dependents",
    "1000000",
    "--max-dependencies-per-token",
    "1000000",
];

/// What one side measured.
struct Side {
    what: String,
    reports: Vec<Duration>,
    health: Vec<Duration>,
    errors: u64,
    /// Each registration: (ID, status, time).
    registered: Vec<(String, u16, Duration)>,
    /// Each report on the target: status, time.
    target_reports: Vec<(u16, Duration)>,
    /// From the first hostile registration to the last report's answer.
    hostile: Duration,
    /// Bytes the server wrote to its disk meanwhile.
    written: u64,
}

fn token_file(dir: &std::path::Path) -> std::io::Result<std::path::PathBuf> {
    std::fs::create_dir_all(dir)?;
    let file = dir.join("tokens.json");
    let tokens = serde_json::json!({"tokens": [
        {"name": "hostile", "role": "agent", "sha256": TENANT_SHA256, "alloc_prefixes": [PREFIX]},
        {"name": "other", "role": "agent", "sha256": OTHER_SHA256, "alloc_prefixes": ["good-"]},
    ]});
    std::fs::write(&file, tokens.to_string())?;
    Ok(file)
}

async fn side(
    config: &BenchConfig,
    bin: &std::path::Path,
    extra: &[&str],
    what: &str,
) -> std::io::Result<Side> {
    let (dir, _guard) = data_dir(config, "dependencies-hostile")?;
    let tokens = token_file(&dir.join("tokens"))?;
    let data = dir.join("data");
    let mut args = vec![
        "--data-dir",
        data.to_str().expect("a UTF-8 path"),
        "--token-file",
        tokens.to_str().expect("a UTF-8 path"),
    ];
    args.extend_from_slice(extra);
    let server = Proc::start_exe(bin, &super::serve_args(&args))?;
    let addr = server.addr;
    let mut good = Conn::open(addr).await?;
    good.extra_headers = OTHER;
    for c in 0..REPORTERS {
        let path = format!("/v1/allocations/{GOOD}{c}");
        let status = good.call("PUT", &path, FIVE_TASKS.as_bytes()).await?;
        if status != 201 {
            return Err(std::io::Error::other(format!(
                "{GOOD}{c}'s registration answered {status}"
            )));
        }
    }

    // Every request due before the hostile tenant is done is sent and
    // timed, also those that queued behind a stall.
    let stop: Arc<OnceLock<Instant>> = Arc::default();
    let more = {
        let stop = stop.clone();
        move |due: Instant| stop.get().is_none_or(|end| due < *end)
    };
    let report = |c: usize, n: u64| {
        let (method, _, body) = flip_web(c, n);
        let path = format!("/v1/allocations/{GOOD}{c}/tasks/web/state");
        (method, path, body)
    };
    let reports = tokio::spawn(paced_while(
        addr,
        REPORTERS,
        REPORT_RATE,
        OTHER,
        more.clone(),
        report,
    ));
    let health = tokio::spawn(paced_while(
        addr,
        CHECKERS,
        HEALTH_RATE,
        "",
        more,
        |_, _| ("GET", "/v1/health".to_owned(), Vec::new()),
    ));

    // The hostile tenant, on one connection.
    let started = Instant::now();
    let mut evil = Conn::open(addr).await?;
    evil.extra_headers = TENANT;
    let mut registered = Vec::new();
    for (id, spec) in Shape::FULL.registrations(PREFIX) {
        let t = Instant::now();
        let status = evil
            .call("PUT", &format!("/v1/allocations/{id}"), spec.as_bytes())
            .await?;
        if status != 201 && status != 429 {
            return Err(std::io::Error::other(format!(
                "{id}'s registration answered {status}: {}",
                String::from_utf8_lossy(&evil.body)
            )));
        }
        registered.push((id, status, t.elapsed()));
    }
    // Then reports on the target, one after another: at least
    // `--hostile-reports`, and more until `--duration` has passed.
    let mut target_reports = Vec::new();
    let target = Shape::target_id(PREFIX);
    for r in 0.. {
        if r >= config.hostile_reports && started.elapsed() >= config.duration {
            break;
        }
        let task = r % Shape::FULL.target_tasks;
        // Running, then pending again once every task ran: each report
        // changes a verdict of every dependent task.
        let state = if (r / Shape::FULL.target_tasks).is_multiple_of(2) {
            "running"
        } else {
            "pending"
        };
        let t = Instant::now();
        let status = evil
            .call(
                "PUT",
                &format!("/v1/allocations/{target}/tasks/t{task}/state"),
                format!(r#"{{"state": "{state}"}}"#).as_bytes(),
            )
            .await?;
        // 503 `timeout`: the server's request timeout (30 s) passed.
        if status != 200 && status != 503 {
            return Err(std::io::Error::other(format!(
                "the target's report answered {status}: {}",
                String::from_utf8_lossy(&evil.body)
            )));
        }
        target_reports.push((status, t.elapsed()));
    }
    let hostile = started.elapsed();
    let _ = stop.set(Instant::now());
    let (reports, report_errors) = reports.await.map_err(std::io::Error::other)??;
    let (health, health_errors) = health.await.map_err(std::io::Error::other)??;
    let written = server.written_bytes().unwrap_or(0);
    drop(server);
    Ok(Side {
        what: what.to_owned(),
        reports,
        health,
        errors: report_errors + health_errors,
        registered,
        target_reports,
        hostile,
        written,
    })
}

impl Side {
    fn describe(&self) -> String {
        let ms = |v: &[Duration], p: f64| percentile(v, p).as_secs_f64() * 1e3;
        let refused = self.registered.iter().filter(|r| r.1 == 429).count();
        let mut regs: Vec<Duration> = self.registered.iter().map(|r| r.2).collect();
        regs.sort_unstable();
        let mut own: Vec<Duration> = self.target_reports.iter().map(|r| r.1).collect();
        own.sort_unstable();
        let timed_out = self.target_reports.iter().filter(|r| r.0 == 503).count();
        format!(
            "{}: the other tenant's reports p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} \
             sent); GET /v1/health p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} sent); {} not \
             2xx. The hostile tenant: {} registrations ({} refused 429), the slowest {:.0} ms; \
             {} reports on the target ({} timed out, 503), p50 {:.0} ms, max {:.0} ms; {:.1} s \
             in all; the server wrote {} MiB to its disk",
            self.what,
            ms(&self.reports, 0.5),
            ms(&self.reports, 0.99),
            ms(&self.reports, 1.0),
            self.reports.len(),
            ms(&self.health, 0.5),
            ms(&self.health, 0.99),
            ms(&self.health, 1.0),
            self.health.len(),
            self.errors,
            self.registered.len(),
            refused,
            ms(&regs, 1.0),
            own.len(),
            timed_out,
            ms(&own, 0.5),
            ms(&own, 1.0),
            self.hostile.as_secs_f64(),
            self.written >> 20,
        )
    }
}

/// Issue 43, part 4: the other tenant's p99 ≤ 50 ms while the hostile
/// graph is registered and its target reported on.
pub(super) async fn scenario(config: &BenchConfig) -> std::io::Result<String> {
    let this = super::server_bin()?;
    let mut lines = Vec::new();
    if let Some(base) = &config.base_server_bin {
        let s = side(
            config,
            base,
            &[],
            &format!("base build ({})", base.display()),
        )
        .await?;
        eprintln!("bench: {}", s.describe());
        lines.push(s.describe());
    }
    let s = side(config, &this, &[], "this build, default limits").await?;
    eprintln!("bench: {}", s.describe());
    lines.push(s.describe());
    let s = side(
        config,
        &this,
        RAISED,
        "this build, limits raised (the whole graph held)",
    )
    .await?;
    eprintln!("bench: {}", s.describe());
    lines.push(s.describe());
    // The same without a disk: what judging costs, apart from writing
    // each dependent's new version (whole, its spec included).
    let in_memory: Vec<&str> = RAISED.iter().copied().chain(["--in-memory"]).collect();
    let s = side(
        config,
        &this,
        &in_memory,
        "this build, limits raised, --in-memory",
    )
    .await?;
    lines.push(s.describe());
    Ok(format!(
        "dependencies-hostile: one agent token registers the audit's graph (a chain of {} \
         tasks, a target of {} tasks on its head, {} dependents of {} tasks with {} \
         dependencies each on the target) and reports on the target, one report after \
         another, at least {} times and for {:?} from its first registration, while another \
         token's allocations take {REPORT_RATE} reports/s and health is asked {HEALTH_RATE} \
         times/s (target: p99 ≤ 50 ms); durable servers:\n- {}",
        Shape::FULL.chain * Shape::FULL.chain_tasks,
        Shape::FULL.target_tasks,
        Shape::FULL.dependents,
        Shape::FULL.dependent_tasks,
        Shape::FULL.target_tasks,
        config.hostile_reports,
        config.duration,
        lines.join("\n- ")
    ))
}
