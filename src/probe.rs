//! `taskgate health`: probes a running server's `/v1/health`, for container
//! health checks in images without curl. Exit 0 when it answers 200.

use std::{path::PathBuf, sync::Arc, time::Duration};

use clap::Args;
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::TcpStream,
};
use tokio_rustls::{
    TlsConnector,
    rustls::{
        self, ClientConfig, RootCertStore,
        pki_types::{CertificateDer, ServerName, pem::PemObject},
    },
};

#[derive(Debug, Clone, Args)]
pub struct HealthConfig {
    /// The server's base URL (`http://host:port` or `https://host:port`).
    #[arg(long, env = "TASKGATE_SERVER", default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// PEM CA certificate(s) to trust for an `https` server.
    #[arg(long, env = "TASKGATE_CA_CERT")]
    pub ca_cert: Option<PathBuf>,
    /// Give up after this long.
    #[arg(long, default_value = "5s", value_parser = crate::http::params::parse_duration)]
    pub timeout: Duration,
}

/// `(tls, host, port)` of a base URL.
fn parse_server(url: &str) -> Result<(bool, String, u16), String> {
    let (tls, rest) = if let Some(r) = url.strip_prefix("https://") {
        (true, r)
    } else if let Some(r) = url.strip_prefix("http://") {
        (false, r)
    } else {
        return Err(format!(
            "{url:?}: the server URL must start with http:// or https://"
        ));
    };
    let authority = rest.split('/').next().unwrap_or_default();
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => (
            h.to_owned(),
            p.parse::<u16>()
                .map_err(|_| format!("{url:?}: bad port {p:?}"))?,
        ),
        _ => (authority.to_owned(), if tls { 443 } else { 80 }),
    };
    if host.is_empty() {
        return Err(format!("{url:?}: no host"));
    }
    Ok((tls, host.trim_matches(['[', ']']).to_owned(), port))
}

async fn get_health<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    host: &str,
) -> Result<u16, String> {
    let req = format!("GET /v1/health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out);
    text.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| "no HTTP answer".to_owned())
}

async fn probe(config: &HealthConfig) -> Result<u16, String> {
    let (tls, host, port) = parse_server(&config.server)?;
    let tcp = TcpStream::connect((host.as_str(), port))
        .await
        .map_err(|e| format!("cannot connect to {host}:{port}: {e}"))?;
    if !tls {
        return get_health(tcp, &host).await;
    }
    let ca = config
        .ca_cert
        .as_ref()
        .ok_or("an https server needs --ca-cert (the CA that signed its certificate)")?;
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).map_err(|e| format!("{}: {e}", ca.display()))? {
        roots
            .add(cert.map_err(|e| format!("{}: {e}", ca.display()))?)
            .map_err(|e| format!("{}: {e}", ca.display()))?;
    }
    let client =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
    let name = ServerName::try_from(host.clone()).map_err(|e| format!("{host:?}: {e}"))?;
    let stream = TlsConnector::from(Arc::new(client))
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS with {host}: {e}"))?;
    get_health(stream, &host).await
}

/// Returns true when the server is healthy; says why not on stderr.
pub async fn run(config: HealthConfig) -> bool {
    match tokio::time::timeout(config.timeout, probe(&config)).await {
        Ok(Ok(200)) => true,
        Ok(Ok(status)) => {
            eprintln!("taskgate health: {} answered {status}", config.server);
            false
        }
        Ok(Err(e)) => {
            eprintln!("taskgate health: {e}");
            false
        }
        Err(_) => {
            eprintln!(
                "taskgate health: no answer from {} within {:?}",
                config.server, config.timeout
            );
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_urls() {
        assert_eq!(
            parse_server("http://127.0.0.1:8080").unwrap(),
            (false, "127.0.0.1".into(), 8080)
        );
        assert_eq!(
            parse_server("https://tg.example/").unwrap(),
            (true, "tg.example".into(), 443)
        );
        assert_eq!(
            parse_server("http://[::1]:9").unwrap(),
            (false, "::1".into(), 9)
        );
        assert!(parse_server("127.0.0.1:8080").is_err());
        assert!(parse_server("http://:80").is_err());
        assert!(parse_server("http://h:x").is_err());
    }
}
