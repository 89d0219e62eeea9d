//! Runs the README's walkthrough against a real server, so it cannot rot:
//! each command of the marked block runs in `sh` as written, with the
//! `taskgate` this build made first on the PATH (where the README's `cargo
//! install --locked --path .` puts the reader's). The block's first line
//! sets `TASKGATE_SERVER`, the one place that names the server's address;
//! here the test's own server stands in for it, and every command takes
//! the address from that variable (as the reader's do). Each `# expect:`
//! line must be in the output of the command before it. A line
//! `NAME=$(curl ...)` (or `$(taskgate ...)`) sets a shell variable, as it
//! does in the reader's shell when the block is pasted: its value must not
//! be empty, and the commands after it see it.

mod common;

use std::process::Command;

/// One command of the walkthrough and what its output must contain.
struct Step {
    command: String,
    expect: Vec<String>,
    /// The variable the command sets (`NAME=$(...)`), if it sets one.
    sets: Option<String>,
}

/// The variable a line sets from the output of a `curl` or `taskgate`
/// command (`NAME=$(curl ...`), if it is such a line.
fn assignment(line: &str) -> Option<String> {
    let (name, rest) = line.split_once("=$(")?;
    let is_name = name.starts_with(|c: char| c.is_ascii_uppercase())
        && name
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
    (is_name && (rest.starts_with("curl ") || rest.starts_with("taskgate ")))
        .then(|| name.to_owned())
}

/// The line that opens every walkthrough: the server's address, which
/// every command takes from `TASKGATE_SERVER` (the CLI reads it too).
const SERVER_LINE: &str = "export TASKGATE_SERVER=http://127.0.0.1:8080";

/// The marked walkthrough of a page of the repository.
fn walkthrough(page: &str) -> Vec<Step> {
    walkthrough_at(page, 1)
}

/// The `n`th walkthrough block of `page` (from 1).
fn walkthrough_at(page: &str, n: usize) -> Vec<Step> {
    let readme = std::fs::read_to_string(format!("{}/{page}", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let block = readme
        .split("<!-- walkthrough:start -->")
        .nth(n)
        .and_then(|rest| rest.split("<!-- walkthrough:end -->").next())
        .expect("README has a walkthrough block");
    // The address is in one place: the first command sets it, no other
    // line names it.
    let first = block
        .lines()
        .find(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with("```"));
    assert_eq!(
        first,
        Some(SERVER_LINE),
        "{page}: the walkthrough's first command says where the server is"
    );
    for line in block.lines().filter(|&l| l != SERVER_LINE) {
        assert!(
            !["127.0.0.1:8080", "localhost:8080"]
                .iter()
                .any(|a| line.contains(a)),
            "{page}: only the first line names the server's address; use \"$TASKGATE_SERVER/...\" in:\n{line}"
        );
    }
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
        } else if line.starts_with("curl ")
            || line.starts_with("taskgate ")
            || line.starts_with("for ")
            || assignment(line).is_some()
        {
            open = Some(line.to_owned());
        } else {
            continue;
        }
        let cmd = open.as_ref().unwrap();
        // A command goes on while a quote is open or the line ends in `\`.
        let quotes_open = cmd.matches('\'').count() % 2 == 1;
        if !quotes_open && !cmd.ends_with('\\') {
            let command = open.take().unwrap();
            steps.push(Step {
                sets: assignment(&command),
                command,
                expect: Vec::new(),
            });
        }
    }
    assert!(open.is_none(), "unterminated command in the walkthrough");
    for step in steps.iter().filter(|s| s.command.contains("curl ")) {
        assert!(
            step.command.contains("\"$TASKGATE_SERVER/"),
            "{page}: a request that does not go to \"$TASKGATE_SERVER/...\":\n{}",
            step.command
        );
    }
    steps
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_walkthrough_runs_as_written() {
    // The walkthrough's `taskgate` is the one the README's run command
    // installs (and runs the server with).
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let before = readme.split("<!-- walkthrough:start -->").next().unwrap();
    assert!(
        before.contains("```sh\ncargo install --locked --path . && taskgate serve\n```"),
        "the README installs taskgate and serves with it before its walkthrough"
    );
    run(walkthrough("README.md"), 15).await;
}

/// docs/dependencies.md: a database and the application that needs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dependencies_walkthrough_runs_as_written() {
    run(walkthrough("docs/dependencies.md"), 12).await;
}

/// docs/semaphores.md: ten applications whose migrations take turns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_semaphores_walkthrough_runs_as_written() {
    run(walkthrough("docs/semaphores.md"), 14).await;
}

/// docs/semaphores.md: four training workers meet at a barrier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_barriers_walkthrough_runs_as_written() {
    run(walkthrough_at("docs/semaphores.md", 2), 13).await;
}

async fn run(steps: Vec<Step>, at_least: usize) {
    assert!(
        steps.len() >= at_least,
        "the walkthrough was found ({} steps)",
        steps.len()
    );
    assert!(
        steps
            .iter()
            .all(|s| s.sets.is_some() || !s.expect.is_empty()),
        "every command checks its output"
    );
    let server = common::spawn_server().await;
    // In place of the walkthrough's first line: this server's address.
    let base = server.base.clone();
    // The binary under test is the `taskgate` the shell finds.
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_taskgate"));
    let path = format!(
        "{}:{}",
        bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let found = Command::new("sh")
        .args(["-c", "command -v taskgate"])
        .env("PATH", &path)
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&found.stdout).trim(),
        bin.to_str().unwrap()
    );
    // The variables set so far, as the reader's shell holds them.
    let mut vars: Vec<(String, String)> = Vec::new();
    for step in steps {
        let mut command = step.command.clone();
        // A bound on each request, so a hung server fails the test: the
        // step's own curl (a `NAME=$(curl ...)` one's too) gets one.
        let curl = match &step.sets {
            Some(name) => format!("{name}=$(curl "),
            None => "curl ".to_owned(),
        };
        if let Some(rest) = command.strip_prefix(&curl) {
            command = format!("{curl}--max-time 30 {rest}");
        }
        if let Some(name) = &step.sets {
            // Its output is the value it set.
            command.push_str(&format!("\nprintf '%s' \"${name}\""));
        }
        let (base, path, env) = (base.clone(), path.clone(), vars.clone());
        let out = tokio::task::spawn_blocking(move || {
            Command::new("sh")
                .arg("-c")
                .arg(command)
                .envs(env)
                .env("PATH", path)
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
        if let Some(name) = step.sets {
            assert!(
                !stdout.is_empty(),
                "{}\nset {name} to nothing",
                step.command
            );
            vars.push((name, stdout.to_string()));
        }
        for expect in &step.expect {
            assert!(
                stdout.contains(expect.as_str()),
                "{}\nexpected {expect:?} in:\n{stdout}",
                step.command
            );
        }
    }
}
