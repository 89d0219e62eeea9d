//! `taskgate agent`: runs one task of an allocation under its gate, in the
//! spirit of Nomad's task runner. It reports `pending`, long-polls
//! start-condition until allowed, spawns the command in its own process
//! group, reports `running`, watches its task for stop and restart orders
//! while the command runs, and reports what happened when it ends.
//! Reports are retried with backoff until the server takes them.
//!
//! **Containment.** Nothing the task starts outlives the task. Where the
//! agent may create a cgroup (cgroup v2, as root or in a delegated
//! subtree), each run of the task starts in a cgroup of its own, which
//! holds all it starts, and SIGKILL reaches all of it at once through
//! `cgroup.kill` (`cgroup.rs`); elsewhere the agent says so once and falls
//! back to what it also does with a cgroup: it is a child subreaper, so a
//! process that leaves the task's group (`setsid`) or loses its parent (a
//! double fork) is re-parented to the agent, not to init. Whenever a run
//! ends — the command exits on its own, a stop or restart order, a deleted
//! allocation, the agent stopping on a signal or an error — the agent
//! sends SIGTERM to the task's process group, to every such stray and to
//! every process of the cgroup, SIGKILL after `--kill-timeout`, and reaps
//! them, before it reports the task dead (`process.rs`). Readiness
//! commands run under a reaper of their own, which ends all they started
//! when their check ends. Every terminating signal a process may catch
//! (HUP, INT, QUIT, TERM, USR1, USR2, ALRM, STKFLT, the real-time signals,
//! ...; `signals.rs`) stops the task and reports it dead; a second one
//! kills everything and exits.
//!
//! **SIGKILL of the agent** (or a signal the C library keeps for itself,
//! 32 and 33 under glibc, which it lets no program handle) leaves it no
//! chance to do any of that. The command's first process gets SIGKILL
//! from the kernel (its parent-death signal, set by `launch.rs`), and so
//! does a running readiness command; processes they started live on,
//! re-parented to init (or to the agent's own supervisor if it is a
//! subreaper), in the run's cgroup if it had one, which stays (the next
//! agent removes it once it is empty). A supervisor that runs the agent in
//! a cgroup (systemd's `KillMode=control-group`, a container) takes them
//! along, the run's cgroup with them, since it is below the agent's. The
//! server still shows the task `running`: a task with a liveness TTL
//! (`liveness.ttl`) whose agent gives no sign of life within it is
//! declared lost by the server (dead, failed, `Agent Lost`), and its
//! siblings are told to stop.
//!
//! **The token.** The agent marks itself non-dumpable first thing
//! ([`forbid_inspection`]): its `/proc/<pid>/` files belong to root from
//! then on, so a process of the same user (the task, a readiness command)
//! can neither read its environment or memory nor ptrace it. Nothing the
//! agent starts gets `TASKGATE_TOKEN`, `TASKGATE_TOKEN_FILE` or
//! `TASKGATE_OPERATOR_TOKEN` in its environment. A workload of the same
//! user can still read the token *file* if it finds it and may read it;
//! only another user (file mode, or a workload run as its own user) keeps
//! it from that, and root can read anything.

mod api;
mod cgroup;
pub mod exit;
mod launch;
mod policy;
mod process;
pub use process::runs;
mod readiness;
mod signals;
mod spec_diff;

use std::{future::Future, path::PathBuf, pin::Pin, sync::Arc, time::Duration};

use clap::Args;
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::{secret::Secret, units::parse_duration};
use api::{Api, ApiError, TaskInfo};
use launch::Launch;
pub use launch::{ExecArgs, exec};
pub use policy::{RestartMode, RestartPolicy};
use process::Exit;
use readiness::Probe;

#[derive(Debug, Clone, Args)]
#[command(after_help = exit::TABLE)]
pub struct AgentConfig {
    /// The server's base URL; several, comma-separated, for replicas of one
    /// deployment (`--store etcd`): a request that finds one unreachable
    /// or unavailable goes to the next.
    #[arg(
        long,
        env = "TASKGATE_SERVER",
        default_value = "http://127.0.0.1:8080",
        value_delimiter = ','
    )]
    pub server: Vec<String>,
    /// PEM CA certificate(s) to trust for an `https` server.
    #[arg(long, env = "TASKGATE_CA_CERT")]
    pub ca_cert: Option<PathBuf>,
    /// The allocation ID.
    #[arg(long, env = "TASKGATE_ALLOC")]
    pub alloc: String,
    /// The task this agent runs.
    #[arg(long, env = "TASKGATE_TASK")]
    pub task: String,
    /// A token of role agent (or operator). Never passed on to the command
    /// (nor is any other taskgate secret in the agent's environment). On
    /// the command line it shows in every user's process list: prefer
    /// TASKGATE_TOKEN or --token-file.
    #[arg(
        long,
        env = "TASKGATE_TOKEN",
        hide_env_values = true,
        conflicts_with = "token_file"
    )]
    pub token: Option<Secret>,
    /// Read the token from this file (its first line), so the secret need
    /// not sit in any process's environment; read again before each
    /// request, so a token replaced in it is sent from then on. On the
    /// command line its path shows in every user's process list: prefer
    /// TASKGATE_TOKEN_FILE.
    #[arg(long, env = "TASKGATE_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Register the allocation from this spec file first (idempotent: every
    /// agent of a group may pass the same file).
    #[arg(long, env = "TASKGATE_REGISTER")]
    pub register: Option<PathBuf>,
    /// With --register: every task of the spec that declares no liveness
    /// runs under this TTL (give every agent of the group the same value).
    /// The server declares a task lost whose agent gives no sign of life
    /// for this long; the agent sends heartbeats well within it.
    #[arg(long, env = "TASKGATE_LIVENESS_TTL", value_parser = parse_duration, requires = "register")]
    pub liveness_ttl: Option<Duration>,
    /// Restarts allowed within --restart-interval after the task fails.
    #[arg(long, env = "TASKGATE_RESTART_ATTEMPTS", default_value_t = 2)]
    pub restart_attempts: u32,
    /// The window in which --restart-attempts are counted.
    #[arg(long, env = "TASKGATE_RESTART_INTERVAL", default_value = "30m", value_parser = parse_duration)]
    pub restart_interval: Duration,
    /// Wait before a restart (plus up to 25% jitter).
    #[arg(long, env = "TASKGATE_RESTART_DELAY", default_value = "15s", value_parser = parse_duration)]
    pub restart_delay: Duration,
    /// When the attempts are used up: `fail` the task, or `delay` until the
    /// interval frees an attempt.
    #[arg(long, env = "TASKGATE_RESTART_MODE", value_enum, default_value_t = RestartMode::Fail)]
    pub restart_mode: RestartMode,
    /// Restart sidecar and main tasks after a successful exit too
    /// (ephemeral prestart/poststart and poststop tasks never are).
    #[arg(long, env = "TASKGATE_RESTART_ON_SUCCESS")]
    pub restart_on_success: bool,
    /// Readiness probe: this shell command (`sh -c`) exits 0 once the task
    /// is ready. Needed, or one of the other two, when the task declares
    /// `readiness`.
    #[arg(long, env = "TASKGATE_READY_CMD", conflicts_with_all = ["ready_http", "ready_tcp"])]
    pub ready_cmd: Option<String>,
    /// Readiness probe: a GET of this URL answers 2xx once the task is
    /// ready.
    #[arg(long, env = "TASKGATE_READY_HTTP", conflicts_with = "ready_tcp")]
    pub ready_http: Option<String>,
    /// Readiness probe: HOST:PORT accepts a connection once the task is
    /// ready.
    #[arg(long, env = "TASKGATE_READY_TCP")]
    pub ready_tcp: Option<String>,
    /// Time between readiness checks (each check is bounded by it).
    #[arg(long, env = "TASKGATE_READY_INTERVAL", default_value = "1s", value_parser = parse_duration)]
    pub ready_interval: Duration,
    /// A task not ready this long after it started is killed and handled
    /// as a failure by its restart policy (default: no limit).
    #[arg(long, env = "TASKGATE_READY_TIMEOUT", value_parser = parse_duration)]
    pub ready_timeout: Option<Duration>,
    /// On SIGTERM, SIGINT, SIGHUP or any other terminating signal the agent
    /// stops its task at once and tries this long to report it dead, then
    /// exits; a second signal exits at once (killing everything the task
    /// started).
    #[arg(long, env = "TASKGATE_SHUTDOWN_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub shutdown_timeout: Duration,
    /// After SIGTERM to the task's process group, wait this long before SIGKILL.
    #[arg(long, env = "TASKGATE_KILL_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub kill_timeout: Duration,
    /// Log filter, as RUST_LOG: `info`; `info,taskgate=debug` also shows
    /// each retry of a request while the server does not answer.
    #[arg(long, env = "TASKGATE_LOG", default_value = "info")]
    pub log: String,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, num_args = 1..)]
    pub command: Vec<String>,
}

fn event(kind: &str, message: impl Into<String>, details: Value) -> Value {
    json!({"type": kind, "message": message.into(), "details": details})
}

/// Reports the task's state (with an event, if any).
async fn report(
    api: &Api,
    state: &str,
    failed: bool,
    event: Option<Value>,
) -> Result<(), ApiError> {
    let mut body = json!({"state": state, "failed": failed});
    if let Some(e) = event {
        body["event"] = e;
    }
    api.report(&body).await
}

/// A request the loop of a run keeps in flight beside the child, the
/// signals and the orders, none of which waits for it.
type Request = Pin<Box<dyn Future<Output = Result<(), ApiError>>>>;

/// Completes with the request in `slot`, which it empties; never while the
/// slot is empty. Cancel-safe: the request stays in the slot until it has
/// completed.
async fn settle(slot: &mut Option<Request>) -> Result<(), ApiError> {
    let result = match slot.as_mut() {
        Some(request) => request.await,
        None => std::future::pending().await,
    };
    *slot = None;
    result
}

/// Waits for a request that must land before the next report (the
/// `running` one before the report of how the run ended), if any.
async fn landed(request: Option<Request>) -> Result<(), ApiError> {
    match request {
        Some(request) => request.await,
        None => Ok(()),
    }
}

/// What ended a run of the command.
enum Ended {
    Exited(Exit),
    /// Not ready within `--ready-timeout`.
    NotReadyInTime,
    StopOrder(String),
    RestartOrder,
    AgentStopping,
}

/// What the start condition said.
enum Gate {
    /// The task may start.
    Open,
    /// The task must not start (`desired: stop`).
    Stop,
    /// The agent was told to stop while it waited.
    AgentStopping,
    /// Another agent runs the task.
    Claimed,
}

/// What to do after the task is dead.
enum AfterDeath {
    Restart,
    Exit,
}

struct Agent {
    /// Shared with the requests the loop of a run keeps in flight beside
    /// it.
    api: Arc<Api>,
    config: AgentConfig,
    /// Stage of the task (`main`, `poststop`, ...), from the server.
    stage: String,
    /// The last restart order seen.
    generation: u64,
    /// The task's `modify_index` last seen, for blocking queries.
    index: u64,
    /// Turns true on SIGTERM/SIGINT to the agent.
    stopping: watch::Receiver<bool>,
    policy: RestartPolicy,
    /// The exit code the agent ends with, once a run (or the wait for
    /// one) has ended: the task's own code after a run that ended by
    /// itself, else one of `exit`'s.
    exit_code: Option<i32>,
    /// The readiness probe, if one was given.
    probe: Option<Probe>,
    /// What the last start condition said of how the allocation ended, for
    /// a poststop task's environment.
    outcome: Option<(String, Vec<String>)>,
    /// The running command's process group (0: none), for a second signal.
    running: std::sync::Arc<std::sync::atomic::AtomicU32>,
    /// The liveness TTL the task runs under (from the server), for the
    /// heartbeats.
    ttl: Option<Duration>,
    /// How commands are started.
    launch: Launch,
    /// Whether the task has run under this agent.
    ran: bool,
    /// Where each run of the task gets a cgroup of its own, if the agent
    /// may create one.
    place: Option<cgroup::Place>,
}

impl Agent {
    fn is_stopping(&self) -> bool {
        *self.stopping.borrow()
    }

    /// Completes once the agent is told to stop. Borrows nothing, so it can
    /// race any call on `self`.
    fn stopped(&self) -> impl std::future::Future<Output = ()> + 'static {
        let mut rx = self.stopping.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }

    fn learn(&mut self, t: &TaskInfo) {
        self.index = self.index.max(t.modify_index);
    }

    async fn report(
        &self,
        state: &str,
        failed: bool,
        event: Option<Value>,
    ) -> Result<(), ApiError> {
        report(&self.api, state, failed, event).await
    }

    /// The whole life of the agent; returns its exit code.
    async fn run(&mut self) -> Result<i32, ApiError> {
        // Until the task runs, a signal ends the agent at once: it has
        // nothing to stop, and reports nothing (not even a `pending`
        // still in flight).
        let stopped = self.stopped();
        tokio::select! {
            prepared = self.prepare() => prepared?,
            () = stopped => return Ok(self.stopped_at_the_gate()),
        }
        loop {
            let stopped = self.stopped();
            let gate = tokio::select! {
                reported = self.announce() => match reported? {
                    true => self.wait_for_gate().await?,
                    false => {
                        // Dead, and no order reopened it: nothing to run
                        // until one does.
                        self.exit_code = Some(exit::STOP_ORDER);
                        match self.after_death().await? {
                            AfterDeath::Restart => continue,
                            AfterDeath::Exit => return Ok(exit::STOP_ORDER),
                        }
                    }
                },
                () = stopped => Gate::AgentStopping,
            };
            match gate {
                Gate::Open => {}
                Gate::Claimed => continue,
                Gate::AgentStopping => return Ok(self.stopped_at_the_gate()),
                Gate::Stop => {
                    self.exit_code = Some(exit::STOP_ORDER);
                    self.report(
                        "dead",
                        false,
                        Some(event(
                            "Not Restarting",
                            "told to stop before starting",
                            json!({}),
                        )),
                    )
                    .await?;
                    match self.after_death().await? {
                        AfterDeath::Restart => continue,
                        AfterDeath::Exit => return Ok(self.exit_code.unwrap_or(0)),
                    }
                }
            }
            // The run is claimed before the command starts: of two agents
            // let through together, the second learns so before it starts
            // a second copy.
            match self.report("running", false, None).await {
                Ok(()) => {}
                Err(e @ ApiError::Claimed { .. }) => {
                    tracing::info!(task = %self.config.task, "not starting the task: {e}");
                    continue;
                }
                Err(e) => return Err(e),
            }
            self.ran = true;
            match self.run_once().await? {
                AfterDeath::Restart => continue,
                AfterDeath::Exit => return Ok(self.exit_code.unwrap_or(0)),
            }
        }
    }

    /// What comes before the first `pending` report: the registration,
    /// the task's view, and the checks of the flags against it.
    async fn prepare(&mut self) -> Result<(), ApiError> {
        if let Some(file) = self.config.register.clone() {
            self.api.register(&file, self.config.liveness_ttl).await?;
        }
        let info = match self.api.task(0).await {
            Err(ApiError::Gone) => {
                return Err(ApiError::Fatal(format!(
                    "allocation {:?} does not exist on the server: check --alloc, or give \
                     --register SPEC to create it",
                    self.config.alloc
                )));
            }
            other => other?,
        };
        if info.readiness && self.probe.is_none() {
            return Err(ApiError::Fatal(format!(
                "task {} declares readiness: give a probe, --ready-cmd CMD, --ready-http URL \
                 or --ready-tcp HOST:PORT",
                self.config.task
            )));
        }
        if !info.readiness && self.probe.is_some() {
            // The server refuses `ready: true` for it (400): the probe
            // would end the run at its first answer.
            return Err(ApiError::Fatal(format!(
                "task {} declares no readiness, so the server takes no readiness report of \
                 it: drop the probe, or declare `\"readiness\": true` on the task in the \
                 allocation's spec",
                self.config.task
            )));
        }
        self.stage = info.stage.clone();
        self.generation = info.restart_generation;
        self.ttl = info.ttl;
        self.learn(&info);
        Ok(())
    }

    /// Reports the task `pending`, once no other agent runs it (SEMANTICS
    /// "Runs": a second agent waits, visibly, until the first one's run
    /// ends or is lost, and takes nothing from it). False if the task is
    /// dead and no order has reopened it (409 `task_dead`).
    async fn announce(&mut self) -> Result<bool, ApiError> {
        if self.api.run().is_none() {
            // Waited on through the allocation's view: a query on the task
            // by an agent that names no run may count as a sign of life
            // for the run it waits on, which would keep a dead agent's run
            // from ever being declared lost.
            let (mut t, mut index) = self.api.task_in_allocation(0).await?;
            let mut said = false;
            while t.state == "running" {
                if !said {
                    said = true;
                    tracing::info!(
                        task = %self.config.task,
                        "another agent runs the task (the server shows it running under a run \
                         that is not this agent's): waiting until that run ends or is lost"
                    );
                }
                (t, index) = self.api.task_in_allocation(index).await?;
            }
            self.learn(&t);
            // The `pending` below answers every restart order made so far
            // (the server takes a task's first report after an order as
            // its answer): the run it leads to is not stopped for one of
            // them again. One that came as the last run ended, before its
            // agent saw it, was answered by the policy's restart.
            self.generation = self.generation.max(t.restart_generation);
        }
        match self.report("pending", false, None).await {
            Ok(()) => Ok(true),
            Err(e @ ApiError::Dead { .. }) => {
                tracing::info!(
                    task = %self.config.task,
                    "not running the task: {e}; an operator's all-tasks restart or restore \
                     runs it again, and this agent waits for one until the allocation ends"
                );
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// The agent was stopped while its task waited to run (at its gate,
    /// or before the agent got there): the task stays as the server has
    /// it, so the agent's own shutdown decides nothing of the allocation
    /// (a liveness TTL or a deadline bounds the wait). Says so; exit 0.
    fn stopped_at_the_gate(&self) -> i32 {
        let when = if self.ran {
            "while its task waited at its gate to run again"
        } else {
            "before its task ran"
        };
        tracing::info!(
            task = %self.config.task,
            "stopped {when}: nothing was reported for the task, which stays as the server \
             shows it; this agent's shutdown decides nothing of the allocation"
        );
        0
    }

    /// Long-polls until the task may start, or must not.
    async fn wait_for_gate(&mut self) -> Result<Gate, ApiError> {
        tracing::info!(task = %self.config.task, "waiting for the task's gate to open");
        loop {
            if self.is_stopping() {
                return Ok(Gate::AgentStopping);
            }
            let sc = tokio::select! {
                sc = self.api.start_condition() => sc?,
                () = self.stopped() => return Ok(Gate::AgentStopping),
            };
            if sc.lost() {
                return Err(ApiError::Lost { lost_at: None });
            }
            if sc.desired == "stop" {
                return Ok(Gate::Stop);
            }
            if sc.allowed && sc.state == "running" && sc.run != self.api.run() {
                // Another agent's run began meanwhile: wait for its end.
                return Ok(Gate::Claimed);
            }
            if sc.allowed {
                tracing::info!(task = %self.config.task, coordinator_state = %sc.coordinator_state, "the gate is open");
                self.outcome = sc.outcome.map(|o| (o, sc.failed_tasks));
                return Ok(Gate::Open);
            }
            tracing::debug!(
                task = %self.config.task,
                coordinator_state = %sc.coordinator_state,
                "the gate is still closed"
            );
        }
    }

    /// Runs the command once and handles how it ends.
    ///
    /// While the command runs, every request the agent makes (the
    /// `running` report, readiness reports, heartbeats, the long-poll on
    /// the task) is in flight beside the loop, which never waits for one:
    /// the command's exit, a signal to the agent and an order of the server
    /// are acted on at once, in that order when they come together.
    async fn run_once(&mut self) -> Result<AfterDeath, ApiError> {
        // A poststop task learns how the allocation ended.
        let env: Vec<(&str, String)> = match &self.outcome {
            Some((outcome, failed)) if self.stage == "poststop" => vec![
                ("TASKGATE_ALLOC_OUTCOME", outcome.clone()),
                ("TASKGATE_FAILED_TASKS", failed.join(",")),
            ],
            _ => Vec::new(),
        };
        let cgroup = self.place.as_ref().and_then(|place| {
            place
                .create()
                .map_err(|e| tracing::warn!("the task runs without a cgroup of its own: {e}"))
                .ok()
        });
        let command = self.launch.task(
            &self.config.command,
            cgroup.as_ref().map(cgroup::Cgroup::path),
        );
        let spawned = match command {
            Ok(cmd) => process::spawn(cmd, &env, cgroup),
            Err(e) => {
                if let Some(cgroup) = cgroup {
                    cgroup.remove();
                }
                Err(e)
            }
        };
        self.exit_code = None;
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                let not_found = e.kind() == std::io::ErrorKind::NotFound;
                tracing::error!(
                    task = %self.config.task,
                    command = ?self.config.command,
                    "cannot run the command: {e}"
                );
                self.exit_code = Some(if not_found {
                    exit::NOT_FOUND
                } else {
                    exit::CANNOT_RUN
                });
                self.report(
                    "dead",
                    true,
                    Some(event("Driver Failure", e.to_string(), json!({}))),
                )
                .await?;
                return self.after_death().await;
            }
        };
        let pid = child.pid();
        self.running
            .store(pid, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(task = %self.config.task, pid, "started");
        let kill_timeout = self.config.kill_timeout;
        let api = self.api.clone();
        // Until the `running` report has landed no readiness is reported:
        // it would reach the server first.
        let mut started: Option<Request> = Some(Box::pin({
            let api = api.clone();
            let started = event("Started", "", json!({"pid": pid.to_string()}));
            async move { report(&api, "running", false, Some(started)).await }
        }));
        let mut probe = self
            .probe
            .clone()
            .map(|p| p.spawn(self.config.ready_interval));
        // The probe's last answer, and the last one reported.
        let (mut ready, mut reported_ready) = (false, false);
        // --ready-timeout bounds the first readiness only: a task that was
        // ready once and loses it is reported, not killed.
        let mut ever_ready = false;
        let ready_by = self
            .config
            .ready_timeout
            .filter(|_| probe.is_some())
            .map(|t| tokio::time::Instant::now() + t);
        let mut readiness: Option<Request> = None;
        // Three heartbeats a TTL, so one lost on the way is not a loss of
        // the task; each may take a third of the TTL, then the next one
        // goes.
        let beat = self.ttl.map_or(Duration::from_secs(3600), |t| {
            (t / 3).max(Duration::from_millis(100))
        });
        let mut heartbeats = tokio::time::interval_at(tokio::time::Instant::now() + beat, beat);
        heartbeats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut heartbeat: Option<Request> = None;
        // One long-poll of the task at a time, kept across the loop's
        // turns and made anew only once it has answered: a readiness
        // answer must neither cut it (a dropped connection each time) nor
        // restart the backoff of its retries while the server is down.
        let watch = |index| {
            let api = api.clone();
            Box::pin(async move { api.task(index).await })
        };
        let mut poll = watch(self.index);
        let ended = loop {
            if started.is_none() && readiness.is_none() && ready != reported_ready {
                reported_ready = ready;
                let (kind, message) = if ready {
                    ("Ready", "the readiness probe succeeded")
                } else {
                    ("Not Ready", "the readiness probe failed")
                };
                let api = api.clone();
                let body = json!({"state": "running", "ready": ready,
                                  "event": event(kind, message, json!({}))});
                readiness = Some(Box::pin(async move { api.report(&body).await }));
            }
            let probed = async {
                match probe.as_mut() {
                    Some(p) => p.rx.recv().await,
                    None => std::future::pending().await,
                }
            };
            let late = async {
                match ready_by {
                    Some(at) if !ever_ready => tokio::time::sleep_until(at).await,
                    _ => std::future::pending().await,
                }
            };
            let failed = tokio::select! {
                biased;
                exit = child.wait() => break Ended::Exited(exit),
                () = self.stopped() => break Ended::AgentStopping,
                t = &mut poll => match t {
                    Ok(t) => {
                        self.index = self.index.max(t.modify_index);
                        if t.desired == "stop" && t.stop_reason.as_deref() == Some(api::AGENT_LOST) {
                            Err(ApiError::Lost { lost_at: None })
                        } else if api.superseded(&t) {
                            Err(ApiError::Superseded { current: t.run })
                        } else if t.desired == "stop" {
                            break Ended::StopOrder(t.stop_reason.unwrap_or_default());
                        } else if t.restart_generation > self.generation {
                            self.generation = t.restart_generation;
                            break Ended::RestartOrder;
                        } else {
                            poll = watch(self.index);
                            Ok(())
                        }
                    }
                    // A deleted allocation, a lost task or a fatal answer:
                    // everything the task started goes too.
                    Err(e) => Err(e),
                },
                r = settle(&mut started) => r,
                r = settle(&mut readiness) => r,
                r = settle(&mut heartbeat) => r,
                _ = heartbeats.tick(), if self.ttl.is_some() && heartbeat.is_none() => {
                    let api = api.clone();
                    heartbeat = Some(Box::pin(async move { api.heartbeat(beat).await }));
                    Ok(())
                }
                () = late => break Ended::NotReadyInTime,
                Some(now_ready) = probed => {
                    if now_ready != ready {
                        ready = now_ready;
                        ever_ready |= ready;
                        tracing::info!(task = %self.config.task, ready, "readiness changed");
                    }
                    Ok(())
                }
            };
            if let Err(e) = failed {
                drop(probe);
                child.stop(kill_timeout).await;
                return Err(e);
            }
        };
        // A readiness check in flight ends with the run; so do a readiness
        // report and a heartbeat still in flight, which the report of how
        // the run ended makes moot.
        drop((probe, readiness, heartbeat, poll));
        match &ended {
            Ended::Exited(exit) => {
                tracing::info!(task = %self.config.task, pid, how = %exit.describe(), "exited");
            }
            Ended::NotReadyInTime => {
                tracing::info!(task = %self.config.task, pid, "not ready within --ready-timeout: stopping it");
            }
            Ended::StopOrder(reason) => {
                tracing::info!(task = %self.config.task, pid, %reason, "told to stop: stopping it");
            }
            Ended::RestartOrder => {
                tracing::info!(task = %self.config.task, pid, "told to restart: stopping it");
            }
            Ended::AgentStopping => {
                let within = self.config.shutdown_timeout;
                tracing::info!(
                    task = %self.config.task,
                    pid,
                    "the agent is stopping: stopping the task, then reporting it dead (for at most {within:?})"
                );
            }
        }
        // In every case the task is stopped first (all it started; after
        // a natural exit, what it left running), and reported after.
        match ended {
            Ended::Exited(exit) => {
                child.stop(kill_timeout).await;
                self.running.store(0, std::sync::atomic::Ordering::Relaxed);
                landed(started).await?;
                self.exited(exit).await
            }
            Ended::NotReadyInTime => {
                let timeout = self.config.ready_timeout.unwrap_or_default();
                let shown = format!("{}ms", timeout.as_millis());
                let message = format!("not ready {shown} after it started");
                let killing = event("Killing", message.clone(), json!({}));
                let exit = self.kill(&mut child, started, killing).await?;
                let mut details = exit.details();
                details["readiness_timeout"] = json!(shown);
                self.failed_run(
                    exit::NOT_READY,
                    event("Readiness Timeout", message, details),
                )
                .await
            }
            Ended::StopOrder(reason) => {
                let killing = event("Killing", reason.clone(), json!({}));
                let exit = self.kill(&mut child, started, killing).await?;
                self.exit_code = Some(exit::STOP_ORDER);
                self.report("dead", false, Some(event("Killed", reason, exit.details())))
                    .await?;
                self.after_death().await
            }
            Ended::RestartOrder => {
                child.stop(kill_timeout).await;
                self.running.store(0, std::sync::atomic::Ordering::Relaxed);
                landed(started).await?;
                self.report(
                    "pending",
                    false,
                    Some(event(
                        "Restarting",
                        "restart signaled by the server",
                        json!({"delay": "0s"}),
                    )),
                )
                .await?;
                Ok(AfterDeath::Restart)
            }
            Ended::AgentStopping => {
                self.exit_code = Some(0);
                let exit = child.stop(kill_timeout).await;
                self.running.store(0, std::sync::atomic::Ordering::Relaxed);
                landed(started).await?;
                self.report(
                    "dead",
                    false,
                    Some(event("Killed", "the agent is stopping", exit.details())),
                )
                .await?;
                Ok(AfterDeath::Exit)
            }
        }
    }

    /// Stops the task while its `Killing` event goes to the server (after
    /// the `running` report, if that is still in flight): the stop does
    /// not wait for the server.
    async fn kill(
        &self,
        child: &mut process::Child,
        started: Option<Request>,
        killing: Value,
    ) -> Result<process::Exit, ApiError> {
        let (reported, exit) = tokio::join!(
            async {
                landed(started).await?;
                self.report("running", false, Some(killing)).await
            },
            child.stop(self.config.kill_timeout)
        );
        self.running.store(0, std::sync::atomic::Ordering::Relaxed);
        reported.map(|()| exit)
    }

    /// The command ended on its own: restart it or report it dead.
    async fn exited(&mut self, exit: Exit) -> Result<AfterDeath, ApiError> {
        let terminated = event("Terminated", exit.describe(), exit.details());
        if exit.success() {
            self.ended(exit.code(), false, terminated).await
        } else {
            self.failed_run(exit.code(), terminated).await
        }
    }

    /// A run that failed (an exit that was not a success, a readiness
    /// timeout): the restart policy decides.
    async fn failed_run(&mut self, code: i32, terminated: Value) -> Result<AfterDeath, ApiError> {
        self.ended(code, true, terminated).await
    }

    /// A run ended (`failed` or not): restart it under the policy, or
    /// report the task dead. When the policy gives up on a task it would
    /// restart — a failure, or any exit under `--restart-on-success` — the
    /// task is dead and failed, as Nomad marks it: its siblings are told
    /// "Sibling Task Failed" and the allocation ends `failed`.
    async fn ended(
        &mut self,
        code: i32,
        failed: bool,
        terminated: Value,
    ) -> Result<AfterDeath, ApiError> {
        self.exit_code = Some(code);
        let ephemeral = matches!(
            self.stage.as_str(),
            "prestart_ephemeral" | "poststart_ephemeral" | "poststop"
        );
        let wants_restart = failed || (!ephemeral && self.config.restart_on_success);
        let decision = if wants_restart {
            self.policy.decide(std::time::Instant::now())
        } else {
            policy::Decision::No("the task completed".into())
        };
        let failed = wants_restart;
        match decision {
            policy::Decision::After(delay) => {
                self.report("pending", false, Some(terminated)).await?;
                let shown = format!("{}ms", delay.as_millis());
                tracing::info!(task = %self.config.task, delay = %shown, "restarting under the restart policy");
                self.report(
                    "pending",
                    false,
                    Some(event(
                        "Restarting",
                        format!("restarting in {shown}"),
                        json!({"delay": shown}),
                    )),
                )
                .await?;
                tokio::select! {
                    () = tokio::time::sleep(delay) => Ok(AfterDeath::Restart),
                    () = self.stopped() => {
                        self.report("dead", failed, Some(event("Not Restarting", "the agent is stopping", json!({})))).await?;
                        Ok(AfterDeath::Exit)
                    }
                }
            }
            policy::Decision::No(reason) => {
                tracing::info!(task = %self.config.task, failed, %reason, "not restarting");
                self.report("dead", failed, Some(terminated)).await?;
                self.report(
                    "dead",
                    failed,
                    Some(event("Not Restarting", reason, json!({}))),
                )
                .await?;
                self.after_death().await
            }
        }
    }

    /// A dead task stays attached: an all-tasks restart runs it again. It
    /// ends when the allocation reaches `poststop` (for a non-poststop
    /// task), when it is itself a finished poststop task, or when the
    /// allocation is deleted.
    async fn after_death(&mut self) -> Result<AfterDeath, ApiError> {
        let mut alloc_index = 0;
        loop {
            if self.is_stopping() {
                return Ok(AfterDeath::Exit);
            }
            let (t, seen) = tokio::select! {
                t = self.api.task_in_allocation(alloc_index) => t?,
                () = self.stopped() => return Ok(AfterDeath::Exit),
            };
            alloc_index = seen;
            self.learn(&t);
            if t.restart_generation > self.generation {
                self.generation = t.restart_generation;
                tracing::info!(task = %self.config.task, "told to restart: running it again");
                return Ok(AfterDeath::Restart);
            }
            let own_poststop_done = self.stage == "poststop" && t.state == "dead";
            let allocation_done = self.stage != "poststop" && t.coordinator_state == "poststop";
            if own_poststop_done || allocation_done {
                return Ok(AfterDeath::Exit);
            }
        }
    }
}

/// How long the agent's last sweep tries to empty and remove the task's
/// cgroup.
const KILLED_WITHIN: Duration = Duration::from_secs(10);

/// How often at most the agent looks for ended strays to reap while a task
/// runs (each look reads every process's `/proc/<pid>/stat`).
const REAP_PAUSE: std::time::Duration = std::time::Duration::from_secs(1);

/// Marks this process non-dumpable (`PR_SET_DUMPABLE` 0): from then on its
/// `/proc/<pid>/` files (`environ`, `mem`, ...) belong to root, a process
/// of the same user may neither read them nor ptrace it, and it leaves no
/// core dump. `taskgate agent` calls it before it does anything else.
pub fn forbid_inspection() -> std::io::Result<()> {
    rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
        .map_err(Into::into)
}

/// Whether `flag` was given on the command line (before the command's own
/// `--`), where every user of the host sees it.
fn on_command_line(flag: &str) -> bool {
    std::env::args()
        .skip(1)
        .take_while(|a| a != "--")
        .any(|a| a == flag || a.strip_prefix(flag).is_some_and(|v| v.starts_with('=')))
}

/// Runs the agent until it is done; returns the process exit code.
pub async fn run(config: AgentConfig) -> i32 {
    // Before anything is started: the handlers, so that no terminating
    // signal ends the agent without a word; the subreaper flag, so that no
    // orphan of the task escapes to init.
    let mut signals = signals::Terminating::listen();
    if let Err(e) = process::become_subreaper() {
        tracing::warn!(
            error = %e,
            "cannot become a child subreaper: processes that leave the task's \
             process group will not be stopped with it"
        );
    }
    tokio::spawn(process::reap_forever(REAP_PAUSE));
    if on_command_line("--token") {
        tracing::warn!(
            "--token on the command line shows in every user's process list \
             (/proc/<pid>/cmdline); give it in TASKGATE_TOKEN or a file named by \
             TASKGATE_TOKEN_FILE"
        );
    }
    if on_command_line("--token-file") {
        tracing::warn!(
            "--token-file on the command line shows the file's path in every user's process \
             list (/proc/<pid>/cmdline), and the workload, if it runs as the file's owner, may \
             read the file: name it in TASKGATE_TOKEN_FILE (the agent's environment is hidden \
             from other processes), and keep it unreadable to the workload's user"
        );
    }
    let api = match Api::new(&config) {
        Ok(api) => api,
        Err(e) => {
            eprintln!("taskgate agent: {e}");
            return exit::CONFIG;
        }
    };
    let launch = Launch::for_agent();
    let place = contain(&config, launch);
    let probe = match Probe::from_flags(
        config.ready_cmd.as_deref(),
        config.ready_http.as_deref(),
        config.ready_tcp.as_deref(),
        launch,
    ) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("taskgate agent: {e}");
            return exit::CONFIG;
        }
    };
    let (stop_tx, stopping) = watch::channel(false);
    let running = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let give_up_at = api.give_up_at.clone();
    let shutdown_timeout = config.shutdown_timeout;
    let group = running.clone();
    let cgroup_of_run = place.clone();
    tokio::spawn(async move {
        let signal = signals.recv().await;
        tracing::info!(signal, "stopping; a second signal exits at once");
        let _ = give_up_at.set(tokio::time::Instant::now() + shutdown_timeout);
        let _ = stop_tx.send(true);
        let signal = signals.recv().await;
        let pgid = group.load(std::sync::atomic::Ordering::Relaxed);
        process::kill_everything(pgid, cgroup_of_run.as_ref().map(cgroup::Place::current)).await;
        eprintln!("taskgate agent: a second signal ({signal}): exiting now");
        std::process::exit(exit::SECOND_SIGNAL);
    });
    let policy = RestartPolicy {
        attempts: config.restart_attempts,
        interval: config.restart_interval,
        delay: config.restart_delay,
        mode: config.restart_mode,
        history: Default::default(),
    };
    let mut agent = Agent {
        api: Arc::new(api),
        config,
        stage: String::new(),
        generation: 0,
        index: 0,
        stopping,
        policy,
        exit_code: None,
        probe,
        outcome: None,
        running,
        launch,
        ttl: None,
        ran: false,
        place: place.clone(),
    };
    let code = match agent.run().await {
        Ok(code) => code,
        Err(ApiError::Gone) => {
            // After a run that ended by itself, the task's own code: the
            // deletion only ended the wait for the allocation's end.
            let code = agent.exit_code.unwrap_or(exit::DELETED);
            tracing::info!(code, "the allocation was deleted");
            code
        }
        Err(e @ ApiError::Lost { .. }) => {
            eprintln!(
                "taskgate agent: {e} (its agent gave no sign of life within its TTL): the \
                 task's process is stopped, and the server takes no report of it; an all-tasks \
                 restart or a restore runs it again, with a new agent"
            );
            exit::LOST
        }
        Err(ApiError::Unreachable(e)) => {
            eprintln!("taskgate agent: {e}");
            exit::UNREACHABLE
        }
        Err(ApiError::Fatal(e)) => {
            eprintln!("taskgate agent: {e}");
            exit::CONFIG
        }
        Err(
            e @ (ApiError::Superseded { .. } | ApiError::Claimed { .. } | ApiError::Dead { .. }),
        ) => {
            eprintln!(
                "taskgate agent: {e}: the task's process is stopped, and nothing more is \
                 reported for this run"
            );
            exit::STOP_ORDER
        }
    };
    // Each run stopped its own; this is for what a readiness command may
    // have left after the last run, and for the error paths.
    drop(agent);
    process::sweep().await;
    if let Some(place) = place {
        place.current().kill_and_remove(KILLED_WITHIN).await;
    }
    code
}

/// How the task is contained here: in a cgroup of its own for each run,
/// where the agent may create one, else by its process group and the
/// agent's child subreaper only. Says which, once.
fn contain(config: &AgentConfig, launch: Launch) -> Option<cgroup::Place> {
    let found = match launch {
        Launch::DiesWithAgent => cgroup::Place::find(&config.alloc, &config.task),
        Launch::Direct => Err("the agent cannot start its own binary to move the task".into()),
    };
    match found {
        Ok(place) => {
            tracing::info!(
                parent = %place.parent().display(),
                "each run of the task goes in a cgroup of its own, ended with cgroup.kill"
            );
            Some(place)
        }
        Err(why) => {
            tracing::info!(
                "no cgroup for the task ({why}): the agent falls back to process groups and \
                 its child subreaper"
            );
            None
        }
    }
}
