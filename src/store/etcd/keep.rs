//! Lease keep-alives: one stream per replica, on one member at a time,
//! carrying every renewal the replica sends (`Leases::keep_alive`).
//! A renewal is served by etcd's leader from memory: no raft write, no
//! revision (etcd's lessor; lease checkpoints, off by default, would add
//! one per lease per checkpoint interval). How often each lease is renewed
//! is the registry's business (`registry/lives.rs`); this
//! only carries them and moves to the next member when the one it is on
//! breaks the stream or leaves a renewal unanswered for `DEADLINE` (less
//! with short leases).

use std::{
    collections::{HashMap, VecDeque},
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::sync::{mpsc, watch};

use super::client::{Client, LeaseStream};
use crate::store::Lease;

/// How long a renewal may go unanswered before the stream is taken to
/// another member, at most. Short: a renewal that does not arrive in time
/// is a live task declared lost. Shorter still with short leases: a third
/// of the shortest TTL etcd answered with (`Unanswered::deadline`).
const DEADLINE: Duration = Duration::from_secs(1);
/// Waits between openings that fail, doubling to `RETRY_MAX`.
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(1);

/// Where renewals are queued for the stream's task.
pub(super) struct KeepAlives {
    tx: mpsc::UnboundedSender<Lease>,
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
        supervisor.keep("keep_alive", move || {
            carry(client.clone(), rx.clone(), closed.clone())
        });
        Self { tx }
    }

    pub(super) fn renew(&self, lease: Lease) {
        let _ = self.tx.send(lease);
    }
}

/// Renewals sent and not answered yet, by lease, with when each was sent
/// (a member answers a stream's renewals in order); and the shortest lease
/// TTL etcd answered with.
#[derive(Default)]
struct Unanswered {
    sent: HashMap<Lease, VecDeque<Instant>>,
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
        self.sent
            .entry(lease)
            .or_default()
            .push_back(Instant::now());
    }

    /// A renewal was answered: the lease runs `ttl` seconds from now.
    fn answered(&mut self, lease: Lease, ttl: i64) {
        if let Some(waiting) = self.sent.get_mut(&lease) {
            waiting.pop_front();
            if waiting.is_empty() {
                self.sent.remove(&lease);
            }
        }
        if let Ok(secs) = u64::try_from(ttl)
            && secs > 0
        {
            let ttl = Duration::from_secs(secs);
            self.shortest = Some(self.shortest.map_or(ttl, |t| t.min(ttl)));
        }
    }

    /// How long a renewal may wait for its answer: `DEADLINE`, or a third
    /// of the shortest lease seen if that is less. A renewal is sent at
    /// most a third of a TTL after the last one answered (`registry/lives.rs`
    /// sends one per third while a task is heard), so one that waited this
    /// long and is then sent on another member still arrives a third of a
    /// TTL before its lease would run out. A fixed deadline longer than
    /// that lets a short lease run out on a stopped member before the
    /// stream moves.
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
            .min()
            .map(|&t| t + deadline)
    }
}

async fn carry(
    client: Arc<Client>,
    rx: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Lease>>>,
    mut closed: watch::Receiver<bool>,
) {
    let mut rx = rx.lock().await;
    let mut unanswered = Unanswered::default();
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
        }
        // Whatever was not answered on the last stream goes on the next.
        let first: Vec<Lease> = unanswered.sent.keys().copied().collect();
        let opened = tokio::select! {
            s = client.lease_stream(&first) => s,
            _ = closed.wait_for(|c| *c) => return,
        };
        let mut stream = match opened {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "no etcd member takes lease keep-alives; trying again");
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    _ = closed.wait_for(|c| *c) => return,
                }
                backoff = (backoff * 2).min(RETRY_MAX);
                continue;
            }
        };
        // One renewal of each went with the opening.
        for waiting in unanswered.sent.values_mut() {
            *waiting = VecDeque::from([Instant::now()]);
        }
        match pump(&mut stream, &mut rx, &mut unanswered, &mut closed).await {
            Pumped::Stop => return,
            Pumped::Broken(why) => {
                client.skip(&stream.endpoint);
                tracing::warn!(endpoint = %stream.endpoint, error = %why, "the lease keep-alive stream broke; moving to the next member");
            }
        }
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
) -> Pumped {
    loop {
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
