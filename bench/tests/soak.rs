//! Soak: mixed traffic from several client processes (`taskgate-bench
//! soak-client`) against the real binary on a disk store, for a bounded
//! time (`TASKGATE_SOAK_SECS`, default 120). Asserts no 5xx, every answer
//! as the lifecycle model predicts, no leaked waiters, memory stable after
//! warm-up, and the final state of every allocation equal to its last
//! acknowledged change, before and after a restart.

// The service's test helpers: the server process and raw HTTP.
#[path = "../../tests/common/process.rs"]
#[allow(dead_code)]
mod process;
#[path = "../../tests/common/raw.rs"]
#[allow(dead_code)]
mod raw;

use std::{
    net::SocketAddr,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use process::Server;
use raw::{exchange, gauge, request};
use serde_json::Value;

const CLIENTS: u32 = 3;

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Every expected allocation reads back exactly as last acknowledged;
/// deleted ones are gone; the listing holds exactly the live ones.
fn check_final_state(addr: SocketAddr, expected: &[(String, Value)]) {
    let mut live = 0;
    for (id, view) in expected {
        let answer = exchange(
            addr,
            &request("GET", &format!("/v1/allocations/{id}"), None, b""),
        );
        if view.is_null() {
            assert_eq!(answer.status, 404, "{id} was deleted last");
        } else {
            live += 1;
            assert_eq!(answer.status, 200, "{id}");
            assert_eq!(
                &answer.json(),
                view,
                "{id} differs from its last acknowledged change"
            );
        }
    }
    let list = exchange(
        addr,
        &request(
            "GET",
            "/v1/allocations?prefix=soak-&per_page=1000",
            None,
            b"",
        ),
    );
    assert_eq!(list.json().as_array().unwrap().len(), live);
}

#[test]
#[ignore = "the soak tier (two minutes): cargo test -p taskgate-bench --test soak -- --ignored"]
fn soak_mixed_traffic_from_several_processes() {
    let secs: u64 = std::env::var("TASKGATE_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(120);
    let seed: u64 = std::env::var("TASKGATE_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap().to_owned();
    // A small log limit: checkpoints fold the log into the snapshot all
    // through the run, and the restart at the end recovers from both.
    let args = [
        "--data-dir",
        data.as_str(),
        "--max-wait",
        "5s",
        "--store-log-limit",
        "256KiB",
    ];
    let mut server = Server::start(&args);
    let addr = server.addr();
    let pid = server.child.id();

    let started = Instant::now();
    let mut clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            Command::new(env!("CARGO_BIN_EXE_taskgate-bench"))
                .args([
                    "soak-client",
                    "--server",
                    &addr.to_string(),
                    "--client",
                    &c.to_string(),
                    "--duration",
                    &format!("{secs}s"),
                    "--seed",
                    &(seed + u64::from(c)).to_string(),
                ])
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("a soak client starts")
        })
        .collect();
    // Read each summary as it comes (it is larger than a pipe's buffer).
    let outputs: Vec<_> = clients
        .iter_mut()
        .map(|c| {
            let mut stdout = c.stdout.take().unwrap();
            std::thread::spawn(move || {
                let mut out = Vec::new();
                std::io::Read::read_to_end(&mut stdout, &mut out).map(|_| out)
            })
        })
        .collect();

    // Sample the server's memory while the clients run. The level after
    // warm-up is the first sample past a quarter of the run; the end level
    // the last sample before the clients finish.
    let warm_after = Duration::from_secs(secs) / 4;
    let deadline = started + Duration::from_secs(secs) + Duration::from_secs(120);
    let (mut warm, mut last) = (None, 0);
    let mut peak_waiters = 0;
    while clients.iter_mut().any(|c| c.try_wait().unwrap().is_none()) {
        assert!(Instant::now() < deadline, "the soak clients did not finish");
        last = rss_kib(pid);
        if warm.is_none() && started.elapsed() >= warm_after {
            warm = Some(last);
        }
        peak_waiters = peak_waiters.max(gauge(addr, "taskgate_waiters"));
        // Sampling cadence, not synchronization.
        std::thread::sleep(Duration::from_millis(250));
    }

    let mut expected: Vec<(String, Value)> = Vec::new();
    let mut requests = 0;
    for (mut c, out) in clients.into_iter().zip(outputs) {
        let status = c.wait().unwrap();
        assert!(status.success(), "a soak client failed: {status}");
        let out = out.join().unwrap().unwrap();
        let summary: Value = serde_json::from_slice(&out).expect("a JSON summary");
        let statuses = summary["statuses"].as_object().unwrap();
        for (status, n) in statuses {
            let status: u16 = status.parse().unwrap();
            assert!(status < 500, "{n} answers with status {status}: {summary}");
        }
        let mismatches = summary["mismatches"].as_array().unwrap();
        assert!(
            mismatches.is_empty(),
            "answers the model did not expect: {mismatches:#?}"
        );
        requests += summary["requests"].as_u64().unwrap();
        for a in summary["allocations"].as_array().unwrap() {
            expected.push((a["id"].as_str().unwrap().to_owned(), a["view"].clone()));
        }
    }
    let folded = gauge(addr, "taskgate_store_checkpoint_records_total");
    eprintln!(
        "soak: {requests} requests in {secs} s from {CLIENTS} processes; peak waiters \
         {peak_waiters}; RSS {warm:?} KiB after warm-up, {last} KiB at the end; {folded} \
         records folded by checkpoints"
    );
    assert!(requests > 1000, "only {requests} requests");
    assert!(peak_waiters > 0, "no waiter was ever parked");
    assert!(folded > 0, "no checkpoint folded the log into the snapshot");

    // No leaked waiters: every one ends once its client is gone.
    let released = Instant::now() + Duration::from_secs(30);
    while gauge(addr, "taskgate_waiters") > 0 {
        assert!(Instant::now() < released, "waiters leaked");
        std::thread::sleep(Duration::from_millis(20));
    }

    let warm = warm.expect("the run outlasted its warm-up");
    assert!(
        last as f64 <= 1.2 * warm as f64,
        "memory grew from {warm} KiB after warm-up to {last} KiB"
    );

    check_final_state(addr, &expected);
    // And the same after a restart: every acknowledged change was durable.
    server.terminate();
    let exit = server.child.wait().unwrap();
    assert!(exit.success(), "the server stopped with {exit}");
    let server = Server::start(&args);
    let addr = server.addr();
    check_final_state(addr, &expected);
}
