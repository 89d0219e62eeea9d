use super::*;
use crate::lifecycle::{Event, EventBody, MAX_EVENTS, TaskReport};
use time::macros::datetime;

fn task(name: &str, hook: Option<Hook>, sidecar: bool, leader: bool) -> TaskSpec {
    TaskSpec {
        name: TaskName::parse(name).unwrap(),
        lifecycle: hook.map(|hook| Lifecycle { hook, sidecar }),
        leader,
        readiness: false,
        liveness: None,
        depends_on: Vec::new(),
        acquire: Vec::new(),
        barrier: None,
    }
}

/// A registered allocation with one report: what most records are.
fn sample() -> Allocation {
    let spec = AllocSpec::new(
        vec![
            task("init", Some(Hook::Prestart), false, false),
            task("web", None, false, true),
        ],
        &Limits::default(),
    )
    .unwrap();
    let now = datetime!(2026-11-21 10:00:00.123456789 UTC);
    let a = Allocation::register(AllocId::parse("a1").unwrap(), Arc::new(spec), 3, now);
    let report = TaskReport {
        state: RunState::Dead,
        failed: false,
        event: None,
        ready: None,
    };
    a.report(&[(0, report)], now, || 4).unwrap()
}

/// Every field set, every kind of task, odd timestamps.
fn full() -> Allocation {
    let deadlines = Deadlines {
        prestart: Some(Duration::from_millis(1001)),
        main: None,
        poststart: Some(Duration::from_secs(7 * 24 * 3600)),
        poststop: Some(Duration::from_secs(1)),
    };
    let spec = AllocSpec::with_deadlines(
        vec![
            task("init", Some(Hook::Prestart), false, false),
            TaskSpec {
                readiness: true,
                liveness: Some(Duration::from_secs(24 * 3600)),
                ..task("proxy", Some(Hook::Prestart), true, false)
            },
            TaskSpec {
                liveness: Some(Duration::from_millis(1500)),
                depends_on: vec![
                    Dependency {
                        task: TaskName::parse("proxy").unwrap(),
                        allocation: None,
                        condition: Condition::Running,
                    },
                    Dependency {
                        task: TaskName::parse("db").unwrap(),
                        allocation: Some(AllocId::parse("db-7").unwrap()),
                        condition: Condition::Ready,
                    },
                    Dependency {
                        task: TaskName::parse("db").unwrap(),
                        allocation: Some(AllocId::parse("b-2").unwrap()),
                        condition: Condition::Dead,
                    },
                ],
                acquire: vec![
                    SemName::parse("db-migrations").unwrap(),
                    SemName::parse("x").unwrap(),
                ],
                ..task("web", None, false, true)
            },
            task("announce", Some(Hook::Poststart), false, false),
            task("log-ship", Some(Hook::Poststart), true, false),
            task("cleanup", Some(Hook::Poststop), false, false),
        ],
        deadlines,
        &Limits::default(),
    )
    .unwrap();
    let east = datetime!(2026-11-21 10:00:00.000000001 +05:30);
    let old = datetime!(1969-12-31 23:59:59.999999999 -11:00);
    let event = |kind: &str, details: &[(&str, &str)]| {
        Event::new(
            kind,
            east,
            "Exit Code: 1 — ünïcode",
            crate::lifecycle::Details::from_pairs(details.iter().copied()),
        )
    };
    let mut tasks: Vec<TaskStatus> = (0..6).map(TaskStatus::new).collect();
    tasks[0] = TaskStatus {
        state: RunState::Dead,
        failed: true,
        restarts: u64::MAX,
        started_at: Some(old),
        finished_at: Some(east),
        last_restart: Some(datetime!(9999-12-31 23:59:59.999999999 UTC)),
        events: [
            event("Terminated", &[("exit_code", "1"), ("signal", "")]),
            event("Restart Signaled", &[]),
        ]
        .into_iter()
        .collect(),
        restart_generation: 1 << 35,
        ready: false,
        ready_at: None,
        stale: true,
        modify_index: 300,
        run: None,
        reopened: true,
        extra: Some(Arc::new(TaskExtra {
            lost_at: Some(old),
            keys: vec![
                IdemKey {
                    key: u64::MAX,
                    request: 0,
                },
                IdemKey {
                    key: 1,
                    request: 1 << 63,
                },
            ],
            deps: Vec::new(),
            hold: Some(Hold::Granted {
                fence: u64::MAX,
                at: old,
            }),
            meet: None,
        })),
    };
    tasks[1].state = RunState::Running;
    tasks[1].ready = true;
    tasks[1].ready_at = Some(east);
    tasks[2].state = RunState::Running;
    tasks[2].run = Some(u64::MAX);
    tasks[2].started_at = Some(datetime!(-9999-01-01 00:00:00 UTC));
    tasks[2].ready_at = Some(old);
    tasks[2].set_hold(Some(Hold::Queued {
        since: 1 << 40,
        at: east,
    }));
    tasks[2].set_deps(vec![
        DepState::Holds,
        DepState::Blocked(Why::NotReady),
        DepState::Cycle(vec!["b-2/db".to_owned(), "job.group_7-x/web".to_owned()].into()),
    ]);
    let order = Desired::Stop(StopReason {
        task: Some(TaskName::parse("init").unwrap()),
        ..StopReason::bare(StopKind::SiblingTaskFailed)
    });
    let overdue = Overdue {
        stage: Some((CoordState::Poststart, vec![3, 0])),
        poststop: Some(vec![5]),
    };
    Allocation::from_parts(
        AllocId::parse("job.group_7-x").unwrap(),
        Arc::new(spec),
        CoordState::WaitAlloc,
        tasks,
        Some(order),
        1,
        u64::MAX - 1,
        old,
        east,
    )
    .with_deadlines(Some(east), Some(overdue))
}

/// A record whose order is a deadline's.
fn overdue_main() -> Allocation {
    let deadlines = Deadlines {
        main: Some(Duration::from_secs(60)),
        ..Deadlines::default()
    };
    let spec = AllocSpec::with_deadlines(
        vec![task("web", None, false, false)],
        deadlines,
        &Limits::default(),
    )
    .unwrap();
    let now = datetime!(2026-11-21 10:00 UTC);
    let a = Allocation::register(AllocId::parse("d1").unwrap(), Arc::new(spec), 3, now);
    assert!(a.deadline_at.is_some());
    let later = now + Duration::from_secs(61);
    let next = a
        .tick(later, &|_| None, None, || 4)
        .expect("the deadline fires");
    assert_eq!(
        next.order().reason().unwrap().kind,
        StopKind::DeadlineExceeded
    );
    next
}

#[test]
fn a_record_round_trips_exactly() {
    for a in [sample(), full(), overdue_main()] {
        let back = decode(&encode(&a)).unwrap();
        assert_eq!(back, a);
        // Equal instants are equal timestamps; the offsets are kept too.
        assert_eq!(back.created_at.offset(), a.created_at.offset());
    }
    let a = full();
    let back = decode(&encode(&a)).unwrap();
    assert_eq!(
        back.tasks[0].events.all()[0].time().offset(),
        a.tasks[0].events.all()[0].time().offset()
    );
}

#[test]
fn write_marks_round_trip_and_keep_the_last_eight() {
    let mut a = overdue_main();
    for i in 0..11u64 {
        a.mark_write(WriteMark {
            id: u64::MAX - i,
            parent: i * 300,
        });
    }
    assert_eq!(a.writes().len(), WRITE_MARKS);
    assert_eq!(a.writes()[0].parent, 900, "the oldest three are gone");
    assert_eq!(a.writes()[7].id, u64::MAX - 10);
    let back = decode(&encode(&a)).unwrap();
    assert_eq!(back.writes(), a.writes());
    assert_eq!(back, a);
    // Nine marks are damage.
    let mut bytes = encode(&a);
    let at = bytes
        .windows(2)
        .position(|w| w == [EXT_WRITES, 1 + 8 * 8 + 8 * 2])
        .expect("the marks' block");
    assert_eq!(bytes[at + 2], 8);
    bytes[at + 2] = 9;
    assert!(decode(&bytes).is_err());
}

#[test]
fn unknown_or_unordered_extensions_are_damage() {
    let bytes = encode(&sample());
    // The allocation's block: right after the order (byte 27).
    assert_eq!(&bytes[27..29], &[0, 0], "run, no extensions");
    let mut unknown = bytes.clone();
    unknown.splice(28..29, [1, 9, 0]);
    assert!(
        decode(&unknown)
            .unwrap_err()
            .contains("unknown allocation extension 9")
    );
    // Two deadline_at entries: tags must increase.
    let mut at = Vec::new();
    put_time(&mut at, datetime!(2026-11-21 10:00 UTC));
    let mut twice = vec![2, EXT_DEADLINE_AT, at.len() as u8];
    twice.extend_from_slice(&at);
    twice.extend_from_slice(&[EXT_DEADLINE_AT, at.len() as u8]);
    twice.extend_from_slice(&at);
    let mut repeated = bytes.clone();
    repeated.splice(28..29, twice);
    assert!(decode(&repeated).unwrap_err().contains("out of order"));
    // A payload with bytes left over.
    let mut long = vec![1, EXT_DEADLINE_AT, at.len() as u8 + 1];
    long.extend_from_slice(&at);
    long.push(0);
    let mut padded = bytes.clone();
    padded.splice(28..29, long);
    assert!(decode(&padded).unwrap_err().contains("after deadline_at"));
    // A task's block: the record's last byte.
    let mut task = bytes;
    let end = task.len() - 1;
    task.splice(end.., [1, 11, 0]);
    assert!(
        decode(&task)
            .unwrap_err()
            .contains("unknown task extension 11")
    );
}

#[test]
fn the_format_is_pinned_byte_for_byte() {
    // A change here breaks every data directory written before it.
    let expected: &[u8] = &[
        5, // version
        2, b'a', b'1', // id
        2,    // state: main
        3, 4, // create_index, modify_index
        // created_at and modified_at: 2026-11-21 10:00:00.123456789 UTC
        // (1795255200 zigzagged, 123456789 ns, offset 0)
        192, 174, 139, 176, 13, 149, 154, 239, 58, 0, //
        192, 174, 139, 176, 13, 149, 154, 239, 58, 0, //
        0, // stop order: run
        0, // no allocation extensions
        2, // tasks
        // init: prestart; dead; finished_at; restarts 0, generation 0,
        // index 4; finished_at; no events; no extensions
        4, b'i', b'n', b'i', b't', 1, 2, 4, 0, 0, 4, //
        192, 174, 139, 176, 13, 149, 154, 239, 58, 0, 0, 0, //
        // web: main, leader; pending; no flags; 0, 0, index 4; no
        // events; no extensions
        3, b'w', b'e', b'b', 0x20, 0, 0, 0, 0, 4, 0, 0,
    ];
    assert_eq!(encode(&sample()), expected);
    // With a TTL on web, a deadline for main passed (its order and
    // its tasks) and a key kept on web.
    let mut a = sample();
    let mut web = a.spec.tasks()[1].clone();
    web.liveness = Some(Duration::from_secs(30));
    let deadlines = Deadlines {
        main: Some(Duration::from_secs(300)),
        ..Deadlines::default()
    };
    let spec = AllocSpec::with_deadlines(
        vec![a.spec.tasks()[0].clone(), web],
        deadlines,
        &Limits::default(),
    )
    .unwrap();
    a.spec = Arc::new(spec);
    a.tasks[1].remember(IdemKey { key: 1, request: 2 });
    let a = Allocation::from_parts(
        a.id.clone(),
        a.spec.clone(),
        a.state,
        a.tasks.clone(),
        Some(Desired::Stop(StopReason::deadline(CoordState::Main))),
        a.create_index,
        a.modify_index,
        a.created_at,
        a.modified_at,
    )
    .with_deadlines(
        None,
        Some(Overdue {
            stage: Some((CoordState::Main, vec![1])),
            poststop: None,
        }),
    );
    let expected: &[u8] = &[
        5, 2, b'a', b'1', 2, 3, 4, //
        192, 174, 139, 176, 13, 149, 154, 239, 58, 0, //
        192, 174, 139, 176, 13, 149, 154, 239, 58, 0, //
        4, 2, // stop order: Deadline Exceeded in main
        2, // two allocation extensions
        1, 4, 0x2, 0xe0, 0xa7, 0x12, // deadlines: main, 300,000 ms
        3, 3, 2, 1, 1, // stage overdue: main, one task: web
        2, // tasks
        4, b'i', b'n', b'i', b't', 1, 2, 4, 0, 0, 4, //
        192, 174, 139, 176, 13, 149, 154, 239, 58, 0, 0, 0, //
        3, b'w', b'e', b'b', 0x20, 0, 0, 0, 0, 4, 0, //
        2, // two task extensions
        1, 3, 0xb0, 0xea, 0x01, // ttl: 30,000 ms
        3, 17, 1, 1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, // one key
    ];
    assert_eq!(encode(&a), expected);
    assert_eq!(decode(expected).unwrap(), a);
}

/// `sample()` with events: init `Started`; web `Started` (the same
/// body) and `Terminated` with a detail; all at its created time.
fn sample_with_events() -> Allocation {
    let mut a = sample();
    let t = datetime!(2026-11-21 10:00:00.123456789 UTC);
    let started = || Event::new("Started", t, "", Default::default());
    let terminated = Event::new(
        "Terminated",
        t,
        "x",
        crate::lifecycle::Details::from_pairs([("exit_code", "1")]),
    );
    a.tasks[0].events = [started()].into_iter().collect();
    a.tasks[1].events = [started(), terminated].into_iter().collect();
    a
}

/// `sample_with_events()` as written: a body the record wrote before
/// is its number.
const EVENTS: &[u8] = &[
    5, 2, b'a', b'1', 2, 3, 4, //
    192, 174, 139, 176, 13, 149, 154, 239, 58, 0, //
    192, 174, 139, 176, 13, 149, 154, 239, 58, 0, //
    0, 0, 2, //
    4, b'i', b'n', b'i', b't', 1, 2, 4, 0, 0, 4, //
    192, 174, 139, 176, 13, 149, 154, 239, 58, 0, //
    1, // one event: a new body (1), then its time
    0, 7, b'S', b't', b'a', b'r', b't', b'e', b'd', 0, 0, //
    192, 174, 139, 176, 13, 149, 154, 239, 58, 0, //
    0, // no extensions
    3, b'w', b'e', b'b', 0x20, 0, 0, 0, 0, 4, //
    2, // two events: body 1 again, then a new body (2)
    1, 192, 174, 139, 176, 13, 149, 154, 239, 58, 0, //
    0, 10, b'T', b'e', b'r', b'm', b'i', b'n', b'a', b't', b'e', b'd', 1, b'x', //
    1, 9, b'e', b'x', b'i', b't', b'_', b'c', b'o', b'd', b'e', 1, b'1', //
    192, 174, 139, 176, 13, 149, 154, 239, 58, 0, //
    0,
];

#[test]
fn an_event_body_is_written_once_per_record() {
    let a = sample_with_events();
    assert_eq!(encode(&a), EVENTS);
    let back = decode(EVENTS).unwrap();
    assert_eq!(back, a);
    // Read back, the two Started events share one body.
    assert!(Arc::ptr_eq(
        back.tasks[0].events.all()[0].body(),
        back.tasks[1].events.all()[0].body()
    ));
}

#[test]
fn a_body_number_not_written_before_or_a_body_written_twice_is_damage() {
    // web's first event names body 2 while only body 1 is written.
    let at = EVENTS
        .windows(2)
        .position(|w| w == [2, 1])
        .expect("web's two events, the first body 1")
        + 1;
    let mut bytes = EVENTS.to_vec();
    bytes[at] = 2;
    let e = decode(&bytes).unwrap_err();
    assert!(e.contains("event body 2 of the 1 written before it"), "{e}");
    bytes[at] = 0x80; // a varint cut short by the time after it: still damage
    assert!(decode(&bytes).is_err());
    // web's first event writes body 1's text again instead of its
    // number: read alone it would be the same record, so it is refused
    // (a record has one encoding).
    let mut twice = EVENTS[..at].to_vec();
    twice.extend_from_slice(&[0, 7, b'S', b't', b'a', b'r', b't', b'e', b'd', 0, 0]);
    twice.extend_from_slice(&EVENTS[at + 1..]);
    let e = decode(&twice).unwrap_err();
    assert!(e.contains("event body 1 written again"), "{e}");
}

#[test]
fn tasks_sharing_their_events_write_each_body_once() {
    // The events benchmark's histories: five tasks, each given the
    // same ten events, then web ten of its own.
    let spec = AllocSpec::new(
        ["init", "proxy", "web", "announce", "cleanup"]
            .iter()
            .map(|t| task(t, None, false, false))
            .collect(),
        &Limits::default(),
    )
    .unwrap();
    let now = datetime!(2026-11-22 21:56:29.943529789 UTC);
    let mut a = Allocation::register(AllocId::parse("events-1").unwrap(), Arc::new(spec), 1, now);
    let event = |n: u64| {
        Event::new(
            "Started",
            now + Duration::from_millis(n * 1234),
            &format!("report {n} of this task, sent by the benchmark"),
            crate::lifecycle::Details::from_pairs([("exit_code", "0"), ("signal", "0")]),
        )
    };
    // Each report's message is in the record once, and it reads back.
    let once = |a: &Allocation, reports: &[u64]| {
        let bytes = encode(a);
        for n in reports {
            let text = format!("report {n} of this task");
            let found = bytes.windows(text.len()).filter(|w| *w == text.as_bytes());
            assert_eq!(found.count(), 1, "{text}");
        }
        assert_eq!(decode(&bytes).unwrap(), *a);
    };
    let shared: Vec<u64> = (0..MAX_EVENTS as u64).collect();
    for task in a.tasks.iter_mut() {
        task.events = shared.iter().copied().map(event).collect();
    }
    once(&a, &shared);
    let own: Vec<u64> = (100..100 + MAX_EVENTS as u64).collect();
    a.tasks[2].events = own.iter().copied().map(event).collect();
    once(&a, &[shared, own].concat());
}

#[test]
fn the_stop_order_is_kept_as_stored_not_recomputed() {
    let a = full();
    let back = decode(&encode(&a)).unwrap();
    assert_eq!(back.order(), a.order());
    // Its states alone call for another reason (init, the failed task,
    // is stale: it does not count).
    assert_ne!(
        back.order(),
        &crate::lifecycle::desired_states(&back.spec, &back.tasks)[0]
    );
    // A named task past the record's tasks is damage.
    let mut bytes = encode(&a);
    let at = bytes
        .windows(2)
        .position(|w| w == [2, 1])
        .expect("the order: Sibling Task Failed, task 1");
    bytes[at + 1] = 9;
    assert!(decode(&bytes).unwrap_err().contains("names task 9"));
}

#[test]
fn every_state_has_exactly_one_code() {
    fn check<T: PartialEq + Copy + std::fmt::Debug>(table: &[T], all: &[T]) {
        assert_eq!(table.len(), all.len());
        for v in all {
            assert_eq!(table.iter().filter(|t| *t == v).count(), 1, "{v:?}");
        }
    }
    check(&COORD, CoordState::ALL);
    check(&RUN, RunState::ALL);
    check(&HOOK, Hook::ALL);
}

#[test]
fn other_versions_are_refused_by_name() {
    let mut bytes = encode(&sample());
    for v in (0..=u8::MAX).filter(|&v| v != RECORD_VERSION) {
        bytes[0] = v;
        let err = decode(&bytes).unwrap_err();
        assert!(
            err.contains(&format!("record format version {v},")),
            "{err}"
        );
        assert!(err.contains("reads version 5 only"), "{err}");
    }
    assert!(decode(b"").is_err());
}

/// `bytes` cut at every length is refused; with any byte changed by
/// each of `flips` it is refused or decodes to what encodes back to
/// the same bytes, kept as stored and with one history's events made
/// after another (no change may panic or size anything past the
/// record).
fn cut_or_changed_is_refused_or_one_encoding(bytes: &[u8], flips: &[u8]) {
    for len in 0..bytes.len() {
        assert!(decode(&bytes[..len]).is_err(), "cut at {len}");
    }
    for at in 0..bytes.len() {
        for &flip in flips {
            let mut changed = bytes.to_vec();
            changed[at] ^= flip;
            if let Ok(mut a) = decode(&changed) {
                assert_eq!(encode(&a), changed, "byte {at} ^ {flip:#x}");
                for i in 0..a.tasks.len() {
                    let t = &mut a.tasks[i];
                    t.events = t.events.all().iter().cloned().collect();
                    assert_eq!(encode(&a), changed, "byte {at} ^ {flip:#x}, task {i} made");
                }
            }
        }
    }
}

#[test]
fn every_cut_and_changed_byte_is_refused_or_still_a_valid_record() {
    let bytes = encode(&full());
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(
        decode(&longer)
            .unwrap_err()
            .contains("after the record's end")
    );
    cut_or_changed_is_refused_or_one_encoding(&bytes, &[0x01, 0x02, 0x10, 0x40, 0x80, 0xff]);
}

mod properties {
    use super::*;
    use crate::wire::damage;
    use proptest::prelude::*;

    /// Decoding never panics, and whatever decodes is the one encoding
    /// of its record (so a damaged record is never read as another):
    /// with its histories kept as stored, with some of them made into
    /// events and with all of them, each of which neither panics nor
    /// reads them as others.
    fn check(bytes: &[u8]) -> Result<(), TestCaseError> {
        if let Ok(mut a) = decode(bytes) {
            prop_assert_eq!(encode(&a), bytes);
            for i in 0..a.tasks.len() {
                let t = &mut a.tasks[i];
                t.events = t.events.all().iter().cloned().collect();
                prop_assert_eq!(encode(&a), bytes, "task {} made", i);
            }
        }
        Ok(())
    }

    /// Any time an event can carry: local times across the years
    /// time holds, any offset (so some are, in UTC, past either end),
    /// the ends of 64-bit nanoseconds and their sentinel.
    fn any_time() -> impl Strategy<Value = Timestamp> {
        let (min, max) = (
            time::PrimitiveDateTime::MIN
                .assume_utc()
                .unix_timestamp_nanos(),
            time::PrimitiveDateTime::MAX
                .assume_utc()
                .unix_timestamp_nanos(),
        );
        let near = |at: i128| (-2i128..=2).prop_map(move |d| at + d);
        let nanos = prop_oneof![
            min..=max,
            any::<i64>().prop_map(i128::from),
            near(i128::from(i64::MIN)),
            near(i128::from(i64::MAX)),
            near(0),
            near(min + 2),
            near(max - 2),
        ];
        let offset = prop_oneof![Just(0i32), -93_599i32..=93_599, Just(-93_599), Just(93_599)];
        (nanos, offset).prop_filter_map("a time's local date and time is in range", |(n, o)| {
            let local = Timestamp::from_unix_timestamp_nanos(n).ok()?;
            let offset = time::UtcOffset::from_whole_seconds(o).ok()?;
            // The local date and time as given, at `offset`; and the
            // same instant at `offset` where that exists.
            Some(if n % 2 == 0 {
                time::PrimitiveDateTime::new(local.date(), local.time()).assume_offset(offset)
            } else {
                local.checked_to_offset(offset)?
            })
        })
    }

    fn any_event() -> impl Strategy<Value = Event> {
        let s = || "[ab]{0,3}";
        (
            s(),
            any_time(),
            s(),
            prop::collection::btree_map(s(), s(), 0..3),
        )
            .prop_map(|(kind, time, message, details)| {
                Event::new(
                    &kind,
                    time,
                    &message,
                    crate::lifecycle::Details::from_pairs(details),
                )
            })
    }

    proptest! {
        /// Any event's time comes back exactly, instant and offset,
        /// from the event and through a record, which re-encodes to
        /// the same bytes; a body read back is the one it was.
        #[test]
        fn events_of_any_time_and_text_round_trip_exactly(
            given in prop::collection::vec((any_time(), any_event()), 0..6)
        ) {
            let mut a = sample();
            let mut events = Vec::new();
            for (t, e) in &given {
                let again = Event::with_body(e.body().clone(), *t);
                prop_assert_eq!((again.time(), again.time().offset()), (*t, t.offset()));
                events.push(again);
                events.push(e.clone());
            }
            a.tasks[0].events = events.iter().cloned().collect();
            // web holds them too, the other way round: bodies shared
            // across tasks, written once, first by web or by init.
            a.tasks[1].events = events.iter().rev().cloned().collect();
            let bytes = encode(&a);
            let back = decode(&bytes);
            prop_assert!(back.is_ok(), "{:?}: {:?}", events, back);
            let back = back.unwrap();
            prop_assert_eq!(&back, &a);
            prop_assert_eq!(encode(&back), encode(&a));
            for (task, given) in [(0, events.clone()), (1, events.iter().rev().cloned().collect())] {
                prop_assert_eq!(back.tasks[task].events.len(), given.len());
                for (b, e) in back.tasks[task].events.all().iter().zip(&given) {
                    prop_assert_eq!((b.time(), b.time().offset()), (e.time(), e.time().offset()));
                    prop_assert!(Arc::ptr_eq(b.body(), e.body()));
                }
            }
        }
    }

    /// An event's text: type, message, details.
    type Text = (String, String, Vec<(String, String)>);

    fn any_text() -> impl Strategy<Value = Text> {
        let s = || "[ab]{0,2}";
        (
            s(),
            s(),
            prop::collection::btree_map(s(), s(), 0..3)
                .prop_map(|d| d.into_iter().collect::<Vec<_>>()),
        )
    }

    fn event_of_text(t: &Text, time: Timestamp) -> Event {
        Event::new(
            &t.0,
            time,
            &t.1,
            crate::lifecycle::Details::from_pairs(
                t.2.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            ),
        )
    }

    fn text_of(e: &Event) -> Text {
        (
            e.kind.to_string(),
            e.message.to_string(),
            e.details
                .iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(100))]

        /// Six tasks' events drawn from a pool of texts (past the
        /// encoder's scan, `Bodies::SCAN`), at any times: read back
        /// exactly, each text one body, each body the one given.
        #[test]
        fn bodies_shared_across_tasks_come_back_shared(
            pool in prop::collection::vec(any_text(), 1..12),
            numbered in 0usize..50,
            given in prop::collection::vec(
                prop::collection::vec((any::<prop::sample::Index>(), any_time()), 0..25),
                6,
            ),
        ) {
            let mut pool = pool;
            pool.extend((0..numbered).map(|i| (format!("k{i}"), String::new(), Vec::new())));
            let mut a = full();
            for (task, events) in a.tasks.iter_mut().zip(&given) {
                task.events = events
                    .iter()
                    .map(|(i, t)| event_of_text(&pool[i.index(pool.len())], *t))
                    .collect();
            }
            let bytes = encode(&a);
            let back = decode(&bytes);
            prop_assert!(back.is_ok(), "{:?}", back.err());
            let back = back.unwrap();
            prop_assert_eq!(&back, &a);
            prop_assert_eq!(encode(&back), encode(&a));
            let read: Vec<Event> = back.tasks.iter().flat_map(|t| t.events.all().to_vec()).collect();
            let written: Vec<Event> = a.tasks.iter().flat_map(|t| t.events.all().to_vec()).collect();
            prop_assert_eq!(read.len(), written.len());
            for (b, e) in read.iter().zip(&written) {
                prop_assert_eq!((b.time(), b.time().offset()), (e.time(), e.time().offset()));
                prop_assert_eq!(b.utc_nanos(), e.utc_nanos());
                prop_assert!(Arc::ptr_eq(b.body(), e.body()));
            }
            for x in &read {
                for y in &read {
                    prop_assert_eq!(
                        Arc::ptr_eq(&x.text_body(), &y.text_body()),
                        text_of(x) == text_of(y)
                    );
                }
            }
        }
    }

    /// Every byte of a record with forty bodies (past the scan),
    /// times its bodies hold and texts shared across tasks, with each
    /// of its bits flipped and all of them, and the record cut at
    /// every length:
    /// refused, or the one encoding of what it reads as.
    #[test]
    fn every_changed_byte_of_a_record_sharing_bodies() {
        let times = [
            datetime!(2026-11-21 10:00:00.123456789 UTC),
            datetime!(2026-11-21 10:00:00.123456789 +05:30),
            datetime!(1600-01-01 00:00:00 UTC),
        ];
        let mut a = full();
        for (n, task) in a.tasks.iter_mut().enumerate() {
            task.events = (0..12)
                .map(|i| {
                    let text = (
                        format!("k{}", (i * 5 + n * 3) % 40),
                        String::new(),
                        Vec::new(),
                    );
                    event_of_text(&text, times[(i + n) % 3])
                })
                .collect();
        }
        let bytes = encode(&a);
        assert_eq!(decode(&bytes).unwrap(), a);
        cut_or_changed_is_refused_or_one_encoding(
            &bytes,
            &[1, 2, 4, 8, 0x10, 0x20, 0x40, 0x80, 0xff],
        );
    }

    /// The encoder tells texts apart by pointer: a text made on
    /// another thread, dropped, swept from the table and made again by
    /// every constructor (`Event::new`, `with_body`, `at_utc_nanos`) is
    /// still one body, and the record reads back.
    #[test]
    fn a_text_made_again_after_sweeps_by_every_constructor_is_one_body() {
        let utc = datetime!(2026-11-21 10:00:00 UTC);
        let east = datetime!(2026-11-21 10:00:00 +01:00);
        let far = datetime!(1500-11-21 10:00:00 UTC);
        let kind = "made-again".to_owned();
        let k = kind.clone();
        std::thread::spawn(move || {
            drop(Event::new(&k, east, "", Default::default()));
            drop(EventBody::new(&k, "", Default::default()));
        })
        .join()
        .unwrap();
        // Sweeps in every shard (each sweeps when it doubles).
        for i in 0..50_000 {
            drop(EventBody::of_text(&format!("churn-{i}"), "", &[]));
        }
        let k = kind.clone();
        let elsewhere: Vec<Event> = std::thread::spawn(move || {
            [east, far, utc]
                .into_iter()
                .map(|t| Event::new(&k, t, "", Default::default()))
                .collect()
        })
        .join()
        .unwrap();
        let mut events = elsewhere.clone();
        let b = EventBody::of_text(&kind, "", &[]);
        events.push(Event::with_body(b.clone(), east));
        events.push(Event::at_utc_nanos(b, 5));
        events.push(Event::with_body(elsewhere[0].body().clone(), utc));
        events.push(Event::at_utc_nanos(elsewhere[1].body().clone(), 7));
        for e in &elsewhere {
            events.push(Event::new(&e.kind, e.time(), &e.message, e.details.clone()));
        }
        drop(elsewhere);
        for e in &events {
            assert!(Arc::ptr_eq(&e.text_body(), &events[2].text_body()));
        }
        let mut a = full();
        for (i, task) in a.tasks.iter_mut().enumerate() {
            task.events = events
                .iter()
                .cycle()
                .skip(i)
                .take(events.len())
                .cloned()
                .collect();
        }
        let bytes = encode(&a);
        let back = decode(&bytes).unwrap();
        assert_eq!(back, a);
        assert_eq!(encode(&back), bytes);
    }

    proptest! {
        /// An event's time is written as `put_time` writes it, byte for
        /// byte, whether the event holds it as UTC nanoseconds or its
        /// body holds it; and read back as the event written, kept as
        /// stored and made (its time read as UTC nanoseconds, or as a
        /// date).
        #[test]
        fn an_event_s_time_is_written_as_its_timestamp_is_and_read_back(
            t in any_time(),
            nanos in prop_oneof![any::<i64>(), -2_000_000_000i64..2_000_000_000],
        ) {
            let utc = Timestamp::from_unix_timestamp_nanos(i128::from(nanos)).unwrap();
            for t in [t, utc] {
                let e = Event::new("Started", t, "", Default::default());
                let mut a = sample();
                a.tasks[0].events = [e.clone()].into_iter().collect();
                let bytes = encode(&a);
                let mut time = Vec::new();
                put_time(&mut time, t);
                prop_assert!(bytes.windows(time.len()).any(|w| w == time), "{}", t);
                let back = decode(&bytes).unwrap();
                prop_assert!(back.tasks[0].events.is_stored());
                let read = back.tasks[0].events.all()[0].clone();
                prop_assert_eq!(&read, &e);
                prop_assert_eq!(read.utc_nanos(), e.utc_nanos());
                prop_assert_eq!((read.time(), read.time().offset()), (t, t.offset()));
                prop_assert_eq!(encode(&back), bytes);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn random_bytes_after_the_version(tail in prop::collection::vec(any::<u8>(), 0..300)) {
            let mut bytes = vec![RECORD_VERSION];
            bytes.extend(tail);
            check(&bytes)?;
        }

        #[test]
        fn records_with_bytes_changed_inserted_or_removed(
            edits in damage::edits(1..6)
        ) {
            let mut bytes = encode(&full());
            damage::apply(&mut bytes, edits);
            check(&bytes)?;
        }
    }
}

#[test]
fn a_record_is_not_reevaluated_on_load() {
    // A stored state that evaluation would move on is kept as stored.
    let mut a = sample();
    a.state = CoordState::Prestart;
    let back = decode(&encode(&a)).unwrap();
    assert_eq!(back.state, CoordState::Prestart);
}

/// A barrier member: its spec (name, size, timeout or none), where it
/// stands, and the stop order of a barrier that timed out, which names
/// the barrier by its member's position.
#[test]
fn barriers_and_their_stop_order_round_trip_and_refuse_damage() {
    let at = datetime!(2026-11-29 10:00:00.5 +01:00);
    let member = |n: &str, barrier: &str, timeout: Option<u64>| TaskSpec {
        barrier: Some(BarrierSpec {
            name: SemName::parse(barrier).unwrap(),
            size: 1000,
            timeout: timeout.map(Duration::from_millis),
        }),
        ..task(n, None, false, false)
    };
    let spec = AllocSpec::new(
        vec![
            task("init", Some(Hook::Prestart), false, false),
            member("w1", "train-1", Some(600_001)),
            member("w2", "train-2", None),
            member("w3", "train-3", Some(1000)),
        ],
        &Limits::default(),
    )
    .unwrap();
    let mut tasks = vec![TaskStatus::new(7); 4];
    tasks[1].set_meet(Some(Meet::Arrived { at }));
    tasks[2].set_meet(Some(Meet::Passed { at }));
    tasks[3].set_meet(Some(Meet::Closed { at }));
    let a = Allocation::from_parts(
        AllocId::parse("train-a").unwrap(),
        Arc::new(spec),
        CoordState::Prestart,
        tasks,
        Some(Desired::Stop(StopReason::barrier(
            SemName::parse("train-3").unwrap(),
        ))),
        7,
        9,
        at,
        at,
    );
    let bytes = encode(&a);
    let back = decode(&bytes).unwrap();
    assert_eq!(back, a);
    assert_eq!(
        back.order()
            .reason()
            .unwrap()
            .barrier
            .as_ref()
            .unwrap()
            .as_str(),
        "train-3"
    );
    cut_or_changed_is_refused_or_one_encoding(&bytes, &[0x01, 0x02, 0x80]);
    // The order names its member by position: one with no barrier is
    // damage.
    let mut bad = bytes.clone();
    let order = bad
        .windows(2)
        .position(|w| w == [6, 4])
        .expect("Barrier Timeout, task 4");
    bad[order + 1] = 1;
    assert!(
        decode(&bad)
            .unwrap_err()
            .contains("names no task with a barrier"),
        "{:?}",
        decode(&bad)
    );
}
