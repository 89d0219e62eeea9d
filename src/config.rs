//! `taskgate serve`'s arguments: every flag also a `TASKGATE_*` variable.
//! `taskgate serve --help` is the reference.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use clap::Args;

pub use crate::secret::Secret;
use crate::units::{byte_size, parse_duration};

fn duration(s: &str) -> Result<Duration, String> {
    parse_duration(s)
}

/// A liveness TTL: a duration in the range a task may declare.
fn liveness_ttl(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    let (min, max) = crate::lifecycle::TTL_RANGE;
    if d < min || d > max {
        return Err(format!(
            "must be {} to {}",
            crate::units::format_duration(min),
            crate::units::format_duration(max)
        ));
    }
    Ok(d)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StoreKind {
    Disk,
    Etcd,
}

/// The etcd cluster of `--store etcd`.
#[derive(Debug, Clone, Default, Args)]
#[command(next_help_heading = "Replicas (--store etcd)")]
pub struct EtcdArgs {
    /// Client URLs of the etcd members, comma-separated
    /// (`http://10.0.0.1:2379,http://10.0.0.2:2379`).
    #[arg(long, env = "TASKGATE_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,

    /// Every key of this deployment starts with it; replicas on the same
    /// prefix share their allocations.
    #[arg(long, env = "TASKGATE_ETCD_PREFIX", default_value = "/taskgate/")]
    pub etcd_prefix: String,

    /// CA bundle (PEM) that signed the members' certificates.
    #[arg(long, env = "TASKGATE_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,

    /// Client certificate (PEM) for members that require one; with
    /// `--etcd-key`.
    #[arg(long, env = "TASKGATE_ETCD_CERT", requires = "etcd_key")]
    pub etcd_cert: Option<PathBuf>,

    /// The client certificate's private key (PEM).
    #[arg(long, env = "TASKGATE_ETCD_KEY", requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,

    /// etcd user, on a cluster with auth enabled; the password comes from
    /// `--etcd-password-file` or `TASKGATE_ETCD_PASSWORD`.
    #[arg(long, env = "TASKGATE_ETCD_USER")]
    pub etcd_user: Option<String>,

    /// File holding the etcd user's password (one line).
    #[arg(
        long,
        env = "TASKGATE_ETCD_PASSWORD_FILE",
        conflicts_with = "etcd_password"
    )]
    pub etcd_password_file: Option<PathBuf>,

    /// The etcd user's password (from the environment; a flag would show
    /// in the process list).
    #[arg(
        long,
        env = "TASKGATE_ETCD_PASSWORD",
        hide = true,
        hide_env_values = true
    )]
    pub etcd_password: Option<Secret>,

    /// How long one request to an etcd member may take before the next
    /// member is tried.
    #[arg(long, env = "TASKGATE_ETCD_TIMEOUT", default_value = "5s", value_parser = duration)]
    pub etcd_timeout: Duration,
}

impl EtcdArgs {
    /// The client's configuration, the password read from its file.
    pub fn config(&self) -> Result<crate::store::etcd::EtcdConfig, String> {
        let password = match (&self.etcd_password_file, &self.etcd_password) {
            (Some(path), _) => Some(
                std::fs::read_to_string(path)
                    .map_err(|e| {
                        format!("cannot read the etcd password file {}: {e}", path.display())
                    })?
                    .trim_end_matches(['\n', '\r'])
                    .to_owned(),
            ),
            (None, Some(secret)) => Some(secret.0.clone()),
            (None, None) => None,
        };
        Ok(crate::store::etcd::EtcdConfig {
            prefix: self.etcd_prefix.clone(),
            ca: self.etcd_ca.clone(),
            cert: self.etcd_cert.clone(),
            key: self.etcd_key.clone(),
            user: self.etcd_user.clone(),
            password,
            request_timeout: self.etcd_timeout,
            ..crate::store::etcd::EtcdConfig::new(self.etcd_endpoints.clone())
        })
    }
}

#[derive(Debug, Clone, Args)]
pub struct ServeConfig {
    /// Address to listen on: HOST:PORT (a host name such as `localhost`
    /// too), or `:PORT` for every interface; port 0 picks a free one.
    #[arg(help_heading = "Listening", long, env = "TASKGATE_LISTEN", default_value = "127.0.0.1:8080", value_parser = crate::units::parse_listen)]
    pub listen: SocketAddr,

    /// Directory of the embedded store (a snapshot and its log). Created
    /// if missing.
    #[arg(
        help_heading = "Storage",
        long,
        env = "TASKGATE_DATA_DIR",
        default_value = "./taskgate-data"
    )]
    pub data_dir: PathBuf,

    /// Keep everything in memory instead: nothing survives a restart. For
    /// tests and experiments. Refused beside `--store` or
    /// `--etcd-endpoints` (`--data-dir`, which images set, is ignored).
    #[arg(
        help_heading = "Storage",
        long,
        env = "TASKGATE_IN_MEMORY",
        conflicts_with_all = ["store", "etcd_endpoints"]
    )]
    pub in_memory: bool,

    /// Where records live: `disk` (the data directory) or `etcd` (an etcd
    /// cluster that any number of replicas share; see `--etcd-endpoints`).
    #[arg(help_heading = "Storage", long, env = "TASKGATE_STORE", value_enum, default_value_t = StoreKind::Disk)]
    pub store: StoreKind,

    #[command(flatten)]
    pub etcd: Box<EtcdArgs>,

    /// Most changes the store groups into one durable commit. 1 turns
    /// group commit off (one fsync per change).
    #[arg(help_heading = "Storage", long, env = "TASKGATE_COMMIT_BATCH", default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..))]
    pub commit_batch: u64,

    /// Size of the store's log at which a checkpoint folds it into the
    /// snapshot (`64MiB`, `512KiB`, or bytes), or a quarter of the
    /// snapshot's size if that is larger (a checkpoint rewrites the whole
    /// snapshot, so its cost per change stays the same at any size). The
    /// log stays under about four times that, which is what recovery
    /// replays at most; larger means fewer, bigger checkpoints.
    #[arg(help_heading = "Storage", long, env = "TASKGATE_STORE_LOG_LIMIT", default_value = "64MiB", value_parser = byte_size)]
    pub store_log_limit: u64,

    /// The most log the store keeps unfolded while checkpoints fail (a
    /// damaged snapshot, a full disk): past it, writes are refused with
    /// 503 `store_unavailable` until a checkpoint succeeds, instead of the
    /// log growing until the disk or the memory of the next start runs
    /// out. At least four times `--store-log-limit`.
    #[arg(help_heading = "Storage", long, env = "TASKGATE_STORE_LOG_CEILING", default_value = "1GiB", value_parser = byte_size)]
    pub store_log_ceiling: u64,

    /// JSON file of tokens (only SHA-256 hashes of the secrets):
    /// `{"tokens": [{"name": "ci", "role": "agent", "sha256": "<hex>",
    /// "alloc_prefixes": ["web-"]}]}`; roles: operator, agent, reader.
    #[arg(help_heading = "Security", long, env = "TASKGATE_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,

    /// JSON file of trusted JWT issuers (workload identities: Kubernetes
    /// service-account tokens, Nomad workload identities, ...): `{"issuers":
    /// [{"issuer": "<iss>", "jwks_file" or "jwks_url": "...", "audience":
    /// "taskgate", "role": "agent", "alloc_prefixes_claim":
    /// "/kubernetes.io/namespace"}]}`. A bearer token that is a JWT of one of
    /// them is verified against its keys (docs/operations.md).
    #[arg(help_heading = "Security", long, env = "TASKGATE_JWT_ISSUERS")]
    pub jwt_issuers: Option<PathBuf>,

    /// One operator secret (prefer the environment variable: a flag shows
    /// in the process list).
    #[arg(
        help_heading = "Security",
        long,
        env = "TASKGATE_OPERATOR_TOKEN",
        hide_env_values = true
    )]
    pub operator_token: Option<Secret>,

    /// Serve without tokens on a non-loopback address. Without it, such a
    /// server refuses to start.
    #[arg(help_heading = "Security", long, env = "TASKGATE_INSECURE_NO_AUTH")]
    pub insecure_no_auth: bool,

    /// Host names served besides localhost, 127.x.y.z and [::1]
    /// (comma-separated NAME or NAME:PORT; `*`: any).
    ///
    /// A request naming another host (its Host header) is answered 421
    /// `host_not_allowed`, so that a web page whose DNS name is pointed at
    /// the server (DNS rebinding) cannot use it. Without this flag, a
    /// server on a loopback address serves only the loopback names, and
    /// one on any other address serves every name.
    #[arg(help_heading = "Listening", long, env = "TASKGATE_ALLOWED_HOSTS", value_delimiter = ',', value_parser = crate::http::site::parse_allowed_host)]
    pub allowed_hosts: Vec<crate::http::site::AllowedHost>,

    /// Serve /metrics without a token.
    #[arg(help_heading = "Security", long, env = "TASKGATE_PUBLIC_METRICS")]
    pub public_metrics: bool,

    /// Largest request body accepted, in bytes.
    #[arg(help_heading = "Limits", long, env = "TASKGATE_BODY_LIMIT", default_value_t = 1024 * 1024)]
    pub body_limit: usize,

    /// Longest wait a blocking query or long-poll may ask for.
    #[arg(help_heading = "Time", long, env = "TASKGATE_MAX_WAIT", default_value = "300s", value_parser = duration)]
    pub max_wait: Duration,

    /// Requests that may be parked in waits at once; more get 503.
    #[arg(
        help_heading = "Limits",
        long,
        env = "TASKGATE_MAX_WAITERS",
        default_value_t = 100_000
    )]
    pub max_waiters: usize,

    /// Waits one token may hold at once (a token file entry's
    /// `max_waiters` overrides it); more get 429 `quota_exceeded`, so one
    /// tenant cannot take every waiter slot.
    #[arg(help_heading = "Limits", long, env = "TASKGATE_MAX_WAITERS_PER_TOKEN", default_value_t = crate::http::auth::DEFAULT_MAX_WAITERS_PER_TOKEN)]
    pub max_waiters_per_token: usize,

    /// Allocations the server holds at most; registering one more is 429
    /// `quota_exceeded` (a token file entry's `max_allocations` limits one
    /// token within its prefixes).
    #[arg(help_heading = "Limits", long, env = "TASKGATE_MAX_ALLOCATIONS", default_value_t = crate::registry::DEFAULT_MAX_ALLOCATIONS)]
    pub max_allocations: usize,

    /// Dependencies on one allocation's tasks that the tasks of other
    /// allocations may declare together: a registration that would pass it
    /// is 429 `quota_exceeded`. It bounds what one change of an allocation
    /// makes the server judge.
    #[arg(help_heading = "Limits", long, env = "TASKGATE_MAX_DEPENDENTS", default_value_t = crate::registry::DEFAULT_MAX_DEPENDENTS)]
    pub max_dependents: usize,

    /// Dependencies on other allocations that the allocations within one
    /// agent token's prefixes may declare together (a token file entry's
    /// `max_dependencies` overrides it, for any role); a registration that
    /// would pass it is 429 `quota_exceeded`, so one tenant cannot make
    /// the graph every change is judged on as large as it likes.
    #[arg(help_heading = "Limits", long, env = "TASKGATE_MAX_DEPENDENCIES_PER_TOKEN", default_value_t = crate::http::auth::DEFAULT_MAX_DEPENDENCIES_PER_TOKEN)]
    pub max_dependencies_per_token: usize,

    /// Entries each allocation's timeline keeps in memory (its server's
    /// decisions and its agents' events; `GET .../events`); 0 keeps none.
    #[arg(help_heading = "Limits", long, env = "TASKGATE_TIMELINE_EVENTS", default_value_t = crate::registry::DEFAULT_TIMELINE_EVENTS)]
    pub timeline_events: usize,

    /// The liveness TTL of every task that declares none: a running task
    /// whose agent gives no sign of life for this long is declared lost
    /// (dead, failed). Off by default: only tasks with their own
    /// `liveness.ttl` are watched.
    #[arg(help_heading = "Time", long, env = "TASKGATE_DEFAULT_LIVENESS_TTL", value_parser = liveness_ttl)]
    pub default_liveness_ttl: Option<Duration>,

    /// Changes the event stream (`GET /v1/events`) keeps in memory for
    /// readers that resume; one further behind is told to list again
    /// (a `Resync` line).
    #[arg(help_heading = "Limits", long, env = "TASKGATE_EVENT_BUFFER", default_value_t = crate::registry::DEFAULT_EVENT_BUFFER, value_parser = at_least_one)]
    pub event_buffer: usize,

    /// Most bytes of those changes kept rendered for readers (one copy,
    /// shared by all of them): past it the oldest go, and a reader that
    /// far behind is told to list again.
    #[arg(help_heading = "Limits", long, env = "TASKGATE_EVENT_BUFFER_BYTES", default_value = "64MiB", value_parser = byte_size)]
    pub event_buffer_bytes: u64,

    /// Event streams (`GET /v1/events`) open at once; one more is answered
    /// 503 `too_many_waiters`. Each may hold up to 256 KiB of changes ahead
    /// of a client that stopped reading, so the default bounds what streams
    /// can take to 256 MiB.
    #[arg(help_heading = "Limits", long, env = "TASKGATE_MAX_STREAMS", default_value_t = crate::http::DEFAULT_MAX_STREAMS, value_parser = at_least_one)]
    pub max_streams: usize,

    /// The kernel's send buffer of an event stream's connection: what a
    /// client that stops reading pins in the kernel (until
    /// `--write-timeout`) on top of the stream's backlog, and about what a
    /// stream may send per round trip. 0 leaves it to the kernel's
    /// autotuning (up to `net.ipv4.tcp_wmem`'s largest). Other answers
    /// keep the kernel's autotuning.
    #[arg(help_heading = "Limits", long, env = "TASKGATE_STREAM_SEND_BUFFER", default_value = "256KiB", value_parser = crate::units::byte_size_or_zero)]
    pub stream_send_buffer: u64,

    /// Client connections open at once (default: 20000, or what the
    /// open-files limit leaves room for); one more is answered 503
    /// `too_many_connections` and closed.
    ///
    /// A default lowered to fit the open-files limit is said at start, at
    /// info; a value above what the limit allows is lowered to fit, with a
    /// warning.
    #[arg(help_heading = "Limits", long, env = "TASKGATE_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,

    /// Let the memory allocator back the heap with transparent huge pages.
    ///
    /// Off by default: with them, buffer space a connection never touches
    /// is resident anyway, and they made the server no faster (measured:
    /// see BENCHMARKS.md, "Transparent huge pages").
    #[arg(help_heading = "Limits", long, env = "TASKGATE_TRANSPARENT_HUGE_PAGES")]
    pub transparent_huge_pages: bool,

    /// PEM certificate chain: serve HTTPS (with --tls-key).
    #[arg(
        help_heading = "Security",
        long,
        env = "TASKGATE_TLS_CERT",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of --tls-cert.
    #[arg(
        help_heading = "Security",
        long,
        env = "TASKGATE_TLS_KEY",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,

    /// Longest time a client may take to send its request headers (and to
    /// finish a TLS handshake).
    #[arg(help_heading = "Time", long, env = "TASKGATE_HEADER_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub header_timeout: Duration,

    /// Longest time a write of an answer may wait for the client to read;
    /// a client that stops reading is dropped then, with what it held.
    #[arg(help_heading = "Time", long, env = "TASKGATE_WRITE_TIMEOUT", default_value = "30s", value_parser = duration)]
    pub write_timeout: Duration,

    /// Longest time a request that does not wait (everything but blocking
    /// queries and start-condition) may take; then 503 `timeout`.
    #[arg(help_heading = "Time", long, env = "TASKGATE_REQUEST_TIMEOUT", default_value = "30s", value_parser = duration)]
    pub request_timeout: Duration,

    /// How long in-flight requests may take to finish after SIGTERM/SIGINT.
    #[arg(help_heading = "Time", long, env = "TASKGATE_SHUTDOWN_GRACE", default_value = "10s", value_parser = duration)]
    pub shutdown_grace: Duration,

    /// Log filter, as RUST_LOG (`info`, `taskgate=debug,tower_http=info`).
    #[arg(
        help_heading = "Logging",
        long,
        env = "TASKGATE_LOG",
        default_value = "info"
    )]
    pub log: String,

    /// Log format: `text` for people, `json` (one object per line) for log
    /// pipelines.
    #[arg(help_heading = "Logging", long, env = "TASKGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Where each allocation's trace goes: set from the `OTEL_*`
    /// variables (`telemetry.rs`), never a flag; `None`: traces are off.
    #[arg(skip)]
    pub traces: Option<std::sync::Arc<crate::registry::Traces>>,
}

impl ServeConfig {
    /// Defaults for tests: in memory, an OS-chosen loopback port.
    pub fn for_tests() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            data_dir: PathBuf::from("./taskgate-data"),
            in_memory: true,
            store: StoreKind::Disk,
            etcd: Box::new(EtcdArgs {
                etcd_prefix: "/taskgate/".into(),
                etcd_timeout: Duration::from_secs(5),
                ..EtcdArgs::default()
            }),
            commit_batch: 4096,
            transparent_huge_pages: false,
            store_log_limit: crate::store::DEFAULT_LOG_LIMIT,
            store_log_ceiling: crate::store::DEFAULT_LOG_CEILING,
            token_file: None,
            jwt_issuers: None,
            operator_token: None,
            insecure_no_auth: false,
            allowed_hosts: Vec::new(),
            public_metrics: false,
            log: "warn".into(),
            log_format: LogFormat::Text,
            body_limit: 1024 * 1024,
            max_wait: Duration::from_secs(300),
            max_waiters: 100_000,
            max_waiters_per_token: crate::http::auth::DEFAULT_MAX_WAITERS_PER_TOKEN,
            max_allocations: crate::registry::DEFAULT_MAX_ALLOCATIONS,
            max_dependents: crate::registry::DEFAULT_MAX_DEPENDENTS,
            max_dependencies_per_token: crate::http::auth::DEFAULT_MAX_DEPENDENCIES_PER_TOKEN,
            timeline_events: crate::registry::DEFAULT_TIMELINE_EVENTS,
            event_buffer: crate::registry::DEFAULT_EVENT_BUFFER,
            event_buffer_bytes: crate::registry::DEFAULT_EVENT_BUFFER_BYTES as u64,
            default_liveness_ttl: None,
            max_connections: None,
            max_streams: crate::http::DEFAULT_MAX_STREAMS,
            stream_send_buffer: crate::server::DEFAULT_STREAM_SEND_BUFFER as u64,
            shutdown_grace: Duration::from_secs(10),
            tls_cert: None,
            tls_key: None,
            header_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(30),
            traces: None,
        }
    }
}

/// A count of which zero would mean nothing works.
fn at_least_one(raw: &str) -> Result<usize, String> {
    match raw.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}
