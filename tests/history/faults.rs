//! The faults of the history test, on a schedule drawn from the run's
//! seed: each fault lasts a few seconds and heals itself, then the driver
//! waits (bounded) until etcd and every replica say they are healthy again,
//! and lets the workload run calmly for a moment before the next one.

use std::{
    process::Command,
    sync::Arc,
    time::{Duration, Instant},
};

use serde::Serialize;

use super::common::{etcd::Cluster, process::Server, stall::Stall};
use super::workload::Shared;

/// How long a compaction waits, after its member was paused, for a
/// replica's view to fall behind the others'.
const BEHIND_WITHIN: Duration = Duration::from_millis(1_500);

/// How long a compaction is tried (a paused leader: an election first).
const COMPACT_WITHIN: Duration = Duration::from_secs(15);

/// The prefix every replica of the run shares.
pub const PREFIX: &str = "/h/";

/// How long the system may take to be healthy again after a fault heals:
/// a replica's watch leaves a silent member within two check intervals
/// (4 s), an election takes about a second, a replica starts in less.
const SETTLE: Duration = Duration::from_secs(30);

#[derive(Clone, Copy, Debug, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fault {
    /// SIGKILL a replica; start it again (on a new port) afterwards.
    KillReplica { replica: usize },
    /// SIGSTOP a replica (it holds its connections and answers nothing),
    /// then SIGCONT.
    PauseReplica { replica: usize },
    /// SIGSTOP an etcd member, then SIGCONT.
    PauseMember { member: usize },
    /// SIGKILL one etcd member (the leader, or not), then restart it.
    KillMember { leader: bool },
    /// SIGKILL two of the three members (the leader among them): no
    /// quorum until they are restarted.
    LoseQuorum,
    /// Hold back every answer of its first member to a replica (a
    /// forwarder between them; the member still applies what it is sent)
    /// for longer than the replica's `--etcd-timeout`: the writes in
    /// flight commit and their answers are lost, so the replica finds out
    /// from the records' write marks (docs/replicas.md, "No write applied
    /// twice").
    StallAnswers { replica: usize },
    /// SIGSTOP the member a replica's watch is on; once the others have
    /// gone past that replica's view, compact etcd's history, so that the
    /// replica finds its revision compacted when its watch moves to
    /// another member, and lists again.
    CompactBehindPausedMember { replica: usize },
    /// SIGSTOP etcd's leader for longer than the liveness tasks' TTL, then
    /// SIGCONT: another member leads meanwhile, and the one that resumes
    /// may revoke every lease it counted down (etcd before 3.4.31 and
    /// 3.5.13: issues #12528, #15247).
    PauseLeader,
    /// SIGSTOP the leader and a follower for longer than the TTL: no
    /// quorum, no renewal acknowledged; when they resume, the leader
    /// revokes every lease whose TTL passed.
    LoseQuorumLeaderPaused,
}

/// One entry of the schedule: the fault, how long it lasts, how long the
/// workload runs calmly after the system is healthy again.
#[derive(Clone, Debug, Serialize)]
pub struct Step {
    pub fault: Fault,
    pub hold_ms: u64,
    pub calm_ms: u64,
}

/// What happened, for the history's record.
#[derive(Clone, Debug, Serialize)]
pub struct Done {
    pub step: Step,
    /// Microseconds since the start: the fault began, it was healed, the
    /// system was healthy again (`None`: not within `SETTLE`).
    pub began: u64,
    pub healed: u64,
    pub settled: Option<u64>,
    pub detail: String,
}

/// Each kind of fault `rounds` times, on targets drawn at random, in a
/// random order.
pub fn schedule(
    rng: &mut fastrand::Rng,
    rounds: usize,
    replicas: usize,
    members: usize,
) -> Vec<Step> {
    let mut faults = Vec::new();
    for _ in 0..rounds {
        faults.extend([
            Fault::KillReplica {
                replica: rng.usize(..replicas),
            },
            Fault::PauseReplica {
                replica: rng.usize(..replicas),
            },
            Fault::PauseMember {
                member: rng.usize(..members),
            },
            Fault::KillMember { leader: rng.bool() },
            Fault::LoseQuorum,
            Fault::StallAnswers {
                replica: rng.usize(..replicas),
            },
            Fault::CompactBehindPausedMember {
                replica: rng.usize(..replicas),
            },
            Fault::PauseLeader,
            Fault::LoseQuorumLeaderPaused,
        ]);
    }
    rng.shuffle(&mut faults);
    faults
        .into_iter()
        .map(|fault| Step {
            fault,
            hold_ms: match fault {
                // Past the replica's `--etcd-timeout` (5 s by default).
                Fault::StallAnswers { .. } => rng.u64(6_000..=7_500),
                // Past the liveness tasks' TTL (3 s), so that every lease
                // runs out on the paused leader's clock.
                Fault::PauseLeader | Fault::LoseQuorumLeaderPaused => rng.u64(3_500..=5_000),
                _ => rng.u64(1_500..=3_500),
            },
            calm_ms: rng.u64(1_000..=2_500),
        })
        .collect()
}

/// Compacts etcd's history up to its revision now, through the members
/// other than `paused` (`Cluster::compact` asks the members in order, and
/// a paused one would take its whole timeout). A paused leader leaves the
/// others without one until they elect one (about a second): the
/// compaction is tried again until `COMPACT_WITHIN` has passed. The
/// revision, or why it failed.
fn compact_without(cluster: &Cluster, paused: usize) -> Result<u64, String> {
    let mut endpoints = cluster.endpoints();
    endpoints.remove(paused);
    let etcdctl = |args: &[&str]| -> Result<Vec<u8>, String> {
        let out = Command::new("etcdctl")
            .args(["--endpoints", &endpoints.join(","), "--command-timeout=3s"])
            .args(args)
            .env("ETCDCTL_API", "3")
            .output()
            .map_err(|e| format!("etcdctl: {e}"))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let last = err.lines().last().unwrap_or_default();
            return Err(format!("etcdctl {args:?}: {last}"));
        }
        Ok(out.stdout)
    };
    let until = Instant::now() + COMPACT_WITHIN;
    loop {
        let attempt = etcdctl(&["endpoint", "status", "-w", "json"]).and_then(|out| {
            let status: serde_json::Value =
                serde_json::from_slice(&out).map_err(|e| format!("endpoint status: {e}"))?;
            let revision = status
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| s["Status"]["header"]["revision"].as_u64())
                .max()
                .ok_or("no member's revision")?;
            etcdctl(&["compaction", &revision.to_string()])?;
            Ok(revision)
        });
        match attempt {
            Ok(revision) => return Ok(revision),
            Err(why) if Instant::now() >= until => return Err(why),
            // The next attempt waits on etcdctl's own deadline, not on a
            // sleep; a pause keeps a refused attempt from spinning.
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// The etcd cluster and the replicas, as the driver changes them.
pub struct Rig {
    pub cluster: Cluster,
    /// `None` while a replica is killed.
    pub servers: Vec<Option<Server>>,
    /// What each replica logged, including the processes killed so far.
    pub logs: Vec<Vec<String>>,
    /// Replica `r`'s way to its first member (`r` modulo the members).
    pub stalls: Vec<Stall>,
    pub shared: Arc<Shared>,
}

/// The blocking calls (processes, `etcdctl`, the cluster's health polls)
/// run on this thread without stalling the workload's tasks.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

fn signal(pid: u32, signal: &str) {
    let ok = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {signal} {pid}");
}

impl Rig {
    /// Starts replica `r`: its etcd endpoints rotated by `r`, so that each
    /// replica prefers another member and their writes race in etcd; the
    /// first through `stall` (a forwarder to that member).
    pub fn start_replica(cluster: &Cluster, stall: &Stall, r: usize) -> Server {
        let mut endpoints = cluster.endpoints();
        let n = endpoints.len();
        endpoints.rotate_left(r % n);
        endpoints[0] = stall.url.clone();
        let endpoints = endpoints.join(",");
        Server::start(&[
            "--store",
            "etcd",
            "--etcd-endpoints",
            &endpoints,
            "--etcd-prefix",
            PREFIX,
        ])
    }

    fn pid(&self, r: usize) -> u32 {
        self.servers[r]
            .as_ref()
            .expect("the replica runs")
            .child
            .id()
    }

    /// The member replica `r`'s watch is on: the last it logged it was
    /// back on, else the first of its endpoints (where it starts).
    fn watched(&self, r: usize) -> usize {
        let endpoints = self.cluster.endpoints();
        let first = r % endpoints.len();
        let stall = &self.stalls[r].url;
        let Some(server) = &self.servers[r] else {
            return first;
        };
        server
            .log()
            .iter()
            .rev()
            .filter(|l| l.contains("the watch on etcd is back"))
            .find_map(|l| {
                let url = l.split("endpoint=").nth(1)?.split_whitespace().next()?;
                if url == stall {
                    return Some(first);
                }
                endpoints.iter().position(|e| e == url)
            })
            .unwrap_or(first)
    }

    fn hold(step: &Step) -> Duration {
        Duration::from_millis(step.hold_ms)
    }

    /// Applies `step`'s fault, holds it, heals it. What it did, in words.
    async fn apply(&mut self, step: &Step) -> String {
        let hold = Self::hold(step);
        match step.fault {
            Fault::KillReplica { replica } => {
                let server = self.servers[replica].take().expect("the replica runs");
                self.logs[replica].extend(server.log());
                let old = server.base.clone();
                blocking(|| drop(server)); // SIGKILL
                tokio::time::sleep(hold).await;
                let server =
                    blocking(|| Self::start_replica(&self.cluster, &self.stalls[replica], replica));
                let new = server.base.clone();
                self.shared.set_url(replica, new.clone());
                self.servers[replica] = Some(server);
                format!("replica {replica} killed at {old}, started again at {new}")
            }
            Fault::PauseReplica { replica } => {
                let pid = self.pid(replica);
                blocking(|| signal(pid, "-STOP"));
                tokio::time::sleep(hold).await;
                blocking(|| signal(pid, "-CONT"));
                format!("replica {replica} paused")
            }
            Fault::StallAnswers { replica } => {
                let member = replica % self.cluster.endpoints().len();
                self.stalls[replica].stall();
                tokio::time::sleep(hold).await;
                self.stalls[replica].release();
                format!("member {member}'s answers to replica {replica} held back")
            }
            Fault::PauseMember { member } => {
                blocking(|| self.cluster.pause(member));
                tokio::time::sleep(hold).await;
                blocking(|| self.cluster.resume(member));
                format!("member {member} paused")
            }
            Fault::KillMember { leader } => {
                let member = blocking(|| {
                    let l = self.cluster.leader();
                    if leader { l } else { (l + 1) % 3 }
                });
                blocking(|| self.cluster.kill(member));
                tokio::time::sleep(hold).await;
                blocking(|| self.cluster.restart(member));
                format!(
                    "member {member} ({}) killed and restarted",
                    if leader { "the leader" } else { "a follower" }
                )
            }
            Fault::LoseQuorum => {
                let (l, other) = blocking(|| {
                    let l = self.cluster.leader();
                    (l, (l + 1) % 3)
                });
                blocking(|| {
                    self.cluster.kill(l);
                    self.cluster.kill(other);
                });
                tokio::time::sleep(hold).await;
                blocking(|| {
                    self.cluster.restart(l);
                    self.cluster.restart(other);
                });
                format!("members {l} (the leader) and {other} killed and restarted")
            }
            Fault::PauseLeader => {
                let leader = blocking(|| self.cluster.leader());
                blocking(|| self.cluster.pause(leader));
                tokio::time::sleep(hold).await;
                blocking(|| self.cluster.resume(leader));
                format!("member {leader} (the leader) paused")
            }
            Fault::LoseQuorumLeaderPaused => {
                let (l, other) = blocking(|| {
                    let l = self.cluster.leader();
                    (l, (l + 1) % 3)
                });
                blocking(|| {
                    self.cluster.pause(l);
                    self.cluster.pause(other);
                });
                tokio::time::sleep(hold).await;
                blocking(|| {
                    self.cluster.resume(l);
                    self.cluster.resume(other);
                });
                format!("members {l} (the leader) and {other} paused: no quorum")
            }
            Fault::CompactBehindPausedMember { replica } => {
                let member = self.watched(replica);
                blocking(|| self.cluster.pause(member));
                // Writes go on through the other members, unseen by a
                // watch on this one, which is left no sooner than one check
                // deadline (2 s) after the pause: once another replica's
                // view has passed this one's, the compaction passes it too.
                let behind = self.fell_behind(replica, BEHIND_WITHIN).await;
                let compacted = blocking(|| compact_without(&self.cluster, member));
                tokio::time::sleep(hold + Duration::from_secs(2)).await;
                blocking(|| self.cluster.resume(member));
                format!(
                    "member {member} (replica {replica}'s watch) paused, etcd compacted at \
                     revision {}{}",
                    match compacted {
                        Ok(revision) => revision.to_string(),
                        Err(why) => format!("FAILED ({why})"),
                    },
                    match behind {
                        Some(view) => format!(" (the replica's view was at {view})"),
                        None => " (the replica's view had not fallen behind)".into(),
                    }
                )
            }
        }
    }

    /// Each replica's view index, by `/v1/health` (`None`: no answer).
    async fn views(&self) -> Vec<Option<u64>> {
        let mut out = Vec::new();
        for r in 0..self.servers.len() {
            let url = self.shared.url(r);
            let res = self
                .shared
                .http
                .get(format!("{url}/v1/health"))
                .timeout(Duration::from_secs(1))
                .send()
                .await;
            let view = match res {
                Ok(res) => res.json::<serde_json::Value>().await.ok(),
                Err(_) => None,
            };
            out.push(view.and_then(|v| v["view"]["index"].as_u64()));
        }
        out
    }

    /// Waits (bounded) until another replica's view has passed replica
    /// `r`'s; `r`'s view then, if it did.
    async fn fell_behind(&self, r: usize, within: Duration) -> Option<u64> {
        let until = Instant::now() + within;
        while Instant::now() < until {
            let views = self.views().await;
            if let Some(mine) = views[r]
                && views.iter().flatten().any(|&v| v > mine)
            {
                return Some(mine);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    /// Waits until every member and every replica is healthy (each
    /// replica's `/v1/health` 200), within `within`. False if not.
    pub async fn settle(&self, within: Duration) -> bool {
        let until = Instant::now() + within;
        loop {
            let members = blocking(|| (0..3).all(|i| self.cluster.healthy(i)));
            if members && self.replicas_healthy().await {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn replicas_healthy(&self) -> bool {
        for r in 0..self.servers.len() {
            let url = self.shared.url(r);
            let ok = self
                .shared
                .http
                .get(format!("{url}/v1/health"))
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .is_ok_and(|res| res.status() == 200);
            if !ok {
                return false;
            }
        }
        true
    }

    /// Runs the schedule: each fault, then (bounded) the system healthy
    /// again, then a calm moment.
    pub async fn run(&mut self, steps: &[Step]) -> Vec<Done> {
        let mut done = Vec::new();
        for step in steps {
            let began = self.shared.now();
            let detail = self.apply(step).await;
            let healed = self.shared.now();
            let settled = self.settle(SETTLE).await.then(|| self.shared.now());
            done.push(Done {
                step: step.clone(),
                began,
                healed,
                settled,
                detail,
            });
            tokio::time::sleep(Duration::from_millis(step.calm_ms)).await;
        }
        done
    }

    /// Every replica's log so far (the running processes' included).
    pub fn all_logs(&self) -> Vec<Vec<String>> {
        let mut logs = self.logs.clone();
        for (r, s) in self.servers.iter().enumerate() {
            if let Some(s) = s {
                logs[r].extend(s.log());
            }
        }
        logs
    }
}
