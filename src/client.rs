//! The command-line tools' client of a taskgate server (`taskgate health`,
//! `taskgate agent`, `taskgate alloc`): reqwest, with keep-alive
//! connections, timeouts, proxies from the environment and TLS (rustls
//! with ring, as the server). A failed TLS handshake is told apart from an
//! unreachable server and says what to check: it is a setup to fix, not a
//! network to wait for.

use std::{path::Path, time::Duration};

/// Where a server is and how to reach it.
#[derive(Clone)]
pub struct Endpoint {
    client: reqwest::Client,
    /// The base URL as given, for messages.
    pub url: String,
    base: String,
}

impl Endpoint {
    /// A server at `url` (`http://host:port` or `https://host:port`). An
    /// `https` server is verified against `ca_cert` (PEM) if given, else
    /// against the system's roots.
    pub fn new(url: &str, ca_cert: Option<&Path>) -> Result<Self, String> {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(format!(
                "{url:?}: the server URL must start with http:// or https://"
            ));
        }
        let parsed = reqwest::Url::parse(url).map_err(|e| format!("{url:?}: {e}"))?;
        if parsed.host_str().is_none_or(str::is_empty) {
            return Err(format!("{url:?}: no host"));
        }
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut builder = reqwest::Client::builder()
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(10))
            .redirect(reqwest::redirect::Policy::none());
        if let Some(ca) = ca_cert {
            let pem = std::fs::read(ca).map_err(|e| format!("{}: {e}", ca.display()))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| format!("{}: {e}", ca.display()))?;
            if certs.is_empty() {
                return Err(format!("{}: no PEM certificate in it", ca.display()));
            }
            builder = builder.tls_certs_only(certs);
        } else if parsed.scheme() == "http" {
            // Plain HTTP needs no roots (and a minimal image has none).
            builder = builder.tls_certs_only([]);
        }
        let client = builder.build().map_err(|e| {
            format!(
                "cannot make a client for {url}: {} (--ca-cert names the CA to trust)",
                error_chain(&e)
            )
        })?;
        Ok(Self {
            client,
            url: url.to_owned(),
            base: url.trim_end_matches('/').to_owned(),
        })
    }

    /// One request; returns the status and the body. Fails on network
    /// errors and when `timeout` passes.
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&serde_json::Value>,
        headers: &[(&'static str, &'static str)],
        timeout: Duration,
    ) -> Result<(u16, Vec<u8>), String> {
        self.request_reading(method, path, token, body, headers, timeout, None)
            .await
            .map(|(status, _, body)| (status, body))
            .map_err(|e| e.to_string())
    }

    /// `request`, also returning the answer's header `read` (if asked for
    /// and present), with a TLS failure told apart.
    #[allow(clippy::too_many_arguments)]
    pub async fn request_reading(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&serde_json::Value>,
        headers: &[(&'static str, &'static str)],
        timeout: Duration,
        read: Option<&str>,
    ) -> Result<(u16, Option<String>, Vec<u8>), RequestError> {
        let headers: Vec<(&str, &str)> = headers.to_vec();
        let reply = self
            .exchange(method, path, token, body, &headers, timeout)
            .await?;
        let header = read.and_then(|name| reply.header(name)).map(str::to_owned);
        Ok((reply.status, header, reply.body))
    }

    /// One request with any headers; the answer whole.
    pub async fn send(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&serde_json::Value>,
        headers: &[(&str, &str)],
        timeout: Duration,
    ) -> Result<Reply, String> {
        self.exchange(method, path, token, body, headers, timeout)
            .await
            .map_err(|e| e.to_string())
    }

    /// `send`, with a TLS failure told apart.
    async fn exchange(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&serde_json::Value>,
        headers: &[(&str, &str)],
        timeout: Duration,
    ) -> Result<Reply, RequestError> {
        let method = reqwest::Method::from_bytes(method.as_bytes())
            .map_err(|e| RequestError::Unreachable(e.to_string()))?;
        let mut req = self
            .client
            .request(method, format!("{}{path}", self.base))
            .timeout(timeout);
        if let Some(t) = token {
            // A token from a file or a Kubernetes Secret may end with a
            // newline, which no header value can carry.
            req = req.bearer_auth(t.trim());
        }
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        if let Some(b) = body {
            req = req
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(b.to_string());
        }
        let why = |e: reqwest::Error| {
            if let Some(tls) = tls_failure(&e) {
                RequestError::Tls(format!("the TLS handshake with {} failed: {tls}", self.url))
            } else if e.is_timeout() {
                RequestError::Unreachable(format!("no answer from {} within {timeout:?}", self.url))
            } else {
                RequestError::Unreachable(error_chain(&e))
            }
        };
        let answer = req.send().await.map_err(why)?;
        let status = answer.status().as_u16();
        let headers = answer.headers().clone();
        let body = answer.bytes().await.map_err(why)?;
        Ok(Reply {
            status,
            headers,
            body: body.to_vec(),
        })
    }
}

/// Why a request got no answer.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The TLS handshake failed; the message says what to check.
    #[error("{0}")]
    Tls(String),
    /// No answer: a refused or cut connection, a timeout, a name that does
    /// not resolve.
    #[error("{0}")]
    Unreachable(String),
}

/// What to check, said after every certificate refusal.
const CHECK_CA: &str = "check that --ca-cert (TASKGATE_CA_CERT) names the CA that signed \
the server's certificate, and that the server's certificate is not its own CA \
(docs/operations.md, \"TLS\", has a recipe that works)";

/// The TLS failure under a request's error, explained, if it is one.
/// rustls's error sits inside an `io::Error` (inside another, as reqwest
/// wraps it), whose `source()` skips what it holds, so each `io::Error` of
/// the chain is opened down to what it wraps.
fn tls_failure(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut next = Some(e);
    while let Some(e) = next {
        let mut held: Option<&(dyn std::error::Error + 'static)> = Some(e);
        while let Some(h) = held {
            if let Some(tls) = h.downcast_ref::<rustls::Error>() {
                return Some(explain_tls(tls));
            }
            held = h
                .downcast_ref::<std::io::Error>()
                .and_then(std::io::Error::get_ref)
                .map(|inner| inner as &(dyn std::error::Error + 'static));
        }
        next = e.source();
    }
    None
}

fn explain_tls(e: &rustls::Error) -> String {
    use rustls::{CertificateError as C, Error as E};
    match e {
        E::InvalidCertificate(c) => {
            let what = match c {
                C::UnknownIssuer => "the server's certificate is not signed by a CA this client \
                                     trusts (without --ca-cert: the system's CAs)"
                    .to_owned(),
                C::NotValidForName | C::NotValidForNameContext { .. } => {
                    "the server's certificate does not name the host of the URL: its \
                     subjectAltName must list it (DNS:name or IP:address), or use a name it lists"
                        .to_owned()
                }
                C::Expired | C::ExpiredContext { .. } => {
                    "the server's certificate has expired (or this machine's clock is wrong)"
                        .to_owned()
                }
                C::NotValidYet | C::NotValidYetContext { .. } => {
                    "the server's certificate is not valid yet (or this machine's clock is wrong)"
                        .to_owned()
                }
                // webpki's `CaUsedAsEndEntity` reaches rustls as an
                // "other" error: its name is the only way to tell it.
                C::Other(other) if format!("{other:?}").contains("CaUsedAsEndEntity") => {
                    "the server's certificate is a CA certificate (basicConstraints CA:TRUE, \
                     which `openssl req -x509` sets by default): it may sign the server's \
                     certificate but not be it; make a CA and a server certificate signed by it"
                        .to_owned()
                }
                other => format!("the server's certificate was refused ({other:?})"),
            };
            format!("{what}; {CHECK_CA}")
        }
        E::InvalidMessage(_)
        | E::InappropriateMessage { .. }
        | E::InappropriateHandshakeMessage { .. } => {
            "the server does not speak TLS (a plain-HTTP server?): use an http:// URL, or give the \
             server --tls-cert and --tls-key"
                .to_owned()
        }
        E::AlertReceived(alert) => format!(
            "the server ended the handshake ({alert:?}): check that it has a certificate and key \
             that belong together, and its log"
        ),
        other => format!("{other}; {CHECK_CA}"),
    }
}

/// A server's answer.
pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Vec<u8>,
}

impl Reply {
    /// A header's value, if present and text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// An error and every error under it, `: `-separated (reqwest's own
/// message is only the outermost, "error sending request").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut why = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        why.push_str(": ");
        why.push_str(&s.to_string());
        source = s.source();
    }
    why
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_urls_are_checked() {
        assert!(Endpoint::new("http://127.0.0.1:8080", None).is_ok());
        assert!(Endpoint::new("http://[::1]:9/", None).is_ok());
        assert!(Endpoint::new("127.0.0.1:8080", None).is_err());
        assert!(Endpoint::new("http://:80", None).is_err());
        assert!(Endpoint::new("http://h:x", None).is_err());
        let missing = Endpoint::new("https://h", Some(Path::new("/nonexistent/ca.pem")));
        assert!(missing.err().unwrap().contains("/nonexistent/ca.pem"));
    }
}
