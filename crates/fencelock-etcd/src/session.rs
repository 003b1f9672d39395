//! The backend's etcd leases (Go's `concurrency.Session`), one per TTL class:
//! a hold of TTL `t` is a key attached to the lease of `ceil(t)` seconds
//! (capped by `session_ttl`), so a holder that dies frees its lock after its
//! own TTL, not a longer one. Each lease is granted on first use, kept alive
//! by one task, and replaced by a new one after it expires; the keepalive
//! renews every hold of its class at once.

use std::sync::{Arc, Mutex, Weak};
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

/// The lease in force of one TTL class, and the expired ones still to revoke.
pub(crate) struct Session {
    /// The lease TTL this class asks for (whole seconds).
    pub(crate) secs: i64,
    pub(crate) current: Mutex<Lease>,
    /// Serialises granting a replacement lease.
    pub(crate) gate: tokio::sync::Mutex<()>,
    /// Leases given up on, to revoke (so that a lease this client declared lost
    /// but the server still keeps does not block other clients), until a deadline.
    pub(crate) dead: Mutex<Vec<(i64, Instant)>>,
}

impl Session {
    pub(crate) fn new(secs: i64, lease: Lease) -> Self {
        Session {
            secs,
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
    /// Grants a new lease of `secs` seconds (the server may raise it to its
    /// minimum).
    pub(crate) async fn grant_lease(&self, secs: i64) -> Result<Lease> {
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

    /// The session of holds of `ttl`: the class of `ceil(ttl)` seconds, at
    /// most `session_ttl`; started (with its keepalive task) on first use.
    pub(crate) fn session(self: &Arc<Self>, ttl: Duration) -> Arc<Session> {
        let cap = self.options.session_ttl.as_secs_f64().ceil().max(1.0) as i64;
        let secs = (ttl.as_secs_f64().ceil() as i64).clamp(1, cap);
        let mut sessions = lock(&self.sessions);
        sessions
            .entry(secs)
            .or_insert_with(|| {
                let idle = Lease {
                    id: 0,
                    ttl: Duration::from_secs(secs as u64),
                    valid_until: Instant::now(),
                    alive: false,
                };
                let session = Arc::new(Session::new(secs, idle));
                tokio::spawn(keep_alive(Arc::downgrade(self), Arc::downgrade(&session)));
                session
            })
            .clone()
    }

    /// The sessions started so far.
    pub(crate) fn sessions(&self) -> Vec<Arc<Session>> {
        lock(&self.sessions).values().cloned().collect()
    }

    /// The lease of `session` to attach a new hold to: the current one while
    /// it is alive, else a new one.
    pub(crate) async fn live_lease(&self, session: &Session) -> Result<Lease> {
        let now = Instant::now();
        let l = session.lease();
        if l.alive && l.valid_until > now {
            return Ok(l);
        }
        let _one = session.gate.lock().await;
        let l = session.lease();
        if l.alive && l.valid_until > Instant::now() {
            return Ok(l);
        }
        session.give_up(l.id, false);
        let fresh = self.grant_lease(session.secs).await?;
        *lock(&session.current) = fresh;
        Ok(fresh)
    }

    /// Revokes the leases given up on; forgets those past their deadline.
    pub(crate) async fn revoke_dead(&self, session: &Session) {
        let dead = std::mem::take(&mut *lock(&session.dead));
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
        lock(&session.dead).extend(keep);
    }
}

/// Keeps the current lease of `session` alive: a keepalive every third of its
/// TTL (sooner after a failure) on one stream, reopened when it breaks. Ends
/// when the backend is dropped.
pub(crate) async fn keep_alive(inner: Weak<Inner>, session: Weak<Session>) {
    let mut stream: Option<(i64, LeaseKeeper, LeaseKeepAliveStream)> = None;
    let mut failing = false;
    loop {
        let Some(ttl) = session.upgrade().map(|s| s.lease().ttl) else {
            return;
        };
        tokio::time::sleep(if failing { RETRY } else { ttl / 3 }).await;
        let (Some(inner), Some(session)) = (inner.upgrade(), session.upgrade()) else {
            return;
        };
        let lease = session.lease();
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
                session.extend(lease.id, sent + Duration::from_secs(ttl as u64));
                failing = false;
            }
            Ok(Ok(Some(_))) => {
                session.give_up(lease.id, true);
                stream = None;
            }
            Ok(Err(etcd_client::Error::LeaseKeepAliveError(e))) if e.contains("not found") => {
                session.give_up(lease.id, true);
                stream = None;
            }
            Ok(Ok(None)) | Ok(Err(_)) | Err(_) => {
                stream = None;
                failing = true;
                session.give_up(lease.id, false);
            }
        }
    }
}
