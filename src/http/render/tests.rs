//! `render` against serde_json writing the views it must match, on strings
//! that need escaping and strings that do not.

use std::{sync::Arc, time::Duration};

use time::{OffsetDateTime, UtcOffset, macros::datetime};

use super::*;
use crate::{
    http::{
        dto::{BatchBody, RegisterBody},
        views::{AllocationView, Live, StreamLine},
    },
    lifecycle::{AllocId, Limits},
    registry::{Registry, RegistryConfig, feed},
    store::MemoryStore,
};

/// serde_json's own `ESCAPE` table: what it does not write as it is.
fn escaped_by_serde(b: u8) -> bool {
    b < 0x20 || b == b'"' || b == b'\\'
}

#[test]
fn plain_finds_every_byte_serde_escapes_wherever_it_stands() {
    for len in 0..=24 {
        for at in 0..len {
            for b in 0..=255u8 {
                let mut bytes = vec![b'a'; len];
                bytes[at] = b;
                assert_eq!(
                    plain(&bytes),
                    !escaped_by_serde(b),
                    "byte {b:#04x} at {at} of {len}"
                );
            }
        }
        assert!(plain(&vec![b'a'; len]));
    }
    // Bytes just around the ones that count, in every lane of a word:
    // no neighbour is taken for one of them.
    for b in [
        0x1f, 0x20, 0x21, 0x22, 0x23, 0x5b, 0x5c, 0x5d, 0x7f, 0x80, 0xff,
    ] {
        let bytes = [b; 16];
        assert_eq!(plain(&bytes), !escaped_by_serde(b), "{b:#04x}");
    }
}

/// Strings that need escaping (quotes, backslashes, every control
/// character, at the start, the end and across the eight-byte words) and
/// strings that do not (ASCII, non-ASCII, DEL, line separators).
fn strings() -> Vec<String> {
    let mut all: Vec<String> = [
        "",
        "Started",
        "report 5 of this task, sent by the benchmark",
        "say \"hi\"",
        "\"",
        "back\\slash",
        "C:\\tasks\\web",
        "tab\there",
        "line\nbreak\r\n",
        "\u{0}",
        "bell\u{7} and escape \u{1b}[0m",
        "\u{8}\u{c}\u{b}\u{1f}",
        "DEL \u{7f} is written as it is",
        "héllo wörld",
        "日本語のメッセージ",
        "emoji 🎉🚀",
        "separators \u{2028}\u{2029}",
        "1234567\"",
        "12345678\"",
        "123456789\\",
        "exactly 8",
        "0123456789abcdef",
        "0123456789abcde\n",
        "é\"日\\🎉\u{1}",
    ]
    .map(String::from)
    .to_vec();
    all.extend((0u8..0x20).map(|c| format!("before {} after", c as char)));
    all
}

#[test]
fn strings_are_written_as_serde_json_writes_them() {
    for s in strings() {
        let mut out = Vec::new();
        string(&mut out, &s);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            serde_json::to_string(&s).unwrap(),
            "{s:?}"
        );
    }
}

#[derive(serde::Serialize)]
struct Rfc3339Time(#[serde(with = "time::serde::rfc3339")] OffsetDateTime);

#[test]
fn times_are_written_as_time_writes_them() {
    let mut times = vec![
        datetime!(2026-11-26 15:17:25 UTC),
        datetime!(2026-11-26 15:17:25.5 UTC),
        datetime!(2026-11-26 15:17:25.000_000_001 UTC),
        datetime!(2026-11-26 15:17:25.123_456_789 UTC),
        datetime!(2026-11-26 15:17:25.120_000 UTC),
        datetime!(0000-01-01 00:00 UTC),
        datetime!(9999-12-31 23:59:59.999_999_999 UTC),
        datetime!(2024-02-29 12:00 UTC),
        datetime!(2026-11-26 15:17:25.25 +02:00),
        datetime!(2026-11-26 15:17:25 -09:30),
    ];
    let mut t = datetime!(1970-01-01 00:00 UTC);
    for n in 0..2_000i64 {
        // Strides that reach every digit of the date, the time and the
        // fraction.
        t += Duration::from_nanos(
            (n as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) % 40_000_000_000_000_000,
        );
        times.push(t);
        times.push(t.to_offset(UtcOffset::from_hms(5, 45, 0).unwrap()));
    }
    for t in times {
        let mut out = Vec::new();
        time(&mut out, t).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            serde_json::to_string(&Rfc3339Time(t)).unwrap(),
            "{t}"
        );
    }
    // What RFC 3339 cannot say is refused as serde refuses it.
    for t in [
        datetime!(-0001-06-01 00:00 UTC),
        datetime!(2026-01-01 00:00 +01:00:30),
    ] {
        assert!(serde_json::to_string(&Rfc3339Time(t)).is_err());
        assert!(time(&mut Vec::new(), t).is_err(), "{t}");
    }
}

fn registry(default_ttl: Option<Duration>) -> Registry {
    let config = RegistryConfig {
        default_liveness_ttl: default_ttl,
        ..RegistryConfig::default()
    };
    Registry::open(Arc::new(MemoryStore::new()), config).unwrap()
}

async fn register(r: &Registry, id: &str, body: &str) -> Arc<Allocation> {
    let id = AllocId::parse(id).unwrap();
    let body: RegisterBody = serde_json::from_str(body).unwrap();
    let spec = body.into_spec(&Limits::default(), &id).unwrap();
    r.register(id, spec).await.unwrap().0
}

async fn report(r: &Registry, id: &str, body: serde_json::Value) -> Arc<Allocation> {
    let body: BatchBody = serde_json::from_value(body).unwrap();
    let reports = body.into_reports(&Limits::default()).unwrap();
    r.report(id, reports).await.unwrap()
}

/// The view and the stream line of `a`, written both ways.
fn same_as_serde(r: &Registry, a: &Arc<Allocation>) {
    let mut out = Vec::new();
    allocation(&mut out, a, &r.of(a)).unwrap();
    let expected = serde_json::to_string(&AllocationView::new(a, r)).unwrap();
    assert_eq!(String::from_utf8(out).unwrap(), expected);
    let change = feed::Event::put(a.clone());
    let mut out = Vec::new();
    change_line(&mut out, change.index, a, &r.of(a)).unwrap();
    let expected = serde_json::to_string(&StreamLine::change(&change, r)).unwrap();
    assert_eq!(String::from_utf8(out).unwrap(), expected);
}

fn event(kind: &str, message: &str, details: &[(&str, &str)]) -> serde_json::Value {
    let details: serde_json::Map<String, serde_json::Value> = details
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).into()))
        .collect();
    serde_json::json!({"type": kind, "message": message, "details": details})
}

const SPEC: &str = r#"{
    "tasks": [
        {"name": "init", "lifecycle": {"hook": "prestart"}, "liveness": {"ttl": "1.5s"}},
        {"name": "proxy", "lifecycle": {"hook": "prestart", "sidecar": true}, "readiness": true},
        {"name": "web", "leader": true, "depends_on": [{"task": "db", "allocation": "db-7", "condition": "running"}]},
        {"name": "announce", "lifecycle": {"hook": "poststart"}, "depends_on": [{"task": "proxy", "condition": "ready"}]},
        {"name": "cleanup", "lifecycle": {"hook": "poststop"}, "liveness": {"ttl": "1h30m"}}
    ],
    "deadlines": {"prestart": "10m", "main": "90s"}
}"#;

/// A five-task allocation through its life (histories full of strings
/// that need escaping and strings that do not, TTLs, deadlines,
/// dependencies, readiness, a failure, poststop), on servers with and
/// without a default TTL: every version written both ways.
#[tokio::test]
async fn allocation_views_are_written_as_serde_json_writes_them() {
    for default_ttl in [None, Some(Duration::from_secs(30))] {
        let r = registry(default_ttl);
        let db = register(&r, "db-7", r#"{"tasks": [{"name": "db"}]}"#).await;
        same_as_serde(&r, &db);
        let a = register(&r, "a1", SPEC).await;
        same_as_serde(&r, &a);
        for (n, s) in strings().iter().enumerate() {
            let task = ["init", "proxy", "cleanup"][n % 3];
            let e = event(
                if n % 2 == 0 { "Started" } else { s },
                s,
                &[("exit_code", "0"), (s, s), ("z\"key\\", "\n")],
            );
            let a = report(
                &r,
                "a1",
                serde_json::json!({"tasks": {task: {"state": "pending", "event": e}}}),
            )
            .await;
            same_as_serde(&r, &a);
        }
        let steps = [
            serde_json::json!({"tasks": {"init": {"state": "running", "event": {"type": "Started", "time": "2026-11-26T15:17:25.120+02:00"}}}}),
            serde_json::json!({"tasks": {"proxy": {"state": "running", "ready": true}}}),
            serde_json::json!({"tasks": {"init": {"state": "dead"}}}),
        ];
        for step in steps {
            let a = report(&r, "a1", step).await;
            same_as_serde(&r, &a);
        }
        let db = report(
            &r,
            "db-7",
            serde_json::json!({"tasks": {"db": {"state": "running"}}}),
        )
        .await;
        same_as_serde(&r, &db);
        let a = r.get("a1").unwrap();
        same_as_serde(&r, &a);
        for step in [
            serde_json::json!({"tasks": {"web": {"state": "running"}}}),
            serde_json::json!({"tasks": {"announce": {"state": "running"}}}),
            serde_json::json!({"tasks": {"web": {"state": "dead", "failed": true,
                "event": {"type": "Terminated", "message": "Exit Code: 1", "details": {"exit_code": "1"}}}}}),
            serde_json::json!({"tasks": {"proxy": {"state": "dead"}, "announce": {"state": "dead"}}}),
            serde_json::json!({"tasks": {"cleanup": {"state": "running"}}}),
        ] {
            let a = report(&r, "a1", step).await;
            same_as_serde(&r, &a);
        }
        let a = r.get("a1").unwrap();
        assert!(a.outcome().is_some(), "the allocation reached poststop");
        assert!(
            (0..a.tasks.len()).any(|i| a.desired(i).reason().is_some()),
            "some task is told to stop"
        );
    }
}

/// A dependency judged part of a cycle (a registration that closes one
/// is refused, but replicas that register concurrently can make one):
/// `blocked_by` with its path, which needs escaping or not.
#[tokio::test]
async fn a_cycle_and_its_path_are_written_as_serde_json_writes_them() {
    let r = registry(None);
    let spec = r#"{"tasks": [{"name": "web", "depends_on": [
        {"task": "web", "allocation": "c-2", "condition": "running"},
        {"task": "db", "allocation": "c-3", "condition": "ready"}]}]}"#;
    let a = register(&r, "c-1", spec).await;
    same_as_serde(&r, &a);
    let mut cyclic = (*a).clone();
    cyclic.set_verdicts(&|_, j| match j {
        0 => crate::lifecycle::DepState::Cycle(
            vec![
                "c-2/web".to_owned(),
                "c-1/\"web\"\n".to_owned(),
                "c-2/web".to_owned(),
            ]
            .into(),
        ),
        _ => crate::lifecycle::DepState::Holds,
    });
    assert!(matches!(
        cyclic.blocked_by(0).as_slice(),
        [(0, crate::lifecycle::DepState::Cycle(_))]
    ));
    same_as_serde(&r, &Arc::new(cyclic));
}

/// Gates across allocations: a semaphore's queue and grant, a barrier
/// gathering, opened and timed out (its stop order names the barrier),
/// each written both ways.
#[tokio::test(start_paused = true)]
async fn gates_are_written_as_serde_json_writes_them() {
    let config = RegistryConfig {
        clock: crate::registry::Clock::tokio(),
        ..RegistryConfig::default()
    };
    let r = Registry::open(Arc::new(MemoryStore::new()), config).unwrap();
    r.put_semaphore(
        crate::lifecycle::SemName::parse("db").unwrap(),
        1,
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    let member = |barrier: &str, size: u32| {
        format!(
            r#"{{"tasks": [
                {{"name": "migrate", "lifecycle": {{"hook": "prestart"}}, "acquire": ["db"]}},
                {{"name": "worker", "barrier": {{"name": "{barrier}", "size": {size}, "timeout": "1s"}}}}
            ]}}"#
        )
    };
    let ids = ["g-1", "g-2", "t-1"];
    for (id, spec) in ids
        .iter()
        .zip([member("b", 2), member("b", 2), member("t", 3)])
    {
        let a = register(&r, id, &spec).await;
        same_as_serde(&r, &a);
    }
    for id in ids {
        for state in ["running", "dead"] {
            let body = serde_json::json!({"tasks": {"migrate": {"state": state}}});
            // The slot passes on; meanwhile the others queue for it.
            let a = r
                .wait_until(id, Duration::from_secs(60), |a| a.allowed(0))
                .await
                .unwrap();
            same_as_serde(&r, &a);
            let a = report(&r, id, body).await;
            same_as_serde(&r, &a);
        }
    }
    // "b" opens (two members); "t" gathers, then times out.
    for id in ids {
        let a = r
            .wait_until(id, Duration::from_secs(60), |a| {
                a.allowed(1) || a.order().is_stop()
            })
            .await
            .unwrap();
        same_as_serde(&r, &a);
    }
    let t = r.get("t-1").unwrap();
    assert_eq!(
        t.order()
            .reason()
            .and_then(|o| o.barrier.as_ref())
            .map(|b| b.as_str()),
        Some("t")
    );
    assert!(r.get("g-1").unwrap().allowed(1));
}
