//! What differs between the spec `--register` gives and the allocation the
//! server holds under that ID, said so that an operator knows which task
//! to look at: the server answers only that they differ (409
//! `allocation_exists`).

use serde_json::{Value, json};

/// The task fields a spec may leave out, with the value the server takes
/// for them; they are compared whether the file gives them or not.
const DEFAULTED: [&str; 3] = ["lifecycle", "leader", "readiness"];

/// Each difference between `file` (a spec as registered) and `stored` (the
/// allocation view), in words; empty if this agent sees none.
pub fn differences(file: &Value, stored: &Value) -> Vec<String> {
    let ours = tasks(file);
    let theirs = tasks(stored);
    let mut out = Vec::new();
    for (name, _) in &ours {
        if !theirs.iter().any(|(n, _)| n == name) {
            out.push(format!(
                "task {name:?} is in the file, not in the stored allocation"
            ));
        }
    }
    for (name, _) in &theirs {
        if !ours.iter().any(|(n, _)| n == name) {
            out.push(format!(
                "task {name:?} is in the stored allocation, not in the file"
            ));
        }
    }
    for (name, task) in &ours {
        let Some((_, view)) = theirs.iter().find(|(n, _)| n == name) else {
            continue;
        };
        let given = task
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, _)| k.as_str());
        let mut fields: Vec<&str> = DEFAULTED.into_iter().chain(given).collect();
        fields.sort_unstable();
        fields.dedup();
        for field in fields.into_iter().filter(|f| *f != "name") {
            let known = DEFAULTED.contains(&field);
            let Some(stored_value) = view.get(field).or(known.then_some(&Value::Null)) else {
                // A field the view does not show: nothing to compare with.
                continue;
            };
            let (a, b) = (
                normal(field, task.get(field)),
                normal(field, Some(stored_value)),
            );
            if a != b {
                out.push(format!(
                    "task {name:?}: {field} is {b} in the stored allocation, {a} in the file"
                ));
            }
        }
    }
    let (our_order, their_order): (Vec<_>, Vec<_>) = (
        ours.iter().map(|(n, _)| n.as_str()).collect(),
        theirs.iter().map(|(n, _)| n.as_str()).collect(),
    );
    if out.is_empty() && our_order != their_order {
        out.push(format!(
            "the tasks are in another order: {their_order:?} stored, {our_order:?} in the file"
        ));
    }
    for (key, value) in file.as_object().into_iter().flatten() {
        if key != "tasks"
            && let Some(stored_value) = stored.get(key)
            && stored_value != value
        {
            out.push(format!(
                "{key} is {stored_value} in the stored allocation, {value} in the file"
            ));
        }
    }
    out
}

/// The named tasks of a spec or a view, in order.
fn tasks(v: &Value) -> Vec<(String, &Value)> {
    v["tasks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| Some((t["name"].as_str()?.to_owned(), t)))
        .collect()
}

/// A task field as the server reads it: a default for one left out, and a
/// lifecycle with its `sidecar` flag spelled out.
fn normal(field: &str, value: Option<&Value>) -> Value {
    let value = value.cloned().unwrap_or(Value::Null);
    match field {
        "leader" | "readiness" if value.is_null() => json!(false),
        "lifecycle" if value.is_object() => json!({
            "hook": value["hook"],
            "sidecar": value.get("sidecar").cloned().unwrap_or(json!(false)),
        }),
        _ => value,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(tasks: Value) -> Value {
        json!({"id": "a1", "coordinator_state": "prestart", "tasks": tasks})
    }

    #[test]
    fn a_task_missing_extra_or_changed_is_named() {
        let file = json!({"tasks": [
            {"name": "init", "lifecycle": {"hook": "prestart", "sidecar": true}},
            {"name": "web", "leader": true},
            {"name": "extra"}
        ]});
        let stored = view(json!([
            {"name": "init", "lifecycle": {"hook": "prestart", "sidecar": false},
             "leader": false, "readiness": false, "state": "pending"},
            {"name": "web", "lifecycle": null, "leader": true, "readiness": false},
            {"name": "gone", "lifecycle": null, "leader": false, "readiness": false}
        ]));
        let found = differences(&file, &stored);
        assert_eq!(found.len(), 3, "{found:#?}");
        assert!(found[0].contains("\"extra\" is in the file"), "{found:#?}");
        assert!(found[1].contains("\"gone\" is in the stored"), "{found:#?}");
        assert!(found[2].contains("\"init\": lifecycle"), "{found:#?}");
        assert!(found[2].contains("\"sidecar\":true"), "{found:#?}");
    }

    #[test]
    fn defaults_read_as_the_server_reads_them() {
        let file = json!({"tasks": [{"name": "init", "lifecycle": {"hook": "prestart"}},
                                    {"name": "web"}]});
        let stored = view(json!([
            {"name": "init", "lifecycle": {"hook": "prestart", "sidecar": false},
             "leader": false, "readiness": false},
            {"name": "web", "lifecycle": null, "leader": false, "readiness": false}
        ]));
        assert_eq!(differences(&file, &stored), Vec::<String>::new());
        // A stored leader the file leaves out is a difference.
        let stored = view(json!([
            {"name": "init", "lifecycle": {"hook": "prestart", "sidecar": false},
             "leader": false, "readiness": false},
            {"name": "web", "lifecycle": null, "leader": true, "readiness": false}
        ]));
        let found = differences(&file, &stored);
        assert_eq!(found.len(), 1, "{found:#?}");
        assert!(found[0].contains("\"web\": leader is true"), "{found:#?}");
    }

    #[test]
    fn order_and_other_fields_the_view_shows() {
        let file = json!({"tasks": [{"name": "b"}, {"name": "a", "liveness": {"ttl": "30s"}}]});
        let stored = view(json!([
            {"name": "a", "lifecycle": null, "leader": false, "readiness": false},
            {"name": "b", "lifecycle": null, "leader": false, "readiness": false}
        ]));
        let found = differences(&file, &stored);
        assert_eq!(
            found.len(),
            1,
            "a field the view does not show is not compared"
        );
        assert!(found[0].contains("another order"), "{found:#?}");
        let stored = view(json!([
            {"name": "b", "lifecycle": null, "leader": false, "readiness": false},
            {"name": "a", "lifecycle": null, "leader": false, "readiness": false,
             "liveness": {"ttl": "10s"}}
        ]));
        let found = differences(&file, &stored);
        assert_eq!(found.len(), 1, "{found:#?}");
        assert!(found[0].contains("\"a\": liveness"), "{found:#?}");
    }
}
