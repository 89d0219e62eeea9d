//! `taskgate agent-check -- COMMAND...`: a conformance check any agent's
//! author can run. It starts a server of its own (a disk store in a
//! temporary directory, on a loopback port), then for each scenario
//! registers an allocation, starts the agent with `COMMAND` (its
//! placeholders filled in), drives the server as an operator would and
//! watches what the agent does: one line per rule of
//! docs/agent-protocol.md, `PASS` or `FAIL` with what was seen instead.
//!
//! The workload the agent runs is the check's own (`{workload}`): it
//! writes its pid to a file and waits until the check tells it how to
//! exit, so the check sees whether it runs, and ends it when it wants.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use clap::Args;
use serde_json::{Value, json};

use crate::{agent::runs, app::Application, client::Endpoint, config::ServeConfig};

#[derive(Debug, Clone, Args)]
pub struct CheckConfig {
    /// How long the agent gets for each step (to start its task, to stop
    /// it, to exit).
    #[arg(long, default_value = "20s", value_parser = crate::units::parse_duration)]
    pub timeout: Duration,
    /// The command that starts an agent, run once per scenario. Its
    /// arguments `{server}`, `{alloc}` and `{task}` are replaced with the
    /// check's server URL, the scenario's allocation and task; an argument
    /// `{workload}` with the command the agent is to run (`sh -c SCRIPT`,
    /// three arguments). Example: `taskgate agent-check -- taskgate agent
    /// --server {server} --alloc {alloc} --task {task} -- {workload}`.
    #[arg(last = true, required = true, num_args = 1..)]
    pub command: Vec<String>,
}

/// Runs every scenario; returns the exit code (0 when every rule passes).
pub async fn run(config: CheckConfig) -> i32 {
    let dir = std::env::temp_dir().join(format!("taskgate-agent-check.{}", std::process::id()));
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("taskgate agent-check: {}: {e}", dir.display());
        return 2;
    }
    let mut check = match Check::start(config, &dir).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("taskgate agent-check: cannot start its server: {e}");
            return 2;
        }
    };
    for (i, name) in SCENARIOS.iter().enumerate() {
        println!("== {name}");
        let mut s = Scenario::new(&check, &format!("check-{}", i + 1));
        let (c, s_) = (&mut check, &mut s);
        let result = match i {
            0 => start_and_exit(c, s_).await,
            1 => stop_order(c, s_).await,
            2 => restarts(c, s_).await,
            3 => superseded(c, s_).await,
            4 => claimed(c, s_).await,
            5 => liveness(c, s_).await,
            6 => registered_again(c, s_).await,
            _ => server_restart(c, s_).await,
        };
        if let Err(why) = result {
            check.fail(&why.rule, &why.seen);
            println!("{}", s.log_tail());
        }
        s.end();
    }
    check.server.stop().await;
    println!(
        "{} of {} rules pass",
        check.passed,
        check.passed + check.failed
    );
    if check.failed == 0 {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        println!(
            "the agents' logs and the server's data are kept in {}",
            dir.display()
        );
    }
    i32::from(check.failed > 0)
}

/// The scenarios, in the order `run` plays them.
const SCENARIOS: [&str; 8] = [
    "start, then a clean exit",
    "a stop order",
    "restart orders",
    "a run superseded",
    "a task another agent runs",
    "liveness",
    "deleted and registered again",
    "a server restart",
];

/// A rule that did not hold, and what was seen instead.
struct Failed {
    rule: String,
    seen: String,
}

fn failed(rule: &str, seen: impl Into<String>) -> Failed {
    Failed {
        rule: rule.to_owned(),
        seen: seen.into(),
    }
}

const WEB: &str = r#"{"tasks": [{"name": "web"}]}"#;

async fn start_and_exit(c: &mut Check, s: &mut Scenario) -> Result<(), Failed> {
    c.put(
        &s.path(""),
        serde_json::from_str(INIT_AND_WEB).expect("JSON"),
    )
    .await;
    s.launch(c)?;
    let rule = "waits at its gate: starts nothing before the start condition allows it";
    s.parked(c, rule).await?;
    if !s.pids().is_empty() {
        return Err(failed(
            rule,
            "its workload started while the gate was closed",
        ));
    }
    c.pass(rule);
    c.report(s, "init", json!({"state": "dead"})).await;
    let rule = "starts its task once allowed and reports it running under a run";
    let first = s.started(c, rule, 1).await?;
    c.pass(rule);
    s.finish(0);
    let rule = "reports an exit 0 of its process as dead, not failed";
    c.until(s, rule, |t| t["state"] == "dead" && t["failed"] == false)
        .await?;
    c.pass(rule);
    s.exits(c, "exits once the allocation has ended").await?;
    s.gone(c, first, "its process is gone after it exits").await
}

/// One task before the agent's, so that its gate starts closed.
const INIT_AND_WEB: &str =
    r#"{"tasks": [{"name": "init", "lifecycle": {"hook": "prestart"}}, {"name": "web"}]}"#;

async fn stop_order(c: &mut Check, s: &mut Scenario) -> Result<(), Failed> {
    let pid = s.running(c, WEB).await?;
    c.post(&s.path("/stop"), json!(null)).await;
    let rule = "desired: stop: stops its process and reports it dead";
    s.gone(c, pid, rule).await?;
    c.until(s, rule, |t| t["state"] == "dead").await?;
    c.pass(rule);
    s.exits(c, "exits after a stop order").await
}

async fn restarts(c: &mut Check, s: &mut Scenario) -> Result<(), Failed> {
    let first = s.running(c, WEB).await?;
    let run = c.task(s).await["run"].clone();
    c.post(&s.path("/restart"), json!({"task": "web"})).await;
    let rule = "a one-task restart: stops its process and runs it again under a new run";
    s.gone(c, first, rule).await?;
    let second = s.started(c, rule, 2).await?;
    if c.task(s).await["run"] == run {
        return Err(failed(rule, "the task runs under the same run as before"));
    }
    c.pass(rule);
    c.post(&s.path("/restart"), json!({"all_tasks": true}))
        .await;
    let rule = "an all-tasks restart: stops its process and runs it again";
    s.gone(c, second, rule).await?;
    s.started(c, rule, 3).await?;
    c.pass(rule);
    c.post(&s.path("/stop"), json!(null)).await;
    s.exits(c, "exits after a stop order").await
}

async fn superseded(c: &mut Check, s: &mut Scenario) -> Result<(), Failed> {
    let pid = s.running(c, WEB).await?;
    // An operator's restore ends the agent's run: the task is pending.
    c.post(
        &s.path("/restore"),
        json!({"tasks": {"web": {"state": "pending"}}}),
    )
    .await;
    let rule = "run_superseded: stops its process and reports nothing more";
    s.gone(c, pid, rule).await?;
    s.exited(c, rule).await?;
    let t = c.task(s).await;
    if t["state"] != "pending" {
        return Err(failed(rule, format!("the task is {} after it", t["state"])));
    }
    c.pass(rule);
    Ok(())
}

async fn claimed(c: &mut Check, s: &mut Scenario) -> Result<(), Failed> {
    c.put(&s.path(""), serde_json::from_str(WEB).expect("JSON"))
        .await;
    // Another agent (the check) claims the task first.
    let claim = c.report(s, "web", json!({"state": "running"})).await;
    let run = claim["tasks"][0]["run"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    s.launch(c)?;
    let rule = "task_claimed: waits, and never starts a second copy";
    s.parked(c, rule).await?;
    if !s.pids().is_empty() {
        return Err(failed(
            rule,
            "its workload started while another run held the task",
        ));
    }
    c.pass(rule);
    // The other run ends: the task is dead, and no order reopens it.
    c.http(
        "PUT",
        &s.path("/tasks/web/state"),
        json!({"state": "dead"}),
        &[("taskgate-run", &run)],
    )
    .await;
    s.exits(c, "exits when the task it waited for is dead")
        .await?;
    let rule = "task_dead: runs nothing for a dead task";
    if !s.pids().is_empty() {
        return Err(failed(rule, "its workload ran after the task was dead"));
    }
    c.pass(rule);
    Ok(())
}

async fn liveness(c: &mut Check, s: &mut Scenario) -> Result<(), Failed> {
    const TTL: Duration = Duration::from_secs(2);
    let spec = r#"{"tasks": [{"name": "web", "liveness": {"ttl": "2s"}}]}"#;
    let pid = s.running(c, spec).await?;
    let rule = "heartbeats within its TTL: its task is not declared lost";
    let until = Instant::now() + 3 * TTL;
    while Instant::now() < until {
        if c.task(s).await["lost"] == true {
            return Err(failed(
                rule,
                "the task was declared lost while the agent ran",
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.pass(rule);
    // The agent freezes beyond its TTL: the server declares the task lost.
    s.signal(rustix::process::Signal::STOP);
    let lost = c
        .until(s, "(the check) the task is declared lost", |t| {
            t["lost"] == true
        })
        .await;
    s.signal(rustix::process::Signal::CONT);
    lost?;
    let rule = "declared lost: stops its process and reports nothing more";
    s.gone(c, pid, rule).await?;
    s.exits(c, rule).await
}

async fn registered_again(c: &mut Check, s: &mut Scenario) -> Result<(), Failed> {
    let pid = s.running(c, WEB).await?;
    // Cut off while its allocation is deleted and registered again.
    s.signal(rustix::process::Signal::STOP);
    c.http("DELETE", &s.path(""), json!(null), &[]).await;
    c.put(&s.path(""), serde_json::from_str(WEB).expect("JSON"))
        .await;
    s.signal(rustix::process::Signal::CONT);
    let rule = "a new registration under its allocation's ID: stops its old process and \
                does not adopt the new task";
    s.gone(c, pid, rule).await?;
    s.exited(c, rule).await?;
    let t = c.task(s).await;
    if t["state"] != "pending" || !t["run"].is_null() {
        return Err(failed(
            rule,
            format!("the new task is {} (run {})", t["state"], t["run"]),
        ));
    }
    c.pass(rule);
    Ok(())
}

async fn server_restart(c: &mut Check, s: &mut Scenario) -> Result<(), Failed> {
    let pid = s.running(c, WEB).await?;
    let rule = "rides out a server restart: keeps its process and obeys the server after it";
    c.server.restart().await.map_err(|e| failed(rule, e))?;
    if !runs(pid) {
        return Err(failed(rule, "its process ended while the server restarted"));
    }
    c.post(&s.path("/stop"), json!(null)).await;
    s.gone(c, pid, rule).await?;
    c.until(s, rule, |t| t["state"] == "dead").await?;
    s.exits(c, rule).await
}

/// The check's own server: a disk store in the check's directory, so that
/// it can be restarted with everything it acknowledged.
struct Server {
    config: ServeConfig,
    addr: SocketAddr,
    /// `None` once stopped: the registry holds the store (and its lock).
    registry: Option<crate::registry::Registry>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl Server {
    async fn start(config: ServeConfig) -> Result<Self, String> {
        let app = Application::build(config.clone())
            .await
            .map_err(|e| e.to_string())?;
        let (addr, registry) = (app.local_addr(), app.registry().clone());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(app.run_until_stopped(async move {
            let _ = rx.await;
        }));
        Ok(Self {
            config: ServeConfig {
                listen: addr,
                ..config
            },
            addr,
            registry: Some(registry),
            stop: Some(tx),
            task: Some(task),
        })
    }

    async fn stop(&mut self) {
        self.registry = None;
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }

    async fn restart(&mut self) -> Result<(), String> {
        self.stop().await;
        *self = Self::start(self.config.clone()).await?;
        Ok(())
    }

    /// Long-polls parked on the server now (an agent waiting at its gate).
    fn parked(&self) -> usize {
        self.registry.as_ref().map_or(0, |r| r.waiters())
    }
}

struct Check {
    config: CheckConfig,
    server: Server,
    endpoint: Endpoint,
    dir: PathBuf,
    passed: usize,
    failed: usize,
}

impl Check {
    async fn start(config: CheckConfig, dir: &Path) -> Result<Self, String> {
        let serve = ServeConfig {
            data_dir: dir.join("data"),
            in_memory: false,
            // Long-polls end within a second: a frozen agent's parked
            // query (a sign of life while it is open) ends soon, so its
            // TTL can pass.
            max_wait: Duration::from_secs(1),
            ..ServeConfig::for_tests()
        };
        let server = Server::start(serve).await?;
        let endpoint = Endpoint::new(&format!("http://{}", server.addr), None)?;
        println!("server: http://{} (data in {})", server.addr, dir.display());
        Ok(Self {
            config,
            server,
            endpoint,
            dir: dir.to_owned(),
            passed: 0,
            failed: 0,
        })
    }

    fn pass(&mut self, rule: &str) {
        self.passed += 1;
        println!("PASS  {rule}");
    }

    fn fail(&mut self, rule: &str, seen: &str) {
        self.failed += 1;
        println!("FAIL  {rule}: {seen}");
    }

    /// Polls until `cond` holds of the task's view (and whatever else it
    /// looks at), or the step's time is up.
    async fn until(
        &self,
        s: &Scenario,
        rule: &str,
        cond: impl Fn(&Value) -> bool,
    ) -> Result<(), Failed> {
        let deadline = Instant::now() + self.config.timeout;
        while !cond(&self.task(s).await) {
            if Instant::now() > deadline {
                return Err(failed(
                    rule,
                    format!("not seen within {:?}", self.config.timeout),
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// One request as an operator (the server has no tokens on loopback);
    /// the answer's JSON (`null` for none). The check's own requests are
    /// expected to succeed: a refusal is a fault of the check, said so.
    async fn http(&self, method: &str, path: &str, body: Value, headers: &[(&str, &str)]) -> Value {
        let body = (!body.is_null()).then_some(body);
        match self
            .endpoint
            .send(
                method,
                path,
                None,
                body.as_ref(),
                headers,
                Duration::from_secs(10),
            )
            .await
        {
            Ok(r) if r.status < 300 => serde_json::from_slice(&r.body).unwrap_or(Value::Null),
            Ok(r) => {
                let text = String::from_utf8_lossy(&r.body);
                eprintln!("agent-check: {method} {path} answered {}: {text}", r.status);
                Value::Null
            }
            Err(e) => {
                eprintln!("agent-check: {method} {path}: {e}");
                Value::Null
            }
        }
    }

    async fn put(&self, path: &str, body: Value) -> Value {
        self.http("PUT", path, body, &[]).await
    }

    async fn post(&self, path: &str, body: Value) -> Value {
        self.http("POST", path, body, &[]).await
    }

    async fn report(&self, s: &Scenario, task: &str, body: Value) -> Value {
        self.put(&s.path(&format!("/tasks/{task}/state")), body)
            .await
    }

    /// The agent's task as the server shows it.
    async fn task(&self, s: &Scenario) -> Value {
        self.http("GET", &s.path("/tasks/web"), json!(null), &[])
            .await
    }
}

/// One scenario's allocation, agent and workload.
struct Scenario {
    alloc: String,
    pids_file: PathBuf,
    exit_file: PathBuf,
    log: PathBuf,
    agent: Option<Child>,
}

impl Scenario {
    fn new(c: &Check, alloc: &str) -> Self {
        Self {
            alloc: alloc.to_owned(),
            pids_file: c.dir.join(format!("{alloc}.pids")),
            exit_file: c.dir.join(format!("{alloc}.exit")),
            log: c.dir.join(format!("{alloc}.log")),
            agent: None,
        }
    }

    fn path(&self, rest: &str) -> String {
        format!("/v1/allocations/{}{rest}", self.alloc)
    }

    /// The workload: appends its pid, then waits (at most ten minutes)
    /// for the exit file and exits with the code it holds.
    fn workload(&self) -> String {
        let (pids, exit) = (self.pids_file.display(), self.exit_file.display());
        format!(
            "echo $$ >> '{pids}'; i=0; while [ ! -f '{exit}' ] && [ $i -lt 12000 ]; do \
             sleep 0.05; i=$((i+1)); done; exit $(cat '{exit}' 2>/dev/null || echo 1)"
        )
    }

    fn launch(&mut self, c: &Check) -> Result<(), Failed> {
        let server = format!("http://{}", c.server.addr);
        let mut args = Vec::new();
        for a in &c.config.command {
            if a == "{workload}" {
                args.extend(["sh".to_owned(), "-c".to_owned(), self.workload()]);
            } else {
                args.push(
                    a.replace("{server}", &server)
                        .replace("{alloc}", &self.alloc)
                        .replace("{task}", "web"),
                );
            }
        }
        let rule = "(the check) the agent's command starts";
        let log = std::fs::File::create(&self.log).map_err(|e| failed(rule, e.to_string()))?;
        let child = Command::new(&args[0])
            .args(&args[1..])
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| failed(rule, e.to_string()))?)
            .stderr(log)
            .spawn()
            .map_err(|e| failed(rule, format!("{}: {e}", args[0])))?;
        self.agent = Some(child);
        Ok(())
    }

    /// Registers `spec`, starts the agent and waits until its workload
    /// runs and the task is `running`; returns the workload's pid.
    async fn running(&mut self, c: &mut Check, spec: &str) -> Result<i32, Failed> {
        c.put(&self.path(""), serde_json::from_str(spec).expect("JSON"))
            .await;
        self.launch(c)?;
        self.started(
            c,
            "starts its task once allowed and reports it running under a run",
            1,
        )
        .await
    }

    /// Waits for the `n`th start of the workload, with the task `running`
    /// under a run; returns its pid.
    async fn started(&self, c: &Check, rule: &str, n: usize) -> Result<i32, Failed> {
        c.until(self, rule, |t| {
            self.pids().len() >= n && t["state"] == "running" && t["run"].is_string()
        })
        .await
        .map_err(|_| {
            let t = c.config.timeout;
            let started = self.pids().len();
            failed(
                rule,
                format!("after {t:?}: {started} start(s) of its process, not {n}, or the task not running under a run"),
            )
        })?;
        let pids = self.pids();
        if pids.len() > n {
            return Err(failed(
                rule,
                format!("{} copies started, not {n}", pids.len()),
            ));
        }
        Ok(pids[n - 1])
    }

    fn pids(&self) -> Vec<i32> {
        std::fs::read_to_string(&self.pids_file)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    fn finish(&self, code: i32) {
        let _ = std::fs::write(&self.exit_file, code.to_string());
    }

    fn signal(&self, sig: rustix::process::Signal) {
        if let Some(pid) = self.agent.as_ref().and_then(|a| pid_of(a.id())) {
            let _ = rustix::process::kill_process(pid, sig);
        }
    }

    /// Waits until workload `pid` no longer runs.
    async fn gone(&self, c: &Check, pid: i32, rule: &str) -> Result<(), Failed> {
        c.until(self, rule, |_| !runs(pid)).await.map_err(|_| {
            let after = c.config.timeout;
            failed(
                rule,
                format!("its process (pid {pid}) still runs after {after:?}"),
            )
        })
    }

    /// Waits until the agent waits on the server (a long-poll parked), or
    /// its workload started.
    async fn parked(&self, c: &Check, rule: &str) -> Result<(), Failed> {
        c.until(self, rule, |_| {
            c.server.parked() >= 1 || !self.pids().is_empty()
        })
        .await
        .map_err(|_| failed(rule, "it never long-polled the server"))
    }

    /// Waits until the agent exits.
    async fn exited(&mut self, c: &Check, rule: &str) -> Result<(), Failed> {
        let agent = self.agent.as_mut().expect("launched");
        let deadline = Instant::now() + c.config.timeout;
        loop {
            match agent.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                _ => {
                    return Err(failed(
                        rule,
                        format!("the agent still runs after {:?}", c.config.timeout),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Waits until the agent exits; passes `rule`.
    async fn exits(&mut self, c: &mut Check, rule: &str) -> Result<(), Failed> {
        self.exited(c, rule).await?;
        c.pass(rule);
        Ok(())
    }

    /// The last lines the agent wrote, to show with a failure.
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = &lines[lines.len().saturating_sub(8)..];
        tail.iter().map(|l| format!("      | {l}\n")).collect()
    }

    /// Ends what the scenario left: the agent (SIGKILL) and its workload.
    fn end(mut self) {
        self.finish(1);
        if let Some(mut agent) = self.agent.take() {
            let _ = agent.kill();
            let _ = agent.wait();
        }
        for pid in self.pids() {
            if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
    }
}

fn pid_of(id: u32) -> Option<rustix::process::Pid> {
    rustix::process::Pid::from_raw(i32::try_from(id).ok()?)
}
