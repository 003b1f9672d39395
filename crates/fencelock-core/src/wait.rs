//! The one wait loop of the backends whose waiters try again: listen for a
//! wake-up, try, check the deadline, then wait for the wake-up or for a
//! backoff that is cut short by the holder's time left.

use std::future::Future;
use std::pin::pin;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::backend::Grant;
use crate::backoff::Backoff;
use crate::error::Result;

/// What one try of a waiting acquire found.
#[derive(Debug)]
#[non_exhaustive]
pub enum TryOutcome {
    /// The lock was granted.
    Granted(Grant),
    /// Busy; `retry_in`, if known, is how long the current holders' leases
    /// still run (the wait is cut short then).
    Busy {
        /// The holders' time left, if known.
        retry_in: Option<Duration>,
    },
}

impl TryOutcome {
    /// [`TryOutcome::Granted`] for `Some`, [`TryOutcome::Busy`] without a hint
    /// for `None` (what a plain `try_acquire` answers).
    pub fn from_try(grant: Option<Grant>) -> TryOutcome {
        match grant {
            Some(g) => TryOutcome::Granted(g),
            None => TryOutcome::Busy { retry_in: None },
        }
    }
}

/// Tries with `attempt` until it grants or `deadline` passes (`Ok(None)`).
///
/// Between tries it waits for `wake` (notified when a holder releases; the
/// listener is set up before each try, so a release between the answer and
/// the wait is not missed; a wake-up resets `backoff`) or for `backoff`'s
/// next delay, cut short by the holders' time left and the deadline.
/// `attempt` is told whether this try is the first one or follows a
/// wake-up (`true`), or follows a timed wait (`false`): a backend may then
/// look before it tries.
///
/// Queue-based backends (ZooKeeper, etcd) and the memory backend wait their
/// own way; Redis and Redlock add a place in the key's waiting list.
///
/// # Errors
///
/// The first error of `attempt`.
///
/// # Cancel safety
///
/// As cancel safe as `attempt`'s futures: dropped between tries it has no
/// effect; dropped during a try, that try is cut where it stands.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_core::{Backend, Key, MemoryBackend, Mode, Owner};
/// use fencelock_core::backend::{Backoff, Request, TryOutcome, wait_for_grant};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock_core::Result<()> {
/// let backend = MemoryBackend::new();
/// let req = Request::new(Key::new("k")?, Owner::new("me")?, Mode::Exclusive, Duration::from_secs(5));
/// let grant = wait_for_grant(None, Backoff::default(), None, |_| async {
///     Ok(TryOutcome::from_try(backend.try_acquire(&req).await?))
/// })
/// .await?;
/// assert!(grant.is_some());
/// # Ok(()) }
/// ```
pub async fn wait_for_grant<F, Fut>(
    deadline: Option<Instant>,
    mut backoff: Backoff,
    wake: Option<&Notify>,
    mut attempt: F,
) -> Result<Option<Grant>>
where
    F: FnMut(bool) -> Fut,
    Fut: Future<Output = Result<TryOutcome>>,
{
    let mut fresh = true;
    loop {
        let mut woken = pin!(wake.map(Notify::notified));
        if let Some(n) = woken.as_mut().as_pin_mut() {
            n.enable();
        }
        let retry_in = match attempt(fresh).await? {
            TryOutcome::Granted(g) => return Ok(Some(g)),
            TryOutcome::Busy { retry_in } => retry_in,
        };
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
        let wake_up = async {
            match woken.as_mut().as_pin_mut() {
                Some(n) => n.await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = wake_up => {
                backoff.reset();
                fresh = true;
            }
            () = backoff.sleep(deadline, retry_in) => fresh = false,
        }
    }
}
