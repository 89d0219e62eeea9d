//! A client for etcd's v3 gRPC API (tonic over HTTP/2, one connection per
//! member), with the few messages we use written by hand (`proto.rs`): no
//! generated code, no `protoc`, no build script. gRPC, not etcd's JSON
//! gateway: less CPU per request (measured: see BENCHMARKS.md, "Older
//! results").
//!
//! Every call has a deadline (`request_timeout`), the watch's opening
//! included: a member that stops answering (paused, cut off without a
//! reset) costs one deadline, then the next member is tried. A call that
//! failed after it was sent may have been applied: `swap` says so
//! (`CallError::Ambiguous`) instead of guessing, and its caller finds out.

use std::{
    path::PathBuf,
    sync::{
        Mutex, PoisonError,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use tonic::{codegen::http::uri::PathAndQuery, transport::Channel};

use super::proto::{self, CompareUnion, Request, RequestOp};

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
    /// No member answered, or none had a leader: try again later. Nothing
    /// was applied.
    #[error("etcd is unreachable: {0}")]
    Unreachable(String),
    /// The request may or may not have been applied: it was sent, and no
    /// answer came (a deadline passed, the connection broke).
    #[error("etcd did not answer a request it may have applied: {0}")]
    Ambiguous(String),
    /// A member answered with an error that trying again will not fix.
    #[error("etcd refused the request: {0}")]
    Refused(String),
    /// The revision asked for was compacted away.
    #[error("etcd compacted revision {0} away")]
    Compacted(u64),
}

/// The revision a response's header carries (0: none).
fn revision(h: &Option<proto::ResponseHeader>) -> u64 {
    h.as_ref()
        .map_or(0, |h| u64::try_from(h.revision).unwrap_or(0))
}

/// A key-value as read.
#[derive(Debug, Default)]
pub struct KeyValue {
    pub key: Vec<u8>,
    pub mod_revision: u64,
    pub value: Vec<u8>,
    /// The lease the key is under (0: none).
    pub lease: i64,
}

impl From<proto::KeyValue> for KeyValue {
    fn from(kv: proto::KeyValue) -> Self {
        Self {
            key: kv.key,
            mod_revision: u64::try_from(kv.mod_revision).unwrap_or(0),
            value: kv.value,
            lease: kv.lease,
        }
    }
}

/// A range's answer.
#[derive(Debug, Default)]
pub struct RangeResponse {
    /// The revision the range was read at.
    pub revision: u64,
    pub kvs: Vec<KeyValue>,
    pub more: bool,
}

/// A watch's answer.
#[derive(Debug, Default)]
pub struct WatchResponse {
    pub revision: u64,
    pub created: bool,
    pub canceled: bool,
    pub compact_revision: u64,
    pub cancel_reason: String,
    pub events: Vec<Event>,
}

/// A change a watch delivers.
#[derive(Debug, Default)]
pub struct Event {
    pub deleted: bool,
    pub kv: KeyValue,
}

/// What a compare-and-swap did.
#[derive(Debug)]
pub enum Swapped {
    /// Committed at this revision.
    Done(u64),
    /// The key was not at the expected revision; it is at this one now
    /// (0: absent), holding this value, created at `created`, read at the
    /// store's revision `read`. `uncertain`: an earlier attempt of this
    /// same transaction got no answer, so the change that moved the key
    /// may be that attempt's.
    Conflict {
        now: u64,
        value: Vec<u8>,
        created: u64,
        read: u64,
        uncertain: bool,
    },
}

/// What a transaction holds to besides its key's revision
/// (`Client::when_at`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Guards<'a> {
    /// Keys that must not exist (a run declared lost only while its live
    /// key is gone).
    pub absent: &'a [Vec<u8>],
    /// Keys that must still be at these `mod_revision`s (the semaphores
    /// a put grants, each as the grant was decided on).
    pub at: &'a [(Vec<u8>, u64)],
}

/// A transaction's answer as a swap's outcome.
fn swapped(res: proto::TxnResponse, uncertain: bool) -> Swapped {
    let read = revision_of(&res.header);
    if res.succeeded {
        return Swapped::Done(read);
    }
    let kv = res.responses.into_iter().find_map(|r| match r.response {
        Some(proto::Response::Range(r)) => r.kvs.into_iter().next(),
        None => None,
    });
    let (now, value, created) = kv.map_or((0, Vec::new(), 0), |kv| {
        (
            u64::try_from(kv.mod_revision).unwrap_or(0),
            kv.value,
            u64::try_from(kv.create_revision).unwrap_or(0),
        )
    });
    Swapped::Conflict {
        now,
        value,
        created,
        read,
        uncertain,
    }
}

/// Whether a failed call surely never reached a member's raft log: the
/// connection was never made, or the member refused it before proposing
/// (no leader, not capable, overloaded). Anything else may have been
/// applied.
fn surely_unsent(message: &str) -> bool {
    [
        "tcp connect error",
        "Connection refused",
        "etcdserver: no leader",
        "etcdserver: not capable",
        "etcdserver: too many requests",
    ]
    .iter()
    .any(|m| message.contains(m))
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

/// One member: its URL (for messages) and its connection.
struct Member {
    url: String,
    channel: Channel,
}

pub struct Client {
    members: Vec<Member>,
    /// The member tried first (the last that answered).
    current: AtomicUsize,
    credentials: Option<(String, String)>,
    /// Each member's auth token (tokens are per member when etcd's simple
    /// tokens are used), by member: several members are asked at once
    /// when the keep-alive stream moves.
    tokens: Mutex<Vec<Option<String>>>,
    timeout: Duration,
}

const KV_RANGE: &str = "/etcdserverpb.KV/Range";
const KV_TXN: &str = "/etcdserverpb.KV/Txn";
const WATCH: &str = "/etcdserverpb.Watch/Watch";
const AUTHENTICATE: &str = "/etcdserverpb.Auth/Authenticate";
const LEASE_GRANT: &str = "/etcdserverpb.Lease/LeaseGrant";
const LEASE_KEEP_ALIVE: &str = "/etcdserverpb.Lease/LeaseKeepAlive";
const LEASE_REVOKE: &str = "/etcdserverpb.Lease/LeaseRevoke";
const STATUS: &str = "/etcdserverpb.Maintenance/Status";

impl Client {
    pub fn new(config: &EtcdConfig) -> Result<Self, String> {
        if config.endpoints.is_empty() {
            return Err("no etcd endpoint is given (--etcd-endpoints)".into());
        }
        let _ = rustls::crypto::ring::default_provider().install_default();
        let read = |path: &PathBuf, what: &str| {
            std::fs::read(path)
                .map_err(|e| format!("cannot read the etcd {what} {}: {e}", path.display()))
        };
        let mut tls = None;
        if config.endpoints.iter().any(|e| e.starts_with("https://")) {
            let mut t = tonic::transport::ClientTlsConfig::new();
            match &config.ca {
                Some(ca) => {
                    t = t.ca_certificate(tonic::transport::Certificate::from_pem(read(
                        ca,
                        "CA bundle",
                    )?));
                }
                None => t = t.with_native_roots(),
            }
            tls = Some(t);
        }
        match (&config.cert, &config.key) {
            (Some(cert), Some(key)) => {
                let identity = tonic::transport::Identity::from_pem(
                    read(cert, "client certificate")?,
                    read(key, "client key")?,
                );
                tls = Some(
                    tls.unwrap_or_else(tonic::transport::ClientTlsConfig::new)
                        .identity(identity),
                );
            }
            (None, None) => {}
            _ => return Err("--etcd-cert and --etcd-key go together".into()),
        }
        let mut members = Vec::new();
        for e in &config.endpoints {
            if !(e.starts_with("http://") || e.starts_with("https://")) {
                return Err(format!(
                    "etcd endpoint {e:?} is not an http:// or https:// URL"
                ));
            }
            let url = e.trim_end_matches('/').to_owned();
            let mut endpoint = tonic::transport::Endpoint::from_shared(url.clone())
                .map_err(|e| format!("etcd endpoint {url:?}: {e}"))?
                .connect_timeout(config.request_timeout)
                .tcp_nodelay(true)
                .tcp_keepalive(Some(Duration::from_secs(10)))
                .http2_keep_alive_interval(Duration::from_secs(10))
                .keep_alive_timeout(config.request_timeout)
                .keep_alive_while_idle(true);
            if url.starts_with("https://")
                && let Some(t) = &tls
            {
                endpoint = endpoint.tls_config(t.clone()).map_err(|e| {
                    format!("the TLS settings for etcd endpoint {url} are not usable: {e}")
                })?;
            }
            members.push(Member {
                url,
                channel: endpoint.connect_lazy(),
            });
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
            members,
            current: AtomicUsize::new(0),
            credentials,
            tokens: Mutex::new(vec![None; config.endpoints.len()]),
            timeout: config.request_timeout,
        })
    }

    fn token_for(&self, member: usize) -> Option<String> {
        let tokens = self.tokens.lock().unwrap_or_else(PoisonError::into_inner);
        tokens.get(member).cloned().flatten()
    }

    /// A request with the deadline, the auth token and etcd's
    /// require-leader flag (a member without a leader answers at once
    /// instead of waiting).
    fn request<T>(&self, member: usize, message: T, within: Duration) -> tonic::Request<T> {
        let mut req = self.addressed(member, message);
        req.set_timeout(within);
        req
    }

    /// A request with the auth token and the require-leader flag, and no
    /// deadline (a stream lives past any: its opening is bounded by the
    /// caller).
    fn addressed<T>(&self, member: usize, message: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(message);
        let md = req.metadata_mut();
        md.insert(
            "hasleader",
            tonic::metadata::MetadataValue::from_static("true"),
        );
        if let Some(t) = self.token_for(member)
            && let Ok(v) = t.parse()
        {
            md.insert("token", v);
        }
        req
    }

    /// One unary call to one member, within the deadline. `Ambiguous` if
    /// it was (maybe) sent and no answer came.
    async fn unary_once<Req, Res>(
        &self,
        member: usize,
        path: &'static str,
        message: Req,
    ) -> Result<Res, CallError>
    where
        Req: prost::Message + Send + Sync + 'static,
        Res: prost::Message + Default + Send + Sync + 'static,
    {
        let m = &self.members[member];
        let mut grpc = tonic::client::Grpc::new(m.channel.clone());
        let call = async {
            grpc.ready()
                .await
                .map_err(|e| CallError::Unreachable(format!("{}: {e}", m.url)))?;
            // From here on the request may reach the member.
            grpc.unary(
                self.request(member, message, self.timeout),
                PathAndQuery::from_static(path),
                tonic_prost::ProstCodec::default(),
            )
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| classify(&m.url, &status))
        };
        match tokio::time::timeout(self.timeout, call).await {
            Ok(answer) => answer,
            Err(_) => Err(CallError::Ambiguous(format!(
                "{}: no answer within {:?}",
                m.url, self.timeout
            ))),
        }
    }

    async fn authenticate(&self, member: usize) -> Result<(), CallError> {
        let Some((name, password)) = &self.credentials else {
            return Ok(());
        };
        let req = proto::AuthenticateRequest {
            name: name.clone(),
            password: password.clone(),
        };
        let res: proto::AuthenticateResponse = self.unary_once(member, AUTHENTICATE, req).await?;
        if let Some(t) = self
            .tokens
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(member)
        {
            *t = Some(res.token);
        }
        Ok(())
    }

    /// A call to one member, authenticating first where needed (and once
    /// more if its token expired).
    async fn on<Req, Res>(
        &self,
        member: usize,
        path: &'static str,
        message: Req,
    ) -> Result<Res, CallError>
    where
        Req: prost::Message + Clone + Send + Sync + 'static,
        Res: prost::Message + Default + Send + Sync + 'static,
    {
        if self.credentials.is_some() && self.token_for(member).is_none() {
            self.authenticate(member).await?;
        }
        let answer = self.unary_once(member, path, message.clone()).await;
        if matches!(&answer, Err(CallError::Refused(m)) if m.contains("token")) {
            self.authenticate(member).await?;
            return self.unary_once(member, path, message).await;
        }
        answer
    }

    /// A call to the member that answered last, then the others: on a
    /// member that is unreachable or has no leader, the next one. A call
    /// that may have been applied is not sent again (`Ambiguous`) unless
    /// `idempotent`.
    async fn call<Req, Res>(
        &self,
        path: &'static str,
        message: Req,
        idempotent: bool,
    ) -> Result<Res, CallError>
    where
        Req: prost::Message + Clone + Send + Sync + 'static,
        Res: prost::Message + Default + Send + Sync + 'static,
    {
        let n = self.members.len();
        let first = self.current.load(Ordering::Relaxed);
        let mut last = String::new();
        for i in 0..n {
            let at = (first + i) % n;
            match self.on(at, path, message.clone()).await {
                Ok(res) => {
                    self.current.store(at, Ordering::Relaxed);
                    return Ok(res);
                }
                Err(CallError::Unreachable(e)) => last = e,
                Err(CallError::Ambiguous(e)) if idempotent => last = e,
                Err(e) => {
                    // A member that did not answer is not asked first next.
                    if matches!(e, CallError::Ambiguous(_)) {
                        self.current.store((at + 1) % n, Ordering::Relaxed);
                    }
                    return Err(e);
                }
            }
            self.current.store((at + 1) % n, Ordering::Relaxed);
        }
        Err(CallError::Unreachable(last))
    }

    /// Every key from `key` (inclusive) to `end`, at `revision` (0: now),
    /// at most `limit` of them; a linearizable read (through the leader).
    pub async fn range(
        &self,
        key: &[u8],
        end: &[u8],
        revision: u64,
        limit: u64,
    ) -> Result<RangeResponse, CallError> {
        let req = proto::RangeRequest {
            key: key.to_vec(),
            range_end: end.to_vec(),
            limit: i64::try_from(limit).unwrap_or(i64::MAX),
            revision: i64::try_from(revision).unwrap_or(i64::MAX),
            serializable: false,
            count_only: false,
        };
        let res: proto::RangeResponse = self.call(KV_RANGE, req, true).await?;
        Ok(RangeResponse {
            revision: revision_of(&res.header),
            kvs: res.kvs.into_iter().map(KeyValue::from).collect(),
            more: res.more,
        })
    }

    /// Puts `value` at `key` (or deletes `key`, for `None`) if the key's
    /// `mod_revision` is `expect` (0: the key is absent), else reads it.
    /// `Ambiguous` when the transaction was sent and no answer came: it
    /// may have been applied, and the caller finds out (a record carries
    /// the IDs of the writes that made it).
    pub async fn swap(
        &self,
        key: &[u8],
        value: Option<&[u8]>,
        expect: u64,
    ) -> Result<Swapped, CallError> {
        self.swap_with(key, value, expect, Guards::default(), Vec::new())
            .await
    }

    /// `swap`, with `also` applied in the same transaction when it
    /// succeeds (a task's liveness keys with its record), and only while
    /// `guards` hold.
    pub async fn swap_with(
        &self,
        key: &[u8],
        value: Option<&[u8]>,
        expect: u64,
        guards: Guards<'_>,
        also: Vec<Request>,
    ) -> Result<Swapped, CallError> {
        let then = match value {
            Some(v) => Request::Put(proto::PutRequest {
                key: key.to_vec(),
                value: v.to_vec(),
                lease: 0,
            }),
            None => Request::DeleteRange(proto::DeleteRangeRequest {
                key: key.to_vec(),
                range_end: Vec::new(),
            }),
        };
        let mut ops = vec![then];
        ops.extend(also);
        self.when_at(key, expect, guards, ops).await
    }

    /// Applies `ops` in one transaction if `key`'s `mod_revision` is
    /// `expect` (0: the key is absent) and `guards` hold, else reads `key`
    /// (as `swap`: a conflict with `key` at `expect` is a guard that
    /// failed).
    pub async fn when_at(
        &self,
        key: &[u8],
        expect: u64,
        guards: Guards<'_>,
        ops: Vec<Request>,
    ) -> Result<Swapped, CallError> {
        let mut compare = vec![proto::Compare {
            result: proto::COMPARE_EQUAL,
            target: proto::TARGET_MOD,
            key: key.to_vec(),
            target_union: Some(CompareUnion::ModRevision(
                i64::try_from(expect).unwrap_or(i64::MAX),
            )),
        }];
        // A key that does not exist has version 0.
        compare.extend(guards.absent.iter().map(|k| proto::Compare {
            result: proto::COMPARE_EQUAL,
            target: proto::TARGET_VERSION,
            key: k.clone(),
            target_union: Some(CompareUnion::Version(0)),
        }));
        // And `mod_revision` 0, so a guard at a revision fails on it.
        compare.extend(guards.at.iter().map(|(k, revision)| proto::Compare {
            result: proto::COMPARE_EQUAL,
            target: proto::TARGET_MOD,
            key: k.clone(),
            target_union: Some(CompareUnion::ModRevision(
                i64::try_from(*revision).unwrap_or(i64::MAX),
            )),
        }));
        let req = proto::TxnRequest {
            compare,
            success: ops
                .into_iter()
                .map(|request| RequestOp {
                    request: Some(request),
                })
                .collect(),
            failure: vec![RequestOp {
                request: Some(Request::Range(proto::RangeRequest {
                    key: key.to_vec(),
                    ..Default::default()
                })),
            }],
        };
        // The same transaction on each member in turn: sending it again is
        // safe (its compare lets at most one attempt apply), and a conflict
        // after an attempt that got no answer is told as uncertain.
        let n = self.members.len();
        let first = self.current.load(Ordering::Relaxed);
        let mut uncertain = false;
        let mut last = String::new();
        for i in 0..n {
            let at = (first + i) % n;
            match self
                .on::<_, proto::TxnResponse>(at, KV_TXN, req.clone())
                .await
            {
                Ok(res) => {
                    self.current.store(at, Ordering::Relaxed);
                    return Ok(swapped(res, uncertain));
                }
                Err(CallError::Unreachable(e) | CallError::Ambiguous(e)) => {
                    uncertain |= !surely_unsent(&e);
                    last = e;
                }
                Err(e) if uncertain => {
                    return Err(CallError::Ambiguous(format!(
                        "{e}, after an attempt that got no answer"
                    )));
                }
                Err(e) => return Err(e),
            }
            self.current.store((at + 1) % n, Ordering::Relaxed);
        }
        Err(if uncertain {
            CallError::Ambiguous(last)
        } else {
            CallError::Unreachable(last)
        })
    }

    /// Opens a watch on `[key, end)` from `start` on the member that
    /// answered last (then the others), with `require_leader`: a member
    /// that loses its leader cancels the watch instead of going quiet. The
    /// opening has a deadline too: it is open once the member said it
    /// created it.
    pub async fn watch(&self, key: &[u8], end: &[u8], start: u64) -> Result<Watch, CallError> {
        let n = self.members.len();
        let first = self.current.load(Ordering::Relaxed);
        let mut last = String::new();
        for i in 0..n {
            let at = (first + i) % n;
            match self.watch_on(at, key, end, start).await {
                Ok(w) => {
                    self.current.store(at, Ordering::Relaxed);
                    return Ok(w);
                }
                Err(CallError::Compacted(r)) => return Err(CallError::Compacted(r)),
                Err(e) => last = e.to_string(),
            }
            self.current.store((at + 1) % n, Ordering::Relaxed);
        }
        Err(CallError::Unreachable(last))
    }

    async fn watch_on(
        &self,
        member: usize,
        key: &[u8],
        end: &[u8],
        start: u64,
    ) -> Result<Watch, CallError> {
        if self.credentials.is_some() && self.token_for(member).is_none() {
            self.authenticate(member).await?;
        }
        let m = &self.members[member];
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let create = proto::WatchRequest {
            request_union: Some(proto::WatchUnion::Create(proto::WatchCreateRequest {
                key: key.to_vec(),
                range_end: end.to_vec(),
                start_revision: i64::try_from(start).unwrap_or(i64::MAX),
                progress_notify: true,
            })),
        };
        tx.send(create)
            .map_err(|_| CallError::Unreachable("the watch closed".into()))?;
        let open = async {
            // The stream lives past any deadline: only its opening has one
            // (below); a member that goes quiet later is found by `check`.
            let mut stream: tonic::codec::Streaming<proto::WatchResponse> =
                self.open_stream(member, rx, WATCH).await?;
            // Created, or canceled at once (a compacted start).
            let first = stream
                .message()
                .await
                .map_err(|status| classify(&m.url, &status))?
                .ok_or_else(|| {
                    CallError::Unreachable(format!("{}: the watch closed at once", m.url))
                })?;
            Ok::<_, CallError>((stream, first))
        };
        let (stream, first) = match tokio::time::timeout(self.timeout, open).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(CallError::Unreachable(format!(
                    "{}: the watch was not created within {:?}",
                    m.url, self.timeout
                )));
            }
        };
        Ok(Watch {
            endpoint: m.url.clone(),
            stream,
            _requests: tx,
            first: Some(first),
        })
    }

    /// Whether the member at `endpoint` reaches its cluster's quorum now:
    /// a linearizable read of one key goes through the leader.
    pub async fn check(&self, endpoint: &str, key: &[u8]) -> Result<u64, CallError> {
        let Some(at) = self.members.iter().position(|m| m.url == endpoint) else {
            return Err(CallError::Refused(format!("no member {endpoint}")));
        };
        let req = proto::RangeRequest {
            key: key.to_vec(),
            count_only: true,
            ..Default::default()
        };
        let res: proto::RangeResponse = self.on(at, KV_RANGE, req).await?;
        Ok(revision_of(&res.header))
    }

    /// Moves the next requests to the member after `endpoint`.
    pub fn skip(&self, endpoint: &str) {
        if let Some(at) = self.members.iter().position(|m| m.url == endpoint) {
            let n = self.members.len();
            let _ = self.current.compare_exchange(
                at,
                (at + 1) % n,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    /// A lease of `ttl` seconds: its ID and the TTL etcd gave it (raised
    /// to etcd's minimum when `ttl` is below it). Not sent again after an
    /// attempt that got no answer: a lease granted twice is one left to
    /// expire, but the caller learns of the failure.
    pub async fn grant(&self, ttl: i64) -> Result<(i64, i64), CallError> {
        let res: proto::LeaseGrantResponse = self
            .call(LEASE_GRANT, proto::LeaseGrantRequest { ttl, id: 0 }, false)
            .await?;
        if !res.error.is_empty() {
            return Err(CallError::Refused(res.error));
        }
        Ok((res.id, res.ttl))
    }

    /// Revokes a lease (the keys attached to it go).
    pub async fn revoke(&self, id: i64) -> Result<(), CallError> {
        let _: proto::LeaseRevokeResponse = self
            .call(LEASE_REVOKE, proto::LeaseRevokeRequest { id }, true)
            .await?;
        Ok(())
    }

    /// Renews a lease once; its TTL left (0: it has expired).
    pub async fn keep_alive(&self, id: i64) -> Result<i64, CallError> {
        let n = self.members.len();
        let first = self.current.load(Ordering::Relaxed);
        let mut last = String::new();
        for i in 0..n {
            let at = (first + i) % n;
            match self.keep_alive_on(at, id).await {
                Ok(ttl) => return Ok(ttl),
                Err(CallError::Refused(e)) => return Err(CallError::Refused(e)),
                Err(e) => last = e.to_string(),
            }
        }
        Err(CallError::Unreachable(last))
    }

    async fn keep_alive_on(&self, member: usize, id: i64) -> Result<i64, CallError> {
        if self.credentials.is_some() && self.token_for(member).is_none() {
            self.authenticate(member).await?;
        }
        let m = &self.members[member];
        let once = async {
            let mut grpc = tonic::client::Grpc::new(m.channel.clone());
            grpc.ready()
                .await
                .map_err(|e| CallError::Unreachable(format!("{}: {e}", m.url)))?;
            let req = self.request(
                member,
                tokio_stream::once(proto::LeaseKeepAliveRequest { id }),
                self.timeout,
            );
            let res: tonic::Response<tonic::codec::Streaming<proto::LeaseKeepAliveResponse>> = grpc
                .streaming(
                    req,
                    PathAndQuery::from_static(LEASE_KEEP_ALIVE),
                    tonic_prost::ProstCodec::default(),
                )
                .await
                .map_err(|status| classify(&m.url, &status))?;
            let answer = res
                .into_inner()
                .message()
                .await
                .map_err(|status| classify(&m.url, &status))?;
            Ok::<_, CallError>(answer.map_or(0, |a| a.ttl))
        };
        match tokio::time::timeout(self.timeout, once).await {
            Ok(r) => r,
            Err(_) => Err(CallError::Unreachable(format!(
                "{}: a lease keep-alive got no answer within {:?}",
                m.url, self.timeout
            ))),
        }
    }

    /// How many members the client knows.
    pub fn members(&self) -> usize {
        self.members.len()
    }

    /// The member whose client URL is `endpoint`.
    pub fn member_at(&self, endpoint: &str) -> Option<usize> {
        self.members.iter().position(|m| m.url == endpoint)
    }

    /// Opens a stream of lease keep-alives on `member`, sending `first` on
    /// it (at least one: etcd answers the opening with the first renewal),
    /// within `within`, authentication included. Only the opening has a
    /// deadline; the stream lives until it breaks.
    pub async fn lease_stream_on(
        &self,
        member: usize,
        first: &[i64],
        within: Duration,
    ) -> Result<LeaseStream, CallError> {
        let m = &self.members[member];
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for &id in first {
            tx.send(proto::LeaseKeepAliveRequest { id })
                .map_err(|_| CallError::Unreachable("the keep-alive stream closed".into()))?;
        }
        let open = async {
            if self.credentials.is_some() && self.token_for(member).is_none() {
                self.authenticate(member).await?;
            }
            self.open_stream::<_, proto::LeaseKeepAliveResponse>(member, rx, LEASE_KEEP_ALIVE)
                .await
        };
        match tokio::time::timeout(within, open).await {
            Ok(Ok(stream)) => Ok(LeaseStream {
                endpoint: m.url.clone(),
                tx,
                stream,
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(CallError::Unreachable(format!(
                "{}: the keep-alive stream was not opened within {within:?}",
                m.url
            ))),
        }
    }

    /// Opens a bidirectional stream on `member` (the watch, the lease
    /// keep-alives): what `rx` yields is sent as it comes. No deadline
    /// here: the caller bounds the opening.
    async fn open_stream<Req, Resp>(
        &self,
        member: usize,
        rx: tokio::sync::mpsc::UnboundedReceiver<Req>,
        path: &'static str,
    ) -> Result<tonic::codec::Streaming<Resp>, CallError>
    where
        Req: prost::Message + Send + Sync + 'static,
        Resp: prost::Message + Default + Send + Sync + 'static,
    {
        let m = &self.members[member];
        let mut grpc = tonic::client::Grpc::new(m.channel.clone());
        grpc.ready()
            .await
            .map_err(|e| CallError::Unreachable(format!("{}: {e}", m.url)))?;
        let req = self.addressed(
            member,
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
        );
        let res = grpc
            .streaming(
                req,
                PathAndQuery::from_static(path),
                tonic_prost::ProstCodec::default(),
            )
            .await
            .map_err(|status| classify(&m.url, &status))?;
        Ok(res.into_inner())
    }

    /// The member's status (version, leader), for health checks and tests.
    pub async fn status(&self, endpoint: &str) -> Result<(String, u64), CallError> {
        let Some(at) = self.members.iter().position(|m| m.url == endpoint) else {
            return Err(CallError::Refused(format!("no member {endpoint}")));
        };
        let res: proto::StatusResponse = self.on(at, STATUS, proto::StatusRequest {}).await?;
        Ok((res.version, res.leader))
    }
}

fn revision_of(h: &Option<proto::ResponseHeader>) -> u64 {
    revision(h)
}

/// What an error status means for the next try.
fn classify(endpoint: &str, status: &tonic::Status) -> CallError {
    let message = format!("{endpoint}: {} ({:?})", status.message(), status.code());
    if status
        .message()
        .contains("required revision has been compacted")
    {
        return CallError::Compacted(0);
    }
    use tonic::Code;
    match status.code() {
        // No leader, an election, an overloaded member: nothing applied.
        Code::Unavailable | Code::ResourceExhausted | Code::Aborted => {
            CallError::Unreachable(message)
        }
        // The deadline passed or the connection broke with the request
        // maybe on its way: it may have been applied.
        Code::DeadlineExceeded | Code::Cancelled | Code::Unknown => CallError::Ambiguous(message),
        _ => CallError::Refused(message),
    }
}

/// An open stream of lease keep-alives (`Client::lease_stream`).
pub struct LeaseStream {
    pub endpoint: String,
    tx: tokio::sync::mpsc::UnboundedSender<proto::LeaseKeepAliveRequest>,
    stream: tonic::codec::Streaming<proto::LeaseKeepAliveResponse>,
}

impl LeaseStream {
    /// Sends a renewal of lease `id`; false if the stream is closed.
    pub fn send(&self, id: i64) -> bool {
        self.tx.send(proto::LeaseKeepAliveRequest { id }).is_ok()
    }

    /// The next answer: the lease and its TTL left (0: it has expired or
    /// was never granted); `None` when the member closed the stream.
    pub async fn next(&mut self) -> Result<Option<(i64, i64)>, CallError> {
        let answer = self.stream.message().await.map_err(|status| {
            match classify(&self.endpoint, &status) {
                CallError::Ambiguous(m) => CallError::Unreachable(m),
                other => other,
            }
        })?;
        Ok(answer.map(|a| (a.id, a.ttl)))
    }
}

/// An open watch.
pub struct Watch {
    pub endpoint: String,
    stream: tonic::codec::Streaming<proto::WatchResponse>,
    /// Kept open: closing the request stream ends the watch.
    _requests: tokio::sync::mpsc::UnboundedSender<proto::WatchRequest>,
    /// The creation's answer, given first.
    first: Option<proto::WatchResponse>,
}

impl Watch {
    /// The next response; `None` when the member closed the stream.
    pub async fn next(&mut self) -> Result<Option<WatchResponse>, CallError> {
        let message = match self.first.take() {
            Some(m) => Some(m),
            None => self.stream.message().await.map_err(|status| {
                match classify(&self.endpoint, &status) {
                    CallError::Ambiguous(m) => CallError::Unreachable(m),
                    other => other,
                }
            })?,
        };
        Ok(message.map(|r| WatchResponse {
            revision: revision_of(&r.header),
            created: r.created,
            canceled: r.canceled,
            compact_revision: u64::try_from(r.compact_revision).unwrap_or(0),
            cancel_reason: r.cancel_reason,
            events: r
                .events
                .into_iter()
                .map(|e| Event {
                    deleted: e.kind == proto::EVENT_DELETE,
                    kv: e.kv.map(KeyValue::from).unwrap_or_default(),
                })
                .collect(),
        }))
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
    fn a_status_says_whether_the_request_may_have_been_applied() {
        let ambiguous = tonic::Status::deadline_exceeded("slow");
        assert!(matches!(classify("e", &ambiguous), CallError::Ambiguous(_)));
        let no_leader = tonic::Status::unavailable("etcdserver: no leader");
        assert!(matches!(
            classify("e", &no_leader),
            CallError::Unreachable(_)
        ));
        let compacted =
            tonic::Status::out_of_range("etcdserver: mvcc: required revision has been compacted");
        assert!(matches!(classify("e", &compacted), CallError::Compacted(_)));
        let refused = tonic::Status::permission_denied("etcdserver: permission denied");
        assert!(matches!(classify("e", &refused), CallError::Refused(_)));
    }
}
