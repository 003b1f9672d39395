//! Guards (a held lock) and leases (a cheap handle on a hold's validity).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use crate::backend::LeaseRef;
use crate::background::Ticket;
use crate::error::{Error, Result};
use crate::key::{Key, Owner};
use crate::line::{LineHold, hand_off_from};
use crate::locker::Shared;
use crate::mode::Mode;
use crate::token::FencingToken;
use crate::watchdog::DropRelease;

/// Why a lease was lost.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LostReason {
    /// The conservative local deadline passed before a renewal succeeded (for
    /// example the process was paused, or the lease was fixed with `.lease()`).
    Expired,
    /// The backend says the hold is gone (expired there, deleted, taken over).
    NotHeld(String),
    /// Renewal kept failing (connection trouble) until the deadline passed.
    RenewFailed(String),
    /// The session the hold lives in ended (ZooKeeper, database sessions).
    SessionEnded(String),
    /// The `max_hold` cap was reached and the lease was left to expire.
    MaxHold,
    /// The guard was released or dropped.
    Released,
}

impl fmt::Display for LostReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LostReason::Expired => {
                f.write_str("its validity deadline passed without a successful renewal")
            }
            LostReason::NotHeld(why) => write!(f, "the backend no longer holds it ({why})"),
            LostReason::RenewFailed(why) => write!(f, "renewal failed until the deadline ({why})"),
            LostReason::SessionEnded(why) => write!(f, "the session ended ({why})"),
            LostReason::MaxHold => f.write_str("the max_hold cap was reached"),
            LostReason::Released => f.write_str("the guard was released"),
        }
    }
}

/// The shared, watchable state of one hold.
#[derive(Debug, Clone)]
pub(crate) struct LeaseState {
    /// Until when the hold is surely valid.
    pub(crate) deadline: Instant,
    /// Set once, when the hold is gone; never cleared.
    pub(crate) lost: Option<LostReason>,
    /// What `lost` becomes if the deadline passes.
    pub(crate) on_expiry: LostReason,
    /// The backend's name (the metrics' `backend` label).
    pub(crate) backend: &'static str,
}

pub(crate) type StateCell = Arc<LeaseCell>;

/// One lease's state, shared by its guard, its [`Lease`] views and the
/// watchdog: a lock around the state and a wake-up for [`Lease::lost`]
/// (a `watch` channel did the same at three times the memory, which counts
/// when a service holds 10,000 locks).
pub(crate) struct LeaseCell {
    state: crate::sync::Mutex<LeaseState>,
    changed: tokio::sync::Notify,
}

impl LeaseCell {
    pub(crate) fn new(state: LeaseState) -> Self {
        LeaseCell {
            state: crate::sync::Mutex::new(state),
            changed: tokio::sync::Notify::new(),
        }
    }

    /// The state, locked: read it and let go (never hold it across a change).
    pub(crate) fn borrow(&self) -> crate::sync::MutexGuard<'_, LeaseState> {
        crate::sync::lock(&self.state)
    }

    /// Changes the state with `change`, which says whether it changed
    /// anything; waiters of [`Lease::lost`] are woken if so.
    pub(crate) fn send_if_modified(&self, change: impl FnOnce(&mut LeaseState) -> bool) -> bool {
        let changed = change(&mut crate::sync::lock(&self.state));
        if changed {
            self.changed.notify_waiters();
        }
        changed
    }

    /// Changes the state with `change` and wakes the waiters.
    pub(crate) fn send_modify(&self, change: impl FnOnce(&mut LeaseState)) {
        self.send_if_modified(|s| {
            change(s);
            true
        });
    }
}

/// The clock-drift allowance subtracted from every lease: 1 % of the TTL plus
/// 2 ms (the Redlock paper's rule). A hold is trusted only until
/// `request start + ttl − drift_allowance(ttl)`.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_core::backend::drift_allowance;
///
/// assert_eq!(drift_allowance(Duration::from_secs(30)), Duration::from_millis(302));
/// ```
pub fn drift_allowance(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

/// The conservative local deadline of a hold granted or renewed by a request
/// sent at `start` for `ttl`.
pub(crate) fn validity_deadline(start: Instant, ttl: Duration) -> Instant {
    start + ttl.saturating_sub(drift_allowance(ttl))
}

/// If the deadline passed (at `now`) and the lease is not yet lost, marks it lost
/// with its `on_expiry` reason. Returns whether it did.
pub(crate) fn expire_if_due(state: &LeaseCell, now: Instant) -> bool {
    state.send_if_modified(|s| {
        if s.lost.is_none() && now >= s.deadline {
            crate::telemetry::lost(s.backend, &s.on_expiry);
            s.lost = Some(s.on_expiry.clone());
            true
        } else {
            false
        }
    })
}

/// Marks the lease lost with `reason` unless it already is; returns whether it changed.
pub(crate) fn mark_lost(state: &LeaseCell, reason: LostReason) -> bool {
    state.send_if_modified(|s| {
        if s.lost.is_some() {
            return false;
        }
        crate::telemetry::lost(s.backend, &reason);
        s.lost = Some(reason);
        true
    })
}

/// A cheap, cloneable view of one hold: its key, token and validity.
///
/// Hand it to code that must stop when the lock is lost (a worker task, the
/// closure of [`LockBuilder::run`](crate::LockBuilder::run)).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_core::{Locker, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock_core::Result<()> {
/// let locker = Locker::new(MemoryBackend::new());
/// let guard = locker.lock("jobs/nightly").acquire().await?;
/// let lease = guard.lease();
/// let worker = tokio::spawn(async move {
///     tokio::select! {
///         err = lease.lost() => Err(err),
///         _ = tokio::time::sleep(Duration::from_millis(10)) => Ok("work done"),
///     }
/// });
/// assert_eq!(worker.await.unwrap()?, "work done");
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Lease {
    key: Key,
    token: Option<FencingToken>,
    state: StateCell,
}

impl Lease {
    pub(crate) fn new(key: Key, token: Option<FencingToken>, state: StateCell) -> Self {
        Lease { key, token, state }
    }

    /// The lock's key.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// The fencing token of the grant; `None` when the backend gives none.
    pub fn token(&self) -> Option<FencingToken> {
        self.token
    }

    /// Whether the hold is surely still valid: not lost, and its conservative
    /// local deadline (grant or last renewal + ttl − drift allowance) not passed.
    ///
    /// The deadline is kept on the monotonic clock (`CLOCK_MONOTONIC` on Linux),
    /// which runs on while the process is stopped (SIGSTOP, a debugger, a long
    /// GC pause), so a pause past the deadline is noticed. It does **not** run
    /// while the whole machine is suspended (suspend to RAM, a paused VM):
    /// after a resume the hold may look valid although the server let it
    /// expire. Renewal notices within a renewal period; fence writes with the
    /// token where that matters.
    pub fn is_valid(&self) -> bool {
        let s = self.state.borrow();
        s.lost.is_none() && Instant::now() < s.deadline
    }

    /// The conservative local deadline of the hold.
    pub fn deadline(&self) -> Instant {
        self.state.borrow().deadline
    }

    /// Time left until [`Lease::deadline`] (zero once lost).
    pub fn time_left(&self) -> Duration {
        let s = self.state.borrow();
        if s.lost.is_some() {
            return Duration::ZERO;
        }
        s.deadline.saturating_duration_since(Instant::now())
    }

    /// Why the hold was lost, if it was.
    pub fn lost_reason(&self) -> Option<LostReason> {
        self.state.borrow().lost.clone()
    }

    /// Resolves with [`Error::Lost`] when the hold is lost: renewal failed or was
    /// refused, the session ended, the deadline passed (also after the process was
    /// paused), or the guard was released. Never resolves while the hold is valid.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe; call it again (or on a clone) to keep waiting.
    pub fn lost(&self) -> impl Future<Output = Error> + Send + 'static {
        let state = self.state.clone();
        let key = self.key.to_string();
        async move {
            loop {
                // Registered before the state is read: a change after the
                // read still wakes this wait.
                let changed = state.changed.notified();
                let mut changed = std::pin::pin!(changed);
                changed.as_mut().enable();
                let (deadline, lost) = {
                    let s = state.borrow();
                    (s.deadline, s.lost.clone())
                };
                if let Some(reason) = lost {
                    return Error::Lost { key, reason };
                }
                tokio::select! {
                    () = changed => {}
                    _ = crate::sync::sleep_until(deadline) => {
                        expire_if_due(&state, Instant::now());
                    }
                }
            }
        }
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key)
            .field("token", &self.token)
            .field("valid", &self.is_valid())
            .finish()
    }
}

/// A held lock. Owned and `'static`: move it into tasks freely.
///
/// While the guard lives, the [`Locker`](crate::Locker)'s watchdog renews it at
/// ttl/3 (unless it was taken with [`LockBuilder::lease`](crate::LockBuilder::lease)).
/// [`Guard::release`] gives it back and reports errors; dropping the guard stops
/// the renewal and queues a best-effort release without blocking.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_core::{Locker, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock_core::Result<()> {
/// let locker = Locker::new(MemoryBackend::new());
/// let guard = locker
///     .lock("orders/42")
///     .ttl(Duration::from_secs(30))
///     .wait(Duration::from_secs(5))
///     .acquire()
///     .await?;
/// let token = guard.token().expect("the memory backend fences");
/// // write_with_token(token, ...) — the resource rejects older tokens
/// assert!(guard.is_valid());
/// guard.release().await?;
/// # let _ = token; Ok(()) }
/// ```
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct Guard {
    shared: Arc<Shared>,
    lease_ref: Arc<LeaseRef>,
    lease: Lease,
    holds: u32,
    /// Watchdog registration id; `None` for fixed leases.
    watchdog_id: Option<u64>,
    /// Marks this guard as a local holder of its key's line (lined acquires).
    line_hold: Option<LineHold>,
    acquired_at: Instant,
    done: bool,
}

impl Guard {
    pub(crate) fn new(
        shared: Arc<Shared>,
        lease_ref: Arc<LeaseRef>,
        state: StateCell,
        holds: u32,
        watchdog_id: Option<u64>,
    ) -> Self {
        let lease = Lease::new(lease_ref.key.clone(), lease_ref.token, state);
        Guard {
            shared,
            lease_ref,
            lease,
            holds,
            watchdog_id,
            line_hold: None,
            acquired_at: Instant::now(),
            done: false,
        }
    }

    pub(crate) fn set_line_hold(&mut self, hold: Option<LineHold>) {
        self.line_hold = hold;
    }

    /// The lock's key.
    pub fn key(&self) -> &Key {
        &self.lease_ref.key
    }

    /// Who holds it.
    pub fn owner(&self) -> &Owner {
        &self.lease_ref.owner
    }

    /// The mode it is held in.
    pub fn mode(&self) -> Mode {
        self.lease_ref.mode
    }

    /// The fencing token of the grant (the same for reentrant holds, except on
    /// Redlock when an instance that missed the first hold grants the
    /// reentrant one anew: then a larger token, so that a token never comes
    /// from a hold a release left behind on one instance); `None` when the
    /// backend cannot guarantee one.
    pub fn token(&self) -> Option<FencingToken> {
        self.lease_ref.token
    }

    /// The owner's hold count right after this grant (1 unless reentrant).
    pub fn holds(&self) -> u32 {
        self.holds
    }

    /// The TTL the backend granted.
    pub fn ttl(&self) -> Duration {
        self.lease_ref.ttl
    }

    /// See [`Lease::is_valid`].
    pub fn is_valid(&self) -> bool {
        self.lease.is_valid()
    }

    /// See [`Lease::deadline`].
    pub fn deadline(&self) -> Instant {
        self.lease.deadline()
    }

    /// See [`Lease::lost`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub fn lost(&self) -> impl Future<Output = Error> + Send + 'static {
        self.lease.lost()
    }

    /// A cloneable handle on this hold's key, token and validity.
    pub fn lease(&self) -> Lease {
        self.lease.clone()
    }

    /// The backend-level reference of this hold (for tools and tests).
    pub fn lease_ref(&self) -> &LeaseRef {
        &self.lease_ref
    }

    /// Gives the hold back and waits for the backend to confirm.
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] if the hold was already gone (expired or taken over; then
    /// nothing was changed), or a connection/backend error (then the hold expires
    /// after its TTL).
    ///
    /// # Cancel safety
    ///
    /// If cancelled, a plain release may or may not have reached the backend;
    /// the watchdog no longer renews the hold either way, so it expires after
    /// its TTL. A release that hands the lock to a waiter of this locker (an
    /// exclusive hold with the default owner that waited in the locker's line,
    /// see [`Locker`](crate::Locker)) is finished by a task of the runtime:
    /// the waiter gets the lock, or, if it gave up meanwhile, the lock is
    /// released. (With no tokio runtime around, it is cut like a plain one.)
    pub async fn release(mut self) -> Result<()> {
        self.done = true;
        self.stop_renewing();
        // A deadline that passed unnoticed is a lost lease, not a release.
        expire_if_due(&self.lease.state, Instant::now());
        mark_lost(&self.lease.state, LostReason::Released);
        let hold = self.acquired_at.elapsed();
        crate::telemetry::hold(self.shared.backend.name(), hold);
        let span = tracing::debug_span!(
            "fencelock.release",
            key = %self.lease_ref.key,
            backend = self.shared.backend.name(),
            hold_ms = hold.as_millis() as u64,
        );
        let result = self.release_or_hand_off().instrument(span).await;
        match &result {
            Ok(r) => {
                tracing::debug!(key = %self.lease_ref.key, remaining = r.remaining, hold_ms = hold.as_millis() as u64, "released")
            }
            Err(e) => tracing::debug!(key = %self.lease_ref.key, error = %e, "release failed"),
        }
        result.map(|_| ())
    }

    /// Stops renewing and forgets the hold without releasing it: the lock stays
    /// taken until its TTL runs out (a crashed holder, on purpose). Returns the
    /// backend reference, should you want to release it later yourself.
    pub fn leak(mut self) -> LeaseRef {
        self.done = true;
        self.stop_renewing();
        LeaseRef::clone(&self.lease_ref)
    }

    /// Releases, handing an exclusive lock straight to this locker's next
    /// waiter for the key when one waits (see `line::hand_off_from`).
    ///
    /// # Cancel safety
    ///
    /// A handoff, dropped before its end, finishes in a task of the runtime
    /// (see `line::hand_off_from`). A plain release is cut where it stands.
    async fn release_or_hand_off(&mut self) -> Result<crate::backend::Released> {
        if let Some(handoff) = hand_off_from(&self.shared, &self.lease_ref, &mut self.line_hold) {
            return handoff.await;
        }
        self.shared.lines.released_plainly(&self.lease_ref.key);
        self.shared.backend.release(&self.lease_ref).await
    }

    fn stop_renewing(&self) {
        if let Some(id) = self.watchdog_id {
            self.shared.watchdog.unregister(id);
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        expire_if_due(&self.lease.state, Instant::now());
        mark_lost(&self.lease.state, LostReason::Released);
        crate::telemetry::hold(self.shared.backend.name(), self.acquired_at.elapsed());
        self.stop_renewing();
        // Non-blocking: the Locker's background task performs the release.
        let _ = self
            .shared
            .drops
            .send(DropRelease(LeaseRef::clone(&self.lease_ref), Ticket::new()));
    }
}

impl fmt::Debug for Guard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guard")
            .field("key", &self.lease_ref.key)
            .field("owner", &self.lease_ref.owner)
            .field("mode", &self.lease_ref.mode)
            .field("token", &self.lease_ref.token)
            .field("holds", &self.holds)
            .field("valid", &self.is_valid())
            .finish()
    }
}
