//! The signals that end `taskgate agent` cleanly (its task stopped and
//! reported dead, all it started gone): every signal whose default action
//! ends a process and that a process may catch, but for the faults a
//! program raises on itself (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT,
//! SIGSYS, SIGTRAP) and SIGPIPE, which Rust programs ignore. Left to its
//! default action, any of them would end the agent without a word and
//! leave its workload running under init.

use rustix::process::Signal;

/// The C library's first real-time signal (`SIGRTMIN`). The signals below
/// it, from 32, are the library's own (glibc keeps 32 and 33, musl 32 to
/// 34) and it refuses a handler for them: one sent from outside ends the
/// agent as SIGKILL does.
#[cfg(target_env = "musl")]
const RT_MIN: i32 = 35;
#[cfg(not(target_env = "musl"))]
const RT_MIN: i32 = 34;
/// The last real-time signal (`SIGRTMAX`) on Linux.
const RT_MAX: i32 = 64;

/// Every signal the agent handles, by number, with the name its log uses.
fn handled() -> Vec<(i32, String)> {
    let named = [
        (Signal::HUP, "SIGHUP"),
        (Signal::INT, "SIGINT"),
        (Signal::QUIT, "SIGQUIT"),
        (Signal::TERM, "SIGTERM"),
        (Signal::USR1, "SIGUSR1"),
        (Signal::USR2, "SIGUSR2"),
        (Signal::ALARM, "SIGALRM"),
        (Signal::VTALARM, "SIGVTALRM"),
        (Signal::PROF, "SIGPROF"),
        (Signal::XCPU, "SIGXCPU"),
        (Signal::XFSZ, "SIGXFSZ"),
        (Signal::IO, "SIGIO"),
        (Signal::POWER, "SIGPWR"),
        (Signal::STKFLT, "SIGSTKFLT"),
    ];
    let mut all: Vec<(i32, String)> = named
        .into_iter()
        .map(|(sig, name)| (sig.as_raw(), name.to_owned()))
        .collect();
    all.extend((RT_MIN..=RT_MAX).map(|n| (n, rt_name(n))));
    all
}

/// `SIGRTMIN`, `SIGRTMIN+n`, `SIGRTMAX-n`, `SIGRTMAX`, as `kill -l` says.
fn rt_name(n: i32) -> String {
    let (from_min, to_max) = (n - RT_MIN, RT_MAX - n);
    match (from_min, to_max) {
        (0, _) => "SIGRTMIN".to_owned(),
        (_, 0) => "SIGRTMAX".to_owned(),
        (k, _) if k <= (RT_MAX - RT_MIN) / 2 => format!("SIGRTMIN+{k}"),
        (_, k) => format!("SIGRTMAX-{k}"),
    }
}

/// The agent's handlers of every terminating signal, installed when made.
pub struct Terminating(Vec<(tokio::signal::unix::Signal, String)>);

impl Terminating {
    /// Installs the handlers now (a signal that comes before would end
    /// the process). A signal whose handler cannot be installed keeps its
    /// default action, and is named in the log.
    pub fn listen() -> Self {
        use tokio::signal::unix::{SignalKind, signal};
        let mut handlers = Vec::new();
        for (number, name) in handled() {
            match signal(SignalKind::from_raw(number)) {
                Ok(handler) => handlers.push((handler, name)),
                Err(e) => tracing::warn!(signal = name, error = %e, "cannot handle the signal"),
            }
        }
        Self(handlers)
    }

    /// The next terminating signal's name.
    pub async fn recv(&mut self) -> String {
        std::future::poll_fn(|cx| {
            self.0
                .iter_mut()
                .find_map(|(handler, name)| handler.poll_recv(cx).is_ready().then(|| name.clone()))
                .map_or(std::task::Poll::Pending, std::task::Poll::Ready)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_real_time_signal_and_sigstkflt_are_handled_and_no_fault() {
        let all = handled();
        let numbers: std::collections::BTreeSet<i32> = all.iter().map(|(n, _)| *n).collect();
        assert_eq!(numbers.len(), all.len(), "each once: {all:?}");
        for n in RT_MIN..=RT_MAX {
            assert!(numbers.contains(&n), "signal {n}");
        }
        for sig in [Signal::TERM, Signal::STKFLT, Signal::POWER] {
            assert!(numbers.contains(&sig.as_raw()), "{sig:?}");
        }
        for sig in [
            Signal::KILL,
            Signal::STOP,
            Signal::SEGV,
            Signal::BUS,
            Signal::ILL,
            Signal::FPE,
            Signal::ABORT,
            Signal::SYS,
            Signal::TRAP,
            Signal::PIPE,
            Signal::CHILD,
            Signal::WINCH,
            Signal::URG,
            Signal::CONT,
        ] {
            assert!(!numbers.contains(&sig.as_raw()), "{sig:?}");
        }
        for n in 32..RT_MIN {
            assert!(!numbers.contains(&n), "{n}: the C library's own");
        }
    }

    #[test]
    fn real_time_signals_are_named_as_kill_names_them() {
        assert_eq!(rt_name(RT_MIN), "SIGRTMIN");
        assert_eq!(rt_name(RT_MIN + 3), "SIGRTMIN+3");
        assert_eq!(rt_name(RT_MAX - 1), "SIGRTMAX-1");
        assert_eq!(rt_name(RT_MAX), "SIGRTMAX");
    }
}
