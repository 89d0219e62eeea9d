//! The etcd store: any number of replicas over one etcd key prefix.
//!
//! One key per allocation (`<prefix>a/<id>`), its value the record in the
//! same binary encoding the disk store writes. Indexes are etcd revisions:
//! a record is written with a placeholder index (above every index in it)
//! and read back with the placeholder replaced by the key's `mod_revision`,
//! so an allocation's `modify_index` is its key's `mod_revision`, and a
//! task's is the revision of the write that last changed it. Deletions are
//! etcd deletes; their revisions keep the index going up.
//!
//! Writes are compare-and-swap transactions on `mod_revision`
//! (`Store::append`). Reads come from the replica's view: the prefix
//! listed once, then one prefix watch from the revision after the listing
//! (`follow`), which publishes every change in revision order. A watch
//! canceled by a compaction lists the prefix again (`Follower::resync`).
//! A member that loses its quorum cancels the watch (`require_leader`),
//! and a member that stops answering is found by a linearizable read
//! every `CHECK_EVERY`: either way the watch moves to the next member.
//!
//! Tasks under a TTL keep their signs of life in keys of their own
//! (`<prefix>live/`, `live.rs`), under leases the replicas renew
//! (`keep.rs`): the same listing and the same watch carry them, so a
//! replica's view holds them in revision order with the records.
//!
//! Semaphores have a key each, `<prefix>sem/<name>`, their value the
//! semaphore's record (`record::encode_semaphore`) written and read back
//! as an allocation's is (a placeholder index, stamped with the key's
//! `mod_revision`). The listing reads them too, and the one watch runs
//! from `<prefix>a/` to the end of `<prefix>sem/`, which holds `live/`
//! between them (and not `<prefix>store-id`, which sorts after `sem0`).
//! A put of an allocation that grants semaphores (`Append::grants`) holds
//! only while each is still at the revision the grant was decided on,
//! and writes each again in the same transaction, so its revision moves:
//! two replicas' grants decided on one view of a semaphore cannot both
//! commit.

pub mod client;
mod keep;
pub mod live;
pub mod proto;

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex, PoisonError, Weak,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use client::{CallError, Client, Guards, Swapped};
pub use client::{EtcdConfig, prefix_end};
use tokio::sync::watch;

use super::{
    Append, AppendError, Appended, Change, Follower, Lease, Leases, LiveOp, LoadOnce, Loaded, Op,
    QuorumRead, Store, StoreError, StoreHealth, Unreadable, record,
};
use crate::{
    lifecycle::{AllocId, Allocation, SemName, Semaphore, WriteMark},
    supervise::Supervisor,
};

/// Keys listed per request at start and on a resync.
const PAGE: u64 = 500;
/// How often the member the watch is on is asked to read through its
/// leader, and how long it may take.
const CHECK_EVERY: Duration = Duration::from_secs(2);
/// The first wait before a lost watch is opened again (doubling to
/// `RETRY_MAX`).
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);
/// How long a starting replica waits for etcd to answer before it gives
/// up.
const CONNECT_PATIENCE: Duration = Duration::from_secs(60);

pub struct EtcdStore {
    /// The prefix's store ID (`identify`).
    id: String,
    keys: Arc<Keys>,
    /// The runs' leases (`Leases`).
    leases: Arc<EtcdLeases>,
    /// The listing made at connect, until `load` takes it.
    loaded: LoadOnce,
    link: Arc<Mutex<Link>>,
    /// Turns `true` at close: the follower stops.
    closed: watch::Sender<bool>,
    /// Starts the watch again if it panics.
    supervisor: Supervisor,
}

/// Where a prefix's keys are, and the client that writes them.
struct Keys {
    client: Arc<Client>,
    /// `<prefix>a/`: the allocations' keys.
    keys: Vec<u8>,
    /// `<prefix>live/`: the tasks' liveness keys (`live.rs`).
    live: Vec<u8>,
    /// `<prefix>sem/`: the semaphores' keys.
    sems: Vec<u8>,
}

/// The `Leases` of an etcd prefix.
struct EtcdLeases {
    keys: Arc<Keys>,
    /// Carries lease renewals to etcd.
    keep: keep::KeepAlives,
    /// Whether etcd was seen raising a lease's TTL to its minimum (said
    /// once).
    raised: Arc<std::sync::atomic::AtomicBool>,
}

/// How the replica's link to etcd is doing (health).
#[derive(Debug, Default)]
struct Link {
    /// The watch is open and has been created by a member.
    watching: bool,
    /// Why the watch is down (since it last failed, until a member takes
    /// it again): health is 503 `store_unavailable` meanwhile.
    trouble: Option<String>,
    /// Allocations whose record in etcd this build cannot read, with why:
    /// their requests are answered 503 `store_failed`, health is degraded,
    /// and everything else is served. A readable record (or a deletion)
    /// of the allocation takes it off.
    unreadable: BTreeMap<String, Unreadable>,
    /// Semaphores whose record in etcd this build cannot read, with why:
    /// kept out of the view (as if deleted), and health is degraded. A
    /// readable record (or a deletion) of the semaphore takes it off.
    unreadable_semaphores: BTreeMap<String, String>,
}

impl EtcdStore {
    /// Connects and lists every allocation under the prefix.
    pub async fn connect(config: &EtcdConfig) -> Result<Self, StoreError> {
        Self::connect_supervised(config, Supervisor::default()).await
    }

    /// `connect`, its long-lived tasks (the watch, the keep-alive stream)
    /// owned by `supervisor`.
    pub async fn connect_supervised(
        config: &EtcdConfig,
        supervisor: Supervisor,
    ) -> Result<Self, StoreError> {
        if config.prefix.is_empty() {
            return Err(StoreError::Unusable(
                "the etcd prefix is empty; give one (--etcd-prefix), such as /taskgate/".into(),
            ));
        }
        let client = Client::new(config).map_err(StoreError::Unusable)?;
        let mut keys = config.prefix.as_bytes().to_vec();
        keys.extend_from_slice(b"a/");
        let mut live = config.prefix.as_bytes().to_vec();
        live.extend_from_slice(b"live/");
        let mut sems = config.prefix.as_bytes().to_vec();
        sems.extend_from_slice(b"sem/");
        // etcd may come up after the replica (a whole deployment started
        // at once): unreachable members are waited for a while, the server
        // answering 503 `starting` meanwhile.
        let started = Instant::now();
        let mut backoff = RETRY_FIRST;
        let listed = loop {
            match list(&client, &keys, &live, &sems).await {
                Ok(listed) => break listed,
                Err(CallError::Unreachable(e)) if started.elapsed() < CONNECT_PATIENCE => {
                    tracing::warn!(error = %e, retry_in = ?backoff, "etcd is not reachable yet");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(RETRY_MAX);
                }
                Err(e) => {
                    return Err(StoreError::Unusable(format!(
                        "cannot list {} in etcd: {e}",
                        String::from_utf8_lossy(&keys)
                    )));
                }
            }
        };
        let id = identify(&client, config.prefix.as_bytes()).await?;
        let client = Arc::new(client);
        let closed = watch::Sender::new(false);
        let keys = Arc::new(Keys {
            client,
            keys,
            live,
            sems,
        });
        Ok(Self {
            id,
            leases: Arc::new(EtcdLeases {
                keep: keep::KeepAlives::start(keys.client.clone(), closed.subscribe(), &supervisor),
                keys: keys.clone(),
                raised: Arc::default(),
            }),
            keys,
            loaded: LoadOnce::new(listed.loaded),
            link: Arc::new(Mutex::new(Link {
                unreadable: listed.unreadable,
                unreadable_semaphores: listed.unreadable_semaphores,
                ..Link::default()
            })),
            closed,
            supervisor,
        })
    }
}

impl Keys {
    fn key(&self, id: &AllocId) -> Vec<u8> {
        let mut key = self.keys.clone();
        key.extend_from_slice(id.as_str().as_bytes());
        key
    }

    /// `<prefix>sem/<name>`.
    fn sem_key(&self, name: &SemName) -> Vec<u8> {
        let mut key = self.sems.clone();
        key.extend_from_slice(name.as_str().as_bytes());
        key
    }

    /// The requests that apply `ops` to `id`'s liveness keys.
    fn live_requests(&self, id: &AllocId, ops: Vec<LiveOp>) -> Vec<proto::Request> {
        let mut out = Vec::with_capacity(ops.len() * 2);
        for op in ops {
            match op {
                LiveOp::Start { task, mark } => {
                    out.push(proto::Request::Put(proto::PutRequest {
                        key: live::live_key(&self.live, id, &task),
                        value: Vec::new(),
                        lease: mark.lease,
                    }));
                    out.push(proto::Request::Put(proto::PutRequest {
                        key: live::mark_key(&self.live, id, &task),
                        value: live::encode(&mark),
                        lease: 0,
                    }));
                }
                LiveOp::End { task, .. } => {
                    for key in [
                        live::live_key(&self.live, id, &task),
                        live::mark_key(&self.live, id, &task),
                    ] {
                        out.push(proto::Request::DeleteRange(proto::DeleteRangeRequest {
                            key,
                            range_end: Vec::new(),
                        }));
                    }
                }
            }
        }
        out
    }
}

impl Keys {
    /// The live keys a change of `id` must find absent: those of the runs
    /// it declares lost (`LiveOp::End` with `lapsed`) or marks again
    /// (`LiveOp::Start`, `Leases::mark`).
    fn absent(&self, id: &AllocId, ops: &[LiveOp], starts: bool) -> Vec<Vec<u8>> {
        ops.iter()
            .filter_map(|op| match op {
                LiveOp::End { task, lapsed: true } => Some(task),
                LiveOp::Start { task, .. } if starts => Some(task),
                LiveOp::Start { .. } | LiveOp::End { .. } => None,
            })
            .map(|task| live::live_key(&self.live, id, task))
            .collect()
    }
}

/// The prefix's store ID (`<prefix>store-id`), written by the first
/// replica that finds none: every replica of the prefix answers the same.
async fn identify(client: &Client, prefix: &[u8]) -> Result<String, StoreError> {
    let mut key = prefix.to_vec();
    key.extend_from_slice(super::identity::STORE_ID_FILE.as_bytes());
    let name = String::from_utf8_lossy(&key).into_owned();
    let fresh = super::identity::new_id();
    let value = match client.swap(&key, Some(fresh.as_bytes()), 0).await {
        Ok(Swapped::Done(_)) => fresh.into_bytes(),
        Ok(Swapped::Conflict { value, .. }) => value,
        Err(e) => {
            return Err(StoreError::Unusable(format!(
                "cannot read or write the store ID at {name} in etcd: {e}"
            )));
        }
    };
    match String::from_utf8(value) {
        Ok(id) if super::identity::is_id(&id) => Ok(id),
        _ => Err(StoreError::Unusable(format!(
            "the store ID at {name} in etcd is damaged (it should be 32 hex digits); \
             delete the key to give the prefix a new ID (clients then take it for another \
             store)"
        ))),
    }
}

/// The prefix as listed at one revision.
struct Listed {
    loaded: Loaded,
    /// The allocations whose records this build cannot read, with why.
    unreadable: BTreeMap<String, Unreadable>,
    /// The semaphores whose records this build cannot read, with why.
    unreadable_semaphores: BTreeMap<String, String>,
}

/// The whole prefix at one revision, page by page, and the records in it
/// this build cannot read: the allocations under `keys`, then the
/// liveness keys under `live` and the semaphores under `sems` at the same
/// revision.
async fn list(client: &Client, keys: &[u8], live: &[u8], sems: &[u8]) -> Result<Listed, CallError> {
    let mut unreadable = BTreeMap::new();
    let mut at = 0;
    let mut allocations = Vec::new();
    each_key(client, keys, &mut at, |kv| {
        match decode(keys, &kv.key, &kv.value, kv.mod_revision) {
            Ok(a) => allocations.push(a),
            Err(why) => unreadable_record(keys, &kv, why, &mut unreadable),
        }
    })
    .await?;
    let mut liveness = Vec::new();
    each_key(client, live, &mut at, |kv| {
        match live::read(live, &kv, false) {
            Some(l) => liveness.push(l),
            None => unnamed_live_key(&kv.key),
        }
    })
    .await?;
    let mut semaphores = Vec::new();
    let mut unreadable_semaphores = BTreeMap::new();
    each_key(client, sems, &mut at, |kv| {
        match read_semaphore(sems, &kv) {
            Some(Ok(s)) => semaphores.push(s),
            Some(Err((name, why))) => {
                unreadable_semaphores.insert(name.as_str().to_owned(), why);
            }
            None => {}
        }
    })
    .await?;
    Ok(Listed {
        loaded: Loaded {
            allocations,
            last_index: at,
            liveness,
            semaphores,
        },
        unreadable,
        unreadable_semaphores,
    })
}

/// Every key under `prefix` at revision `at` (0: now, which sets `at`),
/// page by page.
async fn each_key(
    client: &Client,
    prefix: &[u8],
    at: &mut u64,
    mut each: impl FnMut(client::KeyValue),
) -> Result<(), CallError> {
    let end = prefix_end(prefix);
    let mut from = prefix.to_vec();
    loop {
        let page = client.range(&from, &end, *at, PAGE).await?;
        if *at == 0 {
            *at = page.revision;
        }
        let more = page.more;
        let mut last = None;
        for kv in page.kvs {
            last = Some(kv.key.clone());
            each(kv);
        }
        match (more, last) {
            (true, Some(mut key)) => {
                // The next page starts just after the last key.
                key.push(0);
                from = key;
            }
            _ => return Ok(()),
        }
    }
}

fn unnamed_live_key(key: &[u8]) {
    tracing::warn!(
        key = %String::from_utf8_lossy(key),
        "a key under the liveness prefix names no task; ignored"
    );
}

/// The allocation a key under the prefix names, if it names one.
fn named(keys: &[u8], key: &[u8]) -> Option<AllocId> {
    let id = std::str::from_utf8(key.get(keys.len()..)?).ok()?;
    AllocId::parse(id).ok()
}

/// Notes a record this build cannot read: under its allocation, or (a key
/// that names none) only in the log.
fn unreadable_record(
    keys: &[u8],
    kv: &client::KeyValue,
    why: CallError,
    unreadable: &mut BTreeMap<String, Unreadable>,
) {
    let key = &kv.key;
    let why = match why {
        CallError::Refused(m) => m,
        other => other.to_string(),
    };
    match named(keys, key) {
        Some(id) => {
            tracing::error!(alloc = %id, error = %why, "a record in etcd cannot be read by this build; its allocation is answered 503 store_failed, the others are served");
            unreadable.insert(
                id.as_str().to_owned(),
                Unreadable {
                    why,
                    index: kv.mod_revision,
                },
            );
        }
        None => tracing::warn!(
            key = %String::from_utf8_lossy(key),
            error = %why,
            "a key under the prefix names no allocation; ignored"
        ),
    }
}

/// A record as stored, stamped with the revision that wrote it.
fn decode(keys: &[u8], key: &[u8], value: &[u8], revision: u64) -> Result<Allocation, CallError> {
    let name = String::from_utf8_lossy(key);
    let mut a = record::decode(value)
        .map_err(|e| CallError::Refused(format!("the record at {name} is damaged: {e}")))?;
    if key.get(keys.len()..) != Some(a.id.as_str().as_bytes()) {
        return Err(CallError::Refused(format!(
            "the record at {name} belongs to allocation {:?}",
            a.id.as_str()
        )));
    }
    let placeholder = a.modify_index;
    a.restamp(placeholder, revision);
    Ok(a)
}

/// The semaphore a key under `sems` names, if it names one.
fn sem_named(sems: &[u8], key: &[u8]) -> Option<SemName> {
    let name = std::str::from_utf8(key.get(sems.len()..)?).ok()?;
    SemName::parse(name).ok()
}

/// A semaphore's key-value as read, stamped with the revision that wrote
/// it; or, if this build cannot read it, its name and why (logged). `None`
/// for a key that names no semaphore (logged, ignored).
fn read_semaphore(
    sems: &[u8],
    kv: &client::KeyValue,
) -> Option<Result<Semaphore, (SemName, String)>> {
    let key = String::from_utf8_lossy(&kv.key);
    let Some(name) = sem_named(sems, &kv.key) else {
        tracing::warn!(%key, "a key under the semaphores' prefix names no semaphore; ignored");
        return None;
    };
    let read = record::decode_semaphore(&kv.value)
        .map_err(|e| format!("the record at {key} is damaged: {e}"))
        .and_then(|s| {
            if s.name == name {
                Ok(s)
            } else {
                Err(format!(
                    "the record at {key} belongs to semaphore {:?}",
                    s.name.as_str()
                ))
            }
        });
    Some(match read {
        Ok(mut s) => {
            let placeholder = s.modify_index;
            s.restamp(placeholder, kv.mod_revision);
            Ok(s)
        }
        Err(why) => {
            tracing::error!(semaphore = %name, error = %why, "a semaphore's record in etcd cannot be read by this build; it is left out of the view (its waiters see it as not registered)");
            Err((name, why))
        }
    })
}

/// The record of `g` written again by a put that grants it: the same
/// semaphore, with a placeholder index above its `create_index` (so that
/// it reads back with its `create_index`, and its `modify_index` the
/// grant's revision).
fn granted_again(g: &Semaphore) -> Vec<u8> {
    record::encode_semaphore(&Semaphore {
        modify_index: g.create_index.max(g.modify_index).saturating_add(1),
        ..g.clone()
    })
}

/// What a failed compare tells about a swap of `op` on the record at
/// `expect`: the key is at revision `now` (0: absent) holding `value`,
/// created at `created`, read at `read`. A write that follows a record
/// names that record's revision in its mark, and at most one write
/// follows each: the record's marks tell whether that one was ours. Only
/// when an attempt got no answer (`uncertain`) and the marks no longer
/// reach back that far is the outcome unknown.
fn settle(
    op: &Op,
    expect: u64,
    now: u64,
    value: &[u8],
    created: u64,
    read: u64,
    uncertain: bool,
) -> AppendError {
    let unknown = |why: &str| {
        AppendError::Store(StoreError::Uncertain(format!(
            "etcd did not answer a write and {why}, so whether it was applied cannot be told; \
             read the allocation before sending the request again (or send it with the same \
             Idempotency-Key)"
        )))
    };
    match op {
        // The record is still the one decided on: what failed is a live
        // key that had to be absent (a replica that heard the agent marked
        // its run again). Nothing was applied, this attempt's or an
        // earlier one's (it would have moved the record): decided again
        // once the view holds what etcd held then.
        Op::Put(_) if expect != 0 && now == expect => AppendError::Conflict { seen: read },
        Op::Put(a) => {
            let Some(ours) = a.writes().last() else {
                return AppendError::Conflict { seen: now };
            };
            if now == 0 {
                // Deleted since: the decision is taken again (and finds
                // no allocation).
                return AppendError::Conflict { seen: read };
            }
            let record = match record::decode(value) {
                Ok(r) => r,
                Err(_) if uncertain => return unknown("the record is unreadable"),
                Err(_) => return AppendError::Conflict { seen: now },
            };
            let marks = record.writes();
            if marks.iter().any(|m| m.id == ours.id) {
                tracing::info!(
                    alloc = %a.id,
                    revision = now,
                    "a write whose answer was lost had been applied (its write mark is in the record); not applied again"
                );
                AppendError::Landed { seen: now }
            } else if !uncertain
                || marks.iter().any(|m| m.parent == expect)
                || (expect != 0 && created > expect)
            {
                AppendError::Conflict { seen: now }
            } else {
                unknown("more writes followed it than the record remembers")
            }
        }
        // A deletion that may have landed: the key gone, or created again
        // since, means the record it was decided on is deleted.
        Op::Delete(_) | Op::DeleteSemaphore(_) if uncertain && (now == 0 || created > expect) => {
            AppendError::Landed {
                seen: if now == 0 { read } else { now },
            }
        }
        // A semaphore's record carries no write marks: a put that may have
        // landed, the key moved since, has landed if the semaphore is as
        // it would leave it (whoever wrote that, deciding again would
        // change nothing); else whether it did cannot be told, and it is
        // not decided again on top of what may be its own write.
        Op::PutSemaphore(ours) if uncertain && now != expect => {
            match record::decode_semaphore(value) {
                Ok(held)
                    if now != 0
                        && held.name == ours.name
                        && held.limit == ours.limit
                        && held.grant_timeout == ours.grant_timeout =>
                {
                    AppendError::Landed { seen: now }
                }
                _ => AppendError::Store(StoreError::Uncertain(format!(
                    "etcd did not answer a write of semaphore {} and it changed since, so \
                     whether the write was applied cannot be told; read the semaphore before \
                     sending the request again",
                    ours.name
                ))),
            }
        }
        Op::Delete(_) | Op::PutSemaphore(_) | Op::DeleteSemaphore(_) => AppendError::Conflict {
            seen: if now == 0 { read } else { now },
        },
    }
}

fn unavailable(e: CallError) -> StoreError {
    match e {
        CallError::Unreachable(m) => StoreError::Unavailable(m),
        CallError::Ambiguous(m) => StoreError::Unavailable(m),
        CallError::Refused(m) => StoreError::Io(m),
        CallError::Compacted(r) => StoreError::Io(format!("etcd compacted revision {r} away")),
    }
}

impl Store for EtcdStore {
    fn load(&self) -> Result<Loaded, StoreError> {
        self.loaded.take()
    }

    fn id(&self) -> &str {
        &self.id
    }

    fn append(&self, append: Append) -> Appended {
        let Append {
            op,
            expect,
            live,
            grants,
        } = append;
        let k = &self.keys;
        let (op, key, value, absent, mut also) = match op {
            Op::Put(mut a) => {
                // Marked, so that an attempt whose answer is lost can be
                // told from another's write (`settle`).
                Arc::make_mut(&mut a).mark_write(WriteMark {
                    id: fastrand::u64(..),
                    parent: expect,
                });
                let (key, value) = (k.key(&a.id), Some(record::encode(&a)));
                let absent = k.absent(&a.id, &live, false);
                let also = k.live_requests(&a.id, live);
                (Op::Put(a), key, value, absent, also)
            }
            // Every liveness key of the allocation goes with it.
            Op::Delete(id) => {
                let keys = live::of_alloc(&k.live, &id);
                let range_end = prefix_end(&keys);
                let key = k.key(&id);
                (
                    Op::Delete(id),
                    key,
                    None,
                    Vec::new(),
                    vec![proto::Request::DeleteRange(proto::DeleteRangeRequest {
                        key: keys,
                        range_end,
                    })],
                )
            }
            // Written with its placeholder index, stamped when read back.
            Op::PutSemaphore(s) => {
                let (key, value) = (k.sem_key(&s.name), Some(record::encode_semaphore(&s)));
                (Op::PutSemaphore(s), key, value, Vec::new(), Vec::new())
            }
            Op::DeleteSemaphore(name) => {
                let key = k.sem_key(&name);
                (Op::DeleteSemaphore(name), key, None, Vec::new(), Vec::new())
            }
        };
        // Each granted semaphore still at the revision the grant was
        // decided on, and written again (its revision moves with the
        // grant). At most `MAX_ACQUIRE` (4) compares and puts: with the
        // record's put and its liveness keys' requests, a transaction
        // stays far below etcd's limit of operations per transaction
        // (`--max-txn-ops`, 128 by default).
        let granted: Vec<(Vec<u8>, u64)> = grants
            .iter()
            .map(|g| (k.sem_key(&g.name), g.modify_index))
            .collect();
        also.extend(grants.iter().map(|g| {
            proto::Request::Put(proto::PutRequest {
                key: k.sem_key(&g.name),
                value: granted_again(g),
                lease: 0,
            })
        }));
        let client = k.client.clone();
        let record = match &op {
            Op::Put(a) => Some(a.clone()),
            _ => None,
        };
        let done = Box::pin(async move {
            let guards = Guards {
                absent: &absent,
                at: &granted,
            };
            match client
                .swap_with(&key, value.as_deref(), expect, guards, also)
                .await
            {
                Ok(Swapped::Done(index)) => Ok(index),
                Ok(Swapped::Conflict {
                    now,
                    value,
                    created,
                    read,
                    uncertain,
                }) => Err(
                    match settle(&op, expect, now, &value, created, read, uncertain) {
                        // A granted semaphore may be what moved, after the
                        // record did: everything is visible at the read.
                        AppendError::Conflict { seen } if !granted.is_empty() => {
                            AppendError::Conflict {
                                seen: seen.max(read),
                            }
                        }
                        other => other,
                    },
                ),
                Err(CallError::Ambiguous(m)) => Err(AppendError::Store(StoreError::Uncertain(
                    format!("no etcd member confirmed a write, which may have been applied: {m}"),
                ))),
                Err(e) => Err(AppendError::Store(unavailable(e))),
            }
        });
        Appended {
            record,
            stamped: false,
            done,
        }
    }

    fn shared(&self) -> bool {
        true
    }

    fn quorum_read(&self, id: &AllocId) -> Option<QuorumRead> {
        let key = self.keys.key(id);
        let client = self.keys.client.clone();
        Some(Box::pin(async move {
            let mut end = key.clone();
            end.push(0);
            let found = client.range(&key, &end, 0, 1).await.map_err(unavailable)?;
            Ok(found.kvs.first().map(|kv| kv.mod_revision))
        }))
    }

    fn leases(&self) -> Option<Arc<dyn Leases>> {
        Some(self.leases.clone())
    }

    fn unreadable(&self, id: &str) -> Option<Unreadable> {
        let link = self.link.lock().unwrap_or_else(PoisonError::into_inner);
        if link.unreadable.is_empty() {
            return None;
        }
        link.unreadable.get(id).cloned()
    }

    fn unreadable_ids(&self) -> Vec<String> {
        let link = self.link.lock().unwrap_or_else(PoisonError::into_inner);
        link.unreadable.keys().cloned().collect()
    }

    /// The watch runs under the supervisor: if it panics (in the follower
    /// it hands changes to, say), it is started again from the last
    /// revision it handed over, and health names it meanwhile.
    fn follow(&self, from: u64, follower: Weak<dyn Follower>) {
        let applied = Arc::new(AtomicU64::new(from));
        let (keys, link, closed) = (
            self.keys.clone(),
            self.link.clone(),
            self.closed.subscribe(),
        );
        self.supervisor.keep("follower", move || {
            let run = Follow {
                client: keys.client.clone(),
                keys: keys.keys.clone(),
                live: keys.live.clone(),
                sems: keys.sems.clone(),
                link: link.clone(),
                follower: follower.clone(),
                applied: applied.clone(),
            };
            run.run(closed.clone())
        });
    }

    fn health(&self) -> StoreHealth {
        // Caught up at start by the listing; behind from the first failure
        // of the watch that follows it until a member takes it again.
        let link = self.link.lock().unwrap_or_else(PoisonError::into_inner);
        match &link.trouble {
            None if !link.unreadable.is_empty() || !link.unreadable_semaphores.is_empty() => {
                StoreHealth::Degraded(vec!["records_unreadable"])
            }
            None => StoreHealth::Ok,
            Some(cause) => StoreHealth::Refusing {
                code: "store_unavailable",
                cause: cause.clone(),
            },
        }
    }

    fn close(&self) -> Result<(), StoreError> {
        self.closed.send_replace(true);
        Ok(())
    }
}

impl Leases for EtcdLeases {
    fn grant(
        &self,
        ttl: Duration,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Lease, StoreError>> + Send>>
    {
        let client = self.keys.client.clone();
        let asked = live::lease_seconds(ttl);
        let raised = self.raised.clone();
        Box::pin(async move {
            let (lease, granted) = client.grant(asked).await.map_err(unavailable)?;
            if granted > asked && !raised.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::info!(
                    asked,
                    granted,
                    "etcd raised a lease's TTL to its minimum (one and a half election \
                     timeouts): tasks with shorter TTLs are declared lost that much later"
                );
            }
            Ok(lease)
        })
    }

    fn mark(
        &self,
        id: &AllocId,
        expect: u64,
        live: Vec<LiveOp>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<u64, AppendError>> + Send>> {
        let key = self.keys.key(id);
        let absent = self.keys.absent(id, &live, true);
        let ops = self.keys.live_requests(id, live);
        let client = self.keys.client.clone();
        Box::pin(async move {
            let guards = Guards {
                absent: &absent,
                at: &[],
            };
            match client.when_at(&key, expect, guards, ops).await {
                Ok(Swapped::Done(index)) => Ok(index),
                // Absent, or still at `expect` (a live key that had to be
                // absent is there): what etcd held when it refused.
                Ok(Swapped::Conflict { now, read, .. }) => Err(AppendError::Conflict {
                    seen: if now == 0 || now == expect { read } else { now },
                }),
                Err(e) => Err(AppendError::Store(unavailable(e))),
            }
        })
    }

    fn keep_alive(&self, lease: Lease) {
        self.keep.renew(lease);
    }

    fn renewing(&self) -> bool {
        self.keep.renewing()
    }
}

/// The replica's watch on the prefix, kept open across member failures
/// and compactions.
struct Follow {
    client: Arc<Client>,
    keys: Vec<u8>,
    /// `<prefix>live/` and `<prefix>sem/`, watched with `keys` in one
    /// range (`a/` to `sem/`'s end), so the records, the liveness keys and
    /// the semaphores arrive in one revision order.
    live: Vec<u8>,
    sems: Vec<u8>,
    link: Arc<Mutex<Link>>,
    follower: Weak<dyn Follower>,
    /// Every change up to this revision is handed to the follower (shared
    /// with the watch's next start).
    applied: Arc<AtomicU64>,
}

/// Why a watch ended.
enum Ended {
    /// The store closed or the registry is gone.
    Stop,
    /// Changes since `applied` are compacted away: list again.
    Compacted,
    Lost(String),
}

impl Follow {
    async fn run(mut self, mut closed: watch::Receiver<bool>) {
        let mut backoff = RETRY_FIRST;
        loop {
            let ended = tokio::select! {
                ended = self.watch() => ended,
                _ = closed.wait_for(|c| *c) => Ended::Stop,
            };
            match ended {
                Ended::Stop => return,
                Ended::Compacted => {
                    let relisted = tokio::select! {
                        r = list(&self.client, &self.keys, &self.live, &self.sems) => r,
                        _ = closed.wait_for(|c| *c) => return,
                    };
                    match relisted {
                        Ok(listed) => {
                            let Some(follower) = self.follower.upgrade() else {
                                return;
                            };
                            let mut link = self.link.lock().unwrap_or_else(PoisonError::into_inner);
                            link.unreadable = listed.unreadable;
                            link.unreadable_semaphores = listed.unreadable_semaphores;
                            drop(link);
                            self.applied
                                .store(listed.loaded.last_index, Ordering::SeqCst);
                            follower.resync(listed.loaded);
                            backoff = RETRY_FIRST;
                            continue;
                        }
                        Err(e) => {
                            self.lost(format!("listing the prefix again failed: {e}"));
                        }
                    }
                }
                // A watch that worked until now is tried again at once
                // (on the next member); one that keeps failing, less often.
                Ended::Lost(why) => {
                    if self.lost(why) {
                        backoff = RETRY_FIRST;
                    }
                }
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                _ = closed.wait_for(|c| *c) => return,
            }
            backoff = (backoff * 2).min(RETRY_MAX);
        }
    }

    /// Records why the watch is down; true if it was working until now.
    fn lost(&self, why: String) -> bool {
        let mut link = self.link.lock().unwrap_or_else(PoisonError::into_inner);
        let was = link.watching;
        if was || link.trouble.is_none() {
            tracing::warn!(error = %why, "the watch on etcd is lost; reads answer from the last view until it is back");
        }
        link.watching = false;
        link.trouble = Some(why);
        was
    }

    /// One watch, from the revision after `applied`, until it ends.
    async fn watch(&mut self) -> Ended {
        let end = prefix_end(&self.sems);
        let from = self.applied.load(Ordering::SeqCst) + 1;
        let mut watch = match self.client.watch(&self.keys, &end, from).await {
            Ok(w) => w,
            Err(e) => return Ended::Lost(e.to_string()),
        };
        let endpoint = watch.endpoint.clone();
        let mut checks = tokio::time::interval(CHECK_EVERY);
        checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let next = tokio::select! {
                next = watch.next() => next,
                _ = checks.tick() => {
                    match tokio::time::timeout(CHECK_EVERY, self.client.check(&endpoint, &self.keys)).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => {
                            self.client.skip(&endpoint);
                            return Ended::Lost(format!("the member the watch is on cannot read through a leader: {e}"));
                        }
                        // Left at once: a member that stopped answering
                        // (paused, cut off without a reset) is left within
                        // two check intervals of its last answer.
                        Err(_) => {
                            self.client.skip(&endpoint);
                            return Ended::Lost(format!("{endpoint}: the member the watch is on did not answer a read within {CHECK_EVERY:?}"));
                        }
                    }
                    continue;
                }
            };
            let response = match next {
                Ok(Some(r)) => r,
                Ok(None) => return Ended::Lost(format!("{endpoint} closed the watch")),
                Err(e) => {
                    self.client.skip(&endpoint);
                    return Ended::Lost(e.to_string());
                }
            };
            if response.canceled {
                if response.compact_revision > 0 {
                    tracing::info!(
                        compacted = response.compact_revision,
                        applied = self.applied.load(Ordering::SeqCst),
                        "the watch fell behind a compaction; listing again"
                    );
                    return Ended::Compacted;
                }
                self.client.skip(&endpoint);
                return Ended::Lost(format!(
                    "{endpoint} canceled the watch: {}",
                    if response.cancel_reason.is_empty() {
                        "no reason given"
                    } else {
                        &response.cancel_reason
                    }
                ));
            }
            if response.created {
                let mut link = self.link.lock().unwrap_or_else(PoisonError::into_inner);
                if link.trouble.take().is_some() {
                    tracing::info!(%endpoint, "the watch on etcd is back");
                }
                link.watching = true;
                continue;
            }
            let Some(follower) = self.follower.upgrade() else {
                return Ended::Stop;
            };
            // Without events this is a progress notification: everything up
            // to its revision has been sent.
            let applied = self.applied.load(Ordering::SeqCst);
            let mut reached = if response.events.is_empty() {
                response.revision
            } else {
                applied
            };
            let mut changes = Vec::with_capacity(response.events.len());
            // Each allocation changed, in order: unreadable (with why) or not.
            let mut read: Vec<(String, Option<Unreadable>)> = Vec::new();
            // The same of each semaphore changed.
            let mut read_sems: Vec<(String, Option<String>)> = Vec::new();
            for e in response.events {
                reached = reached.max(e.kv.mod_revision);
                if e.kv.key.starts_with(&self.live) {
                    match live::read(&self.live, &e.kv, e.deleted) {
                        Some(l) => changes.push(Change::Liveness(l)),
                        None => unnamed_live_key(&e.kv.key),
                    }
                    continue;
                }
                if e.kv.key.starts_with(&self.sems) {
                    let index = e.kv.mod_revision;
                    if e.deleted {
                        if let Some(name) = sem_named(&self.sems, &e.kv.key) {
                            read_sems.push((name.as_str().to_owned(), None));
                            changes.push(Change::DeleteSemaphore { name, index });
                        }
                        continue;
                    }
                    match read_semaphore(&self.sems, &e.kv) {
                        Some(Ok(s)) => {
                            read_sems.push((s.name.as_str().to_owned(), None));
                            changes.push(Change::PutSemaphore(Arc::new(s)));
                        }
                        // Out of the view, as a listing leaves it.
                        Some(Err((name, why))) => {
                            read_sems.push((name.as_str().to_owned(), Some(why)));
                            changes.push(Change::DeleteSemaphore { name, index });
                        }
                        None => {}
                    }
                    continue;
                }
                if !e.kv.key.starts_with(&self.keys) {
                    // Between the two ranges: not ours.
                    continue;
                }
                let Some(id) = named(&self.keys, &e.kv.key) else {
                    tracing::warn!(
                        key = %String::from_utf8_lossy(&e.kv.key),
                        "a key under the prefix that names no allocation changed; ignored"
                    );
                    continue;
                };
                if e.deleted {
                    read.push((id.as_str().to_owned(), None));
                    changes.push(Change::Delete {
                        id,
                        index: e.kv.mod_revision,
                    });
                    continue;
                }
                match decode(&self.keys, &e.kv.key, &e.kv.value, e.kv.mod_revision) {
                    Ok(a) => {
                        read.push((id.as_str().to_owned(), None));
                        changes.push(Change::Put(Arc::new(a)));
                    }
                    Err(why) => {
                        let mut one = BTreeMap::new();
                        unreadable_record(&self.keys, &e.kv, why, &mut one);
                        read.extend(one.into_iter().map(|(id, why)| (id, Some(why))));
                    }
                }
            }
            let mut link = self.link.lock().unwrap_or_else(PoisonError::into_inner);
            for (id, why) in read {
                match why {
                    Some(why) => link.unreadable.insert(id, why),
                    None if link.unreadable.is_empty() => continue,
                    None => link.unreadable.remove(&id),
                };
            }
            for (name, why) in read_sems {
                match why {
                    Some(why) => link.unreadable_semaphores.insert(name, why),
                    None if link.unreadable_semaphores.is_empty() => continue,
                    None => link.unreadable_semaphores.remove(&name),
                };
            }
            drop(link);
            let reached = reached.max(applied);
            follower.changed(changes, reached);
            self.applied.store(reached, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn db(limit: u32, create_index: u64, modify_index: u64) -> Semaphore {
        Semaphore {
            name: SemName::parse("db").unwrap(),
            limit,
            grant_timeout: Duration::from_secs(60),
            create_index,
            modify_index,
        }
    }

    /// What a failed compare of a semaphore's put or deletion settles to:
    /// a conflict unless an attempt got no answer; then landed where the
    /// key says so (deleted, or as the put would leave it), else unknown,
    /// never decided again on top of what may be its own write.
    #[test]
    fn a_semaphore_write_whose_answer_was_lost_is_settled_by_what_etcd_holds() {
        let put = Op::PutSemaphore(Arc::new(db(3, 10, u64::MAX)));
        let ours = record::encode_semaphore(&db(3, 10, 21));
        let theirs = record::encode_semaphore(&db(4, 10, 21));
        let settled =
            |now, value: &[u8], uncertain| settle(&put, 10, now, value, 10, 30, uncertain);
        assert!(matches!(
            settled(21, &theirs, false),
            AppendError::Conflict { seen: 21 }
        ));
        assert!(matches!(
            settled(0, &[], false),
            AppendError::Conflict { seen: 30 }
        ));
        assert!(matches!(
            settled(21, &ours, true),
            AppendError::Landed { seen: 21 }
        ));
        for (now, value) in [(21, &theirs[..]), (0, &[][..]), (21, &[0x82, 1][..])] {
            match settled(now, value, true) {
                AppendError::Store(StoreError::Uncertain(why)) => {
                    assert!(why.contains("write of semaphore db"), "{why}");
                    assert!(why.contains("read the semaphore before"), "{why}");
                }
                other => panic!("{now}: {other:?}"),
            }
        }
        // A creation whose answer was lost, the key still absent.
        let create = Op::PutSemaphore(Arc::new(db(3, u64::MAX, u64::MAX)));
        assert!(matches!(
            settle(&create, 0, 0, &[], 0, 30, true),
            AppendError::Conflict { seen: 30 }
        ));

        let delete = Op::DeleteSemaphore(SemName::parse("db").unwrap());
        assert!(matches!(
            settle(&delete, 10, 0, &[], 0, 30, true),
            AppendError::Landed { seen: 30 }
        ));
        assert!(matches!(
            settle(&delete, 10, 25, &ours, 25, 30, true),
            AppendError::Landed { seen: 25 }
        ));
        assert!(matches!(
            settle(&delete, 10, 21, &ours, 10, 30, true),
            AppendError::Conflict { seen: 21 }
        ));
        assert!(matches!(
            settle(&delete, 10, 0, &[], 0, 30, false),
            AppendError::Conflict { seen: 30 }
        ));
    }

    /// A grant writes the semaphore again with a placeholder above its
    /// `create_index`: read back, only its `modify_index` moves.
    #[test]
    fn a_granted_semaphore_reads_back_with_its_creation_and_the_grant_s_revision() {
        for g in [db(2, 7, 7), db(2, 7, 12)] {
            let mut read = record::decode_semaphore(&granted_again(&g)).unwrap();
            let placeholder = read.modify_index;
            read.restamp(placeholder, 40);
            assert_eq!(read, db(2, 7, 40));
        }
    }
}
