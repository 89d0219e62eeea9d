//! Long-lived tasks, each owned by something that notices its end.
//!
//! Every task that runs for the life of the server — the disk store's
//! writer and checkpoint threads, the etcd store's watch and its lease
//! keep-alive stream, the due-time heap's driver — is started through a
//! `Supervisor`, and none dies in silence:
//!
//! - one that can start afresh (`keep`) is started again when it panics,
//!   after a wait that doubles, and health says `degraded`, naming it
//!   (`<name>_restarted`), for `RECENT` after its last restart; one that
//!   keeps panicking (`MAX_RESTARTS` in a row, each within `RECENT` of the
//!   one before) stops the server;
//! - one the server cannot go on without (`vital`: the disk store's writer,
//!   whose state a panic leaves unknown) stops the server when it ends
//!   unasked: taskgate exits non-zero, and a restart recovers from what is
//!   durable.

use std::{
    collections::BTreeMap,
    future::Future,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use tokio::{sync::watch, time::Instant};

/// How long health names a task after its last restart.
pub const RECENT: Duration = Duration::from_secs(300);

/// Restarts in a row, each within `RECENT` of the one before, after which
/// the server stops instead.
pub const MAX_RESTARTS: u32 = 5;

/// The first wait before a restart, doubling to `LAST_WAIT`.
const FIRST_WAIT: Duration = Duration::from_millis(100);
const LAST_WAIT: Duration = Duration::from_secs(10);

/// The long-lived tasks of one server (cheap to clone).
#[derive(Clone, Default)]
pub struct Supervisor(Arc<Shared>);

#[derive(Default)]
struct Shared {
    /// Each task's restarts. A std lock, held only to read or write it.
    tasks: Mutex<BTreeMap<&'static str, Restarts>>,
    /// Why the server must stop, once a task it cannot go on without
    /// ended.
    fatal: watch::Sender<Option<String>>,
}

#[derive(Clone, Copy, Default)]
struct Restarts {
    /// Restarts in a row, each within `RECENT` of the one before.
    in_a_row: u32,
    last: Option<Instant>,
}

impl Supervisor {
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs the task `start` makes, and a new one each time it panics
    /// (see the module's comment); its return ends it for good. Must be
    /// called inside a runtime.
    pub fn keep<F, Fut>(&self, name: &'static str, start: F)
    where
        F: Fn() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let supervisor = self.clone();
        tokio::spawn(async move {
            let mut wait = FIRST_WAIT;
            loop {
                let ended = tokio::spawn(start()).await;
                let why = match ended {
                    Ok(()) => return,
                    Err(e) if e.is_cancelled() => return,
                    Err(e) => panic_message(e.into_panic()),
                };
                let in_a_row = supervisor.restarted(name);
                if in_a_row >= MAX_RESTARTS {
                    supervisor.stop(format!(
                        "the task `{name}` panicked {in_a_row} times in a row (last: {why})"
                    ));
                    return;
                }
                tracing::error!(task = name, error = %why, wait = ?wait, "a task panicked; it is started again");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(LAST_WAIT);
            }
        });
    }

    /// Counts a restart of `name` (by `keep`, or by the owner of a thread
    /// it started again); returns how many came in a row.
    pub fn restarted(&self, name: &'static str) -> u32 {
        let now = Instant::now();
        let mut tasks = self.0.tasks.lock().unwrap_or_else(PoisonError::into_inner);
        let r = tasks.entry(name).or_default();
        let recent = r.last.is_some_and(|last| now - last < RECENT);
        r.in_a_row = if recent { r.in_a_row + 1 } else { 1 };
        r.last = Some(now);
        r.in_a_row
    }

    /// A guard for a task the server cannot go on without: dropped before
    /// `Vital::done` (a panic unwinding through it, or a return nobody
    /// asked for), it stops the server.
    pub fn vital(&self, name: &'static str) -> Vital {
        Vital {
            supervisor: self.clone(),
            name,
            done: false,
        }
    }

    /// Stops the server: `stopping` resolves with `why`.
    pub fn stop(&self, why: String) {
        tracing::error!(error = %why, "a task the server cannot go on without ended; stopping");
        self.0.fatal.send_if_modified(|fatal| {
            let first = fatal.is_none();
            if first {
                *fatal = Some(why);
            }
            first
        });
    }

    /// Resolves once the server must stop, with why.
    pub async fn stopping(&self) -> String {
        let mut fatal = self.0.fatal.subscribe();
        let why = match fatal.wait_for(Option::is_some).await {
            Ok(why) => why.clone(),
            Err(_) => None,
        };
        match why {
            Some(why) => why,
            // The sender lives as long as `self`.
            None => std::future::pending().await,
        }
    }

    /// The problems health names: `<name>_restarted` for each task
    /// restarted within `RECENT`, and `<name>_ended` once the server must
    /// stop.
    pub fn problems(&self) -> Vec<String> {
        let now = Instant::now();
        let tasks = self.0.tasks.lock().unwrap_or_else(PoisonError::into_inner);
        let mut problems: Vec<String> = tasks
            .iter()
            .filter(|(_, r)| r.last.is_some_and(|last| now - last < RECENT))
            .map(|(name, _)| format!("{name}_restarted"))
            .collect();
        drop(tasks);
        if self.0.fatal.borrow().is_some() {
            problems.push("task_ended".into());
        }
        problems
    }
}

/// See `Supervisor::vital`.
pub struct Vital {
    supervisor: Supervisor,
    name: &'static str,
    done: bool,
}

impl Vital {
    /// The task ends as asked.
    pub fn done(mut self) {
        self.done = true;
    }
}

impl Drop for Vital {
    fn drop(&mut self) {
        if !self.done {
            let how = if std::thread::panicking() {
                "panicked"
            } else {
                "ended"
            };
            self.supervisor
                .stop(format!("the task `{}` {how}", self.name));
        }
    }
}

/// What a panic said, if it said it in text.
fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(payload) => match payload.downcast::<&'static str>() {
            Ok(s) => (*s).to_owned(),
            Err(_) => "a panic without a message".to_owned(),
        },
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    /// A task that panics is started again, and health names it for
    /// `RECENT`; one that keeps panicking stops the server instead.
    #[tokio::test(start_paused = true)]
    async fn a_panicking_task_is_started_again_named_then_the_server_stops() {
        let s = Supervisor::new();
        let starts = Arc::new(AtomicU32::new(0));
        let counted = starts.clone();
        s.keep("timers", move || {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    panic!("first run");
                }
                std::future::pending::<()>().await;
            }
        });
        while starts.load(Ordering::SeqCst) < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(s.problems(), ["timers_restarted"]);
        tokio::time::sleep(RECENT).await;
        assert!(s.problems().is_empty(), "named for a while only");

        let stopping = {
            let s = s.clone();
            tokio::spawn(async move { s.stopping().await })
        };
        s.keep("follower", || async { panic!("always") });
        let why = stopping.await.unwrap();
        assert!(why.contains("`follower` panicked 5 times"), "{why}");
        assert!(why.contains("always"), "{why}");
        assert!(s.problems().contains(&"task_ended".to_owned()));
    }

    /// A vital task's guard stops the server when the task panics or ends
    /// unasked, and not when it ends as asked.
    #[tokio::test]
    async fn a_vital_task_that_ends_unasked_stops_the_server() {
        let s = Supervisor::new();
        let guard = s.vital("store_writer");
        std::thread::spawn(move || guard.done()).join().unwrap();
        assert!(s.problems().is_empty());
        let guard = s.vital("store_writer");
        let died = std::thread::spawn(move || {
            let _guard = guard;
            panic!("the follower's bug");
        });
        assert!(died.join().is_err());
        let why = tokio::time::timeout(Duration::from_secs(10), s.stopping())
            .await
            .expect("stopping");
        assert_eq!(why, "the task `store_writer` panicked");
    }
}
