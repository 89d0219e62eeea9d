//! `taskgate-bench --scenarios pipeline` (needs `--base-server-bin`): the
//! benchmark row of issue 36, item 1 (pipelined commits). `--clients`
//! writers (HTTP keep-alive clients) send reports with an event to the
//! `web` task of ONE allocation on the durable disk store, and, for
//! scale, the same writers each to an allocation of its own; on fresh
//! servers of `--base-server-bin` (the build before pipelining) and of
//! this build in turns, `--rounds` times, medians.
//!
//! Before pipelining a writer held its allocation's write lock until its
//! change was durable, so the writers of one allocation committed one at a
//! time (one fsync each); with it, the next writer decides on the pending
//! version and the store groups them into one commit.

use super::{
    BenchConfig, FIVE_TASKS, Outcome, drive_cpu, event_reports, fill_histories,
    liveness::{Compared, fresh_server, order},
    register,
};

/// What the writers write to.
#[derive(Clone, Copy)]
enum Target {
    /// Every writer to `pipe-0`.
    One,
    /// Writer `c` to `pipe-c`.
    Own,
}

/// The disk's latency of a 10 KB append and `fdatasync` (p50, p99 in
/// ms over 200), in a fresh directory where the servers keep their data:
/// what one commit at a time is bound by. On this shared virtual disk it
/// moves by an order of magnitude with the other work on the machine.
fn fsync_latency(config: &BenchConfig) -> std::io::Result<(f64, f64)> {
    use std::io::Write;
    let (dir, _guard) = super::data_dir(config, "pipeline-fsync")?;
    std::fs::create_dir_all(&dir)?;
    let mut f = std::fs::File::create(dir.join("probe"))?;
    let block = vec![b'x'; 10_000];
    let mut ts = Vec::with_capacity(200);
    for _ in 0..200 {
        let t = std::time::Instant::now();
        f.write_all(&block)?;
        f.sync_data()?;
        ts.push(t.elapsed());
    }
    ts.sort_unstable();
    let ms = |p| super::percentile(&ts, p).as_secs_f64() * 1e3;
    Ok((ms(0.5), ms(0.99)))
}

/// Issue 36, item 1: reports to one allocation at least 5× the rate of
/// the build before pipelining, same run, alternated.
pub(super) async fn scenario(config: &BenchConfig) -> std::io::Result<(Vec<Outcome>, String)> {
    let base = config.base_server_bin.clone().ok_or_else(|| {
        std::io::Error::other(
            "pipeline needs --base-server-bin (the build before pipelined commits)",
        )
    })?;
    let this = super::server_bin()?;
    let bins = [
        (base.as_path(), "base build"),
        (this.as_path(), "this build"),
    ];
    let (clients, rounds) = (config.clients, config.rounds as usize);
    let mut rows = Vec::new();
    // [one allocation, an allocation each] × [base, this]
    let mut seen: [[Compared; 2]; 2] = Default::default();
    let disk_before = fsync_latency(config)?;
    for round in 0..rounds {
        for side in order(round, &[0usize, 1]) {
            let (bin, what) = bins[side];
            let (_guard, server) = fresh_server(config, bin, "pipeline")?;
            let addr = server.addr;
            register(addr, "pipe", 0..clients, clients, FIVE_TASKS).await?;
            // Every record at its settled size: full histories.
            fill_histories(addr, "pipe", 0..clients, clients).await?;
            for target in order(round, &[Target::One, Target::Own]) {
                let (name, slot) = match target {
                    Target::One => (
                        format!(
                            "reports with an event, {clients} writers, ONE allocation, durable, \
                             {what}, round {}",
                            round + 1
                        ),
                        0,
                    ),
                    Target::Own => (
                        format!(
                            "reports with an event, {clients} writers, an allocation each, \
                             durable, {what}, round {}",
                            round + 1
                        ),
                        1,
                    ),
                };
                let reports = event_reports("pipe");
                let request = move |c: usize, n: u64| match target {
                    // Writer c's n-th report, on pipe-0: every report
                    // carries an event, so each is a change whatever the
                    // state the other writers left.
                    Target::One => reports(0, n),
                    Target::Own => reports(c, n),
                };
                let (o, cpu) =
                    drive_cpu(&name, &server, clients, config.duration, "", request).await?;
                seen[slot][side].push(&o, cpu)?;
                rows.push(o);
            }
        }
    }
    let line = |what: &str, [b, t]: &[Compared; 2], target: &str| {
        // Each round's two sides ran next to each other: their ratio.
        let mut paired: Vec<f64> = t
            .rates()
            .iter()
            .zip(b.rates())
            .map(|(t, b)| t / b)
            .collect();
        let each: Vec<String> = paired.iter().map(|r| format!("{r:.2}")).collect();
        paired.sort_by(f64::total_cmp);
        format!(
            "- {what}: {}; {}: {} ({:.2}× the base's median rate; round by round {}, median \
             {:.2}×{target})",
            b.describe("base"),
            t.describe("this build"),
            Compared::versus(b, t),
            t.rate() / b.rate(),
            each.join(" / "),
            paired[paired.len() / 2],
        )
    };
    let disk_after = fsync_latency(config)?;
    let note = format!(
        "pipelined commits: {clients} writers sending reports with an event (full answers) to \
         five-task allocations with full histories, durable disk store, against {} \
         ({rounds} alternations, medians, fresh servers):\n{}\n{}\n- the disk: a 10 KB \
         append and fdatasync p50 {:.2} ms, p99 {:.2} ms before the windows, {:.2} / {:.2} ms \
         after (the base build commits one allocation's changes one at a time)",
        base.display(),
        line("one allocation", &seen[0], "; target ≥ 5×"),
        line("an allocation each", &seen[1], ""),
        disk_before.0,
        disk_before.1,
        disk_after.0,
        disk_after.1,
    );
    Ok((rows, note))
}
