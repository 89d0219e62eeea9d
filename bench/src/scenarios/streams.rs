//! `taskgate-bench --scenarios streams`: the benchmark row of issue 32
//! (event-stream readers that never read). `--stream-readers` clients
//! open `GET /v1/events` and then never read a byte, while `--clients`
//! writers send reports with an event (full answers) to five-task
//! allocations with full histories, so every change the stream renders is
//! a full view of several KiB. One durable server; windows without and
//! with the readers connected, alternated `--rounds` times (ABBA), each
//! window once as fast as the writers go and once at a fixed
//! `--stream-paced-rate` (a p99 that is the server's, not a saturated
//! queue's). Resident memory per reader: the server's RSS at the end of
//! the first window with readers (all of them still connected, never
//! having read) against the end of the window without them just before.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use tokio::{io::AsyncWriteExt, net::TcpStream};

use super::{
    BenchConfig, Outcome, drive_cpu, event_json, fill_histories,
    liveness::{Compared, fresh_server, order},
    metric, paced, percentile, register,
};

/// The first window after the readers connect (after `drive`'s one-second
/// warm-up): it takes the filling of the new streams' buffers, so the
/// windows after it measure readers that have long stopped reading.
const SETTLE: Duration = Duration::from_secs(3);

/// The writers' allocations, `events-*`.
const PREFIX: &str = "events";

/// Writer `c`'s next report on its allocation, `pending` and `running` in
/// turn, each with an event: every report is a change. The turn is kept
/// per allocation across windows (a window's first report follows the
/// last one's, whatever the number of reports between): a `running`
/// report on a task already running is another agent's claim, refused
/// 409 `task_claimed`.
fn event_reports(
    prefix: &'static str,
) -> impl Fn(usize, u64) -> (&'static str, String, Vec<u8>) + Send + Sync + Clone + 'static {
    use std::sync::atomic::{AtomicBool, Ordering};
    static RUNNING: [AtomicBool; 4096] = [const { AtomicBool::new(false) }; 4096];
    move |c, n| {
        let was_running = RUNNING[c % RUNNING.len()].fetch_xor(true, Ordering::Relaxed);
        let (state, kind) = if was_running {
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

/// Opens `n` event streams that are never read: each sends its request
/// and holds its connection. Returns once the server counts them all as
/// waiting.
async fn readers(addr: SocketAddr, n: usize) -> std::io::Result<Vec<TcpStream>> {
    let before = metric(addr, "taskgate_waiters").await?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let mut s = TcpStream::connect(addr).await?;
        s.write_all(b"GET /v1/events HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .await?;
        out.push(s);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while metric(addr, "taskgate_waiters").await? < before + n as f64 {
        if Instant::now() > deadline {
            return Err(std::io::Error::other(
                "the event-stream readers never all counted as waiting",
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(out)
}

/// Closes the readers and waits until the server has let them all go.
async fn close(addr: SocketAddr, readers: Vec<TcpStream>) -> std::io::Result<()> {
    drop(readers);
    let deadline = Instant::now() + Duration::from_secs(60);
    while metric(addr, "taskgate_waiters").await? > 0.0 {
        if Instant::now() > deadline {
            return Err(std::io::Error::other(
                "the server still counts closed event streams as waiting after 60 s",
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// The kernel's TCP buffer memory in KiB (`/proc/net/sockstat`, `TCP:
/// ... mem PAGES`): where the bytes a reader does not read wait besides
/// the server's own memory.
fn tcp_kernel_kib() -> u64 {
    std::fs::read_to_string("/proc/net/sockstat")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("TCP:"))?;
            let mut words = line.split_whitespace();
            words.find(|w| *w == "mem")?;
            words.next()?.parse::<u64>().ok()
        })
        .map_or(0, |pages| pages * 4)
}

/// Issue 32: readers that never read cost at most 256 KiB of the server's
/// memory each, and move the writers' p99 by at most 10%.
pub(super) async fn scenario(config: &BenchConfig) -> std::io::Result<(Vec<Outcome>, String)> {
    let bin = super::server_bin()?;
    let (_guard, server) = fresh_server(config, &bin, "streams")?;
    let addr = server.addr;
    let (clients, n, rounds) = (
        config.clients,
        config.stream_readers,
        config.rounds as usize,
    );
    let files = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    if (n + clients) as u64 + 256 > files {
        return Err(std::io::Error::other(format!(
            "{n} readers and {clients} writers need as many connections, and the open-files \
             limit is {files}"
        )));
    }
    register(addr, PREFIX, 0..clients, clients, super::FIVE_TASKS).await?;
    fill_histories(addr, PREFIX, 0..clients, clients).await?;
    let view = {
        let mut conn = super::Conn::open(addr).await?;
        conn.call("GET", &format!("/v1/allocations/{PREFIX}-0"), b"")
            .await?;
        conn.body.len()
    };
    let rate = config.stream_paced_rate;
    let mut rows = Vec::new();
    // [without, with] readers: saturated windows, paced p99s (ms).
    let mut seen: [Compared; 2] = Default::default();
    let mut first: [Compared; 2] = Default::default();
    let mut paced_p99: [Vec<f64>; 2] = Default::default();
    let mut rss_after: Vec<(bool, u64, u64)> = Vec::new();
    let mut memory_lines = Vec::new();
    let mut sent = 0u64;
    for round in 0..rounds {
        for with in order(round, &[false, true]) {
            let side = usize::from(with);
            let what = if with {
                format!("{n} event-stream readers that never read")
            } else {
                "no readers".to_owned()
            };
            let (rss0, tcp0) = (server.rss_kib().unwrap_or(0), tcp_kernel_kib());
            let open = if with {
                Some(readers(addr, n).await?)
            } else {
                None
            };
            let (rss1, tcp1) = (server.rss_kib().unwrap_or(0), tcp_kernel_kib());
            // The first window after the readers connect (and the same
            // on the side without them): the server fills the kernel's
            // buffers of every new stream, a cost paid once per reader.
            let offset = sent;
            let reports = event_reports(PREFIX);
            let request = move |c: usize, k: u64| reports(c, offset + k);
            let name = format!(
                "reports with an event, first window, {what}, round {}",
                round + 1
            );
            let (o, cpu) = drive_cpu(&name, &server, clients, SETTLE, "", request).await?;
            sent += o.requests + o.errors + 1_000_000;
            first[side].push(&o, cpu)?;
            rows.push(o);
            // Writers as fast as they go; each window goes on with the
            // reports' alternation, so every report is a change.
            let offset = sent;
            let reports = event_reports(PREFIX);
            let request = move |c: usize, k: u64| reports(c, offset + k);
            let name = format!(
                "reports with an event, durable, full histories, {what}, round {}",
                round + 1
            );
            let (o, cpu) = drive_cpu(&name, &server, clients, config.duration, "", request).await?;
            sent += o.requests + o.errors + 1_000_000;
            seen[side].push(&o, cpu)?;
            rows.push(o);
            // The same at a fixed rate.
            let offset = sent;
            let reports = event_reports(PREFIX);
            let request = move |c: usize, k: u64| reports(c, offset + k);
            let (lat, errors) = paced(addr, clients, rate, config.duration, request).await?;
            sent += lat.len() as u64 + 1_000_000;
            if errors > 0 {
                return Err(std::io::Error::other(format!(
                    "{errors} paced reports were not 2xx ({what})"
                )));
            }
            paced_p99[side].push(percentile(&lat, 0.99).as_secs_f64() * 1e3);
            let (rss2, tcp2) = (server.rss_kib().unwrap_or(0), tcp_kernel_kib());
            if with {
                memory_lines.push(format!(
                    "  - round {}: server RSS {:.1} MiB before the readers, {:.1} MiB once \
                     connected, {:.1} MiB after the writers' windows ({:+.1} KiB per reader over \
                     the windows, {:+.1} KiB since before they connected); the kernel's TCP \
                     buffers {tcp0} → {tcp1} → {tcp2} KiB; the stream's rendered changes {:.0} \
                     KiB",
                    round + 1,
                    rss0 as f64 / 1024.0,
                    rss1 as f64 / 1024.0,
                    rss2 as f64 / 1024.0,
                    (rss2 as f64 - rss1 as f64) / n as f64,
                    (rss2 as f64 - rss0 as f64) / n as f64,
                    metric(addr, "taskgate_stream_rendered_bytes").await? / 1024.0,
                ));
            }
            rss_after.push((with, rss2, tcp2));
            if let Some(open) = open {
                close(addr, open).await?;
            }
        }
    }
    // Per reader: the first window with readers against the window without
    // them that ended just before it (round 1: without, then with).
    let first_with = rss_after.iter().position(|r| r.0);
    let per_reader = match first_with {
        Some(i) if i > 0 && !rss_after[i - 1].0 => {
            (rss_after[i].1 as f64 - rss_after[i - 1].1 as f64) / n as f64
        }
        _ => f64::NAN,
    };
    let [without, with] = &seen;
    let med = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let p99_each = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    let p99_sat = |c: &Compared| c.p99_median();
    let note = format!(
        "event-stream readers that never read: one durable server, {clients} writers sending \
         reports with an event (full answers) to five-task allocations with full histories (a \
         view, what each change renders, is {view} bytes), {rounds} alternations of windows \
         without and with {n} readers of `GET /v1/events` that connect and never read (medians):\n\
         - server RSS per reader, the first window with readers against the window without \
           just before it: {per_reader:+.1} KiB (target ≤ 256 KiB)\n{}\n\
         - the writers' first window after the readers connect ({SETTLE:?} after a 1 s warm-up): \
           {}; {}: {}\n\
         - writers as fast as they go, after it: {}; {}: {}; p99 {:.2} → {:.2} ms ({:+.1}%; target: \
           within ±10%)\n\
         - writers at {rate:.0}/s: p99 without readers {} ms, with them {} ms: medians {:.2} → \
           {:.2} ms ({:+.1}%; target: within ±10%)",
        memory_lines.join("\n"),
        first[0].describe("without readers"),
        first[1].describe(&format!("with {n} readers")),
        Compared::versus(&first[0], &first[1]),
        without.describe("without readers"),
        with.describe(&format!("with {n} readers")),
        Compared::versus(without, with),
        p99_sat(without),
        p99_sat(with),
        100.0 * (p99_sat(with) / p99_sat(without) - 1.0),
        p99_each(&paced_p99[0]),
        p99_each(&paced_p99[1]),
        med(&paced_p99[0]),
        med(&paced_p99[1]),
        100.0 * (med(&paced_p99[1]) / med(&paced_p99[0]) - 1.0),
    );
    Ok((rows, note))
}
