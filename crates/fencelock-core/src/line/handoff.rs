//! The releaser's side: handing the lock to the first waiter of the line in
//! the same backend call that releases it.

use std::sync::Arc;

use super::{LineHold, Offer};
use crate::backend::{Backend, LeaseRef, Released};
use crate::error::{Error, Result};
use crate::locker::Shared;
use crate::mode::Mode;
use crate::sync::{FinishOnDrop, timeout};

/// The handoff of the hold `lease`, if one applies: the hold is exclusive and
/// held through the line (`line_hold`, which the waiter carries on: a guard
/// from `try_acquire` or with an owner of its own holds without one and
/// releases plainly), and the line's first waiter's offer is open. Run the
/// handoff by awaiting it.
///
/// # Cancel safety
///
/// The handoff, dropped before its end, finishes in a task of the runtime:
/// cut midway, it could leave the lock handed to a waiter that never hears
/// of it (a ghost holder until the TTL, should that waiter give up before its
/// own attempt finds the hold). Without a runtime to finish it, it is cut
/// where it stands and the offer opens again.
pub(crate) fn hand_off_from(
    shared: &Shared,
    lease: &LeaseRef,
    line_hold: &mut Option<LineHold>,
) -> Option<FinishOnDrop<Result<Released>>> {
    if line_hold.is_none() || lease.mode != Mode::Exclusive {
        return None;
    }
    let offer = shared.lines.take_offer(&lease.key)?;
    let line_hold = line_hold.take()?;
    // Armed before anything can drop it: the offer opens again unless the
    // handoff got an answer.
    let pending = OfferInFlight(Some(offer.clone()));
    Some(FinishOnDrop::new(hand_off(
        shared.backend.clone(),
        lease.clone(),
        offer,
        line_hold,
        pending,
    )))
}

/// Releases `lease` and hands the lock to the waiter of `offer` in one
/// backend call; the releaser's local hold is carried on to the waiter if
/// it got the lock, and ends here otherwise. (Run under shuttle with the
/// line: `src/shuttle_tests.rs`, `docs/SAFETY.md` §3.)
async fn hand_off(
    backend: Arc<dyn Backend>,
    lease: LeaseRef,
    offer: Arc<Offer>,
    line_hold: LineHold,
    pending: OfferInFlight,
) -> Result<Released> {
    // A call that never answers would keep the offer in flight and the
    // local hold counted: it gets the lease's TTL, after which the hold it
    // was to release has expired anyway.
    let outcome = timeout(lease.ttl, backend.release_to(&lease, offer.request()))
        .await
        .unwrap_or_else(|| {
            Err(Error::backend(
                backend.name(),
                format!(
                    "the release did not answer within the TTL ({:?})",
                    lease.ttl
                ),
            ))
        });
    pending.disarm();
    // After an error the lock may have been handed all the same (a lost
    // reply): the waiter's own attempts find that hold; given up, it stays
    // until its TTL, as any hold whose release went unanswered.
    let (result, grant) = match outcome {
        Ok((released, grant)) => (Ok(released), grant),
        Err(e) => (Err(e), None),
    };
    if offer.complete(grant) {
        crate::telemetry::handoff(backend.name());
        line_hold.hand_on();
    }
    result
}

/// An offer taken for a handoff: opened again if the handoff is dropped
/// before it got an answer (no runtime finished it).
struct OfferInFlight(Option<Arc<Offer>>);

impl OfferInFlight {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for OfferInFlight {
    fn drop(&mut self) {
        if let Some(offer) = self.0.take() {
            offer.complete(None);
        }
    }
}
