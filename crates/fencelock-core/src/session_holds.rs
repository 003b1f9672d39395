//! Bookkeeping for backends that hold each lock on a dedicated server session
//! (PostgreSQL advisory locks, MySQL `GET_LOCK`): the live holds of one client
//! with their sessions, reentrancy, the watchdog's pings, release, and a small
//! list of idle sessions to reuse.
//!
//! The backend does the I/O (taking and letting go of the lock on a session);
//! [`SessionHolds`] keeps who holds what on which session.
//!
//! # Examples
//!
//! ```
//! use std::time::Duration;
//! use fencelock_core::{Key, Mode, Owner};
//! use fencelock_core::backend::{LeaseRef, Renewal, Request, SessionHolds};
//! use tokio::time::Instant;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock_core::Result<()> {
//! // A "session" here is a plain string; a backend stores its connection type.
//! let holds: SessionHolds<String> = SessionHolds::new("demo", 4);
//! let req = Request::new(Key::new("k")?, Owner::new("me")?, Mode::Exclusive, Duration::from_secs(5));
//! let alive = async |_s: &mut String| Ok(()); // a backend pings its session here
//! assert!(holds.reenter(&req, Instant::now(), alive).await?.is_none()); // not held yet
//! let grant = holds.insert(&req, 7, 0, "session-1".to_string(), Instant::now());
//! let lease = LeaseRef::new(&req, &grant);
//! let renewals = holds.ping(&[lease.clone()], async |_s: &mut String| Ok(())).await;
//! assert!(matches!(renewals[0], Renewal::Held { .. }));
//! let last = holds.release(&lease).await?;
//! assert!(last.session.is_some()); // the last hold: let go of the lock on this session
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::{Grant, LeaseRef, Renewal, Request};
use crate::error::{Error, Result};
use crate::key::{Key, Owner};
use crate::mode::Mode;
use crate::token::FencingToken;

/// When the lease of a grant on `session` counts from, for a backend whose
/// TTL is the session's idle timeout (`idle_session_timeout`, `wait_timeout`):
/// that timeout starts when the granting statement ends, which may be long
/// after it was sent at `sent` (it waited in the server). Then one more round
/// trip (`ping`) restarts the timeout, and the lease counts from its sending;
/// a grant answered within a tenth of the TTL counts from `sent`.
///
/// # Errors
///
/// The ping's error: the session is gone (and the lock with it).
pub async fn lease_start<S, F>(
    sent: Instant,
    ttl: Duration,
    session: &mut S,
    ping: F,
) -> std::result::Result<Instant, String>
where
    F: AsyncFn(&mut S) -> std::result::Result<(), String>,
{
    if sent.elapsed() <= ttl / 10 {
        return Ok(sent);
    }
    let again = Instant::now();
    ping(session).await?;
    Ok(again)
}

/// See [`SessionHolds::watcher`].
#[derive(Clone, Debug)]
pub struct SessionWatch {
    events: std::sync::Weak<tokio::sync::watch::Sender<u64>>,
}

impl SessionWatch {
    /// Whether the holds it watches for still exist.
    pub fn alive(&self) -> bool {
        self.events.strong_count() > 0
    }

    /// The server closed the watching session: the holds' sessions may have
    /// ended too.
    pub fn sessions_may_have_ended(&self) {
        if let Some(events) = self.events.upgrade() {
            events.send_modify(|n| *n += 1);
        }
    }
}

/// One hold and its session.
struct Held<S> {
    key: Key,
    owner: Owner,
    mode: Mode,
    token: u64,
    slot: u32,
    ttl: Duration,
    holds: Mutex<u32>,
    /// `None` once the session is known to be gone.
    session: tokio::sync::Mutex<Option<S>>,
}

/// What [`SessionHolds::release`] leaves to the backend.
#[derive(Debug)]
#[non_exhaustive]
pub struct LastHold<S> {
    /// Holds the owner still has; the lock stays taken when above 0.
    pub remaining: u32,
    /// With `remaining == 0`: the session whose lock the backend must now let
    /// go of (then reuse or drop it); `None` if the session had already ended
    /// (the lock went with it: the release is [`Error::NotHeld`]).
    pub session: Option<S>,
    /// The key.
    pub key: Key,
    /// The mode held.
    pub mode: Mode,
    /// The permit held (backend-defined; 0 when not a semaphore).
    pub slot: u32,
    /// The TTL of the hold.
    pub ttl: Duration,
}

/// The live holds of one client, each on its own session `S`, and idle
/// sessions (with a backend-defined tag, e.g. the timeout set on them).
pub struct SessionHolds<S> {
    prefix: &'static str,
    /// Changed when the sessions may have ended (see [`SessionHolds::events`]).
    events: Arc<tokio::sync::watch::Sender<u64>>,
    held: Mutex<HashMap<String, Arc<Held<S>>>>,
    idle: Mutex<Vec<(S, u64)>>,
    max_idle: usize,
    next_id: AtomicU64,
}

impl<S: Send + 'static> SessionHolds<S> {
    /// An empty registry; handles are `<prefix>-<n>`; at most `max_idle` idle
    /// sessions are kept.
    pub fn new(prefix: &'static str, max_idle: usize) -> Self {
        SessionHolds {
            prefix,
            events: Arc::new(tokio::sync::watch::Sender::new(0)),
            held: Mutex::new(HashMap::new()),
            idle: Mutex::new(Vec::new()),
            max_idle,
            next_id: AtomicU64::new(1),
        }
    }

    /// The signal for [`Backend::session_events`](crate::Backend::session_events).
    pub fn events(&self) -> tokio::sync::watch::Receiver<u64> {
        self.events.subscribe()
    }

    /// Says that the sessions may have ended (the backend saw the server close
    /// a connection of its own): the watchdog pings every hold at once. Idle
    /// sessions are dropped (they are gone too, most likely).
    pub fn sessions_may_have_ended(&self) {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.events.send_modify(|n| *n += 1);
    }

    /// A handle for a task that watches the server (a session of its own,
    /// waiting in a statement): it says when the server closed that session,
    /// and knows when these holds are gone (then the task stops).
    pub fn watcher(&self) -> SessionWatch {
        SessionWatch {
            events: Arc::downgrade(&self.events),
        }
    }

    /// An idle session and its tag, if any.
    pub fn take_idle(&self) -> Option<(S, u64)> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop()
    }

    /// Keeps `session` for reuse (dropped if the idle list is full).
    pub fn put_idle(&self, session: S, tag: u64) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < self.max_idle {
            idle.push((session, tag));
        }
    }

    fn find(&self, key: &Key, owner: &Owner) -> Option<(String, Arc<Held<S>>)> {
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        held.iter()
            .find(|(_, h)| &h.key == key && &h.owner == owner)
            .map(|(id, h)| (id.clone(), h.clone()))
    }

    fn lookup(&self, lease: &LeaseRef) -> Option<Arc<Held<S>>> {
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        held.get(&lease.handle)
            .filter(|h| h.key == lease.key && h.owner == lease.owner)
            .cloned()
    }

    fn forget(&self, handle: &str) {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(handle);
    }

    /// If this client holds `req.key` for `req.owner` on a live session: the
    /// grant of a reentrant request (one more hold, same token) or of a repeated
    /// one (unchanged). `None` if the backend must take the lock — also when
    /// `ping` shows the session gone (ended by the server, killed by an
    /// operator): its hold is forgotten then, never handed back.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] if the owner holds the key in another mode.
    pub async fn reenter<F>(
        &self,
        req: &Request,
        requested_at: Instant,
        ping: F,
    ) -> Result<Option<Grant>>
    where
        F: AsyncFn(&mut S) -> std::result::Result<(), String>,
    {
        let Some((handle, h)) = self.find(&req.key, &req.owner) else {
            return Ok(None);
        };
        if h.mode != req.mode {
            return Err(Error::mode_mismatch(
                req.owner.as_str(),
                req.key.as_str(),
                h.mode,
                req.mode,
            ));
        }
        {
            let mut session = h.session.lock().await;
            let alive = match session.as_mut() {
                Some(s) => matches!(crate::sync::timeout(h.ttl, ping(s)).await, Some(Ok(()))),
                None => false,
            };
            if !alive {
                *session = None;
                self.forget(&handle);
                return Ok(None);
            }
        }
        let holds = {
            let mut n = h.holds.lock().unwrap_or_else(|p| p.into_inner());
            *n += u32::from(req.reentrant);
            *n
        };
        let grant = Grant::new(Some(FencingToken::new(h.token)), h.ttl, holds, requested_at);
        Ok(Some(grant.with_handle(handle)))
    }

    /// Records a new hold of `req` with `token` (and permit `slot`) on `session`.
    pub fn insert(
        &self,
        req: &Request,
        token: u64,
        slot: u32,
        session: S,
        requested_at: Instant,
    ) -> Grant {
        let handle = format!(
            "{}-{}",
            self.prefix,
            self.next_id.fetch_add(1, Ordering::Relaxed)
        );
        let held = Held {
            key: req.key.clone(),
            owner: req.owner.clone(),
            mode: req.mode,
            token,
            slot,
            ttl: req.ttl,
            holds: Mutex::new(1),
            session: tokio::sync::Mutex::new(Some(session)),
        };
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(handle.clone(), Arc::new(held));
        Grant::new(Some(FencingToken::new(token)), req.ttl, 1, requested_at).with_handle(handle)
    }

    /// Pings every lease's session with `ping`, all at once; a ping that fails
    /// (or takes longer than the lease's TTL) means the session, and the lock
    /// with it, is gone: [`Renewal::Lost`], and the hold is forgotten.
    pub async fn ping<F>(&self, leases: &[LeaseRef], ping: F) -> Vec<Renewal>
    where
        F: AsyncFn(&mut S) -> std::result::Result<(), String>,
    {
        let ping = &ping;
        futures::future::join_all(leases.iter().map(|lease| async move {
            let Some(h) = self.lookup(lease) else {
                return Renewal::Lost {
                    reason: "this client holds no session for it".into(),
                };
            };
            let mut session = h.session.lock().await;
            let Some(s) = session.as_mut() else {
                return Renewal::Lost {
                    reason: "its session ended".into(),
                };
            };
            let reason = match crate::sync::timeout(lease.ttl, ping(s)).await {
                Some(Ok(())) => return Renewal::Held { ttl: lease.ttl },
                Some(Err(e)) => format!("its session ended: {e}"),
                None => format!("its session did not answer within {:?}", lease.ttl),
            };
            *session = None;
            self.forget(&lease.handle);
            Renewal::Lost { reason }
        }))
        .await
    }

    /// Gives one hold back. With holds left, nothing more to do; for the last
    /// one the hold is forgotten and its session handed back to let go of the
    /// lock.
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] if this client has no such hold.
    pub async fn release(&self, lease: &LeaseRef) -> Result<LastHold<S>> {
        let h = self.lookup(lease).ok_or_else(|| Error::NotHeld {
            key: lease.key.to_string(),
            owner: lease.owner.to_string(),
        })?;
        let remaining = {
            let mut n = h.holds.lock().unwrap_or_else(|p| p.into_inner());
            *n = n.saturating_sub(1);
            *n
        };
        let session = if remaining == 0 {
            self.forget(&lease.handle);
            h.session.lock().await.take()
        } else {
            None
        };
        Ok(LastHold {
            remaining,
            session,
            key: h.key.clone(),
            mode: h.mode,
            slot: h.slot,
            ttl: h.ttl,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(owner: &str, mode: Mode, reentrant: bool) -> Request {
        Request::new(
            Key::new("k").unwrap(),
            Owner::new(owner).unwrap(),
            mode,
            Duration::from_secs(1),
        )
        .with_reentrant(reentrant)
    }

    #[tokio::test]
    async fn reentrant_holds_count_and_the_last_release_returns_the_session() {
        let holds: SessionHolds<u32> = SessionHolds::new("t", 2);
        let r = req("a", Mode::Exclusive, true);
        let g = holds.insert(&r, 5, 0, 42, Instant::now());
        let again = holds
            .reenter(&r, Instant::now(), async |_: &mut u32| Ok(()))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (again.holds, again.token, &again.handle),
            (2, g.token, &g.handle)
        );
        let repeat = req("a", Mode::Exclusive, false);
        assert_eq!(
            holds
                .reenter(&repeat, Instant::now(), async |_: &mut u32| Ok(()))
                .await
                .unwrap()
                .unwrap()
                .holds,
            2
        );
        assert!(
            holds
                .reenter(
                    &req("a", Mode::Shared, true),
                    Instant::now(),
                    async |_: &mut u32| Ok(())
                )
                .await
                .is_err()
        );
        let lease = LeaseRef::new(&r, &g);
        let first = holds.release(&lease).await.unwrap();
        assert_eq!((first.remaining, first.session), (1, None));
        let last = holds.release(&lease).await.unwrap();
        assert_eq!((last.remaining, last.session), (0, Some(42)));
        assert!(matches!(
            holds.release(&lease).await,
            Err(Error::NotHeld { .. })
        ));
    }

    #[tokio::test]
    async fn a_failed_ping_loses_the_hold_and_another_owner_cannot_release() {
        let holds: SessionHolds<u32> = SessionHolds::new("t", 2);
        let r = req("a", Mode::Exclusive, true);
        let lease = LeaseRef::new(&r, &holds.insert(&r, 1, 0, 7, Instant::now()));
        let mut intruder = lease.clone();
        intruder.owner = Owner::new("b").unwrap();
        assert!(holds.release(&intruder).await.is_err());
        let ok = holds
            .ping(std::slice::from_ref(&lease), async |_: &mut u32| Ok(()))
            .await;
        assert!(matches!(ok[0], Renewal::Held { .. }));
        let failed = holds
            .ping(std::slice::from_ref(&lease), async |_: &mut u32| {
                Err("gone".into())
            })
            .await;
        assert!(matches!(&failed[0], Renewal::Lost { reason } if reason.contains("gone")));
        assert!(
            holds
                .reenter(&r, Instant::now(), async |_: &mut u32| Ok(()))
                .await
                .unwrap()
                .is_none()
        );
        assert!(holds.release(&lease).await.is_err());
    }

    #[tokio::test]
    async fn a_session_found_dead_is_not_reentered_and_its_hold_is_forgotten() {
        let holds: SessionHolds<u32> = SessionHolds::new("t", 2);
        let r = req("a", Mode::Exclusive, true);
        let lease = LeaseRef::new(&r, &holds.insert(&r, 1, 0, 7, Instant::now()));
        let dead = async |_: &mut u32| Err("terminated".to_string());
        assert!(
            holds
                .reenter(&r, Instant::now(), dead)
                .await
                .unwrap()
                .is_none()
        );
        assert!(holds.release(&lease).await.is_err());
    }

    #[test]
    fn the_idle_list_is_bounded() {
        let holds: SessionHolds<u32> = SessionHolds::new("t", 1);
        holds.put_idle(1, 10);
        holds.put_idle(2, 20);
        assert_eq!(holds.take_idle(), Some((1, 10)));
        assert_eq!(holds.take_idle(), None);
    }
}
