//! Whether a request comes from where the server is: the host it names
//! (`Host`, against DNS rebinding) and, for a request that changes
//! something, the site of the page a browser sent it from (`Origin`,
//! `Sec-Fetch-Site`, against cross-site requests). Both hold with or
//! without tokens: a web page of another site carries no token of this
//! server, so on a server without tokens (the loopback default) these are
//! all that stands between any page a browser opens and every write.
//!
//! - **Host.** A page on `http://evil.example:8080` whose name is then
//!   made to resolve to 127.0.0.1 talks to a loopback server as its own
//!   origin: the browser sends `Host: evil.example:8080`, and reads the
//!   answers. A server on a loopback address therefore serves only
//!   loopback names (`localhost`, `127.x.y.z`, `[::1]`, any port) and
//!   those of `--allowed-hosts`; one on another address serves any name
//!   unless `--allowed-hosts` lists them. Loopback names are served on
//!   every address: no page can be given one of them by DNS, and container
//!   health checks use them.
//! - **Site.** Every method but GET, HEAD and OPTIONS changes something. A
//!   browser says where such a request comes from: `Sec-Fetch-Site` (every
//!   current browser) is taken as it says, `same-origin` or `none` (typed
//!   by the user) passing; without it, `Origin` must name the host the
//!   request came to (its `Host`). `Origin: null` (a sandboxed frame, a
//!   file, a cross-site redirect) is never this server. A request with
//!   neither header is not a browser's cross-site request (curl, agents,
//!   an old browser's same-origin form) and passes. Reads pass: CORS keeps
//!   their answers from another site's page (the server sends no CORS
//!   headers), and rebinding, the way around that, is the Host check's.
//!
//! The scheme is not compared: `Host` does not carry it, a proxy that
//! ends TLS changes it, and no other server can answer on the same host
//! and port. `Sec-Fetch-Site` goes first so that a proxy that rewrites
//! `Host` (nginx's default) does not turn the web view's own writes away.

use std::net::{Ipv4Addr, Ipv6Addr};

use axum::{
    extract::Request,
    http::{HeaderMap, HeaderName, Method, StatusCode, header},
};

use super::error::ApiError;

/// One entry of `--allowed-hosts`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AllowedHost {
    /// `*`: every host.
    Any,
    /// A host name or address (lowercase; an IPv6 address in brackets),
    /// on any port or on `port` only.
    Name { host: String, port: Option<u16> },
}

/// Parses an `--allowed-hosts` entry: `*`, or a host as a `Host` header
/// names it, with or without a port (`taskgate.internal`,
/// `taskgate.internal:8443`, `10.0.0.5`, `[fd00::5]`).
pub fn parse_allowed_host(s: &str) -> Result<AllowedHost, String> {
    let s = s.trim();
    if s == "*" {
        return Ok(AllowedHost::Any);
    }
    let (host, port) = host_and_port(s).ok_or_else(|| {
        format!(
            "{s:?} is not a host: give a name or address as a Host header names it \
             (taskgate.internal, taskgate.internal:8443, 10.0.0.5, [fd00::5]), or * for any"
        )
    })?;
    Ok(AllowedHost::Name {
        host: host.to_ascii_lowercase(),
        port,
    })
}

/// A `Host` value split into host and port: a name (letters, digits,
/// `-`, `.`, `_`), an IPv4 address, or an IPv6 address in brackets. No
/// user part, no path.
fn host_and_port(s: &str) -> Option<(&str, Option<u16>)> {
    let (host, port) = if s.starts_with('[') {
        let end = s.find(']')? + 1;
        s[1..end - 1].parse::<Ipv6Addr>().ok()?;
        match &s[end..] {
            "" => (&s[..end], None),
            rest => (&s[..end], Some(rest.strip_prefix(':')?)),
        }
    } else {
        match s.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (s, None),
        }
    };
    let name_ok = host.starts_with('[')
        || (!host.is_empty()
            && host.len() <= 253
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_')));
    if !name_ok {
        return None;
    }
    let port = match port {
        None => None,
        Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => Some(p.parse().ok()?),
        Some(_) => return None,
    };
    Some((host, port))
}

/// A loopback name: `localhost`, an address in 127.0.0.0/8, or `[::1]`.
fn is_loopback(host: &str) -> bool {
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return v6.parse::<Ipv6Addr>().is_ok_and(|a| a.is_loopback());
    }
    host.parse::<Ipv4Addr>().is_ok_and(|a| a.is_loopback())
}

/// Which hosts a server answers to (see the module doc).
#[derive(Clone, Debug)]
pub struct Site {
    /// The server listens on a loopback address: only loopback names and
    /// `allowed` are served.
    loopback: bool,
    /// `--allowed-hosts`; empty: the default of the listener's address.
    allowed: Vec<AllowedHost>,
}

impl Default for Site {
    /// The default server's: on loopback, nothing more allowed.
    fn default() -> Self {
        Self::new(true, Vec::new())
    }
}

/// Why a request was refused, and the answer.
pub struct Refused {
    pub why: &'static str,
    pub answer: ApiError,
}

impl Site {
    pub fn new(loopback_listener: bool, allowed: Vec<AllowedHost>) -> Self {
        Self {
            loopback: loopback_listener,
            allowed,
        }
    }

    fn serves(&self, host: &str, port: Option<u16>) -> bool {
        if is_loopback(host) {
            return true;
        }
        if self.allowed.is_empty() {
            return !self.loopback;
        }
        self.allowed.iter().any(|a| match a {
            AllowedHost::Any => true,
            AllowedHost::Name { host: h, port: p } => {
                h.eq_ignore_ascii_case(host) && p.is_none_or(|p| Some(p) == port)
            }
        })
    }

    /// Lets a request through, or says why not: a host this server does
    /// not serve (421), then a cross-site request that would change
    /// something (403).
    pub fn admit(&self, req: &Request) -> Result<(), Box<Refused>> {
        self.check_host(req)?;
        cross_site(req.method(), req.headers())
    }

    /// Every host a request names, in its `Host` headers and in an
    /// absolute-form target, must be served. A request that names none
    /// (HTTP/1.0) is no browser's and passes.
    fn check_host(&self, req: &Request) -> Result<(), Box<Refused>> {
        let named = req
            .headers()
            .get_all(header::HOST)
            .iter()
            .map(|v| v.to_str().ok());
        let target = req.uri().authority().map(|a| Some(a.as_str()));
        for host in named.chain(target) {
            let parsed = host.and_then(host_and_port);
            if parsed.is_some_and(|(h, p)| self.serves(h, p)) {
                continue;
            }
            let detail = match parsed {
                None => "the Host header does not name a host".to_owned(),
                Some((h, _)) => format!("this server does not serve the host {h:?}"),
            };
            let served = if self.loopback {
                "On a loopback address it serves localhost, 127.0.0.1 (any of 127.0.0.0/8) and \
                 [::1]"
            } else {
                "It serves the loopback names"
            };
            let answer = ApiError::new(
                StatusCode::MISDIRECTED_REQUEST,
                "host_not_allowed",
                format!(
                    "{detail}. {served}, and the names its operator gives with --allowed-hosts \
                     (TASKGATE_ALLOWED_HOSTS), so that a web page whose DNS name is pointed at \
                     this server cannot use it; to serve this name, start it with \
                     --allowed-hosts and the name"
                ),
            );
            return Err(Box::new(Refused {
                why: "a host this server does not serve",
                answer,
            }));
        }
        Ok(())
    }
}

/// A browser's `Sec-Fetch-Site` (made at compile time: a `&str` is parsed
/// on each use).
const SEC_FETCH_SITE: HeaderName = HeaderName::from_static("sec-fetch-site");

/// Refuses a request that would change something and that a browser sent
/// from a page of another site (see the module doc).
fn cross_site(method: &Method, headers: &HeaderMap) -> Result<(), Box<Refused>> {
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return Ok(());
    }
    let refuse = |why: &'static str, said: &str| {
        Box::new(Refused {
            why,
            answer: ApiError::new(
                StatusCode::FORBIDDEN,
                "cross_site_request",
                format!(
                    "a cross-site request: a browser sent it from a page of another site \
                     ({said}), and such a request may not change anything here (reads may). Use \
                     the web view this server serves at /ui, or a client that is not a web page"
                ),
            ),
        })
    };
    if let Some(site) = headers.get(SEC_FETCH_SITE) {
        return match site.as_bytes() {
            b"same-origin" | b"none" => Ok(()),
            _ => Err(refuse(
                "Sec-Fetch-Site is not same-origin",
                "its Sec-Fetch-Site is not same-origin",
            )),
        };
    }
    let mut origins = headers.get_all(header::ORIGIN).iter().peekable();
    if origins.peek().is_none() {
        return Ok(());
    }
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .and_then(host_and_port);
    for origin in origins {
        let origin = origin.to_str().unwrap_or_default();
        if origin == "null" {
            return Err(refuse(
                "Origin: null",
                "`Origin: null`: a sandboxed frame, a file, or a redirect from another site",
            ));
        }
        if !same_host(origin, host) {
            return Err(refuse(
                "Origin is not this server",
                "its Origin is not this server's",
            ));
        }
    }
    Ok(())
}

/// Whether `origin` (`scheme://host[:port]`) names `host` (from the Host
/// header), ports compared with the origin scheme's default filled in.
fn same_host(origin: &str, host: Option<(&str, Option<u16>)>) -> bool {
    let Some((host, port)) = host else {
        return false;
    };
    let Some((scheme, authority)) = origin.split_once("://") else {
        return false;
    };
    let default = match scheme.to_ascii_lowercase().as_str() {
        "http" => 80,
        "https" => 443,
        _ => return false,
    };
    let Some((o_host, o_port)) = host_and_port(authority) else {
        return false;
    };
    o_host.eq_ignore_ascii_case(host) && o_port.unwrap_or(default) == port.unwrap_or(default)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(method: &str, headers: &[(&str, &str)]) -> Request {
        let mut r = Request::builder().method(method).uri("/v1/allocations/a1");
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        r.body(axum::body::Body::empty()).unwrap()
    }

    fn status(site: &Site, method: &str, headers: &[(&str, &str)]) -> u16 {
        match site.admit(&req(method, headers)) {
            Ok(()) => 200,
            Err(r) => r.answer.status.as_u16(),
        }
    }

    #[test]
    fn hosts_parse_as_a_host_header_names_them() {
        for (s, host, port) in [
            ("localhost", "localhost", None),
            ("LocalHost:8080", "LocalHost", Some(8080)),
            ("127.0.0.1:1", "127.0.0.1", Some(1)),
            ("[::1]", "[::1]", None),
            ("[::1]:8080", "[::1]", Some(8080)),
            ("taskgate.internal", "taskgate.internal", None),
        ] {
            assert_eq!(host_and_port(s), Some((host, port)), "{s}");
        }
        for s in [
            "",
            ":80",
            "a b",
            "user@host",
            "host:",
            "host:x",
            "host:99999",
            "[::1",
            "[zz]",
            "[::1]x",
            "host/path",
            "a:1:2",
            "::1",
        ] {
            assert_eq!(host_and_port(s), None, "{s:?}");
        }
        assert_eq!(parse_allowed_host(" * "), Ok(AllowedHost::Any));
        assert_eq!(
            parse_allowed_host("TG.example:8443"),
            Ok(AllowedHost::Name {
                host: "tg.example".into(),
                port: Some(8443)
            })
        );
        assert!(parse_allowed_host("http://tg.example").is_err());
        assert!(parse_allowed_host("").is_err());
    }

    /// On loopback: loopback names only, unless allowed; elsewhere any
    /// name unless `--allowed-hosts` lists them (loopback names always).
    #[test]
    fn a_loopback_server_serves_loopback_names_and_the_allowed_ones() {
        let loopback = Site::default();
        for host in [
            "localhost",
            "localhost:8080",
            "LOCALHOST",
            "127.0.0.1:8080",
            "127.8.9.10",
            "[::1]:8080",
            "[0:0:0:0:0:0:0:1]",
        ] {
            assert_eq!(status(&loopback, "GET", &[("host", host)]), 200, "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:8080",
            "localhost.evil.example",
            "127.0.0.1.evil.example",
            "10.0.0.1",
            "[::2]",
            "",
            "a@localhost",
        ] {
            assert_eq!(status(&loopback, "GET", &[("host", host)]), 421, "{host:?}");
        }
        assert_eq!(status(&loopback, "GET", &[]), 200, "no Host: no browser");
        let two = [("host", "localhost"), ("host", "evil.example")];
        assert_eq!(status(&loopback, "GET", &two), 421, "every Host counts");
        let absolute = Request::builder()
            .uri("http://evil.example/v1/allocations")
            .header("host", "localhost")
            .body(axum::body::Body::empty())
            .unwrap();
        assert!(loopback.admit(&absolute).is_err(), "nor a target's host");

        let allowed = Site::new(
            true,
            vec![
                parse_allowed_host("tg.internal").unwrap(),
                parse_allowed_host("other.example:8443").unwrap(),
            ],
        );
        for (host, want) in [
            ("tg.internal", 200),
            ("TG.internal:9", 200),
            ("other.example:8443", 200),
            ("other.example:8080", 421),
            ("other.example", 421),
            ("evil.example", 421),
            ("localhost:1", 200),
        ] {
            assert_eq!(status(&allowed, "GET", &[("host", host)]), want, "{host}");
        }
        let any = Site::new(true, vec![AllowedHost::Any]);
        assert_eq!(status(&any, "GET", &[("host", "evil.example")]), 200);
        let open = Site::new(false, Vec::new());
        assert_eq!(status(&open, "GET", &[("host", "tg.example")]), 200);
        let listed = Site::new(false, vec![parse_allowed_host("tg.example").unwrap()]);
        assert_eq!(status(&listed, "GET", &[("host", "tg.example")]), 200);
        assert_eq!(status(&listed, "GET", &[("host", "evil.example")]), 421);
        assert_eq!(status(&listed, "GET", &[("host", "127.0.0.1:8080")]), 200);
    }

    /// Writes from another site's page are refused, however the browser
    /// says so; the server's own page, and clients that are not browsers,
    /// are not; reads never are.
    #[test]
    fn writes_from_another_site_are_refused() {
        let site = Site::default();
        let own = [("host", "localhost:8080")];
        for (origin, fetch_site, want) in [
            (Some("http://localhost:8080"), None, 200),
            (Some("https://localhost:8080"), None, 200),
            (Some("http://LOCALHOST:8080"), None, 200),
            (Some("http://localhost:8080"), Some("same-origin"), 200),
            (None, Some("same-origin"), 200),
            (None, Some("none"), 200),
            (None, None, 200),
            (Some("http://evil.example"), None, 403),
            (Some("http://localhost:8081"), None, 403),
            (Some("http://localhost"), None, 403),
            (Some("http://127.0.0.1:8080"), None, 403),
            (Some("null"), None, 403),
            (Some("chrome-extension://abc"), None, 403),
            (Some("localhost:8080"), None, 403),
            (Some("http://localhost:8080/ui"), None, 403),
            (None, Some("cross-site"), 403),
            (None, Some("same-site"), 403),
            (Some("http://localhost:8080"), Some("cross-site"), 403),
        ] {
            let mut headers = own.to_vec();
            headers.extend(origin.map(|o| ("origin", o)));
            headers.extend(fetch_site.map(|s| ("sec-fetch-site", s)));
            for method in ["POST", "PUT", "DELETE", "PATCH"] {
                assert_eq!(
                    status(&site, method, &headers),
                    want,
                    "{method} {headers:?}"
                );
            }
            for method in ["GET", "HEAD", "OPTIONS"] {
                assert_eq!(status(&site, method, &headers), 200, "{method} {headers:?}");
            }
        }
        let port_80 = [("host", "localhost"), ("origin", "http://localhost:80")];
        assert_eq!(status(&site, "POST", &port_80), 200, "default ports");
        let no_host = [("origin", "http://localhost")];
        assert_eq!(status(&site, "POST", &no_host), 403, "no Host to match");
        let two = [
            ("host", "localhost"),
            ("origin", "http://localhost"),
            ("origin", "http://evil.example"),
        ];
        assert_eq!(status(&site, "POST", &two), 403, "every Origin counts");
    }
}
