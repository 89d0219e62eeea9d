//! Runs the README's walkthrough against a real server, so it cannot rot:
//! each `curl` command of the marked block runs in `sh` with the server's
//! address in place of `localhost:8080`, each `taskgate` command runs the
//! binary with `TASKGATE_SERVER` set to it, and each `# expect:` line must
//! be in the output of the command before it.

mod common;

use std::process::Command;

/// One command of the walkthrough and what its output must contain.
struct Step {
    command: String,
    expect: Vec<String>,
}

/// The marked walkthrough of a page of the repository.
fn walkthrough(page: &str) -> Vec<Step> {
    let readme = std::fs::read_to_string(format!("{}/{page}", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let block = readme
        .split("<!-- walkthrough:start -->")
        .nth(1)
        .and_then(|rest| rest.split("<!-- walkthrough:end -->").next())
        .expect("README has a walkthrough block");
    let mut steps: Vec<Step> = Vec::new();
    let mut open: Option<String> = None;
    for line in block.lines() {
        if let Some(cmd) = open.as_mut() {
            cmd.push('\n');
            cmd.push_str(line);
        } else if let Some(expect) = line.strip_prefix("# expect: ") {
            steps
                .last_mut()
                .expect("an expect line follows a command")
                .expect
                .push(expect.to_owned());
            continue;
        } else if line.starts_with("curl ") || line.starts_with("taskgate ") {
            open = Some(line.to_owned());
        } else {
            continue;
        }
        let cmd = open.as_ref().unwrap();
        // A command goes on while a quote is open or the line ends in `\`.
        let quotes_open = cmd.matches('\'').count() % 2 == 1;
        if !quotes_open && !cmd.ends_with('\\') {
            steps.push(Step {
                command: open.take().unwrap(),
                expect: Vec::new(),
            });
        }
    }
    assert!(open.is_none(), "unterminated command in the walkthrough");
    steps
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_walkthrough_runs_as_written() {
    run(walkthrough("README.md"), 15).await;
}

/// docs/dependencies.md: a database and the application that needs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dependencies_walkthrough_runs_as_written() {
    run(walkthrough("docs/dependencies.md"), 12).await;
}

async fn run(steps: Vec<Step>, at_least: usize) {
    assert!(
        steps.len() >= at_least,
        "the walkthrough was found ({} steps)",
        steps.len()
    );
    assert!(
        steps.iter().all(|s| !s.expect.is_empty()),
        "every command checks its output"
    );
    let server = common::spawn_server().await;
    let addr = server.base.trim_start_matches("http://").to_owned();
    let base = server.base.clone();
    for step in steps {
        let command = step.command.replace("localhost:8080", &addr);
        // `taskgate ...` is the binary under test, told where the server
        // is as an operator's environment would.
        let command = match command.strip_prefix("taskgate ") {
            Some(rest) => format!("{} {rest}", env!("CARGO_BIN_EXE_taskgate")),
            None => format!("{command} --max-time 30"),
        };
        let base = base.clone();
        let out = tokio::task::spawn_blocking(move || {
            Command::new("sh")
                .arg("-c")
                .arg(command)
                .env("TASKGATE_SERVER", base)
                .env("NO_COLOR", "1")
                .output()
                .expect("sh runs (and curl is installed)")
        })
        .await
        .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}\nfailed: {}",
            step.command,
            String::from_utf8_lossy(&out.stderr)
        );
        for expect in &step.expect {
            assert!(
                stdout.contains(expect.as_str()),
                "{}\nexpected {expect:?} in:\n{stdout}",
                step.command
            );
        }
    }
}
