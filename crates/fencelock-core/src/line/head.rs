//! The waiter's side: standing in line, waiting as its head, and what a
//! waiter gets (a handoff, its own grant, or nothing).

use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use super::{LineHold, Lines, Turn};
use crate::backend::{Backend, Grant, Request};
use crate::error::Result;
use crate::sync::sleep_until;

/// Waits in `key`'s line of `lines` with `req` until this waiter gets the
/// lock (handed over by a local releaser, or granted at the backend as the
/// head) or gives up at `deadline`. Returns the grant, if any, and the
/// local hold that marks it.
///
/// # Errors
///
/// The backend's error, unless a handoff arrived meanwhile (then it wins).
///
/// # Cancel safety
///
/// Cancel safe: the waiter leaves the line, and a grant handed to it
/// meanwhile is given back.
pub(crate) async fn acquire_in_line(
    lines: &std::sync::Arc<Lines>,
    backend: &std::sync::Arc<dyn Backend>,
    req: &Request,
    deadline: Option<Instant>,
    span: &tracing::Span,
) -> Result<(Option<Grant>, Option<LineHold>)> {
    let turn = lines.join(&req.key, req, backend, deadline).await;
    let offer = turn.offer();
    let outcome = if let Some(g) = offer.take_delivered() {
        Ok(Some((g, true)))
    } else if turn.is_head() {
        wait_as_head(&turn, backend.as_ref(), req, deadline)
            .instrument(span.clone())
            .await
    } else {
        Ok(None)
    };
    let (grant, handed) = match outcome {
        // A handoff delivered meanwhile is the same hold, whose local hold
        // its releaser carried on to this waiter: count it once.
        Ok(Some((g, handed))) => {
            let delivered = offer.done();
            (Some(g), handed || delivered)
        }
        // Gave up: a handoff may have arrived meanwhile; take it.
        Ok(None) => (offer.abandon(), true),
        Err(e) => match offer.abandon() {
            Some(g) => (Some(g), true),
            None => return Err(e),
        },
    };
    let hold = grant.as_ref().map(|_| turn.hold(lines, handed));
    Ok((grant, hold))
}

/// How often a head re-checks the backend while a local guard holds the key
/// (in case that guard's lease was lost without the guard being dropped).
const LOCAL_HOLDER_RECHECK: Duration = Duration::from_secs(1);

/// The head of a line waits for a handoff from a local releaser; while no
/// local guard holds the key (or always, on a queue-based backend) it also waits
/// at the backend. Returns the grant and whether it was handed over. (Run
/// under shuttle with the line: `src/shuttle_tests.rs`, `docs/SAFETY.md` §3.)
async fn wait_as_head(
    turn: &Turn<'_>,
    backend: &dyn Backend,
    req: &Request,
    deadline: Option<Instant>,
) -> Result<Option<(Grant, bool)>> {
    loop {
        let gone = turn.holder_gone();
        tokio::pin!(gone);
        gone.as_mut().enable();
        // A queue-based backend (`fair`) keeps a place in its queue while it
        // waits, so the head joins that queue even while a local guard holds.
        if turn.local_holders() == 0 || backend.capabilities().fair {
            return tokio::select! {
                biased;
                g = turn.offer().delivered() => Ok(Some((g, true))),
                r = backend.acquire(req, deadline) => r.map(|g| g.map(|g| (g, false))),
            };
        }
        // Busy here: it will be handed over, or released here (which wakes us).
        let mut recheck = Instant::now() + LOCAL_HOLDER_RECHECK;
        if let Some(d) = deadline {
            recheck = recheck.min(d);
        }
        tokio::select! {
            biased;
            g = turn.offer().delivered() => return Ok(Some((g, true))),
            _ = &mut gone => {}
            _ = sleep_until(recheck) => {
                if let Some(g) = backend.try_acquire(req).await? {
                    return Ok(Some((g, false)));
                }
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Ok(None);
                }
            }
        }
    }
}
