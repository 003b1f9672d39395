//! Local FIFO lines: the waiters of one [`Locker`](crate::Locker) for one key
//! line up here, and only the head of the line waits at the backend.
//!
//! This removes the herd inside a process (one backend request per key and
//! locker instead of one per waiting task), and stops a releasing task from
//! barging back in ahead of the tasks that were already waiting next to it.
//!
//! The head also offers itself for a **handoff**: a guard of the same locker
//! that releases the key passes the lock straight to the head with
//! [`Backend::release_to`](crate::Backend::release_to) — one round trip where a
//! release and a new acquire would take two, with no window in which anybody
//! else could take the lock. To keep waiters of other processes from starving,
//! at most [`MAX_HANDOFFS`] handoffs happen in a row; then the lock is released
//! plainly and every waiter races for it.
//!
//! Lines are used for exclusive requests with the default (per-guard) owner
//! only: an explicit owner may be reentrant, and queueing it behind a waiter
//! that waits for that same owner would deadlock; shared and semaphore holders
//! may hold together and must not wait for each other.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::backend::{Backend, Grant, LeaseRef, Request};
use crate::key::Key;

/// Handoffs in a row before a release lets every waiter race again.
pub(crate) const MAX_HANDOFFS: u32 = 16;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Default)]
pub(crate) struct LocalQueues {
    lines: Mutex<HashMap<Key, Arc<Line>>>,
}

struct Line {
    turn: Arc<Semaphore>,
    /// The head's offer to take a handoff, while it waits at the backend.
    offer: Mutex<Option<Arc<Offer>>>,
    handoffs_in_a_row: Mutex<u32>,
}

/// Where an offered handoff stands.
enum Stage {
    /// The head waits; a releaser may take the offer.
    Open,
    /// A releaser is running `release_to` for the head.
    InFlight,
    /// The handoff succeeded; the head has not picked the grant up yet.
    Delivered(Grant),
    /// The head got the lock by itself (the same hold, so nothing to undo).
    HeadDone,
    /// The head gave up while a handoff was in flight; the releaser undoes it.
    Abandoned,
}

/// A head's standing offer to receive the lock from a local releaser.
pub(crate) struct Offer {
    req: Request,
    backend: Arc<dyn Backend>,
    stage: Mutex<Stage>,
    delivered: Notify,
}

/// The head of a key's line; the next waiter moves up when it is dropped.
pub(crate) struct Turn<'a> {
    queues: &'a LocalQueues,
    key: Key,
    line: Arc<Line>,
    permit: Option<OwnedSemaphorePermit>,
}

impl LocalQueues {
    /// Waits for the head of `key`'s line; `None` if `deadline` passed first.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a cancelled waiter leaves the line.
    pub(crate) async fn turn(&self, key: &Key, deadline: Option<Instant>) -> Option<Turn<'_>> {
        let line = lock(&self.lines)
            .entry(key.clone())
            .or_insert_with(|| {
                Arc::new(Line {
                    turn: Arc::new(Semaphore::new(1)),
                    offer: Mutex::new(None),
                    handoffs_in_a_row: Mutex::new(0),
                })
            })
            .clone();
        let mut turn = Turn {
            queues: self,
            key: key.clone(),
            line: line.clone(),
            permit: None,
        };
        let acquire = line.turn.clone().acquire_owned();
        let permit = match deadline {
            None => acquire.await.ok()?,
            Some(d) => tokio::time::timeout_at(d, acquire).await.ok()?.ok()?,
        };
        turn.permit = Some(permit);
        Some(turn)
    }

    /// Takes the offer of `key`'s waiting head for a handoff, unless the line
    /// has handed off [`MAX_HANDOFFS`] times in a row (then it resets, and the
    /// caller releases plainly).
    pub(crate) fn take_offer(&self, key: &Key) -> Option<Arc<Offer>> {
        let line = lock(&self.lines).get(key)?.clone();
        let mut in_a_row = lock(&line.handoffs_in_a_row);
        let offer = lock(&line.offer).take()?;
        if *in_a_row >= MAX_HANDOFFS {
            *in_a_row = 0;
            *lock(&line.offer) = Some(offer);
            return None;
        }
        let mut stage = lock(&offer.stage);
        if !matches!(*stage, Stage::Open) {
            return None;
        }
        *stage = Stage::InFlight;
        drop(stage);
        *in_a_row += 1;
        Some(offer)
    }

    /// Notes a plain release of `key` (the handoff streak ends).
    pub(crate) fn released_plainly(&self, key: &Key) {
        if let Some(line) = lock(&self.lines).get(key) {
            *lock(&line.handoffs_in_a_row) = 0;
        }
    }
}

impl Turn<'_> {
    /// Offers this head for handoffs of `req` while it waits at the backend.
    pub(crate) fn offer(&self, req: &Request, backend: &Arc<dyn Backend>) -> Arc<Offer> {
        let offer = Arc::new(Offer {
            req: req.clone(),
            backend: backend.clone(),
            stage: Mutex::new(Stage::Open),
            delivered: Notify::new(),
        });
        *lock(&self.line.offer) = Some(offer.clone());
        offer
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        *lock(&self.line.offer) = None;
        let mut lines = lock(&self.queues.lines);
        self.permit.take();
        // Nobody else waits or holds a turn: forget the line (the map plus this turn).
        if Arc::strong_count(&self.line) == 2 && self.line.turn.available_permits() == 1 {
            lines.remove(&self.key);
        }
    }
}

impl Offer {
    /// The request the head waits with.
    pub(crate) fn request(&self) -> &Request {
        &self.req
    }

    /// Resolves with the grant once a releaser handed the lock over.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe; the grant stays in the offer until taken.
    pub(crate) async fn delivered(&self) -> Grant {
        loop {
            let notified = self.delivered.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Stage::Delivered(g) = &*lock(&self.stage) {
                return g.clone();
            }
            notified.await;
        }
    }

    /// The releaser's side, after `release_to`: delivers `grant`, or re-opens the
    /// offer if there was none. If the head gave up meanwhile, the handed hold
    /// is released on its behalf.
    pub(crate) fn complete(&self, grant: Option<Grant>) {
        let mut stage = lock(&self.stage);
        match (&*stage, grant) {
            (Stage::InFlight, Some(g)) => {
                *stage = Stage::Delivered(g);
                drop(stage);
                self.delivered.notify_waiters();
            }
            (Stage::InFlight, None) => *stage = Stage::Open,
            (Stage::Abandoned, Some(g)) => self.give_back(g),
            // The head took the same hold by itself, or nothing was handed.
            _ => {}
        }
    }

    /// Releases a handed hold that nobody will use, best effort.
    fn give_back(&self, grant: Grant) {
        let lease = LeaseRef::new(&self.req, &grant);
        let backend = self.backend.clone();
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            h.spawn(async move {
                let _ = backend.release(&lease).await;
            });
        }
    }

    /// [`Offer::abandon`] for a head that is dropped: a delivered grant is given back.
    pub(crate) fn abandon_on_drop(&self) {
        if let Some(g) = self.abandon() {
            self.give_back(g);
        }
    }

    /// The head's side when its own attempt succeeded: a handoff in flight is
    /// for the very same hold, so it needs no undoing.
    pub(crate) fn head_done(&self) {
        let mut stage = lock(&self.stage);
        if matches!(*stage, Stage::InFlight | Stage::Open) {
            *stage = Stage::HeadDone;
        }
    }

    /// The head's side when it gives up (deadline, error, cancellation):
    /// returns a grant that was delivered after all, else makes sure a handoff
    /// still in flight is undone by its releaser.
    pub(crate) fn abandon(&self) -> Option<Grant> {
        let mut stage = lock(&self.stage);
        match std::mem::replace(&mut *stage, Stage::Abandoned) {
            Stage::Delivered(g) => {
                *stage = Stage::HeadDone;
                Some(g)
            }
            Stage::HeadDone => {
                *stage = Stage::HeadDone;
                None
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn waiters_take_turns_in_arrival_order_and_lines_are_forgotten() {
        let q = Arc::new(LocalQueues::default());
        let key = Key::new("k").unwrap();
        let first = q.turn(&key, None).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..5 {
            let (q, key, order) = (q.clone(), key.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let _t = q.turn(&key, None).await.unwrap();
                order.lock().unwrap().push(i);
            }));
            tokio::task::yield_now().await; // let it join the line before the next
        }
        let late = q
            .turn(&key, Some(Instant::now() + Duration::from_millis(20)))
            .await;
        assert!(late.is_none(), "a waiter got a turn while the head held it");
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
        assert!(q.lines.lock().unwrap().is_empty(), "an idle line was kept");
    }
}
