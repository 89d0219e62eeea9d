//! The semaphore record: its bytes pinned, round trips, and damage.

use super::*;

fn sample() -> Semaphore {
    Semaphore {
        name: SemName::parse("db-migrations").unwrap(),
        limit: 3,
        grant_timeout: Duration::from_secs(90),
        create_index: 7,
        modify_index: 300,
    }
}

#[test]
fn a_semaphore_record_round_trips_exactly() {
    let odd = Semaphore {
        name: SemName::parse("a").unwrap(),
        limit: LIMIT_RANGE.1,
        // Finer than a millisecond: kept to the nanosecond.
        grant_timeout: GRANT_TIMEOUT_RANGE.0 + Duration::from_nanos(1),
        create_index: 1 << 40,
        modify_index: 1 << 40,
    };
    for s in [sample(), odd] {
        assert_eq!(decode_semaphore(&encode_semaphore(&s)), Ok(s));
    }
}

#[test]
fn the_semaphore_format_is_pinned_byte_for_byte() {
    // A change here breaks every data directory written before it.
    let mut expected = vec![0x81, 13];
    expected.extend_from_slice(b"db-migrations");
    expected.extend_from_slice(&[
        3, // limit
        // grant_timeout: 90 s = 90,000,000,000 ns
        0x80, 0x88, 0xac, 0xa3, 0xcf, 0x02, //
        7,    // create_index
        0xac, 0x02, // modify_index 300
        0,    // no extensions
    ]);
    assert_eq!(encode_semaphore(&sample()), expected);
}

#[test]
fn other_semaphore_formats_are_refused_by_name() {
    let mut bytes = encode_semaphore(&sample());
    for v in (0..=u8::MAX).filter(|&v| v != SEMAPHORE_VERSION) {
        bytes[0] = v;
        let err = decode_semaphore(&bytes).unwrap_err();
        assert!(err.contains(&format!("format byte {v:#04x},")), "{err}");
        assert!(err.contains("format 1 (byte 0x81) only"), "{err}");
    }
    assert_eq!(decode_semaphore(b"").unwrap_err(), "an empty record");
}

/// A semaphore's record taken for an allocation's (or the other way
/// round) is refused, never misread.
#[test]
fn the_two_kinds_of_record_are_never_taken_for_each_other() {
    let err = decode(&encode_semaphore(&sample())).unwrap_err();
    assert!(err.contains("record format version 129,"), "{err}");
    let spec = AllocSpec::new(
        vec![TaskSpec {
            name: TaskName::parse("web").unwrap(),
            lifecycle: None,
            leader: false,
            readiness: false,
            liveness: None,
            depends_on: Vec::new(),
            acquire: Vec::new(),
            barrier: None,
        }],
        &Limits::default(),
    )
    .unwrap();
    let a = Allocation::register(
        AllocId::parse("a1").unwrap(),
        Arc::new(spec),
        1,
        time::OffsetDateTime::UNIX_EPOCH,
    );
    let err = decode_semaphore(&encode(&a)).unwrap_err();
    assert!(err.contains("format byte 0x05,"), "{err}");
}

#[test]
fn values_no_semaphore_can_have_are_damage_named() {
    let refused = |change: &dyn Fn(&mut Semaphore)| {
        let mut s = sample();
        change(&mut s);
        decode_semaphore(&encode_semaphore(&s)).unwrap_err()
    };
    let err = refused(&|s| s.limit = 0);
    assert_eq!(err, "limit 0 is outside 1 to 10000");
    assert!(refused(&|s| s.limit = 10_001).contains("limit 10001 is outside"));
    let err = refused(&|s| s.grant_timeout = Duration::from_millis(999));
    assert!(
        err.contains("grant_timeout 999ms is outside 1s to"),
        "{err}"
    );
    let err = refused(&|s| s.grant_timeout = Duration::from_secs(24 * 3600 + 1));
    assert!(err.contains("grant_timeout 86401s is outside"), "{err}");
    let err = refused(&|s| s.create_index = 301);
    assert_eq!(err, "create_index 301 is above modify_index 300");

    // A name no semaphore can have (as an allocation ID's syntax).
    let mut bytes = encode_semaphore(&sample());
    bytes[2] = b'~';
    let err = decode_semaphore(&bytes).unwrap_err();
    assert!(
        err.contains("bad semaphore name \"~b-migrations\""),
        "{err}"
    );

    // An extension this build does not know, and bytes after the end.
    let mut bytes = encode_semaphore(&sample());
    let last = bytes.len() - 1;
    bytes.truncate(last);
    bytes.extend_from_slice(&[1, 9, 0]);
    let err = decode_semaphore(&bytes).unwrap_err();
    assert_eq!(err, "unknown semaphore extension 9");
    let mut bytes = encode_semaphore(&sample());
    bytes.push(0);
    let err = decode_semaphore(&bytes).unwrap_err();
    assert_eq!(err, "1 bytes after the record's end");
}

/// Cut at every length it is refused; with any byte changed it is
/// refused or decodes to what encodes back to the same bytes (no change
/// may panic, or read as another semaphore's record silently).
#[test]
fn every_cut_and_changed_byte_of_a_semaphore_record_is_refused_or_one_encoding() {
    let bytes = encode_semaphore(&sample());
    for len in 0..bytes.len() {
        assert!(decode_semaphore(&bytes[..len]).is_err(), "cut at {len}");
    }
    for at in 0..bytes.len() {
        for flip in [0x01, 0x02, 0x10, 0x40, 0x80, 0xff] {
            let mut changed = bytes.clone();
            changed[at] ^= flip;
            if let Ok(s) = decode_semaphore(&changed) {
                assert_eq!(encode_semaphore(&s), changed, "byte {at} ^ {flip:#x}");
            }
        }
    }
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Decoding never panics, and whatever decodes is the one encoding
        /// of its semaphore.
        #[test]
        fn random_bytes_after_the_semaphore_format_byte(
            tail in prop::collection::vec(any::<u8>(), 0..64)
        ) {
            let mut bytes = vec![SEMAPHORE_VERSION];
            bytes.extend(tail);
            if let Ok(s) = decode_semaphore(&bytes) {
                prop_assert_eq!(encode_semaphore(&s), bytes);
            }
        }

        /// Every semaphore the API can make round-trips exactly.
        #[test]
        fn any_semaphore_round_trips(
            name in "[a-z0-9][a-z0-9._-]{0,127}",
            limit in LIMIT_RANGE.0..=LIMIT_RANGE.1,
            nanos in GRANT_TIMEOUT_RANGE.0.as_nanos() as u64..=GRANT_TIMEOUT_RANGE.1.as_nanos() as u64,
            create_index in any::<u64>(),
            later in any::<u64>(),
        ) {
            let s = Semaphore {
                name: SemName::parse(&name).unwrap(),
                limit,
                grant_timeout: Duration::from_nanos(nanos),
                create_index,
                modify_index: create_index.saturating_add(later),
            };
            prop_assert_eq!(decode_semaphore(&encode_semaphore(&s)), Ok(s));
        }
    }
}
