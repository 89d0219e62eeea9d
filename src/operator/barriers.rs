//! `taskgate barrier status` (docs/lifecycle.md, "Barriers"), with the
//! output, exit codes and flags of `taskgate alloc`; and the barriers part
//! of `alloc status`.

use std::fmt::Write as _;

use clap::{Args, Subcommand};
use serde_json::Value;
use time::format_description::well_known::Rfc3339;

use super::{
    Client, Connection, EXIT_CODES, Failure, Paint, ago, enc, fit, session, table, text, until,
    wrap,
};

#[derive(Debug, Clone, Args)]
#[command(after_help = EXIT_CODES)]
pub struct BarrierArgs {
    #[command(flatten)]
    pub conn: Connection,
    #[command(subcommand)]
    pub command: BarrierCommand,
}

#[derive(Debug, Clone, Subcommand)]
pub enum BarrierCommand {
    /// A barrier's state (gathering, open, timed out), size, timeout and
    /// how many arrived, then its members and where each stands.
    Status {
        /// The barrier's name, as its tasks name it.
        name: String,
    },
}

/// Members `status` prints at most; `--json` has every one.
const SHOWN: usize = 20;

/// Runs `taskgate barrier`; returns the exit code.
pub async fn run(args: BarrierArgs) -> i32 {
    session("barrier", &args.conn, async |client, paint, out| {
        let BarrierCommand::Status { name } = &args.command;
        let b = client
            .call("GET", &path(name), None)
            .await
            .map_err(where_to_look)?;
        if args.conn.json {
            let _ = writeln!(out, "{b}");
        } else {
            status(&b, paint, time::OffsetDateTime::now_utc(), out);
        }
        Ok(())
    })
    .await
}

fn path(name: &str) -> String {
    format!("/v1/barriers/{}", enc(name))
}

/// A barrier not found, with what makes one exist (there is no list of
/// them to look in).
fn where_to_look(f: Failure) -> Failure {
    match f {
        Failure::Refused {
            status,
            code,
            mut message,
        } if code == "barrier_not_found" => {
            message.push_str(
                "\n  a barrier exists while a task of a registered allocation names it:\
                 \n  `taskgate alloc status ID` shows a task's barrier",
            );
            Failure::Refused {
                status,
                code,
                message,
            }
        }
        other => other,
    }
}

/// When a gathering barrier times out: `timeout` after the earliest
/// arrival among those that count now (none: it does not).
fn due(b: &Value) -> Option<time::OffsetDateTime> {
    let timeout = b["timeout"].as_str()?;
    let timeout = crate::units::parse_duration(timeout).ok()?;
    let first = b["members"]
        .as_array()?
        .iter()
        .filter_map(|m| m["arrived_at"].as_str())
        .filter_map(|at| time::OffsetDateTime::parse(at, &Rfc3339).ok())
        .min()?;
    Some(first + timeout)
}

/// A member's `standing` in words.
fn standing_words(s: &Value) -> String {
    match s.as_str() {
        Some("absent") => "not arrived".to_owned(),
        Some("timed_out") => "timed out".to_owned(),
        _ => text(s),
    }
}

/// `barrier status`: what it has come to in the first lines, then its
/// members (cut at `SHOWN`, saying how many more).
fn status(b: &Value, paint: &Paint, now: time::OffsetDateTime, out: &mut String) {
    let label = |l: &str| paint.bold(&format!("{l:<8}"));
    // A name of up to 128 characters: whole, over as many lines as it takes.
    for (i, line) in wrap(&text(&b["name"]), 70).iter().enumerate() {
        let _ = writeln!(out, "{}  {line}", label(if i == 0 { "Name" } else { "" }));
    }
    let size = text(&b["size"]);
    let members = b["members"].as_array().cloned().unwrap_or_default();
    let state = match b["state"].as_str() {
        Some("gathering") => format!("gathering: {} of {size} arrived", text(&b["arrived"])),
        Some("open") => "open: its members were released together".to_owned(),
        Some("timed_out") => "timed out: its members' allocations were told to stop".to_owned(),
        _ => text(&b["state"]),
    };
    let _ = writeln!(out, "{}  {state}", label("State"));
    let _ = writeln!(
        out,
        "{}  {size}: {} registered",
        label("Size"),
        members.len()
    );
    let timeout = match (b["timeout"].as_str(), due(b)) {
        (None, _) => "none: it may gather for ever".to_owned(),
        (Some(t), Some(at)) if b["state"] == "gathering" => {
            let when = if at <= now {
                "now".to_owned()
            } else {
                until(&at.format(&Rfc3339).unwrap_or_default(), now)
            };
            let clock = at.time();
            format!(
                "{t} from the first arrival: times out {when} ({:02}:{:02}:{:02})",
                clock.hour(),
                clock.minute(),
                clock.second()
            )
        }
        (Some(t), _) => format!("{t} from the first arrival"),
    };
    let _ = writeln!(out, "{}  {timeout}", label("Timeout"));
    let opened = match b["opened_at"].as_str() {
        Some(at) => {
            let second = at.get(..19).unwrap_or(at).replace('T', " ");
            format!("{} ({second} UTC)", ago(at, now))
        }
        None => "-".to_owned(),
    };
    let _ = writeln!(out, "{}  {opened}", label("Opened"));
    let _ = writeln!(
        out,
        "{}  index {}",
        label("Modified"),
        text(&b["modify_index"])
    );

    let _ = writeln!(out);
    let _ = writeln!(out, "{}", paint.bold("Members, in registration order"));
    let rows: Vec<Vec<String>> = members
        .iter()
        .take(SHOWN)
        .map(|m| {
            vec![
                text(&m["allocation"]),
                text(&m["task"]),
                standing_words(&m["standing"]),
                m["arrived_at"]
                    .as_str()
                    .map_or_else(|| "-".to_owned(), |at| ago(at, now)),
            ]
        })
        .collect();
    let header = ["Allocation", "Task", "Standing", "Arrived"];
    for line in table(&header, &rows, &[30, 20, 11], paint) {
        let _ = writeln!(out, "{line}");
    }
    if members.len() > SHOWN {
        let _ = writeln!(
            out,
            "… and {} more members (--json lists every one)",
            members.len() - SHOWN
        );
    }
}

/// How task `t` of allocation `id` stands at its barrier. From the
/// barrier as read (`b`): an open or timed-out barrier decided for every
/// member; a gathering one says whether this one arrived. Without it (a
/// token that may not read it), from the task's view alone: its
/// `blocked_by` while it gathers or timed out, its gate once it passed;
/// otherwise the view cannot tell a member that passed from one that has
/// not arrived.
fn standing(id: &str, t: &Value, b: Option<&Value>) -> String {
    let size = text(&t["barrier"]["size"]);
    let gathering = |arrived: &Value| format!("gathering: {} of {size} arrived", text(arrived));
    let passed = || format!("passed (all {size} released together)");
    let timed_out = || format!("timed out before {size} arrived: it will not start");
    if let Some(b) = b {
        let member = b["members"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|m| m["allocation"].as_str() == Some(id) && m["task"] == t["name"]);
        match (b["state"].as_str(), member.map(|m| &m["standing"])) {
            (Some("open"), _) => return passed(),
            (Some("timed_out"), _) => return timed_out(),
            (Some("gathering"), Some(s)) if s == "arrived" => return gathering(&b["arrived"]),
            (Some("gathering"), Some(_)) => {
                return format!("not arrived yet ({} of {size} have)", text(&b["arrived"]));
            }
            _ => {}
        }
    }
    let blocked = t["blocked_by"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e.get("barrier").is_some());
    match blocked {
        Some(e) if e["why"] == "gathering" => gathering(&e["arrived"]),
        Some(e) if e["why"] == "timed_out" => timed_out(),
        Some(e) => text(&e["why"]).replace('_', " "),
        None if t["allowed"] == true => passed(),
        None => format!("not waiting at it now (size {size})"),
    }
}

/// The barriers the tasks of `a` name, each once, as read now; one that
/// cannot be read (a token that may not, a barrier just forgotten) is
/// left out, and its tasks' standing is told from their view alone.
pub(super) async fn read_for(client: &Client, a: &Value) -> Result<Vec<Value>, Failure> {
    let mut names: Vec<&str> = a["tasks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["barrier"]["name"].as_str())
        .collect();
    names.sort_unstable();
    names.dedup();
    let mut read = Vec::new();
    for name in names {
        match client.call("GET", &path(name), None).await {
            Ok(b) => read.push(b),
            Err(e @ (Failure::Unreachable(_) | Failure::Tls(_))) => return Err(e),
            Err(_) => {}
        }
    }
    Ok(read)
}

/// The "Barriers" part of `alloc status`: each task that names a barrier,
/// the barrier and how the task stands at it (`read`: the barriers as
/// `read_for` read them).
pub(super) fn of_tasks(a: &Value, read: &[Value], paint: &Paint, out: &mut String) {
    let id = a["id"].as_str().unwrap_or("");
    let mut first = true;
    for t in a["tasks"].as_array().into_iter().flatten() {
        let Some(name) = t["barrier"]["name"].as_str() else {
            continue;
        };
        if first {
            let _ = writeln!(out, "\n{}", paint.bold("Barriers"));
            first = false;
        }
        let b = read.iter().find(|b| b["name"] == name);
        let line = format!(
            "{:<10}{:<22}{}",
            fit(&text(&t["name"]), 9),
            fit(name, 21),
            standing(id, t, b)
        );
        let _ = writeln!(out, "{}", fit(&line, 80));
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const NOW: time::OffsetDateTime = time::macros::datetime!(2026-11-29 10:00:12 UTC);

    /// Barrier `train-42` of size 4 with `members` registered, the first
    /// `arrived` of them arrived (the first at 10:00:00, the others at
    /// 10:00:09).
    fn gathering(members: usize, arrived: usize) -> Value {
        let members: Vec<Value> = (0..members)
            .map(|i| {
                let at = match i {
                    _ if i >= arrived => Value::Null,
                    0 => json!("2026-11-29T10:00:00Z"),
                    _ => json!("2026-11-29T10:00:09Z"),
                };
                let standing = if i < arrived { "arrived" } else { "absent" };
                json!({"allocation": format!("train-{}", i + 1), "task": "worker",
                       "arrived_at": at, "standing": standing})
            })
            .collect();
        json!({"name": "train-42", "size": 4, "timeout": "10m", "members": members,
               "state": "gathering", "arrived": arrived, "opened_at": null, "modify_index": 1050})
    }

    /// `b` decided: every member `standing`, none counted as arrived.
    fn decided(mut b: Value, state: &str, standing: &str) -> Value {
        b["state"] = json!(state);
        b["arrived"] = json!(0);
        for m in b["members"].as_array_mut().unwrap() {
            m["standing"] = json!(standing);
            m["arrived_at"] = Value::Null;
        }
        b
    }

    #[test]
    fn status_says_how_many_arrived_and_when_it_times_out_then_each_member() {
        let mut out = String::new();
        status(&gathering(3, 2), &Paint(false), NOW, &mut out);
        assert_eq!(
            out,
            "Name      train-42\n\
             State     gathering: 2 of 4 arrived\n\
             Size      4: 3 registered\n\
             Timeout   10m from the first arrival: times out in 9m48s (10:10:00)\n\
             Opened    -\n\
             Modified  index 1050\n\
             \n\
             Members, in registration order\n\
             Allocation  Task    Standing     Arrived\n\
             train-1     worker  arrived      12s ago\n\
             train-2     worker  arrived      3s ago\n\
             train-3     worker  not arrived  -\n"
        );
        // Nobody arrived yet: nothing counts down.
        let mut out = String::new();
        status(&gathering(1, 0), &Paint(false), NOW, &mut out);
        assert!(
            out.contains("\nTimeout   10m from the first arrival\n"),
            "{out}"
        );
        // Past due (the server decides in a moment), and no timeout at all.
        let mut out = String::new();
        status(
            &gathering(2, 1),
            &Paint(false),
            NOW + time::Duration::hours(1),
            &mut out,
        );
        assert!(out.contains(": times out now (10:10:00)\n"), "{out}");
        let mut b = gathering(2, 1);
        b["timeout"] = Value::Null;
        let mut out = String::new();
        status(&b, &Paint(false), NOW, &mut out);
        assert!(
            out.contains("\nTimeout   none: it may gather for ever\n"),
            "{out}"
        );
    }

    #[test]
    fn status_of_an_open_or_timed_out_barrier_says_what_became_of_its_members() {
        let mut open = decided(gathering(4, 4), "open", "passed");
        open["opened_at"] = json!("2026-11-29T10:00:10.123456Z");
        let mut out = String::new();
        status(&open, &Paint(false), NOW, &mut out);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines[1],
            "State     open: its members were released together"
        );
        assert_eq!(lines[3], "Timeout   10m from the first arrival", "{out}");
        assert_eq!(lines[4], "Opened    1s ago (2026-11-29 10:00:10 UTC)");
        assert!(out.ends_with("train-4     worker  passed    -\n"), "{out}");

        let closed = decided(gathering(2, 1), "timed_out", "timed_out");
        let mut out = String::new();
        status(&closed, &Paint(false), NOW, &mut out);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines[1],
            "State     timed out: its members' allocations were told to stop"
        );
        assert_eq!(lines[4], "Opened    -");
        assert!(out.ends_with("train-2     worker  timed out  -\n"), "{out}");
    }

    #[test]
    fn status_keeps_to_80_columns_and_shows_the_first_20_members_of_1000() {
        let mut b = gathering(1000, 3);
        b["name"] = json!("n".repeat(128));
        b["members"][0]["allocation"] = json!("a".repeat(128));
        b["members"][0]["task"] = json!("t".repeat(128));
        let mut out = String::new();
        status(&b, &Paint(false), NOW, &mut out);
        let wide: Vec<&str> = out.lines().filter(|l| l.chars().count() > 80).collect();
        assert!(wide.is_empty(), "wider than 80: {wide:#?}");
        // The name whole, over two lines.
        assert!(
            out.contains(&format!(
                "Name      {}\n          {}\n",
                "n".repeat(70),
                "n".repeat(58)
            )),
            "{out}"
        );
        assert!(out.contains("\ntrain-20 "), "{out}");
        assert!(!out.contains("train-21"), "{out}");
        assert!(
            out.ends_with("… and 980 more members (--json lists every one)\n"),
            "{out}"
        );
    }

    /// An allocation `train-1` whose `worker` is at barrier `train-42`
    /// (size 4), with `blocked_by` and `allowed` as given, beside a task
    /// at no barrier.
    fn member(blocked_by: Value, allowed: bool) -> Value {
        json!({"id": "train-1", "tasks": [
            {"name": "side", "barrier": null, "blocked_by": [], "allowed": true},
            {"name": "worker", "barrier": {"name": "train-42", "size": 4, "timeout": "10m"},
             "blocked_by": blocked_by, "allowed": allowed}
        ]})
    }

    fn barriers_part(a: &Value, read: &[Value]) -> String {
        let mut out = String::new();
        of_tasks(a, read, &Paint(false), &mut out);
        out
    }

    #[test]
    fn alloc_status_tells_each_members_standing_from_its_barrier() {
        let gathers = json!([{"barrier": "train-42", "why": "gathering", "arrived": 2, "size": 4}]);
        assert_eq!(
            barriers_part(&member(gathers, false), &[gathering(3, 2)]),
            "\nBarriers\nworker    train-42              gathering: 2 of 4 arrived\n"
        );
        // train-3 has not arrived: its gate holds it, so its view says
        // nothing of the barrier, and the barrier tells it apart from a
        // member that passed.
        let mut absent = member(json!([]), false);
        absent["id"] = json!("train-3");
        assert_eq!(
            barriers_part(&absent, &[gathering(3, 2)]),
            "\nBarriers\nworker    train-42              not arrived yet (2 of 4 have)\n"
        );
        // Opened, or timed out: decided for every member, this one too
        // (even while its record still follows the decision).
        let open = decided(gathering(4, 4), "open", "passed");
        assert_eq!(
            barriers_part(&absent, &[open]),
            "\nBarriers\nworker    train-42              passed (all 4 released together)\n"
        );
        let closed = decided(gathering(3, 1), "timed_out", "timed_out");
        assert_eq!(
            barriers_part(&absent, &[closed]),
            "\nBarriers\nworker    train-42              \
             timed out before 4 arrived: it will not start\n"
        );
        assert_eq!(
            barriers_part(
                &json!({"id": "x", "tasks": [{"name": "web", "barrier": null}]}),
                &[]
            ),
            "",
            "nothing for an allocation whose tasks name none"
        );
    }

    #[test]
    fn without_its_barrier_alloc_status_tells_what_the_task_view_says() {
        let gathers = json!([{"barrier": "train-42", "why": "gathering", "arrived": 3, "size": 4}]);
        let line = |a: &Value| barriers_part(a, &[]).lines().nth(2).unwrap().to_owned();
        assert_eq!(
            line(&member(gathers, false)),
            "worker    train-42              gathering: 3 of 4 arrived"
        );
        let timed_out = json!([{"barrier": "train-42", "why": "timed_out", "size": 4}]);
        assert_eq!(
            line(&member(timed_out, false)),
            "worker    train-42              timed out before 4 arrived: it will not start"
        );
        assert_eq!(
            line(&member(json!([]), true)),
            "worker    train-42              passed (all 4 released together)"
        );
        // Neither held by it nor allowed: passed and held by its gate
        // since, or not arrived; the view alone cannot tell which.
        assert_eq!(
            line(&member(json!([]), false)),
            "worker    train-42              not waiting at it now (size 4)"
        );
    }
}
