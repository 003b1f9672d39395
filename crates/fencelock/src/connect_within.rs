//! Connecting through an outage, within a wait.

use std::time::Duration;

use fencelock_core::backend::{Backoff, redact_url};
use fencelock_core::{Error, Locker, Result};
use tokio::time::{Instant, timeout_at};

/// What one try may take at most: a server that does not answer is asked
/// again on a new connection.
const ONE_TRY: Duration = Duration::from_secs(10);

/// What the first try may take however short the wait (a zero wait still
/// tries once).
const FIRST_TRY: Duration = Duration::from_secs(5);

/// Opens a [`Locker`] as [`crate::connect`] does, but asks again through
/// connection errors (a server that restarts, refuses or does not answer)
/// until `wait` has passed, or for ever with `None`; says so once (a
/// `tracing` warning). A try that gets no answer within 10 s is given up
/// and made again; the first may take up to 5 s even when `wait` is shorter. Errors that asking again cannot mend (a bad URL, a refused login)
/// return at once.
///
/// # Errors
///
/// As [`crate::connect`]: the last error when the wait ends.
///
/// # Cancel safety
///
/// Cancel safe: nothing is held until it returns.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock::Result<()> {
/// use std::time::Duration;
///
/// let locker = fencelock::connect_within("memory://", Some(Duration::from_secs(5))).await?;
/// assert_eq!(locker.backend().name(), "memory");
/// # Ok(()) }
/// ```
pub async fn connect_within(url: &str, wait: Option<Duration>) -> Result<Locker> {
    let start = Instant::now();
    let deadline = wait.map(|w| start + w);
    let mut backoff: Option<Backoff> = None;
    loop {
        let tried_at = Instant::now();
        let mut limit = tried_at + ONE_TRY;
        if let Some(d) = deadline {
            limit = limit.min(d.max(start + FIRST_TRY));
        }
        let tried = timeout_at(limit, crate::connect(url))
            .await
            .unwrap_or_else(|_| {
                let took = Duration::from_millis((limit - tried_at).as_millis() as u64);
                Err(Error::connection(
                    crate::backend_name(url),
                    &redact_url(url),
                    format!("no answer within {took:?}"),
                ))
            });
        let e = match tried {
            Ok(locker) => return Ok(locker),
            Err(e) => e,
        };
        if !e.is_transient() || deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(e);
        }
        let backoff = backoff.get_or_insert_with(|| {
            tracing::warn!(
                error = %e,
                "cannot connect; asking again{}",
                if deadline.is_some() { " until the wait ends" } else { "" }
            );
            Backoff::new(Duration::from_millis(100), Duration::from_secs(5))
        });
        backoff.sleep(deadline, None).await;
        // The wait ended while asleep: the last error says why.
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(e);
        }
    }
}
