//! Lease keep-alives: one stream per replica, on one member at a time,
//! carrying every renewal the replica sends (`ReplicatedStore::keep_alive`).
//! A renewal is served by etcd's leader from memory: no raft write, no
//! revision (etcd's lessor; lease checkpoints, off by default, would add
//! one per lease per checkpoint interval). How often each
//! lease is renewed is the registry's business (`registry/keep.rs`); this
//! only carries them and moves to the next member when the one it is on
//! breaks the stream or leaves a renewal unanswered for `DEADLINE`.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::sync::{mpsc, watch};

use super::client::{Client, LeaseStream};
use crate::store::Lease;

/// How long a renewal may go unanswered before the stream is taken to
/// another member. Short: a renewal that does not arrive in time is a live
/// task declared lost.
const DEADLINE: Duration = Duration::from_secs(1);
/// Waits between openings that fail, doubling to `RETRY_MAX`.
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(1);

/// Where renewals are queued for the stream's task.
pub(super) struct KeepAlives {
    tx: mpsc::UnboundedSender<Lease>,
}

impl KeepAlives {
    /// Starts the task that carries the renewals (inside a runtime).
    pub(super) fn start(client: Arc<Client>, closed: watch::Receiver<bool>) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(carry(client, rx, closed));
        Self { tx }
    }

    pub(super) fn renew(&self, lease: Lease) {
        let _ = self.tx.send(lease);
    }
}

/// Renewals sent and not answered yet, with when each was sent.
#[derive(Default)]
struct Unanswered(HashMap<Lease, Instant>);

impl Unanswered {
    fn sent(&mut self, lease: Lease) {
        self.0.entry(lease).or_insert_with(Instant::now);
    }

    /// The earliest moment a renewal on the stream is overdue.
    fn overdue_at(&self) -> Option<Instant> {
        self.0.values().min().map(|&t| t + DEADLINE)
    }
}

async fn carry(
    client: Arc<Client>,
    mut rx: mpsc::UnboundedReceiver<Lease>,
    mut closed: watch::Receiver<bool>,
) {
    let mut unanswered = Unanswered::default();
    let mut backoff = RETRY_FIRST;
    loop {
        if unanswered.0.is_empty() {
            tokio::select! {
                lease = rx.recv() => match lease {
                    Some(lease) => unanswered.sent(lease),
                    None => return,
                },
                _ = closed.wait_for(|c| *c) => return,
            }
        }
        // Whatever was not answered on the last stream goes on the next.
        let first: Vec<Lease> = unanswered.0.keys().copied().collect();
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
        for t in unanswered.0.values_mut() {
            *t = Instant::now();
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
                    unanswered.0.remove(&lease);
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
                return Pumped::Broken(format!("a renewal got no answer within {DEADLINE:?}"));
            }
            _ = closed.wait_for(|c| *c) => return Pumped::Stop,
        }
    }
}
