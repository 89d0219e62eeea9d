//! TLS with a certificate made at test time, the recipe of
//! docs/operations.md run as written and used by the CLI and the agent,
//! TLS failures told as such, the header-read bound, and the timeout on
//! requests that do not wait.

mod common;

use std::{sync::Arc, time::Duration};

use taskgate::{app::Application, config::ServeConfig};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};
use tokio_rustls::{
    TlsConnector,
    rustls::{self, ClientConfig, RootCertStore, pki_types::ServerName},
};

const BOUND: Duration = Duration::from_secs(20);

struct Running {
    addr: std::net::SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn start(config: ServeConfig) -> Running {
    let app = Application::build(config).await.unwrap();
    let addr = app.local_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(app.run_until_stopped(async move {
        let _ = stopped.await;
    }));
    Running { addr, stop, task }
}

/// Reads a whole HTTP/1.1 answer (the server closes after `Connection: close`).
async fn exchange<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    mut s: S,
    path: &str,
) -> String {
    let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(BOUND, s.read_to_end(&mut out))
        .await
        .expect("answered")
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

/// A TLS server with a certificate made now, and a client that trusts it.
async fn tls_server() -> (Running, TlsConnector, tempfile::TempDir) {
    tls_server_with(ServeConfig::for_tests()).await
}

/// `tls_server` with this configuration.
async fn tls_server_with(mut config: ServeConfig) -> (Running, TlsConnector, tempfile::TempDir) {
    let made = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("cert.pem");
    let key = dir.path().join("key.pem");
    std::fs::write(&cert, made.cert.pem()).unwrap();
    std::fs::write(&key, made.key_pair.serialize_pem()).unwrap();
    config.tls_cert = Some(cert);
    config.tls_key = Some(key);
    let server = start(config).await;

    let mut roots = RootCertStore::empty();
    roots.add(made.cert.der().clone()).unwrap();
    let client =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    (server, TlsConnector::from(Arc::new(client)), dir)
}

async fn tls_connect(
    connector: &TlsConnector,
    addr: std::net::SocketAddr,
) -> tokio_rustls::client::TlsStream<TcpStream> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .expect("handshake with the generated certificate")
}

/// Sends `request` on a new TLS connection and reads the whole answer
/// (the request says `Connection: close`).
async fn tls_send(connector: &TlsConnector, addr: std::net::SocketAddr, request: &[u8]) -> String {
    let mut tls = tls_connect(connector, addr).await;
    tls.write_all(request).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(BOUND, tls.read_to_end(&mut out))
        .await
        .expect("answered")
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

/// Opens an event stream over TLS and reads its answer's head, then
/// nothing more: the stream's connection, and the client's address.
async fn tls_stream(
    connector: &TlsConnector,
    addr: std::net::SocketAddr,
) -> (
    tokio_rustls::client::TlsStream<TcpStream>,
    std::net::SocketAddr,
) {
    let mut reader = tls_connect(connector, addr).await;
    let client = reader.get_ref().0.local_addr().unwrap();
    reader
        .write_all(b"GET /v1/events HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0; 1];
        tokio::time::timeout(BOUND, reader.read_exact(&mut byte))
            .await
            .expect("the stream's head")
            .unwrap();
        head.push(byte[0]);
    }
    assert!(head.starts_with(b"HTTP/1.1 200"), "{head:?}");
    (reader, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_https_with_the_given_certificate() {
    let (server, connector, _dir) = tls_server().await;
    let tls = tls_connect(&connector, server.addr).await;
    let answer = exchange(tls, "/v1/health").await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains(r#"{"status":"ok"}"#), "{answer}");

    // Plain HTTP to the TLS port gets no HTTP answer.
    let plain = exchange(TcpStream::connect(server.addr).await.unwrap(), "/v1/health").await;
    assert!(!plain.contains("200 OK"), "{plain}");

    server.stop.send(()).unwrap();
    server.task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_finishes_its_headers_is_cut_off() {
    let mut config = ServeConfig::for_tests();
    config.header_timeout = Duration::from_millis(300);
    let server = start(config).await;
    let mut slow = TcpStream::connect(server.addr).await.unwrap();
    slow.write_all(b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\n")
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let mut buf = Vec::new();
    // Ends (EOF, or a reset) once the server gives up on the headers.
    let _ = tokio::time::timeout(BOUND, slow.read_to_end(&mut buf))
        .await
        .expect("the server closed the connection");
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "{:?}",
        started.elapsed()
    );
    // Others are served meanwhile and after.
    let answer = exchange(TcpStream::connect(server.addr).await.unwrap(), "/v1/health").await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    server.stop.send(()).unwrap();
    server.task.await.unwrap().unwrap();
}

/// Under TLS too, an event-stream client that never reads holds the
/// server's kernel send queue (encrypted bytes now) to the stream's send
/// buffer, however many changes pile up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_event_stream_over_tls_holds_a_bounded_kernel_send_queue() {
    let (server, connector, _dir) = tls_server().await;
    let send = |request: Vec<u8>| {
        let connector = connector.clone();
        let addr = server.addr;
        async move { tls_send(&connector, addr, &request).await }
    };
    let spec = common::five_tasks().to_string();
    let answer = send(common::raw::json_request(
        "PUT",
        "/v1/allocations/a1",
        spec.as_bytes(),
    ))
    .await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");

    let (reader, client) = tls_stream(&connector, server.addr).await;

    // As in tests/rude.rs: the buffer, the segment being filled, room.
    let bound = taskgate::server::DEFAULT_STREAM_SEND_BUFFER as u64 + (128 << 10);
    let mut most = 0;
    for n in 0..200 {
        let answer = send(common::raw::report_with_event(n)).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let queued =
            common::raw::server_send_queue(server.addr, client).expect("the stream's connection");
        most = most.max(queued);
        assert!(
            queued <= bound,
            "after {n} changes the server's send queue to a TLS client that reads nothing holds \
             {queued} bytes (bound {bound})"
        );
    }
    let deadline = std::time::Instant::now() + BOUND;
    while common::raw::server_send_queue(server.addr, client).is_none_or(|q| q < 128 << 10) {
        assert!(
            std::time::Instant::now() < deadline,
            "the stream never filled the kernel's send queue (most {most} bytes)"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(common::raw::server_send_queue(server.addr, client).unwrap() <= bound);
    drop(reader);
    server.stop.send(()).unwrap();
    server.task.await.unwrap().unwrap();
}

/// Under TLS too, an event-stream client that stops reading is dropped
/// after the write timeout (the bound is under the TLS stream, on its
/// encrypted writes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_event_stream_over_tls_is_dropped_after_the_write_timeout() {
    let mut config = ServeConfig::for_tests();
    config.write_timeout = Duration::from_millis(500);
    let (server, connector, _dir) = tls_server_with(config).await;
    let spec = common::five_tasks().to_string();
    let put = common::raw::json_request("PUT", "/v1/allocations/a1", spec.as_bytes());
    let answer = tls_send(&connector, server.addr, &put).await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    let waiters = || async {
        let metrics = common::raw::request("GET", "/metrics", None, b"");
        let text = tls_send(&connector, server.addr, &metrics).await;
        text.lines()
            .find_map(|l| l.strip_prefix("taskgate_waiters "))
            .map(|v| v.trim().parse::<u64>().unwrap())
            .expect("taskgate_waiters")
    };
    let (reader, _client) = tls_stream(&connector, server.addr).await;
    assert_eq!(waiters().await, 1);
    let mut dropped = false;
    for n in 0..2_000 {
        let answer = tls_send(&connector, server.addr, &common::raw::report_with_event(n)).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        if waiters().await == 0 {
            dropped = true;
            break;
        }
    }
    assert!(
        dropped,
        "the server kept a TLS event stream whose client stopped reading"
    );
    drop(reader);
    server.stop.send(()).unwrap();
    server.task.await.unwrap().unwrap();
}

/// The commands of docs/operations.md's TLS recipe.
fn recipe() -> String {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .unwrap();
    let block = doc
        .split("<!-- tls-recipe:start -->")
        .nth(1)
        .and_then(|rest| rest.split("<!-- tls-recipe:end -->").next())
        .expect("docs/operations.md has the TLS recipe");
    let body = block
        .split("```sh\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the recipe is a sh block");
    body.to_owned()
}

/// Runs `script` with `sh -e` in `dir` (openssl must be installed:
/// `.ci/run` installs it).
fn sh_in(dir: &std::path::Path, script: &str) {
    let out = std::process::Command::new("sh")
        .args(["-e", "-c", script])
        .current_dir(dir)
        .output()
        .expect("sh runs");
    assert!(
        out.status.success(),
        "{script}\nfailed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn taskgate(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_taskgate"))
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .unwrap()
}

/// Waits (bounded) for a child to exit.
fn exit_within(child: &mut std::process::Child, bound: Duration) -> std::process::ExitStatus {
    let until = std::time::Instant::now() + bound;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if std::time::Instant::now() > until {
            let _ = child.kill();
            panic!("the child did not exit within {bound:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The recipe of docs/operations.md, run as written, makes a certificate
/// that the CLI and the agent accept, by name and by address.
#[test]
fn the_documented_recipe_works_with_the_cli_and_the_agent() {
    let dir = tempfile::tempdir().unwrap();
    sh_in(dir.path(), &recipe());
    let file = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let server = common::process::Server::start(&[
        "--in-memory",
        "--tls-cert",
        &file("cert.pem"),
        "--tls-key",
        &file("key.pem"),
    ]);
    let port = server.addr().port();
    let ca = file("ca.pem");
    for host in ["localhost", "127.0.0.1"] {
        let url = format!("https://{host}:{port}");
        let o = taskgate(&["alloc", "--server", &url, "--ca-cert", &ca, "list"]);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{host}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&o.stdout), "no allocations\n");
    }
    let url = format!("https://localhost:{port}");
    let o = taskgate(&["health", "--server", &url, "--ca-cert", &ca]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // The agent registers a one-task allocation over TLS, runs its task
    // and exits with its exit code once the allocation is done.
    let spec = file("spec.json");
    std::fs::write(&spec, r#"{"tasks": [{"name": "main"}]}"#).unwrap();
    let mut agent = std::process::Command::new(env!("CARGO_BIN_EXE_taskgate"))
        .args([
            "agent",
            "--server",
            &url,
            "--ca-cert",
            &ca,
            "--alloc",
            "tls-1",
            "--task",
            "main",
            "--register",
            &spec,
            "--",
            "true",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let exit = exit_within(&mut agent, BOUND);
    assert!(exit.success(), "{exit:?}");
    let o = taskgate(&[
        "alloc",
        "--server",
        &url,
        "--ca-cert",
        &ca,
        "status",
        "tls-1",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("main      main"), "{out}");
    assert!(out.contains("dead ok"), "{out}");
}

/// The usual self-signed certificate (its own CA), a CA the client was not
/// given, and an https:// URL for a plain-HTTP server: each a TLS failure
/// (exit 4) that says what to check, not "cannot reach the server" (3).
#[test]
fn tls_failures_are_told_as_such_with_their_own_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    sh_in(
        dir.path(),
        "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 \
         -subj /CN=localhost -addext subjectAltName=DNS:localhost \
         -keyout self.key -out self.pem",
    );
    sh_in(dir.path(), &recipe());
    let file = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let own_ca = common::process::Server::start(&[
        "--in-memory",
        "--tls-cert",
        &file("self.pem"),
        "--tls-key",
        &file("self.key"),
    ]);
    let url = format!("https://localhost:{}", own_ca.addr().port());
    let o = taskgate(&[
        "alloc",
        "--server",
        &url,
        "--ca-cert",
        &file("self.pem"),
        "list",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(4), "{err}");
    assert!(err.contains("is a CA certificate"), "{err}");
    assert!(
        err.contains("--ca-cert") && err.contains("docs/operations.md"),
        "{err}"
    );
    assert!(!err.contains("cannot reach"), "{err}");

    let signed = common::process::Server::start(&[
        "--in-memory",
        "--tls-cert",
        &file("cert.pem"),
        "--tls-key",
        &file("key.pem"),
    ]);
    let url = format!("https://localhost:{}", signed.addr().port());
    // The server's CA is not the one given.
    let o = taskgate(&[
        "alloc",
        "--server",
        &url,
        "--ca-cert",
        &file("self.pem"),
        "list",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(4), "{err}");
    assert!(
        err.contains("not signed by a CA this client trusts"),
        "{err}"
    );

    let plain = common::process::Server::start(&["--in-memory"]);
    let url = format!("https://127.0.0.1:{}", plain.addr().port());
    let o = taskgate(&["alloc", "--server", &url, "list"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(4), "{err}");
    assert!(err.contains("does not speak TLS"), "{err}");
}
