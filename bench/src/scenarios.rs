//! `taskgate-bench`: a load benchmark anyone can rerun. It starts its own
//! server processes (the `taskgate` binary), drives them over loopback with a
//! fixed number of HTTP/1.1 keep-alive clients, and prints a table. The
//! ceiling (a bare axum 200 handler, also this binary) is measured in the
//! same run, so the ratios hold whatever the machine.

use std::{
    io::{BufRead, BufReader as StdBufReader},
    net::SocketAddr,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use clap::Args;

mod barriers;
mod dependencies;
mod etcd;
mod hostile_graph;
mod instructions;
mod liveness;
mod pipeline;
mod semaphores;
mod streams;
mod versus_etcd;

use rustix::process::{Pid, Signal, kill_process};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::TcpStream,
};

#[derive(Debug, Clone, Args)]
pub struct BenchConfig {
    /// Concurrent keep-alive clients per scenario.
    #[arg(long, default_value_t = 64)]
    pub clients: usize,
    /// Measured time per scenario (after a one-second warm-up).
    #[arg(long, default_value = "10s", value_parser = taskgate::units::parse_duration)]
    pub duration: Duration,
    /// Scenarios to run, comma-separated: ceiling, durable, events, memory,
    /// no-group-commit, recovery; and by name only: events-memory (events
    /// on `--in-memory`), fanout (holds 10,000 connections), scale (registers 1,000,000 allocations),
    /// checkpoint (the store's checkpoint code alone, on a file as large
    /// as the largest scale size), etcd (three replicas on a
    /// three-member etcd it starts, against etcd's own transactions) and
    /// versus-etcd (durable reports on one-task allocations against a
    /// single etcd member's puts through its JSON gateway and its gRPC
    /// API, alternated three times); the last two need etcd and etcdctl on
    /// the PATH; liveness (what TTLs cost: liveness-ttl,
    /// liveness-heartbeats, liveness-scale, and liveness-base with
    /// --base-server-bin), dependencies (dependencies-wake, and
    /// dependencies-base with --base-server-bin), dependencies-hostile (one
    /// token's hostile dependency graph against another token's reports
    /// and health; this build, and --base-server-bin if given) and
    /// instructions (the
    /// server's instructions per request under callgrind, this build with
    /// and without TTLs and --base-server-bin; needs valgrind), pipeline
    /// (`--clients` writers on one allocation and on one each, against
    /// --base-server-bin), streams (`--stream-readers` event streams
    /// that never read, alternated with none, while writers write),
    /// semaphores (a slot handed over in a line of `--semaphore-queued`
    /// parked polls) and barriers (a barrier of `--barrier-size` members
    /// opening: the last arrival to every member's parked poll answered).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "ceiling,durable,events,memory,no-group-commit,recovery"
    )]
    pub scenarios: Vec<String>,
    /// Parked start-condition waiters in the fanout scenario (10 per
    /// allocation).
    #[arg(long, default_value_t = 10_000)]
    pub fanout_waiters: usize,
    /// Allocations (of five tasks) registered for the recovery scenario.
    #[arg(long, default_value_t = 100_000)]
    pub recovery_allocations: usize,
    /// Allocation counts the scale scenario measures reports at, in
    /// increasing order (the largest is also restarted and listed).
    #[arg(long, value_delimiter = ',', default_value = "1000,100000,1000000")]
    pub scale_sizes: Vec<usize>,
    /// Allocations (of five tasks) the histories scenario gives full
    /// histories.
    #[arg(long, default_value_t = 1_000_000)]
    pub histories_allocations: usize,
    /// Runs the scale scenario on `--in-memory` (no store) instead of disk,
    /// to tell the store's share of the cost from the rest.
    #[arg(long)]
    pub scale_in_memory: bool,
    /// Measures the scale scenario's reports right after registration,
    /// without first reporting on every allocation. The first reports
    /// after registration grow each record (timestamps, counters); at
    /// 1,000 allocations a 10 s window is almost all settled records, at
    /// 1,000,000 almost all first reports, so by default every size is
    /// warmed up first and the sizes compare like with like.
    #[arg(long)]
    pub scale_no_warm_up: bool,
    /// After the scale scenario's reports as fast as they go, reports at
    /// this fixed rate for as long again, at each size: a p99 that is
    /// the server's own, not the queue of a saturated run (0: skip).
    #[arg(long, default_value_t = 10_000.0)]
    pub scale_paced_rate: f64,
    /// Measures the scale scenario in this many rounds: each size on a
    /// server of its own, filled first, then the sizes' windows in turn
    /// (1,000, 1,000,000, 1,000, 1,000,000, ...), each `--duration` long;
    /// a server is stopped (SIGSTOP) outside its own windows, so its
    /// checkpoints run in its windows only. A VM whose speed drifts over
    /// minutes then slows every size alike. With 1 (the default) one
    /// server is filled size by size and each size is measured once, as it
    /// is reached, minutes apart.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub scale_rounds: u32,
    /// Allocations the etcd scenario fills its prefix with before a new
    /// replica joins it (initial sync time and memory).
    #[arg(long, default_value_t = 100_000)]
    pub etcd_sync_allocations: usize,
    /// The servers' `--log` filter. It must let the `taskgate listening`
    /// line through (the bench reads the address from it);
    /// `info,taskgate::http::edge=warn` turns the per-request span off.
    #[arg(long, default_value = "info")]
    pub server_log: String,
    /// The service binary the servers run (default: `taskgate` next to
    /// this binary).
    #[arg(long, env = "TASKGATE_BIN")]
    pub server_bin: Option<PathBuf>,
    /// A second service binary, the build to compare against: the
    /// liveness-base and dependencies-base scenarios alternate servers of
    /// it with servers of `--server-bin` (e.g. the build before a change,
    /// from a `git worktree` of its commit).
    #[arg(long, env = "TASKGATE_BASE_BIN")]
    pub base_server_bin: Option<PathBuf>,
    /// Alternations of each side in the liveness and dependencies
    /// comparisons (medians of them are reported); on a busy machine more
    /// rounds of a shorter `--duration` follow its load better. Also the
    /// barriers scenario's rounds (a barrier each).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: u32,
    /// Allocations (of five tasks) the liveness-scale scenario fills two
    /// servers with, one with every task under a TTL and one without.
    #[arg(long, default_value_t = 1_000_000)]
    pub liveness_allocations: usize,
    /// Dependent allocations in the dependencies scenario, each with one
    /// start-condition long-poll parked (one connection each: mind the
    /// open-files limit, `ulimit -n`, and the server's `--max-waiters`
    /// and `--max-connections`).
    #[arg(long, default_value_t = 10_000)]
    pub dependents: usize,
    /// Target allocations the dependents are spread over (each dependent
    /// depends on one target's task).
    #[arg(long, default_value_t = 100)]
    pub dependency_targets: usize,
    /// Reports on the target's tasks the dependencies-hostile scenario
    /// sends at least once its graph is registered, one after another (and
    /// more until `--duration` has passed since the first registration).
    #[arg(long, default_value_t = 2)]
    pub hostile_reports: usize,
    /// Event-stream readers (`GET /v1/events`, never read) the streams
    /// scenario holds open in its windows with readers.
    #[arg(long, default_value_t = 300)]
    pub stream_readers: usize,
    /// The fixed rate of the streams scenario's paced writer windows
    /// (reports per second, over `--clients` connections).
    #[arg(long, default_value_t = 2000.0)]
    pub stream_paced_rate: f64,
    /// Allocations (one task each) in line for the semaphore of the
    /// semaphores scenario, each with its start-condition long-poll parked
    /// (one connection each: mind `ulimit -n`).
    #[arg(long, default_value_t = 10_000)]
    pub semaphore_queued: usize,
    /// Slots of the semaphores scenario's semaphore.
    #[arg(long, default_value_t = 10)]
    pub semaphore_limit: usize,
    /// Hand-overs the semaphores scenario measures, one after another.
    #[arg(long, default_value_t = 300)]
    pub semaphore_handovers: usize,
    /// Members of the barriers scenario's barrier (2 to 1000), each an
    /// allocation with its start-condition long-poll parked (one
    /// connection each: mind `ulimit -n`).
    #[arg(long, default_value_t = 1000)]
    pub barrier_size: usize,
    /// Where the durable scenarios keep their data (a fresh temporary
    /// directory per scenario by default).
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
}

/// A server process of this binary, killed on drop.
pub(super) struct Proc {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    /// Starts `taskgate ARGS` and reads `addr=...` from its log.
    fn start(args: &[String]) -> std::io::Result<Self> {
        // Servers are the service's binary; the ceiling is this one.
        let exe = if args.first().is_some_and(|a| a == "serve") {
            server_bin()?
        } else {
            std::env::current_exe()?
        };
        Self::start_exe(&exe, args)
    }

    /// Starts `EXE ARGS` (a server of another build) and reads `addr=...`
    /// from its log.
    fn start_exe(exe: &std::path::Path, args: &[String]) -> std::io::Result<Self> {
        let mut child = Command::new(exe)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in StdBufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(addr) = line.split("addr=").nth(1)
                    && let Some(tx) = tx.take()
                {
                    let _ = tx.send(addr.trim().to_owned());
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(120))
            .map_err(|_| "the server did not log its address".to_owned())
            .and_then(|addr| addr.parse().map_err(|_| format!("bad address {addr:?}")));
        match addr {
            Ok(addr) => Ok(Self { child, addr }),
            Err(why) => {
                // Not left running (it would hold this process's stderr).
                let _ = child.kill();
                let _ = child.wait();
                Err(std::io::Error::other(why))
            }
        }
    }

    /// Bytes the server has written to storage (`/proc/PID/io`).
    fn written_bytes(&self) -> Option<u64> {
        let io = std::fs::read_to_string(format!("/proc/{}/io", self.child.id())).ok()?;
        io.lines()
            .find_map(|l| l.strip_prefix("write_bytes:"))
            .and_then(|v| v.trim().parse().ok())
    }

    fn rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }

    /// The server's threads now (`/proc/PID/task`).
    fn threads(&self) -> Option<usize> {
        std::fs::read_dir(format!("/proc/{}/task", self.child.id()))
            .ok()
            .map(Iterator::count)
    }

    /// Stops (`Signal::STOP`) or continues (`Signal::CONT`) the server.
    fn signal(&self, signal: Signal) -> std::io::Result<()> {
        kill_process(Pid::from_child(&self.child), signal).map_err(std::io::Error::from)
    }

    fn terminate(mut self) -> std::io::Result<()> {
        Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()?;
        self.child.wait()?;
        Ok(())
    }
}

/// One HTTP/1.1 keep-alive connection; just enough client for a benchmark
/// (Content-Length bodies only), so the load generator spends little CPU.
/// A minimal HTTP/1.1 keep-alive client (also used by the soak client).
pub(crate) struct Conn {
    stream: BufReader<TcpStream>,
    line: String,
    /// Header lines (each ending in CRLF) sent with every request.
    pub(crate) extra_headers: &'static str,
    /// The body of the last answer.
    pub(crate) body: Vec<u8>,
}

impl Conn {
    pub(crate) async fn open(addr: SocketAddr) -> std::io::Result<Self> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Self {
            stream: BufReader::new(stream),
            line: String::new(),
            extra_headers: "",
            body: Vec::new(),
        })
    }

    /// The last answer's body as JSON.
    pub(crate) fn json(&self) -> std::io::Result<serde_json::Value> {
        serde_json::from_slice(&self.body).map_err(std::io::Error::other)
    }

    /// Sends a request and reads the whole answer; returns the status.
    pub(crate) async fn call(
        &mut self,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> std::io::Result<u16> {
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{}",
            self.extra_headers
        );
        if !body.is_empty() {
            req.push_str("Content-Type: application/json\r\n");
        }
        req.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
        let mut bytes = req.into_bytes();
        bytes.extend_from_slice(body);
        self.stream.get_mut().write_all(&bytes).await?;

        self.line.clear();
        self.stream.read_line(&mut self.line).await?;
        let status: u16 = self
            .line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| {
                std::io::Error::other(format!(
                    "bad status line {:?} answering {method} {path}{}",
                    self.line,
                    if self.line.is_empty() {
                        " (the server closed the connection)"
                    } else {
                        ""
                    }
                ))
            })?;
        let mut length = None;
        loop {
            self.line.clear();
            if self.stream.read_line(&mut self.line).await? == 0 {
                return Err(std::io::Error::other("connection closed"));
            }
            let l = self.line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                length = v.trim().parse::<usize>().ok();
            }
        }
        let length = match (length, status) {
            (Some(n), _) => n,
            (None, 204 | 304) => 0,
            (None, _) => return Err(std::io::Error::other("no Content-Length")),
        };
        self.body.resize(length, 0);
        self.stream.read_exact(&mut self.body).await?;
        Ok(status)
    }
}

/// What one scenario measured.
pub(super) struct Outcome {
    name: String,
    requests: u64,
    errors: u64,
    elapsed: Duration,
    latencies_us: Vec<u32>,
}

impl Outcome {
    fn rate(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }

    fn pct(&self, p: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return 0.0;
        }
        let i = ((self.latencies_us.len() as f64 - 1.0) * p).round() as usize;
        f64::from(self.latencies_us[i]) / 1000.0
    }
}

/// Runs `clients` loops of `request` for warm-up plus `duration`; only the
/// requests that start after the warm-up are counted.
pub(super) async fn drive<F>(
    name: &str,
    addr: SocketAddr,
    clients: usize,
    duration: Duration,
    request: F,
) -> std::io::Result<Outcome>
where
    F: Fn(usize, u64) -> (&'static str, String, Vec<u8>) + Send + Sync + Clone + 'static,
{
    drive_on(name, &[addr], clients, duration, request).await
}

/// `drive` over several servers: client `c` talks to `addrs[c % n]`.
pub(super) async fn drive_on<F>(
    name: &str,
    addrs: &[SocketAddr],
    clients: usize,
    duration: Duration,
    request: F,
) -> std::io::Result<Outcome>
where
    F: Fn(usize, u64) -> (&'static str, String, Vec<u8>) + Send + Sync + Clone + 'static,
{
    drive_with(name, addrs, clients, duration, "", request).await
}

/// `drive_on`, each request with the header lines `headers` (each ending
/// in CRLF).
pub(super) async fn drive_with<F>(
    name: &str,
    addrs: &[SocketAddr],
    clients: usize,
    duration: Duration,
    headers: &'static str,
    request: F,
) -> std::io::Result<Outcome>
where
    F: Fn(usize, u64) -> (&'static str, String, Vec<u8>) + Send + Sync + Clone + 'static,
{
    let warmup = Duration::from_secs(1);
    let start = Instant::now();
    let measure_from = start + warmup;
    let end = measure_from + duration;
    let mut tasks = Vec::with_capacity(clients);
    for c in 0..clients {
        let request = request.clone();
        let addr = addrs[c % addrs.len()];
        tasks.push(tokio::spawn(async move {
            let mut conn = Conn::open(addr).await?;
            conn.extra_headers = headers;
            let mut lat = Vec::new();
            let (mut ok, mut errors) = (0u64, 0u64);
            let mut n = 0u64;
            loop {
                let sent = Instant::now();
                if sent >= end {
                    break;
                }
                let (method, path, body) = request(c, n);
                n += 1;
                let status = conn.call(method, &path, &body).await?;
                if sent >= measure_from {
                    lat.push(sent.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
                    if status < 300 {
                        ok += 1;
                    } else {
                        errors += 1;
                    }
                }
            }
            Ok::<_, std::io::Error>((ok, errors, lat))
        }));
    }
    let mut out = Outcome {
        name: name.to_owned(),
        requests: 0,
        errors: 0,
        elapsed: duration,
        latencies_us: Vec::new(),
    };
    for t in tasks {
        let (ok, errors, lat) = t.await.map_err(std::io::Error::other)??;
        out.requests += ok;
        out.errors += errors;
        out.latencies_us.extend(lat);
    }
    out.latencies_us.sort_unstable();
    Ok(out)
}

/// `drive_with` on `server` alone, and the server's CPU time (all its
/// threads, user and system) per answered request over the measured
/// window, in µs: a cost the other work on a shared machine moves far
/// less than it moves a rate.
pub(super) async fn drive_cpu<F>(
    name: &str,
    server: &Proc,
    clients: usize,
    duration: Duration,
    headers: &'static str,
    request: F,
) -> std::io::Result<(Outcome, f64)>
where
    F: Fn(usize, u64) -> (&'static str, String, Vec<u8>) + Send + Sync + Clone + 'static,
{
    let (pid, from) = (server.child.id(), tokio::time::Instant::now());
    // The window drive_with counts: after its one-second warm-up.
    let cpu = tokio::spawn(async move {
        let total = |c: Cpu| c.requests + c.writer + c.checkpoint;
        tokio::time::sleep_until(from + Duration::from_secs(1)).await;
        let start = Cpu::sample(pid)?;
        tokio::time::sleep_until(from + Duration::from_secs(1) + duration).await;
        Ok::<_, std::io::Error>(total(Cpu::sample(pid)?.since(start)))
    });
    let o = drive_with(name, &[server.addr], clients, duration, headers, request).await?;
    let seconds = cpu.await.map_err(std::io::Error::other)??;
    let us = seconds * 1e6 / o.requests.max(1) as f64;
    Ok((o, us))
}

/// Sends `request(c, n)` on `conns` keep-alive connections at `rate`
/// requests per second in all, each connection on a fixed schedule, for
/// `duration`. A request that falls due while its connection still waits
/// for the previous answer is timed from when it was due, not from when
/// it went out: a server that stalls is charged for every request that
/// queued behind the stall, as the clients that were due would see it (a
/// client that waited for the stall to end before sending would hide it).
/// Any other request is timed from when it went out, so the timer's own
/// lateness (tokio's is up to a millisecond) is not charged to the server.
/// Returns the latencies, sorted, and the count of answers that were not
/// 2xx.
async fn paced<F>(
    addr: SocketAddr,
    conns: usize,
    rate: f64,
    duration: Duration,
    request: F,
) -> std::io::Result<(Vec<Duration>, u64)>
where
    F: Fn(usize, u64) -> (&'static str, String, Vec<u8>) + Send + Sync + Clone + 'static,
{
    let end = Instant::now() + duration;
    paced_while(addr, conns, rate, "", move |due| due < end, request).await
}

/// `paced`, each request with the header lines `headers` (each ending in
/// CRLF), for as long as `more(due)` says a request due then is sent.
pub(super) async fn paced_while<F, M>(
    addr: SocketAddr,
    conns: usize,
    rate: f64,
    headers: &'static str,
    more: M,
    request: F,
) -> std::io::Result<(Vec<Duration>, u64)>
where
    F: Fn(usize, u64) -> (&'static str, String, Vec<u8>) + Send + Sync + Clone + 'static,
    M: Fn(Instant) -> bool + Send + Sync + Clone + 'static,
{
    let every = Duration::from_secs_f64(conns as f64 / rate);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(conns);
    for c in 0..conns {
        let (request, more) = (request.clone(), more.clone());
        tasks.push(tokio::spawn(async move {
            let mut conn = Conn::open(addr).await?;
            conn.extra_headers = headers;
            let mut lat = Vec::new();
            let mut errors = 0u64;
            // Connections start spread over one interval, not all at once.
            let mut due = start + every.mul_f64(c as f64 / conns as f64);
            let mut n = 0u64;
            let mut free = start;
            while more(due) {
                tokio::time::sleep_until(due.into()).await;
                let from = if free > due { due } else { Instant::now() };
                let (method, path, body) = request(c, n);
                let status = conn.call(method, &path, &body).await?;
                free = Instant::now();
                lat.push(free - from);
                if status >= 300 {
                    errors += 1;
                }
                n += 1;
                due += every;
            }
            Ok::<_, std::io::Error>((lat, errors))
        }));
    }
    let (mut all, mut errors) = (Vec::new(), 0);
    for t in tasks {
        let (lat, e) = t.await.map_err(std::io::Error::other)??;
        all.extend(lat);
        errors += e;
    }
    all.sort_unstable();
    Ok((all, errors))
}

pub(crate) use taskgate_testkit::FIVE_TASKS;

/// The service's binary (`--server-bin`), set once per run.
static SERVER_BIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// The `taskgate` binary the servers run: `--server-bin`, or the one next
/// to this binary (cargo builds both into the same directory).
fn server_bin() -> std::io::Result<PathBuf> {
    if let Some(bin) = SERVER_BIN.get() {
        return Ok(bin.clone());
    }
    let me = std::env::current_exe()?;
    let bin = me.with_file_name("taskgate");
    if !bin.exists() {
        return Err(std::io::Error::other(format!(
            "no taskgate binary next to {} (build it: cargo build --release, or give --server-bin)",
            me.display()
        )));
    }
    Ok(bin)
}

/// The servers' `--log` filter (`--server-log`), set once per run.
static SERVER_LOG: std::sync::OnceLock<String> = std::sync::OnceLock::new();

pub(super) fn serve_args(extra: &[&str]) -> Vec<String> {
    let log = SERVER_LOG.get().map_or("info", String::as_str);
    let mut args: Vec<String> = ["serve", "--listen", "127.0.0.1:0", "--log", log]
        .map(String::from)
        .to_vec();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// One `PUT path(i)` with `body` for every `i` in `ids`, `clients`
/// keep-alive connections at a time (client `c` takes `ids.start + c`,
/// then every `clients`-th); any answer but `ok` is an error naming `what`.
async fn put_each(
    addr: SocketAddr,
    ids: std::ops::Range<usize>,
    clients: usize,
    path: impl Fn(usize) -> String + Clone + Send + 'static,
    body: String,
    ok: &'static [u16],
    what: &'static str,
) -> std::io::Result<()> {
    let request = move |i| ("PUT", path(i), body.clone());
    send_each(addr, ids, clients, request, ok, what).await
}

/// `request(i)` (method, path, body) for every `i` in `ids`, as `put_each`.
pub(super) async fn send_each(
    addr: SocketAddr,
    ids: std::ops::Range<usize>,
    clients: usize,
    request: impl Fn(usize) -> (&'static str, String, String) + Clone + Send + 'static,
    ok: &'static [u16],
    what: &'static str,
) -> std::io::Result<()> {
    let mut tasks = Vec::new();
    for c in 0..clients.min(ids.len().max(1)) {
        let (ids, request) = (ids.clone(), request.clone());
        tasks.push(tokio::spawn(async move {
            let mut conn = Conn::open(addr).await?;
            for i in (ids.start + c..ids.end).step_by(clients) {
                let (method, path, body) = request(i);
                let status = conn.call(method, &path, body.as_bytes()).await?;
                if !ok.contains(&status) {
                    return Err(std::io::Error::other(format!(
                        "{what} answered {status}: {}",
                        String::from_utf8_lossy(&conn.body)
                    )));
                }
            }
            Ok::<_, std::io::Error>(())
        }));
    }
    for t in tasks {
        t.await.map_err(std::io::Error::other)??;
    }
    Ok(())
}

/// Registers `{prefix}-{i}` for every `i` in `ids` with `spec`.
pub(super) async fn register(
    addr: SocketAddr,
    prefix: &str,
    ids: std::ops::Range<usize>,
    clients: usize,
    spec: &str,
) -> std::io::Result<()> {
    let prefix = prefix.to_owned();
    let path = move |i| format!("/v1/allocations/{prefix}-{i}");
    put_each(
        addr,
        ids,
        clients,
        path,
        spec.into(),
        &[200, 201],
        "register",
    )
    .await
}

/// Reports `web` running, then pending, on every allocation `scale-0` to
/// `scale-{size-1}` (`clients` at a time), so that the measured reports
/// find every record at its settled size and start with a real change.
async fn warm_up(addr: SocketAddr, size: usize, clients: usize) -> std::io::Result<()> {
    for state in ["running", "pending"] {
        let path = |i| format!("/v1/allocations/scale-{i}/tasks/web/state");
        let body = format!(r#"{{"state": "{state}"}}"#);
        put_each(addr, 0..size, clients, path, body, &[200], "warm-up").await?;
    }
    Ok(())
}

/// State reports to the `web` task of each client's own allocation,
/// alternating running and pending so that every report is a real change.
async fn reports(name: &str, server: &Proc, config: &BenchConfig) -> std::io::Result<Outcome> {
    register(
        server.addr,
        "bench",
        0..config.clients,
        config.clients,
        FIVE_TASKS,
    )
    .await?;
    drive(name, server.addr, config.clients, config.duration, flip_web).await
}

/// Client `c`'s next report (its `n`th) on the `web` task of its own
/// allocation `bench-{c}`: running, then pending, and so on, so that every
/// report is a real change.
pub(super) fn flip_web(c: usize, n: u64) -> (&'static str, String, Vec<u8>) {
    let state = if n.is_multiple_of(2) {
        "running"
    } else {
        "pending"
    };
    (
        "PUT",
        format!("/v1/allocations/bench-{c}/tasks/web/state"),
        format!(r#"{{"state": "{state}"}}"#).into_bytes(),
    )
}

/// An event as agents send them with their reports (Nomad's task events
/// carry a type, a message and a few details).
pub(super) fn event_json(kind: &str, n: u64) -> String {
    format!(
        r#"{{"type": "{kind}", "message": "report {n} of this task, sent by the benchmark", "details": {{"exit_code": "0", "signal": "0"}}}}"#
    )
}

/// Allocations the events scenario gives full histories, to measure the
/// memory they take (the reports go to the first `--clients` of them).
const EVENT_MEMORY_ALLOCATIONS: usize = 4000;

/// As `reports`, but each report carries an event and every task of every
/// allocation first gets a full history (`MAX_EVENTS` events each, in
/// batch reports): what a report costs once an allocation has run for a
/// while, since the response and the record include every task's history.
/// Also measures the server's memory per allocation's full histories.
async fn reports_with_events(
    server: &Proc,
    config: &BenchConfig,
    store: &str,
) -> std::io::Result<(Outcome, String)> {
    use taskgate::lifecycle::MAX_EVENTS;
    let count = EVENT_MEMORY_ALLOCATIONS.max(config.clients);
    register(server.addr, "events", 0..count, config.clients, FIVE_TASKS).await?;
    let before = server.rss_kib().unwrap_or(0);
    fill_histories(server.addr, "events", 0..count, config.clients).await?;
    let after = server.rss_kib().unwrap_or(0);
    let per = after.saturating_sub(before) as f64 * 1024.0 / count as f64;
    let events = (5 * MAX_EVENTS) as f64;
    let note = format!(
        "events: {count} allocations of five tasks, every task given {MAX_EVENTS} events: \
         resident memory {b:.0} → {a:.0} MiB, {per:.0} bytes per allocation's histories \
         ({each:.0} per event)",
        b = before as f64 / 1024.0,
        a = after as f64 / 1024.0,
        each = per / events,
    );
    let outcome = drive(
        &format!("reports with events, {store}, full histories"),
        server.addr,
        config.clients,
        config.duration,
        event_reports("events"),
    )
    .await?;
    Ok((outcome, note))
}

/// Gives every task of the five-task allocations `{prefix}-{i}`, `i` in
/// `ids`, a full history (`MAX_EVENTS` events each, and one more), in
/// batch reports over `clients` connections: every task reported running,
/// pending (restarting), running and so on, ending running. Each report
/// is a change: a second `running` of a running task without its run
/// would be refused (`task_claimed`), and with it is a retry that records
/// nothing.
pub(super) async fn fill_histories(
    addr: SocketAddr,
    prefix: &str,
    ids: std::ops::Range<usize>,
    clients: usize,
) -> std::io::Result<()> {
    use taskgate::lifecycle::MAX_EVENTS;
    let mut fill = Vec::new();
    for c in 0..clients {
        let prefix = prefix.to_owned();
        let ids = ids.clone();
        fill.push(tokio::spawn(async move {
            let mut conn = Conn::open(addr).await?;
            for i in (ids.start + c..ids.end).step_by(clients) {
                for n in 0..=MAX_EVENTS as u64 {
                    let (state, kind) = if n % 2 == 0 {
                        ("running", "Started")
                    } else {
                        ("pending", "Restarting")
                    };
                    let tasks: Vec<String> = ["init", "proxy", "web", "announce", "cleanup"]
                        .iter()
                        .map(|t| {
                            format!(
                                r#""{t}": {{"state": "{state}", "event": {}}}"#,
                                event_json(kind, n)
                            )
                        })
                        .collect();
                    let body = format!(r#"{{"tasks": {{{}}}}}"#, tasks.join(", "));
                    let path = format!("/v1/allocations/{prefix}-{i}/task-states");
                    let status = conn.call("POST", &path, body.as_bytes()).await?;
                    if status != 200 {
                        return Err(std::io::Error::other(format!(
                            "filling the event history answered {status}"
                        )));
                    }
                }
            }
            Ok::<_, std::io::Error>(())
        }));
    }
    for t in fill {
        t.await.map_err(std::io::Error::other)??;
    }
    Ok(())
}

/// Client `c`'s `n`th report with an event on the `web` task of its own
/// allocation `{prefix}-{c}`: pending (restarting), then running (started),
/// and so on, so that every report is a real change.
pub(super) fn event_reports(
    prefix: &'static str,
) -> impl Fn(usize, u64) -> (&'static str, String, Vec<u8>) + Send + Sync + Clone + 'static {
    move |c, n| {
        let (state, kind) = if n % 2 == 0 {
            ("pending", "Restarting")
        } else {
            ("running", "Started")
        };
        (
            "PUT",
            format!("/v1/allocations/{prefix}-{c}/tasks/web/state"),
            format!(
                r#"{{"state": "{state}", "event": {}}}"#,
                event_json(kind, n)
            )
            .into_bytes(),
        )
    }
}

pub(super) fn data_dir(
    config: &BenchConfig,
    name: &str,
) -> std::io::Result<(PathBuf, Option<taskgate_testkit::TempDir>)> {
    match &config.work_dir {
        Some(dir) => {
            let d = dir.join(name);
            let _ = std::fs::remove_dir_all(&d);
            Ok((d, None))
        }
        None => {
            let t = taskgate_testkit::TempDir::new(name)?;
            Ok((t.path().to_owned(), Some(t)))
        }
    }
}

/// Runs the chosen scenarios and prints the table.
pub async fn run(config: BenchConfig) -> std::io::Result<()> {
    let _ = SERVER_LOG.set(config.server_log.clone());
    if let Some(bin) = &config.server_bin {
        let _ = SERVER_BIN.set(bin.clone());
    }
    let mut outcomes: Vec<Outcome> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    let load_before = load_average();
    for scenario in &config.scenarios {
        eprintln!("bench: {scenario} ... (load average {})", load_average());
        match scenario.as_str() {
            "ceiling" => {
                let server =
                    Proc::start(&["ceiling".into(), "--listen".into(), "127.0.0.1:0".into()])?;
                outcomes.push(
                    drive(
                        "ceiling: bare axum 200",
                        server.addr,
                        config.clients,
                        config.duration,
                        |_, _| ("GET", "/".to_owned(), Vec::new()),
                    )
                    .await?,
                );
            }
            "durable" | "no-group-commit" => {
                let (dir, _guard) = data_dir(&config, scenario)?;
                let dir = dir.to_string_lossy().into_owned();
                let mut extra = vec!["--data-dir", dir.as_str()];
                if scenario == "no-group-commit" {
                    extra.extend(["--commit-batch", "1"]);
                }
                let server = Proc::start(&serve_args(&extra))?;
                let name = if scenario == "durable" {
                    "reports, durable (group commit)"
                } else {
                    "reports, durable, one commit per write"
                };
                outcomes.push(reports(name, &server, &config).await?);
            }
            "events" => {
                let (dir, _guard) = data_dir(&config, scenario)?;
                let dir = dir.to_string_lossy().into_owned();
                let server = Proc::start(&serve_args(&["--data-dir", dir.as_str()]))?;
                let (outcome, note) = reports_with_events(&server, &config, "durable").await?;
                outcomes.push(outcome);
                notes.push(note);
            }
            "events-memory" => {
                let server = Proc::start(&serve_args(&["--in-memory"]))?;
                let (outcome, note) = reports_with_events(&server, &config, "--in-memory").await?;
                outcomes.push(outcome);
                notes.push(note);
            }
            "memory" => {
                let server = Proc::start(&serve_args(&["--in-memory"]))?;
                outcomes.push(reports("reports, --in-memory", &server, &config).await?);
            }
            "recovery" => notes.push(recovery(&config).await?),
            "fanout" => notes.push(fanout(&config).await?),
            "checkpoint" => notes.push(checkpoint(&config).await?),
            "versus-etcd" => {
                let (rows, note) = versus_etcd::scenario(&config).await?;
                outcomes.extend(rows);
                notes.push(note);
            }
            "etcd" => {
                let (rows, note) = etcd::scenario(&config).await?;
                outcomes.extend(rows);
                notes.push(note);
            }
            "histories" => notes.push(histories(&config).await?),
            "liveness"
            | "liveness-ttl"
            | "liveness-heartbeats"
            | "liveness-scale"
            | "liveness-base" => {
                let all = scenario == "liveness";
                let mut parts = Vec::new();
                if all || scenario == "liveness-ttl" {
                    parts.push(liveness::ttl_cost(&config).await?);
                }
                if all || scenario == "liveness-heartbeats" {
                    parts.push(liveness::heartbeats(&config).await?);
                }
                if all || scenario == "liveness-scale" {
                    parts.push(liveness::scale(&config).await?);
                }
                if scenario == "liveness-base" || (all && config.base_server_bin.is_some()) {
                    parts.push(liveness::versus_base(&config).await?);
                } else if all {
                    notes.push("liveness-base skipped: no --base-server-bin".into());
                }
                for (rows, note) in parts {
                    outcomes.extend(rows);
                    notes.push(note);
                }
            }
            "instructions" => notes.push(instructions::scenario(&config).await?),
            "pipeline" => {
                let (rows, note) = pipeline::scenario(&config).await?;
                outcomes.extend(rows);
                notes.push(note);
            }
            "streams" => {
                let (rows, note) = streams::scenario(&config).await?;
                outcomes.extend(rows);
                notes.push(note);
            }
            "dependencies-hostile" => notes.push(hostile_graph::scenario(&config).await?),
            "semaphores" => notes.push(semaphores::handover(&config).await?),
            "barriers" => notes.push(barriers::opening(&config).await?),
            "dependencies" | "dependencies-wake" | "dependencies-base" => {
                if scenario != "dependencies-base" {
                    notes.push(dependencies::wake(&config).await?);
                }
                if scenario == "dependencies-base"
                    || (scenario == "dependencies" && config.base_server_bin.is_some())
                {
                    let (rows, note) = dependencies::versus_base(&config).await?;
                    outcomes.extend(rows);
                    notes.push(note);
                } else if scenario == "dependencies" {
                    notes.push("dependencies-base skipped: no --base-server-bin".into());
                }
            }
            "scale" => {
                let (rows, note) = scale(&config).await?;
                outcomes.extend(rows);
                notes.push(note);
            }
            other => {
                return Err(std::io::Error::other(format!("unknown scenario {other:?}")));
            }
        }
    }
    let ceiling = outcomes
        .iter()
        .find(|o| o.name.starts_with("ceiling"))
        .map(Outcome::rate);
    println!(
        "\n{} clients, {:?} per scenario, {} cores; load average (1, 5, 15 min) {} at the \
         start, {} at the end\n",
        config.clients,
        config.duration,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_before,
        load_average(),
    );
    println!("| scenario | requests | errors | req/s | p50 ms | p99 ms | max ms | of ceiling |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for o in &outcomes {
        let share = ceiling.map_or("-".to_owned(), |c| format!("{:.0}%", 100.0 * o.rate() / c));
        println!(
            "| {} | {} | {} | {:.0} | {:.2} | {:.2} | {:.2} | {} |",
            o.name,
            o.requests,
            o.errors,
            o.rate(),
            o.pct(0.5),
            o.pct(0.99),
            o.pct(1.0),
            share
        );
    }
    for n in notes {
        println!("\n{n}");
    }
    Ok(())
}

/// The machine's load averages over 1, 5 and 15 minutes (`/proc/loadavg`):
/// how busy the shared cores were besides the benchmark.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg").map_or_else(
        |_| "unknown".to_owned(),
        |l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
    )
}

/// Registers many allocations on a durable server, stops it, and measures
/// the restart until `/v1/health` is 200, and the memory then.
async fn recovery(config: &BenchConfig) -> std::io::Result<String> {
    let (dir, _guard) = data_dir(config, "recovery")?;
    let dir = dir.to_string_lossy().into_owned();
    let args = serve_args(&["--data-dir", dir.as_str()]);
    let server = Proc::start(&args)?;
    let started = Instant::now();
    register(
        server.addr,
        "rec",
        0..config.recovery_allocations,
        config.clients,
        FIVE_TASKS,
    )
    .await?;
    let registering = started.elapsed();
    server.terminate()?;

    let started = Instant::now();
    let server = Proc::start(&args)?;
    let ready = healthy(&server, started).await?;
    let mut conn = Conn::open(server.addr).await?;
    let status = conn.call("GET", "/v1/allocations/rec-0", b"").await?;
    let rss = server.rss_kib().unwrap_or(0);
    Ok(format!(
        "recovery: {n} allocations of 5 tasks (registered in {registering:.1?}); restart to healthy \
         in {ready:.2?}; resident memory after load {mib:.0} MiB; first read answered {status}",
        n = config.recovery_allocations,
        mib = rss as f64 / 1024.0,
    ))
}

/// The events one task's agent sends in a restart loop, as
/// `taskgate agent` words them: started (with its pid), terminated with its
/// exit code, restarting after the policy's delay. `n` counts the task's
/// events; `pid` is unique per start.
fn agent_event(n: usize, pid: usize) -> String {
    match n % 3 {
        0 => format!(r#"{{"type": "Started", "details": {{"pid": "{pid}"}}}}"#),
        1 => r#"{"type": "Terminated", "message": "Exit Code: 1", "details": {"exit_code": "1"}}"#
            .to_owned(),
        _ => r#"{"type": "Restarting", "message": "restarting in 15000ms", "details": {"delay": "15000ms"}}"#
            .to_owned(),
    }
}

/// Full histories at `--histories-allocations` five-task allocations: each
/// task given `MAX_EVENTS` events as an agent sends them in a restart loop
/// (`agent_event`; pids wrap as Linux's do, at 2^22), through batch
/// reports; the resident memory before and after, per event; then a
/// restart, timed to healthy, and its memory.
async fn histories(config: &BenchConfig) -> std::io::Result<String> {
    use taskgate::lifecycle::MAX_EVENTS;
    let (dir, _guard) = data_dir(config, "histories")?;
    let dir = dir.to_string_lossy().into_owned();
    let args = serve_args(&["--data-dir", dir.as_str()]);
    let server = Proc::start(&args)?;
    let count = config.histories_allocations;
    let started = Instant::now();
    register(server.addr, "hist", 0..count, config.clients, FIVE_TASKS).await?;
    let registered = started.elapsed();
    let before = server.rss_kib().unwrap_or(0);
    let started = Instant::now();
    let mut fill = Vec::new();
    for c in 0..config.clients.min(count) {
        let (addr, clients) = (server.addr, config.clients);
        fill.push(tokio::spawn(async move {
            let mut conn = Conn::open(addr).await?;
            let mut retried = 0u64;
            for i in (c..count).step_by(clients) {
                for n in 0..MAX_EVENTS {
                    let state = if n % 3 == 0 { "running" } else { "pending" };
                    let tasks: Vec<String> = ["init", "proxy", "web", "announce", "cleanup"]
                        .iter()
                        .enumerate()
                        .map(|(t, name)| {
                            let pid = ((i * 5 + t) * MAX_EVENTS + n) % 4_194_304;
                            format!(
                                r#""{name}": {{"state": "{state}", "event": {}}}"#,
                                agent_event(n, pid)
                            )
                        })
                        .collect();
                    let body = format!(r#"{{"tasks": {{{}}}}}"#, tasks.join(", "));
                    let path = format!("/v1/allocations/hist-{i}/task-states");
                    // As an agent does: a 503 is tried again a moment later.
                    let mut tries = 0;
                    loop {
                        let status = conn.call("POST", &path, body.as_bytes()).await?;
                        match status {
                            200 => break,
                            503 if tries < 100 => {
                                tries += 1;
                                retried += 1;
                                tokio::time::sleep(Duration::from_millis(200)).await;
                            }
                            _ => {
                                return Err(std::io::Error::other(format!(
                                    "filling the histories answered {status}: {}",
                                    String::from_utf8_lossy(&conn.body)
                                )));
                            }
                        }
                    }
                }
            }
            Ok::<_, std::io::Error>(retried)
        }));
    }
    let mut retried = 0;
    for t in fill {
        retried += t.await.map_err(std::io::Error::other)??;
    }
    let filled = started.elapsed();
    let after = server.rss_kib().unwrap_or(0);
    server.terminate()?;
    let started = Instant::now();
    let server = Proc::start(&args)?;
    let ready = healthy(&server, started).await?;
    let reloaded = server.rss_kib().unwrap_or(0);
    let events = (count * 5 * MAX_EVENTS) as f64;
    let mib = |kib: u64| kib as f64 / 1024.0;
    Ok(format!(
        "histories: {count} allocations of five tasks registered in {registered:.1?} \
         ({b:.0} MiB resident), every task given {MAX_EVENTS} agent events in {filled:.1?} \
         ({retried} reports answered 503 and tried again): \
         {a:.0} MiB resident, {per:.1} bytes per event; restarted to healthy in {ready:.2?}, \
         {r:.0} MiB resident after loading ({rper:.1} bytes per event over the registered size)",
        b = mib(before),
        a = mib(after),
        per = after.saturating_sub(before) as f64 * 1024.0 / events,
        r = mib(reloaded),
        rper = reloaded.saturating_sub(before) as f64 * 1024.0 / events,
    ))
}

/// `taskgate-bench ceiling`: the bare axum handler the benchmark compares
/// against.
pub async fn ceiling(listen: SocketAddr) -> std::io::Result<()> {
    let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind(listen).await?;
    tracing::info!(addr = %listener.local_addr()?, "ceiling listening");
    axum::serve(listener, app).await
}

/// A gate task and ten main tasks: the main tasks wait until the gate is
/// reported dead.
const FAN_SPEC: &str = r#"{"tasks": [
  {"name": "gate", "lifecycle": {"hook": "prestart"}},
  {"name": "t0"}, {"name": "t1"}, {"name": "t2"}, {"name": "t3"}, {"name": "t4"},
  {"name": "t5"}, {"name": "t6"}, {"name": "t7"}, {"name": "t8"}, {"name": "t9"}]}"#;

/// The value of an unlabelled series in the server's /metrics (0 if absent).
async fn metric(addr: SocketAddr, name: &str) -> std::io::Result<f64> {
    let mut conn = Conn::open(addr).await?;
    conn.call("GET", "/metrics", b"").await?;
    let text = String::from_utf8_lossy(&conn.body);
    Ok(text
        .lines()
        .find_map(|l| {
            l.strip_prefix(name)
                .and_then(|v| v.strip_prefix(' '))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0.0))
}

/// Store work so far: commits (count, seconds, changes) and checkpoints
/// (count, seconds, records).
async fn store_work(addr: SocketAddr) -> std::io::Result<[f64; 6]> {
    Ok([
        metric(addr, "taskgate_store_commit_duration_seconds_count").await?,
        metric(addr, "taskgate_store_commit_duration_seconds_sum").await?,
        metric(addr, "taskgate_store_commit_batch_size_sum").await?,
        metric(addr, "taskgate_store_checkpoint_duration_seconds_count").await?,
        metric(addr, "taskgate_store_checkpoint_duration_seconds_sum").await?,
        metric(addr, "taskgate_store_checkpoint_records_total").await?,
    ])
}

/// A record as large as the scale scenario's settled five-task
/// allocations (measured: the log grows by 159 bytes per report, 30 of
/// them frame head, index and allocation ID; 740 bytes in the JSON record
/// format of earlier builds).
const CHECKPOINT_RECORD_BYTES: usize = 129;

/// The store's checkpoint code alone, on a snapshot of as many records as
/// the largest scale size: fills it, then folds checkpoints of distinct
/// records picked at random (what reports spread over every allocation give
/// a checkpoint), timed by the wall clock and by the thread's CPU time.
async fn checkpoint(config: &BenchConfig) -> std::io::Result<String> {
    let (dir, _guard) = data_dir(config, "checkpoint")?;
    let size = config
        .scale_sizes
        .iter()
        .copied()
        .max()
        .unwrap_or(1_000_000);
    tokio::task::spawn_blocking(move || {
        let mut store = taskgate::store::FoldBench::create(&dir);
        let record = vec![b'x'; CHECKPOINT_RECORD_BYTES];
        let mut ids: Vec<String> = (0..size).map(|i| format!("scale-{i}")).collect();
        ids.sort_unstable();
        // The three random checkpoints (1%, 9% and 40% of the records),
        // each in key order.
        let mut rng = fastrand::Rng::with_seed(7);
        let mut order: Vec<usize> = (0..size).collect();
        let picks: Vec<Vec<usize>> = [size / 100, size * 9 / 100, size * 4 / 10]
            .into_iter()
            .map(|k| {
                rng.shuffle(&mut order);
                let mut picked = order[..k].to_vec();
                picked.sort_unstable();
                picked
            })
            .collect();
        let mut lines = vec![format!(
            "checkpoint (the store's fold into a snapshot of {size} records of \
             {CHECKPOINT_RECORD_BYTES} bytes):"
        )];
        // (wall, CPU) seconds of `work`, on this thread.
        let timed = |work: &mut dyn FnMut() -> std::io::Result<()>| {
            let cpu = || -> std::io::Result<f64> {
                Ok(proc_stat_seconds(&std::fs::read_to_string("/proc/thread-self/stat")?)?.1)
            };
            let (started, before) = (Instant::now(), cpu()?);
            work()?;
            Ok::<_, std::io::Error>((started.elapsed().as_secs_f64(), cpu()? - before))
        };
        // A checkpoint's changes are gathered before the clock starts, as
        // the store's writer gathers them while it appends.
        let mut fold = |changes: Vec<(String, Vec<u8>)>| {
            let mut changes = Some(taskgate::store::FoldChanges::new(changes));
            timed(&mut || {
                let changes = changes.take().expect("folded once");
                store.fold(changes).map(drop).map_err(std::io::Error::other)
            })
        };
        let us = |seconds: f64, n: usize| seconds * 1e6 / n.max(1) as f64;
        // Filled in ten checkpoints of new records, each after the last.
        let (mut wall, mut cpu, mut slowest) = (0.0, 0.0, 0.0f64);
        let chunk = size.div_ceil(10).max(1);
        for part in ids.chunks(chunk) {
            let (w, c) = fold(part.iter().map(|id| (id.clone(), record.clone())).collect())?;
            (wall, cpu, slowest) = (wall + w, cpu + c, slowest.max(us(w, part.len())));
        }
        lines.push(format!(
            "- filled in ten checkpoints of new records in key order: {wall:.1} s, \
             {per:.1} µs per record ({cpu_per:.1} µs of CPU; the slowest checkpoint \
             {slowest:.1} µs per record)",
            per = us(wall, size),
            cpu_per = us(cpu, size),
        ));
        for picked in &picks {
            let k = picked.len();
            let (wall, cpu) = fold(
                picked
                    .iter()
                    .map(|&i| (ids[i].clone(), record.clone()))
                    .collect(),
            )?;
            lines.push(format!(
                "- a checkpoint of {k} changed records picked at random: {wall:.2} s, \
                 {per:.1} µs per record ({cpu_per:.1} µs of CPU)",
                per = us(wall, k),
                cpu_per = us(cpu, k),
            ));
        }
        Ok(lines.join("\n"))
    })
    .await
    .map_err(std::io::Error::other)?
}

/// CPU time used so far (seconds, user + system), from `/proc`.
#[derive(Debug, Clone, Copy, Default)]
struct Cpu {
    /// The load generator: this process.
    client: f64,
    /// The server's request threads (tokio workers and the rest).
    requests: f64,
    /// The store's writer thread (log appends and fsyncs).
    writer: f64,
    /// The store's checkpoint thread.
    checkpoint: f64,
}

impl Cpu {
    /// Reads the server's threads by name (`taskgate-store`,
    /// `taskgate-checkpoint`) and this process as a whole.
    fn sample(server: u32) -> std::io::Result<Self> {
        let mut cpu = Self {
            client: proc_stat_seconds(&std::fs::read_to_string("/proc/self/stat")?)?.1,
            ..Self::default()
        };
        for entry in std::fs::read_dir(format!("/proc/{server}/task"))? {
            // A thread that ended between the listing and the read is gone
            // with its time; that is at most one short-lived thread.
            let Ok(stat) = std::fs::read_to_string(entry?.path().join("stat")) else {
                continue;
            };
            let (name, seconds) = proc_stat_seconds(&stat)?;
            match name {
                "taskgate-store" => cpu.writer += seconds,
                "taskgate-checkp" => cpu.checkpoint += seconds,
                _ => cpu.requests += seconds,
            }
        }
        Ok(cpu)
    }

    fn plus(self, other: Self) -> Self {
        Self {
            client: self.client + other.client,
            requests: self.requests + other.requests,
            writer: self.writer + other.writer,
            checkpoint: self.checkpoint + other.checkpoint,
        }
    }

    fn since(self, before: Self) -> Self {
        Self {
            client: self.client - before.client,
            requests: self.requests - before.requests,
            writer: self.writer - before.writer,
            checkpoint: self.checkpoint - before.checkpoint,
        }
    }
}

/// The name (as the kernel keeps it, at most 15 bytes) and the user +
/// system seconds of a `/proc/.../stat` line.
fn proc_stat_seconds(stat: &str) -> std::io::Result<(&str, f64)> {
    let bad = || std::io::Error::other(format!("unexpected /proc stat line {stat:?}"));
    let open = stat.find('(').ok_or_else(bad)?;
    let close = stat.rfind(')').ok_or_else(bad)?;
    let name = stat.get(open + 1..close).ok_or_else(bad)?;
    // After the name: state is field 3, utime field 14, stime field 15.
    let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
    let ticks = |i: usize| -> std::io::Result<u64> {
        fields.get(i).and_then(|v| v.parse().ok()).ok_or_else(bad)
    };
    let total = ticks(11)? + ticks(12)?;
    Ok((
        name,
        total as f64 / rustix::param::clock_ticks_per_second() as f64,
    ))
}

pub(super) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Resident memory per accepted connection that has sent nothing, on a
/// fresh in-memory server: what a connection costs before any of
/// taskgate's own code sees a request.
async fn idle_connection_bytes(n: usize) -> std::io::Result<f64> {
    let server = Proc::start(&serve_args(&["--in-memory"]))?;
    let addr = server.addr;
    let before = server.rss_kib().unwrap_or(0);
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        conns.push(tokio::net::TcpStream::connect(addr).await?);
    }
    // Every one accepted (the gauge also counts the connection asking),
    // then until the resident size stops moving: each connection's task
    // sets up its buffers when it first runs.
    let deadline = Instant::now() + Duration::from_secs(60);
    while metric(addr, "taskgate_connections").await? < (n + 1) as f64 {
        if Instant::now() > deadline {
            return Err(std::io::Error::other(
                "the idle connections were never all accepted",
            ));
        }
    }
    let mut rss = server.rss_kib().unwrap_or(0);
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = server.rss_kib().unwrap_or(0);
        if now == rss {
            break;
        }
        rss = now;
    }
    drop(conns);
    Ok((rss.saturating_sub(before) * 1024) as f64 / n as f64)
}

/// Fan-out and idle waiters: parks `fanout_waiters` start-condition
/// long-polls (10 per allocation, one connection each), measures the
/// server's memory per parked waiter and the latency of paced state reports
/// (5,000/s) while they are parked, then opens every gate with one batch
/// report per allocation and measures how fast the waiters are answered.
async fn fanout(config: &BenchConfig) -> std::io::Result<String> {
    let idle = idle_connection_bytes(config.fanout_waiters).await?;
    let (dir, _guard) = data_dir(config, "fanout")?;
    let dir = dir.to_string_lossy().into_owned();
    let server = Proc::start(&serve_args(&["--data-dir", dir.as_str()]))?;
    let addr = server.addr;
    let allocs = config.fanout_waiters.div_ceil(10);
    register(addr, "fan", 0..allocs, 64, FAN_SPEC).await?;
    register(addr, "busy", 0..64, 64, FIVE_TASKS).await?;
    let rss_before = server.rss_kib().unwrap_or(0);

    // Park the waiters, one keep-alive connection each.
    let mut waiters = Vec::with_capacity(config.fanout_waiters);
    for w in 0..config.fanout_waiters {
        let mut conn = Conn::open(addr).await?;
        let (alloc, task) = (w / 10, w % 10);
        waiters.push(tokio::spawn(async move {
            let path =
                format!("/v1/allocations/fan-{alloc}/tasks/t{task}/start-condition?wait=300s");
            let status = conn.call("GET", &path, b"").await?;
            let answered = Instant::now();
            let allowed = String::from_utf8_lossy(&conn.body).contains("\"allowed\":true");
            if status != 200 || !allowed {
                return Err(std::io::Error::other(format!("waiter answered {status}")));
            }
            Ok::<_, std::io::Error>((alloc, answered))
        }));
    }
    let parked_deadline = Instant::now() + Duration::from_secs(120);
    while metric(addr, "taskgate_waiters").await? < config.fanout_waiters as f64 {
        if Instant::now() > parked_deadline {
            return Err(std::io::Error::other("the waiters never all parked"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rss_parked = server.rss_kib().unwrap_or(0);
    let per_waiter =
        (rss_parked.saturating_sub(rss_before) * 1024) as f64 / config.fanout_waiters as f64;

    // Paced reports while they are parked: 5,000/s over 32 connections.
    let (paced, paced_errors) = paced(addr, 32, 5000.0, Duration::from_secs(5), |c, n| {
        let state = if n.is_multiple_of(2) {
            "running"
        } else {
            "pending"
        };
        (
            "PUT",
            format!("/v1/allocations/busy-{}/tasks/web/state", c % 64),
            format!(r#"{{"state": "{state}"}}"#).into_bytes(),
        )
    })
    .await?;
    if paced_errors > 0 {
        return Err(std::io::Error::other(format!(
            "{paced_errors} paced reports were refused"
        )));
    }

    // Open every gate: one batch report per allocation, 64 at a time.
    let acks: Vec<Instant> = {
        let mut tasks = Vec::new();
        for c in 0..64usize {
            tasks.push(tokio::spawn(async move {
                let mut conn = Conn::open(addr).await?;
                let mut acked = Vec::new();
                for a in (c..allocs).step_by(64) {
                    let status = conn
                        .call(
                            "POST",
                            &format!("/v1/allocations/fan-{a}/task-states"),
                            br#"{"tasks": {"gate": {"state": "dead"}}}"#,
                        )
                        .await?;
                    if status != 200 {
                        return Err(std::io::Error::other(format!("report answered {status}")));
                    }
                    acked.push((a, Instant::now()));
                }
                Ok::<_, std::io::Error>(acked)
            }));
        }
        let mut acks = vec![Instant::now(); allocs];
        for t in tasks {
            for (a, at) in t.await.map_err(std::io::Error::other)?? {
                acks[a] = at;
            }
        }
        acks
    };
    let last_ack = acks.iter().max().copied().unwrap_or_else(Instant::now);
    let mut delays = Vec::with_capacity(waiters.len());
    let mut last_answer = last_ack;
    for w in waiters {
        let (alloc, answered) = w.await.map_err(std::io::Error::other)??;
        delays.push(answered.saturating_duration_since(acks[alloc]));
        last_answer = last_answer.max(answered);
    }
    delays.sort_unstable();
    Ok(format!(
        "fanout: {w} start-condition waiters on {allocs} allocations (one connection each)\n\
         - server memory per parked waiter (socket included): {per_waiter:.0} bytes \
           ({before} KiB before parking, {parked} KiB parked)\n\
         - of which a connection costs before it sends a byte (hyper's buffers and the \
           connection task; measured on a fresh server): {idle:.0} bytes\n\
         - paced state reports while parked: {n} at 5,000/s, latency from when each was due: \
           p50 {p50:.2} ms, p99 {p99:.2} ms, max {max:.2} ms\n\
         - report acknowledged → waiter answered: p50 {f50:.1} ms, p99 {f99:.1} ms, max {fmax:.1} ms\n\
         - all {w} answered {all:.1} ms after the last report was acknowledged",
        w = config.fanout_waiters,
        before = rss_before,
        parked = rss_parked,
        n = paced.len(),
        p50 = percentile(&paced, 0.5).as_secs_f64() * 1e3,
        p99 = percentile(&paced, 0.99).as_secs_f64() * 1e3,
        max = percentile(&paced, 1.0).as_secs_f64() * 1e3,
        f50 = percentile(&delays, 0.5).as_secs_f64() * 1e3,
        f99 = percentile(&delays, 0.99).as_secs_f64() * 1e3,
        fmax = percentile(&delays, 1.0).as_secs_f64() * 1e3,
        all = last_answer
            .saturating_duration_since(last_ack)
            .as_secs_f64()
            * 1e3,
    ))
}

/// Many allocations and flat cost: grows one durable server through
/// `scale_sizes` allocations of five tasks; at each size measures state
/// reports spread over every allocation (so the whole map is touched, not a
/// hot few) and the resident memory. At the largest size it times prefix
/// listings, restarts the server and times recovery.
async fn scale(config: &BenchConfig) -> std::io::Result<(Vec<Outcome>, String)> {
    let (dir, _guard) = data_dir(config, "scale")?;
    let store = if config.scale_in_memory {
        "in memory"
    } else {
        "durable"
    };
    let args = |name: &str| {
        if config.scale_in_memory {
            serve_args(&["--in-memory"])
        } else {
            let dir = dir.join(name).to_string_lossy().into_owned();
            serve_args(&["--data-dir", dir.as_str()])
        }
    };
    let mut lines = Vec::new();
    let mut sizes: Vec<Measured> = config
        .scale_sizes
        .iter()
        .map(|&size| Measured::new(size, config.clients))
        .collect();
    let largest = config.scale_sizes.iter().copied().max().unwrap_or(0);
    // The server that holds the largest size, and how to start it again.
    let (mut server, args) = if config.scale_rounds == 1 {
        // One server, filled size by size; each size measured as reached.
        let args = args("all");
        let server = Proc::start(&args)?;
        let mut registered = 0;
        for m in &mut sizes {
            lines.extend(fill(&server, registered, m.size, config).await?);
            registered = registered.max(m.size);
            window(&server, m, config, store).await?;
            lines.extend(m.lines(1));
        }
        (server, args)
    } else {
        // A server per size, all filled before the first window. Each runs
        // only in its own windows and is stopped (SIGSTOP) in the others',
        // so a checkpoint that one window leaves unfinished goes on in that
        // size's next window, as it would under steady load, and never in
        // another size's.
        let mut servers = Vec::with_capacity(sizes.len());
        for (i, m) in sizes.iter().enumerate() {
            // A size given twice gets two servers, not one directory twice.
            let args = args(&format!("{i}-{}", m.size));
            let server = Proc::start(&args)?;
            lines.extend(fill(&server, 0, m.size, config).await?);
            server.signal(Signal::STOP)?;
            servers.push((server, args));
        }
        for _ in 0..config.scale_rounds {
            for (m, (server, _)) in sizes.iter_mut().zip(&servers) {
                server.signal(Signal::CONT)?;
                window(server, m, config, store).await?;
                server.signal(Signal::STOP)?;
            }
        }
        for (server, _) in &servers {
            server.signal(Signal::CONT)?;
        }
        for m in &sizes {
            lines.extend(m.lines(config.scale_rounds));
        }
        let largest_at = sizes.iter().position(|m| m.size == largest);
        let largest_at = largest_at.ok_or_else(|| std::io::Error::other("no --scale-sizes"))?;
        servers.swap_remove(largest_at)
    };
    let mut rows = Vec::new();
    for m in sizes {
        rows.extend(m.saturated);
        rows.extend(m.paced);
    }
    let registered = largest;
    let rss_live = server.rss_kib().unwrap_or(0);

    // Listing: the first page of a prefix that matches everything, one that
    // matches a few, and no prefix at all.
    let mut conn = Conn::open(server.addr).await?;
    let probe = registered / 2;
    for (what, path) in [
        (
            "prefix matching all",
            "/v1/allocations?prefix=scale-".to_owned(),
        ),
        (
            "prefix matching a few",
            format!("/v1/allocations?prefix=scale-{}", probe / 10),
        ),
        ("no prefix", "/v1/allocations".to_owned()),
    ] {
        let mut lat = Vec::with_capacity(200);
        for _ in 0..200 {
            let sent = Instant::now();
            let status = conn.call("GET", &path, b"").await?;
            lat.push(sent.elapsed());
            if status != 200 {
                return Err(std::io::Error::other(format!("list answered {status}")));
            }
        }
        lat.sort_unstable();
        lines.push(format!(
            "- first page, {what} (`GET {path}`, {bytes} bytes): p50 {p50:.2} ms, p99 {p99:.2} ms, max {max:.2} ms",
            bytes = conn.body.len(),
            p50 = percentile(&lat, 0.5).as_secs_f64() * 1e3,
            p99 = percentile(&lat, 0.99).as_secs_f64() * 1e3,
            max = percentile(&lat, 1.0).as_secs_f64() * 1e3,
        ));
    }
    drop(conn);

    server.terminate()?;
    let started = Instant::now();
    server = Proc::start(&args)?;
    let ready = healthy(&server, started).await?;
    let rss_recovered = server.rss_kib().unwrap_or(0);
    let mut conn = Conn::open(server.addr).await?;
    let status = conn
        .call("GET", &format!("/v1/allocations/scale-{probe}"), b"")
        .await?;
    lines.push(format!(
        "- {registered} allocations: resident memory {live:.0} MiB while serving; restart to healthy \
         in {ready:.2?}, resident memory after recovery {rec:.0} MiB; a read after it answered {status}",
        live = rss_live as f64 / 1024.0,
        rec = rss_recovered as f64 / 1024.0,
    ));
    Ok((rows, format!("scale:\n{}", lines.join("\n"))))
}

/// Registers `scale-{before}` to `scale-{size-1}` on `server` and, unless
/// `--scale-no-warm-up`, warms all of `0..size` up; says what it took.
async fn fill(
    server: &Proc,
    before: usize,
    size: usize,
    config: &BenchConfig,
) -> std::io::Result<Vec<String>> {
    let started = Instant::now();
    register(
        server.addr,
        "scale",
        before..size,
        config.clients,
        FIVE_TASKS,
    )
    .await?;
    let took = started.elapsed();
    let rss = server.rss_kib().unwrap_or(0);
    let mut lines = vec![format!(
        "- {size} allocations: registered {n} more in {took:.1?}; resident memory {mib:.0} MiB \
         ({per:.0} bytes per allocation)",
        n = size.saturating_sub(before),
        mib = rss as f64 / 1024.0,
        per = rss as f64 * 1024.0 / size as f64,
    )];
    if !config.scale_no_warm_up {
        let started = Instant::now();
        warm_up(server.addr, size, config.clients).await?;
        lines.push(format!(
            "  - warm-up at {size}: web reported running, then pending, on every allocation \
             in {:.1?}",
            started.elapsed()
        ));
    }
    Ok(lines)
}

/// What the scale scenario measured at one size, over all its windows.
struct Measured {
    size: usize,
    /// Reports sent by each client so far: every window goes on where the
    /// last one stopped, so every report is a real change.
    sent: Arc<Vec<AtomicU64>>,
    saturated: Option<Outcome>,
    paced: Option<Outcome>,
    cpu: Cpu,
    /// `store_work`'s counters, summed over the windows.
    work: [f64; 6],
    /// Each window's reports per second and p99 (ms), as fast as they go.
    windows: Vec<(f64, f64)>,
}

impl Measured {
    fn new(size: usize, clients: usize) -> Self {
        Self {
            size,
            sent: Arc::new((0..clients).map(|_| AtomicU64::new(0)).collect()),
            saturated: None,
            paced: None,
            cpu: Cpu::default(),
            work: [0.0; 6],
            windows: Vec::new(),
        }
    }

    /// Client `c`'s next report: client c owns the allocations i ≡ c (mod
    /// clients) and walks them in a scattered order; each visit flips
    /// `web` between running and pending.
    fn reports(
        &self,
        clients: usize,
    ) -> std::io::Result<
        impl Fn(usize, u64) -> (&'static str, String, Vec<u8>) + Send + Sync + Clone + 'static,
    > {
        let owned = self.size / clients;
        if owned == 0 {
            return Err(std::io::Error::other("fewer allocations than clients"));
        }
        let step = coprime_step(owned);
        let sent = self.sent.clone();
        Ok(move |c: usize, _| {
            let n = sent[c].fetch_add(1, Ordering::Relaxed) as usize;
            let slot = (n % owned) * step % owned;
            let state = if (n / owned).is_multiple_of(2) {
                "running"
            } else {
                "pending"
            };
            (
                "PUT",
                format!(
                    "/v1/allocations/scale-{}/tasks/web/state",
                    c + slot * clients
                ),
                format!(r#"{{"state": "{state}"}}"#).into_bytes(),
            )
        })
    }

    /// The notes on this size's windows.
    fn lines(&self, rounds: u32) -> Vec<String> {
        let size = self.size;
        let mut lines = Vec::new();
        if rounds > 1 {
            let each: Vec<String> = self
                .windows
                .iter()
                .map(|(rate, p99)| format!("{rate:.0}/s p99 {p99:.2} ms"))
                .collect();
            lines.push(format!(
                "  - {rounds} windows at {size}, taking turns with the other sizes (each size's \
                 server stopped outside its own): {}",
                each.join("; ")
            ));
        }
        let reports = self.saturated.as_ref().map_or(0, |r| r.requests).max(1) as f64;
        let per = |seconds: f64| seconds * 1e6 / reports;
        let cpu = self.cpu;
        lines.push(format!(
            "  - CPU per report at {size}: server {server:.1} µs (request threads {req:.1}, \
             store writer {w:.1}, checkpoints {cp:.1}), load generator {client:.1} µs",
            server = per(cpu.requests + cpu.writer + cpu.checkpoint),
            req = per(cpu.requests),
            w = per(cpu.writer),
            cp = per(cpu.checkpoint),
            client = per(cpu.client),
        ));
        let d = self.work;
        if d[0] > 0.0 {
            lines.push(format!(
                "  - while reporting at {size}: {n:.0} store commits, mean {ms:.2} ms, \
                 mean {batch:.1} changes per commit; {cp:.0} checkpoints, {cps:.2} s \
                 in all, {records:.0} records folded",
                n = d[0],
                ms = 1e3 * d[1] / d[0],
                batch = d[2] / d[0],
                cp = d[3],
                cps = d[4],
                records = d[5],
            ));
        }
        lines
    }
}

/// One window of the scale scenario at `m`'s size: reports as fast as they
/// go for `--duration`, then (unless 0) at the paced rate for as long
/// again, added to what `m` measured before.
async fn window(
    server: &Proc,
    m: &mut Measured,
    config: &BenchConfig,
    store: &str,
) -> std::io::Result<()> {
    let report = m.reports(config.clients)?;
    let size = m.size;
    let before = store_work(server.addr).await?;
    // CPU over exactly the measured window (drive's one-second warm-up
    // excluded), read by a task of its own while the clients run.
    let cpu = {
        let (pid, from) = (server.child.id(), tokio::time::Instant::now());
        let warmup = Duration::from_secs(1);
        let duration = config.duration;
        tokio::spawn(async move {
            tokio::time::sleep_until(from + warmup).await;
            let start = Cpu::sample(pid)?;
            tokio::time::sleep_until(from + warmup + duration).await;
            Ok::<_, std::io::Error>(Cpu::sample(pid)?.since(start))
        })
    };
    let saturated = drive(
        &format!("reports, {store}, {size} allocations"),
        server.addr,
        config.clients,
        config.duration,
        report.clone(),
    )
    .await?;
    let after = store_work(server.addr).await?;
    let cpu = cpu.await.map_err(std::io::Error::other)??;
    m.windows.push((saturated.rate(), saturated.pct(0.99)));
    absorb(&mut m.saturated, saturated);
    m.cpu = m.cpu.plus(cpu);
    for (sum, (a, b)) in m.work.iter_mut().zip(after.iter().zip(before)) {
        *sum += a - b;
    }
    if config.scale_paced_rate > 0.0 {
        let rate = config.scale_paced_rate;
        let (lat, errors) =
            paced(server.addr, config.clients, rate, config.duration, report).await?;
        let paced = Outcome {
            name: format!("reports at {rate:.0}/s, {store}, {size} allocations"),
            requests: lat.len() as u64 - errors,
            errors,
            elapsed: config.duration,
            latencies_us: lat
                .iter()
                .map(|d| d.as_micros().min(u128::from(u32::MAX)) as u32)
                .collect(),
        };
        absorb(&mut m.paced, paced);
    }
    Ok(())
}

/// Adds one window's outcome to the windows' total so far (the rate and
/// the percentiles of the total are over every window's requests).
fn absorb(total: &mut Option<Outcome>, window: Outcome) {
    match total {
        None => *total = Some(window),
        Some(t) => {
            t.requests += window.requests;
            t.errors += window.errors;
            t.elapsed += window.elapsed;
            t.latencies_us.extend(window.latencies_us);
            t.latencies_us.sort_unstable();
        }
    }
}

/// A step that visits every slot of `0..n` once per round (coprime to n).
fn coprime_step(n: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 { a } else { gcd(b, a % b) }
    }
    let mut step = 7_919usize;
    while n > 1 && gcd(step, n) != 1 {
        step += 2;
    }
    step
}

/// Waits (bounded) until a freshly started server answers `/v1/health` 200;
/// returns the time since `started`.
pub(super) async fn healthy(server: &Proc, started: Instant) -> std::io::Result<Duration> {
    loop {
        if started.elapsed() > Duration::from_secs(300) {
            return Err(std::io::Error::other("the server did not become healthy"));
        }
        if let Ok(mut conn) = Conn::open(server.addr).await
            && conn.call("GET", "/v1/health", b"").await? == 200
        {
            return Ok(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proc_stat_line_gives_the_thread_name_and_its_cpu_seconds() {
        let hz = rustix::param::clock_ticks_per_second() as f64;
        // A name with a space and a parenthesis: the name ends at the last ')'.
        let line = "4242 (odd) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 7 0";
        let (name, seconds) = proc_stat_seconds(line).unwrap();
        assert_eq!(name, "odd) name");
        assert!((seconds - 300.0 / hz).abs() < 1e-9, "{seconds}");
        assert!(proc_stat_seconds("4242 (cut) S 1 2").is_err());
    }

    #[test]
    fn the_threads_of_a_process_add_up_to_its_time() {
        let me = std::process::id();
        let before = Cpu::sample(me).unwrap();
        // Work until this thread's time shows (a tick is 10 ms; the loop
        // gives up after 10 s of wall time, which only a sampler that does
        // not see this busy thread would reach).
        let started = Instant::now();
        let mut x = 0u64;
        let later = loop {
            for i in 0..1_000_000u64 {
                x = x.wrapping_mul(31).wrapping_add(std::hint::black_box(i));
            }
            let now = Cpu::sample(me).unwrap().since(before);
            let seen = now.client > 0.0 && now.requests > 0.0;
            if seen || started.elapsed() > Duration::from_secs(10) {
                break now;
            }
        };
        std::hint::black_box(x);
        // No thread here is named like the store's: all of the time is
        // counted under request threads, and the process total has it too.
        assert!(later.client > 0.0, "no CPU time seen in 10 s: {later:?}");
        assert!(
            later.requests > 0.0,
            "no thread's time seen in 10 s: {later:?}"
        );
        assert_eq!((later.writer, later.checkpoint), (0.0, 0.0), "{later:?}");
    }

    fn outcome(requests: u64, errors: u64, secs: u64, latencies_us: Vec<u32>) -> Outcome {
        Outcome {
            name: "w".into(),
            requests,
            errors,
            elapsed: Duration::from_secs(secs),
            latencies_us,
        }
    }

    #[test]
    fn windows_add_up_to_one_outcome_over_all_their_requests() {
        let mut total = None;
        absorb(&mut total, outcome(30, 1, 10, vec![1, 5, 9]));
        absorb(&mut total, outcome(10, 0, 10, vec![2, 3, 100]));
        let t = total.expect("two windows absorbed");
        assert_eq!((t.requests, t.errors), (40, 1));
        assert_eq!(t.elapsed, Duration::from_secs(20));
        // The rate is over both windows' time, the percentiles over both
        // windows' requests, in order.
        assert_eq!(t.rate(), 2.0);
        assert_eq!(t.latencies_us, vec![1, 2, 3, 5, 9, 100]);
        assert_eq!(t.pct(1.0), 0.1);
    }

    #[test]
    fn a_size_in_turns_goes_on_where_its_last_window_stopped() {
        // 8 allocations, 2 clients: client 0 owns 0, 2, 4, 6; client 1
        // owns 1, 3, 5, 7.
        let m = Measured::new(8, 2);
        let first = m.reports(2).unwrap();
        let seen: Vec<_> = (0..4).map(|_| first(1, 0)).collect();
        // A later window (a new closure) takes up client 1's sequence.
        let later = m.reports(2).unwrap();
        let more: Vec<_> = (0..4).map(|_| later(1, 0)).collect();
        let ids = |rs: &[(&str, String, Vec<u8>)]| {
            let mut ids: Vec<String> = rs.iter().map(|(_, path, _)| path.clone()).collect();
            ids.sort();
            ids
        };
        let own: Vec<String> = [1, 3, 5, 7]
            .iter()
            .map(|i| format!("/v1/allocations/scale-{i}/tasks/web/state"))
            .collect();
        // Each round visits every owned allocation once: first all running,
        // then all pending, so every report changes a state.
        assert_eq!(ids(&seen), own);
        assert_eq!(ids(&more), own);
        assert!(seen.iter().all(|(_, _, b)| b == br#"{"state": "running"}"#));
        assert!(more.iter().all(|(_, _, b)| b == br#"{"state": "pending"}"#));
        assert!(
            Measured::new(1, 2).reports(2).is_err(),
            "fewer than clients"
        );
    }
}
