//! `taskgate-bench --scenarios versus-etcd`: durable reports against a
//! single-node etcd's puts on the same machine, in one run.
//!
//! The agents' real traffic: `--clients` keep-alive connections, one
//! one-task allocation each, every report a real change (running ↔
//! pending), with and without an event, with full and with minimal
//! (`Prefer: return=minimal`) answers. etcd (a single member started
//! here, its data directory in the system's temporary directory like the
//! durable server's) takes `--clients` loops of puts of a value the size of
//! our stored record, one key per loop, through its JSON gateway (HTTP/1.1
//! keep-alive, sent by the same client code as our reports) and through its gRPC API (HTTP/2; one connection per
//! eight loops, as etcd's own benchmark tool shares them). The four rows
//! alternate `ROUNDS` times; the note gives the medians and the ratios of
//! the medians.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use base64::Engine;
use tonic::codegen::http::uri::PathAndQuery;

use super::{BenchConfig, Outcome, Proc, serve_args};
use taskgate::store::etcd::proto::{PutRequest, ResponseHeader};
use taskgate_testkit::cluster::Cluster;

/// Alternations of the four rows.
const ROUNDS: usize = 3;
/// gRPC loops per HTTP/2 connection.
const LOOPS_PER_CHANNEL: usize = 8;

const ONE_TASK: &str = r#"{"tasks": [{"name": "web"}]}"#;

/// etcd's `etcdserverpb.PutResponse`, of which only the header's revision
/// is read (to know the put was applied). The store's own messages have
/// no put of their own (its puts go in transactions).
#[derive(Clone, PartialEq, prost::Message)]
struct PutResponse {
    #[prost(message, optional, tag = "1")]
    header: Option<ResponseHeader>,
}

pub(super) async fn scenario(config: &BenchConfig) -> std::io::Result<(Vec<Outcome>, String)> {
    let cluster = tokio::task::spawn_blocking(|| Cluster::start(1))
        .await
        .map_err(std::io::Error::other)?;
    let endpoint = cluster.endpoints().remove(0);

    let (dir, _guard) = super::data_dir(config, "versus-etcd")?;
    let dir = dir.to_string_lossy().into_owned();
    let server = Proc::start(&serve_args(&["--data-dir", dir.as_str()]))?;
    super::register(
        server.addr,
        "one",
        0..config.clients,
        config.clients,
        ONE_TASK,
    )
    .await?;
    // The value etcd is given: as long as the record a report stores (the
    // allocation's view after a report with an event, a little larger than
    // its binary record).
    let mut conn = super::Conn::open(server.addr).await?;
    let (method, path, body) = report(true)(0, 0);
    conn.call(method, &path, &body).await?;
    conn.call("GET", "/v1/allocations/one-0", b"").await?;
    let value = conn.json()?.to_string().into_bytes();

    let mut rows = Vec::new();
    let mut rates: [Vec<f64>; 6] = Default::default();
    for round in 0..ROUNDS {
        let round_name = |what: &str| format!("{what}, round {}", round + 1);
        let o = gateway_puts(
            &endpoint,
            &value,
            config,
            &round_name("etcd puts, JSON gateway"),
        )
        .await?;
        rates[0].push(o.rate());
        rows.push(o);
        let o = grpc_puts(&endpoint, &value, config, &round_name("etcd puts, gRPC")).await?;
        rates[1].push(o.rate());
        rows.push(o);
        for (i, events, minimal) in [
            (2, false, false),
            (3, true, false),
            (4, false, true),
            (5, true, true),
        ] {
            let name = match (events, minimal) {
                (false, false) => "reports, durable, one-task allocations",
                (true, false) => "reports with an event, durable, one-task allocations",
                (false, true) => "reports, durable, one-task allocations, return=minimal",
                (true, true) => {
                    "reports with an event, durable, one-task allocations, return=minimal"
                }
            };
            let headers = if minimal {
                "Prefer: return=minimal\r\n"
            } else {
                ""
            };
            let o = super::drive_with(
                &round_name(name),
                &[server.addr],
                config.clients,
                config.duration,
                headers,
                report(events),
            )
            .await?;
            rates[i].push(o.rate());
            rows.push(o);
        }
    }
    let [gateway, grpc, plain, events, plain_min, events_min] = rates.map(|r| median(&r));
    let note = format!(
        "versus etcd: a single etcd member on this machine, {clients} loops of puts of {len} \
         bytes (our stored record's size), {ROUNDS} alternations, medians: JSON gateway \
         {gateway:.0}/s, gRPC {grpc:.0}/s; durable reports on one-task allocations {plain:.0}/s \
         without events, {events:.0}/s with an event each; with `Prefer: return=minimal` \
         {plain_min:.0}/s and {events_min:.0}/s. Reports with an event per etcd put: \
         {:.2}× through the gateway, {:.2}× through gRPC (full answers); {:.2}× and {:.2}× \
         (minimal answers). Without events: {:.2}× and {:.2}× (full), {:.2}× and {:.2}× \
         (minimal).",
        events / gateway,
        events / grpc,
        events_min / gateway,
        events_min / grpc,
        plain / gateway,
        plain / grpc,
        plain_min / gateway,
        plain_min / grpc,
        clients = config.clients,
        len = value.len(),
    );
    drop(server);
    drop(cluster);
    Ok((rows, note))
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Client `c`'s `n`th report on its allocation `one-{c}`: running ↔
/// pending, with an event when `events`.
fn report(events: bool) -> impl Fn(usize, u64) -> (&'static str, String, Vec<u8>) + Clone {
    move |c, n| {
        let (state, kind) = if n.is_multiple_of(2) {
            ("running", "Started")
        } else {
            ("pending", "Restarting")
        };
        let body = if events {
            format!(
                r#"{{"state": "{state}", "event": {}}}"#,
                super::event_json(kind, n)
            )
        } else {
            format!(r#"{{"state": "{state}"}}"#)
        };
        (
            "PUT",
            format!("/v1/allocations/one-{c}/tasks/web/state"),
            body.into_bytes(),
        )
    }
}

/// Runs `clients` loops of `put(loop, key)` for the warm-up and the
/// measured time, as `drive` does for HTTP/1.1.
async fn loops<F, Fut>(name: &str, config: &BenchConfig, put: F) -> std::io::Result<Outcome>
where
    F: Fn(usize, Vec<u8>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), String>> + Send,
{
    let put = Arc::new(put);
    let measure_from = Instant::now() + Duration::from_secs(1);
    let end = measure_from + config.duration;
    let mut tasks = Vec::new();
    for c in 0..config.clients {
        let put = put.clone();
        let key = format!("/versus/{c}").into_bytes();
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut errors, mut lat) = (0u64, 0u64, Vec::new());
            let mut first_error = None;
            loop {
                let sent = Instant::now();
                if sent >= end {
                    break;
                }
                let done = put(c, key.clone()).await;
                if sent >= measure_from {
                    lat.push(sent.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
                    match done {
                        Ok(()) => ok += 1,
                        Err(e) => {
                            errors += 1;
                            first_error.get_or_insert(e);
                        }
                    }
                }
            }
            (ok, errors, lat, first_error)
        }));
    }
    let mut out = Outcome {
        name: name.to_owned(),
        requests: 0,
        errors: 0,
        elapsed: config.duration,
        latencies_us: Vec::new(),
    };
    for t in tasks {
        let (ok, errors, lat, first_error) = t.await.map_err(std::io::Error::other)?;
        if let Some(e) = first_error {
            eprintln!("bench: {name}: {e}");
        }
        out.requests += ok;
        out.errors += errors;
        out.latencies_us.extend(lat);
    }
    out.latencies_us.sort_unstable();
    Ok(out)
}

/// Puts through etcd's JSON gateway (`POST /v3/kv/put`, key and value in
/// base64), sent by the very client that sends our reports (`drive`).
async fn gateway_puts(
    endpoint: &str,
    value: &[u8],
    config: &BenchConfig,
    name: &str,
) -> std::io::Result<Outcome> {
    let addr: std::net::SocketAddr = endpoint
        .strip_prefix("http://")
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("etcd's endpoint {endpoint:?}")))?;
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let bodies: Arc<Vec<Vec<u8>>> = Arc::new(
        (0..config.clients)
            .map(|c| {
                format!(
                    r#"{{"key":"{}","value":"{}"}}"#,
                    b64(format!("/versus/{c}").as_bytes()),
                    b64(value)
                )
                .into_bytes()
            })
            .collect(),
    );
    super::drive(name, addr, config.clients, config.duration, move |c, _| {
        ("POST", "/v3/kv/put".to_owned(), bodies[c].clone())
    })
    .await
}

/// Puts through etcd's gRPC API (`etcdserverpb.KV/Put`), loop `c` on
/// connection `c / LOOPS_PER_CHANNEL`.
async fn grpc_puts(
    endpoint: &str,
    value: &[u8],
    config: &BenchConfig,
    name: &str,
) -> std::io::Result<Outcome> {
    let mut channels = Vec::new();
    for _ in 0..config.clients.div_ceil(LOOPS_PER_CHANNEL) {
        let channel = tonic::transport::Endpoint::from_shared(endpoint.to_owned())
            .map_err(std::io::Error::other)?
            .connect()
            .await
            .map_err(std::io::Error::other)?;
        channels.push(channel);
    }
    let value = value.to_vec();
    loops(name, config, move |c, key| {
        let mut grpc = tonic::client::Grpc::new(channels[c / LOOPS_PER_CHANNEL].clone());
        let request = PutRequest {
            key,
            value: value.clone(),
            lease: 0,
        };
        async move {
            grpc.ready().await.map_err(|e| e.to_string())?;
            let res: tonic::Response<PutResponse> = grpc
                .unary(
                    tonic::Request::new(request),
                    PathAndQuery::from_static("/etcdserverpb.KV/Put"),
                    tonic_prost::ProstCodec::default(),
                )
                .await
                .map_err(|e| e.to_string())?;
            match res.into_inner().header {
                Some(h) if h.revision > 0 => Ok(()),
                other => Err(format!("a put answered without a revision: {other:?}")),
            }
        }
    })
    .await
}
