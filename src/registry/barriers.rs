//! Barriers across allocations (docs/lifecycle.md, "Barriers"): each
//! barrier's members as the published records give them, and what the
//! judge of `gates.rs` decides for them.
//!
//! A member's standing is in its own record (`Meet`): arrived (since a
//! time), or decided for it — passed (the barrier opened) or closed (it
//! timed out). A barrier is only the index of its members' records,
//! rebuilt at start; it exists while it has members.
//!
//! **Deciding once.** The decision is written first to one member, the
//! **anchor**: the member registered first (the lowest `create_index`;
//! every replica's view is a prefix of one history, so every view that
//! holds the anchor agrees on it, and a deleted anchor can no longer be
//! written). Opening (`size` members arrived) and timing out (the first
//! arrival older than `timeout`) are both written to the anchor, so the
//! allocation's compare-and-swap keeps one of them whichever replica
//! decides. Every other member then follows the anchor's decision, each
//! by a write of its own allocation: a thousand members never meet in
//! one transaction. An anchor whose allocation is deleted before the
//! others followed leaves its decision in the index (`left`), and they
//! follow it still; only a view rebuilt from the records in that moment
//! (a start) has lost it, and there they gather again.

use std::{collections::BTreeMap, time::Duration};

use super::{Registry, RegistryError, gates::State};
use crate::lifecycle::{AllocId, Allocation, BarrierSpec, Meet, SemName, Timestamp};

/// A member: its allocation's `create_index`, the allocation, the task's
/// position. Ordered as registered: the first is the anchor.
pub type MemberKey = (u64, AllocId, usize);

/// One barrier, as the published records give it.
#[derive(Default)]
pub(super) struct Barrier {
    /// Each member's spec and standing.
    members: BTreeMap<MemberKey, (BarrierSpec, Option<Meet>)>,
    /// The decision of a member whose allocation was deleted before any
    /// other member followed it (`State::keep_decisions`): the others
    /// follow it, though no record holds it any more.
    left: Option<Meet>,
    /// The index of the last change of a member.
    changed: u64,
}

/// What a barrier has come to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarrierPhase {
    /// Not decided: `arrived` of its members count, the first since
    /// `first`.
    Gathering {
        arrived: usize,
        first: Option<Timestamp>,
    },
    /// Opened at this time.
    Open(Timestamp),
    /// Timed out at this time.
    TimedOut(Timestamp),
}

/// A barrier as `GET /v1/barriers/{name}` shows it.
#[derive(Clone, Debug)]
pub struct BarrierState {
    pub name: SemName,
    /// The anchor's (every member's, but for a race of registrations on
    /// replicas).
    pub size: u16,
    pub timeout: Option<Duration>,
    /// In registration order: allocation, task position, standing.
    pub members: Vec<(AllocId, usize, Option<Meet>)>,
    pub phase: BarrierPhase,
    /// The index of the last change of a member.
    pub changed: u64,
}

impl Barrier {
    fn anchor(&self) -> Option<(&MemberKey, &BarrierSpec)> {
        self.members.iter().next().map(|(k, (spec, _))| (k, spec))
    }

    fn phase(&self) -> BarrierPhase {
        let (mut arrived, mut first) = (0, None::<Timestamp>);
        for (_, meet) in self.members.values() {
            match *meet {
                Some(Meet::Passed { at }) => return BarrierPhase::Open(at),
                Some(Meet::Closed { at }) => return BarrierPhase::TimedOut(at),
                Some(Meet::Arrived { at }) => {
                    arrived += 1;
                    first = Some(first.map_or(at, |f| f.min(at)));
                }
                None => {}
            }
        }
        match self.left {
            Some(Meet::Passed { at }) => BarrierPhase::Open(at),
            Some(Meet::Closed { at }) => BarrierPhase::TimedOut(at),
            _ => BarrierPhase::Gathering { arrived, first },
        }
    }

    /// When a gathering barrier times out, if it does.
    fn due(&self) -> Option<Timestamp> {
        self.due_in(self.phase())
    }

    /// `due`, the phase known.
    fn due_in(&self, phase: BarrierPhase) -> Option<Timestamp> {
        let (_, spec) = self.anchor()?;
        match phase {
            BarrierPhase::Gathering {
                arrived,
                first: Some(first),
            } if arrived < usize::from(spec.size) => {
                let timeout = time::Duration::try_from(spec.timeout?).ok()?;
                Some(first.saturating_add(timeout))
            }
            _ => None,
        }
    }

    /// What member `key` is to be told now (`None`: nothing), the
    /// barrier being in `phase` (`self.phase()`, which the caller reads
    /// once: it counts every member): the decision once the anchor holds
    /// one, else, for the anchor alone, the opening once `size` members
    /// arrived or the timeout once it passed.
    fn verdict(&self, phase: BarrierPhase, key: &MemberKey, now: Timestamp) -> Option<Meet> {
        let (_, meet) = self.members.get(key)?;
        if meet.is_some_and(Meet::decided) {
            return None;
        }
        match phase {
            BarrierPhase::Open(at) => Some(Meet::Passed { at }),
            BarrierPhase::TimedOut(at) => Some(Meet::Closed { at }),
            BarrierPhase::Gathering { arrived, .. } => {
                let (anchor, spec) = self.anchor()?;
                if anchor != key {
                    None
                } else if arrived >= usize::from(spec.size) {
                    Some(Meet::Passed { at: now })
                } else if self.due_in(phase).is_some_and(|due| due <= now) {
                    Some(Meet::Closed { at: now })
                } else {
                    None
                }
            }
        }
    }
}

impl State {
    /// Takes `a`'s barrier members out (`add` false) or puts them in.
    pub(super) fn index_members(&mut self, a: &Allocation, add: bool, index: u64) {
        for (i, spec) in a.spec.tasks().iter().enumerate() {
            let Some(b) = &spec.barrier else { continue };
            let key = (a.create_index, a.id.clone(), i);
            let barrier = self.barriers.entry(b.name.clone()).or_default();
            if add {
                barrier.members.insert(key, (b.clone(), a.tasks[i].meet()));
            } else {
                barrier.members.remove(&key);
            }
            barrier.changed = barrier.changed.max(index);
            // A barrier exists while it has members.
            if barrier.members.is_empty() {
                self.barriers.remove(&b.name);
            }
            self.gathering.insert(b.name.clone());
        }
    }

    /// A deleted allocation's decided members leave the decision with
    /// their barrier while none of its other members holds it (the
    /// anchor's allocation deleted before the others followed): they
    /// follow it still (`left`).
    pub(super) fn keep_decisions(&mut self, a: &Allocation) {
        for (i, spec) in a.spec.tasks().iter().enumerate() {
            let (Some(b), Some(meet)) = (&spec.barrier, a.tasks[i].meet()) else {
                continue;
            };
            if let Some(barrier) = self.barriers.get_mut(&b.name)
                && meet.decided()
                && !barrier
                    .members
                    .values()
                    .any(|(_, m)| m.is_some_and(Meet::decided))
            {
                barrier.left = Some(meet);
            }
        }
    }

    /// The members of the barriers in `names` to write a decision to now.
    pub(super) fn plan_meets(
        &self,
        names: &std::collections::BTreeSet<SemName>,
        now: Timestamp,
    ) -> Vec<(AllocId, usize, SemName)> {
        let mut out = Vec::new();
        for name in names {
            let Some(b) = self.barriers.get(name) else {
                continue;
            };
            // One pass for the phase, one for the members: a barrier of a
            // thousand members planned after each arrival stays linear.
            let phase = b.phase();
            let keys: Box<dyn Iterator<Item = &MemberKey>> = match phase {
                // Only the anchor decides.
                BarrierPhase::Gathering { .. } => Box::new(b.members.keys().take(1)),
                _ => Box::new(b.members.keys()),
            };
            for key in keys {
                if b.verdict(phase, key, now).is_some() {
                    out.push((key.1.clone(), key.2, name.clone()));
                }
            }
        }
        out
    }

    /// Whether task `i` of `a` may join its barrier: refused when the
    /// barrier decided, or holds `size` members already (closed, which
    /// wins), or when its members say another size or timeout
    /// (mismatch). `earlier`: members of `a` itself before `i`.
    fn may_join(&self, a: &Allocation, i: usize) -> Result<(), RegistryError> {
        let Some(b) = &a.spec.tasks()[i].barrier else {
            return Ok(());
        };
        let earlier: Vec<&BarrierSpec> = a.spec.tasks()[..i]
            .iter()
            .filter_map(|t| t.barrier.as_ref())
            .filter(|o| o.name == b.name)
            .collect();
        let held = self.barriers.get(&b.name);
        let members = held.map_or(0, |h| h.members.len()) + earlier.len();
        let first = held
            .and_then(|h| h.anchor().map(|(_, s)| s))
            .or(earlier.first().copied());
        let size = first.map_or(b.size, |f| f.size);
        if held.is_some_and(|h| !matches!(h.phase(), BarrierPhase::Gathering { .. })) {
            return Err(RegistryError::BarrierClosed {
                name: b.name.to_string(),
                why: "it opened or timed out already; a barrier is met once".into(),
            });
        }
        if members >= usize::from(size) {
            return Err(RegistryError::BarrierClosed {
                name: b.name.to_string(),
                why: format!("it has its {size} members already"),
            });
        }
        if let Some(f) = first
            && (f.size, f.timeout) != (b.size, b.timeout)
        {
            return Err(RegistryError::BarrierMismatch {
                name: b.name.to_string(),
                size: f.size,
                timeout: f.timeout,
            });
        }
        Ok(())
    }

    /// Task `i` of `a`'s barrier: (name, arrived, size), while `i` is
    /// counted among the arrived and the barrier gathers.
    fn gathering_for(&self, a: &Allocation, i: usize) -> Option<(SemName, usize, u16, bool)> {
        let spec = a.spec.tasks()[i].barrier.as_ref()?;
        let meet = a.tasks[i].meet()?;
        let b = self.barriers.get(&spec.name)?;
        let size = b.anchor().map_or(spec.size, |(_, s)| s.size);
        match (meet, b.phase()) {
            (Meet::Arrived { .. }, BarrierPhase::Gathering { arrived, .. }) => {
                Some((spec.name.clone(), arrived, size, false))
            }
            (Meet::Closed { .. }, _) => Some((spec.name.clone(), 0, size, true)),
            _ => None,
        }
    }
}

/// Why a member is held back by its barrier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Gathering {
    /// It gathers: `arrived` of `size` are counted.
    Gathering { arrived: usize, size: u16 },
    /// It timed out: the member never passes it.
    TimedOut { size: u16 },
}

impl super::gates::Gates {
    /// Every barrier of `a` that gathers and times out, the earliest
    /// moment; those past it are handed to the judge at once.
    pub(super) fn barrier_due(&self, a: &Allocation, now: Timestamp) -> Option<Timestamp> {
        let mut state = self.state();
        let mut next = None::<Timestamp>;
        let mut passed = Vec::new();
        for spec in a.spec.tasks().iter().filter_map(|t| t.barrier.as_ref()) {
            let Some(due) = state.barriers.get(&spec.name).and_then(Barrier::due) else {
                continue;
            };
            if due <= now {
                passed.push(spec.name.clone());
            } else {
                next = Some(next.map_or(due, |n| n.min(due)));
            }
        }
        if !passed.is_empty() {
            state.gathering.extend(passed);
            self.idle.send_replace(false);
            drop(state);
            self.wake.notify_one();
        }
        next
    }
}

impl Registry {
    /// Refuses a registration whose barrier members may not join (see
    /// `State::may_join`), as the published view holds the barriers (the
    /// registrations' lock keeps this server's from racing).
    pub(super) fn check_barriers(&self, a: &Allocation) -> Result<(), RegistryError> {
        if !a.spec.gathers() {
            return Ok(());
        }
        let state = self.inner.gates.state();
        (0..a.tasks.len()).try_for_each(|i| state.may_join(a, i))
    }

    /// Writes to task `i` of `id` what its barrier `name` decided, if the
    /// view still says so when its allocation's write decides.
    pub(super) async fn meet(
        &self,
        id: &AllocId,
        i: usize,
        name: &SemName,
    ) -> Result<(), RegistryError> {
        // The decision itself (the barrier still gathers) is made under
        // the registrations' lock: a registration checks a barrier and
        // publishes its member under it, so none is accepted between the
        // decision and its publication (a registration after a timeout or
        // an opening is refused, one before it is decided with the rest).
        let gathers = {
            let state = self.inner.gates.state();
            let b = state.barriers.get(name);
            b.is_some_and(|b| matches!(b.phase(), BarrierPhase::Gathering { .. }))
        };
        let _serial = match gathers {
            true => Some(self.inner.registering.clone().lock_owned().await),
            false => None,
        };
        let written = self
            .write(
                id.as_str(),
                |a, next_index| {
                    let now = self.now();
                    let key = (a.create_index, a.id.clone(), i);
                    let verdict = self
                        .inner
                        .gates
                        .state()
                        .barriers
                        .get(name)
                        .and_then(|b| b.verdict(b.phase(), &key, now));
                    Ok((
                        verdict.and_then(|m| a.meet_decided(i, m, now, next_index)),
                        (),
                    ))
                },
                |_| {},
            )
            .await;
        match written {
            Ok(_) | Err(RegistryError::AllocationNotFound(_) | RegistryError::Deleted(_)) => Ok(()),
            Err(e) => {
                tracing::warn!(alloc = %id, barrier = %name, error = %e, "a barrier's decision could not be written to a member; trying again");
                Err(e)
            }
        }
    }

    /// The barrier `name`, while it has members.
    pub fn barrier(&self, name: &str) -> Option<BarrierState> {
        let state = self.inner.gates.state();
        let b = state.barriers.get(name)?;
        let (_, spec) = b.anchor()?;
        Some(BarrierState {
            name: spec.name.clone(),
            size: spec.size,
            timeout: spec.timeout,
            members: b
                .members
                .iter()
                .map(|((_, id, i), (_, meet))| (id.clone(), *i, *meet))
                .collect(),
            phase: b.phase(),
            changed: b.changed,
        })
    }

    /// Waits until barrier `name`'s members changed past `index`, it is
    /// forgotten, or `timeout` passed; the barrier as it is then.
    pub async fn wait_barrier(
        &self,
        name: &str,
        index: u64,
        timeout: Duration,
    ) -> Option<BarrierState> {
        self.wait_gate(index, timeout, |state| {
            state.barriers.get(name).map(|b| b.changed)
        })
        .await;
        self.barrier(name)
    }

    /// Why task `i` of `a` waits at its barrier: its name and how.
    pub fn waiting_at_barrier(&self, a: &Allocation, i: usize) -> Option<(SemName, Gathering)> {
        let state = self.inner.gates.state();
        let (name, arrived, size, closed) = state.gathering_for(a, i)?;
        Some((
            name,
            if closed {
                Gathering::TimedOut { size }
            } else {
                Gathering::Gathering { arrived, size }
            },
        ))
    }
}
