//! A client for etcd's v3 API through its JSON gateway (the gRPC-gateway
//! every etcd 3.4+ member serves on its client port: `/v3/kv/range`,
//! `/v3/kv/txn`, `/v3/watch`, `/v3/auth/authenticate`). Keys and values
//! travel base64-encoded, 64-bit integers as decimal strings.
//!
//! Why the gateway and not gRPC: it needs no generated protobuf code and no
//! `protoc` (reqwest and serde do all of it), and every request of ours is
//! one small transaction or a watch. `taskgate-bench --scenarios etcd`
//! measures our replicas against etcd's own transactions through this same
//! client.

use std::{
    path::PathBuf,
    sync::{
        Mutex, PoisonError,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use base64::{Engine, engine::general_purpose::STANDARD as B64};
use serde::{Deserialize, Deserializer, de::DeserializeOwned};
use serde_json::json;

/// How to reach and authenticate to an etcd cluster.
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    /// Client URLs of the members (`http://host:2379`, `https://…`), tried
    /// in turn.
    pub endpoints: Vec<String>,
    /// Every key of this deployment starts with it.
    pub prefix: String,
    /// CA bundle to verify the members' certificates with (else the
    /// platform's roots).
    pub ca: Option<PathBuf>,
    /// Client certificate and key (PEM) for members that require one.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// etcd user and password (auth enabled on the cluster).
    pub user: Option<String>,
    pub password: Option<String>,
    /// The longest one request to a member may take before the next member
    /// is tried.
    pub request_timeout: Duration,
}

impl EtcdConfig {
    pub fn new(endpoints: Vec<String>) -> Self {
        Self {
            endpoints,
            prefix: "/taskgate/".into(),
            ca: None,
            cert: None,
            key: None,
            user: None,
            password: None,
            request_timeout: Duration::from_secs(5),
        }
    }
}

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// No member answered, or none had a leader: try again later.
    #[error("etcd is unreachable: {0}")]
    Unreachable(String),
    /// A member answered with an error that trying again will not fix.
    #[error("etcd refused the request: {0}")]
    Refused(String),
    /// The revision asked for was compacted away.
    #[error("etcd compacted revision {0} away")]
    Compacted(u64),
}

/// An int64 as the gateway writes it: a decimal string (or a number).
fn num<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum N {
        S(String),
        N(u64),
    }
    match N::deserialize(d)? {
        N::S(s) => s.parse().map_err(serde::de::Error::custom),
        N::N(n) => Ok(n),
    }
}

fn b64<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    let s = String::deserialize(d)?;
    B64.decode(s).map_err(serde::de::Error::custom)
}

#[derive(Debug, Default, Deserialize)]
pub struct Header {
    #[serde(default, deserialize_with = "num")]
    pub revision: u64,
}

#[derive(Debug, Default, Deserialize)]
pub struct KeyValue {
    #[serde(default, deserialize_with = "b64")]
    pub key: Vec<u8>,
    #[serde(default, deserialize_with = "num")]
    pub mod_revision: u64,
    #[serde(default, deserialize_with = "b64")]
    pub value: Vec<u8>,
}

#[derive(Debug, Default, Deserialize)]
pub struct RangeResponse {
    #[serde(default)]
    pub header: Header,
    #[serde(default)]
    pub kvs: Vec<KeyValue>,
    #[serde(default)]
    pub more: bool,
}

#[derive(Debug, Default, Deserialize)]
struct TxnResponse {
    #[serde(default)]
    header: Header,
    #[serde(default)]
    succeeded: bool,
    #[serde(default)]
    responses: Vec<OpResponse>,
}

#[derive(Debug, Default, Deserialize)]
struct OpResponse {
    #[serde(default)]
    response_range: Option<RangeResponse>,
}

#[derive(Debug, Default, Deserialize)]
pub struct WatchResponse {
    #[serde(default)]
    pub header: Header,
    #[serde(default)]
    pub created: bool,
    #[serde(default)]
    pub canceled: bool,
    #[serde(default, deserialize_with = "num")]
    pub compact_revision: u64,
    #[serde(default)]
    pub cancel_reason: String,
    #[serde(default)]
    pub events: Vec<Event>,
}

#[derive(Debug, Default, Deserialize)]
pub struct Event {
    /// `"DELETE"`, or absent for a put.
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    #[serde(default)]
    pub kv: KeyValue,
}

/// The gateway's error body.
#[derive(Debug, Default, Deserialize)]
struct GatewayError {
    #[serde(default)]
    code: i32,
    #[serde(default)]
    message: String,
}

/// What a compare-and-swap did.
#[derive(Debug)]
pub enum Swapped {
    /// Committed at this revision.
    Done(u64),
    /// The key was not at the expected revision; it is at this one now
    /// (0: absent), holding this value.
    Conflict { now: u64, value: Vec<u8> },
}

/// The end of a key range: every key starting with `prefix`.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // All 0xff (or empty): to the end of the key space.
    vec![0]
}

pub struct Client {
    http: reqwest::Client,
    endpoints: Vec<String>,
    /// The member tried first (the last that answered).
    current: AtomicUsize,
    credentials: Option<(String, String)>,
    token: Mutex<Option<String>>,
    timeout: Duration,
}

impl Client {
    pub fn new(config: &EtcdConfig) -> Result<Self, String> {
        if config.endpoints.is_empty() {
            return Err("no etcd endpoint is given (--etcd-endpoints)".into());
        }
        for e in &config.endpoints {
            if !(e.starts_with("http://") || e.starts_with("https://")) {
                return Err(format!(
                    "etcd endpoint {e:?} is not an http:// or https:// URL"
                ));
            }
        }
        // reqwest's rustls needs a crypto provider: ring, as the server's.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let read = |path: &PathBuf, what: &str| {
            std::fs::read(path)
                .map_err(|e| format!("cannot read the etcd {what} {}: {e}", path.display()))
        };
        let mut builder = reqwest::Client::builder()
            .tcp_nodelay(true)
            .tcp_keepalive(Duration::from_secs(10))
            .connect_timeout(config.request_timeout)
            .pool_idle_timeout(Duration::from_secs(60))
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy();
        let tls = config.endpoints.iter().any(|e| e.starts_with("https://"));
        if let Some(ca) = &config.ca {
            let certs = reqwest::Certificate::from_pem_bundle(&read(ca, "CA bundle")?)
                .map_err(|e| format!("the etcd CA bundle {} is not PEM: {e}", ca.display()))?;
            builder = builder.tls_certs_only(certs);
        } else if !tls {
            // Plain HTTP: no certificate roots needed (a minimal image has
            // none, and loading the platform's would fail there).
            builder = builder.tls_certs_only([]);
        }
        match (&config.cert, &config.key) {
            (Some(cert), Some(key)) => {
                let mut pem = read(cert, "client certificate")?;
                pem.extend_from_slice(b"\n");
                pem.extend(read(key, "client key")?);
                let identity = reqwest::Identity::from_pem(&pem).map_err(|e| {
                    format!("the etcd client certificate or key is not usable: {e}")
                })?;
                builder = builder.identity(identity);
            }
            (None, None) => {}
            _ => return Err("--etcd-cert and --etcd-key go together".into()),
        }
        let credentials = match (&config.user, &config.password) {
            (Some(u), Some(p)) => Some((u.clone(), p.clone())),
            (None, None) => None,
            (Some(_), None) => {
                return Err(
                    "--etcd-user needs a password (--etcd-password-file or TASKGATE_ETCD_PASSWORD)"
                        .into(),
                );
            }
            (None, Some(_)) => return Err("an etcd password needs --etcd-user".into()),
        };
        Ok(Self {
            http: builder.build().map_err(|e| {
                let mut why = crate::client::error_chain(&e);
                if tls && config.ca.is_none() {
                    why.push_str(" (without --etcd-ca the system's certificate roots are used)");
                }
                format!("cannot build the etcd client: {why}")
            })?,
            endpoints: config
                .endpoints
                .iter()
                .map(|e| e.trim_end_matches('/').to_owned())
                .collect(),
            current: AtomicUsize::new(0),
            credentials,
            token: Mutex::new(None),
            timeout: config.request_timeout,
        })
    }

    fn token(&self) -> Option<String> {
        self.token
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    async fn authenticate(&self, endpoint: &str) -> Result<(), CallError> {
        let Some((name, password)) = &self.credentials else {
            return Ok(());
        };
        #[derive(Deserialize)]
        struct Token {
            token: String,
        }
        let body = json!({"name": name, "password": password})
            .to_string()
            .into();
        let t: Token = self
            .post_once(endpoint, "/v3/auth/authenticate", &body, None)
            .await?;
        *self.token.lock().unwrap_or_else(PoisonError::into_inner) = Some(t.token);
        Ok(())
    }

    /// One request to one member.
    async fn post_once<T: DeserializeOwned>(
        &self,
        endpoint: &str,
        path: &str,
        body: &bytes::Bytes,
        token: Option<&str>,
    ) -> Result<T, CallError> {
        let mut req = self
            .http
            .post(format!("{endpoint}{path}"))
            .timeout(self.timeout)
            .header("content-type", "application/json")
            .body(body.clone());
        if let Some(t) = token {
            req = req.header("authorization", t);
        }
        let answer = req.send().await.map_err(|e| {
            CallError::Unreachable(format!("{endpoint}: {}", crate::client::error_chain(&e)))
        })?;
        let status = answer.status();
        let bytes = answer
            .bytes()
            .await
            .map_err(|e| CallError::Unreachable(format!("{endpoint}: {e}")))?;
        if status.is_success() {
            return serde_json::from_slice(&bytes).map_err(|e| {
                CallError::Refused(format!(
                    "{endpoint}{path} answered what is not its JSON: {e}"
                ))
            });
        }
        let err: GatewayError = serde_json::from_slice(&bytes).unwrap_or_default();
        Err(classify(endpoint, status.as_u16(), err))
    }

    /// A request, to the member that answered last and then to the others.
    async fn post<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &bytes::Bytes,
    ) -> Result<T, CallError> {
        let n = self.endpoints.len();
        let first = self.current.load(Ordering::Relaxed);
        let mut last = String::new();
        for i in 0..n {
            let at = (first + i) % n;
            let endpoint = &self.endpoints[at];
            if self.credentials.is_some()
                && self.token().is_none()
                && let Err(e) = self.authenticate(endpoint).await
            {
                last = e.to_string();
                continue;
            }
            let mut answer = self
                .post_once(endpoint, path, body, self.token().as_deref())
                .await;
            if matches!(&answer, Err(CallError::Refused(m)) if m.contains("auth token")) {
                // Tokens expire: one new one, then the same request again.
                self.authenticate(endpoint).await?;
                answer = self
                    .post_once(endpoint, path, body, self.token().as_deref())
                    .await;
            }
            match answer {
                Ok(t) => {
                    self.current.store(at, Ordering::Relaxed);
                    return Ok(t);
                }
                Err(CallError::Unreachable(e)) => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(CallError::Unreachable(last))
    }

    /// Every key from `key` (inclusive) to `end`, at `revision` (0: now),
    /// at most `limit` of them.
    pub async fn range(
        &self,
        key: &[u8],
        end: &[u8],
        revision: u64,
        limit: u64,
    ) -> Result<RangeResponse, CallError> {
        let body = json!({
            "key": B64.encode(key),
            "range_end": B64.encode(end),
            "revision": revision.to_string(),
            "limit": limit.to_string(),
        })
        .to_string()
        .into();
        self.post("/v3/kv/range", &body).await
    }

    /// Puts `value` at `key` (or deletes `key`, for `None`) if the key's
    /// `mod_revision` is `expect` (0: the key is absent).
    ///
    /// A request that failed after it was sent may have been committed;
    /// trying it again is safe: its compare fails then, and the key holding
    /// exactly this value (which carries the change's own time) tells that
    /// the first try went through.
    pub async fn swap(
        &self,
        key: &[u8],
        value: Option<&[u8]>,
        expect: u64,
    ) -> Result<Swapped, CallError> {
        // Written out directly (base64 and decimal digits need no JSON
        // escaping): every report commits one of these.
        let key64 = B64.encode(key);
        let then = match value {
            Some(v) => format!(
                r#"{{"request_put":{{"key":"{key64}","value":"{}"}}}}"#,
                B64.encode(v)
            ),
            None => format!(r#"{{"request_delete_range":{{"key":"{key64}"}}}}"#),
        };
        let body = format!(
            r#"{{"compare":[{{"key":"{key64}","target":"MOD","result":"EQUAL","mod_revision":"{expect}"}}],"success":[{then}],"failure":[{{"request_range":{{"key":"{key64}"}}}}]}}"#
        )
        .into();
        let answer: TxnResponse = self.post("/v3/kv/txn", &body).await?;
        if answer.succeeded {
            return Ok(Swapped::Done(answer.header.revision));
        }
        let kv = answer
            .responses
            .into_iter()
            .find_map(|r| r.response_range)
            .and_then(|r| r.kvs.into_iter().next());
        Ok(match kv {
            Some(kv) if value == Some(&kv.value[..]) => Swapped::Done(kv.mod_revision),
            Some(kv) => Swapped::Conflict {
                now: kv.mod_revision,
                value: kv.value,
            },
            None => Swapped::Conflict {
                now: 0,
                value: Vec::new(),
            },
        })
    }

    /// Opens a watch on `[key, end)` from `start` on the member that
    /// answered last, with `require_leader`: a member that loses its
    /// leader cancels the watch instead of going quiet.
    pub async fn watch(&self, key: &[u8], end: &[u8], start: u64) -> Result<Watch, CallError> {
        let n = self.endpoints.len();
        let first = self.current.load(Ordering::Relaxed);
        let body = json!({"create_request": {
            "key": B64.encode(key),
            "range_end": B64.encode(end),
            "start_revision": start.to_string(),
            "progress_notify": true,
        }});
        let mut last = String::new();
        for i in 0..n {
            let at = (first + i) % n;
            let endpoint = &self.endpoints[at];
            if self.credentials.is_some()
                && let Err(e) = self.authenticate(endpoint).await
            {
                last = e.to_string();
                continue;
            }
            let mut req = self
                .http
                .post(format!("{endpoint}/v3/watch"))
                .header("content-type", "application/json")
                // The gateway hands `Grpc-Metadata-*` headers on as gRPC
                // metadata: this one is etcd's require-leader flag.
                .header("grpc-metadata-hasleader", "true")
                .body(body.to_string());
            if let Some(t) = self.token() {
                req = req.header("authorization", t);
            }
            match req.send().await {
                Ok(r) if r.status().is_success() => {
                    self.current.store(at, Ordering::Relaxed);
                    return Ok(Watch {
                        endpoint: endpoint.clone(),
                        response: r,
                        buf: Vec::new(),
                        start: 0,
                    });
                }
                Ok(r) => last = format!("{endpoint}: the watch answered {}", r.status()),
                Err(e) => last = format!("{endpoint}: {e}"),
            }
            // The next member, and the next request starts there too.
            self.current.store((at + 1) % n, Ordering::Relaxed);
        }
        Err(CallError::Unreachable(last))
    }

    /// Whether the member at `endpoint` reaches its cluster's quorum now:
    /// a linearizable read of one key goes through the leader.
    pub async fn check(&self, endpoint: &str, key: &[u8]) -> Result<u64, CallError> {
        let body = json!({"key": B64.encode(key), "count_only": true})
            .to_string()
            .into();
        let r: RangeResponse = self
            .post_once(endpoint, "/v3/kv/range", &body, self.token().as_deref())
            .await?;
        Ok(r.header.revision)
    }

    /// Moves the next requests to the member after `endpoint`.
    pub fn skip(&self, endpoint: &str) {
        if let Some(at) = self.endpoints.iter().position(|e| e == endpoint) {
            let n = self.endpoints.len();
            let _ = self.current.compare_exchange(
                at,
                (at + 1) % n,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }
}

/// What an error answer means for the next try.
fn classify(endpoint: &str, status: u16, err: GatewayError) -> CallError {
    let message = format!("{endpoint}: {} (code {})", err.message, err.code);
    if err.message.contains("required revision has been compacted") {
        return CallError::Compacted(0);
    }
    match err.code {
        // Unavailable, DeadlineExceeded, Aborted, ResourceExhausted: a
        // member without a leader, an election, an overloaded member.
        14 | 4 | 10 | 8 => CallError::Unreachable(message),
        _ if status >= 500 && err.code == 0 => CallError::Unreachable(message),
        _ => CallError::Refused(message),
    }
}

/// An open watch: one JSON object per line.
pub struct Watch {
    pub endpoint: String,
    response: reqwest::Response,
    buf: Vec<u8>,
    /// Where the lines not parsed yet start in `buf`.
    start: usize,
}

impl Watch {
    /// The next response; `None` when the member closed the stream.
    pub async fn next(&mut self) -> Result<Option<WatchResponse>, CallError> {
        loop {
            if let Some(end) = self.buf[self.start..].iter().position(|&b| b == b'\n') {
                let line = self.start..self.start + end + 1;
                self.start = line.end;
                let line = &self.buf[line];
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return parse_line(&self.endpoint, line).map(Some);
            }
            // Every whole line is parsed: the rest moves to the front.
            self.buf.drain(..self.start);
            self.start = 0;
            match self.response.chunk().await {
                Ok(Some(chunk)) => self.buf.extend_from_slice(&chunk),
                Ok(None) if self.buf.iter().all(u8::is_ascii_whitespace) => return Ok(None),
                Ok(None) => {
                    let line = std::mem::take(&mut self.buf);
                    return parse_line(&self.endpoint, &line).map(Some);
                }
                Err(e) => {
                    return Err(CallError::Unreachable(format!(
                        "{}: the watch stream broke: {e}",
                        self.endpoint
                    )));
                }
            }
        }
    }
}

fn parse_line(endpoint: &str, line: &[u8]) -> Result<WatchResponse, CallError> {
    #[derive(Deserialize)]
    struct Line {
        result: Option<WatchResponse>,
        error: Option<GatewayError>,
    }
    let l: Line = serde_json::from_slice(line).map_err(|e| {
        CallError::Unreachable(format!("{endpoint}: a watch line is not JSON: {e}"))
    })?;
    match (l.result, l.error) {
        (Some(r), _) => Ok(r),
        (None, Some(e)) => Err(classify(endpoint, 500, e)),
        (None, None) => Err(CallError::Unreachable(format!(
            "{endpoint}: a watch line holds neither a result nor an error"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_ends_where_the_next_prefix_starts() {
        assert_eq!(prefix_end(b"/taskgate/"), b"/taskgate0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }

    #[test]
    fn the_gateways_lines_decode() {
        let line = br#"{"result":{"header":{"revision":"4"},"events":[{"type":"DELETE","kv":{"key":"L3QvYg==","mod_revision":"4"}},{"kv":{"key":"L3QvYQ==","mod_revision":"3","value":"aGVsbG8="}}]}}"#;
        let r = parse_line("e", line).unwrap();
        assert_eq!(r.header.revision, 4);
        assert_eq!(r.events[0].kind.as_deref(), Some("DELETE"));
        assert_eq!(r.events[0].kv.key, b"/t/b");
        assert_eq!(r.events[1].kind, None);
        assert_eq!(r.events[1].kv.value, b"hello");
        let canceled = br#"{"result":{"header":{},"canceled":true,"compact_revision":"3"}}"#;
        let r = parse_line("e", canceled).unwrap();
        assert!(r.canceled);
        assert_eq!(r.compact_revision, 3);
        let err = br#"{"error":{"grpc_code":14,"http_code":503,"message":"etcdserver: no leader","code":14}}"#;
        assert!(
            matches!(parse_line("e", err), Err(CallError::Unreachable(m)) if m.contains("no leader"))
        );
    }
}
