//! The disk store through the real binary, against damage no crash can
//! cause: write, stop (SIGKILL or SIGTERM), damage the data directory,
//! start, and compare with what was acknowledged. A start either holds
//! every acknowledged change or refuses, naming the file and the byte;
//! it never starts healthy with less.

mod common;

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Read},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use common::process::{Server, taskgate_bin};
use serde_json::{Value, json};

/// Allocation ID → the index its last acknowledged change got.
type Acked = BTreeMap<String, u64>;

fn spec() -> Value {
    json!({"tasks": [
        {"name": "init", "lifecycle": {"hook": "prestart"}},
        {"name": "proxy", "lifecycle": {"hook": "prestart", "sidecar": true}},
        {"name": "web", "leader": true},
        {"name": "announce", "lifecycle": {"hook": "poststart"}},
        {"name": "cleanup", "lifecycle": {"hook": "poststop"}}
    ]})
}

fn start(dir: &Path, log_limit: &str) -> Server {
    Server::start(&[
        "--data-dir",
        dir.to_str().unwrap(),
        "--store-log-limit",
        log_limit,
    ])
}

async fn healthy(base: &str) {
    let http = common::http();
    for _ in 0..3000 {
        if let Ok(res) = http.get(format!("{base}/v1/health")).send().await
            && res.status() == 200
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the server never became healthy");
}

/// Registers `ids` one after the other (an append each) and notes the
/// index each got.
async fn register(base: &str, ids: &[String], acked: &mut Acked) {
    let http = common::http();
    for id in ids {
        let res = http
            .put(format!("{base}/v1/allocations/{id}"))
            .json(&spec())
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 201, "{id}");
        acked.insert(id.clone(), index_of(&res));
    }
}

fn index_of(res: &reqwest::Response) -> u64 {
    res.headers()["x-taskgate-index"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// A task report with an event whose size never changes (its time given),
/// on `id`'s prestart task; `n` picks one of two messages, so that with a
/// full history of them every report changes the record; returns the
/// index it got.
async fn report(base: &str, id: &str, n: usize) -> u64 {
    let message = ["still here", "still there"][n % 2];
    let res = common::http()
        .put(format!("{base}/v1/allocations/{id}/tasks/init/state"))
        .json(&json!({"state": "pending", "event": {
            "type": "Tick", "time": "2024-01-01T00:00:00Z", "message": message}}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    index_of(&res)
}

/// Every acknowledged allocation is there at the index it was
/// acknowledged with.
async fn verify(base: &str, acked: &Acked) {
    let http = common::http();
    for (id, index) in acked {
        let res = http
            .get(format!("{base}/v1/allocations/{id}"))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "{id} was acknowledged at {index}");
        let body: Value = res.json().await.unwrap();
        assert_eq!(body["modify_index"], *index, "{id}");
    }
}

fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i:03}")).collect()
}

/// Starts `taskgate serve` on `dir`, which must refuse to start: returns
/// what it said. Panics if it started (it logged its address) instead.
fn refused(dir: &Path) -> String {
    let mut child = Command::new(taskgate_bin())
        .args(["serve", "--log", "info", "--listen", "127.0.0.1:0"])
        .args(["--data-dir", dir.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("taskgate starts");
    let stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // Its address logged: it started. Its output closed: it exited.
        let started = BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line.contains("addr="));
        let _ = tx.send(started);
    });
    let started = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the server starts or exits");
    if started {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the server started on a damaged data directory");
    }
    let status = child.wait().unwrap();
    assert!(!status.success(), "{status:?}");
    let mut said = String::new();
    stderr.read_to_string(&mut said).unwrap();
    said
}

fn segment(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("taskgate.wal.{seq:020}"))
}

/// Where each append of a log segment starts, and where the last ends:
/// after its 32-byte header, each frame's length is its first 4 bytes,
/// then an 12-byte head in all (docs/storage-format.md); zeros written
/// ahead follow the last.
fn append_starts(bytes: &[u8]) -> Vec<usize> {
    let mut at = 32;
    let mut starts = Vec::new();
    while at + 12 <= bytes.len() {
        starts.push(at);
        let len = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        if len == 0 {
            break;
        }
        at += 12 + len;
    }
    starts
}

/// The byte offsets named in a refusal: "byte N".
fn bytes_named(said: &str) -> Vec<usize> {
    said.split("byte ")
        .skip(1)
        .filter_map(|s| s.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
        .collect()
}

/// A sealed log segment cut exactly at an append's boundary — the appends
/// at its end gone, the segment after it intact — is refused, naming the
/// segment and the byte where the missing appends began; put back, every
/// acknowledged change is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_segment_cut_at_an_append_boundary_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut acked = Acked::new();
    // A segment per start.
    for round in ["a", "b", "c"] {
        let mut server = start(dir.path(), "64MiB");
        healthy(&server.base).await;
        register(&server.base, &ids(round, 6), &mut acked).await;
        server.child.kill().unwrap();
        server.child.wait().unwrap();
    }
    let first = segment(dir.path(), 1);
    let whole = std::fs::read(&first).unwrap();
    let last = *append_starts(&whole).last().unwrap();
    std::fs::write(&first, &whole[..last]).unwrap();
    let said = refused(dir.path());
    assert!(said.contains(&first.display().to_string()), "{said}");
    assert!(bytes_named(&said).contains(&last), "{said}");
    std::fs::write(&first, &whole).unwrap();
    let server = start(dir.path(), "64MiB");
    healthy(&server.base).await;
    verify(&server.base, &acked).await;
}

/// The checkpoints' count, from `/metrics`.
async fn checkpoints(base: &str) -> u64 {
    let text = common::http()
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("taskgate_store_checkpoint_duration_seconds_count "))
        .map_or(0, |n| n.trim().parse().unwrap())
}

/// Folds the whole log into the snapshot: a start with a 1-byte log
/// limit (which the store raises to a quarter of the snapshot's size),
/// changes (`id-<n>`) until one seals the segment and a checkpoint of
/// everything sealed is done, a clean stop.
async fn checkpoint(dir: &Path, id: &str, acked: &mut Acked) {
    let mut server = start(dir, "1B");
    healthy(&server.base).await;
    let mut n = 0;
    while checkpoints(&server.base).await == 0 {
        n += 1;
        assert!(n < 5000, "no checkpoint");
        register(&server.base, &[format!("{id}-{n}")], acked).await;
    }
    server.terminate();
    assert!(server.child.wait().unwrap().success());
}

/// Where a snapshot's record of `id` starts and how long it is (a 40-byte
/// header, 12-byte heads).
fn record_of(snapshot: &[u8], id: &str) -> (usize, usize) {
    let (mut at, head) = (40, 12);
    loop {
        let len = u32::from_le_bytes(snapshot[at..at + 4].try_into().unwrap()) as usize;
        let id_len = snapshot[at + head] as usize;
        if &snapshot[at + head + 1..at + head + 1 + id_len] == id.as_bytes() {
            return (at, head + len);
        }
        at += head + len;
    }
}

/// A 4 KiB block of an older snapshot copied over the same place in the
/// current one, holding an older version of an allocation of the same
/// size (each record in it passes its own checksum, the count is right):
/// refused, naming the snapshot and a byte in the block (or the start of
/// the record the block breaks) — not started
/// with the allocation back at its older index. Put back, every
/// acknowledged change is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_of_an_older_snapshot_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let snapshot = dir.path().join("taskgate.snapshot");
    let mut acked = Acked::new();
    let server = start(dir.path(), "64MiB");
    healthy(&server.base).await;
    register(&server.base, &ids("x", 100), &mut acked).await;
    // A full history of events, so the next ones replace as many bytes.
    for n in 0..10 {
        acked.insert("x050".into(), report(&server.base, "x050", n).await);
    }
    drop(server);
    checkpoint(dir.path(), "zz0", &mut acked).await;
    // A change of the same size: its record's time may take another
    // number of bytes, so tried until one does not (bounded).
    let mut tries = 0;
    let (older, current, at) = loop {
        tries += 1;
        assert!(tries <= 20, "no change of the same size");
        let older = std::fs::read(&snapshot).unwrap();
        let server = start(dir.path(), "64MiB");
        healthy(&server.base).await;
        let before = acked["x050"];
        let index = report(&server.base, "x050", tries).await;
        assert!(index > before, "a change");
        acked.insert("x050".into(), index);
        drop(server);
        checkpoint(dir.path(), &format!("zz{tries}"), &mut acked).await;
        let current = std::fs::read(&snapshot).unwrap();
        let (at, len) = record_of(&current, "x050");
        if record_of(&older, "x050") == (at, len) {
            break (older, current, at);
        }
    };
    let block = at / 4096 * 4096..(at / 4096 + 1) * 4096;
    assert!(block.start >= 4096 && block.end < current.len() - 24);
    let mut mixed = current.clone();
    mixed[block.clone()].copy_from_slice(&older[block.clone()]);
    assert!(mixed != current, "the block holds the older version");
    std::fs::write(&snapshot, &mixed).unwrap();
    let said = refused(dir.path());
    assert!(said.contains(&snapshot.display().to_string()), "{said}");
    // The byte named is in the block, or starts the record the block
    // breaks, which may begin before it.
    let head = if current[7] == 1 { 8 } else { 12 };
    let breaks = |b: usize| {
        block.contains(&b)
            || (b < block.start
                && b + 4096 > block.start
                && b + head + u32::from_le_bytes(current[b..b + 4].try_into().unwrap()) as usize
                    > block.start)
    };
    assert!(bytes_named(&said).into_iter().any(breaks), "{said}");
    std::fs::write(&snapshot, &current).unwrap();
    let server = start(dir.path(), "64MiB");
    healthy(&server.base).await;
    verify(&server.base, &acked).await;
}

/// Two data directories with the same shape (a snapshot that folded the
/// same segments, a log after it): the snapshot of one with the log of
/// the other (an older snapshot with a newer log) is refused, naming the
/// segment that does not follow it and the snapshot — not started with
/// the other's allocations and without this one's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_with_a_log_that_does_not_follow_it_is_refused() {
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let mut acked = [Acked::new(), Acked::new()];
    for (d, (acked, prefix)) in dirs.iter().zip(acked.iter_mut().zip(["a", "b"])) {
        let server = start(d.path(), "64MiB");
        healthy(&server.base).await;
        register(&server.base, &ids(prefix, 20), acked).await;
        drop(server);
        checkpoint(d.path(), &format!("{prefix}-folded"), acked).await;
        let mut server = start(d.path(), "64MiB");
        healthy(&server.base).await;
        register(&server.base, &ids(&format!("{prefix}-log"), 5), acked).await;
        server.child.kill().unwrap();
        server.child.wait().unwrap();
    }
    let [mine, theirs] = &dirs;
    let name = "taskgate.snapshot";
    let own = std::fs::read(mine.path().join(name)).unwrap();
    std::fs::copy(theirs.path().join(name), mine.path().join(name)).unwrap();
    let said = refused(mine.path());
    assert!(said.contains(name), "{said}");
    assert!(said.contains("taskgate.wal."), "{said}");
    std::fs::write(mine.path().join(name), own).unwrap();
    let server = start(mine.path(), "64MiB");
    healthy(&server.base).await;
    verify(&server.base, &acked[0]).await;
}

/// Runs `taskgate dump --data-dir FROM --salvage TO`; returns its exit
/// code and report.
fn salvage(from: &Path, to: &Path) -> (i32, String) {
    let out = Command::new(taskgate_bin())
        .args(["dump", "--data-dir", from.to_str().unwrap()])
        .args(["--salvage", to.to_str().unwrap()])
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    let said = String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), format!("{report}{said}"))
}

/// Salvage by index: the newest version of each allocation wins wherever
/// it lies. A checkpoint folded the log (`x` at a newer index) and
/// stopped before removing the segment it folded (`x` at an older
/// index); the snapshot's header is damaged, so salvage cannot know what
/// it folded and reads that segment too: its older `x` must not win.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salvage_keeps_the_newest_version_of_each_allocation() {
    let dir = tempfile::tempdir().unwrap();
    let mut acked = Acked::new();
    let server = start(dir.path(), "64MiB");
    healthy(&server.base).await;
    register(&server.base, &ids("x", 3), &mut acked).await;
    acked.insert("x001".into(), report(&server.base, "x001", 0).await);
    drop(server);
    let first = segment(dir.path(), 1);
    let folded = std::fs::read(&first).unwrap();
    // Newer changes of x001 in the next segment, then a checkpoint of both.
    let server = start(dir.path(), "64MiB");
    healthy(&server.base).await;
    for n in 1..4 {
        acked.insert("x001".into(), report(&server.base, "x001", n).await);
    }
    drop(server);
    checkpoint(dir.path(), "y", &mut acked).await;
    assert!(!first.exists(), "the checkpoint removed what it folded");
    std::fs::write(&first, &folded).unwrap();
    let snapshot = dir.path().join("taskgate.snapshot");
    let mut bytes = std::fs::read(&snapshot).unwrap();
    bytes[9] ^= 0x01;
    std::fs::write(&snapshot, &bytes).unwrap();
    let to = tempfile::tempdir().unwrap();
    let to = to.path().join("salvaged");
    let (code, said) = salvage(dir.path(), &to);
    assert_eq!(code, 3, "{said}");
    assert!(said.contains("its header is damaged"), "{said}");
    let server = start(&to, "64MiB");
    healthy(&server.base).await;
    verify(&server.base, &acked).await;
}

/// The bytes of a log frame that deletes `victim` at index `index` or
/// near it, every byte of it ASCII so that it can be an event message:
/// what an agent that knows the format could write.
fn fake_frame(victim: &str, mut index: u64) -> Vec<u8> {
    let ascii = |b: &[u8]| b.iter().all(|&c| c < 0x80);
    loop {
        index += 1;
        let mut change = vec![2u8];
        change.extend_from_slice(&index.to_le_bytes());
        change.push(victim.len() as u8);
        change.extend_from_slice(victim.as_bytes());
        let mut payload = (change.len() as u32).to_le_bytes().to_vec();
        payload.extend_from_slice(&change);
        let len = (payload.len() as u32).to_le_bytes();
        let mut h = crc32fast::Hasher::new();
        h.update(&len);
        h.update(&payload);
        let crc = h.finalize().to_le_bytes();
        let mut frame = len.to_vec();
        frame.extend_from_slice(&crc);
        frame.extend_from_slice(b"AAAA");
        frame.extend_from_slice(&payload);
        if ascii(&frame) {
            return frame;
        }
    }
}

/// An agent writes, inside an event message, bytes that read as a log
/// frame deleting another allocation at an index of its choosing. Its
/// append's head is then damaged: salvage must read past it, and must
/// not take the frame inside it — the other allocation is there, and the
/// indexes do not jump. What salvage cannot prove is named, and it exits 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salvage_never_takes_a_frame_written_inside_an_event_message() {
    let dir = tempfile::tempdir().unwrap();
    let mut acked = Acked::new();
    let server = start(dir.path(), "64MiB");
    healthy(&server.base).await;
    register(&server.base, &ids("victim", 3), &mut acked).await;
    register(&server.base, &["agent".to_owned()], &mut acked).await;
    // Indexes below 2^56 whose bytes are ASCII.
    let fake = fake_frame("victim001", 0x0100_0000_0000_0000);
    let message = format!(
        "all is well{}and more",
        String::from_utf8(fake.clone()).unwrap()
    );
    let res = common::http()
        .put(format!(
            "{}/v1/allocations/agent/tasks/init/state",
            server.base
        ))
        .json(&json!({"state": "pending", "event": {"type": "Note", "message": message}}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    register(&server.base, &ids("later", 2), &mut acked).await;
    drop(server);
    // The head of the append that holds the message: its checksum and its
    // chain damaged, so nothing vouches for where it ends.
    let path = segment(dir.path(), 1);
    let mut bytes = std::fs::read(&path).unwrap();
    let inside = bytes
        .windows(fake.len())
        .position(|w| w == fake.as_slice())
        .unwrap();
    let container = *append_starts(&bytes)
        .iter()
        .rfind(|&&at| at < inside)
        .unwrap();
    bytes[container + 5] ^= 0x20;
    bytes[container + 9] ^= 0x20;
    std::fs::write(&path, &bytes).unwrap();
    let said = refused(dir.path());
    assert!(bytes_named(&said).contains(&container), "{said}");
    let to = tempfile::tempdir().unwrap();
    let to = to.path().join("salvaged");
    let (code, said) = salvage(dir.path(), &to);
    assert_eq!(code, 3, "{said}");
    assert!(
        said.contains(&format!("bytes {container} to ")),
        "the damaged append is named: {said}"
    );
    // Written before the lost append: their last index cannot be proven.
    assert!(
        said.contains(r#"unproven: allocation "victim001": salvaged at index"#),
        "{said}"
    );
    assert!(!said.contains(r#""later000""#), "{said}");
    let server = start(&to, "64MiB");
    healthy(&server.base).await;
    // The agent's allocation is back at its registration (the report
    // was in the lost append, and was never noted); all the others are as
    // acknowledged, the victim included.
    verify(&server.base, &acked).await;
    let last = common::http()
        .get(format!("{}/v1/allocations", server.base))
        .send()
        .await
        .unwrap();
    assert!(index_of(&last) < 1 << 40, "indexes did not jump");
}

/// The first line of `GET /v1/events?index=N`.
async fn first_event(base: &str, index: u64) -> Value {
    let mut res = common::http()
        .get(format!("{base}/v1/events?index={index}"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let mut line = Vec::new();
    while !line.contains(&b'\n') {
        let chunk = tokio::time::timeout(Duration::from_secs(60), res.chunk())
            .await
            .expect("a line within the heartbeat")
            .unwrap()
            .expect("the stream goes on");
        line.extend_from_slice(&chunk);
    }
    let end = line.iter().position(|&b| b == b'\n').unwrap();
    serde_json::from_slice(&line[..end]).unwrap()
}

/// Indexes only go up, across restarts, for readers too. Writes refused
/// while checkpoints fail (the snapshot damaged under the running server,
/// the log at its ceiling) still take indexes; a reader must not go past
/// them, since nothing durable holds them and after a restart new changes
/// take them again: a reader that goes on from where it was gets those
/// changes (before: it had gone past them, and waited in silence). A
/// reader ahead of every index the server has reached is told to resync
/// at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_never_goes_past_an_index_a_restart_hands_out_again() {
    let dir = tempfile::tempdir().unwrap();
    let snapshot = dir.path().join("taskgate.snapshot");
    let mut server = Server::start(&[
        "--data-dir",
        dir.path().to_str().unwrap(),
        "--store-log-limit",
        "4KiB",
        "--store-log-ceiling",
        "16KiB",
    ]);
    healthy(&server.base).await;
    let http = common::http();
    let mut acked = Acked::new();
    let mut n = 0;
    while checkpoints(&server.base).await == 0 {
        n += 1;
        assert!(n < 5000, "no checkpoint");
        register(&server.base, &[format!("a{n}")], &mut acked).await;
    }
    // Damaged under the running server: every later checkpoint fails,
    // and the log grows to its ceiling. (A checkpoint already running
    // may still put a good one in its place: damaged again then.)
    let (mut good, mut damaged) = (Vec::new(), Vec::new());
    let mut refused = 0;
    while refused < 3 {
        n += 1;
        assert!(n < 5000, "never refused");
        let now = std::fs::read(&snapshot).unwrap();
        if now != damaged {
            damaged = now.clone();
            let middle = damaged.len() / 2;
            damaged[middle] ^= 0x08;
            std::fs::write(&snapshot, &damaged).unwrap();
            good = now;
        }
        let res = http
            .put(format!("{}/v1/allocations/a{n}", server.base))
            .json(&spec())
            .send()
            .await
            .unwrap();
        match res.status().as_u16() {
            201 => {
                acked.insert(format!("a{n}"), index_of(&res));
            }
            503 => refused += 1,
            other => panic!("{other}"),
        }
    }
    let listed = http
        .get(format!("{}/v1/allocations", server.base))
        .send()
        .await
        .unwrap();
    let reader_at = index_of(&listed);
    assert!(reader_at >= acked.values().copied().max().unwrap());
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    std::fs::write(&snapshot, &good).unwrap();

    let server = start(dir.path(), "64MiB");
    healthy(&server.base).await;
    verify(&server.base, &acked).await;
    register(&server.base, &["after".to_owned()], &mut acked).await;
    let line = first_event(&server.base, reader_at).await;
    assert!(
        line["type"] == "Resync" || line["alloc_id"] == "after",
        "a reader at {reader_at} after the restart: {line}"
    );
    let ahead = acked["after"] + 1000;
    let line = first_event(&server.base, ahead).await;
    assert_eq!(line["type"], "Resync", "{line}");
}

/// A log segment, then the snapshot, whose magic names another format:
/// the start is refused, naming the file and the format this build
/// reads, and changes nothing; put back, every acknowledged change is
/// there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_of_another_format_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut acked = Acked::new();
    checkpoint(dir.path(), "folded", &mut acked).await;
    let server = start(dir.path(), "64MiB");
    healthy(&server.base).await;
    register(&server.base, &ids("logged", 3), &mut acked).await;
    drop(server);
    let newest = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_str().unwrap();
            name.starts_with("taskgate.wal.") && name.len() == "taskgate.wal.".len() + 20
        })
        .max()
        .unwrap();
    let snapshot = dir.path().join("taskgate.snapshot");
    for (path, what, other, reads) in [
        (&newest, "log segment", 2, 3),
        (&snapshot, "snapshot", 1, 2),
    ] {
        let whole = std::fs::read(path).unwrap();
        let mut changed = whole.clone();
        changed[7] = other;
        std::fs::write(path, &changed).unwrap();
        let said = refused(dir.path());
        assert!(said.contains(&path.display().to_string()), "{said}");
        let says = format!("{what} format {other}, but this taskgate reads format {reads} only");
        assert!(said.contains(&says), "{said}");
        assert_eq!(std::fs::read(path).unwrap(), changed, "unchanged");
        std::fs::write(path, &whole).unwrap();
    }
    let server = start(dir.path(), "64MiB");
    healthy(&server.base).await;
    verify(&server.base, &acked).await;
}

/// Every file of a data directory but its lock, by name.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap() != "taskgate.lock")
        .map(|p| {
            let name = p.file_name().unwrap().to_str().unwrap().to_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect()
}

fn put_files(dir: &Path, files: &BTreeMap<String, Vec<u8>>) {
    for (name, bytes) in files {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

/// A snapshot and three segments after it, the newest left by a SIGKILL
/// (zeros written ahead of its appends): what every damage case below
/// starts from.
async fn snapshot_and_log(dir: &Path, acked: &mut Acked) -> BTreeMap<String, Vec<u8>> {
    checkpoint(dir, "folded", acked).await;
    for round in ["a", "b", "c"] {
        let mut server = start(dir, "64MiB");
        healthy(&server.base).await;
        register(&server.base, &ids(round, 8), acked).await;
        server.child.kill().unwrap();
        server.child.wait().unwrap();
    }
    files(dir)
}

/// The newest segment's name among `files`.
fn newest_segment(files: &BTreeMap<String, Vec<u8>>) -> String {
    files
        .keys()
        .filter(|n| n.starts_with("taskgate.wal.") && n.len() == "taskgate.wal.".len() + 20)
        .max()
        .unwrap()
        .clone()
}

/// Damage that takes acknowledged changes away without leaving a frame
/// that fails its checks — a header naming an older format, removed
/// files, the newest segment cut short — is refused, naming what is
/// missing, and a refused start changes no byte of the directory (it
/// used to start healthy with the changes gone, or cut the newest
/// segment before refusing a damaged store ID). Put back, every
/// acknowledged change is there; a torn last append (what a crash
/// leaves) is still cut off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damage_that_removes_acknowledged_changes_is_refused_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut acked = Acked::new();
    let whole = snapshot_and_log(dir.path(), &mut acked).await;
    let newest = newest_segment(&whole);
    let log_bytes = &whole[&newest];
    let starts = append_starts(log_bytes);
    let zeros_from = *starts.last().unwrap();
    assert!(
        log_bytes[zeros_from..].iter().all(|&b| b == 0),
        "zeros ahead"
    );
    let appends = &starts[..starts.len() - 1];
    assert_eq!(appends.len(), 8, "one append per registration");
    let segments: Vec<String> = whole
        .keys()
        .filter(|n| n.starts_with("taskgate.wal.0"))
        .cloned()
        .collect();
    // A torn last append (a crash during it): its head's sector never
    // written, a later one of its payload written.
    let mut torn = log_bytes.clone();
    let later = (zeros_from + 12).next_multiple_of(512);
    torn[later..later + 9].copy_from_slice(b"torn torn");
    type Damage = Box<dyn Fn(&mut BTreeMap<String, Vec<u8>>)>;
    let cut = |at: usize| -> Damage {
        let newest = newest.clone();
        Box::new(move |f| {
            f.get_mut(&newest).unwrap().truncate(at);
        })
    };
    let remove = |names: Vec<String>| -> Damage {
        Box::new(move |f| {
            for n in &names {
                f.remove(n).unwrap();
            }
        })
    };
    let mut all_files: Vec<String> = segments.clone();
    all_files.push("taskgate.snapshot".into());
    let cases: Vec<(&str, Damage, String)> = vec![
        (
            "header says format 1",
            Box::new({
                let newest = newest.clone();
                move |f| f.get_mut(&newest).unwrap()[7] = 1
            }),
            newest.clone(),
        ),
        (
            "newest removed",
            remove(vec![newest.clone()]),
            newest.clone(),
        ),
        (
            "every segment removed",
            remove(segments.clone()),
            newest.clone(),
        ),
        (
            "snapshot and segments removed",
            remove(all_files.clone()),
            "taskgate.snapshot".into(),
        ),
        (
            "everything but the store ID removed",
            Box::new({
                let all = all_files.clone();
                move |f| f.retain(|n, _| n == "store-id" && !all.contains(n))
            }),
            "store-id".into(),
        ),
        (
            "cut at an append in its middle",
            cut(appends[4]),
            newest.clone(),
        ),
        (
            "cut inside an append in its middle",
            cut(appends[4] + 30),
            newest.clone(),
        ),
        ("cut to its bare header", cut(32), newest.clone()),
        (
            "cut at its last append's end",
            cut(zeros_from),
            newest.clone(),
        ),
        (
            "a torn tail and a damaged store ID",
            Box::new({
                let (newest, torn) = (newest.clone(), torn.clone());
                move |f| {
                    f.insert(newest.clone(), torn.clone());
                    f.insert("store-id".into(), b"damaged\n".to_vec());
                }
            }),
            "store-id".into(),
        ),
    ];
    for (case, damage, named) in cases {
        let copy = tempfile::tempdir().unwrap();
        let mut damaged = whole.clone();
        damage(&mut damaged);
        put_files(copy.path(), &damaged);
        let said = refused(copy.path());
        let named = copy.path().join(&named).display().to_string();
        assert!(said.contains(&named), "{case}: names {named}: {said}");
        assert_eq!(files(copy.path()), damaged, "{case}: the directory changed");
    }
    // What a crash leaves starts, the torn append cut off.
    let copy = tempfile::tempdir().unwrap();
    let mut crashed = whole.clone();
    crashed.insert(newest.clone(), torn);
    put_files(copy.path(), &crashed);
    let server = start(copy.path(), "64MiB");
    healthy(&server.base).await;
    verify(&server.base, &acked).await;
    drop(server);
    let server = start(dir.path(), "64MiB");
    healthy(&server.base).await;
    verify(&server.base, &acked).await;
}

/// Salvage of a directory whose newest segment was removed says so and
/// exits non-zero: it did not read everything acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salvage_says_when_a_segment_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let mut acked = Acked::new();
    let whole = snapshot_and_log(dir.path(), &mut acked).await;
    let newest = newest_segment(&whole);
    std::fs::remove_file(dir.path().join(&newest)).unwrap();
    let to = tempfile::tempdir().unwrap();
    let to = to.path().join("salvaged");
    let (code, said) = salvage(dir.path(), &to);
    assert_ne!(code, 0, "{said}");
    assert!(said.contains(&newest), "{said}");
    assert!(said.contains("missing"), "{said}");
}

/// `PUT /v1/allocations/h/tasks/{task}/state` with this event (`time`
/// given unless `None`), in run `run` if the task runs one; the answer.
async fn event(base: &str, task: &str, run: Option<&str>, kind: &str, time: Option<&str>) -> Value {
    let mut event = json!({"type": kind, "message": format!("{kind} of {task}")});
    if kind == "Terminated" {
        event["details"] = json!({"exit_code": "1", "signal": "0"});
    }
    if let Some(t) = time {
        event["time"] = json!(t);
    }
    let mut req = common::http()
        .put(format!("{base}/v1/allocations/h/tasks/{task}/state"))
        .json(&json!({"state": "running", "event": event}));
    if let Some(run) = run {
        req = req.header("taskgate-run", run);
    }
    let res = req.send().await.unwrap();
    assert_eq!(res.status(), 200, "{task} {kind}");
    res.json().await.unwrap()
}

async fn get(base: &str, path: &str) -> Value {
    let res = common::http()
        .get(format!("{base}{path}"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200, "{path}");
    res.json().await.unwrap()
}

/// The events of task `i` in an allocation's view.
fn events_of(view: &Value, i: usize) -> Vec<Value> {
    view["tasks"][i]["events"].as_array().unwrap().clone()
}

/// The agents' events on an allocation's timeline, as `type task`.
async fn agent_entries(base: &str) -> Vec<String> {
    let timeline = get(base, "/v1/allocations/h/events").await;
    (timeline["events"].as_array().unwrap().iter())
        .filter(|e| e["details"]["source"] == "agent")
        .map(|e| {
            format!(
                "{} {}",
                e["type"].as_str().unwrap(),
                e["task"].as_str().unwrap()
            )
        })
        .collect()
}

/// A server on `dir`, healthy, with allocation `h` of `spec` registered.
async fn started_with_h(dir: &Path, spec: Value) -> Server {
    let server = start(dir, "64MiB");
    healthy(&server.base).await;
    let res = common::http()
        .put(format!("{}/v1/allocations/h", server.base))
        .json(&spec)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    server
}

/// A task's history read from the data directory (kept as its stored
/// bytes until asked for) is the events it was before a SIGKILL, in the
/// allocation's view, on the event stream, in `dump` and in what `dump
/// --salvage` copies: times far from
/// 1970, given in another offset and on the server's clock, bodies said
/// again, details. From there a report's event and a restart order are
/// each their own entry on the timeline (not the whole history again),
/// the history grows by one, dropping its oldest, and reads so after the
/// next start too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_s_events_read_the_same_after_a_restart_and_grow_from_there() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = started_with_h(
        dir.path(),
        json!({"tasks": [{"name": "web"}, {"name": "side"}]}),
    )
    .await;
    let base = server.base.clone();
    let run = |view: &Value, i: usize| view["tasks"][i]["run"].as_str().unwrap().to_owned();
    let web = run(
        &event(
            &base,
            "web",
            None,
            "Started",
            Some("2026-11-29T10:00:00.25Z"),
        )
        .await,
        0,
    );
    let side = run(
        &event(
            &base,
            "side",
            None,
            "Started",
            Some("2026-11-29T10:00:00.25Z"),
        )
        .await,
        1,
    );
    // Eleven more on web: its history full, the first two dropped.
    for (kind, time) in [
        ("Terminated", Some("2026-11-29T10:00:01Z")),
        ("Started", Some("2026-11-29T10:00:02Z")),
        ("Far", Some("2300-01-01T00:00:00Z")),
        ("Long Ago", Some("1500-06-01T12:00:00+05:30")),
        ("Terminated", Some("2026-11-29T10:00:03Z")),
        ("Now", None),
        ("Started", Some("1969-12-31T23:59:59.5Z")),
        ("Far", Some("2300-01-01T00:00:00Z")),
        ("Terminated", Some("2026-11-29T10:00:04Z")),
        ("Started", Some("2262-04-11T23:47:16.854775807Z")),
        ("Started", Some("2262-04-11T23:47:16.854775808Z")),
    ] {
        event(&base, "web", Some(&web), kind, time).await;
    }
    let before = get(&base, "/v1/allocations/h").await;
    assert_eq!(events_of(&before, 0).len(), 10);
    assert_eq!(events_of(&before, 0)[0]["time"], "2026-11-29T10:00:02Z");
    assert_eq!(events_of(&before, 0)[2]["time"], "1500-06-01T06:30:00Z");
    server.child.kill().unwrap();
    server.child.wait().unwrap();

    let out = Command::new(taskgate_bin())
        .args(["dump", "--data-dir", dir.path().to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dumped: Value =
        serde_json::from_slice(out.stdout.split(|&b| b == b'\n').next().unwrap()).unwrap();
    assert_eq!(dumped["id"], "h");
    for i in 0..2 {
        assert_eq!(
            events_of(&dumped, i),
            events_of(&before, i),
            "dump, task {i}"
        );
    }
    // Salvaged into a new directory, the same allocation.
    let to = tempfile::tempdir().unwrap();
    let (code, said) = salvage(dir.path(), &to.path().join("salvaged"));
    assert_eq!(code, 0, "{said}");
    let salvaged = start(&to.path().join("salvaged"), "64MiB");
    healthy(&salvaged.base).await;
    assert_eq!(get(&salvaged.base, "/v1/allocations/h").await, before);
    drop(salvaged);

    let mut server = start(dir.path(), "64MiB");
    let base = server.base.clone();
    healthy(&base).await;
    assert_eq!(get(&base, "/v1/allocations/h").await, before);
    assert_eq!(agent_entries(&base).await, Vec::<String>::new());
    // A report to side: the stream's line holds web's history as read.
    let poked = event(&base, "side", Some(&side), "Poke", None).await;
    let index = poked["modify_index"].as_u64().unwrap();
    let line = first_event(&base, index - 1).await;
    assert_eq!(line["index"], index, "{line}");
    assert_eq!(events_of(&line["allocation"], 0), events_of(&before, 0));
    let mut side_events = events_of(&before, 1);
    side_events.push(events_of(&poked, 1)[1].clone());
    assert_eq!(events_of(&line["allocation"], 1), side_events);
    assert_eq!(events_of(&poked, 1)[1]["type"], "Poke");
    assert_eq!(agent_entries(&base).await, ["Poke side"]);
    // A restart order: its "Restart Signaled" on the timeline and at the
    // end of web's history, none of web's earlier events again.
    let res = common::http()
        .post(format!("{base}/v1/allocations/h/restart"))
        .json(&json!({"task": "web", "reason": "after a start"}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let timeline = get(&base, "/v1/allocations/h/events").await;
    let order = (timeline["events"].as_array().unwrap().iter())
        .find(|e| e["type"] == "Restart Order")
        .unwrap_or_else(|| panic!("no restart order: {timeline}"));
    assert_eq!(order["details"]["reason"], "after a start", "{order}");
    assert_eq!(order["details"]["tasks"], "web", "{order}");
    assert_eq!(agent_entries(&base).await, ["Poke side"]);
    let after = get(&base, "/v1/allocations/h").await;
    let web_events = events_of(&after, 0);
    assert_eq!(web_events[..9], events_of(&before, 0)[1..]);
    assert_eq!(web_events[9]["type"], "Restart Signaled");
    server.child.kill().unwrap();
    server.child.wait().unwrap();

    let server = start(dir.path(), "64MiB");
    healthy(&server.base).await;
    assert_eq!(get(&server.base, "/v1/allocations/h").await, after);
}

/// A running task under a TTL whose agent is not heard after a SIGKILL
/// and a start is lost from its history as read from the data directory:
/// "Agent Lost" ends the events it had (far times, a body said again), it
/// is one entry on the timeline with none of the earlier events, and the
/// next start reads it so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_lost_after_a_restart_keeps_the_events_it_had() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = started_with_h(
        dir.path(),
        json!({"tasks": [{"name": "web", "liveness": {"ttl": "3s"}}]}),
    )
    .await;
    let base = server.base.clone();
    let up = event(&base, "web", None, "Started", Some("2026-11-29T10:00:00Z")).await;
    let web = up["tasks"][0]["run"].as_str().unwrap().to_owned();
    for (kind, time) in [
        ("Far", Some("2300-01-01T00:00:00Z")),
        ("Long Ago", Some("1500-06-01T12:00:00+05:30")),
        ("Started", Some("2026-11-29T10:00:01Z")),
    ] {
        event(&base, "web", Some(&web), kind, time).await;
    }
    let before = get(&base, "/v1/allocations/h").await;
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    assert_eq!(before["tasks"][0]["lost"], false, "{before}");
    assert_eq!(events_of(&before, 0).len(), 4);

    let mut server = start(dir.path(), "64MiB");
    let base = server.base.clone();
    healthy(&base).await;
    let mut lost = Value::Null;
    for _ in 0..3000 {
        lost = get(&base, "/v1/allocations/h").await;
        if lost["tasks"][0]["lost"] == true {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(lost["tasks"][0]["lost"], true, "never lost: {lost}");
    let events = events_of(&lost, 0);
    assert_eq!(events[..4], events_of(&before, 0));
    assert_eq!(events[4]["type"], "Agent Lost", "{lost}");
    let timeline = get(&base, "/v1/allocations/h/events").await;
    let types: Vec<&str> = (timeline["events"].as_array().unwrap().iter())
        .filter(|e| e["task"] == "web" && e["type"] != "Task State")
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(types, ["Agent Lost"], "{timeline}");
    server.child.kill().unwrap();
    server.child.wait().unwrap();

    let server = start(dir.path(), "64MiB");
    healthy(&server.base).await;
    let again = get(&server.base, "/v1/allocations/h").await;
    assert_eq!(events_of(&again, 0), events);
}
