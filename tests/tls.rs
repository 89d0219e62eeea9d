//! TLS with a certificate made at test time, the header-read bound, and
//! the timeout on requests that do not wait.

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_https_with_the_given_certificate() {
    let made = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("cert.pem");
    let key = dir.path().join("key.pem");
    std::fs::write(&cert, made.cert.pem()).unwrap();
    std::fs::write(&key, made.key_pair.serialize_pem()).unwrap();
    let mut config = ServeConfig::for_tests();
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
    let connector = TlsConnector::from(Arc::new(client));
    let tcp = TcpStream::connect(server.addr).await.unwrap();
    let tls = connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .expect("handshake with the generated certificate");
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
