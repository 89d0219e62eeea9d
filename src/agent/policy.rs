//! The restart policy, as Nomad's restart block: a number of attempts
//! within an interval, a delay between them, and what to do when they are
//! used up.

use std::{
    collections::VecDeque,
    time::{Duration, Instant},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RestartMode {
    /// Give up: the task is reported dead and failed.
    Fail,
    /// Wait until the interval frees an attempt, then restart.
    Delay,
}

#[derive(Debug)]
pub enum Decision {
    /// Restart after this long.
    After(Duration),
    /// Do not restart, for this reason.
    No(String),
}

#[derive(Debug)]
pub struct RestartPolicy {
    pub attempts: u32,
    pub interval: Duration,
    pub delay: Duration,
    pub mode: RestartMode,
    /// When the restarts within the current interval happened.
    pub history: VecDeque<Instant>,
}

impl RestartPolicy {
    /// Whether (and when) to restart a task that ended at `now`. A restart
    /// it grants is counted.
    pub fn decide(&mut self, now: Instant) -> Decision {
        while self
            .history
            .front()
            .is_some_and(|t| now.duration_since(*t) >= self.interval)
        {
            self.history.pop_front();
        }
        let jitter = self.delay.mul_f64(0.25 * fastrand::f64());
        if (self.history.len() as u32) < self.attempts {
            self.history.push_back(now);
            return Decision::After(self.delay + jitter);
        }
        match (self.mode, self.history.front()) {
            (RestartMode::Delay, Some(oldest)) => {
                let free_at = *oldest + self.interval;
                let wait = free_at.saturating_duration_since(now).max(self.delay) + jitter;
                self.history.pop_front();
                self.history.push_back(now + wait);
                Decision::After(wait)
            }
            (RestartMode::Delay, None) => Decision::After(self.delay + jitter),
            (RestartMode::Fail, _) => Decision::No(format!(
                "exceeded {} restart attempts in {:?}",
                self.attempts, self.interval
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(attempts: u32, mode: RestartMode) -> RestartPolicy {
        RestartPolicy {
            attempts,
            interval: Duration::from_secs(60),
            delay: Duration::from_secs(1),
            mode,
            history: VecDeque::new(),
        }
    }

    #[test]
    fn fail_mode_gives_up_after_the_attempts_within_the_interval() {
        let mut p = policy(2, RestartMode::Fail);
        let t0 = Instant::now();
        for _ in 0..2 {
            match p.decide(t0) {
                Decision::After(d) => {
                    assert!(d >= Duration::from_secs(1) && d <= Duration::from_millis(1250))
                }
                Decision::No(r) => panic!("{r}"),
            }
        }
        assert!(matches!(p.decide(t0), Decision::No(r) if r.contains("2 restart attempts")));
        // Once the interval has passed, attempts are available again.
        assert!(matches!(
            p.decide(t0 + Duration::from_secs(61)),
            Decision::After(_)
        ));
    }

    #[test]
    fn delay_mode_waits_for_the_interval_to_free_an_attempt() {
        let mut p = policy(1, RestartMode::Delay);
        let t0 = Instant::now();
        assert!(matches!(p.decide(t0), Decision::After(_)));
        match p.decide(t0 + Duration::from_secs(10)) {
            Decision::After(d) => {
                assert!(
                    d >= Duration::from_secs(50) && d <= Duration::from_millis(50_250),
                    "{d:?}"
                )
            }
            Decision::No(r) => panic!("{r}"),
        }
    }

    #[test]
    fn zero_attempts_in_fail_mode_never_restart() {
        let mut p = policy(0, RestartMode::Fail);
        assert!(matches!(p.decide(Instant::now()), Decision::No(_)));
    }
}
