//! The command line: one subcommand per tool, each owning its arguments
//! (`ServeConfig` in `config.rs`, `AgentConfig` in `agent/`, ...).

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "taskgate",
    version,
    about = "Nomad's task lifecycle coordinator as a service"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the server.
    Serve(crate::config::ServeConfig),
    /// Print the OpenAPI document (the committed copy is openapi/openapi.json).
    Openapi,
    /// Run one task of an allocation under its gate: `taskgate agent
    /// --alloc ID --task NAME -- CMD ARGS...`.
    Agent(crate::agent::AgentConfig),
    /// Check an agent against the protocol (docs/agent-protocol.md):
    /// `taskgate agent-check -- COMMAND...` starts a server of its own,
    /// runs the agent through each scenario and prints a PASS or FAIL line
    /// per rule (exit 0 when all pass).
    #[command(name = "agent-check")]
    AgentCheck(crate::agent_check::CheckConfig),
    /// How `taskgate agent` starts a command: sets the parent-death signal
    /// (SIGKILL), then execs the command in its place.
    #[command(name = "agent-exec", hide = true)]
    AgentExec(crate::agent::ExecArgs),
    /// The operator's view and actions: `taskgate alloc status ID`, `list`,
    /// `events [--follow]`, `restart`, `stop`, `restore`, `delete` (`--json` for
    /// scripts).
    Alloc(crate::operator::AllocArgs),
    /// Semaphores (at most N tasks at once, across allocations): `taskgate
    /// semaphore list`, `status NAME`, `set NAME --limit N`, `delete NAME`
    /// (`--json` for scripts).
    Semaphore(crate::operator::SemaphoreArgs),
    /// Barriers (tasks of several allocations that start together):
    /// `taskgate barrier status NAME` (`--json` for scripts).
    Barrier(crate::operator::BarrierArgs),
    /// Probe a running server's /v1/health: exit 0 when healthy, 1 otherwise.
    Health(crate::health::HealthConfig),
    /// Print every allocation a stopped server's data directory holds, one
    /// JSON object per line (as `GET /v1/allocations/{id}` shows it),
    /// without changing the directory.
    Dump(crate::dump::DumpConfig),
}
