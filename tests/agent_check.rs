//! `taskgate agent-check`: our agent and the docs' example agent pass every
//! rule; an agent that ignores the server fails, naming the rules.

use std::process::{Command, Output};

fn check(timeout: &str, agent: &[&str]) -> (Output, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_taskgate"))
        .args(["agent-check", "--timeout", timeout, "--"])
        .args(agent)
        .output()
        .expect("agent-check runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    (out, text)
}

#[test]
fn taskgate_agent_passes_every_rule() {
    let bin = env!("CARGO_BIN_EXE_taskgate");
    let (out, text) = check(
        "20s",
        &[
            bin,
            "agent",
            "--server",
            "{server}",
            "--alloc",
            "{alloc}",
            "--task",
            "{task}",
            "--kill-timeout",
            "2s",
            "--",
            "{workload}",
        ],
    );
    assert!(out.status.success(), "{text}");
    assert!(!text.contains("FAIL"), "{text}");
    assert!(text.contains("17 of 17 rules pass"), "{text}");
}

/// The docs' example agent (examples/minimal_agent.py) passes too.
#[test]
fn the_docs_example_agent_passes_every_rule() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/minimal_agent.py");
    let (out, text) = check(
        "20s",
        &[
            "python3",
            example,
            "{server}",
            "{alloc}",
            "{task}",
            "--",
            "{workload}",
        ],
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("17 of 17 rules pass"), "{text}");
}

/// An agent that claims its task at once, runs it, and never asks the
/// server anything again: the check fails it, naming each rule it breaks,
/// and exits 1.
#[test]
fn an_agent_that_ignores_the_server_fails_naming_the_rules() {
    let dir = tempfile::tempdir().unwrap();
    let agent = dir.path().join("deaf-agent");
    std::fs::write(
        &agent,
        "#!/bin/sh\nserver=$1; alloc=$2; task=$3; shift 4\n\
         curl -s -X PUT -H 'Content-Type: application/json' -d '{\"state\": \"running\"}' \
         \"$server/v1/allocations/$alloc/tasks/$task/state\" >/dev/null\nexec \"$@\"\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (out, text) = check(
        "2s",
        &[
            agent.to_str().unwrap(),
            "{server}",
            "{alloc}",
            "{task}",
            "--",
            "{workload}",
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{text}");
    for rule in [
        "FAIL  waits at its gate: starts nothing before the start condition allows it: its \
         workload started while the gate was closed",
        "FAIL  desired: stop: stops its process and reports it dead: its process",
        "FAIL  task_claimed: waits, and never starts a second copy",
        "FAIL  run_superseded: stops its process",
    ] {
        assert!(text.contains(rule), "{rule} in:\n{text}");
    }
    assert!(text.contains("0 of 8 rules pass"), "{text}");
}
