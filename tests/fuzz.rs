//! Fuzzing request decoding, proptest-driven, beside the cargo-fuzz targets
//! of `fuzz/`. Generated requests (random bytes, JSON built from the API's
//! own vocabulary, mutated valid bodies, hostile paths and query strings) go
//! through the whole router and are checked by the same function as the
//! `decode` target (`taskgate_fuzzing::check_request`): every answer a
//! documented status with a well-formed body, a refused write changes
//! nothing, the app keeps serving.
//!
//! `TASKGATE_FUZZ_CASES` sets the cases per target (default 1,000). A
//! failing case is saved under `proptest-regressions/` and replayed first on
//! every later run; fixed crashes also get a named test below.

mod common;

use common::test_app;
use proptest::{prelude::*, test_runner::FileFailurePersistence};
use serde_json::{Value, json};
use taskgate_fuzzing::{WRITES, check_request, encode};

fn cases() -> u32 {
    std::env::var("TASKGATE_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000)
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: cases(),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("regressions"))),
        ..ProptestConfig::default()
    }
}

/// JSON from the API's own words, so the decoder gets past the first key.
fn arb_json() -> impl Strategy<Value = Value> {
    let key = prop::sample::select(vec![
        "tasks",
        "name",
        "lifecycle",
        "hook",
        "sidecar",
        "leader",
        "state",
        "failed",
        "event",
        "type",
        "message",
        "details",
        "time",
        "task",
        "all_tasks",
        "reason",
        "web",
        "init",
        "proxy",
        "x",
    ]);
    let word = prop::sample::select(vec![
        "prestart",
        "poststart",
        "poststop",
        "pending",
        "running",
        "dead",
        "web",
        "init",
        "2026-11-22T10:00:00Z",
        "",
        "..",
        "a/b",
        "\u{0}",
        "é",
    ]);
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        word.prop_map(Value::from),
        ".{0,20}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 64, 8, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((key.clone(), inner), 0..6).prop_map(|kv| {
                Value::Object(kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
            }),
        ]
    })
}

fn valid_bodies() -> Vec<Vec<u8>> {
    [
        common::five_tasks(),
        json!({"state": "dead", "failed": true, "event": {"type": "Terminated", "message": "Exit Code: 1", "details": {"exit_code": "1"}, "time": "2026-11-22T10:00:00Z"}}),
        json!({"tasks": {"init": {"state": "dead"}, "proxy": {"state": "running"}}}),
        json!({"all_tasks": true, "reason": "operator"}),
        json!({"task": "web"}),
    ]
    .iter()
    .map(|v| v.to_string().into_bytes())
    .collect()
}

/// A valid body with a few random edits: flips, insertions, deletions,
/// truncation.
fn arb_mutated() -> impl Strategy<Value = Vec<u8>> {
    (
        prop::sample::select(valid_bodies()),
        prop::collection::vec((any::<u8>(), any::<prop::sample::Index>(), 0u8..4), 1..6),
    )
        .prop_map(|(mut body, edits)| {
            for (byte, at, kind) in edits {
                if body.is_empty() {
                    break;
                }
                let i = at.index(body.len());
                match kind {
                    0 => body[i] = byte,
                    1 => body.insert(i, byte),
                    2 => {
                        body.remove(i);
                    }
                    _ => body.truncate(i),
                }
            }
            body
        })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn random_bytes_as_bodies(which in 0..WRITES.len(), body in prop::collection::vec(any::<u8>(), 0..256)) {
        let (method, uri) = WRITES[which];
        check_request(method, uri, body);
    }

    #[test]
    fn vocabulary_json_as_bodies(which in 0..WRITES.len(), body in arb_json()) {
        let (method, uri) = WRITES[which];
        check_request(method, uri, body.to_string().into_bytes());
    }

    #[test]
    fn mutated_valid_bodies(which in 0..WRITES.len(), body in arb_mutated()) {
        let (method, uri) = WRITES[which];
        check_request(method, uri, body);
    }

    #[test]
    fn hostile_paths_and_queries(
        id in prop_oneof![Just("a1".to_owned()), "[ -~]{0,12}", ".{0,8}"],
        task in prop_oneof![Just("web".to_owned()), "[ -~]{0,12}"],
        route in 0usize..5,
        query in prop::collection::vec(
            (
                prop::sample::select(vec!["index", "wait", "prefix", "per_page", "next_token", "pretty", "x"]),
                prop_oneof![Just("0".to_owned()), Just("1ms".to_owned()), "[ -~]{0,10}", "[0-9]{1,25}"],
            ),
            0..3,
        ),
    ) {
        let enc = |s: &str| encode(s.as_bytes());
        let path = match route {
            0 => format!("/v1/allocations/{}", enc(&id)),
            1 => format!("/v1/allocations/{}/tasks/{}", enc(&id), enc(&task)),
            2 => format!("/v1/allocations/{}/tasks/{}/start-condition", enc(&id), enc(&task)),
            3 => "/v1/allocations".to_owned(),
            _ => format!("/v1/allocations/{}/tasks/{}/state", enc(&id), enc(&task)),
        };
        // Waits are kept short: a blocking query that parks is a valid
        // answer, not a finding.
        let mut pairs: Vec<String> = query.iter().map(|(k, v)| format!("{k}={}", enc(v))).collect();
        if route == 0 || route == 1 || route == 2 {
            pairs.retain(|p| !p.starts_with("wait="));
            pairs.push("wait=1ms".to_owned());
        }
        let uri = format!("{path}?{}", pairs.join("&"));
        let method = if route == 4 { "PUT" } else { "GET" };
        let body = if route == 4 { br#"{"state": "running"}"#.to_vec() } else { Vec::new() };
        check_request(method, &uri, body);
    }
}

/// Found by `vocabulary_json_as_bodies` (kept in tests/fuzz.regressions):
/// serde's derive also decoded a struct from an array of its fields, so
/// `[]` restarted running tasks and `["running"]` was a report.
#[tokio::test]
async fn regression_arrays_are_not_objects() {
    let app = test_app().await;
    app.register_five("a1").await;
    for (method, uri) in WRITES {
        for body in ["[]", r#"["running"]"#, r#"[[{"name": "web"}]]"#] {
            let answer = app
                .raw(
                    method,
                    uri,
                    Some("application/json"),
                    body.as_bytes().to_vec(),
                )
                .await;
            answer.assert_problem(400, "invalid_json");
        }
    }
}

/// Every input the cargo-fuzz targets keep (`fuzz/seeds/`, and the crashes
/// once found, `fuzz/regressions/`) replayed through the same functions.
#[test]
fn cargo_fuzz_inputs_replay_clean() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut replayed = 0;
    for (dir, target) in [
        ("seeds/decode", taskgate_fuzzing::request as fn(&[u8])),
        ("regressions/decode", taskgate_fuzzing::request),
        ("seeds/lifecycle", taskgate_fuzzing::lifecycle),
        ("regressions/lifecycle", taskgate_fuzzing::lifecycle),
    ] {
        let Ok(entries) = std::fs::read_dir(root.join(dir)) else {
            continue;
        };
        for entry in entries {
            let path = entry.unwrap().path();
            let data = std::fs::read(&path).unwrap();
            if std::panic::catch_unwind(|| target(&data)).is_err() {
                panic!("{} fails again", path.display());
            }
            replayed += 1;
        }
    }
    assert!(replayed >= 10, "only {replayed} inputs found under fuzz/");
}
