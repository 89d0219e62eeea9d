//! `taskgate alloc`, `taskgate semaphore` (in `semaphores`) and `taskgate
//! barrier` (in `barriers`): the operator's command line. `alloc list`,
//! `status`, `events [--follow]`, `restart`, `stop`, `restore`, `delete`;
//! human output for a person at a terminal (80 columns, color only on a
//! terminal and never with `NO_COLOR`), `--json` for scripts.
//!
//! Exit codes: 0 done; 1 the server refused (its code, detail and where
//! the code is explained are printed); 2 usage; 3 the server could not be
//! reached; 4 the TLS handshake failed (the server's certificate was
//! refused, or the server does not speak TLS): a configuration to fix, not
//! a network to wait for.

use std::{fmt::Write as _, io::IsTerminal, path::PathBuf, time::Duration};

use clap::{Args, Subcommand};
use serde_json::{Value, json};

use crate::{
    client::{Endpoint, RequestError},
    secret::Secret,
};

pub mod barriers;
pub mod semaphores;
pub use barriers::BarrierArgs;
pub use semaphores::SemaphoreArgs;

/// What `taskgate alloc --help` says last: how it ends.
const EXIT_CODES: &str = "Exit codes: 0 done; 1 the server refused (its code and what to do are \
printed); 2 usage; 3 the server cannot be reached; 4 the TLS handshake failed (check --ca-cert)";

/// How the operator's commands (`alloc`, `semaphore`) reach the server
/// and print its answers.
#[derive(Debug, Clone, Args)]
pub struct Connection {
    /// The server's base URL.
    #[arg(
        long,
        env = "TASKGATE_SERVER",
        default_value = "http://127.0.0.1:8080",
        global = true
    )]
    pub server: String,
    /// A token (a reader's to look, an operator's to change anything).
    #[arg(long, env = "TASKGATE_TOKEN", hide_env_values = true, global = true)]
    pub token: Option<Secret>,
    /// PEM CA certificate(s) to trust for an `https` server.
    #[arg(long, env = "TASKGATE_CA_CERT", global = true)]
    pub ca_cert: Option<PathBuf>,
    /// Print the server's JSON answer instead of the human summary.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
#[command(after_help = EXIT_CODES)]
pub struct AllocArgs {
    #[command(flatten)]
    pub conn: Connection,
    #[command(subcommand)]
    pub command: AllocCommand,
}

#[derive(Debug, Clone, Subcommand)]
pub enum AllocCommand {
    /// One line per allocation: ID, state, trouble, tasks by state,
    /// waiting on.
    List {
        /// Only IDs that start with this.
        #[arg(long, default_value = "")]
        prefix: String,
        /// Only allocations in one of these states (comma-separated):
        /// running, finished, failed, lost, blocked.
        #[arg(long, value_delimiter = ',', value_parser = ["running", "finished", "failed", "lost", "blocked"])]
        state: Vec<String>,
    },
    /// What the allocation is doing and why, its tasks and its recent
    /// timeline.
    Status {
        /// The allocation's ID.
        id: String,
    },
    /// The allocation's timeline; `--follow` keeps printing as it grows.
    Events {
        /// The allocation's ID.
        id: String,
        /// Keep printing new entries; wait for an allocation not registered
        /// yet and for a server that went away.
        #[arg(long)]
        follow: bool,
    },
    /// Restart the running tasks, one task, or every task.
    Restart {
        /// The allocation's ID.
        id: String,
        /// Restart only this task (it must be running).
        #[arg(long, conflicts_with = "all_tasks")]
        task: Option<String>,
        /// Restart every task, the dead ones too: every gate closes and the
        /// allocation starts over from prestart.
        #[arg(long)]
        all_tasks: bool,
        /// Why, recorded in the restart order and the timeline.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Stop the allocation: every task not yet dead is told to stop, the
    /// poststop tasks run as the cleanup, and the allocation ends
    /// `stopped` (an all-tasks restart runs it again).
    Stop {
        /// The allocation's ID.
        id: String,
    },
    /// Restore the coordinator from known task states (a batch-report JSON
    /// file: `{"tasks": {"web": {"state": "running"}}}`).
    Restore {
        /// The allocation's ID.
        id: String,
        /// The batch-report JSON file with the tasks' known states.
        #[arg(long)]
        file: PathBuf,
    },
    /// Delete the allocation.
    Delete {
        /// The allocation's ID.
        id: String,
    },
}

/// How a command ended.
#[derive(Debug)]
enum Failure {
    /// The server answered with a problem: its status and code, and the
    /// message to print.
    Refused {
        status: u16,
        code: String,
        message: String,
    },
    /// The server could not be reached.
    Unreachable(String),
    /// The TLS handshake failed: the message says what to check.
    Tls(String),
    /// Something the user gave is wrong (a file, a URL).
    Usage(String),
}

const TIMEOUT: Duration = Duration::from_secs(30);
/// A blocking query's wait while following (and the request's timeout
/// above it).
const FOLLOW_WAIT: &str = "60s";

struct Client {
    endpoint: Endpoint,
    token: Option<String>,
}

impl Client {
    async fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value, Failure> {
        self.call_reading(method, path, body, None)
            .await
            .map(|(v, _)| v)
    }

    /// `call`, also returning the answer's header `read`.
    async fn call_reading(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        read: Option<&str>,
    ) -> Result<(Value, Option<String>), Failure> {
        self.answer(method, path, body, read)
            .await
            .map(|(_, v, header)| (v, header))
    }

    /// `call`, also returning the answer's status (201 or 200 for a
    /// creation or a change) and its header `read`.
    async fn answer(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        read: Option<&str>,
    ) -> Result<(u16, Value, Option<String>), Failure> {
        let timeout = if path.contains("wait=") {
            TIMEOUT * 3
        } else {
            TIMEOUT
        };
        let (status, header, bytes) = self
            .endpoint
            .request_reading(
                method,
                path,
                self.token.as_deref(),
                body,
                &[],
                timeout,
                read,
            )
            .await
            .map_err(|e| match e {
                RequestError::Tls(m) => Failure::Tls(m),
                RequestError::Unreachable(m) => {
                    Failure::Unreachable(format!("{}: {m}", self.endpoint.url))
                }
            })?;
        let value: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        if status < 300 {
            return Ok((status, value, header));
        }
        let text = |k: &str| value[k].as_str().unwrap_or_default().to_owned();
        let mut msg = format!("{status} {}: {}", text("code"), text("detail"));
        for e in value["errors"].as_array().into_iter().flatten() {
            let _ = write!(
                msg,
                "\n  {}: {}",
                e["field"].as_str().unwrap_or_default(),
                e["message"].as_str().unwrap_or_default()
            );
        }
        let kind = text("type");
        if kind.starts_with('/') {
            let _ = write!(
                msg,
                "\n  (see {}{kind})",
                self.endpoint.url.trim_end_matches('/')
            );
        }
        if status == 401 {
            msg.push_str("\n  give a token with --token or TASKGATE_TOKEN");
        }
        Err(Failure::Refused {
            status,
            code: text("code"),
            message: msg,
        })
    }
}

/// Colors, only when writing to a terminal and `NO_COLOR` is unset.
struct Paint(bool);

impl Paint {
    fn detect() -> Self {
        Self(std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none())
    }

    fn wrap(&self, code: &str, s: &str) -> String {
        if self.0 {
            format!("\x1b[{code}m{s}\x1b[0m")
        } else {
            s.to_owned()
        }
    }

    fn bold(&self, s: &str) -> String {
        self.wrap("1", s)
    }

    /// A task state with its outcome: green when running or ended well,
    /// red when failed.
    fn state(&self, s: &str, failed: bool) -> String {
        match (s, failed) {
            (_, true) => self.wrap("31", s),
            ("running", _) | ("dead ok", _) => self.wrap("32", s),
            _ => s.to_owned(),
        }
    }
}

/// Runs `taskgate alloc`; returns the exit code.
pub async fn run(args: AllocArgs) -> i32 {
    session("alloc", &args.conn, async |client, paint, out| {
        command(client, &args, paint, out).await
    })
    .await
}

/// Runs one operator command (`taskgate <name> ...`) against the server
/// `conn` names: prints what `work` wrote, or why it failed; returns the
/// exit code.
async fn session(
    name: &str,
    conn: &Connection,
    work: impl AsyncFnOnce(&Client, &Paint, &mut String) -> Result<(), Failure>,
) -> i32 {
    let endpoint = match Endpoint::new(&conn.server, conn.ca_cert.as_deref()) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("taskgate {name}: {e}");
            return 2;
        }
    };
    let client = Client {
        endpoint,
        token: conn.token.as_ref().map(|t| t.0.clone()),
    };
    let paint = Paint::detect();
    let mut out = String::new();
    let done = work(&client, &paint, &mut out).await;
    print!("{out}");
    match done {
        Ok(()) => 0,
        Err(Failure::Refused { message, .. }) => {
            eprintln!("taskgate {name}: the server refused: {message}");
            1
        }
        Err(Failure::Usage(m)) => {
            eprintln!("taskgate {name}: {m}");
            2
        }
        Err(Failure::Unreachable(m)) => {
            eprintln!("taskgate {name}: cannot reach the server: {m}");
            3
        }
        Err(Failure::Tls(m)) => {
            eprintln!("taskgate {name}: {m}");
            4
        }
    }
}

fn enc(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

async fn command(
    client: &Client,
    args: &AllocArgs,
    paint: &Paint,
    out: &mut String,
) -> Result<(), Failure> {
    match &args.command {
        AllocCommand::List { prefix, state } => {
            list(client, prefix, state, args.conn.json, paint, out).await
        }
        AllocCommand::Status { id } => {
            let a = client
                .call("GET", &format!("/v1/allocations/{}", enc(id)), None)
                .await?;
            let t = client
                .call("GET", &format!("/v1/allocations/{}/events", enc(id)), None)
                .await?;
            if args.conn.json {
                let _ = writeln!(out, "{}", json!({"allocation": a, "timeline": t}));
            } else {
                let barriers = barriers::read_for(client, &a).await?;
                let now = time::OffsetDateTime::now_utc();
                status(&a, &t, &barriers, paint, now, out);
            }
            Ok(())
        }
        AllocCommand::Events { id, follow } => {
            events(client, id, *follow, args.conn.json, out).await
        }
        AllocCommand::Restart {
            id,
            task,
            all_tasks,
            reason,
        } => {
            let mut body = json!({});
            if let Some(t) = task {
                body["task"] = json!(t);
            }
            if *all_tasks {
                body["all_tasks"] = json!(true);
            }
            if let Some(r) = reason {
                body["reason"] = json!(r);
            }
            let r = client
                .call(
                    "POST",
                    &format!("/v1/allocations/{}/restart", enc(id)),
                    Some(&body),
                )
                .await?;
            if args.conn.json {
                let _ = writeln!(out, "{r}");
            } else {
                let names: Vec<&str> = r["restarted"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .collect();
                let what = if names.is_empty() {
                    "no task was running: nothing restarted".to_owned()
                } else {
                    format!("restarted {}", names.join(", "))
                };
                let _ = writeln!(
                    out,
                    "{id}: {what}; coordinator {} (index {})",
                    r["coordinator_state"].as_str().unwrap_or("?"),
                    r["index"]
                );
            }
            Ok(())
        }
        AllocCommand::Stop { id } => {
            let a = client
                .call("POST", &format!("/v1/allocations/{}/stop", enc(id)), None)
                .await?;
            if args.conn.json {
                let _ = writeln!(out, "{a}");
            } else {
                let _ = writeln!(
                    out,
                    "{id}: told to stop (Stopped By Operator); coordinator {} (index {}); \
                     poststop tasks run as the cleanup",
                    a["coordinator_state"].as_str().unwrap_or("?"),
                    a["modify_index"]
                );
            }
            Ok(())
        }
        AllocCommand::Restore { id, file } => {
            let text = std::fs::read_to_string(file)
                .map_err(|e| Failure::Usage(format!("{}: {e}", file.display())))?;
            let body: Value = serde_json::from_str(&text)
                .map_err(|e| Failure::Usage(format!("{} is not JSON: {e}", file.display())))?;
            let a = client
                .call(
                    "POST",
                    &format!("/v1/allocations/{}/restore", enc(id)),
                    Some(&body),
                )
                .await?;
            if args.conn.json {
                let _ = writeln!(out, "{a}");
            } else {
                let _ = writeln!(
                    out,
                    "{id}: restored; coordinator {} (index {})",
                    a["coordinator_state"].as_str().unwrap_or("?"),
                    a["modify_index"]
                );
            }
            Ok(())
        }
        AllocCommand::Delete { id } => {
            client
                .call("DELETE", &format!("/v1/allocations/{}", enc(id)), None)
                .await?;
            if args.conn.json {
                let _ = writeln!(out, "{}", json!({"deleted": id}));
            } else {
                let _ = writeln!(out, "{id}: deleted");
            }
            Ok(())
        }
    }
}

/// One listing request per page: the list's items carry what a line
/// shows (tasks by state, waiting on), so no allocation is read on its own.
async fn list(
    client: &Client,
    prefix: &str,
    state: &[String],
    as_json: bool,
    paint: &Paint,
    out: &mut String,
) -> Result<(), Failure> {
    let mut items = Vec::new();
    let mut next = String::new();
    loop {
        let mut path = format!("/v1/allocations?per_page=1000&prefix={}", enc(prefix));
        if !state.is_empty() {
            let _ = write!(path, "&state={}", enc(&state.join(",")));
        }
        if !next.is_empty() {
            let _ = write!(path, "&next_token={}", enc(&next));
        }
        let (page, token) = client
            .call_reading("GET", &path, None, Some("x-taskgate-nexttoken"))
            .await?;
        if let Value::Array(page) = page {
            items.extend(page);
        }
        match token {
            Some(t) => next = t,
            None => break,
        }
    }
    if as_json {
        let _ = writeln!(out, "{}", Value::Array(items));
        return Ok(());
    }
    if items.is_empty() {
        let _ = writeln!(out, "no allocations");
        return Ok(());
    }
    // ID, state, trouble, tasks by state, waiting on.
    let rows: Vec<[String; 5]> = items
        .iter()
        .map(|v| {
            let by_state: Vec<String> = ["running", "pending", "dead"]
                .iter()
                .map(|s| (s, v["task_states"][s].as_u64().unwrap_or(0)))
                .filter(|(_, n)| *n > 0)
                .map(|(s, n)| format!("{n} {s}"))
                .collect();
            let words = |key: &str, field: &dyn Fn(&Value) -> Option<&str>| -> Vec<String> {
                let all = v[key].as_array().into_iter().flatten();
                all.filter_map(field).map(str::to_owned).collect()
            };
            let waiting = words("waiting_on", &Value::as_str);
            let trouble = words("trouble", &|t| t["kind"].as_str());
            let state = match v["finished"].as_bool() {
                Some(true) => "finished",
                _ => v["coordinator_state"].as_str().unwrap_or(""),
            };
            [
                v["id"].as_str().unwrap_or("").to_owned(),
                state.to_owned(),
                if trouble.is_empty() {
                    "-".to_owned()
                } else {
                    trouble.join(",")
                },
                by_state.join(", "),
                waiting.join(", "),
            ]
        })
        .collect();
    // Each column as wide as its widest cell, up to a cap, so that a line
    // keeps to 80 columns and leaves what it waits on the most room.
    const HEADER: [&str; 5] = ["ID", "State", "Trouble", "Tasks", "Waiting on"];
    const CAPS: [usize; 4] = [20, 10, 13, 28];
    let widths: Vec<usize> = (0..CAPS.len())
        .map(|c| {
            let widest = rows.iter().map(|r| r[c].chars().count());
            widest.fold(HEADER[c].len(), usize::max).min(CAPS[c])
        })
        .collect();
    let room = 80 - widths.iter().map(|w| w + 2).sum::<usize>();
    let line = |cells: [&str; 5], troubled: bool| {
        let mut line = String::new();
        for (c, &w) in widths.iter().enumerate() {
            let cell = format!("{:<w$}", fit(cells[c], w));
            // Coloured after padding, so the escape codes take no width.
            let cell = if c == 2 && troubled {
                paint.wrap("31", &cell)
            } else {
                cell
            };
            let _ = write!(line, "{cell}  ");
        }
        line.push_str(&fit(cells[4], room));
        line.trim_end().to_owned()
    };
    let _ = writeln!(out, "{}", line(HEADER, false));
    for r in &rows {
        let cells = [&r[0], &r[1], &r[2], &r[3], &r[4]].map(String::as_str);
        let _ = writeln!(out, "{}", line(cells, r[2] != "-"));
    }
    Ok(())
}

/// `s` in lines of at most `width` characters, broken at spaces (a word
/// longer than that, such as a long task name, is broken across lines).
fn wrap(s: &str, width: usize) -> Vec<String> {
    let mut lines = vec![String::new()];
    for word in s.split_whitespace() {
        let chars: Vec<char> = word.chars().collect();
        for piece in chars.chunks(width.max(1)) {
            let last = lines.last_mut().expect("one line at least");
            let used = last.chars().count();
            if used > 0 && used + 1 + piece.len() > width {
                lines.push(String::new());
            } else if used > 0 {
                last.push(' ');
            }
            lines.last_mut().expect("one line at least").extend(piece);
        }
    }
    lines
}

/// `s` cut to `width` characters, with `…` when cut.
fn fit(s: &str, width: usize) -> String {
    if s.chars().count() <= width {
        return s.to_owned();
    }
    let mut cut: String = s.chars().take(width.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// A field as a cell: a string as it is, `-` for null.
fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".to_owned(),
        other => other.to_string(),
    }
}

/// Rows under a bold header within 80 columns: each column but the last
/// as wide as its widest cell up to its cap (cut with `…` past it), the
/// last in what is left.
fn table(header: &[&str], rows: &[Vec<String>], caps: &[usize], paint: &Paint) -> Vec<String> {
    let widths: Vec<usize> = caps
        .iter()
        .enumerate()
        .map(|(c, cap)| {
            let widest = rows.iter().map(|r| r[c].chars().count());
            widest.fold(header[c].chars().count(), usize::max).min(*cap)
        })
        .collect();
    let room = 80 - widths.iter().map(|w| w + 2).sum::<usize>();
    let line = |cells: &[&str]| {
        let mut line = String::new();
        for (cell, &w) in cells.iter().zip(&widths) {
            let _ = write!(line, "{:<w$}  ", fit(cell, w));
        }
        line.push_str(&fit(cells[widths.len()], room));
        line.trim_end().to_owned()
    };
    let mut lines = vec![paint.bold(&line(header))];
    for r in rows {
        let cells: Vec<&str> = r.iter().map(String::as_str).collect();
        lines.push(line(&cells));
    }
    lines
}

/// "12s ago", "5m ago", "3h ago", "2d ago".
fn ago(then: &str, now: time::OffsetDateTime) -> String {
    let Ok(t) = time::OffsetDateTime::parse(then, &time::format_description::well_known::Rfc3339)
    else {
        return then.to_owned();
    };
    let secs = (now - t).whole_seconds().max(0);
    match secs {
        0..60 => format!("{secs}s ago"),
        60..3600 => format!("{}m ago", secs / 60),
        3600..86400 => format!("{}h ago", secs / 3600),
        _ => format!("{}d ago", secs / 86400),
    }
}

/// What `waiting_on` waits for, as words: "web to be running, init to
/// succeed" (tasks waited on for the same thing together, in order).
pub fn waiting_words(a: &Value) -> String {
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    let names = a["waiting_on"].as_array().into_iter().flatten();
    let whys = a["waiting"].as_array().into_iter().flatten();
    for (name, why) in names.zip(whys) {
        let what = match why.as_str().unwrap_or("") {
            "pending" => "to report pending",
            "success" => "to succeed",
            "running" => "to be running",
            "ready" => "to be ready",
            "dead" => "to end",
            "dependency" => "dependency",
            other => other,
        }
        .to_owned();
        let name = name.as_str().unwrap_or("").to_owned();
        match groups.iter_mut().find(|(w, _)| *w == what) {
            Some((_, names)) => names.push(name),
            None => groups.push((what, vec![name])),
        }
    }
    groups
        .into_iter()
        .map(|(what, names)| match what.as_str() {
            "dependency" => format!("the dependencies of {}", names.join(", ")),
            _ => format!("{} {what}", names.join(", ")),
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// How far off `at` is from `now`: "in 4m0s", "in 12s", "passing now".
fn until(at: &str, now: time::OffsetDateTime) -> String {
    let Ok(t) = time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339)
    else {
        return at.to_owned();
    };
    let secs = (t - now).whole_seconds();
    match secs {
        ..=0 => "passing now".to_owned(),
        1..60 => format!("in {secs}s"),
        60..3600 => format!("in {}m{}s", secs / 60, secs % 60),
        3600..86400 => format!("in {}h{}m", secs / 3600, secs % 3600 / 60),
        _ => format!("in {}d{}h", secs / 86400, secs % 86400 / 3600),
    }
}

/// The status summary of CLI.md: what it does and why in three lines, the
/// task table, the recent timeline (`barriers`: those its tasks name, as
/// `barriers::read_for` read them).
fn status(
    a: &Value,
    timeline: &Value,
    barriers: &[Value],
    paint: &Paint,
    now: time::OffsetDateTime,
    out: &mut String,
) {
    let s = |v: &Value| v.as_str().unwrap_or("").to_owned();
    let waiting = waiting_words(a);
    let state = s(&a["coordinator_state"]);
    let headline = if state == "poststop" {
        match a["outcome"].as_str() {
            Some("failed") => {
                let failed: Vec<String> = a["failed_tasks"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(s)
                    .collect();
                format!("poststop — ended failed ({})", failed.join(", "))
            }
            _ => "poststop — ended successfully".to_owned(),
        }
    } else if waiting.is_empty() {
        state.clone()
    } else {
        format!("{state} — waiting for {waiting}")
    };
    // An ID of up to 128 characters: whole, over as many lines as it takes.
    for (i, line) in wrap(&s(&a["id"]), 70).iter().enumerate() {
        let label = if i == 0 { "ID      " } else { "        " };
        let _ = writeln!(out, "{}  {line}", paint.bold(label));
    }
    let _ = writeln!(out, "{}  {}", paint.bold("State   "), fit(&headline, 70));
    let _ = writeln!(
        out,
        "{}  {} (index {})",
        paint.bold("Modified"),
        ago(&s(&a["modified_at"]), now),
        a["modify_index"]
    );
    for t in a["trouble"].as_array().into_iter().flatten() {
        let said = format!("{}: {}", s(&t["kind"]), s(&t["message"]));
        for (i, line) in wrap(&said, 70).iter().enumerate() {
            let label = if i == 0 { "Trouble " } else { "        " };
            let _ = writeln!(out, "{}  {}", paint.bold(label), paint.wrap("31", line));
        }
        // What to do, under it.
        for (i, line) in wrap(&s(&t["next_step"]), 68).iter().enumerate() {
            let _ = writeln!(out, "          {} {line}", if i == 0 { "→" } else { " " });
        }
    }
    if let Some(at) = a["deadline_at"].as_str() {
        let _ = writeln!(
            out,
            "{}  {state} must end {} ({})",
            paint.bold("Deadline"),
            until(at, now),
            at.get(11..19).unwrap_or(at)
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{}",
        paint.bold(&format!(
            "{:<10}{:<20}{:<8}{:<10}{:<7}{:<9}{:<9}{}",
            "Task", "Stage", "Gate", "State", "Ready", "Desired", "Restarts", "Run"
        ))
    );
    for t in a["tasks"].as_array().into_iter().flatten() {
        let mut stage = s(&t["stage"]).replace("ephemeral", "ephem.");
        if t["leader"] == true {
            stage.push_str(" (leader)");
        }
        let failed = t["failed"] == true;
        let st = match (s(&t["state"]).as_str(), failed) {
            _ if t["lost"] == true => "lost".to_owned(),
            ("dead", true) => "dead fail".to_owned(),
            ("dead", false) => "dead ok".to_owned(),
            (other, _) => other.to_owned(),
        };
        let ready = if t["readiness"] == true {
            if t["ready"] == true { "yes" } else { "no" }
        } else {
            "-"
        };
        let desired = match t["stop_reason"]["type"].as_str() {
            Some(_) => "stop".to_owned(),
            None => s(&t["desired"]),
        };
        let _ = writeln!(
            out,
            "{:<10}{:<20}{:<8}{}{:<7}{:<9}{:<9}{}",
            fit(&s(&t["name"]), 9),
            fit(&stage, 19),
            if t["allowed"] == true {
                "open"
            } else {
                "closed"
            },
            // Padded before painting, so colors do not break the columns.
            paint.state(&format!("{st:<10}"), failed),
            ready,
            desired,
            t["restarts"].to_string(),
            t["run"].as_str().unwrap_or("-")
        );
    }
    // The allocation's order (its non-poststop tasks share it); a lost
    // task's own "Agent Lost" and a poststop deadline's are said apart.
    let orders = a["tasks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| t["lost"] != true && t["stage"] != "poststop")
        .find_map(|t| t["stop_reason"].as_object());
    let mut said = false;
    if let Some(reason) = orders {
        let named = ["task", "stage", "barrier"]
            .iter()
            .find_map(|k| reason.get(*k).and_then(Value::as_str))
            .map(|t| format!(" ({t})"))
            .unwrap_or_default();
        let order = format!(
            "Stop order: {}{named}",
            reason.get("type").and_then(Value::as_str).unwrap_or("")
        );
        let _ = writeln!(out, "\n{}", fit(&order, 80));
        said = true;
    }
    // What each task waits on besides its gate: its dependencies that do
    // not hold (its semaphores and its barrier are said below, with the
    // ones it holds or passed).
    let mut first = true;
    for t in a["tasks"].as_array().into_iter().flatten() {
        let dependencies = t["blocked_by"].as_array().into_iter().flatten();
        for b in dependencies.filter(|b| b.get("allocation").is_some()) {
            if first {
                let _ = writeln!(out, "\n{}", paint.bold("Blocked by"));
                first = false;
            }
            let path = b["path"]
                .as_array()
                .map(|p| {
                    let steps: Vec<String> = p.iter().map(s).collect();
                    format!(": {}", steps.join(" → "))
                })
                .unwrap_or_default();
            let line = format!(
                "{:<10}{}/{} {} — {}{path}",
                fit(&s(&t["name"]), 9),
                s(&b["allocation"]),
                s(&b["task"]),
                s(&b["condition"]),
                s(&b["why"]).replace('_', " "),
            );
            let _ = writeln!(out, "{}", fit(&line, 80));
        }
    }
    semaphores::of_tasks(a, paint, out);
    barriers::of_tasks(a, barriers, paint, out);
    for t in a["tasks"].as_array().into_iter().flatten() {
        let why = if t["lost"] == true {
            let seen = t["last_seen"].as_str().map_or(String::new(), |at| {
                format!(", last sign of life {}", ago(at, now))
            });
            format!("lost: no sign of life within its TTL{seen}")
        } else if t["stage"] == "poststop" && t["desired"] == "stop" {
            "told to stop: the poststop deadline passed".to_owned()
        } else {
            continue;
        };
        let line = format!("{}: {why}", s(&t["name"]));
        let _ = writeln!(out, "{}{}", if said { "" } else { "\n" }, fit(&line, 80));
        said = true;
    }
    let entries = timeline["events"].as_array().cloned().unwrap_or_default();
    if !entries.is_empty() {
        let _ = writeln!(out, "\n{}", paint.bold("Recent events"));
        for e in entries.iter().skip(entries.len().saturating_sub(10)) {
            let _ = writeln!(out, "{}", fit(&event_line(e), 80));
        }
    }
}

/// One timeline entry on one line: time, who, what.
fn event_line(e: &Value) -> String {
    let s = |v: &Value| v.as_str().unwrap_or("").to_owned();
    let time = s(&e["time"]);
    let clock = time.get(11..19).unwrap_or(&time).to_owned();
    let kind = s(&e["type"]);
    let who = match e["task"].as_str() {
        Some(task) => task.to_owned(),
        None => kind.clone(),
    };
    let what = match (e["task"].as_str(), kind.as_str()) {
        (None, "Registered" | "Restored") => String::new(),
        (None, _) => s(&e["message"]),
        (Some(_), "Task State") => format!("Task State {}", s(&e["message"])),
        (Some(_), _) => {
            let m = s(&e["message"]);
            if m.is_empty() {
                kind.clone()
            } else {
                format!("{kind}: {m}")
            }
        }
    };
    format!("{clock}  {:<15}  {what}", fit(&who, 15))
        .trim_end()
        .to_owned()
}

/// First and longest pause of `--follow` between tries while the server
/// is away or the allocation is not registered yet: short at first (a
/// restart takes a moment), never so long that a returning server waits.
const RETRY_FIRST: Duration = Duration::from_millis(250);
const RETRY_CAP: Duration = Duration::from_secs(5);

/// Why `--follow` is waiting, said once each time it starts waiting for
/// another reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Away {
    NotRegistered,
    Server,
}

/// `--follow`'s waiting between tries: backoff, and one line on stderr
/// per episode (and per change of reason within one).
struct Retry {
    id: String,
    said: Option<Away>,
    pause: Duration,
}

impl Retry {
    fn new(id: &str) -> Self {
        Self {
            id: id.to_owned(),
            said: None,
            pause: RETRY_FIRST,
        }
    }

    /// A try answered: the next episode starts from the first pause.
    fn answered(&mut self) {
        self.said = None;
        self.pause = RETRY_FIRST;
    }

    /// Waits before the next try after `failure`, or returns it when it is
    /// not something that goes away by waiting (a refused token, a TLS
    /// setup to fix).
    async fn wait(&mut self, failure: Failure, seen: bool) -> Result<(), Failure> {
        let (away, why) = match &failure {
            Failure::Refused { status: 404, .. } if !seen => (
                Away::NotRegistered,
                format!("{} is not registered yet; waiting for it", self.id),
            ),
            Failure::Refused {
                status: 429 | 502 | 503 | 504,
                code,
                ..
            } => (
                Away::Server,
                format!("the server is unavailable ({code}); retrying until it answers"),
            ),
            Failure::Unreachable(m) => (
                Away::Server,
                format!("lost the server ({m}); retrying until it answers"),
            ),
            _ => return Err(failure),
        };
        if self.said != Some(away) {
            eprintln!("taskgate alloc: {why}");
            self.said = Some(away);
        }
        // Jittered, so that many followers of one restarted server do not
        // come back in step.
        tokio::time::sleep(self.pause.mul_f64(0.75 + fastrand::f64() / 2.0)).await;
        self.pause = (self.pause * 2).min(RETRY_CAP);
        Ok(())
    }
}

/// Whether a failure says the allocation is gone (once it was seen).
fn deleted(f: &Failure) -> bool {
    matches!(
        f,
        Failure::Refused {
            status: 404 | 410,
            ..
        }
    )
}

async fn events(
    client: &Client,
    id: &str,
    follow: bool,
    as_json: bool,
    out: &mut String,
) -> Result<(), Failure> {
    let path = format!("/v1/allocations/{}/events", enc(id));
    let mut retry = Retry::new(id);
    // With --follow, an allocation not registered yet and a server that
    // does not answer yet are waited for, as the web view does.
    let mut t = loop {
        match client.call("GET", &path, None).await {
            Ok(t) => break t,
            Err(e) if follow => retry.wait(e, false).await?,
            Err(e) => return Err(e),
        }
    };
    retry.answered();
    // Entries already printed: (index, position within that index).
    let mut printed: Option<(u64, usize)> = None;
    loop {
        let entries = t["events"].as_array().cloned().unwrap_or_default();
        let mut last = printed;
        let mut pos_in_index = 0usize;
        let mut prev_index = None;
        for e in &entries {
            let index = e["index"].as_u64().unwrap_or(0);
            pos_in_index = if prev_index == Some(index) {
                pos_in_index + 1
            } else {
                0
            };
            prev_index = Some(index);
            if printed.is_some_and(|p| (index, pos_in_index) <= p) {
                continue;
            }
            if as_json {
                let _ = writeln!(out, "{e}");
            } else {
                let _ = writeln!(out, "{}", fit(&event_line(e), 80));
            }
            last = Some((index, pos_in_index));
        }
        printed = last;
        if !follow {
            return Ok(());
        }
        // Following: print what came so far, then a blocking query for
        // the next change. A server that goes away (a restart) is waited
        // for and the query resumed from the last index printed: the
        // indexes of a server's store go on across its restarts.
        print!("{out}");
        let _ = std::io::Write::flush(&mut std::io::stdout());
        out.clear();
        let index = printed.map_or(0, |p| p.0);
        let asked = format!("{path}?index={index}&wait={FOLLOW_WAIT}");
        match client.call("GET", &asked, None).await {
            Ok(next) => {
                t = next;
                retry.answered();
            }
            Err(e) if deleted(&e) => {
                eprintln!("taskgate alloc: {id} was deleted");
                return Ok(());
            }
            Err(e) => retry.wait(e, true).await?,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_says_what_and_why_in_three_lines_within_80_columns() {
        let a = json!({
            "id": "web-42", "coordinator_state": "main",
            "waiting_on": ["web"], "waiting": ["running"],
            "outcome": null, "failed_tasks": [],
            "modify_index": 9, "modified_at": "2026-11-24T12:00:00Z",
            "tasks": [
                {"name": "init", "stage": "prestart_ephemeral", "leader": false, "allowed": false,
                 "state": "dead", "failed": false, "readiness": false, "ready": false,
                 "desired": "run", "stop_reason": null, "restarts": 0},
                {"name": "web", "stage": "main", "leader": true, "allowed": true,
                 "state": "pending", "failed": false, "readiness": false, "ready": false,
                 "desired": "run", "stop_reason": null, "restarts": 1}
            ]
        });
        let t = json!({"events": [
            {"index": 1, "time": "2026-11-24T12:00:01Z", "type": "Registered", "task": null, "message": "", "details": {}},
            {"index": 2, "time": "2026-11-24T12:00:03Z", "type": "Coordinator", "task": null, "message": "prestart → main", "details": {}}
        ]});
        let mut out = String::new();
        let now = time::macros::datetime!(2026-11-24 12:00:12 UTC);
        status(&a, &t, &[], &Paint(false), now, &mut out);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "ID        web-42");
        assert_eq!(lines[1], "State     main — waiting for web to be running");
        assert_eq!(lines[2], "Modified  12s ago (index 9)");
        assert!(
            out.contains("web       main (leader)       open    pending   -      run      1"),
            "{out}"
        );
        assert!(
            out.contains("12:00:03  Coordinator      prestart → main"),
            "{out}"
        );
        assert!(lines.iter().all(|l| l.chars().count() <= 80), "{out}");
        assert!(!out.contains('\x1b'), "no color off a terminal");
        // A running task shows its run.
        let mut running = a.clone();
        running["tasks"][1]["state"] = json!("running");
        running["tasks"][1]["run"] = json!("1234567");
        let mut out = String::new();
        status(&running, &t, &[], &Paint(false), now, &mut out);
        assert!(out.contains("Restarts Run"), "{out}");
        assert!(
            out.contains(
                "web       main (leader)       open    running   -      run      1        1234567"
            ),
            "{out}"
        );
        assert!(out.lines().all(|l| l.chars().count() <= 80), "{out}");
    }

    #[test]
    fn waiting_reads_as_what_is_awaited_not_as_a_state() {
        let a =
            json!({"waiting_on": ["files", "web", "init"], "waiting": ["dead", "dead", "success"]});
        assert_eq!(waiting_words(&a), "files, web to end; init to succeed");
        assert_eq!(waiting_words(&json!({"waiting_on": [], "waiting": []})), "");
    }

    #[test]
    fn status_names_lost_tasks_and_the_running_deadline() {
        let a = json!({
            "id": "a1", "coordinator_state": "main",
            "waiting_on": ["web"], "waiting": ["running"],
            "outcome": null, "failed_tasks": [],
            "modify_index": 9, "modified_at": "2026-11-24T12:00:00Z",
            "deadline_at": "2026-11-24T12:04:12Z",
            "tasks": [
                {"name": "side", "stage": "prestart_sidecar", "leader": false, "allowed": true,
                 "state": "dead", "failed": true, "lost": true, "readiness": false, "ready": false,
                 "last_seen": "2026-11-24T11:59:30Z",
                 "desired": "stop", "stop_reason": {"type": "Agent Lost", "task": null, "stage": null},
                 "restarts": 0},
                {"name": "web", "stage": "main", "leader": false, "allowed": true,
                 "state": "pending", "failed": false, "lost": false, "readiness": false, "ready": false,
                 "desired": "stop",
                 "stop_reason": {"type": "Sibling Task Failed", "task": "side", "stage": null},
                 "restarts": 0}
            ]
        });
        let mut out = String::new();
        let now = time::macros::datetime!(2026-11-24 12:00:12 UTC);
        status(
            &a,
            &json!({"events": []}),
            &[],
            &Paint(false),
            now,
            &mut out,
        );
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines[3], "Deadline  main must end in 4m0s (12:04:12)",
            "{out}"
        );
        assert!(
            out.contains("side      prestart_sidecar    open    lost "),
            "{out}"
        );
        assert!(
            out.contains("Stop order: Sibling Task Failed (side)"),
            "{out}"
        );
        assert!(
            out.contains("side: lost: no sign of life within its TTL, last sign of life 42s ago"),
            "{out}"
        );
        assert!(lines.iter().all(|l| l.chars().count() <= 80), "{out}");
    }

    #[test]
    fn status_names_the_barrier_that_timed_out_and_says_a_barrier_only_under_barriers() {
        let a = json!({
            "id": "train-1", "coordinator_state": "main",
            "waiting_on": ["worker"], "waiting": ["running"],
            "outcome": null, "failed_tasks": [],
            "modify_index": 9, "modified_at": "2026-11-24T12:00:00Z",
            "tasks": [
                {"name": "worker", "stage": "main", "leader": false, "allowed": false,
                 "state": "pending", "failed": false, "lost": false, "readiness": false,
                 "ready": false, "desired": "stop", "restarts": 0,
                 "stop_reason": {"type": "Barrier Timeout", "task": null, "stage": null,
                                 "barrier": "train-42"},
                 "barrier": {"name": "train-42", "size": 4, "timeout": "10m"},
                 "blocked_by": [{"barrier": "train-42", "why": "timed_out", "size": 4}]}
            ]
        });
        let mut out = String::new();
        let now = time::macros::datetime!(2026-11-24 12:00:12 UTC);
        status(
            &a,
            &json!({"events": []}),
            &[],
            &Paint(false),
            now,
            &mut out,
        );
        assert!(
            out.contains("\nStop order: Barrier Timeout (train-42)\n"),
            "{out}"
        );
        assert!(!out.contains("Blocked by"), "{out}");
        assert!(
            out.contains(
                "\nBarriers\nworker    train-42              \
                 timed out before 4 arrived: it will not start\n"
            ),
            "{out}"
        );
    }

    #[test]
    fn status_says_what_each_task_is_blocked_by() {
        let a = json!({
            "id": "app", "coordinator_state": "main",
            "waiting_on": ["web"], "waiting": ["dependency"],
            "outcome": null, "failed_tasks": [],
            "modify_index": 9, "modified_at": "2026-11-24T12:00:00Z",
            "tasks": [
                {"name": "web", "stage": "main", "leader": false, "allowed": false,
                 "state": "pending", "failed": false, "lost": false, "readiness": false,
                 "ready": false, "desired": "run", "stop_reason": null, "restarts": 0,
                 "blocked_by": [
                     {"allocation": "db-7", "task": "db", "condition": "ready", "why": "not_ready"},
                     {"allocation": "x", "task": "y", "condition": "running", "why": "cycle",
                      "path": ["app/web", "x/y", "app/web"]}
                 ]}
            ]
        });
        let mut out = String::new();
        let now = time::macros::datetime!(2026-11-24 12:00:12 UTC);
        status(
            &a,
            &json!({"events": []}),
            &[],
            &Paint(false),
            now,
            &mut out,
        );
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines[1],
            "State     main — waiting for the dependencies of web"
        );
        assert!(
            out.contains("Blocked by\nweb       db-7/db ready — not ready\n"),
            "{out}"
        );
        assert!(
            out.contains("web       x/y running — cycle: app/web → x/y → app/web"),
            "{out}"
        );
    }
}
