//! The watchdog: one task per [`Locker`](crate::Locker) that renews every live
//! guard with one batched [`Backend::renew`] call per tick, marks leases lost,
//! and performs the releases queued by dropped guards.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;
use tracing::Instrument;

use crate::backend::{Backend, LeaseRef, Renewal};
use crate::guard::{
    LeaseState, LostReason, StateCell, expire_if_due, mark_lost, validity_deadline,
};

/// Messages from guards to the watchdog task.
pub(crate) enum Command {
    /// Renew this hold until told otherwise.
    Register(Registration),
    /// Stop renewing (the guard was released or leaked).
    Unregister { id: u64 },
    /// Stop renewing and release on the guard's behalf (it was dropped).
    Release { id: Option<u64>, lease: LeaseRef },
}

/// One hold to keep alive.
pub(crate) struct Registration {
    pub(crate) id: u64,
    pub(crate) lease: LeaseRef,
    pub(crate) state: StateCell,
    /// When the first renewal is due.
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

/// How early a renewal may be pulled forward so that it joins a batch.
fn batch_window(ttl: Duration) -> Duration {
    ttl / 10
}

/// Retry delay after a failed renewal: a few tries fit in the time left.
fn retry_delay(ttl: Duration) -> Duration {
    (ttl / 10).max(Duration::from_millis(5))
}

pub(crate) async fn run(backend: Arc<dyn Backend>, mut commands: UnboundedReceiver<Command>) {
    let mut entries: HashMap<u64, Registration> = HashMap::new();
    loop {
        let now = Instant::now();
        let next = entries.values().map(|e| e.next_wake(now)).min();
        tokio::select! {
            biased;
            cmd = commands.recv() => match cmd {
                None => break,
                Some(cmd) => handle(cmd, &mut entries, &backend),
            },
            _ = sleep_until_opt(next) => tick(&backend, &mut entries).await,
        }
    }
    tracing::trace!(backend = backend.name(), "watchdog stopped");
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn handle(cmd: Command, entries: &mut HashMap<u64, Registration>, backend: &Arc<dyn Backend>) {
    match cmd {
        Command::Register(reg) => {
            entries.insert(reg.id, reg);
        }
        Command::Unregister { id } => {
            entries.remove(&id);
        }
        Command::Release { id, lease } => {
            if let Some(id) = id {
                entries.remove(&id);
            }
            let backend = backend.clone();
            tokio::spawn(async move {
                match backend.release(&lease).await {
                    Ok(_) => tracing::debug!(key = %lease.key, "dropped guard released"),
                    Err(e) => {
                        tracing::debug!(key = %lease.key, error = %e, "best-effort release of a dropped guard failed; the hold expires after its TTL")
                    }
                }
            });
        }
    }
}

async fn tick(backend: &Arc<dyn Backend>, entries: &mut HashMap<u64, Registration>) {
    let now = Instant::now();
    // Forget holds that are gone; mark those whose deadline passed.
    entries.retain(|_, e| {
        if expire_if_due(&e.state, now) {
            let reason = e.state.borrow().lost.clone();
            tracing::warn!(key = %e.lease.key, backend = backend.name(), reason = ?reason, "lease lost");
        }
        e.state.borrow().lost.is_none()
    });
    for e in entries.values() {
        if !e.renewing(now) {
            e.state.send_if_modified(|s: &mut LeaseState| {
                let changed = s.on_expiry != LostReason::MaxHold;
                s.on_expiry = LostReason::MaxHold;
                changed
            });
        }
    }
    let due: Vec<u64> = entries
        .iter()
        .filter(|(_, e)| e.renewing(now) && e.next_renew <= now + batch_window(e.lease.ttl))
        .map(|(id, _)| *id)
        .collect();
    if due.is_empty() {
        return;
    }
    let leases: Vec<LeaseRef> = due.iter().map(|id| entries[id].lease.clone()).collect();
    let limit = due
        .iter()
        .map(|id| entries[id].state.borrow().deadline)
        .min()
        .unwrap_or(now);
    let started = Instant::now();
    let span = tracing::debug_span!(
        "fencelock.renew",
        backend = backend.name(),
        leases = leases.len()
    );
    let outcome =
        match tokio::time::timeout_at(limit, backend.renew(&leases).instrument(span)).await {
            Ok(Ok(r)) if r.len() == leases.len() => Ok(r),
            Ok(Ok(r)) => Err(format!(
                "the backend answered {} renewals for {} leases",
                r.len(),
                leases.len()
            )),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("renewal timed out".to_string()),
        };
    match outcome {
        Ok(renewals) => {
            for (id, renewal) in due.iter().zip(renewals) {
                let Some(e) = entries.get_mut(id) else {
                    continue;
                };
                match renewal {
                    Renewal::Held { ttl } => {
                        let deadline = validity_deadline(started, ttl);
                        let updated = e.state.send_if_modified(|s| {
                            if s.lost.is_some() {
                                return false;
                            }
                            s.deadline = deadline;
                            s.on_expiry = LostReason::Expired;
                            true
                        });
                        if updated {
                            e.next_renew = started + ttl / 3;
                        } else {
                            entries.remove(id);
                        }
                    }
                    Renewal::Lost { reason } => {
                        tracing::warn!(key = %e.lease.key, backend = backend.name(), %reason, "lease lost: the backend no longer holds it");
                        mark_lost(&e.state, LostReason::NotHeld(reason));
                        entries.remove(id);
                    }
                }
            }
        }
        Err(msg) => {
            tracing::debug!(backend = backend.name(), error = %msg, "renewal failed; retrying until the deadline");
            let retry_at = Instant::now();
            for id in &due {
                if let Some(e) = entries.get_mut(id) {
                    e.state
                        .send_modify(|s| s.on_expiry = LostReason::RenewFailed(msg.clone()));
                    e.next_renew = retry_at + retry_delay(e.lease.ttl);
                }
            }
        }
    }
}
