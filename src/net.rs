//! A small HTTP/1.1 client for the command-line tools (`taskgate health`,
//! `taskgate agent`): one connection per request, plain or TLS, JSON in
//! and out. Enough for a handful of requests a second; not a general
//! client.

use std::{path::Path, sync::Arc, time::Duration};

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

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// Where a server is and how to reach it.
#[derive(Clone)]
pub struct Endpoint {
    host: String,
    port: u16,
    tls: Option<(TlsConnector, ServerName<'static>)>,
    /// The URL as given, for messages.
    pub url: String,
}

/// `(tls, host, port)` of a base URL.
pub fn parse_server(url: &str) -> Result<(bool, String, u16), String> {
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

impl Endpoint {
    /// `ca_cert` (PEM) is required for `https` URLs.
    pub fn new(url: &str, ca_cert: Option<&Path>) -> Result<Self, String> {
        let (tls, host, port) = parse_server(url)?;
        let tls = if tls {
            let ca = ca_cert
                .ok_or("an https server needs --ca-cert (the CA that signed its certificate)")?;
            let mut roots = RootCertStore::empty();
            for cert in
                CertificateDer::pem_file_iter(ca).map_err(|e| format!("{}: {e}", ca.display()))?
            {
                roots
                    .add(cert.map_err(|e| format!("{}: {e}", ca.display()))?)
                    .map_err(|e| format!("{}: {e}", ca.display()))?;
            }
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let client = ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| e.to_string())?
                .with_root_certificates(roots)
                .with_no_client_auth();
            let name = ServerName::try_from(host.clone()).map_err(|e| format!("{host:?}: {e}"))?;
            Some((TlsConnector::from(Arc::new(client)), name))
        } else {
            None
        };
        Ok(Self {
            host,
            port,
            tls,
            url: url.to_owned(),
        })
    }

    async fn connect(&self) -> Result<Box<dyn Io>, String> {
        let tcp = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| format!("cannot connect to {}:{}: {e}", self.host, self.port))?;
        let _ = tcp.set_nodelay(true);
        match &self.tls {
            None => Ok(Box::new(tcp)),
            Some((connector, name)) => {
                let tls = connector
                    .connect(name.clone(), tcp)
                    .await
                    .map_err(|e| format!("TLS with {}: {e}", self.host))?;
                Ok(Box::new(tls))
            }
        }
    }

    /// One request; returns the status and the body. Fails on I/O errors and
    /// when `timeout` passes.
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&serde_json::Value>,
        timeout: Duration,
    ) -> Result<(u16, Vec<u8>), String> {
        let exchange = async {
            let mut io = self.connect().await?;
            let body = body.map(|b| b.to_string()).unwrap_or_default();
            let mut req = format!(
                "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: {}\r\n",
                self.host,
                body.len()
            );
            if !body.is_empty() {
                req.push_str("Content-Type: application/json\r\n");
            }
            if let Some(t) = token {
                req.push_str(&format!("Authorization: Bearer {t}\r\n"));
            }
            req.push_str("\r\n");
            req.push_str(&body);
            io.write_all(req.as_bytes())
                .await
                .map_err(|e| e.to_string())?;
            let mut raw = Vec::new();
            io.read_to_end(&mut raw).await.map_err(|e| e.to_string())?;
            parse_response(&raw)
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| format!("no answer from {} within {timeout:?}", self.url))?
    }
}

/// Status and body of a whole `Connection: close` answer.
fn parse_response(raw: &[u8]) -> Result<(u16, Vec<u8>), String> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("an incomplete HTTP answer")?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("no HTTP status")?;
    let body = &raw[split + 4..];
    let chunked = head
        .lines()
        .any(|l| l.to_ascii_lowercase().starts_with("transfer-encoding:") && l.contains("chunked"));
    Ok((
        status,
        if chunked {
            dechunk(body)
        } else {
            body.to_vec()
        },
    ))
}

fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = body.windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&body[..eol])
            .ok()
            .and_then(|s| usize::from_str_radix(s.split(';').next().unwrap_or("").trim(), 16).ok())
            .unwrap_or(0);
        body = &body[eol + 2..];
        if size == 0 || body.len() < size {
            break;
        }
        out.extend_from_slice(&body[..size]);
        body = body.get(size + 2..).unwrap_or_default();
    }
    out
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

    #[test]
    fn answers_plain_and_chunked() {
        let (s, b) = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok").unwrap();
        assert_eq!((s, b.as_slice()), (200, b"ok".as_slice()));
        let (s, b) = parse_response(
            b"HTTP/1.1 503 X\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n1\r\nc\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!((s, b.as_slice()), (503, b"abc".as_slice()));
        assert!(parse_response(b"HTTP/1.1 200").is_err());
    }
}
