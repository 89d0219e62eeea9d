//! `taskgate-bench --scenarios instructions` (needs `valgrind`): the
//! server's instructions per request, counted by callgrind, for the
//! comparisons of the liveness scenarios. A rate on a machine whose
//! cores others share moves by tens of percent between windows; an
//! instruction count does not (it leaves out the kernel's work, fsync
//! included, and the time spent waiting).
//!
//! Each case runs on a fresh durable server started under
//! `valgrind --tool=callgrind --instr-atstart=no`: the allocations are
//! registered and filled, `CLIENTS` keep-alive connections opened, then
//! instrumentation is switched on (`callgrind_control -i on`), each
//! connection sends `PER_CLIENT` requests, it is switched off, and the
//! server is stopped; the total over the requests sent (with `--work-dir`
//! each case's `callgrind.out` is kept there, for `callgrind_annotate`).
//! Under valgrind the server's threads run one at a time, so its commits
//! batch differently from a native run: compare the columns, not these
//! counts with a native profile.

use std::{path::Path, process::Command};

use super::{
    BenchConfig, Conn, FIVE_TASKS, Proc, data_dir, event_reports, fill_histories, flip_web,
    liveness::five_tasks_with_ttl, put_each, register, serve_args,
};

/// Connections, and requests each sends, while instructions are counted.
const CLIENTS: usize = 8;
const PER_CLIENT: u64 = 500;

/// What the counted requests are.
#[derive(Clone, Copy, PartialEq)]
enum Load {
    /// Durable reports as the `durable` scenario sends them.
    Reports,
    /// Reports with an event on allocations with full histories (as
    /// `events`), full answers.
    Events,
    /// The same with `Prefer: return=minimal`.
    EventsMinimal,
    /// `PUT .../heartbeat` on running `web` tasks.
    Heartbeats,
}

impl Load {
    /// A name for its files.
    fn name(self) -> &'static str {
        match self {
            Load::Reports => "reports",
            Load::Events => "events",
            Load::EventsMinimal => "events-minimal",
            Load::Heartbeats => "heartbeats",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Load::Reports => "durable reports (as `durable`)",
            Load::Events => "reports with events, full histories, full answers",
            Load::EventsMinimal => "the same, return=minimal",
            Load::Heartbeats => "heartbeats",
        }
    }
}

/// `callgrind_control ARG PID`.
fn control(arg: &str, pid: u32) -> std::io::Result<()> {
    let out = Command::new("callgrind_control")
        .args([arg, &pid.to_string()])
        .output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "callgrind_control {arg} {pid}: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(())
}

/// The server's instructions per request for `load` on allocations of
/// `spec`, on a server of `bin` under callgrind (`case` names its files);
/// with `graph`, the server holds `--dependents` allocations depending on
/// `--dependency-targets` others besides.
async fn count(
    config: &BenchConfig,
    case: &str,
    bin: &Path,
    spec: &str,
    load: Load,
    graph: bool,
) -> std::io::Result<f64> {
    let (dir, _guard) = data_dir(config, &format!("instructions-{case}-{}", load.name()))?;
    std::fs::create_dir_all(&dir)?;
    let out = dir.join("callgrind.out");
    let data = dir.join("data").to_string_lossy().into_owned();
    let mut args = vec![
        "-q".to_owned(),
        "--tool=callgrind".to_owned(),
        "--instr-atstart=no".to_owned(),
        format!("--callgrind-out-file={}", out.display()),
        bin.to_string_lossy().into_owned(),
    ];
    args.extend(serve_args(&["--data-dir", data.as_str()]));
    let server = Proc::start_exe(Path::new("valgrind"), &args)?;
    let addr = server.addr;
    let prefix = match load {
        Load::Reports | Load::Heartbeats => "bench",
        Load::Events | Load::EventsMinimal => "events",
    };
    if graph {
        let targets = config.dependency_targets.max(1);
        super::dependencies::graph(addr, targets, config.dependents, CLIENTS).await?;
    }
    register(addr, prefix, 0..CLIENTS, CLIENTS, spec).await?;
    match load {
        Load::Events | Load::EventsMinimal => {
            fill_histories(addr, "events", 0..CLIENTS, CLIENTS).await?;
        }
        Load::Heartbeats => {
            let path = |i| format!("/v1/allocations/bench-{i}/tasks/web/state");
            let body = r#"{"state": "running"}"#.to_owned();
            put_each(addr, 0..CLIENTS, CLIENTS, path, body, &[200], "start").await?;
        }
        Load::Reports => {}
    }
    let mut conns = Vec::new();
    for _ in 0..CLIENTS {
        let mut conn = Conn::open(addr).await?;
        if load == Load::EventsMinimal {
            conn.extra_headers = "Prefer: return=minimal\r\n";
        }
        conns.push(conn);
    }
    let pid = server.child.id();
    tokio::task::spawn_blocking(move || control("--instr=on", pid))
        .await
        .map_err(std::io::Error::other)??;
    let mut tasks = Vec::new();
    for (c, mut conn) in conns.into_iter().enumerate() {
        let events = event_reports("events");
        tasks.push(tokio::spawn(async move {
            for n in 0..PER_CLIENT {
                let (method, path, body) = match load {
                    Load::Reports => flip_web(c, n),
                    Load::Events | Load::EventsMinimal => events(c, n),
                    Load::Heartbeats => (
                        "PUT",
                        format!("/v1/allocations/bench-{c}/tasks/web/heartbeat"),
                        Vec::new(),
                    ),
                };
                let status = conn.call(method, &path, &body).await?;
                if status >= 300 {
                    return Err(std::io::Error::other(format!(
                        "{} answered {status}",
                        load.what()
                    )));
                }
            }
            Ok::<_, std::io::Error>(())
        }));
    }
    for t in tasks {
        t.await.map_err(std::io::Error::other)??;
    }
    tokio::task::spawn_blocking(move || control("--instr=off", pid))
        .await
        .map_err(std::io::Error::other)??;
    server.terminate()?;
    let text = std::fs::read_to_string(&out)?;
    let total: f64 = text
        .lines()
        .filter_map(|l| l.strip_prefix("totals:"))
        .filter_map(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .sum();
    if total == 0.0 {
        return Err(std::io::Error::other(format!(
            "callgrind counted nothing in {}",
            out.display()
        )));
    }
    Ok(total / (CLIENTS as u64 * PER_CLIENT) as f64)
}

/// Instructions per request: this build (without TTLs and with every task
/// under a 30 s TTL) and, with `--base-server-bin`, the base build.
pub(super) async fn scenario(config: &BenchConfig) -> std::io::Result<String> {
    let this = super::server_bin()?;
    let base = config.base_server_bin.clone();
    let ttl = five_tasks_with_ttl("30s");
    let mut lines = vec![
        format!(
            "instructions (callgrind, user space, the server's threads) per request, \
             {CLIENTS} connections × {PER_CLIENT} requests, fresh durable servers:"
        ),
        "| requests | base build | this build | this build, every task under a 30 s TTL |"
            .to_owned(),
        "|---|---:|---:|---:|".to_owned(),
    ];
    for load in [
        Load::Reports,
        Load::Events,
        Load::EventsMinimal,
        Load::Heartbeats,
    ] {
        eprintln!("bench: instructions: {} ...", load.what());
        let base = match (&base, load) {
            (Some(bin), l) if l != Load::Heartbeats => {
                format!(
                    "{:.0}",
                    count(config, "base", bin, FIVE_TASKS, load, false).await?
                )
            }
            _ => "-".to_owned(),
        };
        let plain = if load == Load::Heartbeats {
            "-".to_owned()
        } else {
            format!(
                "{:.0}",
                count(config, "this", &this, FIVE_TASKS, load, false).await?
            )
        };
        let timed = format!(
            "{:.0}",
            count(config, "ttl", &this, &ttl, load, false).await?
        );
        lines.push(format!("| {} | {base} | {plain} | {timed} |", load.what()));
    }
    eprintln!("bench: instructions: durable reports next to a dependency graph ...");
    let held = count(config, "graph", &this, FIVE_TASKS, Load::Reports, true).await?;
    lines.push(format!(
        "\nDurable reports (as `durable`) on this build while it holds {} allocations \
         depending on {} others besides: {held:.0} instructions per report.",
        config.dependents,
        config.dependency_targets.max(1),
    ));
    Ok(lines.join("\n"))
}
