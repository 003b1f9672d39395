//! Local FIFO lines: the waiters of one [`Locker`](crate::Locker) for one key
//! line up here, and only the head of the line waits at the backend.
//!
//! This removes the herd inside a process (one backend request per key and
//! locker instead of one per waiting task), and stops a releasing task from
//! barging back in ahead of the tasks that were already waiting next to it.
//!
//! Every waiter also stands in the line with an [`Offer`] to take a **handoff**:
//! a guard of the same locker that releases the key passes the lock straight to
//! the first waiter with [`Backend::release_to`](crate::Backend::release_to) —
//! one round trip where a release and a new acquire would take two, with no
//! window in which anybody else could take the lock. To keep waiters of other
//! processes from starving, at most [`MAX_HANDOFFS`] handoffs happen in a row;
//! then the lock is released plainly and every waiter races for it. (With the
//! Redis scripts, the handoff racing the head's own request is model-checked in
//! `crates/fencelock-models/src/redis_queue.rs`, `docs/SAFETY.md`; this line
//! itself runs under shuttle's schedulers in `src/shuttle_tests.rs`,
//! `docs/SAFETY.md` §3: a change here should keep those runs green.)
//!
//! The protocol lives in this module: the places and the line's bookkeeping
//! here, the [`Offer`] stages in `offer.rs`, the waiter's side (standing in
//! line, waiting as the head) in `head.rs`, the releaser's side (the handoff)
//! in `handoff.rs`.
//!
//! While a guard of this locker holds the key through the line (a
//! [`LineHold`]), the head does not wait at the backend: the lock is busy, and
//! it will be handed over or released here, which wakes the head. It only
//! re-checks with one `try_acquire` a second, in case that guard's lease was
//! lost without the guard being dropped.
//!
//! Lines are used for exclusive requests with the default (per-guard) owner
//! only: an explicit owner may be reentrant, and queueing it behind a waiter
//! that waits for that same owner would deadlock; shared and semaphore holders
//! may hold together and must not wait for each other. Only a guard that holds
//! through the line hands off (the waiter carries its local hold on); a guard
//! from `try_acquire` or with its own owner releases plainly.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::backend::{Backend, Request};
use crate::key::Key;
#[cfg(shuttle)]
use crate::sync::{Mutation, mutated};
use crate::sync::{Mutex, lock, sleep_until};

mod handoff;
mod head;
mod offer;
#[cfg(all(test, not(shuttle)))]
mod tests;

pub(crate) use handoff::hand_off_from;
pub(crate) use head::acquire_in_line;
pub(crate) use offer::Offer;

/// Handoffs in a row before a release lets every waiter race again.
pub(crate) const MAX_HANDOFFS: u32 = 16;

#[derive(Default)]
pub(crate) struct Lines {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The lines of the keys somebody waits for.
    lines: HashMap<Key, Arc<Line>>,
    /// How many guards of this locker hold each key through a line. Kept
    /// apart from the lines: a held key nobody waits for keeps no line (a
    /// line costs ~250 bytes, which counts at 10,000 held locks).
    holders: HashMap<Key, usize>,
}

struct Line {
    /// One permit: the head of the line holds it.
    turn: Arc<Semaphore>,
    /// The waiters' offers, in arrival order (the order of the permit).
    waiters: Mutex<VecDeque<Arc<Offer>>>,
    handoffs_in_a_row: Mutex<u32>,
    /// Fired when a guard that held the key through a line is gone
    /// (released, dropped, leaked).
    holder_gone: Notify,
}

/// A waiter's place in a key's line. It is the head once it holds the permit.
/// Dropping it leaves the line (a delivered grant nobody took is given back).
pub(crate) struct Turn<'a> {
    lines: &'a Lines,
    key: Key,
    line: Arc<Line>,
    offer: Arc<Offer>,
    permit: Option<OwnedSemaphorePermit>,
}

/// Marks a guard as a local holder of its line's key while it lives.
pub(crate) struct LineHold {
    lines: Arc<Lines>,
    key: Key,
    /// Handed to the next waiter, who carries the hold on: nothing to count down.
    handed_on: bool,
}

impl Lines {
    /// Joins `key`'s line with `req` and waits until this waiter is the head,
    /// a releaser handed it the lock, or `deadline` passed (then the turn is
    /// neither head nor handed, and the caller gives up).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a cancelled waiter leaves the line, and a grant handed to it
    /// in the meantime is given back.
    pub(crate) async fn join(
        &self,
        key: &Key,
        req: &Request,
        backend: &Arc<dyn Backend>,
        deadline: Option<Instant>,
    ) -> Turn<'_> {
        let line = lock(&self.state)
            .lines
            .entry(key.clone())
            .or_insert_with(|| {
                Arc::new(Line {
                    turn: Arc::new(Semaphore::new(1)),
                    waiters: Mutex::new(VecDeque::new()),
                    handoffs_in_a_row: Mutex::new(0),
                    holder_gone: Notify::new(),
                })
            })
            .clone();
        let offer = Arc::new(Offer::new(req, backend));
        lock(&line.waiters).push_back(offer.clone());
        // The line moves into the turn: no other reference of this call may
        // outlive a cancellation, or the turn's drop could not forget it.
        let mut turn = Turn {
            lines: self,
            key: key.clone(),
            line,
            offer,
            permit: None,
        };
        let acquire = turn.line.turn.clone().acquire_owned();
        let until = async {
            match deadline {
                Some(d) => sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            p = acquire => turn.permit = p.ok(),
            _ = turn.offer.wait_delivery() => {}
            _ = until => {}
        }
        turn
    }

    /// Takes the offer of the first waiter of `key` for a handoff, unless the
    /// line has handed off [`MAX_HANDOFFS`] times in a row (then the streak
    /// resets and the caller releases plainly).
    pub(crate) fn take_offer(&self, key: &Key) -> Option<Arc<Offer>> {
        let line = lock(&self.state).lines.get(key)?.clone();
        let mut in_a_row = lock(&line.handoffs_in_a_row);
        if *in_a_row >= MAX_HANDOFFS {
            *in_a_row = 0;
            return None;
        }
        let offer = lock(&line.waiters).front()?.clone();
        if !offer.take_for_handoff() {
            return None;
        }
        *in_a_row += 1;
        Some(offer)
    }

    /// Notes a plain release of `key` (the handoff streak ends).
    pub(crate) fn released_plainly(&self, key: &Key) {
        if let Some(line) = lock(&self.state).lines.get(key) {
            *lock(&line.handoffs_in_a_row) = 0;
        }
    }

    /// Every line kept: its key, how many wait in it and how many local
    /// guards hold through it (for tests: both return to zero and the line
    /// is forgotten when everyone is gone).
    #[cfg(test)]
    pub(crate) fn census(&self) -> Vec<(Key, usize, usize)> {
        let s = lock(&self.state);
        let mut out: Vec<(Key, usize, usize)> = s
            .lines
            .iter()
            .map(|(k, l)| {
                let holders = s.holders.get(k).copied().unwrap_or(0);
                (k.clone(), lock(&l.waiters).len(), holders)
            })
            .collect();
        for (k, n) in &s.holders {
            if !s.lines.contains_key(k) {
                out.push((k.clone(), 0, *n));
            }
        }
        out
    }

    /// Forgets `line` if nobody waits in it (only the map and `refs` other
    /// references remain).
    fn forget_if_idle(&self, key: &Key, line: &Arc<Line>, refs: usize) {
        let mut s = lock(&self.state);
        if Arc::strong_count(line) == refs + 1
            && s.lines.get(key).is_some_and(|l| Arc::ptr_eq(l, line))
        {
            s.lines.remove(key);
        }
    }

    /// How many guards of this locker hold `key` through a line.
    fn holders(&self, key: &Key) -> usize {
        lock(&self.state).holders.get(key).copied().unwrap_or(0)
    }

    /// One more guard holds `key` through a line.
    fn add_holder(&self, key: &Key) {
        *lock(&self.state).holders.entry(key.clone()).or_default() += 1;
    }

    /// A guard that held `key` through a line is gone: one fewer, and the
    /// head of the key's line (if anybody waits) wakes to look.
    fn remove_holder(&self, key: &Key) {
        let line = {
            let mut s = lock(&self.state);
            if let Some(n) = s.holders.get_mut(key) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    s.holders.remove(key);
                }
            }
            s.lines.get(key).cloned()
        };
        if let Some(line) = line {
            line.holder_gone.notify_waiters();
        }
        self.forget_idle(key);
    }

    /// Forgets `key`'s line if nobody refers to it but the map: a last waiter
    /// that left while another reference was briefly taken (a handoff's
    /// look for an offer, a holder's wake-up call) could not.
    fn forget_idle(&self, key: &Key) {
        let mut s = lock(&self.state);
        if s.lines.get(key).is_some_and(|l| Arc::strong_count(l) == 1) {
            s.lines.remove(key);
        }
    }
}

impl Turn<'_> {
    /// Whether this waiter holds the permit (the head waits at the backend).
    pub(crate) fn is_head(&self) -> bool {
        self.permit.is_some()
    }

    /// This waiter's offer.
    pub(crate) fn offer(&self) -> &Offer {
        &self.offer
    }

    /// How many guards of this locker hold the key through this line.
    pub(crate) fn local_holders(&self) -> usize {
        self.lines.holders(&self.key)
    }

    /// Resolves when a local holder is gone. Enable it before checking
    /// [`Turn::local_holders`], so that a departure in between is not missed.
    pub(crate) fn holder_gone(&self) -> tokio::sync::futures::Notified<'_> {
        self.line.holder_gone.notified()
    }

    /// Registers the granted guard as a local holder; `handed` when the grant
    /// came from a local releaser, whose hold this one carries on (the count of
    /// local holders does not change, so no waiter wakes for nothing).
    pub(crate) fn hold(&self, lines: &Arc<Lines>, handed: bool) -> LineHold {
        if !handed {
            self.lines.add_holder(&self.key);
        }
        LineHold {
            lines: lines.clone(),
            key: self.key.clone(),
            handed_on: false,
        }
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        lock(&self.line.waiters).retain(|o| !Arc::ptr_eq(o, &self.offer));
        // Not finished normally (cancelled): give back what was handed meanwhile.
        // Its releaser carried the local hold on to this waiter; it ends here.
        #[cfg(shuttle)]
        let keep_count = mutated(Mutation::DroppedWaiterKeepsCount);
        #[cfg(not(shuttle))]
        let keep_count = false;
        if self.offer.abandon_on_drop() && !keep_count {
            self.lines.remove_holder(&self.key);
        }
        self.permit.take();
        // Forgotten unless others wait (the map and this turn refer to it).
        self.lines.forget_if_idle(&self.key, &self.line, 1);
    }
}

impl LineHold {
    /// The lock went to the next waiter of the line, who carries the hold on.
    pub(crate) fn hand_on(mut self) {
        self.handed_on = true;
    }
}

impl Drop for LineHold {
    fn drop(&mut self) {
        if self.handed_on {
            self.lines.forget_idle(&self.key);
        } else {
            self.lines.remove_holder(&self.key);
        }
    }
}
