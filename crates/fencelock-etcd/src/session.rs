//! The backend's etcd lease (Go's `concurrency.Session`): granted at connect,
//! kept alive by one task, replaced by a new one after it expires. Every hold
//! is a key attached to it, so the keepalive renews them all at once.

use std::sync::{Mutex, Weak};
use std::time::Duration;

use etcd_client::{LeaseKeepAliveStream, LeaseKeeper};
use fencelock_core::{Error, Result};
use tokio::time::Instant;

use crate::{Inner, NAME, lock};

/// How soon a failed keepalive is tried again.
const RETRY: Duration = Duration::from_millis(200);

/// One etcd lease as this client knows it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lease {
    pub(crate) id: i64,
    /// The TTL the server granted.
    pub(crate) ttl: Duration,
    /// Its server-side expiry cannot come before this: the send time of the
    /// last keepalive that succeeded, plus the TTL.
    pub(crate) valid_until: Instant,
    /// False once it expired (or its validity passed without a keepalive):
    /// its holds are lost, and the next acquire takes a new lease.
    pub(crate) alive: bool,
}

/// The lease in force, and the expired ones still to revoke.
pub(crate) struct Session {
    pub(crate) current: Mutex<Lease>,
    /// Serialises granting a replacement lease.
    pub(crate) gate: tokio::sync::Mutex<()>,
    /// Leases given up on, to revoke (so that a lease this client declared lost
    /// but the server still keeps does not block other clients), until a deadline.
    pub(crate) dead: Mutex<Vec<(i64, Instant)>>,
}

impl Session {
    pub(crate) fn new(lease: Lease) -> Self {
        Session {
            current: Mutex::new(lease),
            gate: tokio::sync::Mutex::new(()),
            dead: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn lease(&self) -> Lease {
        *lock(&self.current)
    }

    /// A keepalive of `id` sent at some instant succeeded with `until` as the new validity.
    fn extend(&self, id: i64, until: Instant) {
        let mut l = lock(&self.current);
        if l.id == id && l.alive {
            l.valid_until = l.valid_until.max(until);
        }
    }

    /// Gives up on lease `id` if it is the current one and `expired` (the
    /// server said so) or its validity has passed.
    fn give_up(&self, id: i64, expired: bool) {
        let mut l = lock(&self.current);
        if l.id == id && l.alive && (expired || Instant::now() >= l.valid_until) {
            l.alive = false;
            lock(&self.dead).push((id, Instant::now() + l.ttl * 2));
        }
    }
}

impl Inner {
    /// Grants a new lease of `session_ttl`.
    pub(crate) async fn grant_lease(&self) -> Result<Lease> {
        let secs = self.options.session_ttl.as_secs_f64().ceil() as i64;
        let sent = Instant::now();
        let resp = self
            .call(|mut c| async move { c.lease_grant(secs, None).await })
            .await?;
        if !resp.error().is_empty() {
            return Err(Error::backend(
                NAME,
                format!("lease grant: {}", resp.error()),
            ));
        }
        let ttl = Duration::from_secs(resp.ttl().max(1) as u64);
        Ok(Lease {
            id: resp.id(),
            ttl,
            valid_until: sent + ttl,
            alive: true,
        })
    }

    /// The lease to attach a new hold to: the current one while it is alive,
    /// else a new one.
    pub(crate) async fn live_lease(&self) -> Result<Lease> {
        let now = Instant::now();
        let l = self.session.lease();
        if l.alive && l.valid_until > now {
            return Ok(l);
        }
        let _one = self.session.gate.lock().await;
        let l = self.session.lease();
        if l.alive && l.valid_until > Instant::now() {
            return Ok(l);
        }
        self.session.give_up(l.id, false);
        let fresh = self.grant_lease().await?;
        *lock(&self.session.current) = fresh;
        Ok(fresh)
    }

    /// Revokes the leases given up on; forgets those past their deadline.
    pub(crate) async fn revoke_dead(&self) {
        let dead = std::mem::take(&mut *lock(&self.session.dead));
        let mut keep = Vec::new();
        for (id, until) in dead {
            let mut c = self.client.clone();
            let r = tokio::time::timeout(self.options.request_timeout, c.lease_revoke(id)).await;
            let done = match r {
                Ok(Ok(_)) => true,
                Ok(Err(e)) => e.to_string().contains("not found"),
                Err(_) => false,
            };
            if !done && Instant::now() < until {
                keep.push((id, until));
            }
        }
        lock(&self.session.dead).extend(keep);
    }
}

/// Keeps the current lease alive: a keepalive every third of its TTL (sooner
/// after a failure) on one stream, reopened when it breaks. Ends when the
/// backend is dropped.
pub(crate) async fn keep_alive(inner: Weak<Inner>) {
    let mut stream: Option<(i64, LeaseKeeper, LeaseKeepAliveStream)> = None;
    let mut failing = false;
    loop {
        let Some(ttl) = inner.upgrade().map(|i| i.session.lease().ttl) else {
            return;
        };
        tokio::time::sleep(if failing { RETRY } else { ttl / 3 }).await;
        let Some(inner) = inner.upgrade() else { return };
        let lease = inner.session.lease();
        if !lease.alive {
            // Nothing to keep until an acquire takes a new lease.
            stream = None;
            failing = false;
            continue;
        }
        let sent = Instant::now();
        let wait = inner.options.request_timeout.min(lease.ttl / 3);
        let answer = tokio::time::timeout(wait, async {
            match &mut stream {
                Some((id, keeper, s)) if *id == lease.id => {
                    keeper.keep_alive().await?;
                    Ok(s.message().await?.map(|r| r.ttl()))
                }
                _ => {
                    // Opening the stream sends a first keepalive and fails if
                    // the lease is gone.
                    let (keeper, s) = inner.client.clone().lease_keep_alive(lease.id).await?;
                    stream = Some((lease.id, keeper, s));
                    Ok(Some(lease.ttl.as_secs() as i64))
                }
            }
        })
        .await;
        match answer {
            Ok(Ok(Some(ttl))) if ttl > 0 => {
                inner
                    .session
                    .extend(lease.id, sent + Duration::from_secs(ttl as u64));
                failing = false;
            }
            Ok(Ok(Some(_))) => {
                inner.session.give_up(lease.id, true);
                stream = None;
            }
            Ok(Err(etcd_client::Error::LeaseKeepAliveError(e))) if e.contains("not found") => {
                inner.session.give_up(lease.id, true);
                stream = None;
            }
            Ok(Ok(None)) | Ok(Err(_)) | Err(_) => {
                stream = None;
                failing = true;
                inner.session.give_up(lease.id, false);
            }
        }
    }
}
