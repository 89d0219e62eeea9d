//! Hostile input against the real binary: every malformed, oversized or
//! nonsensical request is answered with the documented 4xx problem+json,
//! changes nothing, and leaves the server healthy.

mod common;

use std::net::SocketAddr;

use common::{
    process::{Server, health},
    raw::{RawAnswer, exchange, gauge, json_request, request, request_with},
};
use serde_json::Value;

/// A server with one registered allocation `a1` (the five-task example)
/// and a snapshot of everything a hostile request could change.
struct Battery {
    server: Server,
    addr: SocketAddr,
    before: Snapshot,
}

#[derive(Debug, PartialEq)]
struct Snapshot {
    a1: Value,
    list: Value,
    last_index: u64,
    allocations: u64,
}

impl Battery {
    fn start() -> Self {
        let server = Server::start(&["--in-memory", "--body-limit", "1048576"]);
        let addr = server.addr();
        let spec = common::five_tasks().to_string();
        let answer = exchange(
            addr,
            &json_request("PUT", "/v1/allocations/a1", spec.as_bytes()),
        );
        assert_eq!(
            answer.status,
            201,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
        let answer = exchange(
            addr,
            &json_request(
                "PUT",
                "/v1/allocations/a1/tasks/init/state",
                br#"{"state": "running"}"#,
            ),
        );
        assert_eq!(answer.status, 200);
        let before = snapshot(addr);
        Self {
            server,
            addr,
            before,
        }
    }

    /// Sends `bytes` and asserts the problem answer.
    #[track_caller]
    fn expect(&self, what: &str, bytes: &[u8], status: u16, code: &str) -> RawAnswer {
        let answer = exchange(self.addr, bytes);
        if answer.status != status || answer.json()["code"] != code {
            panic!(
                "{what}: expected {status} {code}, got {} {}",
                answer.status,
                String::from_utf8_lossy(&answer.body)
            );
        }
        answer.assert_problem(status, code);
        answer
    }

    /// Nothing was stored or changed and the server is healthy.
    fn finish(self) {
        assert_eq!(
            snapshot(self.addr),
            self.before,
            "a hostile request changed state"
        );
        assert!(
            health(&self.server.base),
            "the server is unhealthy afterwards"
        );
        assert_eq!(gauge(self.addr, "taskgate_waiters"), 0);
    }
}

fn snapshot(addr: SocketAddr) -> Snapshot {
    let a1 = exchange(addr, &request("GET", "/v1/allocations/a1", None, b""));
    assert_eq!(a1.status, 200);
    let list = exchange(addr, &request("GET", "/v1/allocations", None, b""));
    assert_eq!(list.status, 200);
    Snapshot {
        a1: a1.json(),
        list: list.json(),
        last_index: gauge(addr, "taskgate_last_index"),
        allocations: gauge(addr, "taskgate_allocations"),
    }
}

const REGISTER: &str = "/v1/allocations/new1";
const REPORT: &str = "/v1/allocations/a1/tasks/web/state";
const BATCH: &str = "/v1/allocations/a1/task-states";
const RESTORE: &str = "/v1/allocations/a1/restore";
const RESTART: &str = "/v1/allocations/a1/restart";

#[test]
fn malformed_truncated_and_mistyped_json_is_invalid_json() {
    let b = Battery::start();
    let cases: &[(&str, &str, &[u8])] = &[
        ("truncated spec", REGISTER, br#"{"tasks": [{"name": "web""#),
        ("unquoted keys", REGISTER, br#"{tasks: []}"#),
        ("empty body", REGISTER, b""),
        ("just whitespace", REPORT, b"   \n"),
        ("trailing garbage", REPORT, br#"{"state": "running"} x"#),
        (
            "two documents",
            REPORT,
            br#"{"state": "running"}{"state": "dead"}"#,
        ),
        ("array instead of object", REPORT, br#"["running"]"#),
        ("null body", REPORT, b"null"),
        ("tasks as a string", REGISTER, br#"{"tasks": "web"}"#),
        ("state as a number", REPORT, br#"{"state": 5}"#),
        (
            "failed as a string",
            REPORT,
            br#"{"state": "dead", "failed": "yes"}"#,
        ),
        ("unknown state", REPORT, br#"{"state": "sleeping"}"#),
        (
            "unknown hook",
            REGISTER,
            br#"{"tasks": [{"name": "a", "lifecycle": {"hook": "prestop"}}]}"#,
        ),
        (
            "unknown field",
            REPORT,
            br#"{"state": "running", "bogus": 1}"#,
        ),
        (
            "duplicate field",
            REPORT,
            br#"{"state": "running", "state": "dead"}"#,
        ),
        (
            "duplicate map key",
            BATCH,
            br#"{"tasks": {"web": {"state": "running"}, "web": {"state": "dead"}}}"#,
        ),
        ("missing state", REPORT, br#"{"failed": true}"#),
        (
            "event detail not a string",
            REPORT,
            br#"{"state": "running", "event": {"type": "Started", "details": {"pid": 12}}}"#,
        ),
        (
            "huge number",
            REPORT,
            br#"{"state": "running", "failed": 1e999}"#,
        ),
        (
            "lone surrogate escape",
            REPORT,
            br#"{"state": "running", "event": {"type": "\ud800"}}"#,
        ),
        (
            "NUL byte outside strings",
            REPORT,
            b"{\"state\":\0\"running\"}",
        ),
        ("restore without tasks", RESTORE, br#"{}"#),
        ("restart mode unknown", RESTART, br#"{"mode": "sometimes"}"#),
    ];
    for (what, path, body) in cases {
        let method = if path.ends_with("task-states")
            || path.ends_with("restore")
            || path.ends_with("restart")
        {
            "POST"
        } else {
            "PUT"
        };
        b.expect(what, &json_request(method, path, body), 400, "invalid_json");
    }
    b.finish();
}

#[test]
fn invalid_utf8_and_deep_nesting_are_invalid_json() {
    let b = Battery::start();
    b.expect(
        "invalid UTF-8 in a string",
        &json_request(
            "PUT",
            REPORT,
            b"{\"state\": \"running\", \"event\": {\"type\": \"\xff\xfe\"}}",
        ),
        400,
        "invalid_json",
    );
    b.expect(
        "invalid UTF-8 in a key",
        &json_request("PUT", REPORT, b"{\"st\xc3\x28te\": \"running\"}"),
        400,
        "invalid_json",
    );
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    b.expect(
        "100,000 nested arrays",
        &json_request("PUT", REGISTER, deep.as_bytes()),
        400,
        "invalid_json",
    );
    let deep_field = format!(
        r#"{{"state": "running", "event": {{"type": "x", "details": {}{}}}}}"#,
        "{\"a\":".repeat(50_000),
        "}".repeat(50_000)
    );
    b.expect(
        "deeply nested object inside a field",
        &json_request("PUT", REPORT, deep_field.as_bytes()),
        400,
        "invalid_json",
    );
    b.finish();
}

#[test]
fn rule_breaking_specs_and_reports_are_invalid_requests() {
    let b = Battery::start();
    let many: Vec<Value> = (0..10_000)
        .map(|i| serde_json::json!({"name": format!("t{i}")}))
        .collect();
    let many = serde_json::json!({ "tasks": many }).to_string();
    let answer = b.expect(
        "10,000 tasks",
        &json_request("PUT", REGISTER, many.as_bytes()),
        400,
        "invalid_request",
    );
    assert!(answer.json()["errors"].to_string().contains("at most"));
    let overlong = format!(
        r#"{{"state": "running", "event": {{"type": "x", "message": "{}"}}}}"#,
        "m".repeat(5000)
    );
    let cases: &[(&str, &str, &str, &[u8])] = &[
        ("no tasks", "PUT", REGISTER, br#"{"tasks": []}"#),
        (
            "duplicate task names",
            "PUT",
            REGISTER,
            br#"{"tasks": [{"name": "web"}, {"name": "web"}]}"#,
        ),
        (
            "two leaders",
            "PUT",
            REGISTER,
            br#"{"tasks": [{"name": "a", "leader": true}, {"name": "b", "leader": true}]}"#,
        ),
        (
            "sidecar poststop",
            "PUT",
            REGISTER,
            br#"{"tasks": [{"name": "a", "lifecycle": {"hook": "poststop", "sidecar": true}}]}"#,
        ),
        (
            "task name with ..",
            "PUT",
            REGISTER,
            br#"{"tasks": [{"name": ".."}]}"#,
        ),
        (
            "task name with a slash",
            "PUT",
            REGISTER,
            br#"{"tasks": [{"name": "a/b"}]}"#,
        ),
        (
            "task name with a NUL",
            "PUT",
            REGISTER,
            br#"{"tasks": [{"name": "a\u0000"}]}"#,
        ),
        (
            "task name with a newline",
            "PUT",
            REGISTER,
            br#"{"tasks": [{"name": "a\nb"}]}"#,
        ),
        (
            "unicode task name",
            "PUT",
            REGISTER,
            "{\"tasks\": [{\"name\": \"caf\u{e9}\"}]}".as_bytes(),
        ),
        (
            "empty task name",
            "PUT",
            REGISTER,
            br#"{"tasks": [{"name": ""}]}"#,
        ),
        ("overlong event message", "PUT", REPORT, overlong.as_bytes()),
    ];
    for (what, method, path, body) in cases {
        b.expect(
            what,
            &json_request(method, path, body),
            400,
            "invalid_request",
        );
    }
    b.expect(
        "batch naming an unknown task",
        &json_request(
            "POST",
            BATCH,
            br#"{"tasks": {"nope": {"state": "running"}}}"#,
        ),
        404,
        "task_not_found",
    );
    b.finish();
}

/// An event's `details`: decoding stops at the 33rd key (a body of 40,000
/// keys is refused where that key starts, not after a pairwise check of all
/// of them), duplicates are found, and the bytes of a key, a value and a
/// whole event are limited, each error naming its field and the limit.
#[test]
fn event_details_are_limited_while_decoding_and_by_their_bytes() {
    let b = Battery::start();
    let with_details = |keys: &[String]| {
        format!(
            r#"{{"state": "running", "event": {{"type": "x", "details": {{{}}}}}}}"#,
            keys.join(", ")
        )
    };
    let keys: Vec<String> = (0..40_000).map(|i| format!("\"k{i:05}\": \"v\"")).collect();
    let body = with_details(&keys);
    let answer = b.expect(
        "40,000 details",
        &json_request("PUT", REPORT, body.as_bytes()),
        400,
        "invalid_json",
    );
    let detail = answer.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("more than 32 entries"), "{detail}");
    // Where decoding stopped: at the end of the 33rd key.
    let stop = body.find("\"k00032\"").unwrap() + "\"k00032\"".len();
    assert!(
        detail.contains(&format!("column {stop}")),
        "{stop}: {detail}"
    );

    let mut keys: Vec<String> = (0..31).map(|i| format!("\"k{i}\": \"v\"")).collect();
    keys.push("\"k0\": \"again\"".into());
    let body = with_details(&keys);
    let answer = b.expect(
        "a duplicate detail key",
        &json_request("PUT", REPORT, body.as_bytes()),
        400,
        "invalid_json",
    );
    assert!(
        answer.json()["detail"]
            .as_str()
            .unwrap()
            .contains("duplicate key `k0`")
    );

    let event = |details: String, message: usize| {
        format!(
            r#"{{"state": "running", "event": {{"type": "x", "message": "{}", "details": {{{details}}}}}}}"#,
            "m".repeat(message)
        )
    };
    let cases = [
        (
            "a 129-byte key",
            event(format!(r#""{}": "v""#, "k".repeat(129)), 0),
            "event.details",
            "keys must be at most 128 bytes",
        ),
        (
            "a 1025-byte value",
            event(format!(r#""k": "{}""#, "v".repeat(1025)), 0),
            "event.details.k",
            "must be at most 1024 bytes",
        ),
        (
            "an event of over 8 KiB",
            event(
                (0..7)
                    .map(|i| format!(r#""k{i}": "{}""#, "v".repeat(1000)))
                    .collect::<Vec<_>>()
                    .join(","),
                4000,
            ),
            "event",
            "must be at most 8192 bytes",
        ),
    ];
    for (what, body, field, message) in cases {
        let answer = b.expect(
            what,
            &json_request("PUT", REPORT, body.as_bytes()),
            400,
            "invalid_request",
        );
        let errors = &answer.json()["errors"];
        assert_eq!(errors[0]["field"], field, "{what}: {errors}");
        let got = errors[0]["message"].as_str().unwrap();
        assert!(got.contains(message), "{what}: {got}");
    }
    b.finish();
}

#[test]
fn hostile_identifiers_in_paths_are_rejected() {
    let b = Battery::start();
    let body = common::five_tasks().to_string();
    let invalid: &[(&str, &str)] = &[
        ("dot-dot", "/v1/allocations/.."),
        ("leading dot", "/v1/allocations/.hidden"),
        ("percent-encoded dot-dot", "/v1/allocations/%2E%2E"),
        ("percent-encoded slash", "/v1/allocations/a%2Fb"),
        (
            "percent-encoded path",
            "/v1/allocations/a1%2Ftasks%2Fweb%2Fstate",
        ),
        ("encoded backslash", "/v1/allocations/a%5Cb"),
        ("unicode", "/v1/allocations/%C3%A9t%C3%A9"),
        ("NUL", "/v1/allocations/a%00b"),
        ("newline", "/v1/allocations/a%0Ab"),
        ("space", "/v1/allocations/a%20b"),
        ("invalid UTF-8 escape", "/v1/allocations/a%FFb"),
        (
            "129 characters",
            "/v1/allocations/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        ),
    ];
    for (what, path) in invalid {
        b.expect(
            what,
            &json_request("PUT", path, body.as_bytes()),
            400,
            "invalid_request",
        );
        b.expect(
            what,
            &request("GET", path, None, b""),
            400,
            "invalid_request",
        );
    }
    let task_paths: &[(&str, &str)] = &[
        ("task dot-dot", "/v1/allocations/a1/tasks/../state"),
        (
            "task encoded slash",
            "/v1/allocations/a1/tasks/we%2Fb/state",
        ),
        (
            "task control character",
            "/v1/allocations/a1/tasks/w%07b/state",
        ),
    ];
    for (what, path) in task_paths {
        b.expect(
            what,
            &json_request("PUT", path, br#"{"state": "running"}"#),
            400,
            "invalid_request",
        );
    }
    // Paths that do not name a route at all.
    let unrouted: &[&str] = &[
        "/v1/allocations/a1/../a1",
        "/v1/allocations/a1/tasks",
        "/v1//allocations/a1",
        "/v2/allocations/a1",
        "/../../etc/passwd",
    ];
    for path in unrouted {
        b.expect(path, &request("GET", path, None, b""), 404, "not_found");
    }
    b.expect(
        "an unknown allocation",
        &request("GET", "/v1/allocations/nope", None, b""),
        404,
        "allocation_not_found",
    );
    b.finish();
}

#[test]
fn bad_blocking_parameters_and_unknown_query_parameters_are_rejected() {
    let b = Battery::start();
    let bad: &[&str] = &[
        "index=-1",
        "index=99999999999999999999999",
        "index=1.5",
        "index=abc",
        "index=",
        "wait=10",
        "wait=-5s",
        "wait=5parsecs",
        "wait=1e9h",
        "wait=",
        "wait=5s&wait=6s",
        "wiat=30s",
        "index=1&bogus",
        "pretty=maybe",
        "wait=%FF",
    ];
    for q in bad {
        b.expect(
            q,
            &request("GET", &format!("/v1/allocations/a1?{q}"), None, b""),
            400,
            "invalid_request",
        );
        b.expect(
            q,
            &request(
                "GET",
                &format!("/v1/allocations/a1/tasks/web?{q}"),
                None,
                b"",
            ),
            400,
            "invalid_request",
        );
    }
    // 30,000 unknown parameters, no token: the answer lists the first 20
    // and counts the rest, instead of growing to 54 times the request.
    let many = vec!["a"; 30_000].join("&");
    let target = format!("/v1/health?{many}");
    let answer = b.expect(
        "30,000 unknown parameters",
        &request("GET", &target, None, b""),
        400,
        "invalid_request",
    );
    let problem = answer.json();
    assert_eq!(problem["errors"].as_array().unwrap().len(), 20);
    assert_eq!(problem["errors_omitted"], 29_980);
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .ends_with("and 29980 more")
    );
    assert!(answer.body.len() < 4096, "{} bytes", answer.body.len());
    for q in [
        "per_page=0",
        "per_page=-1",
        "per_page=100000000000000000000",
        "prefix=%FF",
        "next_token=..",
        "limit=5",
    ] {
        b.expect(
            q,
            &request("GET", &format!("/v1/allocations?{q}"), None, b""),
            400,
            "invalid_request",
        );
    }
    b.expect(
        "unknown parameter on a write",
        &json_request(
            "PUT",
            &format!("{REPORT}?force=true"),
            br#"{"state": "running"}"#,
        ),
        400,
        "invalid_request",
    );
    b.expect(
        "start-condition with a unitless wait",
        &request(
            "GET",
            "/v1/allocations/a1/tasks/web/start-condition?wait=30",
            None,
            b"",
        ),
        400,
        "invalid_request",
    );
    b.finish();
}

#[test]
fn wrong_methods_and_content_types_are_rejected() {
    let b = Battery::start();
    for (method, path) in [
        ("PATCH", "/v1/allocations/a1"),
        ("POST", "/v1/allocations/a1"),
        ("DELETE", REPORT),
        ("GET", BATCH),
        ("PUT", RESTART),
        ("DELETE", "/v1/allocations"),
        ("POST", "/v1/health"),
    ] {
        b.expect(
            &format!("{method} {path}"),
            &request(method, path, None, b""),
            405,
            "method_not_allowed",
        );
    }
    let body = br#"{"state": "running"}"#;
    b.expect(
        "no content type",
        &request("PUT", REPORT, None, body),
        415,
        "unsupported_media_type",
    );
    for ct in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
        "json",
    ] {
        b.expect(
            ct,
            &request("PUT", REPORT, Some(ct), body),
            415,
            "unsupported_media_type",
        );
    }
    b.expect(
        "no content type on a registration",
        &request(
            "PUT",
            REGISTER,
            None,
            common::five_tasks().to_string().as_bytes(),
        ),
        415,
        "unsupported_media_type",
    );
    b.finish();
}

#[test]
fn oversized_bodies_are_payload_too_large() {
    let b = Battery::start();
    // A 2 MiB event message: well over the 1 MiB limit.
    let big = format!(
        r#"{{"state": "running", "event": {{"type": "x", "message": "{}"}}}}"#,
        "m".repeat(2 * 1024 * 1024)
    );
    b.expect(
        "2 MiB body",
        &json_request("PUT", REPORT, big.as_bytes()),
        413,
        "payload_too_large",
    );
    // A Content-Length over the limit is refused before the body is read.
    let head = format!(
        "PUT {REPORT} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{{",
        64 * 1024 * 1024
    );
    b.expect(
        "64 MiB announced",
        head.as_bytes(),
        413,
        "payload_too_large",
    );
    // Chunked bodies are counted too.
    let mut chunked = format!(
        "PUT {REPORT} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    .into_bytes();
    for _ in 0..3 {
        chunked.extend_from_slice(format!("{:x}\r\n", 512 * 1024).as_bytes());
        chunked.extend(std::iter::repeat_n(b' ', 512 * 1024));
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    b.expect("1.5 MiB chunked", &chunked, 413, "payload_too_large");
    b.finish();
}

/// Bytes that are not HTTP/1.1 never reach the service: the HTTP parser
/// answers a bare 400 (or 431 for an oversized head) and closes the
/// connection. Nothing changes and the server stays healthy.
#[test]
fn broken_http_framing_is_refused_at_the_parser() {
    let b = Battery::start();
    let cases: &[(&str, &[u8], u16)] = &[
        ("raw invalid UTF-8 in the path", b"GET /v1/allocations/\xff\xfe HTTP/1.1\r\nHost: localhost\r\n\r\n", 400),
        ("a space in the path", b"GET /v1/allocations/a b HTTP/1.1\r\nHost: localhost\r\n\r\n", 400),
        ("not a request line", b"GARBAGE\r\n\r\n", 400),
        ("Content-Length not a number", b"PUT /v1/allocations/a HTTP/1.1\r\nHost: localhost\r\nContent-Length: abc\r\n\r\n", 400),
        ("two different Content-Lengths", b"PUT /v1/allocations/a HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello", 400),
        ("a control character in a header", b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\nX-Bad: a\x01b\r\n\r\n", 400),
    ];
    for (what, bytes, status) in cases {
        let answer = exchange(b.addr, bytes);
        assert_eq!(answer.status, *status, "{what}");
        assert_eq!(answer.header("connection"), Some("close"), "{what}");
    }
    let mut huge = b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\nX-Long: ".to_vec();
    huge.extend(std::iter::repeat_n(b'a', 100 * 1024));
    huge.extend_from_slice(b"\r\n\r\n");
    let answer = exchange(b.addr, &huge);
    assert_eq!(answer.status, 431, "a 100 KiB header");
    // Raw UTF-8 (not percent-encoded) does reach the router, and is an
    // invalid identifier like any other.
    b.expect(
        "raw UTF-8 in an ID",
        b"GET /v1/allocations/caf\xc3\xa9 HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
        400,
        "invalid_request",
    );
    b.finish();
}

/// The open door of issue 32: on a server without tokens (the loopback
/// default) a page of any other site restarted allocations with a no-cors
/// `fetch` (a POST with no body and no Content-Type). Every write a
/// browser sends from another site — by a foreign `Origin`, another port
/// of the same host, `Origin: null`, or `Sec-Fetch-Site` alone — is
/// refused 403 `cross_site_request` and changes nothing; reads with a
/// foreign `Origin` are served (CORS keeps their answers from the page);
/// the server's own page writes.
#[test]
fn cross_site_writes_are_refused_and_change_nothing() {
    let b = Battery::start();
    let port = b.addr.port();
    let host = format!("127.0.0.1:{port}");
    let other_port = format!("http://127.0.0.1:{}", port.wrapping_add(1));
    let browsers: [Vec<(&str, &str)>; 6] = [
        vec![("Origin", "http://evil.example")],
        vec![
            ("Origin", "http://evil.example"),
            ("Sec-Fetch-Site", "cross-site"),
        ],
        vec![("Origin", &other_port)],
        vec![("Origin", "null")],
        vec![("Sec-Fetch-Site", "cross-site")],
        vec![("Sec-Fetch-Site", "same-site")],
    ];
    let spec = common::five_tasks().to_string();
    let report = br#"{"state": "dead", "failed": true}"#;
    let writes: [(&str, &str, Option<&str>, &[u8]); 8] = [
        ("POST", RESTART, None, b""),
        (
            "POST",
            RESTART,
            Some("text/plain"),
            b"{\"all_tasks\": true}",
        ),
        ("POST", RESTART, Some("application/json"), b"{}"),
        ("PUT", REPORT, Some("application/json"), report),
        (
            "POST",
            BATCH,
            Some("application/json"),
            br#"{"tasks": {"web": {"state": "running"}}}"#,
        ),
        (
            "POST",
            RESTORE,
            Some("application/json"),
            br#"{"tasks": {}}"#,
        ),
        ("PUT", REGISTER, Some("application/json"), spec.as_bytes()),
        ("DELETE", "/v1/allocations/a1", None, b""),
    ];
    for headers in &browsers {
        let mut headers = headers.clone();
        headers.push(("Host", &host));
        for (method, path, ct, body) in writes {
            let answer = b.expect(
                &format!("{method} {path} {headers:?}"),
                &request_with(method, path, &headers, ct, body),
                403,
                "cross_site_request",
            );
            let detail = answer.json()["detail"].as_str().unwrap().to_owned();
            assert!(detail.contains("another site"), "{detail}");
        }
        for path in ["/v1/allocations/a1", "/v1/allocations"] {
            let read = exchange(b.addr, &request_with("GET", path, &headers, None, b""));
            assert_eq!(read.status, 200, "GET {path} {headers:?}");
        }
    }
    assert_eq!(
        snapshot(b.addr),
        b.before,
        "a cross-site write changed state"
    );

    // The server's own page: its Origin is the host it came to.
    let own = format!("http://{host}");
    let localhost = format!("localhost:{port}");
    let own_localhost = format!("http://{localhost}");
    for headers in [
        vec![("Host", host.as_str()), ("Origin", own.as_str())],
        vec![
            ("Host", localhost.as_str()),
            ("Origin", own_localhost.as_str()),
            ("Sec-Fetch-Site", "same-origin"),
        ],
    ] {
        let answer = exchange(b.addr, &request_with("POST", RESTART, &headers, None, b""));
        assert_eq!(
            answer.status,
            200,
            "{headers:?}: {}",
            String::from_utf8_lossy(&answer.body)
        );
        assert!(answer.json()["restarted"].is_array());
    }
    assert!(health(&b.server.base));
}

/// DNS rebinding (issue 32): a page on evil.example whose name is then
/// pointed at 127.0.0.1 talks to a loopback server as its own origin,
/// sending `Host: evil.example:PORT`. A loopback server serves only
/// loopback names: any other host is 421 `host_not_allowed` saying which
/// flag to set, reads and writes alike; `localhost:PORT`,
/// `127.0.0.1:PORT` and the others work (the health command too).
#[test]
fn a_loopback_server_serves_only_loopback_host_names() {
    let b = Battery::start();
    let port = b.addr.port();
    let hosts = [
        "evil.example".to_owned(),
        format!("evil.example:{port}"),
        format!("127.0.0.1.evil.example:{port}"),
        format!("localhost.evil.example:{port}"),
        format!("10.1.2.3:{port}"),
    ];
    for host in &hosts {
        let page = format!("http://{host}");
        let tries = [
            request_with("GET", "/v1/allocations/a1", &[("Host", host)], None, b""),
            request_with("GET", "/v1/health", &[("Host", host)], None, b""),
            request_with(
                "POST",
                RESTART,
                &[
                    ("Host", host),
                    ("Origin", &page),
                    ("Sec-Fetch-Site", "same-origin"),
                ],
                None,
                b"",
            ),
        ];
        for bytes in tries {
            let answer = b.expect(&format!("Host {host}"), &bytes, 421, "host_not_allowed");
            let detail = answer.json()["detail"].as_str().unwrap().to_owned();
            assert!(detail.contains("--allowed-hosts"), "{detail}");
        }
    }
    for host in [
        format!("localhost:{port}"),
        format!("LOCALHOST:{port}"),
        format!("127.0.0.1:{port}"),
        "127.0.0.1".to_owned(),
        "localhost".to_owned(),
        format!("[::1]:{port}"),
    ] {
        let answer = exchange(
            b.addr,
            &request_with("GET", "/v1/allocations/a1", &[("Host", &host)], None, b""),
        );
        assert_eq!(answer.status, 200, "Host {host}");
    }
    b.finish();
}

/// `--allowed-hosts` lets the names it lists in (a name on any port, or
/// on the port given), and `*` in `TASKGATE_ALLOWED_HOSTS` any name; the
/// loopback names stay served.
#[test]
fn allowed_hosts_let_named_hosts_in() {
    let server = Server::start(&[
        "--in-memory",
        "--allowed-hosts",
        "taskgate.internal,tg.example:8443",
    ]);
    let addr = server.addr();
    let port = addr.port();
    for (host, status) in [
        (format!("taskgate.internal:{port}"), 200),
        ("TASKGATE.internal".to_owned(), 200),
        ("tg.example:8443".to_owned(), 200),
        (format!("tg.example:{port}"), 421),
        ("evil.example".to_owned(), 421),
        (format!("localhost:{port}"), 200),
    ] {
        let answer = exchange(
            addr,
            &request_with("GET", "/v1/allocations", &[("Host", &host)], None, b""),
        );
        assert_eq!(answer.status, status, "Host {host}");
    }
    let any = Server::start_env(&["--in-memory"], &[("TASKGATE_ALLOWED_HOSTS", "*")]);
    let answer = exchange(
        any.addr(),
        &request_with(
            "GET",
            "/v1/allocations",
            &[("Host", "evil.example")],
            None,
            b"",
        ),
    );
    assert_eq!(answer.status, 200);
}
