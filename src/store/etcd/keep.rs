//! Lease keep-alives: one stream per replica, on one member at a time,
//! carrying every renewal the replica sends (`Leases::keep_alive`).
//! A renewal is served by etcd's leader from memory: no raft write, no
//! revision (etcd's lessor; lease checkpoints, off by default, would add
//! one per lease per checkpoint interval). How often each lease is renewed
//! is the registry's business (`registry/lives.rs`); this only carries
//! them, and says whether they are acknowledged (`KeepAlives::renewing`).
//!
//! The renewal deadline is `DEADLINE` (1 s), or a third of the shortest
//! lease's TTL if that is less. A renewal unanswered for that long, or a
//! stream the member breaks, moves the stream: it is opened on every other
//! member at once, and the first that answers within the deadline takes
//! it (a member that missed a deadline or broke the stream in the last
//! `AVOID` is asked only when no other answers). So a stream that leaves a
//! member that stopped answering is open elsewhere within two deadlines
//! of the renewal that went unanswered, whatever the next member in the
//! list does: one deadline waited on that member would already be more
//! than a short lease has left.

use std::{
    collections::{BTreeSet, HashMap, VecDeque},
    sync::{
        Arc,
        atomic::{AtomicI64, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use tokio::sync::{mpsc, watch};

use super::client::{Client, LeaseStream};
use crate::store::Lease;

/// How long a renewal may go unanswered before the stream is taken to
/// another member, at most, and how long the stream's opening may take.
/// Short: a renewal that does not arrive in time is a live task declared
/// lost. Shorter still with short leases: a third of the shortest TTL etcd
/// answered with (`Unanswered::deadline`).
const DEADLINE: Duration = Duration::from_secs(1);
/// Waits between openings that fail on every member, doubling to
/// `RETRY_MAX`.
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(1);
/// How long a member that missed a renewal's deadline, broke the stream
/// or did not open it in time is asked only after the others.
const AVOID: Duration = Duration::from_secs(10);

/// Where renewals are queued for the stream's task.
pub(super) struct KeepAlives {
    tx: mpsc::UnboundedSender<Lease>,
    acked: Arc<Acked>,
}

impl KeepAlives {
    /// Starts the task that carries the renewals (inside a runtime), under
    /// `supervisor`: started again, with the renewals queued, if it panics.
    pub(super) fn start(
        client: Arc<Client>,
        closed: watch::Receiver<bool>,
        supervisor: &crate::supervise::Supervisor,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let rx = Arc::new(tokio::sync::Mutex::new(rx));
        let acked = Arc::new(Acked::new());
        let shared = acked.clone();
        supervisor.keep("keep_alive", move || {
            carry(client.clone(), rx.clone(), closed.clone(), shared.clone())
        });
        Self { tx, acked }
    }

    pub(super) fn renew(&self, lease: Lease) {
        let _ = self.tx.send(lease);
    }

    /// Whether etcd acknowledges renewals now: no renewal sent has waited
    /// past the renewal deadline for its answer (on this stream or the
    /// ones before it). False from the moment one has, until every
    /// renewal owed an answer got one.
    pub(super) fn renewing(&self) -> bool {
        self.acked.renewing()
    }
}

/// What the stream's task tells the registry: since when the oldest
/// renewal still owed an answer was sent, and the renewal deadline.
/// Atomics, written by the stream's task alone.
struct Acked {
    base: Instant,
    /// Nanoseconds from `base` (`NONE_OWED`: none is owed).
    owed_since: AtomicI64,
    deadline_ns: AtomicU64,
}

const NONE_OWED: i64 = i64::MAX;

impl Acked {
    fn new() -> Self {
        Self {
            base: Instant::now(),
            owed_since: AtomicI64::new(NONE_OWED),
            deadline_ns: AtomicU64::new(DEADLINE.as_nanos() as u64),
        }
    }

    fn publish(&self, unanswered: &Unanswered) {
        let since = unanswered.owed_since().map_or(NONE_OWED, |t| {
            i64::try_from(t.saturating_duration_since(self.base).as_nanos()).unwrap_or(NONE_OWED)
        });
        self.owed_since.store(since, Ordering::SeqCst);
        let deadline = u64::try_from(unanswered.deadline().as_nanos()).unwrap_or(u64::MAX);
        self.deadline_ns.store(deadline, Ordering::SeqCst);
    }

    fn renewing(&self) -> bool {
        let since = self.owed_since.load(Ordering::SeqCst);
        if since == NONE_OWED {
            return true;
        }
        let waited = i64::try_from(self.base.elapsed().as_nanos())
            .unwrap_or(i64::MAX)
            .saturating_sub(since);
        let deadline = self.deadline_ns.load(Ordering::SeqCst);
        u64::try_from(waited).unwrap_or(0) < deadline
    }
}

/// A renewal sent and not answered yet.
#[derive(Clone, Copy, Debug)]
struct Waiting {
    /// When it was first sent: on an earlier stream, if that one broke
    /// before it was answered (it was sent again on the next).
    first: Instant,
    /// When it was sent on the stream open now.
    sent: Instant,
}

/// Renewals sent and not answered yet, by lease (a member answers a
/// stream's renewals in order), the oldest of them, and the shortest
/// lease TTL etcd answered with.
#[derive(Default)]
struct Unanswered {
    sent: HashMap<Lease, VecDeque<Waiting>>,
    /// The oldest unanswered renewal of each lease, by when it was first
    /// sent: the first is the renewal owed an answer the longest.
    owed: BTreeSet<(Instant, Lease)>,
    shortest: Option<Duration>,
}

/// A lease a test renews to make the task that carries renewals panic.
#[cfg(test)]
const PANIC_LEASE: Lease = -7;

impl Unanswered {
    fn sent(&mut self, lease: Lease) {
        #[cfg(test)]
        assert!(
            lease != PANIC_LEASE,
            "a test's panic in the keep-alive task"
        );
        let now = Instant::now();
        let waiting = self.sent.entry(lease).or_default();
        if waiting.is_empty() {
            self.owed.insert((now, lease));
        }
        waiting.push_back(Waiting {
            first: now,
            sent: now,
        });
    }

    /// A renewal was answered: the lease runs `ttl` seconds from now.
    fn answered(&mut self, lease: Lease, ttl: i64) {
        if let Some(waiting) = self.sent.get_mut(&lease)
            && let Some(done) = waiting.pop_front()
        {
            self.owed.remove(&(done.first, lease));
            match waiting.front() {
                Some(next) => {
                    self.owed.insert((next.first, lease));
                }
                None => {
                    self.sent.remove(&lease);
                }
            }
        }
        if let Ok(secs) = u64::try_from(ttl)
            && secs > 0
        {
            let ttl = Duration::from_secs(secs);
            self.shortest = Some(self.shortest.map_or(ttl, |t| t.min(ttl)));
        }
    }

    /// A new stream opened with one renewal of each lease owed one: each
    /// waits for that one's answer from now, and is owed it since it was
    /// first sent.
    fn reopened(&mut self, at: Instant) {
        for waiting in self.sent.values_mut() {
            if let Some(oldest) = waiting.front().copied() {
                *waiting = VecDeque::from([Waiting {
                    first: oldest.first,
                    sent: at,
                }]);
            }
        }
    }

    /// How long a renewal may wait for its answer: `DEADLINE`, or a third
    /// of the shortest lease seen if that is less. A renewal is sent at
    /// most a third of a TTL after the last one answered (`registry/lives.rs`
    /// sends one per third while a task is heard), so one that waited this
    /// long and is then sent on another member, opened within the same
    /// deadline, still arrives before its lease runs out. A fixed deadline
    /// longer than that lets a short lease run out on a stopped member
    /// before the stream moves.
    fn deadline(&self) -> Duration {
        self.shortest
            .map_or(DEADLINE, |ttl| (ttl / 3).min(DEADLINE))
    }

    /// The earliest moment a renewal on the stream is overdue.
    fn overdue_at(&self) -> Option<Instant> {
        let deadline = self.deadline();
        self.sent
            .values()
            .filter_map(|w| w.front())
            .map(|w| w.sent)
            .min()
            .map(|t| t + deadline)
    }

    /// When the renewal owed an answer the longest was first sent.
    fn owed_since(&self) -> Option<Instant> {
        self.owed.first().map(|&(t, _)| t)
    }
}

/// The members that failed the stream lately (by member), asked last.
#[derive(Default)]
struct Avoided(HashMap<usize, Instant>);

impl Avoided {
    fn failed(&mut self, member: usize) {
        self.0.insert(member, Instant::now());
    }

    /// The members to open the stream on: every member that has not failed
    /// in the last `AVOID`, or every member if each one has.
    fn candidates(&mut self, members: usize) -> Vec<usize> {
        self.0.retain(|_, at| at.elapsed() < AVOID);
        let fresh: Vec<usize> = (0..members).filter(|m| !self.0.contains_key(m)).collect();
        if fresh.is_empty() {
            (0..members).collect()
        } else {
            fresh
        }
    }
}

/// Opens the stream on each of `members` at once, sending `first`: the
/// first to answer within `within` takes it (the other openings are
/// dropped). The members that did not are noted in `avoided`.
async fn open(
    client: &Arc<Client>,
    members: Vec<usize>,
    first: &[Lease],
    within: Duration,
    avoided: &mut Avoided,
) -> Result<LeaseStream, String> {
    let mut openings = tokio::task::JoinSet::new();
    for &m in &members {
        let (client, first) = (client.clone(), first.to_vec());
        openings.spawn(async move { (m, client.lease_stream_on(m, &first, within).await) });
    }
    let mut why = Vec::new();
    while let Some(done) = openings.join_next().await {
        match done {
            Ok((_, Ok(stream))) => return Ok(stream),
            Ok((m, Err(e))) => {
                avoided.failed(m);
                why.push(e.to_string());
            }
            Err(e) => why.push(format!("an opening failed: {e}")),
        }
    }
    Err(why.join("; "))
}

async fn carry(
    client: Arc<Client>,
    rx: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Lease>>>,
    mut closed: watch::Receiver<bool>,
    acked: Arc<Acked>,
) {
    let mut rx = rx.lock().await;
    let mut unanswered = Unanswered::default();
    acked.publish(&unanswered);
    let mut avoided = Avoided::default();
    let mut backoff = RETRY_FIRST;
    loop {
        if unanswered.sent.is_empty() {
            tokio::select! {
                lease = rx.recv() => match lease {
                    Some(lease) => unanswered.sent(lease),
                    None => return,
                },
                _ = closed.wait_for(|c| *c) => return,
            }
            acked.publish(&unanswered);
        }
        // Whatever was not answered on the last stream goes on the next.
        let first: Vec<Lease> = unanswered.sent.keys().copied().collect();
        let members = avoided.candidates(client.members());
        let opened = tokio::select! {
            s = open(&client, members, &first, unanswered.deadline(), &mut avoided) => s,
            _ = closed.wait_for(|c| *c) => return,
        };
        let mut stream = match opened {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "no etcd member takes lease keep-alives; trying again");
                // Renewals queued meanwhile go with the next opening.
                let wait = tokio::time::sleep(backoff);
                tokio::pin!(wait);
                loop {
                    tokio::select! {
                        () = &mut wait => break,
                        lease = rx.recv() => match lease {
                            Some(lease) => unanswered.sent(lease),
                            None => return,
                        },
                        _ = closed.wait_for(|c| *c) => return,
                    }
                }
                backoff = (backoff * 2).min(RETRY_MAX);
                continue;
            }
        };
        // One renewal of each went with the opening.
        unanswered.reopened(Instant::now());
        match pump(&mut stream, &mut rx, &mut unanswered, &mut closed, &acked).await {
            Pumped::Stop => return,
            Pumped::Broken(why) => {
                client.skip(&stream.endpoint);
                if let Some(m) = client.member_at(&stream.endpoint) {
                    avoided.failed(m);
                }
                tracing::warn!(endpoint = %stream.endpoint, error = %why, "the lease keep-alive stream broke; moving to another member");
            }
        }
        acked.publish(&unanswered);
        backoff = RETRY_FIRST;
    }
}

enum Pumped {
    Stop,
    Broken(String),
}

/// Sends renewals and reads their answers until the stream breaks.
async fn pump(
    stream: &mut LeaseStream,
    rx: &mut mpsc::UnboundedReceiver<Lease>,
    unanswered: &mut Unanswered,
    closed: &mut watch::Receiver<bool>,
    acked: &Acked,
) -> Pumped {
    loop {
        acked.publish(unanswered);
        let overdue = unanswered.overdue_at();
        let late = async {
            match overdue {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            lease = rx.recv() => {
                let Some(lease) = lease else { return Pumped::Stop };
                if !stream.send(lease) {
                    unanswered.sent(lease);
                    return Pumped::Broken("the stream closed".into());
                }
                unanswered.sent(lease);
            }
            answer = stream.next() => match answer {
                Ok(Some((lease, ttl))) => {
                    unanswered.answered(lease, ttl);
                    if ttl <= 0 {
                        // Expired (its live key is gone, which the watch
                        // delivers) or revoked: nothing to renew.
                        tracing::debug!(lease, "a lease kept alive had expired");
                    }
                }
                Ok(None) => return Pumped::Broken("the member closed the stream".into()),
                Err(e) => return Pumped::Broken(e.to_string()),
            },
            () = late => {
                return Pumped::Broken(format!("a renewal got no answer within {:?}", unanswered.deadline()));
            }
            _ = closed.wait_for(|c| *c) => return Pumped::Stop,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The task that carries renewals, if it panics, is started again on
    /// the same queue (the supervisor names it, `keep_alive_restarted`);
    /// one that keeps panicking stops the server.
    #[tokio::test(start_paused = true)]
    async fn a_keep_alive_task_that_panics_is_started_again_on_its_queue() {
        let supervisor = crate::supervise::Supervisor::new();
        let config = super::super::EtcdConfig::new(vec!["http://127.0.0.1:9".into()]);
        let client = Arc::new(Client::new(&config).unwrap());
        let (_open, closed) = watch::channel(false);
        let keep = KeepAlives::start(client, closed, &supervisor);
        keep.renew(PANIC_LEASE);
        while supervisor.problems().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(supervisor.problems(), ["keep_alive_restarted"]);
        // Each start takes the next renewal from the same queue.
        for _ in 0..crate::supervise::MAX_RESTARTS {
            keep.renew(PANIC_LEASE);
        }
        let why = supervisor.stopping().await;
        assert!(why.contains("`keep_alive` panicked 5 times"), "{why}");
    }

    /// A lease renewed twice before the first answer came: the second
    /// renewal is still waited for once the first is answered.
    #[test]
    fn each_renewal_of_a_lease_is_waited_for() {
        let mut u = Unanswered::default();
        u.sent(7);
        u.sent(7);
        u.answered(7, 3);
        assert!(u.overdue_at().is_some(), "the second renewal is waited for");
        u.answered(7, 3);
        assert_eq!(u.overdue_at(), None);
    }

    /// A renewal is owed an answer from when it was first sent, across
    /// the streams it is sent again on: what says whether renewals are
    /// acknowledged (`KeepAlives::renewing`).
    #[test]
    fn a_renewal_is_owed_from_its_first_sending_across_streams() {
        let mut u = Unanswered::default();
        assert_eq!(u.owed_since(), None);
        u.sent(7);
        let first = u.owed_since().expect("owed");
        u.sent(8);
        u.sent(7);
        assert_eq!(u.owed_since(), Some(first), "the oldest");
        let later = Instant::now() + Duration::from_secs(1);
        u.reopened(later);
        assert_eq!(u.owed_since(), Some(first), "still owed since then");
        assert_eq!(
            u.overdue_at(),
            Some(later + DEADLINE),
            "this stream's deadline"
        );
        assert_eq!(u.sent[&7].len(), 1, "one renewal went with the opening");
        u.answered(7, 3);
        let eight = u.owed_since().expect("8 is owed");
        assert!(eight >= first);
        u.answered(8, 3);
        assert_eq!(u.owed_since(), None);
        let acked = Acked::new();
        acked.publish(&u);
        assert!(acked.renewing());
    }

    /// Unanswered past the deadline: not renewing, until answered.
    #[test]
    fn renewals_owed_past_the_deadline_are_not_acknowledged() {
        let acked = Acked::new();
        let mut u = Unanswered::default();
        u.sent(7);
        acked.publish(&u);
        assert!(acked.renewing(), "within the deadline");
        // As if it had been sent a deadline ago.
        let since = acked.owed_since.load(Ordering::SeqCst);
        acked.owed_since.store(
            since - i64::try_from(DEADLINE.as_nanos()).unwrap(),
            Ordering::SeqCst,
        );
        assert!(!acked.renewing());
        u.answered(7, 3);
        acked.publish(&u);
        assert!(acked.renewing());
    }

    /// A member that failed the stream is asked only when every other
    /// failed too.
    #[test]
    fn members_that_failed_lately_are_asked_last() {
        let mut avoided = Avoided::default();
        assert_eq!(avoided.candidates(3), [0, 1, 2]);
        avoided.failed(0);
        assert_eq!(avoided.candidates(3), [1, 2]);
        avoided.failed(2);
        assert_eq!(avoided.candidates(3), [1]);
        avoided.failed(1);
        assert_eq!(avoided.candidates(3), [0, 1, 2], "all failed: all asked");
    }

    #[test]
    fn a_renewal_waits_a_second_or_a_third_of_the_shortest_lease() {
        let mut u = Unanswered::default();
        assert_eq!(u.deadline(), DEADLINE, "no lease answered yet");
        u.sent(7);
        u.answered(7, 30);
        assert_eq!(u.deadline(), DEADLINE);
        u.answered(8, 1);
        assert_eq!(
            u.deadline(),
            Duration::from_millis(333) + Duration::from_nanos(333_333)
        );
        // An expired lease (TTL 0) says nothing of how long leases run.
        u.answered(9, 0);
        u.answered(9, -1);
        u.answered(10, 6);
        assert_eq!(u.deadline(), Duration::from_secs(1) / 3);
        assert!(u.sent.is_empty());
    }
}
