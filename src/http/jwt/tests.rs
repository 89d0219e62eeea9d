use super::{
    testing::{TestKey, b64, issuers},
    *,
};
use serde_json::json;

fn ec_jwk(kid: &str) -> Value {
    TestKey::new(kid).jwk()
}

#[test]
fn only_rs256_and_es256_signing_keys_are_kept() {
    let mut small_rsa = json!({"kty": "RSA", "kid": "small", "n": b64(&[0xc5; 128]), "e": "AQAB"});
    let big_rsa = json!({"kty": "RSA", "kid": "big", "n": b64(&[0xc5; 256]), "e": "AQAB"});
    let mut enc = ec_jwk("enc");
    enc["use"] = json!("enc");
    let mut rs384 = big_rsa.clone();
    rs384["kid"] = json!("rs384");
    rs384["alg"] = json!("RS384");
    let p384 =
        json!({"kty": "EC", "crv": "P-384", "kid": "p384", "x": b64(&[1; 48]), "y": b64(&[2; 48])});
    let hmac = json!({"kty": "oct", "kid": "hmac", "k": b64(b"secret")});
    let odd = json!({"kty": "OKP", "crv": "X448", "kid": "odd", "x": "AA"});
    let mut twin = ec_jwk("ec");
    twin["alg"] = json!("ES256");
    let set = json!({"keys": [small_rsa.clone(), big_rsa, enc, rs384, p384, hmac, odd,
                              ec_jwk("ec"), twin]});
    let keys = parse_jwks(set.to_string().as_bytes(), "t").unwrap();
    let kept: Vec<_> = keys
        .iter()
        .map(|k| (k.kid.as_deref().unwrap(), k.alg))
        .collect();
    assert_eq!(kept, [("big", Algorithm::RS256), ("ec", Algorithm::ES256)]);

    small_rsa["alg"] = json!("RS256");
    let err = parse_jwks(json!({"keys": [small_rsa]}).to_string().as_bytes(), "t")
        .err()
        .unwrap();
    assert!(
        err.contains("no RS256 or ES256") && err.contains("1024 bits"),
        "{err}"
    );
    let err = parse_jwks(b"[]", "t").err().unwrap();
    assert!(err.contains("not a JWKS"), "{err}");
}

#[test]
fn prefixes_come_from_a_claim_or_a_pointer_into_one() {
    let (_dir, _, by_pointer) = issuers(json!({"alloc_prefixes_claim": "/kubernetes.io/namespace",
                                            "alloc_prefix_suffix": "."}));
    let by_pointer = by_pointer.unwrap();
    let issuer = &by_pointer.issuers[0];
    let claims = json!({"kubernetes.io": {"namespace": "team-a"}});
    assert_eq!(issuer.prefixes(&claims).unwrap(), ["team-a."]);
    for (claims, why) in [
        (json!({}), "has no claim"),
        (
            json!({"kubernetes.io": {"namespace": 7}}),
            "neither a string",
        ),
        (
            json!({"kubernetes.io": {"namespace": "a/b"}}),
            "can start an allocation ID",
        ),
    ] {
        let err = issuer.prefixes(&claims).unwrap_err();
        assert!(
            err.contains(why) && err.contains("may use no allocation"),
            "{err}"
        );
    }

    let (_dir, _, by_name) = issuers(json!({"alloc_prefixes_claim": "groups"}));
    let by_name = by_name.unwrap();
    let issuer = &by_name.issuers[0];
    // Values that cannot start an ID are left out; the others kept
    // (sorted).
    let claims = json!({"groups": ["web-", "not/one", 3, "db-"]});
    assert_eq!(issuer.prefixes(&claims).unwrap(), ["db-", "web-"]);
    let many: Vec<String> = (0..=MAX_CLAIM_PREFIXES).map(|i| format!("p{i}")).collect();
    assert!(
        issuer
            .prefixes(&json!({"groups": many}))
            .unwrap_err()
            .contains("at most")
    );

    let (_dir, _, every) = issuers(json!({}));
    assert!(
        every.unwrap().issuers[0]
            .prefixes(&json!({}))
            .unwrap()
            .is_empty()
    );
}

/// A kept token is judged again once it expires (past the leeway) or
/// its issuer's keys change.
#[test]
fn a_kept_token_lasts_until_it_expires_or_the_keys_change() {
    let (_dir, _, loaded) = issuers(json!({}));
    let jwt = loaded.unwrap();
    let token = jwt.identity(0, Vec::new());
    let kept = |exp| Verified {
        token: token.clone(),
        subject: "s".into(),
        issuer: 0,
        generation: jwt.issuers[0].generation.load(Ordering::Acquire),
        exp,
    };
    let leeway = LEEWAY.as_secs();
    jwt.keep([1; 32], kept(1000), 900);
    assert!(matches!(
        jwt.known(&[1; 32], 1000 + leeway),
        Some(Judged::Known(..))
    ));
    assert!(jwt.known(&[1; 32], 1001 + leeway).is_none());
    assert!(
        jwt.known(&[1; 32], 900).is_none(),
        "an expired one is forgotten"
    );

    jwt.keep([2; 32], kept(1000), 900);
    jwt.issuers[0].replace_keys(Vec::new());
    assert!(jwt.known(&[2; 32], 900).is_none());
}

/// Identities of one issuer and prefix set are one token while held
/// (their waits count together); a new one once none holds it.
#[test]
fn identities_are_shared_while_held() {
    let (_dir, _, loaded) = issuers(json!({"alloc_prefixes_claim": "ns", "max_waiters": 3}));
    let jwt = loaded.unwrap();
    let a = jwt.identity(0, vec!["team-a".into()]);
    let again = jwt.identity(0, vec!["team-a".into()]);
    assert!(Arc::ptr_eq(&a, &again));
    let b = jwt.identity(0, vec!["team-b".into()]);
    assert!(!Arc::ptr_eq(&a, &b));
    assert_eq!(a.role, Role::Agent);
    assert_eq!(a.name, "jwt:https://iss");
    assert_eq!(
        a.max_dependencies,
        Some(super::super::auth::DEFAULT_MAX_DEPENDENCIES_PER_TOKEN)
    );
    let held = Arc::downgrade(&a);
    drop((a, again));
    assert!(held.upgrade().is_none(), "the map keeps no identity alive");
}

/// How `judge` answers a token (after a re-read if it asks for one):
/// `Ok` with the identity, or the refusal's text.
fn judged(jwt: &Issuers, token: &str) -> Result<Arc<Token>, String> {
    use sha2::Digest;
    let hash: [u8; 32] = sha2::Sha256::digest(token.as_bytes()).into();
    let mut reread = Reread::NotYet;
    loop {
        match jwt.judge(token, &hash, reread) {
            Judged::Known(token, _) => return Ok(token),
            Judged::Unauthorized(why) => return Err(format!("401 {why}")),
            Judged::Forbidden(why) => return Err(format!("403 {why}")),
            Judged::Unavailable(why) => return Err(format!("503 {why}")),
            Judged::Reread { issuer, generation } => {
                assert_eq!(reread, Reread::NotYet, "a second re-read");
                reread = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap()
                    .block_on(jwt.reread(issuer, generation));
            }
        }
    }
}

fn claims() -> Value {
    json!({"iss": "https://iss", "aud": "taskgate",
           "exp": jsonwebtoken::get_current_timestamp() + 600})
}

/// An issuer that vouches for every workload of a platform (a CI's,
/// a cluster's) is narrowed to taskgate's by claims its tokens must
/// hold: a token of the same issuer and audience without them is
/// refused (403), one with them taken.
#[test]
fn required_claims_narrow_an_issuer_to_its_workloads() {
    let (_dir, key, loaded) = issuers(json!({"required_claims": {
        "repository_owner": "our-org",
        "/kubernetes.io/serviceaccount/name": "taskgate-agent"}}));
    let jwt = loaded.unwrap();
    let with = |owner: &str, sa: Value| {
        let mut c = claims();
        c["repository_owner"] = json!(owner);
        c["kubernetes.io"] = json!({"serviceaccount": {"name": sa}});
        judged(&jwt, &key.sign(&c))
    };
    assert!(with("our-org", json!("taskgate-agent")).is_ok());
    for (owner, sa) in [
        ("their-org", json!("taskgate-agent")),
        ("our-org", json!("default")),
        ("our-org", json!(["taskgate-agent"])),
        ("our-org", Value::Null),
    ] {
        let err = with(owner, sa.clone()).unwrap_err();
        assert!(
            err.starts_with("403 ") && err.contains("required_claims"),
            "{owner} {sa}: {err}"
        );
    }
    // A required claim with no value, or no name, refuses the file.
    for bad in [json!({"": "x"}), json!({"a": ""}), json!({"/": "x"})] {
        let (_dir, _, loaded) = issuers(json!({"required_claims": bad}));
        let err = loaded.unwrap_err();
        assert!(err.contains("required_claims"), "{err}");
    }
}

/// Headers that try to choose the key or the algorithm: keys the token
/// carries or points to are never used; only RS256 and ES256, spelled
/// exactly, on a key of that kind.
#[test]
fn a_token_cannot_bring_its_own_key_or_algorithm() {
    let (_dir, key, loaded) = issuers(json!({}));
    let jwt = loaded.unwrap();
    assert!(judged(&jwt, &key.sign(&claims())).is_ok());
    let forger = TestKey::new("k1");
    for header in [
        json!({"alg": "ES256", "jwk": forger.jwk()}),
        json!({"alg": "ES256", "kid": "k1", "jwk": forger.jwk()}),
        json!({"alg": "ES256", "kid": "k1", "jku": "http://127.0.0.1:1/jwks"}),
        json!({"alg": "ES256", "kid": "k1", "x5u": "http://127.0.0.1:1/cert"}),
    ] {
        let err = judged(&jwt, &forger.sign_with(&header, &claims())).unwrap_err();
        assert!(err.contains("signature does not verify"), "{header}: {err}");
    }
    for alg in [
        "es256", "ES256 ", " ES256", "HS256", "ES384", "PS256", "EdDSA", "RS256",
    ] {
        let header = json!({"alg": alg, "kid": "k1"});
        let err = judged(&jwt, &key.sign_with(&header, &claims())).unwrap_err();
        assert!(err.starts_with("401"), "{alg}: {err}");
    }
    // An extension the token says must be understood is not.
    let crit = json!({"alg": "ES256", "kid": "k1", "crit": ["exp"]});
    assert!(judged(&jwt, &key.sign_with(&crit, &claims())).is_err());
    // A signature of zeros (the "psychic signature" of some ECDSA
    // verifiers).
    let good = key.sign(&claims());
    let (message, _) = good.rsplit_once('.').unwrap();
    let zeros = format!("{message}.{}", b64(&[0; 64]));
    assert!(
        judged(&jwt, &zeros)
            .unwrap_err()
            .contains("does not verify")
    );
}

/// `exp` and `nbf` of other types than a number of seconds, and `iss`
/// and `aud` in their other shapes.
#[test]
fn claims_of_odd_types_are_refused() {
    let (_dir, key, loaded) = issuers(json!({}));
    let jwt = loaded.unwrap();
    let now = jsonwebtoken::get_current_timestamp();
    let with = |k: &str, v: Value| {
        let mut c = claims();
        c[k] = v;
        key.sign(&c)
    };
    for (k, v) in [
        ("exp", json!((now + 600).to_string())),
        ("exp", json!(-1)),
        ("exp", json!(1e300)),
        ("exp", json!(true)),
        ("exp", json!(null)),
        ("nbf", json!((now - 10).to_string())),
        ("nbf", json!(now + 600)),
        ("iss", json!(["https://iss"])),
        ("iss", json!("https://iss/")),
        ("aud", json!([])),
        ("aud", json!("taskgatex")),
        ("aud", json!(["taskgat"])),
    ] {
        let err = judged(&jwt, &with(k, v.clone())).unwrap_err();
        assert!(err.starts_with("401"), "{k}: {v}: {err}");
    }
    for (k, v) in [
        ("aud", json!(["vault", "taskgate"])),
        ("exp", json!(now as f64 + 600.5)),
    ] {
        assert!(judged(&jwt, &with(k, v.clone())).is_ok(), "{k}: {v}");
    }
}

/// Two issuers whose keys share a `kid`, or where one names the
/// other's: a token is checked with its own issuer's keys only.
#[test]
fn an_issuer_s_token_is_checked_with_its_keys_only() {
    let dir = tempfile::tempdir().unwrap();
    let (a1, b1, b2) = (
        TestKey::new("k1"),
        TestKey::new("k1"),
        TestKey::new("only-b"),
    );
    let (fa, fb) = (dir.path().join("a.json"), dir.path().join("b.json"));
    std::fs::write(&fa, json!({"keys": [a1.jwk()]}).to_string()).unwrap();
    std::fs::write(&fb, json!({"keys": [b1.jwk(), b2.jwk()]}).to_string()).unwrap();
    let file = dir.path().join("issuers.json");
    std::fs::write(
        &file,
        json!({"issuers": [
        {"issuer": "https://a", "audience": "taskgate", "role": "agent", "jwks_file": fa,
         "alloc_prefixes": ["a-"]},
        {"issuer": "https://b", "audience": "taskgate", "role": "operator", "jwks_file": fb}]})
        .to_string(),
    )
    .unwrap();
    let jwt = Issuers::load(&file).unwrap();
    let mut claims = claims();
    claims["iss"] = json!("https://b");
    assert_eq!(
        judged(&jwt, &b1.sign(&claims)).unwrap().role,
        Role::Operator
    );
    assert_eq!(
        judged(&jwt, &b2.sign(&claims)).unwrap().role,
        Role::Operator
    );
    // A's key cannot make an operator of B.
    assert!(
        judged(&jwt, &a1.sign(&claims))
            .unwrap_err()
            .contains("does not verify")
    );
    claims["iss"] = json!("https://a");
    assert_eq!(
        judged(&jwt, &a1.sign(&claims)).unwrap().alloc_prefixes,
        ["a-"]
    );
    // B's keys do not vouch for A's tokens.
    assert!(
        judged(&jwt, &b1.sign(&claims))
            .unwrap_err()
            .contains("does not verify")
    );
    assert!(
        judged(&jwt, &b2.sign(&claims))
            .unwrap_err()
            .contains("no key \"only-b\"")
    );
}

/// Tokens whose claim gives the same prefixes, in another order, with
/// one twice or with one inside another, are one identity (their waits
/// count together).
#[test]
fn the_same_prefixes_in_any_order_are_one_identity() {
    let (_dir, key, loaded) = issuers(json!({"alloc_prefixes_claim": "groups"}));
    let jwt = loaded.unwrap();
    let with = |groups: Value| {
        let mut c = claims();
        c["groups"] = groups;
        judged(&jwt, &key.sign(&c)).unwrap()
    };
    let one = with(json!(["a-", "b-"]));
    for other in [
        json!(["b-", "a-"]),
        json!(["a-", "b-", "a-"]),
        json!(["b-", "a-x", "a-", "not/one", "b-"]),
    ] {
        let again = with(other.clone());
        assert!(
            Arc::ptr_eq(&one, &again),
            "{other}: {:?}",
            again.alloc_prefixes
        );
    }
}
