//! A raw HTTP/1.1 client over a blocking `TcpStream`: sends exactly the
//! bytes a test gives it (malformed ones included) and parses the answer.
//! Every read has a timeout, so a server that never answers fails the test
//! instead of hanging it.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use serde_json::Value;

/// How long any single read may block.
pub const READ_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Debug)]
pub struct RawAnswer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawAnswer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "the body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// Asserts a problem+json answer with this status and code.
    #[track_caller]
    pub fn assert_problem(&self, status: u16, code: &str) {
        let text = String::from_utf8_lossy(&self.body);
        assert_eq!(self.status, status, "body: {text}");
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "body: {text}"
        );
        let body = self.json();
        assert_eq!(body["status"], status, "body: {text}");
        assert_eq!(body["code"], code, "body: {text}");
        assert!(
            body["title"].is_string() && body["detail"].is_string(),
            "body: {text}"
        );
    }
}

pub fn connect(addr: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
    stream.set_nodelay(true).unwrap();
    stream
}

/// Sends `request` as is on a new connection and reads one answer.
pub fn exchange(addr: SocketAddr, request: &[u8]) -> RawAnswer {
    let mut stream = connect(addr);
    stream.write_all(request).expect("send");
    read_answer(&mut stream).expect("an answer")
}

/// Builds a request with `Connection: close`, a Host header and (for a
/// non-empty body or an explicit type) Content-Length.
pub fn request(method: &str, target: &str, content_type: Option<&str>, body: &[u8]) -> Vec<u8> {
    request_with(method, target, &[], content_type, body)
}

/// `request` with more headers; a `Host` among them replaces the default
/// (`localhost`).
pub fn request_with(
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    content_type: Option<&str>,
    body: &[u8],
) -> Vec<u8> {
    let mut head = format!("{method} {target} HTTP/1.1\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        head.push_str("Host: localhost\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("Connection: close\r\n");
    if let Some(ct) = content_type {
        head.push_str(&format!("Content-Type: {ct}\r\n"));
    }
    if !body.is_empty() || content_type.is_some() || method != "GET" {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// JSON body helper.
pub fn json_request(method: &str, target: &str, body: &[u8]) -> Vec<u8> {
    request(method, target, Some("application/json"), body)
}

/// Reads one answer: status line, headers, and a body framed by
/// Content-Length, chunked encoding, or the end of the connection.
pub fn read_answer(stream: &mut TcpStream) -> std::io::Result<RawAnswer> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i;
        }
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "connection closed before an answer: {:?}",
                    String::from_utf8_lossy(&buf)
                ),
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line in {head:?}")))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let mut rest = buf[head_end + 4..].to_vec();
    let get = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    };
    let body = if let Some(len) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
        while rest.len() < len {
            let n = stream.read(&mut chunk)?;
            if n == 0 {
                return Err(std::io::Error::other("connection closed inside the body"));
            }
            rest.extend_from_slice(&chunk[..n]);
        }
        rest.truncate(len);
        rest
    } else if get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            if let Some(body) = dechunk(&rest) {
                break body;
            }
            let n = stream.read(&mut chunk)?;
            if n == 0 {
                return Err(std::io::Error::other("connection closed inside the body"));
            }
            rest.extend_from_slice(&chunk[..n]);
        }
    } else if status == 204 || status == 304 || (100..200).contains(&status) {
        Vec::new()
    } else {
        stream.read_to_end(&mut rest)?;
        rest
    };
    Ok(RawAnswer {
        status,
        headers,
        body,
    })
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The decoded body when `raw` holds a complete chunked body.
fn dechunk(raw: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let mut at = 0;
    loop {
        let line_end = at + find(&raw[at..], b"\r\n")?;
        let size_text = std::str::from_utf8(&raw[at..line_end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        let data = line_end + 2;
        if size == 0 {
            return Some(out);
        }
        if raw.len() < data + size + 2 {
            return None;
        }
        out.extend_from_slice(&raw[data..data + size]);
        at = data + size + 2;
    }
}

/// The value of an unlabelled metric in `/metrics` (the server must allow
/// unauthenticated metrics or run without tokens).
pub fn gauge(addr: SocketAddr, name: &str) -> u64 {
    let answer = exchange(addr, &request("GET", "/metrics", None, b""));
    assert_eq!(answer.status, 200);
    let text = String::from_utf8_lossy(&answer.body).into_owned();
    text.lines()
        .find_map(|l| {
            l.strip_prefix(name)
                .and_then(|v| v.strip_prefix(' '))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or_else(|| panic!("metric {name} in {text}"))
}

/// Bytes the kernel holds in the send queue of the server's end of a
/// loopback connection (`tx_queue` of `/proc/net/tcp`: written by the
/// server, not yet acknowledged by the client), found by the two ends'
/// addresses; `None` once that connection is gone.
pub fn server_send_queue(server: SocketAddr, client: SocketAddr) -> Option<u64> {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    let end = |a: SocketAddr| format!(":{:04X}", a.port());
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (local, remote, queues) = (fields.get(1)?, fields.get(2)?, fields.get(4)?);
        (local.ends_with(&end(server)) && remote.ends_with(&end(client)))
            .then(|| u64::from_str_radix(queues.split(':').next()?, 16).ok())?
    })
}

/// A report that changes allocation `a1` (of `common::five_tasks`) with an
/// event of about 1 KiB, so its view (what an event stream sends for the
/// change) grows to ~12 KiB as histories fill: `n` alternates the state.
pub fn report_with_event(n: usize) -> Vec<u8> {
    let (state, kind) = if n.is_multiple_of(2) {
        ("running", "Started")
    } else {
        ("pending", "Restarting")
    };
    let body = format!(
        r#"{{"state": "{state}", "event": {{"type": "{kind}", "message": "{}"}}}}"#,
        "x".repeat(900)
    );
    json_request(
        "PUT",
        "/v1/allocations/a1/tasks/proxy/state",
        body.as_bytes(),
    )
}
