//! `taskgate-bench --scenarios liveness`: what liveness TTLs cost (the
//! benchmark rows of issue 31), in four parts that can also be run alone:
//!
//! - `liveness-ttl`: reports with events on allocations whose tasks all
//!   run under a TTL against the same workload without TTLs, same build,
//!   durable, alternated `--rounds` times on fresh servers.
//! - `liveness-heartbeats`: `PUT .../heartbeat` against durable reports on
//!   one server, alternated.
//! - `liveness-scale`: `--liveness-allocations` five-task allocations on
//!   two servers, one with every task under a TTL: memory, threads, idle
//!   CPU, reports spread over all of them (alternated), restarts.
//! - `liveness-base`: allocations without the new fields on this build
//!   against `--base-server-bin` (the build before the third edition),
//!   alternated.

use std::{
    net::SocketAddr,
    path::Path,
    time::{Duration, Instant},
};

use rustix::process::Signal;

use super::{
    BenchConfig, Conn, Cpu, FIVE_TASKS, Measured, Outcome, Proc, data_dir, drive_cpu,
    event_reports, fill_histories, flip_web, healthy, put_each, register, send_each, serve_args,
    window,
};

/// The TTL of the measured windows (lifecycle.md's example).
const TTL: &str = "30s";
/// How often the agents of the tasks a window does not report on give a
/// sign of life: a third of the TTL, as `taskgate agent` does.
const HEARTBEAT_EVERY: Duration = Duration::from_secs(10);
/// The TTL at scale: longer than the run, so nothing is lost there (a
/// million tasks' heartbeats every ten seconds are more than this
/// machine's two cores answer next to the measured load).
const LONG_TTL: &str = "1h";
/// The tasks the measured reports leave alone (they go to `web`).
const QUIET_TASKS: [&str; 4] = ["init", "proxy", "announce", "cleanup"];
/// At scale, what every allocation's agents report first: the prestart
/// task done, the sidecar running (under its TTL: the allocation is in
/// the timer heap), `web` still pending (the measured reports start it).
const STARTED: &str = r#"{"tasks": {"init": {"state": "dead"}, "proxy": {"state": "running"}}}"#;

/// The five-task allocation of API.md with `"liveness": {"ttl": ttl}` on
/// every task.
pub(super) fn five_tasks_with_ttl(ttl: &str) -> String {
    let mut spec: serde_json::Value = serde_json::from_str(FIVE_TASKS).expect("FIVE_TASKS is JSON");
    for task in spec["tasks"].as_array_mut().expect("a task list") {
        task["liveness"] = serde_json::json!({ "ttl": ttl });
    }
    spec.to_string()
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Each round's value, as `a / b / c`.
fn each(xs: &[f64]) -> String {
    let all: Vec<String> = xs.iter().map(|x| format!("{x:.0}")).collect();
    all.join(" / ")
}

/// `a` against `b` in percent (+: `a` is larger).
fn change(a: f64, b: f64) -> f64 {
    100.0 * (a / b - 1.0)
}

/// What one kind of window measured on one side, over the rounds.
#[derive(Default)]
pub(super) struct Compared {
    rates: Vec<f64>,
    cpu_us: Vec<f64>,
    p99: Vec<f64>,
}

impl Compared {
    /// A window and its server's CPU per request (µs); an error if any
    /// answer was not 2xx.
    pub(super) fn push(&mut self, o: &Outcome, cpu_us: f64) -> std::io::Result<()> {
        if o.errors > 0 {
            return Err(std::io::Error::other(format!(
                "{}: {} answers were not 2xx",
                o.name, o.errors
            )));
        }
        self.rates.push(o.rate());
        self.cpu_us.push(cpu_us);
        self.p99.push(o.pct(0.99));
        Ok(())
    }

    pub(super) fn rate(&self) -> f64 {
        median(&self.rates)
    }

    pub(super) fn cpu_us(&self) -> f64 {
        median(&self.cpu_us)
    }

    /// Each window's rate, in order.
    pub(super) fn rates(&self) -> &[f64] {
        &self.rates
    }

    /// The windows' p99s (ms), median.
    pub(super) fn p99_median(&self) -> f64 {
        median(&self.p99)
    }

    /// "`what`: rate (each round), CPU per request, p99", medians.
    pub(super) fn describe(&self, what: &str) -> String {
        format!(
            "{what} {r:.0}/s ({}), {c:.1} µs of server CPU per request ({}), p99 {p:.2} ms ({})",
            each(&self.rates),
            each(&self.cpu_us),
            self.p99
                .iter()
                .map(|p| format!("{p:.1}"))
                .collect::<Vec<_>>()
                .join(" / "),
            r = self.rate(),
            c = self.cpu_us(),
            p = median(&self.p99),
        )
    }

    /// `b` against `a`: "rate ±x%, CPU per request ±y%".
    pub(super) fn versus(a: &Self, b: &Self) -> String {
        format!(
            "rate {:+.1}%, CPU per request {:+.1}%",
            change(b.rate(), a.rate()),
            change(b.cpu_us(), a.cpu_us())
        )
    }
}

/// The order of two sides in round `round`: ABBA..., so a machine that
/// drifts over the run does not always favour the side that goes first.
pub(super) fn order<T: Copy>(round: usize, sides: &[T]) -> Vec<T> {
    let mut v = sides.to_vec();
    if round % 2 == 1 {
        v.reverse();
    }
    v
}

/// A durable server of `bin` on a fresh data directory (kept alive by the
/// returned guard). The guard comes first, so that `let (_guard, server)`
/// drops the server (bindings go in reverse order) before the directory:
/// the other way round a server's checkpoint could write into a directory
/// already removed, and leave it behind.
pub(super) fn fresh_server(
    config: &BenchConfig,
    bin: &Path,
    name: &str,
) -> std::io::Result<(Option<taskgate_testkit::TempDir>, Proc)> {
    let (dir, guard) = data_dir(config, name)?;
    let dir = dir.to_string_lossy().into_owned();
    let server = Proc::start_exe(bin, &serve_args(&["--data-dir", dir.as_str()]))?;
    Ok((guard, server))
}

/// Heartbeats for `tasks` of `{prefix}-0` to `{prefix}-{allocations-1}`,
/// every `every`, on one keep-alive connection, as their agents would send
/// them, until stopped. The server closes a connection that stays idle for
/// its `--header-timeout` (10 s, as long as `HEARTBEAT_EVERY`); a
/// heartbeat that finds its connection closed is sent again on a new one,
/// as a pooling HTTP client does, and counted.
struct Heartbeats {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<Beaten>>,
}

/// What `Heartbeats` did.
#[derive(Debug, Default, Clone, Copy)]
struct Beaten {
    sent: u64,
    /// Heartbeats that found their connection closed by the server.
    reopened: u64,
}

/// `Beaten::reopened` over every `Heartbeats` of the run, for the notes.
static REOPENED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The heartbeats sent again on a new connection so far, as a note.
fn reopened() -> String {
    format!(
        "{} heartbeats found their keep-alive connection closed by the server (idle for its \
         10 s header timeout) and were sent again on a new one",
        REOPENED.load(std::sync::atomic::Ordering::Relaxed)
    )
}

impl Heartbeats {
    fn start(
        addr: SocketAddr,
        prefix: &'static str,
        allocations: usize,
        tasks: &'static [&'static str],
        every: Duration,
    ) -> Self {
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let mut conn = Conn::open(addr).await?;
            let mut done = Beaten::default();
            loop {
                let began = Instant::now();
                for a in 0..allocations {
                    for t in tasks {
                        let path = format!("/v1/allocations/{prefix}-{a}/tasks/{t}/heartbeat");
                        let status = match conn.call("PUT", &path, b"").await {
                            Ok(status) => status,
                            Err(_) => {
                                done.reopened += 1;
                                REOPENED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                conn = Conn::open(addr).await?;
                                conn.call("PUT", &path, b"").await?
                            }
                        };
                        if status != 204 {
                            return Err(std::io::Error::other(format!(
                                "a heartbeat answered {status}: {}",
                                String::from_utf8_lossy(&conn.body)
                            )));
                        }
                        done.sent += 1;
                    }
                }
                tokio::select! {
                    _ = &mut stopped => return Ok(done),
                    () = tokio::time::sleep_until((began + every).into()) => {}
                }
            }
        });
        Self { stop, task }
    }

    /// Stops them; what they did.
    async fn stop(self) -> std::io::Result<Beaten> {
        let _ = self.stop.send(());
        self.task.await.map_err(std::io::Error::other)?
    }
}

/// An error if any task of `{prefix}-0` to `{prefix}-{n-1}` was declared
/// lost (the measured windows must not lose any: a loss is a write of its
/// own and changes what the reports find).
async fn none_lost(addr: SocketAddr, prefix: &str, n: usize) -> std::io::Result<()> {
    let mut conn = Conn::open(addr).await?;
    for i in 0..n {
        let status = conn
            .call("GET", &format!("/v1/allocations/{prefix}-{i}"), b"")
            .await?;
        let body = String::from_utf8_lossy(&conn.body);
        if status != 200 || body.contains(r#""lost":true"#) {
            return Err(std::io::Error::other(format!(
                "{prefix}-{i}: a task was lost during the measurement ({status}): {body}"
            )));
        }
    }
    Ok(())
}

/// Reports with events on a fresh durable server of `bin`: `--clients`
/// allocations of `spec` (one per client) given full histories, then
/// `--duration` of reports with an event on `web` with full answers, and
/// as long again with `Prefer: return=minimal` (as `taskgate agent`
/// sends them). With `keep_alive`, the other four tasks' heartbeats go on
/// meanwhile (every `HEARTBEAT_EVERY`), and no task may be lost by the
/// end. The two outcomes (named `name` with ", full answers" and ",
/// return=minimal") with the server's CPU per request.
async fn events_windows(
    config: &BenchConfig,
    bin: &Path,
    spec: &str,
    keep_alive: bool,
    name: &str,
) -> std::io::Result<Vec<(Outcome, f64)>> {
    let (_guard, server) = fresh_server(config, bin, "liveness-events")?;
    let (addr, clients) = (server.addr, config.clients);
    register(addr, "events", 0..clients, clients, spec).await?;
    fill_histories(addr, "events", 0..clients, clients).await?;
    let beats = keep_alive
        .then(|| Heartbeats::start(addr, "events", clients, &QUIET_TASKS, HEARTBEAT_EVERY));
    let mut out = Vec::new();
    for (what, headers) in [
        ("full answers", ""),
        ("return=minimal", "Prefer: return=minimal\r\n"),
    ] {
        out.push(
            drive_cpu(
                &format!("{name}, {what}"),
                &server,
                clients,
                config.duration,
                headers,
                event_reports("events"),
            )
            .await?,
        );
    }
    if let Some(beats) = beats {
        beats.stop().await?;
        none_lost(addr, "events", clients).await?;
    }
    Ok(out)
}

/// The size of a five-task allocation's view with full histories (what a
/// report's full answer carries) on a server of `bin`, for `spec`.
async fn view_bytes(config: &BenchConfig, bin: &Path, spec: &str) -> std::io::Result<usize> {
    let (_guard, server) = fresh_server(config, bin, "liveness-view")?;
    register(server.addr, "events", 0..1, 1, spec).await?;
    fill_histories(server.addr, "events", 0..1, 1).await?;
    let mut conn = Conn::open(server.addr).await?;
    conn.call("GET", "/v1/allocations/events-0", b"").await?;
    Ok(conn.body.len())
}

/// Issue 31: reports at most 5% slower with TTLs. Reports with events (as
/// the `events` scenario sends them, on allocations with full
/// histories), durable, on allocations whose five tasks all run under a
/// 30 s TTL against the same without TTLs; fresh servers of this build,
/// `--rounds` alternations; full answers, then minimal ones. The four
/// tasks the reports leave alone get heartbeats every 10 s on both sides
/// (a heartbeat for a task without a TTL is taken and ignored), as their
/// agents would send them.
pub(super) async fn ttl_cost(config: &BenchConfig) -> std::io::Result<(Vec<Outcome>, String)> {
    let bin = super::server_bin()?;
    let with = five_tasks_with_ttl(TTL);
    let rounds = config.rounds as usize;
    let mut rows = Vec::new();
    // [no TTL, TTL] × [full, minimal]
    let mut seen: [[Compared; 2]; 2] = Default::default();
    for round in 0..rounds {
        for ttl in order(round, &[false, true]) {
            let (spec, what) = if ttl {
                (with.as_str(), "every task under a 30 s TTL")
            } else {
                (FIVE_TASKS, "no TTL")
            };
            let name = format!(
                "reports with events, durable, full histories, {what}, round {}",
                round + 1
            );
            let side = usize::from(ttl);
            let windows = events_windows(config, &bin, spec, true, &name).await?;
            for (answer, (o, cpu)) in windows.into_iter().enumerate() {
                seen[side][answer].push(&o, cpu)?;
                rows.push(o);
            }
        }
    }
    let sizes = (
        view_bytes(config, &bin, FIVE_TASKS).await?,
        view_bytes(config, &bin, &with).await?,
    );
    let line = |answer: usize, what: &str| {
        let [without, with] = [&seen[0][answer], &seen[1][answer]];
        format!(
            "- {what}: {}; {}: {} (target: rate no worse than -5%)",
            without.describe("without TTLs"),
            with.describe(&format!("every task under a {TTL} TTL")),
            Compared::versus(without, with),
        )
    };
    let note = format!(
        "liveness, TTL cost: reports with events on {clients} five-task allocations with full \
         histories, durable, fresh servers, {rounds} alternations (medians); heartbeats for the \
         other four tasks every {every:?} on both sides; no task was lost:\n{}\n{}\n- a full \
         answer (the allocation's view) is {} bytes without TTLs, {} with them\n- {}",
        line(0, "full answers"),
        line(1, "return=minimal"),
        sizes.0,
        sizes.1,
        reopened(),
        clients = config.clients,
        every = HEARTBEAT_EVERY,
    );
    Ok((rows, note))
}

#[derive(Clone, Copy)]
enum Load {
    Heartbeats,
    Reports,
    EventsMinimal,
}

/// Issue 31: heartbeats at least 3× the rate of durable reports, same
/// machine, same run. One durable server, `--clients` five-task
/// allocations with every task under a 30 s TTL; `--rounds` alternations
/// of heartbeats on `web` (running), durable reports as the `durable`
/// scenario sends them, and reports with an event and `Prefer:
/// return=minimal` as `taskgate agent` sends them (on allocations of
/// their own); every `web` also beats every 10 s throughout, as its agent
/// would between the windows that touch it.
pub(super) async fn heartbeats(config: &BenchConfig) -> std::io::Result<(Vec<Outcome>, String)> {
    let bin = super::server_bin()?;
    let (_guard, server) = fresh_server(config, &bin, "liveness-heartbeats")?;
    let (addr, clients) = (server.addr, config.clients);
    let rounds = config.rounds as usize;
    // Heartbeats and plain reports on `bench-*`, reports with events on
    // `events-*` (so the plain reports' answers carry no histories, as in
    // `durable`).
    let spec = five_tasks_with_ttl(TTL);
    register(addr, "bench", 0..clients, clients, &spec).await?;
    register(addr, "events", 0..clients, clients, &spec).await?;
    // Between their windows every `web` still beats, as its agent would:
    // a window may wait for several others, longer than the TTL.
    let keep = [
        Heartbeats::start(addr, "bench", clients, &["web"], HEARTBEAT_EVERY),
        Heartbeats::start(addr, "events", clients, &["web"], HEARTBEAT_EVERY),
    ];
    let mut rows = Vec::new();
    let mut seen: [Compared; 3] = Default::default();
    let loads = [Load::Heartbeats, Load::Reports, Load::EventsMinimal];
    for round in 0..rounds {
        for load in order(round, &loads) {
            let round = round + 1;
            let (o, cpu) = match load {
                Load::Heartbeats => {
                    // A task beats while it runs: started again, whatever
                    // the reports' window left (a `running` report on a
                    // task already running is another agent's claim, 409).
                    let path = |i| format!("/v1/allocations/bench-{i}/tasks/web/state");
                    for (state, what) in [("pending", "restart"), ("running", "start")] {
                        let body = format!(r#"{{"state": "{state}"}}"#);
                        put_each(addr, 0..clients, clients, path, body, &[200], what).await?;
                    }
                    drive_cpu(
                        &format!("heartbeats (PUT .../heartbeat, 204), round {round}"),
                        &server,
                        clients,
                        config.duration,
                        "",
                        |c, _| {
                            let path = format!("/v1/allocations/bench-{c}/tasks/web/heartbeat");
                            ("PUT", path, Vec::new())
                        },
                    )
                    .await?
                }
                Load::Reports => {
                    drive_cpu(
                        &format!("reports, durable (as `durable`), round {round}"),
                        &server,
                        clients,
                        config.duration,
                        "",
                        flip_web,
                    )
                    .await?
                }
                Load::EventsMinimal => {
                    drive_cpu(
                        &format!(
                            "reports with an event, durable, return=minimal (as agents \
                             send them), round {round}"
                        ),
                        &server,
                        clients,
                        config.duration,
                        "Prefer: return=minimal\r\n",
                        event_reports("events"),
                    )
                    .await?
                }
            };
            if let Err(e) = seen[load as usize].push(&o, cpu) {
                // Say why: a heartbeat refused, or a task lost.
                let mut why = vec![e.to_string()];
                for beats in keep {
                    if let Err(e) = beats.stop().await {
                        why.push(e.to_string());
                    }
                }
                for prefix in ["bench", "events"] {
                    if let Err(e) = none_lost(addr, prefix, clients).await {
                        why.push(e.to_string());
                    }
                }
                for m in [
                    "taskgate_store_refusing_writes",
                    "taskgate_store_degraded",
                    "taskgate_store_unfolded_log_bytes",
                ] {
                    why.push(format!("{m} {}", super::metric(addr, m).await?));
                }
                return Err(std::io::Error::other(why.join("; ")));
            }
            rows.push(o);
        }
    }
    for beats in keep {
        beats.stop().await?;
    }
    none_lost(addr, "bench", clients).await?;
    none_lost(addr, "events", clients).await?;
    let [beats, reports, agents] = &seen;
    let note = format!(
        "liveness, heartbeats: one durable server, {clients} five-task allocations under a {TTL} \
         TTL, {rounds} alternations (medians):\n- {}\n- {}\n- {}\n- heartbeats per durable \
         report: {r1:.2}× the rate (target ≥ 3×), {c1:.2}× fewer µs of server CPU; per report \
         as agents send them: {r2:.2}× the rate, {c2:.2}× fewer µs\n- {}",
        beats.describe("heartbeats"),
        reports.describe("durable reports"),
        agents.describe("reports with an event, return=minimal"),
        reopened(),
        clients = config.clients,
        r1 = beats.rate() / reports.rate(),
        c1 = reports.cpu_us() / beats.cpu_us(),
        r2 = beats.rate() / agents.rate(),
        c2 = agents.cpu_us() / beats.cpu_us(),
    );
    Ok((rows, note))
}

/// The server's CPU seconds (all its threads: request threads, store
/// writer, checkpoints) split as request threads and the store's.
fn server_cpu(server: &Proc) -> std::io::Result<(f64, f64)> {
    let cpu = Cpu::sample(server.child.id())?;
    Ok((cpu.requests, cpu.writer + cpu.checkpoint))
}

/// One side of the scale comparison.
struct Side {
    what: &'static str,
    args: Vec<String>,
    server: Option<Proc>,
    measured: Measured,
    lines: Vec<String>,
    rss_kib: u64,
    threads: usize,
    idle: (f64, f64),
    restarts: Vec<(Duration, u64, usize)>,
}

/// Issue 31: a million allocations with TTL'd tasks cost no timer per
/// allocation, and reports on them at most 5% slower. Two durable servers
/// of this build, each filled with `--liveness-allocations` five-task
/// allocations (`init` dead, `proxy` running, `web` pending), one with
/// every task under a 1 h TTL (so every allocation is in the timer heap
/// and nothing is lost in the run): resident memory, threads, CPU while
/// idle; reports spread over every allocation (the `scale` scenario's
/// windows), the two servers in turns, each stopped (SIGSTOP) outside its
/// own windows; restarts in turns.
pub(super) async fn scale(config: &BenchConfig) -> std::io::Result<(Vec<Outcome>, String)> {
    let size = config.liveness_allocations;
    let clients = config.clients;
    let (dir, _guard) = data_dir(config, "liveness-scale")?;
    let long = five_tasks_with_ttl(LONG_TTL);
    let mut sides = Vec::new();
    for (i, (what, spec)) in [("no TTL", FIVE_TASKS), ("TTL", long.as_str())]
        .into_iter()
        .enumerate()
    {
        let d = dir.join(format!("side-{i}")).to_string_lossy().into_owned();
        let args = serve_args(&["--data-dir", d.as_str()]);
        let server = Proc::start(&args)?;
        let addr = server.addr;
        let started = Instant::now();
        register(addr, "scale", 0..size, clients, spec).await?;
        let registered = started.elapsed();
        let rss_registered = server.rss_kib().unwrap_or(0);
        let started = Instant::now();
        let request = |i| {
            let path = format!("/v1/allocations/scale-{i}/task-states");
            ("POST", path, STARTED.to_owned())
        };
        send_each(addr, 0..size, clients, request, &[200], "starting").await?;
        let reported = started.elapsed();
        let rss_kib = server.rss_kib().unwrap_or(0);
        let threads = server.threads().unwrap_or(0);
        let timers = super::metric(addr, "taskgate_timer_entries").await?;
        let mib = |kib: u64| kib as f64 / 1024.0;
        let lines = vec![format!(
            "- {what}: {size} allocations registered in {registered:.1?} ({r:.0} MiB resident), \
             init dead and proxy running on each in {reported:.1?}: {s:.0} MiB resident \
             ({per:.0} bytes per allocation), {threads} threads, {timers:.0} entries in the \
             timer heap (taskgate_timer_entries)",
            r = mib(rss_registered),
            s = mib(rss_kib),
            per = rss_kib as f64 * 1024.0 / size as f64,
        )];
        // Still while the other side fills and is measured.
        server.signal(Signal::STOP)?;
        sides.push(Side {
            what,
            args,
            server: Some(server),
            measured: Measured::new(size, clients),
            lines,
            rss_kib,
            threads,
            idle: (0.0, 0.0),
            restarts: Vec::new(),
        });
    }

    // Idle: both running, nothing sent, for ten seconds.
    let idle_for = Duration::from_secs(10);
    for side in &sides {
        side.server
            .as_ref()
            .expect("running")
            .signal(Signal::CONT)?;
    }
    let before: Vec<(f64, f64)> = sides
        .iter()
        .map(|s| server_cpu(s.server.as_ref().expect("running")))
        .collect::<Result<_, _>>()?;
    tokio::time::sleep(idle_for).await;
    for (side, (req, store)) in sides.iter_mut().zip(before) {
        let server = side.server.as_ref().expect("running");
        let (r, s) = server_cpu(server)?;
        side.idle = (r - req, s - store);
        server.signal(Signal::STOP)?;
    }

    // Reports spread over every allocation, the sides in turns.
    let rounds = config.rounds as usize;
    for round in 0..rounds {
        for i in order(round, &[0, 1]) {
            let side = &mut sides[i];
            let server = side.server.as_ref().expect("running");
            server.signal(Signal::CONT)?;
            let store = format!("durable, {}", side.what);
            window(server, &mut side.measured, config, &store).await?;
            server.signal(Signal::STOP)?;
        }
    }
    let mut rows = Vec::new();
    for side in &mut sides {
        let server = side.server.take().expect("running");
        server.signal(Signal::CONT)?;
        none_lost(server.addr, "scale", 1).await?;
        server.terminate()?;
        // CPU per report and the store's work, over every window.
        side.lines.extend(side.measured.lines(1));
        rows.extend(side.measured.saturated.take());
        rows.extend(side.measured.paced.take());
    }

    // Restarts in turns: each loads its store, the TTL side giving every
    // running task a full TTL (a heap entry per allocation again).
    for round in 0..rounds {
        for i in order(round, &[0, 1]) {
            let side = &mut sides[i];
            let started = Instant::now();
            let server = Proc::start(&side.args)?;
            let ready = healthy(&server, started).await?;
            let rss = server.rss_kib().unwrap_or(0);
            let threads = server.threads().unwrap_or(0);
            side.restarts.push((ready, rss, threads));
            server.terminate()?;
        }
    }

    let rate = |s: &Side| median(&s.measured.windows.iter().map(|w| w.0).collect::<Vec<_>>());
    let p99 = |s: &Side| median(&s.measured.windows.iter().map(|w| w.1).collect::<Vec<_>>());
    let ready = |s: &Side| {
        median(
            &s.restarts
                .iter()
                .map(|r| r.0.as_secs_f64())
                .collect::<Vec<_>>(),
        )
    };
    let rss_restarted =
        |s: &Side| median(&s.restarts.iter().map(|r| r.1 as f64).collect::<Vec<_>>());
    let (a, b) = (&sides[0], &sides[1]);
    let mut lines = vec![format!(
        "liveness at scale: {size} five-task allocations on each of two durable servers, one \
         with every task under a {LONG_TTL} TTL:"
    )];
    for side in &sides {
        lines.extend(side.lines.iter().cloned());
    }
    for side in &sides {
        let windows: Vec<String> = side
            .measured
            .windows
            .iter()
            .map(|(r, p)| format!("{r:.0}/s p99 {p:.2} ms"))
            .collect();
        let restarts: Vec<String> = side
            .restarts
            .iter()
            .map(|(t, rss, th)| {
                format!(
                    "{:.2} s {:.0} MiB {th} threads",
                    t.as_secs_f64(),
                    *rss as f64 / 1024.0
                )
            })
            .collect();
        lines.push(format!(
            "- {}: idle 10 s: {:.2} s CPU in request threads, {:.2} s in the store's; \
             report windows: {}; restarts: {}",
            side.what,
            side.idle.0,
            side.idle.1,
            windows.join(", "),
            restarts.join(", "),
        ));
    }
    lines.push(format!(
        "- with TTLs against without: resident {d:+.0} bytes per allocation serving \
         ({ra:.0} → {rb:.0} MiB), {rd:+.0} bytes after a restart; threads {ta} → {tb}; reports \
         (medians of {rounds} windows) {wa:.0} → {wb:.0}/s ({dw:+.1}%; target: no worse than \
         -5%), p99 {pa:.2} → {pb:.2} ms; restart to healthy {ha:.2} → {hb:.2} s",
        d = (b.rss_kib as f64 - a.rss_kib as f64) * 1024.0 / size as f64,
        ra = a.rss_kib as f64 / 1024.0,
        rb = b.rss_kib as f64 / 1024.0,
        rd = (rss_restarted(b) - rss_restarted(a)) * 1024.0 / size as f64,
        ta = a.threads,
        tb = b.threads,
        wa = rate(a),
        wb = rate(b),
        dw = change(rate(b), rate(a)),
        pa = p99(a),
        pb = p99(b),
        ha = ready(a),
        hb = ready(b),
    ));
    Ok((rows, lines.join("\n")))
}

/// Issue 31: allocations without the new fields cost what they cost
/// before the third edition. Fresh durable servers of
/// `--base-server-bin` and of this build in turns, `--rounds` times:
/// durable reports as the `durable` scenario sends them, then reports with
/// events on allocations with full histories (as `events`, on `--clients`
/// allocations), with full answers and with minimal ones.
pub(super) async fn versus_base(config: &BenchConfig) -> std::io::Result<(Vec<Outcome>, String)> {
    let base = config.base_server_bin.clone().ok_or_else(|| {
        std::io::Error::other("liveness-base needs --base-server-bin (the build to compare with)")
    })?;
    let this = super::server_bin()?;
    let bins = [
        (base.as_path(), "base build"),
        (this.as_path(), "this build"),
    ];
    let rounds = config.rounds as usize;
    let mut rows = Vec::new();
    // [plain, events full, events minimal] × [base, this]
    let mut seen: [[Compared; 2]; 3] = Default::default();
    for round in 0..rounds {
        for side in order(round, &[0usize, 1]) {
            let (bin, what) = bins[side];
            let (_guard, server) = fresh_server(config, bin, "liveness-base")?;
            let clients = config.clients;
            register(server.addr, "bench", 0..clients, clients, FIVE_TASKS).await?;
            let name = format!("reports, durable, {what}, round {}", round + 1);
            let (o, cpu) =
                drive_cpu(&name, &server, clients, config.duration, "", flip_web).await?;
            seen[0][side].push(&o, cpu)?;
            rows.push(o);
            drop(server);
            let name = format!(
                "reports with events, durable, full histories, {what}, round {}",
                round + 1
            );
            let windows = events_windows(config, bin, FIVE_TASKS, false, &name).await?;
            for (answer, (o, cpu)) in windows.into_iter().enumerate() {
                seen[1 + answer][side].push(&o, cpu)?;
                rows.push(o);
            }
        }
    }
    let line = |what: &str, [b, t]: &[Compared; 2]| {
        format!(
            "- {what}: {}; {}: {}",
            b.describe("base"),
            t.describe("this build"),
            Compared::versus(b, t)
        )
    };
    let note = format!(
        "liveness, allocations without the new fields against {} ({rounds} alternations, \
         medians, fresh durable servers):\n{}\n{}\n{}\n- a full answer (the allocation's view \
         with full histories) is {} bytes on the base build, {} on this one",
        base.display(),
        line("durable reports", &seen[0]),
        line(
            "reports with events, full histories, full answers",
            &seen[1]
        ),
        line("the same, return=minimal", &seen[2]),
        view_bytes(config, &base, FIVE_TASKS).await?,
        view_bytes(config, &this, FIVE_TASKS).await?,
    );
    Ok((rows, note))
}
