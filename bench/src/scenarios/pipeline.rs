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
    for round in 0..rounds {
        for side in order(round, &[0usize, 1]) {
            let (bin, what) = bins[side];
            let (server, _guard) = fresh_server(config, bin, "pipeline")?;
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
        format!(
            "- {what}: {}; {}: {} ({:.2}× the base rate{target})",
            b.describe("base"),
            t.describe("this build"),
            Compared::versus(b, t),
            t.rate() / b.rate(),
        )
    };
    let note = format!(
        "pipelined commits: {clients} writers sending reports with an event (full answers) to \
         five-task allocations with full histories, durable disk store, against {} \
         ({rounds} alternations, medians, fresh servers):\n{}\n{}",
        base.display(),
        line("one allocation", &seen[0], "; target ≥ 5×"),
        line("an allocation each", &seen[1], ""),
    );
    Ok((rows, note))
}
