//! A waiter's offer to take a handoff, and the stages it goes through.

use std::sync::Arc;

use tokio::sync::Notify;

use crate::backend::{Backend, Grant, LeaseRef, Request};
#[cfg(shuttle)]
use crate::sync::{Mutation, mutated};
use crate::sync::{Mutex, lock, runtime_present, spawn};

/// Where an offered handoff stands.
enum Stage {
    /// Waiting; a releaser may take the offer.
    Open,
    /// A releaser is running `release_to` for this waiter.
    InFlight,
    /// The handoff succeeded; the waiter has not picked the grant up yet.
    Delivered(Grant),
    /// The waiter has its grant (handed, or got by itself: the same hold).
    Done,
    /// The waiter gave up; a handoff still in flight is undone by its releaser.
    Abandoned,
}

/// A waiter's standing offer to receive the lock from a local releaser.
pub(crate) struct Offer {
    req: Request,
    backend: Arc<dyn Backend>,
    stage: Mutex<Stage>,
    delivered: Notify,
}

impl Offer {
    /// A new, open offer of a waiter that waits with `req` at `backend`.
    pub(super) fn new(req: &Request, backend: &Arc<dyn Backend>) -> Offer {
        Offer {
            req: req.clone(),
            backend: backend.clone(),
            stage: Mutex::new(Stage::Open),
            delivered: Notify::new(),
        }
    }

    /// A releaser takes the offer for a handoff: whether it was open (it is
    /// in flight now).
    pub(super) fn take_for_handoff(&self) -> bool {
        let mut stage = lock(&self.stage);
        if !matches!(*stage, Stage::Open) {
            return false;
        }
        *stage = Stage::InFlight;
        true
    }
    /// The request the waiter waits with.
    pub(crate) fn request(&self) -> &Request {
        &self.req
    }

    /// Waits until a grant is delivered (without taking it).
    pub(super) async fn wait_delivery(&self) {
        loop {
            let notified = self.delivered.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if matches!(*lock(&self.stage), Stage::Delivered(_)) {
                return;
            }
            notified.await;
        }
    }

    /// Takes a delivered grant, if there is one.
    pub(crate) fn take_delivered(&self) -> Option<Grant> {
        let mut stage = lock(&self.stage);
        match std::mem::replace(&mut *stage, Stage::Done) {
            Stage::Delivered(g) => Some(g),
            other => {
                *stage = other;
                None
            }
        }
    }

    /// Resolves with the grant once a releaser handed the lock over, and takes it.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe; an untaken grant stays in the offer.
    pub(crate) async fn delivered(&self) -> Grant {
        loop {
            self.wait_delivery().await;
            if let Some(g) = self.take_delivered() {
                return g;
            }
        }
    }

    /// The releaser's side, after `release_to`: delivers `grant`, or re-opens the
    /// offer if there was none. If the waiter gave up meanwhile, the handed hold
    /// is released on its behalf. Returns whether the waiter carries the
    /// releaser's local hold on.
    pub(crate) fn complete(&self, grant: Option<Grant>) -> bool {
        let mut stage = lock(&self.stage);
        match (&*stage, grant) {
            (Stage::InFlight, Some(g)) => {
                *stage = Stage::Delivered(g);
                drop(stage);
                self.delivered.notify_waiters();
                true
            }
            (Stage::InFlight, None) => {
                *stage = Stage::Open;
                false
            }
            (Stage::Abandoned, Some(g)) => {
                drop(stage);
                self.give_back(g);
                false
            }
            // The waiter got the same hold by itself, or nothing was handed.
            _ => false,
        }
    }

    /// The waiter's side when its own attempt succeeded: a handoff in flight or
    /// delivered is for the very same hold, so it needs no undoing. Returns
    /// whether a handoff was delivered all the same (then its releaser carried
    /// the local hold on to this waiter).
    pub(crate) fn done(&self) -> bool {
        let mut stage = lock(&self.stage);
        match std::mem::replace(&mut *stage, Stage::Done) {
            #[cfg(shuttle)]
            Stage::Delivered(_) if mutated(Mutation::CountHandoffTwice) => false,
            #[cfg(shuttle)]
            Stage::Delivered(g) if mutated(Mutation::GiveBackOwnHold) => {
                drop(stage);
                self.give_back(g);
                true
            }
            Stage::Delivered(_) => true,
            Stage::Abandoned => {
                *stage = Stage::Abandoned;
                false
            }
            _ => false,
        }
    }

    /// The waiter's side when it gives up (deadline, error): returns a grant
    /// that was delivered after all, else makes sure a handoff still in flight
    /// is undone by its releaser.
    pub(crate) fn abandon(&self) -> Option<Grant> {
        let mut stage = lock(&self.stage);
        match std::mem::replace(&mut *stage, Stage::Abandoned) {
            Stage::Delivered(g) => {
                *stage = Stage::Done;
                Some(g)
            }
            Stage::Done => {
                *stage = Stage::Done;
                None
            }
            _ => None,
        }
    }

    /// [`Offer::abandon`] for a waiter that is dropped: a delivered grant is
    /// given back. Returns whether there was one.
    pub(super) fn abandon_on_drop(&self) -> bool {
        match self.abandon() {
            #[cfg(shuttle)]
            Some(_) if mutated(Mutation::DroppedWaiterKeepsGrant) => true,
            Some(g) => {
                self.give_back(g);
                true
            }
            None => false,
        }
    }

    /// Releases a handed hold that nobody will use, best effort.
    fn give_back(&self, grant: Grant) {
        let lease = LeaseRef::new(&self.req, &grant);
        let backend = self.backend.clone();
        if runtime_present() {
            spawn(crate::background::tracked(async move {
                let _ = backend.release(&lease).await;
            }));
        }
    }
}
