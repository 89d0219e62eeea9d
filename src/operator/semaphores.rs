//! `taskgate semaphore`: `list`, `status`, `set`, `delete`
//! (docs/lifecycle.md, "Semaphores"), with the output, exit codes and
//! flags of `taskgate alloc`; and the semaphores part of `alloc status`.

use std::fmt::Write as _;

use clap::{Args, Subcommand};
use serde_json::{Value, json};

use super::{
    Client, Connection, EXIT_CODES, Failure, Paint, ago, enc, fit, session, table, text, wrap,
};

#[derive(Debug, Clone, Args)]
#[command(after_help = EXIT_CODES)]
pub struct SemaphoreArgs {
    #[command(flatten)]
    pub conn: Connection,
    #[command(subcommand)]
    pub command: SemaphoreCommand,
}

#[derive(Debug, Clone, Subcommand)]
pub enum SemaphoreCommand {
    /// One line per semaphore: name, limit, how many tasks hold it and
    /// wait for it, grant timeout.
    List {
        /// Only names that start with this.
        #[arg(long, default_value = "")]
        prefix: String,
    },
    /// A semaphore's limit, grant timeout and next fence, the tasks that
    /// hold it and the tasks waiting for it, first in line first.
    Status {
        /// The semaphore's name.
        name: String,
    },
    /// Create a semaphore, or change its limit or grant timeout (a lower
    /// limit takes no slot away: no grant until fewer hold it).
    Set {
        /// The semaphore's name (as an allocation ID).
        name: String,
        /// How many tasks may hold it at once: 1 to 10000.
        #[arg(long)]
        limit: u32,
        /// How long a granted task may take to become running, with a unit
        /// (1s to 24h); default: the semaphore's current one, 1m for a new
        /// one.
        #[arg(long)]
        grant_timeout: Option<String>,
    },
    /// Delete a semaphore. Its holders keep their slots until they end;
    /// the tasks waiting for it wait until it is created again.
    Delete {
        /// The semaphore's name.
        name: String,
    },
}

/// Queue entries and holders `status` prints at most; `--json` has every
/// one.
const SHOWN: usize = 20;

/// Runs `taskgate semaphore`; returns the exit code.
pub async fn run(args: SemaphoreArgs) -> i32 {
    session("semaphore", &args.conn, async |client, paint, out| {
        command(client, &args, paint, out)
            .await
            .map_err(name_the_missing)
    })
    .await
}

/// A semaphore not found, with where to look for the ones there are.
fn name_the_missing(f: Failure) -> Failure {
    match f {
        Failure::Refused {
            status,
            code,
            mut message,
        } if code == "semaphore_not_found" => {
            message.push_str("\n  `taskgate semaphore list` shows the semaphores there are");
            Failure::Refused {
                status,
                code,
                message,
            }
        }
        other => other,
    }
}

fn path(name: &str) -> String {
    format!("/v1/semaphores/{}", enc(name))
}

/// The semaphore as it is before a change, for saying what the change
/// did: `None` when there is none, or this token may not read it (the
/// change itself says so if it may not make it either).
async fn before(client: &Client, name: &str) -> Result<Option<Value>, Failure> {
    match client.call("GET", &path(name), None).await {
        Ok(v) => Ok(Some(v)),
        Err(e @ (Failure::Unreachable(_) | Failure::Tls(_))) => Err(e),
        Err(_) => Ok(None),
    }
}

async fn command(
    client: &Client,
    args: &SemaphoreArgs,
    paint: &Paint,
    out: &mut String,
) -> Result<(), Failure> {
    let as_json = args.conn.json;
    match &args.command {
        SemaphoreCommand::List { prefix } => {
            let items = list_all(client, prefix).await?;
            if as_json {
                let _ = writeln!(out, "{}", Value::Array(items));
            } else {
                list(&items, paint, out);
            }
            Ok(())
        }
        SemaphoreCommand::Status { name } => {
            let s = client.call("GET", &path(name), None).await?;
            if as_json {
                let _ = writeln!(out, "{s}");
            } else {
                status(&s, paint, time::OffsetDateTime::now_utc(), out);
            }
            Ok(())
        }
        SemaphoreCommand::Set {
            name,
            limit,
            grant_timeout,
        } => {
            let was = before(client, name).await?;
            let mut body = json!({"limit": limit});
            // Left out, the server would set the default: a change of the
            // limit alone keeps the grant timeout the semaphore has.
            let kept = was.as_ref().and_then(|w| w["grant_timeout"].as_str());
            if let Some(t) = grant_timeout.as_deref().or(kept) {
                body["grant_timeout"] = json!(t);
            }
            let (code, now, _) = client.answer("PUT", &path(name), Some(&body), None).await?;
            if as_json {
                let _ = writeln!(out, "{now}");
            } else {
                let _ = writeln!(out, "{}", set_line(name, code == 201, was.as_ref(), &now));
            }
            Ok(())
        }
        SemaphoreCommand::Delete { name } => {
            let was = before(client, name).await?;
            client.call("DELETE", &path(name), None).await?;
            if as_json {
                let _ = writeln!(out, "{}", json!({"deleted": name}));
            } else {
                let _ = writeln!(out, "{}", delete_line(name, was.as_ref()));
            }
            Ok(())
        }
    }
}

/// Every page of the listing.
async fn list_all(client: &Client, prefix: &str) -> Result<Vec<Value>, Failure> {
    let mut items = Vec::new();
    let mut next = String::new();
    loop {
        let mut path = format!("/v1/semaphores?per_page=1000&prefix={}", enc(prefix));
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
            None => return Ok(items),
        }
    }
}

fn len(v: &Value) -> usize {
    v.as_array().map_or(0, Vec::len)
}

/// `semaphore list`: one line per semaphore.
fn list(items: &[Value], paint: &Paint, out: &mut String) {
    if items.is_empty() {
        let _ = writeln!(out, "no semaphores");
        return;
    }
    let rows: Vec<Vec<String>> = items
        .iter()
        .map(|s| {
            vec![
                text(&s["name"]),
                text(&s["limit"]),
                len(&s["holders"]).to_string(),
                len(&s["queue"]).to_string(),
                text(&s["grant_timeout"]),
            ]
        })
        .collect();
    let header = ["Name", "Limit", "Held", "Queued", "Grant timeout"];
    for line in table(&header, &rows, &[40, 5, 5, 6], paint) {
        let _ = writeln!(out, "{line}");
    }
}

/// `semaphore status`: how full it is in the first lines, then its
/// holders and its queue (each cut at `SHOWN`, saying how many more).
fn status(s: &Value, paint: &Paint, now: time::OffsetDateTime, out: &mut String) {
    let label = |l: &str| paint.bold(&format!("{l:<13}"));
    // A name of up to 128 characters: whole, over as many lines as it takes.
    for (i, line) in wrap(&text(&s["name"]), 65).iter().enumerate() {
        let _ = writeln!(out, "{}  {line}", label(if i == 0 { "Name" } else { "" }));
    }
    let holders = s["holders"].as_array().cloned().unwrap_or_default();
    let queue = s["queue"].as_array().cloned().unwrap_or_default();
    let limit = s["limit"].as_u64().unwrap_or(0);
    let held = holders.len();
    let _ = writeln!(
        out,
        "{}  {limit}: {held} held, {} queued",
        label("Limit"),
        queue.len()
    );
    if held as u64 > limit {
        let _ = writeln!(
            out,
            "{}  over the limit: no grant until fewer than {limit} hold it",
            label("")
        );
    }
    let _ = writeln!(
        out,
        "{}  {}",
        label("Grant timeout"),
        text(&s["grant_timeout"])
    );
    let _ = writeln!(
        out,
        "{}  at least {}",
        label("Next fence"),
        text(&s["next_fence"])
    );
    let _ = writeln!(
        out,
        "{}  index {}",
        label("Modified"),
        text(&s["modify_index"])
    );
    let more = |out: &mut String, n: usize, what: &str| {
        if n > SHOWN {
            let _ = writeln!(
                out,
                "… and {} more {what} (--json lists every one)",
                n - SHOWN
            );
        }
    };

    let _ = writeln!(out);
    if holders.is_empty() {
        let _ = writeln!(out, "{}", paint.bold("Holders: none"));
    } else {
        let _ = writeln!(out, "{}", paint.bold("Holders"));
        let rows: Vec<Vec<String>> = holders
            .iter()
            .take(SHOWN)
            .map(|h| {
                vec![
                    text(&h["allocation"]),
                    text(&h["task"]),
                    text(&h["run"]),
                    text(&h["fence"]),
                    ago(h["since"].as_str().unwrap_or(""), now),
                ]
            })
            .collect();
        let header = ["Allocation", "Task", "Run", "Fence", "Since"];
        for line in table(&header, &rows, &[24, 16, 12, 12], paint) {
            let _ = writeln!(out, "{line}");
        }
        more(out, held, "holding it");
    }

    let _ = writeln!(out);
    if queue.is_empty() {
        let _ = writeln!(out, "{}", paint.bold("Queue: empty"));
    } else {
        let _ = writeln!(out, "{}", paint.bold("Queue, first in line first"));
        let rows: Vec<Vec<String>> = queue
            .iter()
            .take(SHOWN)
            .enumerate()
            .map(|(i, q)| {
                vec![
                    (i + 1).to_string(),
                    text(&q["allocation"]),
                    text(&q["task"]),
                    ago(q["since"].as_str().unwrap_or(""), now),
                ]
            })
            .collect();
        let header = ["#", "Allocation", "Task", "Since"];
        for line in table(&header, &rows, &[4, 30, 20], paint) {
            let _ = writeln!(out, "{line}");
        }
        more(out, queue.len(), "in line");
    }
}

/// What `semaphore set` did, in one line: created, changed (from what to
/// what) or unchanged, and how full the semaphore is now.
fn set_line(name: &str, created: bool, was: Option<&Value>, now: &Value) -> String {
    let (limit, timeout) = (text(&now["limit"]), text(&now["grant_timeout"]));
    let what = if created {
        format!("created: limit {limit}, grant timeout {timeout}")
    } else {
        let from = |field: &str, to: &str| match was.map(|w| text(&w[field])) {
            Some(old) if old != to => format!("{old} → {to}"),
            _ => to.to_owned(),
        };
        let same = was.is_some_and(|w| w["limit"] == now["limit"])
            && was.is_some_and(|w| w["grant_timeout"] == now["grant_timeout"]);
        format!(
            "{}: limit {}, grant timeout {}",
            if same { "unchanged" } else { "changed" },
            from("limit", &limit),
            from("grant_timeout", &timeout)
        )
    };
    let held = len(&now["holders"]);
    let queued = len(&now["queue"]);
    let full = if held as u64 > now["limit"].as_u64().unwrap_or(0) {
        format!(
            "; {held} hold it, over the limit: no grant until fewer do (a lower limit takes no slot away)"
        )
    } else {
        format!("; {held} held, {queued} queued")
    };
    format!("{name}: {what}{full}")
}

/// What `semaphore delete` did, in one line, with what becomes of the
/// tasks that held it or waited for it (`was`, if it could be read).
fn delete_line(name: &str, was: Option<&Value>) -> String {
    let held = was.map_or(0, |w| len(&w["holders"]));
    let queued = was.map_or(0, |w| len(&w["queue"]));
    let mut line = format!("{name}: deleted");
    match held {
        0 => {}
        1 => line.push_str("; its 1 holder keeps its slot until it ends"),
        n => {
            let _ = write!(line, "; its {n} holders keep their slots until they end");
        }
    }
    match queued {
        0 => {}
        1 => line.push_str("; the 1 task waiting for it waits until it is created again"),
        n => {
            let _ = write!(
                line,
                "; the {n} tasks waiting for it wait until it is created again"
            );
        }
    }
    line
}

/// How task `t` stands with semaphore `name`: held (with its grant's
/// fence), in line (its place), or waiting for it to be created.
fn standing(t: &Value, name: &str) -> String {
    let named = |list: &Value| {
        list.as_array()
            .into_iter()
            .flatten()
            .find(|e| e["semaphore"] == name)
            .cloned()
    };
    if let Some(g) = named(&t["grants"]) {
        return format!("held, fence {}", text(&g["fence"]));
    }
    match named(&t["blocked_by"]) {
        Some(b) if b["why"] == "queued" => format!("queued, position {}", text(&b["position"])),
        Some(b) if b["why"] == "not_registered" => {
            "not registered (`semaphore set` creates it)".to_owned()
        }
        Some(b) => text(&b["why"]).replace('_', " "),
        // Not in line: its gate is closed, it is not pending, or it runs
        // without having asked.
        None => "not held".to_owned(),
    }
}

/// The "Semaphores" part of `alloc status`: for each task that acquires
/// any, each semaphore and how the task stands with it.
pub(super) fn of_tasks(a: &Value, paint: &Paint, out: &mut String) {
    let mut first = true;
    for t in a["tasks"].as_array().into_iter().flatten() {
        for name in t["acquire"].as_array().into_iter().flatten() {
            let name = name.as_str().unwrap_or("");
            if first {
                let _ = writeln!(out, "\n{}", paint.bold("Semaphores"));
                first = false;
            }
            let line = format!(
                "{:<10}{:<22}{}",
                fit(&text(&t["name"]), 9),
                fit(name, 21),
                standing(t, name)
            );
            let _ = writeln!(out, "{}", fit(&line, 80));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: time::OffsetDateTime = time::macros::datetime!(2026-11-29 10:00:12 UTC);

    fn semaphore(holders: usize, queued: usize) -> Value {
        let holders: Vec<Value> = (0..holders)
            .map(|i| {
                json!({"allocation": format!("app-{i}"), "task": "migrate",
                       "run": if i == 0 { Value::Null } else { json!("1043") },
                       "fence": 1040 + i, "since": "2026-11-29T10:00:00Z"})
            })
            .collect();
        let queue: Vec<Value> = (0..queued)
            .map(|i| {
                json!({"allocation": format!("wait-{}", i + 1), "task": "migrate",
                       "since": "2026-11-29T10:00:09Z"})
            })
            .collect();
        json!({"name": "db-migrations", "limit": 2, "grant_timeout": "5m",
               "holders": holders, "queue": queue, "next_fence": 1051, "modify_index": 1050})
    }

    #[test]
    fn status_says_how_full_then_who_holds_and_who_waits_in_order() {
        let mut out = String::new();
        status(&semaphore(1, 2), &Paint(false), NOW, &mut out);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "Name           db-migrations");
        assert_eq!(lines[1], "Limit          2: 1 held, 2 queued");
        assert_eq!(lines[2], "Grant timeout  5m");
        assert_eq!(lines[3], "Next fence     at least 1051");
        assert!(
            out.contains(
                "Holders\nAllocation  Task     Run  Fence  Since\napp-0       migrate  -    1040   12s ago\n"
            ),
            "{out}"
        );
        assert!(
            out.contains(
                "#  Allocation  Task     Since\n1  wait-1      migrate  3s ago\n2  wait-2"
            ),
            "{out}"
        );
        assert!(!out.contains("more"), "{out}");
    }

    #[test]
    fn status_of_a_long_queue_shows_the_first_and_says_how_many_more() {
        let mut out = String::new();
        status(&semaphore(2, 45), &Paint(false), NOW, &mut out);
        assert!(out.contains("\n20  wait-20 "), "{out}");
        assert!(!out.contains("wait-21"), "{out}");
        assert!(
            out.ends_with("… and 25 more in line (--json lists every one)\n"),
            "{out}"
        );
        let mut out = String::new();
        status(&semaphore(0, 0), &Paint(false), NOW, &mut out);
        assert!(out.contains("\nHolders: none\n\nQueue: empty\n"), "{out}");
    }

    #[test]
    fn status_and_list_keep_to_80_columns_with_the_longest_names() {
        let long = "n".repeat(128);
        let mut s = semaphore(3, 3);
        s["name"] = json!(long);
        s["holders"][0]["allocation"] = json!("a".repeat(128));
        s["holders"][0]["task"] = json!("t".repeat(128));
        s["queue"][0]["allocation"] = json!("a".repeat(128));
        s["queue"][0]["task"] = json!("t".repeat(128));
        let mut out = String::new();
        status(&s, &Paint(false), NOW, &mut out);
        list(&[s.clone(), semaphore(0, 0)], &Paint(false), &mut out);
        let wide: Vec<&str> = out.lines().filter(|l| l.chars().count() > 80).collect();
        assert!(wide.is_empty(), "wider than 80: {wide:#?}");
        // The name whole, over two lines.
        assert!(
            out.contains(&format!("\n               {}\n", "n".repeat(63))),
            "{out}"
        );
    }

    #[test]
    fn status_says_when_more_hold_it_than_its_limit() {
        let mut out = String::new();
        status(&semaphore(3, 0), &Paint(false), NOW, &mut out);
        assert!(
            out.contains(
                "Limit          2: 3 held, 0 queued\n               \
                 over the limit: no grant until fewer than 2 hold it\nGrant timeout"
            ),
            "{out}"
        );
    }

    #[test]
    fn set_says_whether_it_created_changed_or_left_it() {
        let now = semaphore(1, 0);
        assert_eq!(
            set_line("db-migrations", true, None, &now),
            "db-migrations: created: limit 2, grant timeout 5m; 1 held, 0 queued"
        );
        let mut was = now.clone();
        was["limit"] = json!(1);
        assert_eq!(
            set_line("db-migrations", false, Some(&was), &now),
            "db-migrations: changed: limit 1 → 2, grant timeout 5m; 1 held, 0 queued"
        );
        assert_eq!(
            set_line("db-migrations", false, Some(&now), &now),
            "db-migrations: unchanged: limit 2, grant timeout 5m; 1 held, 0 queued"
        );
        let lowered = semaphore(3, 1);
        assert_eq!(
            set_line("db-migrations", false, None, &lowered),
            "db-migrations: changed: limit 2, grant timeout 5m; 3 hold it, over the limit: \
             no grant until fewer do (a lower limit takes no slot away)"
        );
    }

    #[test]
    fn delete_says_what_becomes_of_holders_and_waiters() {
        assert_eq!(delete_line("s", None), "s: deleted");
        assert_eq!(delete_line("s", Some(&semaphore(0, 0))), "s: deleted");
        assert_eq!(
            delete_line("s", Some(&semaphore(1, 2))),
            "s: deleted; its 1 holder keeps its slot until it ends; \
             the 2 tasks waiting for it wait until it is created again"
        );
    }

    #[test]
    fn alloc_status_shows_each_acquired_semaphore_held_queued_or_missing() {
        let a = json!({"tasks": [
            {"name": "migrate", "acquire": ["db", "later"], "grants": [],
             "blocked_by": [
                 {"allocation": "x", "task": "y", "condition": "running", "why": "not_running"},
                 {"semaphore": "db", "why": "queued", "position": 2},
                 {"semaphore": "later", "why": "not_registered"}]},
            {"name": "seed", "acquire": ["db"], "grants": [{"semaphore": "db", "fence": 1040}],
             "blocked_by": []},
            {"name": "web", "acquire": [], "grants": [], "blocked_by": []},
            {"name": "idle", "acquire": ["db"], "grants": [], "blocked_by": []}
        ]});
        let mut out = String::new();
        of_tasks(&a, &Paint(false), &mut out);
        assert_eq!(
            out,
            "\nSemaphores\n\
             migrate   db                    queued, position 2\n\
             migrate   later                 not registered (`semaphore set` creates it)\n\
             seed      db                    held, fence 1040\n\
             idle      db                    not held\n"
        );
        let mut out = String::new();
        of_tasks(
            &json!({"tasks": [{"name": "web", "acquire": []}]}),
            &Paint(false),
            &mut out,
        );
        assert_eq!(out, "", "nothing for an allocation that acquires none");
    }
}
