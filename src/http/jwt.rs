//! Workload identities: a bearer token that is a JWT signed by an issuer of
//! `--jwt-issuers` (a Kubernetes service-account token, a Nomad workload
//! identity, a SPIFFE JWT-SVID, a CI job's OIDC token) is verified offline
//! against that issuer's public keys (a JWKS, from a file or a URL), and
//! becomes an identity of the issuer's role, scoped to the allocation
//! prefixes its configured claim names.
//!
//! - Algorithms: RS256 and ES256 only; `alg: none`, HMAC and every other
//!   algorithm are refused, and a key is used only for the algorithm it is
//!   (an RSA key never checks an ES256 token, a key that declares an `alg`
//!   only that one).
//! - Claims: `iss` selects the issuer; `aud` must hold its audience; `exp`
//!   is required; `exp` and `nbf` are checked with `LEEWAY`.
//! - Keys: read at start (a file) or fetched in the background (a URL); a
//!   token naming a key (`kid`) the issuer's set lacks makes the server
//!   re-read the set, at most once per `MIN_REREAD` per issuer, so a
//!   rotation needs no restart; a re-read that fails keeps the keys it had.
//! - A verified token is kept (by its SHA-256) until it expires or its
//!   issuer's keys change, so each agent's requests after its first cost a
//!   hash and a lookup instead of a signature check.
//!
//! Signatures are checked by `ring` (the TLS stack's crypto), plugged into
//! `jsonwebtoken` as its crypto provider: no second crypto library.

use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    sync::{
        Arc, Mutex, RwLock, Weak,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use base64::Engine;
use jsonwebtoken::{
    Algorithm, DecodingKey, DecodingKeyKind, Validation,
    crypto::{CryptoProvider, JwtVerifier, KeyUtils},
    errors::{Error as JwtError, ErrorKind},
    jwk::{AlgorithmParameters, EllipticCurve, Jwk, KeyAlgorithm, PublicKeyUse},
};
use serde::Deserialize;
use serde_json::Value;

use super::auth::{Role, Token};
use crate::units::format_duration;

/// Clock skew allowed on `exp` and `nbf`.
pub const LEEWAY: Duration = Duration::from_secs(30);

/// An issuer's keys are re-read for an unknown `kid` at most this often.
pub const MIN_REREAD: Duration = Duration::from_secs(30);

/// How long a fetch of a JWKS URL may take (connecting: `CONNECT_TIMEOUT`).
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest JWKS read (a set of a few keys is a few KiB).
const MAX_JWKS_BYTES: usize = 1024 * 1024;

/// The most allocation prefixes one token's claim may give.
const MAX_CLAIM_PREFIXES: usize = 64;

/// Verified tokens kept at most; past it the expired ones go, and if that
/// is not enough, all of them.
const MAX_VERIFIED: usize = 10_000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct IssuersFile {
    issuers: Vec<IssuerEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct IssuerEntry {
    /// The `iss` claim of its tokens, exactly.
    issuer: String,
    /// A short name for logs and answers (else the issuer).
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    jwks_file: Option<PathBuf>,
    #[serde(default)]
    jwks_url: Option<String>,
    /// PEM CA bundle that signed the `jwks_url` server's certificate
    /// (else the system's roots).
    #[serde(default)]
    jwks_ca_file: Option<PathBuf>,
    /// What `aud` must hold.
    audience: String,
    role: Role,
    /// The claim whose value(s) are the allocation prefixes: a top-level
    /// claim's name, or a JSON pointer (`/kubernetes.io/namespace`).
    #[serde(default)]
    alloc_prefixes_claim: Option<String>,
    /// Appended to each of the claim's values.
    #[serde(default)]
    alloc_prefix_suffix: Option<String>,
    /// The same prefixes for every token of the issuer.
    #[serde(default)]
    alloc_prefixes: Option<Vec<String>>,
    /// The semaphores every token of the issuer may read and acquire
    /// (none by default).
    #[serde(default)]
    semaphore_prefixes: Vec<String>,
    /// Claims a token must carry with exactly these values (a claim's name,
    /// or a JSON pointer into one, → a string): which of the issuer's
    /// workloads are taskgate's (`repository_owner` of a CI issuer, the
    /// `/kubernetes.io/serviceaccount/name` of a cluster).
    #[serde(default)]
    required_claims: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    max_allocations: Option<usize>,
    #[serde(default)]
    max_waiters: Option<usize>,
    #[serde(default)]
    max_dependencies: Option<usize>,
}

/// A claim by its name, or a JSON pointer into the claims (`/a/b`).
fn claim_at<'a>(claims: &'a Value, path: &str) -> Option<&'a Value> {
    if path.starts_with('/') {
        claims.pointer(path)
    } else {
        claims.get(path)
    }
}

/// Which allocations an issuer's tokens may use.
#[derive(Debug)]
enum Scope {
    Every,
    Fixed(Vec<String>),
    Claim { path: String, suffix: String },
}

/// Where an issuer's keys come from.
#[derive(Debug)]
enum Source {
    File(PathBuf),
    Url {
        url: String,
        client: reqwest::Client,
    },
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::File(path) => write!(f, "{}", path.display()),
            Source::Url { url, .. } => f.write_str(url),
        }
    }
}

/// One usable public key.
struct Key {
    kid: Option<String>,
    alg: Algorithm,
    decoding: DecodingKey,
}

/// The state of an issuer's re-reads.
#[derive(Default)]
struct Reads {
    /// The last re-read for an unknown key (the start's read is not one).
    last_reread: Option<Instant>,
    /// Why the last read failed, if it did (cleared by one that succeeds).
    last_error: Option<String>,
}

struct Issuer {
    issuer: String,
    /// For logs and answers: `jwt:<name>`.
    label: String,
    audience: String,
    role: Role,
    scope: Scope,
    /// (claim or pointer, the value it must hold), in name order.
    required: Vec<(String, String)>,
    semaphore_prefixes: Vec<String>,
    max_allocations: Option<usize>,
    max_waiters: Option<usize>,
    max_dependencies: Option<usize>,
    source: Source,
    /// The validation of each algorithm (issuer, audience, leeway, `exp`).
    rs256: Validation,
    es256: Validation,
    keys: RwLock<Arc<Vec<Key>>>,
    /// Counts key-set changes (0: never read).
    generation: AtomicU64,
    reads: Mutex<Reads>,
    /// One read at a time; those waiting see its keys.
    reading: tokio::sync::Mutex<()>,
}

/// A verified token, kept.
struct Verified {
    token: Arc<Token>,
    subject: Arc<str>,
    issuer: usize,
    /// The issuer's key generation it was verified under.
    generation: u64,
    exp: u64,
}

/// An identity: its issuer's index and its allocation prefixes.
type IdentityKey = (usize, Vec<String>);

/// The trusted issuers and what they verified.
pub struct Issuers {
    issuers: Vec<Arc<Issuer>>,
    verified: Mutex<HashMap<[u8; 32], Verified>>,
    /// One token per (issuer, prefixes): its identities share its waits.
    identities: Mutex<HashMap<IdentityKey, Weak<Token>>>,
    /// `--max-dependencies-per-token`, for agent identities whose issuer
    /// gives no `max_dependencies`.
    default_max_dependencies: AtomicUsize,
}

impl std::fmt::Debug for Issuers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.issuers.iter().map(|i| &i.issuer))
            .finish()
    }
}

/// What a JWT is judged.
pub(super) enum Judged {
    /// Verified: the identity, and the token's subject for the logs.
    Known(Arc<Token>, Arc<str>),
    /// 401, saying why.
    Unauthorized(String),
    /// 403: verified, but it may use no allocation.
    Forbidden(String),
    /// 503: the issuer's keys lack the token's key, and could not be read
    /// again for it (they never could be, the read failed, or the last was
    /// less than `MIN_REREAD` ago): the key may be new, so the token may be
    /// good once they are. Saying why.
    Unavailable(String),
    /// The issuer's keys lack the token's key: re-read them (see
    /// `Issuers::reread`) and judge it again.
    Reread { issuer: usize, generation: u64 },
}

/// Whether an issuer's keys were read again for a token they lacked the key
/// of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reread {
    /// Not asked yet: a key the issuer lacks asks for a re-read.
    NotYet,
    /// They were read after the token was first judged: a key they lack
    /// is not the issuer's (401).
    Read,
    /// They could not be (see `Judged::Unavailable`).
    NotRead,
}

impl Issuers {
    /// The issuers of a `--jwt-issuers` file, their key files read. A
    /// `jwks_url` is not fetched here (see `fetch_keys`). Errors name the
    /// file, the entry and what to do.
    pub fn load(path: &std::path::Path) -> Result<Self, String> {
        let _ = RING.install_default();
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the JWT issuers file {}: {e}", path.display()))?;
        let parsed: IssuersFile = serde_json::from_str(&text)
            .map_err(|e| format!("JWT issuers file {}: {e}", path.display()))?;
        if parsed.issuers.is_empty() {
            return Err(format!(
                "JWT issuers file {}: `issuers` is empty; name at least one issuer, or leave \
                 --jwt-issuers out",
                path.display()
            ));
        }
        let mut seen = HashSet::new();
        let mut issuers = Vec::new();
        for (i, entry) in parsed.issuers.into_iter().enumerate() {
            let at = format!(
                "JWT issuers file {}: issuers[{i}] ({:?})",
                path.display(),
                entry.issuer
            );
            if !seen.insert(entry.issuer.clone()) {
                return Err(format!(
                    "{at}: this issuer is named twice; give each issuer one entry"
                ));
            }
            let issuer = Issuer::new(entry, &at)?;
            if let Source::File(file) = &issuer.source {
                let bytes = std::fs::read(file)
                    .map_err(|e| format!("{at}: cannot read jwks_file {}: {e}", file.display()))?;
                let keys = parse_jwks(&bytes, &issuer.label)
                    .map_err(|e| format!("{at}: jwks_file {}: {e}", file.display()))?;
                issuer.replace_keys(keys);
            }
            issuers.push(Arc::new(issuer));
        }
        Ok(Self {
            issuers,
            verified: Mutex::default(),
            identities: Mutex::default(),
            default_max_dependencies: AtomicUsize::new(
                super::auth::DEFAULT_MAX_DEPENDENCIES_PER_TOKEN,
            ),
        })
    }

    /// Sets `--max-dependencies-per-token` for agent identities.
    pub fn set_default_max_dependencies(&self, max: usize) {
        self.default_max_dependencies.store(max, Ordering::Relaxed);
    }

    /// Fetches the keys of every `jwks_url` issuer (at start, in the
    /// background). One that cannot be fetched is said at warn; its tokens
    /// are refused (401) until a later fetch succeeds.
    pub fn fetch_keys(&self) -> impl Future<Output = ()> + Send + 'static {
        let urls: Vec<Arc<Issuer>> = self
            .issuers
            .iter()
            .filter(|i| matches!(i.source, Source::Url { .. }))
            .cloned()
            .collect();
        async move {
            for issuer in urls {
                let _reading = issuer.reading.lock().await;
                if issuer.generation.load(Ordering::Acquire) == 0 {
                    issuer.read().await;
                }
            }
        }
    }

    /// Judges a bearer token shaped as a JWT. `hash` is its SHA-256;
    /// `reread` says whether its issuer's keys were re-read for it.
    pub(super) fn judge(&self, token: &str, hash: &[u8; 32], reread: Reread) -> Judged {
        let now = jsonwebtoken::get_current_timestamp();
        if let Some(known) = self.known(hash, now) {
            return known;
        }
        let (header, claims) = match peek(token) {
            Ok(parts) => parts,
            Err(why) => return Judged::Unauthorized(why),
        };
        let alg = match header.alg.as_str() {
            "RS256" => Algorithm::RS256,
            "ES256" => Algorithm::ES256,
            "none" => {
                return Judged::Unauthorized(
                    "the JWT is unsigned (alg \"none\"); taskgate accepts only signed tokens \
                     (RS256, ES256)"
                        .into(),
                );
            }
            other => {
                return Judged::Unauthorized(format!(
                    "the JWT's algorithm {} is not accepted; taskgate accepts RS256 and ES256",
                    quoted(other)
                ));
            }
        };
        let Some(iss) = claims.get("iss").and_then(Value::as_str) else {
            return Judged::Unauthorized(
                "the JWT has no `iss` claim, so no issuer of this server can vouch for it".into(),
            );
        };
        let Some(index) = self.issuers.iter().position(|i| i.issuer == iss) else {
            return Judged::Unauthorized(format!(
                "the JWT's issuer {} is not one this server trusts (--jwt-issuers)",
                quoted(iss)
            ));
        };
        let issuer = &self.issuers[index];
        let generation = issuer.generation.load(Ordering::Acquire);
        let keys = issuer.keys.read().expect("keys lock").clone();
        let key = match header.kid.as_deref() {
            Some(kid) => keys.iter().find(|k| k.kid.as_deref() == Some(kid)),
            None => {
                let mut of_alg = keys.iter().filter(|k| k.alg == alg);
                match (of_alg.next(), of_alg.next()) {
                    (Some(only), None) => Some(only),
                    (None, _) => None,
                    (Some(_), Some(_)) => {
                        return Judged::Unauthorized(format!(
                            "the JWT names no key (`kid`) and issuer {} has several {alg:?} keys",
                            issuer.label
                        ));
                    }
                }
            }
        };
        let Some(key) = key else {
            let why = || issuer.no_key(header.kid.as_deref(), generation);
            return match reread {
                Reread::NotYet => Judged::Reread {
                    issuer: index,
                    generation,
                },
                Reread::Read => Judged::Unauthorized(why()),
                Reread::NotRead => Judged::Unavailable(format!(
                    "{}; the key may be newer than the keys read: retry",
                    why()
                )),
            };
        };
        if key.alg != alg {
            return Judged::Unauthorized(format!(
                "the JWT says {alg:?}, but key {:?} of issuer {} is an {:?} key",
                key.kid.as_deref().unwrap_or_default(),
                issuer.label,
                key.alg
            ));
        }
        let validation = if alg == Algorithm::RS256 {
            &issuer.rs256
        } else {
            &issuer.es256
        };
        if let Err(e) = jsonwebtoken::decode::<Value>(token, &key.decoding, validation) {
            return Judged::Unauthorized(refusal(&e, issuer, &claims, now));
        }
        if let Err(why) = issuer.required(&claims) {
            return Judged::Forbidden(why);
        }
        let prefixes = match issuer.prefixes(&claims) {
            Ok(prefixes) => prefixes,
            Err(why) => return Judged::Forbidden(why),
        };
        let subject: Arc<str> = match claims.get("sub").and_then(Value::as_str) {
            Some(sub) => sub.chars().take(256).collect::<String>().into(),
            None => "(no sub)".into(),
        };
        let token = self.identity(index, prefixes);
        // `exp` is required and was checked: a number.
        let exp = claims
            .get("exp")
            .and_then(Value::as_f64)
            .map_or(0, |e| e as u64);
        self.keep(
            *hash,
            Verified {
                token: token.clone(),
                subject: subject.clone(),
                issuer: index,
                generation,
                exp,
            },
            now,
        );
        Judged::Known(token, subject)
    }

    /// A verified token that is still valid under the keys it was verified
    /// with.
    fn known(&self, hash: &[u8; 32], now: u64) -> Option<Judged> {
        let mut verified = self.verified.lock().expect("verified lock");
        let v = verified.get(hash)?;
        let current = self.issuers[v.issuer].generation.load(Ordering::Acquire);
        if now <= v.exp.saturating_add(LEEWAY.as_secs()) && v.generation == current {
            return Some(Judged::Known(v.token.clone(), v.subject.clone()));
        }
        verified.remove(hash);
        None
    }

    fn keep(&self, hash: [u8; 32], v: Verified, now: u64) {
        let mut verified = self.verified.lock().expect("verified lock");
        if verified.len() >= MAX_VERIFIED {
            verified.retain(|_, v| now <= v.exp.saturating_add(LEEWAY.as_secs()));
            if verified.len() >= MAX_VERIFIED {
                verified.clear();
            }
        }
        verified.insert(hash, v);
    }

    /// The identity of an issuer's tokens with these prefixes: one token
    /// object while any holds it, so their waits are counted together.
    fn identity(&self, index: usize, prefixes: Vec<String>) -> Arc<Token> {
        let mut identities = self.identities.lock().expect("identities lock");
        let key = (index, prefixes);
        if let Some(token) = identities.get(&key).and_then(Weak::upgrade) {
            return token;
        }
        let issuer = &self.issuers[index];
        let max_dependencies = issuer.max_dependencies.or_else(|| {
            (issuer.role == Role::Agent)
                .then(|| self.default_max_dependencies.load(Ordering::Relaxed))
        });
        let mut token = Token::identity(
            issuer.label.clone(),
            issuer.role,
            key.1.clone(),
            issuer.max_allocations,
            max_dependencies,
            issuer.max_waiters,
        );
        token.semaphore_prefixes = issuer.semaphore_prefixes.clone();
        let token = Arc::new(token);
        if identities.len() >= MAX_VERIFIED {
            identities.retain(|_, t| t.strong_count() > 0);
        }
        identities.insert(key, Arc::downgrade(&token));
        token
    }

    /// Re-reads an issuer's keys for a token whose key it lacked (when it
    /// looked, at key `generation`), unless they changed since or were
    /// re-read less than `MIN_REREAD` ago. Runs apart from the request, so
    /// a client that goes away does not cut it short. `Read` if the keys
    /// were read (by it or another) since the token was first judged.
    pub(super) async fn reread(&self, index: usize, generation: u64) -> Reread {
        let issuer = self.issuers[index].clone();
        let work = tokio::spawn(async move {
            let _reading = issuer.reading.lock().await;
            if issuer.generation.load(Ordering::Acquire) != generation {
                return;
            }
            {
                let mut reads = issuer.reads.lock().expect("reads lock");
                if reads
                    .last_reread
                    .is_some_and(|at| at.elapsed() < MIN_REREAD)
                {
                    return;
                }
                reads.last_reread = Some(Instant::now());
            }
            issuer.read().await;
        });
        let _ = work.await;
        if self.issuers[index].generation.load(Ordering::Acquire) == generation {
            Reread::NotRead
        } else {
            Reread::Read
        }
    }
}

impl Issuer {
    fn new(e: IssuerEntry, at: &str) -> Result<Self, String> {
        if e.issuer.is_empty() {
            return Err(format!("{at}: `issuer` must not be empty"));
        }
        if e.audience.is_empty() {
            return Err(format!(
                "{at}: `audience` must not be empty (the `aud` its tokens are made for, such \
                 as \"taskgate\")"
            ));
        }
        let source = match (e.jwks_file, e.jwks_url) {
            (Some(file), None) => {
                if e.jwks_ca_file.is_some() {
                    return Err(format!("{at}: jwks_ca_file goes with jwks_url only"));
                }
                Source::File(file)
            }
            (None, Some(url)) => {
                // Said without the URL: it would show the password.
                if reqwest::Url::parse(&url)
                    .is_ok_and(|u| !u.username().is_empty() || u.password().is_some())
                {
                    return Err(format!(
                        "{at}: jwks_url must hold no user or password (`user:password@`): \
                         taskgate fetches the keys anonymously, and logs the URL"
                    ));
                }
                Source::Url {
                    client: jwks_client(&url, e.jwks_ca_file.as_deref())
                        .map_err(|why| format!("{at}: jwks_url {url:?}: {why}"))?,
                    url,
                }
            }
            _ => {
                return Err(format!(
                    "{at}: give exactly one of jwks_file (a JWKS saved to a file) and jwks_url \
                     (where the issuer serves it)"
                ));
            }
        };
        if e.alloc_prefix_suffix.is_some() && e.alloc_prefixes_claim.is_none() {
            return Err(format!(
                "{at}: alloc_prefix_suffix goes with alloc_prefixes_claim"
            ));
        }
        for p in &e.semaphore_prefixes {
            if let Err(err) = crate::lifecycle::SemName::parse(p) {
                return Err(format!(
                    "{at}: semaphore_prefixes entry {p:?} {err}; a prefix is the start of a \
                     semaphore's name"
                ));
            }
        }
        let scoped = e.alloc_prefixes_claim.is_some() || e.alloc_prefixes.is_some();
        if e.role == Role::Operator && scoped {
            return Err(format!(
                "{at}: an operator identity cannot be limited to prefixes"
            ));
        }
        let scope = match (e.alloc_prefixes_claim, e.alloc_prefixes) {
            (Some(_), Some(_)) => {
                return Err(format!(
                    "{at}: give alloc_prefixes_claim (prefixes from each token) or \
                     alloc_prefixes (the same for every token), not both"
                ));
            }
            (Some(path), None) => {
                if path.is_empty() || path == "/" {
                    return Err(format!(
                        "{at}: alloc_prefixes_claim must name a claim (`nomad_namespace`) or \
                         point into one (`/kubernetes.io/namespace`)"
                    ));
                }
                let suffix = e.alloc_prefix_suffix.unwrap_or_default();
                if let Some(bad) = suffix
                    .chars()
                    .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
                {
                    return Err(format!(
                        "{at}: alloc_prefix_suffix {suffix:?} has {bad:?}, which no allocation \
                         ID holds (A-Z a-z 0-9 . _ -)"
                    ));
                }
                Scope::Claim { path, suffix }
            }
            (None, Some(prefixes)) => {
                if prefixes.is_empty() {
                    return Err(format!(
                        "{at}: alloc_prefixes is empty; leave it out for every allocation"
                    ));
                }
                for p in &prefixes {
                    if let Err(e) = crate::lifecycle::AllocId::parse(p) {
                        return Err(format!(
                            "{at}: alloc_prefixes entry {p:?} {e}; a prefix is the start of an \
                             allocation ID"
                        ));
                    }
                }
                Scope::Fixed(prefixes)
            }
            (None, None) => Scope::Every,
        };
        for (claim, value) in &e.required_claims {
            if claim.is_empty() || claim == "/" || value.is_empty() {
                return Err(format!(
                    "{at}: required_claims {claim:?}: {value:?}: name a claim (or point into \
                     one) and the non-empty value it must hold"
                ));
            }
        }
        let required: Vec<(String, String)> = e.required_claims.into_iter().collect();
        let validation = |alg| {
            let mut v = Validation::new(alg);
            v.leeway = LEEWAY.as_secs();
            v.validate_nbf = true;
            v.set_issuer(&[&e.issuer]);
            v.set_audience(&[&e.audience]);
            v.set_required_spec_claims(&["exp", "iss", "aud"]);
            v
        };
        Ok(Self {
            label: format!("jwt:{}", e.name.as_deref().unwrap_or(&e.issuer)),
            rs256: validation(Algorithm::RS256),
            es256: validation(Algorithm::ES256),
            issuer: e.issuer,
            audience: e.audience,
            role: e.role,
            scope,
            required,
            semaphore_prefixes: e.semaphore_prefixes,
            max_allocations: e.max_allocations,
            max_waiters: e.max_waiters,
            max_dependencies: e.max_dependencies,
            source,
            keys: RwLock::new(Arc::new(Vec::new())),
            generation: AtomicU64::new(0),
            reads: Mutex::default(),
            reading: tokio::sync::Mutex::new(()),
        })
    }

    fn replace_keys(&self, keys: Vec<Key>) {
        *self.keys.write().expect("keys lock") = Arc::new(keys);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Reads the keys from the source; a failure keeps the keys it had and
    /// is logged (and kept, for the answers to tokens it leaves unknown).
    async fn read(&self) {
        let read = match &self.source {
            Source::File(path) => {
                let path = path.clone();
                tokio::task::spawn_blocking(move || std::fs::read(path))
                    .await
                    .map_err(|e| e.to_string())
                    .and_then(|read| read.map_err(|e| e.to_string()))
            }
            Source::Url { url, client } => fetch(client, url).await,
        };
        match read.and_then(|bytes| parse_jwks(&bytes, &self.label)) {
            Ok(keys) => {
                let kids: Vec<&str> = keys.iter().filter_map(|k| k.kid.as_deref()).collect();
                tracing::info!(issuer = %self.label, source = %self.source, keys = ?kids, "read the issuer's keys");
                self.replace_keys(keys);
                self.reads.lock().expect("reads lock").last_error = None;
            }
            Err(why) => {
                let had = self.generation.load(Ordering::Acquire) > 0;
                tracing::warn!(
                    issuer = %self.label,
                    source = %self.source,
                    "cannot read the issuer's keys: {why}; {}",
                    if had {
                        "keeping the keys read before"
                    } else {
                        "its tokens are refused until they can be read"
                    }
                );
                self.reads.lock().expect("reads lock").last_error = Some(why);
            }
        }
    }

    /// Why a token's key is not among the keys, after a re-read was asked
    /// for (the answer says what the server did, not what it read).
    fn no_key(&self, kid: Option<&str>, generation: u64) -> String {
        let reads = self.reads.lock().expect("reads lock");
        let key = match kid {
            Some(kid) => format!("no key {}", quoted(kid)),
            None => "no key of the JWT's algorithm".to_owned(),
        };
        if generation == 0 {
            return format!(
                "the keys of issuer {} are not available (they could not be read; the server's \
                 log says why), so its tokens cannot be verified",
                self.label
            );
        }
        let when = match reads.last_reread {
            Some(at) => format!(
                "they were re-read {} ago, and are re-read for an unknown key at most every {}",
                format_duration(Duration::from_secs(at.elapsed().as_secs())),
                format_duration(MIN_REREAD)
            ),
            None => "they were read at start".to_owned(),
        };
        let failed = if reads.last_error.is_some() {
            "; the last re-read failed (the server's log says why), so the keys read before are \
             kept"
        } else {
            ""
        };
        format!("issuer {} has {key} ({when}{failed})", self.label)
    }

    /// Whether a verified token's claims hold every required value.
    fn required(&self, claims: &Value) -> Result<(), String> {
        for (claim, value) in &self.required {
            if claim_at(claims, claim).and_then(Value::as_str) != Some(value.as_str()) {
                return Err(format!(
                    "the token of issuer {} does not have {claim:?} = {value:?} (the issuer's \
                     required_claims): it is not one of the workloads this server trusts",
                    self.label
                ));
            }
        }
        Ok(())
    }

    /// The allocation prefixes of a verified token's claims.
    fn prefixes(&self, claims: &Value) -> Result<Vec<String>, String> {
        let (path, suffix) = match &self.scope {
            Scope::Every => return Ok(Vec::new()),
            Scope::Fixed(prefixes) => return Ok(prefixes.clone()),
            Scope::Claim { path, suffix } => (path, suffix),
        };
        let value = claim_at(claims, path);
        let none = |what: &str| {
            format!(
                "the token of issuer {} {what}, so it may use no allocation (the issuer's \
                 alloc_prefixes_claim)",
                self.label
            )
        };
        let values: Vec<&str> = match value {
            None | Some(Value::Null) => return Err(none(&format!("has no claim {path:?}"))),
            Some(Value::String(s)) => vec![s.as_str()],
            Some(Value::Array(items)) => items.iter().filter_map(Value::as_str).collect(),
            Some(_) => {
                return Err(none(&format!(
                    "has a claim {path:?} that is neither a string nor a list of strings"
                )));
            }
        };
        if values.len() > MAX_CLAIM_PREFIXES {
            return Err(format!(
                "the token of issuer {} gives {} allocation prefixes in {path:?}; at most \
                 {MAX_CLAIM_PREFIXES} are accepted",
                self.label,
                values.len()
            ));
        }
        let mut usable: Vec<String> = values
            .into_iter()
            .map(|v| format!("{v}{suffix}"))
            .filter(|p| crate::lifecycle::AllocId::parse(p).is_ok())
            .collect();
        // One list for one set of allocations, whatever the claim's order,
        // so tokens that may use the same allocations are one identity:
        // sorted, each prefix inside another (or given twice) left out
        // (sorted, what starts with a prefix follows it).
        usable.sort();
        let mut prefixes: Vec<String> = Vec::with_capacity(usable.len());
        for p in usable {
            if !prefixes
                .last()
                .is_some_and(|kept| p.starts_with(kept.as_str()))
            {
                prefixes.push(p);
            }
        }
        if prefixes.is_empty() {
            return Err(none(&format!(
                "has no value in claim {path:?} that can start an allocation ID (A-Z a-z 0-9 . \
                 _ -)"
            )));
        }
        Ok(prefixes)
    }
}

/// The client that fetches a JWKS URL: rustls with ring, as the rest of
/// taskgate; no redirects (the URL must answer itself).
fn jwks_client(url: &str, ca: Option<&std::path::Path>) -> Result<reqwest::Client, String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| e.to_string())?;
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none_or(str::is_empty) {
        return Err("must be an http:// or https:// URL with a host".into());
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut builder = reqwest::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(FETCH_TIMEOUT)
        .redirect(reqwest::redirect::Policy::none());
    if let Some(ca) = ca {
        let pem = std::fs::read(ca)
            .map_err(|e| format!("cannot read jwks_ca_file {}: {e}", ca.display()))?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem)
            .map_err(|e| format!("jwks_ca_file {}: {e}", ca.display()))?;
        if certs.is_empty() {
            return Err(format!(
                "jwks_ca_file {}: no PEM certificate in it",
                ca.display()
            ));
        }
        builder = builder.tls_certs_only(certs);
    } else if parsed.scheme() == "http" {
        // Plain HTTP needs no roots (and a minimal image has none).
        builder = builder.tls_certs_only([]);
    }
    builder.build().map_err(|e| crate::client::error_chain(&e))
}

async fn fetch(client: &reqwest::Client, url: &str) -> Result<Vec<u8>, String> {
    let mut answer = client
        .get(url)
        .header(reqwest::header::ACCEPT, "application/json")
        .send()
        .await
        .map_err(|e| crate::client::error_chain(&e))?;
    if !answer.status().is_success() {
        return Err(format!("the answer was {}", answer.status()));
    }
    let mut body = Vec::new();
    while let Some(chunk) = answer
        .chunk()
        .await
        .map_err(|e| crate::client::error_chain(&e))?
    {
        if body.len() + chunk.len() > MAX_JWKS_BYTES {
            return Err(format!(
                "the answer is larger than {MAX_JWKS_BYTES} bytes, too large for a JWKS"
            ));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// The RS256 and ES256 signing keys of a JWKS. A key of another kind (an
/// encryption key, an HMAC secret, another curve, an RSA key under 2048
/// bits, or one that declares another algorithm) is left out; a set with
/// none that taskgate can use is an error.
fn parse_jwks(bytes: &[u8], label: &str) -> Result<Vec<Key>, String> {
    #[derive(Deserialize)]
    struct Set {
        keys: Vec<Value>,
    }
    let set: Set = serde_json::from_slice(bytes)
        .map_err(|e| format!("not a JWKS (a JSON object with a `keys` list): {e}"))?;
    let mut keys: Vec<Key> = Vec::new();
    let mut left_out = Vec::new();
    for (i, raw) in set.keys.into_iter().enumerate() {
        let kid = raw.get("kid").and_then(Value::as_str).map(str::to_owned);
        let name = kid.clone().unwrap_or_else(|| format!("keys[{i}]"));
        match usable(raw) {
            Ok(key) if kid.is_some() && keys.iter().any(|k| k.kid == kid) => {
                drop(key);
                left_out.push(format!("{name}: a second key of that kid"));
            }
            Ok(key) => keys.push(key),
            Err(why) => left_out.push(format!("{name}: {why}")),
        }
    }
    if !left_out.is_empty() {
        tracing::info!(issuer = %label, left_out = ?left_out, "keys left out of the issuer's set");
    }
    if keys.is_empty() {
        return Err(format!(
            "no RS256 or ES256 signing key in it ({} left out: {})",
            left_out.len(),
            left_out.join("; ")
        ));
    }
    Ok(keys)
}

/// A JWK as a key taskgate verifies with, or why it is not one.
fn usable(raw: Value) -> Result<Key, String> {
    let jwk: Jwk = serde_json::from_value(raw).map_err(|e| format!("not a JWK ({e})"))?;
    if jwk.common.public_key_use == Some(PublicKeyUse::Encryption) {
        return Err("an encryption key (use \"enc\")".into());
    }
    let declared = jwk.common.key_algorithm;
    let alg = match (&jwk.algorithm, declared) {
        (AlgorithmParameters::RSA(_), None | Some(KeyAlgorithm::RS256)) => Algorithm::RS256,
        (AlgorithmParameters::EllipticCurve(p), None | Some(KeyAlgorithm::ES256))
            if p.curve == EllipticCurve::P256 =>
        {
            Algorithm::ES256
        }
        (_, Some(other)) => return Err(format!("declares {other:?}, not RS256 or ES256")),
        _ => return Err("neither an RSA key nor an EC key on P-256".into()),
    };
    let decoding = DecodingKey::from_jwk(&jwk).map_err(|e| format!("unreadable ({e})"))?;
    match decoding.kind() {
        DecodingKeyKind::RsaModulusExponent { n, .. } => {
            let bits = n.iter().skip_while(|b| **b == 0).count() * 8;
            if bits < 2048 {
                return Err(format!(
                    "an RSA key of about {bits} bits; at least 2048 are required"
                ));
            }
        }
        DecodingKeyKind::SecretOrDer(point) if point.len() != 65 => {
            return Err("an EC key whose coordinates are not 32 bytes each".into());
        }
        DecodingKeyKind::SecretOrDer(_) => {}
    }
    Ok(Key {
        kid: jwk.common.key_id,
        alg,
        decoding,
    })
}

/// A JWT's header fields that choose the key.
#[derive(Deserialize)]
struct Header {
    alg: String,
    #[serde(default)]
    kid: Option<String>,
}

/// A JWT's header and claims, not yet verified.
fn peek(token: &str) -> Result<(Header, Value), String> {
    let not =
        |why: String| format!("the token is not known, and is not a JWT taskgate reads: {why}");
    let mut parts = token.split('.');
    let (Some(header), Some(claims), Some(_), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(not("a JWT has three parts".into()));
    };
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let header = b64
        .decode(header)
        .map_err(|e| not(format!("its header is not base64url ({e})")))?;
    let header: Header = serde_json::from_slice(&header)
        .map_err(|e| not(format!("its header is not a JWT header ({e})")))?;
    let claims = b64
        .decode(claims)
        .map_err(|e| not(format!("its claims are not base64url ({e})")))?;
    let claims: Value = serde_json::from_slice(&claims)
        .map_err(|e| not(format!("its claims are not JSON ({e})")))?;
    if !claims.is_object() {
        return Err(not("its claims are not a JSON object".into()));
    }
    Ok((header, claims))
}

/// Why `jsonwebtoken` refused a token, for its 401.
fn refusal(e: &JwtError, issuer: &Issuer, claims: &Value, now: u64) -> String {
    let at = |claim: &str| {
        claims
            .get(claim)
            .and_then(Value::as_i64)
            .map(|t| {
                time::OffsetDateTime::from_unix_timestamp(t)
                    .ok()
                    .and_then(|t| {
                        t.format(&time::format_description::well_known::Rfc3339)
                            .ok()
                    })
                    .unwrap_or_else(|| t.to_string())
            })
            .unwrap_or_default()
    };
    let leeway = format_duration(LEEWAY);
    match e.kind() {
        ErrorKind::ExpiredSignature => format!(
            "the JWT expired at {} (it is {now} s since the epoch; leeway {leeway})",
            at("exp")
        ),
        ErrorKind::ImmatureSignature => {
            format!(
                "the JWT is not valid before {} (leeway {leeway})",
                at("nbf")
            )
        }
        ErrorKind::InvalidAudience => format!(
            "the JWT's audience (`aud`) does not include {:?}, the audience issuer {} must \
             make its tokens for here",
            issuer.audience, issuer.label
        ),
        ErrorKind::InvalidIssuer => format!("the JWT's issuer is not {:?}", issuer.issuer),
        ErrorKind::InvalidSignature => format!(
            "the JWT's signature does not verify with the key it names of issuer {}",
            issuer.label
        ),
        ErrorKind::MissingRequiredClaim(claim) => {
            format!("the JWT has no `{claim}` claim; taskgate requires exp, iss and aud")
        }
        ErrorKind::InvalidClaimFormat(claim) => {
            format!("the JWT's `{claim}` claim is not of the type it must be")
        }
        _ => format!("the JWT cannot be verified: {}", quoted(&e.to_string())),
    }
}

/// What a caller wrote (a claim, a header field, or an error quoting one),
/// for an answer and the log: quoted, so a log line stays one line, and
/// cut short, so a token the size of the request's head is not logged
/// whole.
fn quoted(s: &str) -> String {
    const MAX_CHARS: usize = 100;
    match s.char_indices().nth(MAX_CHARS) {
        None => format!("{s:?}"),
        Some((end, _)) => format!("{:?}… (cut)", &s[..end]),
    }
}

/// `jsonwebtoken`'s crypto: `ring` verifies RS256 (PKCS#1 v1.5, 2048 to
/// 8192 bits) and ES256 (P-256, fixed-size signatures); nothing is signed
/// and no JWK utility is needed.
static RING: CryptoProvider = CryptoProvider {
    signer_factory: |_, _| Err(ErrorKind::UnsupportedAlgorithm.into()),
    verifier_factory: ring_verifier,
    key_utils: KeyUtils {
        rsa_pub_components_from_private_key: |_| Err(ErrorKind::UnsupportedAlgorithm.into()),
        rsa_pub_components_from_public_key: |_| Err(ErrorKind::UnsupportedAlgorithm.into()),
        ec_pub_components_from_private_key: |_, _| Err(ErrorKind::UnsupportedAlgorithm.into()),
        ed_pub_components_from_private_key: |_, _| Err(ErrorKind::UnsupportedAlgorithm.into()),
        compute_digest: |_, _| Err(ErrorKind::UnsupportedAlgorithm.into()),
    },
};

/// A key, as `ring` takes it.
enum RingKey {
    Rsa {
        n: Vec<u8>,
        e: Vec<u8>,
    },
    /// An RSA public key in DER, or an EC point (`0x04 || x || y`).
    Bytes(Vec<u8>),
}

struct RingVerifier {
    alg: Algorithm,
    key: RingKey,
}

fn ring_verifier(
    alg: &Algorithm,
    key: &DecodingKey,
) -> jsonwebtoken::errors::Result<Box<dyn JwtVerifier>> {
    let family = match alg {
        Algorithm::RS256 => jsonwebtoken::AlgorithmFamily::Rsa,
        Algorithm::ES256 => jsonwebtoken::AlgorithmFamily::Ec,
        _ => return Err(ErrorKind::UnsupportedAlgorithm.into()),
    };
    if key.family() != family {
        return Err(ErrorKind::InvalidAlgorithm.into());
    }
    let key = match key.kind() {
        DecodingKeyKind::RsaModulusExponent { n, e } => RingKey::Rsa {
            n: n.clone(),
            e: e.clone(),
        },
        DecodingKeyKind::SecretOrDer(bytes) => RingKey::Bytes(bytes.clone()),
    };
    Ok(Box::new(RingVerifier { alg: *alg, key }))
}

impl jsonwebtoken::signature::Verifier<Vec<u8>> for RingVerifier {
    fn verify(
        &self,
        msg: &[u8],
        signature: &Vec<u8>,
    ) -> Result<(), jsonwebtoken::signature::Error> {
        use ring::signature as s;
        let checked =
            match (&self.key, self.alg) {
                (RingKey::Rsa { n, e }, Algorithm::RS256) => s::RsaPublicKeyComponents { n, e }
                    .verify(&s::RSA_PKCS1_2048_8192_SHA256, msg, signature),
                (RingKey::Bytes(der), Algorithm::RS256) => {
                    s::UnparsedPublicKey::new(&s::RSA_PKCS1_2048_8192_SHA256, der)
                        .verify(msg, signature)
                }
                (RingKey::Bytes(point), Algorithm::ES256) => {
                    s::UnparsedPublicKey::new(&s::ECDSA_P256_SHA256_FIXED, point)
                        .verify(msg, signature)
                }
                _ => Err(ring::error::Unspecified),
            };
        checked.map_err(|_| jsonwebtoken::signature::Error::new())
    }
}

impl JwtVerifier for RingVerifier {
    fn algorithm(&self) -> Algorithm {
        self.alg
    }
}

#[cfg(test)]
pub(super) mod testing;
#[cfg(test)]
mod tests;
