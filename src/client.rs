//! The command-line tools' client of a taskgate server (`taskgate health`,
//! `taskgate agent`): reqwest, with keep-alive connections, timeouts,
//! proxies from the environment and TLS (rustls with ring, as the server).

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
    }

    /// `request`, also returning the answer's header `read` (if asked for
    /// and present).
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
    ) -> Result<(u16, Option<String>, Vec<u8>), String> {
        let headers: Vec<(&str, &str)> = headers.to_vec();
        let reply = self
            .send(method, path, token, body, &headers, timeout)
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
        let method = reqwest::Method::from_bytes(method.as_bytes()).map_err(|e| e.to_string())?;
        let mut req = self
            .client
            .request(method, format!("{}{path}", self.base))
            .timeout(timeout);
        if let Some(t) = token {
            req = req.bearer_auth(t);
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
            if e.is_timeout() {
                format!("no answer from {} within {timeout:?}", self.url)
            } else {
                error_chain(&e)
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
