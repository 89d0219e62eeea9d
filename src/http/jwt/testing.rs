//! A P-256 key made for a test, and issuers that trust it.

use base64::Engine;
use ring::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, KeyPair};
use serde_json::{Value, json};

use super::Issuers;

pub fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

pub struct TestKey(EcdsaKeyPair, String);

impl TestKey {
    pub fn new(kid: &str) -> Self {
        let rng = ring::rand::SystemRandom::new();
        let alg = &ECDSA_P256_SHA256_FIXED_SIGNING;
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(alg, &rng).unwrap();
        let pair = EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), &rng).unwrap();
        Self(pair, kid.into())
    }

    /// Its public JWK.
    pub fn jwk(&self) -> Value {
        let point = self.0.public_key().as_ref();
        json!({"kty": "EC", "crv": "P-256", "kid": self.1,
               "x": b64(&point[1..33]), "y": b64(&point[33..])})
    }

    /// An ES256 JWT of these claims, naming this key.
    pub fn sign(&self, claims: &Value) -> String {
        self.sign_with(&json!({"alg": "ES256", "kid": self.1}), claims)
    }

    /// A JWT of this header and these claims, signed with this key.
    pub fn sign_with(&self, header: &Value, claims: &Value) -> String {
        let message = format!(
            "{}.{}",
            b64(header.to_string().as_bytes()),
            b64(claims.to_string().as_bytes())
        );
        let rng = ring::rand::SystemRandom::new();
        let sig = self.0.sign(&rng, message.as_bytes()).unwrap();
        format!("{message}.{}", b64(sig.as_ref()))
    }
}

/// Issuers of one entry: `entry` completed with the issuer
/// `https://iss`, the audience `taskgate`, the role agent and a key
/// file holding the key returned.
pub fn issuers(entry: Value) -> (tempfile::TempDir, TestKey, Result<Issuers, String>) {
    let dir = tempfile::tempdir().unwrap();
    let key = TestKey::new("k1");
    let keys = dir.path().join("jwks.json");
    std::fs::write(&keys, json!({"keys": [key.jwk()]}).to_string()).unwrap();
    let mut full = json!({"issuer": "https://iss", "audience": "taskgate", "role": "agent",
                          "jwks_file": keys});
    for (k, v) in entry.as_object().unwrap() {
        full[k] = v.clone();
    }
    let file = dir.path().join("issuers.json");
    std::fs::write(&file, json!({"issuers": [full]}).to_string()).unwrap();
    let loaded = Issuers::load(&file);
    (dir, key, loaded)
}
