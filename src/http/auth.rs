//! Authentication and roles. Tokens are bearer secrets (`Authorization:
//! Bearer …` or `X-Taskgate-Token`); the server keeps only their SHA-256
//! hashes. Roles:
//!
//! - `operator`: everything;
//! - `agent`: read, register, report states, start-condition, restore —
//!   optionally only for allocation IDs with given prefixes;
//! - `reader`: GET only (optionally scoped the same way).
//!
//! A bearer token that is none of the configured secrets may be a JWT of a
//! trusted issuer (`--jwt-issuers`, `jwt.rs`): an identity with its
//! issuer's role and the prefixes its claims give.
//!
//! `/` (a pointer to `/ui`), `/v1/health`, `/openapi.json`, `/errors`,
//! `/docs` and the web view's files never need a token; `/metrics`
//! needs one unless `--public-metrics`.

use std::{
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use axum::{
    extract::Request,
    http::{HeaderValue, Method, StatusCode, header},
    response::{IntoResponse, Response},
};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::{
    error::ApiError,
    jwt::{Issuers, Judged, Reread},
    query::query_pairs,
};

/// The event stream, whose answer lasts as long as its client reads.
pub(crate) const STREAM_ROUTE: &str = "/v1/events";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Operator,
    Agent,
    Reader,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenFile {
    tokens: Vec<TokenEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenEntry {
    name: String,
    role: Role,
    /// Hex SHA-256 of the secret.
    sha256: String,
    #[serde(default)]
    alloc_prefixes: Vec<String>,
    /// The semaphores it may read and acquire (none by default; an
    /// operator token, every one).
    #[serde(default)]
    semaphore_prefixes: Vec<String>,
    /// Allocations within its prefixes it may register up to.
    #[serde(default)]
    max_allocations: Option<usize>,
    /// Waits it may hold at once (else `--max-waiters-per-token`).
    #[serde(default)]
    max_waiters: Option<usize>,
    /// Dependencies on other allocations its allocations (within its
    /// prefixes) may declare together (else, for an agent token,
    /// `--max-dependencies-per-token`).
    #[serde(default)]
    max_dependencies: Option<usize>,
}

/// One known token.
#[derive(Debug)]
pub struct Token {
    pub name: String,
    pub role: Role,
    hash: [u8; 32],
    /// Empty: every allocation.
    pub alloc_prefixes: Vec<String>,
    /// The semaphores it may read and acquire. Empty: none, unless it is
    /// an operator's (every one).
    pub semaphore_prefixes: Vec<String>,
    /// Its own limit on registered allocations within its prefixes.
    pub max_allocations: Option<usize>,
    /// Its limit on the dependencies on other allocations that the
    /// allocations within its prefixes declare together: its entry's, else
    /// for an agent token the server's default.
    pub max_dependencies: Option<usize>,
    /// Whether `max_dependencies` is its entry's own.
    own_max_dependencies: bool,
    max_waiters: Option<usize>,
    /// Its waits in progress.
    waiting: AtomicUsize,
}

impl Token {
    fn new(name: String, role: Role, hash: [u8; 32], alloc_prefixes: Vec<String>) -> Self {
        Self {
            name,
            role,
            hash,
            alloc_prefixes,
            semaphore_prefixes: Vec::new(),
            max_allocations: None,
            max_dependencies: (role == Role::Agent).then_some(DEFAULT_MAX_DEPENDENCIES_PER_TOKEN),
            own_max_dependencies: false,
            max_waiters: None,
            waiting: AtomicUsize::new(0),
        }
    }

    /// The identity of a trusted issuer's JWTs (`jwt.rs`), with the limits
    /// its issuer gives. It has no secret: it is never looked up by one.
    pub(super) fn identity(
        name: String,
        role: Role,
        alloc_prefixes: Vec<String>,
        max_allocations: Option<usize>,
        max_dependencies: Option<usize>,
        max_waiters: Option<usize>,
    ) -> Self {
        Self {
            max_allocations,
            max_dependencies,
            own_max_dependencies: true,
            max_waiters,
            ..Self::new(name, role, [0; 32], alloc_prefixes)
        }
    }

    /// Whether the token may act for a task of allocation `id` (report
    /// it): an agent or operator token whose prefixes cover it.
    pub fn may_act(&self, id: &str) -> bool {
        self.role != Role::Reader && self.may_read(id)
    }

    /// Whether the token may read allocation `id` (its prefixes cover it).
    pub fn may_read(&self, id: &str) -> bool {
        self.alloc_prefixes.is_empty()
            || self
                .alloc_prefixes
                .iter()
                .any(|p| id.starts_with(p.as_str()))
    }

    /// Whether the token may read and acquire semaphore `name`.
    pub fn may_use_semaphore(&self, name: &str) -> bool {
        self.role == Role::Operator
            || self
                .semaphore_prefixes
                .iter()
                .any(|p| name.starts_with(p.as_str()))
    }

    /// The registry's quota for this token's registrations, if it has one.
    pub fn quota(&self) -> Option<crate::registry::Quota<'_>> {
        if self.max_allocations.is_none() && self.max_dependencies.is_none() {
            return None;
        }
        Some(crate::registry::Quota {
            name: &self.name,
            prefixes: &self.alloc_prefixes,
            max_allocations: self.max_allocations,
            max_dependencies: self.max_dependencies,
        })
    }
}

/// The token a request was made with (a request extension, for handlers
/// that apply its quotas).
#[derive(Clone, Debug)]
pub struct Caller(pub Arc<Token>);

/// One of a token's waits in progress; the slot is given back on drop.
pub struct WaitSlot(Arc<Token>);

impl Drop for WaitSlot {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Waits one token may hold at once, unless configured otherwise.
pub const DEFAULT_MAX_WAITERS_PER_TOKEN: usize = 10_000;

/// Dependencies on other allocations that the allocations within an agent
/// token's prefixes may declare together, unless configured otherwise:
/// four allocations of 256 tasks, each task with the most dependencies a
/// task may declare (16).
pub const DEFAULT_MAX_DEPENDENCIES_PER_TOKEN: usize = 16_384;

/// The configured tokens and JWT issuers. Neither means authentication is
/// off.
#[derive(Debug)]
pub struct Auth {
    tokens: Vec<Arc<Token>>,
    /// The trusted issuers of JWTs (`--jwt-issuers`).
    jwt: Option<Arc<Issuers>>,
    /// `/metrics` without a token.
    pub public_metrics: bool,
    /// Waits a token may hold at once, unless its entry says otherwise.
    pub max_waiters_per_token: usize,
}

impl Default for Auth {
    fn default() -> Self {
        Self {
            tokens: Vec::new(),
            jwt: None,
            public_metrics: false,
            max_waiters_per_token: DEFAULT_MAX_WAITERS_PER_TOKEN,
        }
    }
}

fn sha256(secret: &[u8]) -> [u8; 32] {
    Sha256::digest(secret).into()
}

fn parse_hex(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, chunk) in s.as_bytes().chunks(2).enumerate() {
        let hex = std::str::from_utf8(chunk).ok()?;
        out[i] = u8::from_str_radix(hex, 16).ok()?;
    }
    Some(out)
}

/// Equal in time that does not depend on where the inputs differ.
fn same(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Auth {
    /// Tokens from a token file and/or one operator secret. Errors name the
    /// file and the entry.
    pub fn load(file: Option<&Path>, operator_secret: Option<&str>) -> Result<Self, String> {
        let mut tokens = Vec::new();
        if let Some(path) = file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read the token file {}: {e}", path.display()))?;
            let parsed: TokenFile = serde_json::from_str(&text)
                .map_err(|e| format!("token file {}: {e}", path.display()))?;
            for (i, t) in parsed.tokens.into_iter().enumerate() {
                let at = format!("token file {}: tokens[{i}] ({:?})", path.display(), t.name);
                let hash = parse_hex(&t.sha256.to_ascii_lowercase())
                    .ok_or_else(|| format!("{at}: sha256 must be 64 hex digits"))?;
                if t.role == Role::Operator && !t.alloc_prefixes.is_empty() {
                    return Err(format!(
                        "{at}: an operator token cannot be limited to prefixes"
                    ));
                }
                for p in &t.alloc_prefixes {
                    // A prefix is the start of an ID, so it must read as
                    // one: an empty prefix would mean every ID (leave the
                    // list out for that), and one with a character no ID
                    // holds would never match.
                    if let Err(e) = crate::lifecycle::AllocId::parse(p) {
                        return Err(format!(
                            "{at}: alloc_prefixes entry {p:?} {e}; a prefix is the start of \
                             an allocation ID (leave alloc_prefixes out for every ID)"
                        ));
                    }
                }
                for p in &t.semaphore_prefixes {
                    if let Err(e) = crate::lifecycle::SemName::parse(p) {
                        return Err(format!(
                            "{at}: semaphore_prefixes entry {p:?} {e}; a prefix is the start of \
                             a semaphore's name"
                        ));
                    }
                }
                let mut token = Token::new(t.name, t.role, hash, t.alloc_prefixes);
                token.semaphore_prefixes = t.semaphore_prefixes;
                token.max_allocations = t.max_allocations;
                token.max_waiters = t.max_waiters;
                if let Some(max) = t.max_dependencies {
                    token.max_dependencies = Some(max);
                    token.own_max_dependencies = true;
                }
                tokens.push(Arc::new(token));
            }
        }
        if let Some(secret) = operator_secret.filter(|s| !s.is_empty()) {
            tokens.push(Arc::new(Token::new(
                "operator (TASKGATE_OPERATOR_TOKEN)".into(),
                Role::Operator,
                sha256(secret.as_bytes()),
                Vec::new(),
            )));
        }
        Ok(Self {
            tokens,
            ..Self::default()
        })
    }

    /// Trusts the JWTs of these issuers besides the tokens.
    pub fn set_jwt_issuers(&mut self, issuers: Issuers) {
        self.jwt = Some(Arc::new(issuers));
    }

    /// Fetches the keys of the issuers that serve them at a URL (at start,
    /// in the background; `None` without any).
    pub fn fetch_jwt_keys(&self) -> Option<impl Future<Output = ()> + Send + 'static> {
        self.jwt.as_ref().map(|jwt| jwt.fetch_keys())
    }

    /// Sets the limit on dependencies of every agent token whose entry
    /// gives none (`--max-dependencies-per-token`), and of agent JWT
    /// identities whose issuer gives none. Before the tokens are shared
    /// (at start).
    pub fn set_max_dependencies_per_token(&mut self, max: usize) {
        if let Some(jwt) = &self.jwt {
            jwt.set_default_max_dependencies(max);
        }
        for token in &mut self.tokens {
            if let Some(t) = Arc::get_mut(token)
                && t.role == Role::Agent
                && !t.own_max_dependencies
            {
                t.max_dependencies = Some(max);
            }
        }
    }

    /// A wait slot of `token`, or `None` if it holds all it may.
    pub fn wait_slot(&self, token: &Arc<Token>) -> Option<WaitSlot> {
        let max = token.max_waiters.unwrap_or(self.max_waiters_per_token);
        let before = token.waiting.fetch_add(1, Ordering::Relaxed);
        let slot = WaitSlot(token.clone());
        (before < max).then_some(slot)
    }

    /// Whether any token or issuer is configured (else authentication is
    /// off).
    pub fn enabled(&self) -> bool {
        !self.tokens.is_empty() || self.jwt.is_some()
    }

    /// The token a secret belongs to. Every token is compared, match or
    /// not, so the time taken does not tell which one matched.
    fn identify(&self, hash: &[u8; 32]) -> Option<&Arc<Token>> {
        let mut found = None;
        for t in &self.tokens {
            if same(&t.hash, hash) && found.is_none() {
                found = Some(t);
            }
        }
        found
    }
}

/// What a route needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Need {
    Nothing,
    AnyToken,
    Read,
    AgentWrite,
    Operator,
}

fn need(method: &Method, route: &str, public_metrics: bool) -> Need {
    match route {
        "/" | "/v1/health" | "/openapi.json" | "/errors" => Need::Nothing,
        r if r == "/docs" || r.starts_with("/docs/") => Need::Nothing,
        // The web view's files; its data comes from the API, with a token.
        r if r == "/ui" || r.starts_with("/ui/") => Need::Nothing,
        "/metrics" if public_metrics => Need::Nothing,
        "/metrics" => Need::AnyToken,
        _ if *method == Method::GET || *method == Method::HEAD => Need::Read,
        "/v1/allocations/{alloc_id}" if *method == Method::PUT => Need::AgentWrite,
        "/v1/allocations/{alloc_id}/tasks/{task}/state"
        | "/v1/allocations/{alloc_id}/tasks/{task}/heartbeat"
        | "/v1/allocations/{alloc_id}/task-states"
        | "/v1/allocations/{alloc_id}/restore" => Need::AgentWrite,
        _ => Need::Operator,
    }
}

/// The secret a request presents: `Authorization: Bearer …`, else
/// `X-Taskgate-Token` (an `Authorization` header of another scheme, meant
/// for a proxy in front, does not hide it).
fn presented(req: &Request) -> Option<&str> {
    let h = req.headers();
    let bearer = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim());
    bearer.or_else(|| h.get("x-taskgate-token").and_then(|v| v.to_str().ok()))
}

/// The scheme of an `Authorization` header that is not `Bearer`, if one
/// was sent (at most 32 characters of it, for the answer).
fn other_scheme(req: &Request) -> Option<String> {
    let value = req.headers().get(header::AUTHORIZATION)?.to_str().ok()?;
    let scheme = value.split(' ').next().unwrap_or_default();
    (!scheme.eq_ignore_ascii_case("bearer")).then(|| scheme.chars().take(32).collect())
}

/// The allocation ID (or, for the list, the `prefix`) a request concerns.
fn scope_target(req: &Request, route: &str) -> Option<String> {
    if route == "/v1/allocations" || route == "/v1/semaphores" || route == STREAM_ROUTE {
        let pairs = query_pairs(req.uri().query())?;
        return Some(
            pairs
                .into_iter()
                .find(|(k, _)| k == "prefix")
                .map(|(_, v)| v)
                .unwrap_or_default(),
        );
    }
    // Decoded as the handler's path extractor decodes it: the scope is
    // checked on the ID the handler will use (`%74eam-a-1` is `team-a-1`).
    let raw = req.uri().path().split('/').nth(3)?;
    percent_encoding::percent_decode_str(raw)
        .decode_utf8()
        .ok()
        .map(|id| id.into_owned())
}

fn unauthorized(detail: &str) -> Response {
    let mut res = ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", detail).into_response();
    res.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"taskgate\""),
    );
    res
}

fn forbidden(detail: String) -> Response {
    ApiError::new(StatusCode::FORBIDDEN, "forbidden", detail).into_response()
}

/// Why `decide` let a request not through.
enum Refusal {
    /// The 401 or 403 to answer.
    Answer(Box<Response>),
    /// A JWT's issuer lacks the key it names: re-read the issuer's keys,
    /// then decide again.
    Reread(KeysToReread),
}

impl Refusal {
    /// The answer to a refused request. A decision after a re-read asks
    /// for none.
    fn into_answer(self) -> Box<Response> {
        match self {
            Refusal::Answer(res) => res,
            Refusal::Reread(_) => {
                Box::new(unauthorized("the keys of the JWT's issuer lack its key"))
            }
        }
    }
}

/// Whether a bearer token is shaped as a JWT (three dot-separated parts).
fn jwt_shaped(secret: &str) -> bool {
    secret.bytes().filter(|b| *b == b'.').count() == 2
}

/// What `Auth::check_now` and `Auth::check_after_reread` decide: `Ok` lets
/// the request through, with the token it was made with (none when
/// authentication is off or the route needs none); `Err` is the 401 or 403
/// to answer.
pub type Decision = Result<Option<Arc<Token>>, Box<Response>>;

/// A request `Auth::check_now` could not decide: its JWT names a key that
/// its issuer's keys lack, so they are re-read first
/// (`Auth::check_after_reread`).
pub struct KeysToReread {
    issuer: usize,
    generation: u64,
}

impl Auth {
    /// Decides a request without waiting, as nearly every one is.
    /// `route` is the matched route; unknown routes pass (they answer 404
    /// whoever asks: nothing is behind them). `Err` when the keys of the
    /// JWT's issuer must be re-read first: then `check_after_reread`. Two
    /// steps so that the wait, which takes the request (a borrowed request
    /// cannot wait: its body is not `Sync`), is a future of its own that
    /// the requests that do not need it do not carry.
    pub fn check_now(&self, req: &Request, route: Option<&str>) -> Result<Decision, KeysToReread> {
        match self.decide(req, route, Reread::NotYet) {
            Err(Refusal::Reread(keys)) => Err(keys),
            decided => Ok(decided.map_err(Refusal::into_answer)),
        }
    }

    /// Re-reads the keys of the JWT's issuer that `check_now` found lacking
    /// the key the token names, then decides; the request is given back.
    pub async fn check_after_reread(
        &self,
        req: Request,
        route: Option<&str>,
        keys: KeysToReread,
    ) -> (Request, Decision) {
        let reread = match &self.jwt {
            Some(jwt) => jwt.reread(keys.issuer, keys.generation).await,
            None => Reread::NotRead,
        };
        let decided = self.decide(&req, route, reread);
        (req, decided.map_err(Refusal::into_answer))
    }

    /// The decision of `check_now` and `check_after_reread`; `reread`:
    /// whether the keys of a JWT's issuer were re-read for it.
    fn decide(
        &self,
        req: &Request,
        route: Option<&str>,
        reread: Reread,
    ) -> Result<Option<Arc<Token>>, Refusal> {
        let answer = |res: Response| Refusal::Answer(Box::new(res));
        if !self.enabled() {
            return Ok(None);
        }
        let Some(route) = route else { return Ok(None) };
        let need = need(req.method(), route, self.public_metrics);
        if need == Need::Nothing {
            return Ok(None);
        }
        let Some(secret) = presented(req) else {
            tracing::info!(%route, method = %req.method(), "refused (401): no token");
            let detail = match other_scheme(req) {
                // A token sent under another scheme (`Token`, `Basic`) is
                // not read as one: say so, rather than that none was sent.
                Some(scheme) => format!(
                    "the Authorization header uses the scheme {scheme:?}; taskgate reads \
                     tokens from `Authorization: Bearer <token>` (or X-Taskgate-Token)"
                ),
                None => "a token is required (Authorization: Bearer <token>, or \
                         X-Taskgate-Token)"
                    .to_owned(),
            };
            return Err(answer(unauthorized(&detail)));
        };
        let hash = sha256(secret.as_bytes());
        let (token, subject) = match (self.identify(&hash), &self.jwt) {
            (Some(token), _) => (token.clone(), None),
            (None, Some(jwt)) if jwt_shaped(secret) => match jwt.judge(secret, &hash, reread) {
                Judged::Known(token, subject) => (token, Some(subject)),
                Judged::Reread { issuer, generation } => {
                    return Err(Refusal::Reread(KeysToReread { issuer, generation }));
                }
                Judged::Unauthorized(why) => {
                    tracing::info!(%route, method = %req.method(), "refused (401): JWT: {why}");
                    return Err(answer(unauthorized(&why)));
                }
                Judged::Forbidden(why) => {
                    tracing::info!(%route, method = %req.method(), "refused (403): JWT: {why}");
                    return Err(answer(forbidden(why)));
                }
                Judged::Unavailable(why) => {
                    tracing::info!(%route, method = %req.method(), "refused (503): JWT: {why}");
                    return Err(answer(
                        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "jwt_keys_unavailable", why)
                            .retry_later()
                            .into_response(),
                    ));
                }
            },
            (None, _) => {
                tracing::info!(%route, method = %req.method(), "refused (401): unknown token");
                return Err(answer(unauthorized("the token is not known")));
            }
        };
        // A JWT's subject is named beside its identity.
        let subject = subject.as_deref();
        let who = || match subject {
            Some(sub) => format!("{:?} (subject {sub:?})", token.name),
            None => format!("{:?}", token.name),
        };
        let allowed = match (need, token.role) {
            (Need::Nothing | Need::AnyToken, _) => true,
            (_, Role::Operator) => true,
            (Need::Read, Role::Agent | Role::Reader) => true,
            (Need::AgentWrite, Role::Agent) => true,
            (Need::AgentWrite, Role::Reader) | (Need::Operator, Role::Agent | Role::Reader) => {
                false
            }
        };
        if !allowed {
            tracing::info!(token = %token.name, subject, role = ?token.role, %route, method = %req.method(), "refused (403): the role does not allow it");
            return Err(answer(forbidden(format!(
                "token {} ({:?}) may not {} {route}",
                who(),
                token.role,
                req.method()
            ))));
        }
        if route == "/v1/semaphores"
            || route == "/v1/semaphores/{name}"
            || route == "/v1/barriers/{name}"
        {
            let target = scope_target(req, route).unwrap_or_default();
            let within = token.may_use_semaphore(&target)
                || (target.is_empty() && token.role == Role::Operator);
            if !within {
                let what = if route == "/v1/semaphores" {
                    "list semaphores with a `prefix` within".to_owned()
                } else if route == "/v1/barriers/{name}" {
                    format!("use barrier {target:?}, outside")
                } else {
                    format!("use semaphore {target:?}, outside")
                };
                tracing::info!(token = %token.name, subject, %route, method = %req.method(), target = %target, "refused (403): outside the token's semaphore prefixes");
                return Err(answer(forbidden(format!(
                    "token {} may only {what} its semaphore_prefixes {:?}",
                    who(),
                    token.semaphore_prefixes
                ))));
            }
        } else if !token.alloc_prefixes.is_empty() && need != Need::AnyToken {
            let target = scope_target(req, route).unwrap_or_default();
            if !token
                .alloc_prefixes
                .iter()
                .any(|p| target.starts_with(p.as_str()))
            {
                let what = if route == "/v1/allocations" {
                    "list with a `prefix` within".to_owned()
                } else if route == STREAM_ROUTE {
                    "follow events with a `prefix` within".to_owned()
                } else {
                    format!("use allocation {target:?}, outside")
                };
                tracing::info!(token = %token.name, subject, %route, method = %req.method(), target = %target, "refused (403): outside the token's prefixes");
                return Err(answer(forbidden(format!(
                    "token {} may only {what} its prefixes {:?}",
                    who(),
                    token.alloc_prefixes
                ))));
            }
        }
        if need != Need::Read && need != Need::AnyToken {
            tracing::info!(token = %token.name, subject, %route, method = %req.method(), "write by token");
        }
        Ok(Some(token))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_file_entries_are_checked_with_their_names() {
        let dir = std::env::temp_dir().join(format!("taskgate-auth-{}", fastrand::u64(..)));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("tokens.json");
        std::fs::write(
            &file,
            r#"{"tokens": [{"name": "ci", "role": "agent", "sha256": "zz", "alloc_prefixes": ["web-"]}]}"#,
        )
        .unwrap();
        let err = Auth::load(Some(&file), None).unwrap_err();
        assert!(
            err.contains("tokens[0] (\"ci\")") && err.contains("64 hex digits"),
            "{err}"
        );
        std::fs::write(
            &file,
            r#"{"tokens": [{"name": "x", "role": "admin", "sha256": ""}]}"#,
        )
        .unwrap();
        assert!(Auth::load(Some(&file), None).unwrap_err().contains("admin"));
        let hash: String = sha256(b"s3cret")
            .iter()
            .map(|b| format!("{b:02X}"))
            .collect();
        std::fs::write(
            &file,
            format!(r#"{{"tokens": [{{"name": "ci", "role": "agent", "sha256": "{hash}"}}]}}"#),
        )
        .unwrap();
        let auth = Auth::load(Some(&file), Some("op")).unwrap();
        assert_eq!(auth.identify(&sha256(b"s3cret")).unwrap().name, "ci");
        // A prefix is the start of an ID: an empty one, or one with a
        // character no ID holds, is refused (it would mean every ID, or
        // none).
        for (prefix, why) in [("", "must not be empty"), ("team-a/", "found '/'")] {
            std::fs::write(
                &file,
                format!(
                    r#"{{"tokens": [{{"name": "ci", "role": "agent", "sha256": "{hash}", "alloc_prefixes": ["web-", "{prefix}"]}}]}}"#
                ),
            )
            .unwrap();
            let err = Auth::load(Some(&file), None).unwrap_err();
            assert!(
                err.contains("tokens[0] (\"ci\")") && err.contains(why),
                "{err}"
            );
            assert!(err.contains(&format!("{prefix:?}")), "{err}");
        }
        assert_eq!(auth.identify(&sha256(b"op")).unwrap().role, Role::Operator);
        assert!(auth.identify(&sha256(b"nope")).is_none());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn routes_need_what_the_roles_table_says() {
        use Method as M;
        assert_eq!(need(&M::GET, "/v1/health", false), Need::Nothing);
        assert_eq!(need(&M::GET, "/", false), Need::Nothing);
        assert_eq!(need(&M::GET, "/metrics", false), Need::AnyToken);
        assert_eq!(need(&M::GET, "/metrics", true), Need::Nothing);
        assert_eq!(
            need(&M::GET, "/v1/allocations/{alloc_id}", false),
            Need::Read
        );
        assert_eq!(
            need(&M::PUT, "/v1/allocations/{alloc_id}", false),
            Need::AgentWrite
        );
        assert_eq!(
            need(&M::DELETE, "/v1/allocations/{alloc_id}", false),
            Need::Operator
        );
        assert_eq!(
            need(&M::POST, "/v1/allocations/{alloc_id}/restart", false),
            Need::Operator
        );
        assert_eq!(
            need(&M::POST, "/v1/allocations/{alloc_id}/restore", false),
            Need::AgentWrite
        );
    }

    /// What `check_now` (and `check_after_reread`) log, and the answer's
    /// status.
    fn logged(auth: &Auth, method: &str, uri: &str, secret: Option<&str>) -> (String, u16) {
        #[derive(Clone, Default)]
        struct Buf(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let writer = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let mut req = Request::builder().method(method).uri(uri);
        if let Some(s) = secret {
            req = req.header(header::AUTHORIZATION, format!("Bearer {s}"));
        }
        let req = req.body(axum::body::Body::empty()).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let route = Some("/v1/allocations/{alloc_id}");
        let answer = tracing::subscriber::with_default(subscriber, || {
            auth.check_now(&req, route).unwrap_or_else(|keys| {
                runtime
                    .block_on(auth.check_after_reread(req, route, keys))
                    .1
            })
        });
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        (text, answer.map_or_else(|r| r.status().as_u16(), |_| 200))
    }

    /// Writes are logged with the token's name at info; refusals with
    /// their reason; the secret never.
    #[test]
    fn writes_and_refusals_leave_an_audit_trail_without_the_secret() {
        let mut auth = Auth::load(None, Some("operator-secret-of-enough-bytes")).unwrap();
        auth.tokens.push(Arc::new(Token::new(
            "web-agents".into(),
            Role::Agent,
            sha256(b"agent-secret"),
            vec!["web-".into()],
        )));
        let cases = [
            (
                "PUT",
                "/v1/allocations/web-1",
                Some("agent-secret"),
                200,
                "write by token",
            ),
            (
                "DELETE",
                "/v1/allocations/web-1",
                Some("agent-secret"),
                403,
                "the role does not allow it",
            ),
            (
                "PUT",
                "/v1/allocations/db-1",
                Some("agent-secret"),
                403,
                "outside the token's prefixes",
            ),
            (
                "PUT",
                "/v1/allocations/web-1",
                Some("guess"),
                401,
                "unknown token",
            ),
            ("PUT", "/v1/allocations/web-1", None, 401, "no token"),
        ];
        for (method, uri, secret, status, says) in cases {
            let (text, got) = logged(&auth, method, uri, secret);
            assert_eq!(got, status, "{method} {uri}");
            assert!(
                text.contains(" INFO ") && text.contains(says),
                "{method} {uri}: {text}"
            );
            if secret == Some("agent-secret") {
                assert!(text.contains("web-agents"), "{text}");
            }
            assert!(
                !text.contains("agent-secret") && !text.contains("guess"),
                "{text}"
            );
        }
        let (text, _) = logged(&auth, "GET", "/v1/allocations/web-1", Some("agent-secret"));
        assert!(text.is_empty(), "reads are not logged at info: {text}");
    }

    /// A JWT's writes and refusals are logged with its identity and
    /// subject, and why; the token never.
    #[test]
    fn a_jwt_leaves_the_same_trail_without_the_token() {
        use super::super::jwt::testing::issuers;
        let (_dir, key, jwt) = issuers(serde_json::json!({"name": "k8s",
                                                          "alloc_prefixes": ["web-"]}));
        let mut auth = Auth::default();
        auth.set_jwt_issuers(jwt.unwrap());
        let now = jsonwebtoken::get_current_timestamp();
        let claims = |exp: u64| {
            serde_json::json!({"iss": "https://iss", "aud": "taskgate", "exp": exp,
                               "sub": "system:serviceaccount:web:agent"})
        };
        let valid = key.sign(&claims(now + 600));
        let expired = key.sign(&claims(now - 600));
        let cases = [
            (
                "PUT",
                "/v1/allocations/web-1",
                &valid,
                200,
                "write by token",
            ),
            (
                "PUT",
                "/v1/allocations/db-1",
                &valid,
                403,
                "outside the token's prefixes",
            ),
            (
                "PUT",
                "/v1/allocations/web-1",
                &expired,
                401,
                "the JWT expired",
            ),
        ];
        for (method, uri, token, status, says) in cases {
            let (text, got) = logged(&auth, method, uri, Some(token));
            assert_eq!(got, status, "{method} {uri}: {text}");
            assert!(text.contains(" INFO ") && text.contains(says), "{text}");
            if status != 401 {
                assert!(
                    text.contains("jwt:k8s") && text.contains("system:serviceaccount:web:agent"),
                    "{text}"
                );
            }
            for part in token.split('.') {
                assert!(!text.contains(part), "{text}");
            }
        }
    }

    /// What a caller writes into a JWT's header or claims reaches the log
    /// and the answer only quoted (one log line, whatever it holds) and
    /// cut short (a 40 KB `iss` is not logged whole).
    #[test]
    fn a_jwt_s_contents_cannot_forge_or_flood_the_log() {
        use super::super::jwt::testing::issuers;
        let (_dir, _, jwt) = issuers(serde_json::json!({}));
        let mut auth = Auth::default();
        auth.set_jwt_issuers(jwt.unwrap());
        // Anyone's key: the header is read before the signature is checked.
        let key = super::super::jwt::testing::TestKey::new("k1");
        let now = jsonwebtoken::get_current_timestamp();
        let claims = serde_json::json!({"iss": "https://iss", "aud": "taskgate", "exp": now + 600});
        let forged = "\n2030-01-01T00:00:00Z  INFO write by token token=\"admin\"";
        let long = "x".repeat(40_000);
        let mut long_iss = claims.clone();
        long_iss["iss"] = serde_json::json!(long);
        let tokens = [
            // Header fields the JWT library reads itself (its error quotes
            // what it could not read).
            key.sign_with(
                &serde_json::json!({"alg": "ES256", "kid": "k1", "jwk": {"kty": forged}}),
                &claims,
            ),
            key.sign_with(
                &serde_json::json!({"alg": "ES256", "kid": "k1", "x5c": long}),
                &claims,
            ),
            key.sign_with(&serde_json::json!({"alg": forged, "kid": "k1"}), &claims),
            key.sign_with(&serde_json::json!({"alg": "ES256", "kid": forged}), &claims),
            key.sign_with(&serde_json::json!({"alg": long, "kid": "k1"}), &claims),
            key.sign_with(&serde_json::json!({"alg": "ES256", "kid": long}), &claims),
            key.sign(&long_iss),
        ];
        for token in &tokens {
            let (text, status) = logged(&auth, "PUT", "/v1/allocations/web-1", Some(token));
            // 503 for a key unknown while the keys may not be read again.
            assert!(status == 401 || status == 503, "{text}");
            assert!(!text.contains("\n2030"), "a line of the caller's: {text}");
            let refusal = text.lines().find(|l| l.contains("refused (")).unwrap();
            assert!(refusal.len() < 1_000, "{} bytes logged", refusal.len());
        }
    }
}
