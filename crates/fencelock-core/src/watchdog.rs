//! The watchdog: one task per [`Locker`](crate::Locker) that renews every live
//! guard with one batched [`Backend::renew`] call per tick, marks leases lost,
//! and performs the releases queued by dropped guards.
//!
//! Guards register and unregister in a shared registry without waking the task
//! (the hot path of an acquire/release cycle stays on the caller's thread); the
//! task is woken only when a new hold is due before its next planned tick.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;
use tracing::Instrument;

use crate::backend::{Backend, LeaseRef, Renewal};
use crate::background::Ticket;
use crate::guard::{
    LeaseState, LostReason, StateCell, expire_if_due, mark_lost, validity_deadline,
};
use crate::sync::{Mutex, MutexGuard, lock, sleep_until, spawn, timeout_at};

/// The task wakes at least this often, even with nothing to renew.
const IDLE_TICK: Duration = Duration::from_secs(1);

/// A release queued by a dropped guard.
pub(crate) struct DropRelease(pub(crate) LeaseRef, pub(crate) Ticket);

/// One hold to keep alive.
pub(crate) struct Registration {
    pub(crate) lease: Arc<LeaseRef>,
    pub(crate) state: StateCell,
    /// When the next renewal is due.
    pub(crate) next_renew: Instant,
    /// `max_hold`: stop renewing from this instant on.
    pub(crate) stop_at: Option<Instant>,
}

impl Registration {
    fn renewing(&self, now: Instant) -> bool {
        self.stop_at.is_none_or(|t| now < t)
    }

    fn next_wake(&self, now: Instant) -> Instant {
        let deadline = self.state.borrow().deadline;
        if self.renewing(now) {
            self.next_renew.min(deadline)
        } else {
            deadline.min(self.stop_at.unwrap_or(deadline).max(now))
        }
    }
}

#[derive(Default)]
struct State {
    entries: HashMap<u64, Registration>,
    /// When the task plans to wake next.
    scheduled: Option<Instant>,
}

/// The registry shared by a locker's guards and its watchdog task.
#[derive(Default)]
pub(crate) struct Watchdog {
    state: Mutex<State>,
    wake: Notify,
}

impl Watchdog {
    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Starts renewing a hold.
    pub(crate) fn register(&self, id: u64, reg: Registration) {
        let due = reg.next_wake(Instant::now());
        let mut s = self.lock();
        s.entries.insert(id, reg);
        if s.scheduled.is_none_or(|t| due < t) {
            s.scheduled = Some(due);
            drop(s);
            self.wake.notify_one();
        }
    }

    /// Stops renewing a hold (released, leaked or dropped).
    pub(crate) fn unregister(&self, id: u64) {
        self.lock().entries.remove(&id);
    }
}

/// Batches pull renewals forward by up to this much.
fn batch_window(ttl: Duration) -> Duration {
    ttl / 10
}

/// Retry delay after a failed renewal: a few tries fit in the time left.
fn retry_delay(ttl: Duration) -> Duration {
    (ttl / 10).max(Duration::from_millis(5))
}

pub(crate) async fn run(
    backend: Arc<dyn Backend>,
    watchdog: Arc<Watchdog>,
    mut releases: UnboundedReceiver<DropRelease>,
) {
    let mut events = backend.session_events();
    loop {
        let now = Instant::now();
        let next = {
            let mut s = watchdog.lock();
            let next = s
                .entries
                .values()
                .map(|e| e.next_wake(now))
                .min()
                .unwrap_or(now + IDLE_TICK)
                .min(now + IDLE_TICK);
            s.scheduled = Some(next);
            next
        };
        tokio::select! {
            biased;
            r = releases.recv() => match r {
                // Every sender (the locker and its guards) is gone.
                None => break,
                Some(DropRelease(lease, ticket)) => {
                    let backend = backend.clone();
                    spawn(async move {
                        let _ticket = ticket;
                        match backend.release(&lease).await {
                            Ok(_) => tracing::debug!(key = %lease.key, "dropped guard released"),
                            Err(e) => tracing::debug!(key = %lease.key, error = %e, "best-effort release of a dropped guard failed; the hold expires after its TTL"),
                        }
                    });
                }
            },
            _ = watchdog.wake.notified() => {}
            // Sessions may have ended: renew everything now.
            gone = session_event(&mut events) => {
                if !gone {
                    let now = Instant::now();
                    for e in watchdog.lock().entries.values_mut() {
                        e.next_renew = e.next_renew.min(now);
                    }
                    tick(&backend, &watchdog).await;
                }
            }
            _ = sleep_until(next) => tick(&backend, &watchdog).await,
        }
    }
    tracing::trace!(backend = backend.name(), "watchdog stopped");
}

/// Resolves when the backend signals that sessions may have ended (`false`),
/// or when its signal is gone for good (`true`; then `events` is cleared).
async fn session_event(events: &mut Option<tokio::sync::watch::Receiver<u64>>) -> bool {
    let Some(rx) = events.as_mut() else {
        return std::future::pending().await;
    };
    if rx.changed().await.is_ok() {
        return false;
    }
    *events = None;
    true
}

async fn tick(backend: &Arc<dyn Backend>, watchdog: &Watchdog) {
    let now = Instant::now();
    let (healthy, retrying) = {
        let mut s = watchdog.lock();
        // Forget holds that are gone; mark those whose deadline passed.
        s.entries.retain(|_, e| {
            if expire_if_due(&e.state, now) {
                let reason = e.state.borrow().lost.clone();
                tracing::warn!(key = %e.lease.key, backend = backend.name(), reason = ?reason, "lease lost");
            }
            e.state.borrow().lost.is_none()
        });
        for e in s.entries.values() {
            if !e.renewing(now) {
                e.state.send_if_modified(|st: &mut LeaseState| {
                    let changed = st.on_expiry != LostReason::MaxHold;
                    st.on_expiry = LostReason::MaxHold;
                    changed
                });
            }
        }
        // Leases whose last renewal failed go in a batch of their own: a
        // server that stalls must not hold up the renewal of the others
        // (a batch is bounded by the earliest deadline in it).
        let mut healthy = Batch::default();
        let mut retrying = Batch::default();
        for (id, e) in &s.entries {
            if e.renewing(now) && e.next_renew <= now + batch_window(e.lease.ttl) {
                let failing = matches!(e.state.borrow().on_expiry, LostReason::RenewFailed(_));
                let batch = if failing { &mut retrying } else { &mut healthy };
                batch.add(*id, e);
            }
        }
        (healthy, retrying)
    };
    futures::future::join(
        renew_batch(backend, watchdog, healthy),
        renew_batch(backend, watchdog, retrying),
    )
    .await;
}

/// Leases renewed in one call.
#[derive(Default)]
struct Batch {
    ids: Vec<u64>,
    leases: Vec<LeaseRef>,
    /// The earliest deadline among them: the call must answer before it.
    limit: Option<Instant>,
}

impl Batch {
    fn add(&mut self, id: u64, e: &Registration) {
        let deadline = e.state.borrow().deadline;
        self.ids.push(id);
        self.leases.push(LeaseRef::clone(&e.lease));
        self.limit = Some(self.limit.map_or(deadline, |l| l.min(deadline)));
    }
}

async fn renew_batch(backend: &Arc<dyn Backend>, watchdog: &Watchdog, batch: Batch) {
    let Batch { ids, leases, limit } = batch;
    let Some(limit) = limit else {
        return;
    };
    let started = Instant::now();
    let span = tracing::debug_span!(
        "fencelock.renew",
        backend = backend.name(),
        leases = leases.len()
    );
    let outcome = match timeout_at(limit, backend.renew(&leases).instrument(span)).await {
        Some(Ok(r)) if r.len() == leases.len() => Ok(r),
        Some(Ok(r)) => Err(format!(
            "the backend answered {} renewals for {} leases",
            r.len(),
            leases.len()
        )),
        Some(Err(e)) => Err(e.to_string()),
        None => Err("renewal timed out".to_string()),
    };
    let mut s = watchdog.lock();
    let retry_at = Instant::now();
    let failed = |e: &mut Registration, why: String| {
        e.state
            .send_modify(|st| st.on_expiry = LostReason::RenewFailed(why));
        e.next_renew = retry_at + retry_delay(e.lease.ttl);
    };
    let renewals = match outcome {
        Ok(renewals) => renewals,
        Err(msg) => {
            tracing::debug!(backend = backend.name(), error = %msg, "renewal failed; retrying until the deadline");
            crate::telemetry::renewals(backend.name(), "failed", ids.len() as u64);
            for id in &ids {
                if let Some(e) = s.entries.get_mut(id) {
                    failed(e, msg.clone());
                }
            }
            return;
        }
    };
    for renewal in &renewals {
        let outcome = match renewal {
            Renewal::Held { .. } => "held",
            Renewal::Lost { .. } => "lost",
            _ => "unknown",
        };
        crate::telemetry::renewals(backend.name(), outcome, 1);
    }
    for (id, renewal) in ids.iter().zip(renewals) {
        // Released while the renewal was in flight: nothing to update.
        let Some(e) = s.entries.get_mut(id) else {
            continue;
        };
        match renewal {
            Renewal::Held { ttl } => {
                let deadline = validity_deadline(started, ttl);
                let updated = e.state.send_if_modified(|st| {
                    if st.lost.is_some() {
                        return false;
                    }
                    st.deadline = deadline;
                    st.on_expiry = LostReason::Expired;
                    true
                });
                if updated {
                    e.next_renew = started + ttl / 3;
                } else {
                    s.entries.remove(id);
                }
            }
            Renewal::Lost { reason } => {
                tracing::warn!(key = %e.lease.key, backend = backend.name(), %reason, "lease lost: the backend no longer holds it");
                mark_lost(&e.state, LostReason::NotHeld(reason));
                s.entries.remove(id);
            }
            Renewal::Unknown { reason } => {
                tracing::debug!(key = %e.lease.key, backend = backend.name(), %reason, "renewal failed; retrying until the deadline");
                failed(e, reason);
            }
        }
    }
}
