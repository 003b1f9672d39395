//! What a backend crate needs: the [`Backend`] trait and the values that
//! cross it, and the toolkit every backend uses — [`BackendUrl`] (the URL
//! parser), [`wait_for_grant`] (the wait loop), [`SessionHolds`] (holds of
//! session-bound backends), [`admit`] (who may hold with whom), [`Backoff`],
//! [`Driver`] (how the facade opens the backend) and the rest.
//!
//! A user of locks needs none of this but [`Backend`] itself (re-exported at
//! the crate's root).

use std::time::{Duration, SystemTime};

use tokio::time::Instant;

pub use crate::admission::{Admission, admit};
pub use crate::background::{Ticket, tracked};
pub use crate::backoff::Backoff;
pub use crate::capabilities::Capabilities;
pub use crate::driver::{Connecting, Driver, MEMORY_DRIVER};
pub use crate::error::redact_url;
use crate::error::{Error, Result};
pub use crate::grant_slots::{GrantSlot, GrantSlots};
pub use crate::grant_table::{GrantTable, Tokened};
pub use crate::guard::drift_allowance;
use crate::key::{Key, Owner};
use crate::mode::Mode;
pub use crate::queue_rule::{QueueRole, QueueWait, queue_blocker};
pub use crate::session_holds::{LastHold, SessionHolds, SessionWatch, lease_start};
use crate::token::FencingToken;
pub use crate::url::BackendUrl;
pub use crate::wait::{TryOutcome, wait_for_grant};
pub use async_trait::async_trait;
#[doc(hidden)]
pub use tokio as __tokio;

/// One request to acquire a lock.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Request {
    /// The lock.
    pub key: Key,
    /// Who asks.
    pub owner: Owner,
    /// Exclusive, shared or semaphore.
    pub mode: Mode,
    /// How long the hold lasts unless renewed.
    pub ttl: Duration,
    /// Whether a request by an owner that already holds the key adds a hold
    /// (reentrancy; explicit owners) or is a repeat of the same request (a retry
    /// after a lost reply, a race with a handoff; the default per-guard owners),
    /// which must return the existing hold unchanged.
    pub reentrant: bool,
}

impl Request {
    /// A reentrant request; `mode` and `ttl` are validated by the
    /// [`Locker`](crate::Locker) before a backend sees them.
    pub fn new(key: Key, owner: Owner, mode: Mode, ttl: Duration) -> Self {
        Request {
            key,
            owner,
            mode,
            ttl,
            reentrant: true,
        }
    }

    /// Sets [`Request::reentrant`].
    pub fn with_reentrant(mut self, reentrant: bool) -> Self {
        self.reentrant = reentrant;
        self
    }
}

/// What a backend hands back when it grants a lock.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Grant {
    /// The fencing token; `None` when the backend cannot guarantee one.
    pub token: Option<FencingToken>,
    /// The TTL the backend granted (may differ from the request, for example a
    /// ZooKeeper session timeout).
    pub ttl: Duration,
    /// The owner's hold count after this grant (1 unless reentrant).
    pub holds: u32,
    /// When the request that won was sent; the lease's validity counts from here.
    pub requested_at: Instant,
    /// Backend-private data identifying the hold (a ZooKeeper node path, an etcd
    /// key); empty when the key and owner suffice.
    pub handle: String,
}

impl Grant {
    /// A grant with an empty handle.
    pub fn new(
        token: Option<FencingToken>,
        ttl: Duration,
        holds: u32,
        requested_at: Instant,
    ) -> Self {
        Grant {
            token,
            ttl,
            holds,
            requested_at,
            handle: String::new(),
        }
    }

    /// Sets the backend-private handle.
    pub fn with_handle(mut self, handle: impl Into<String>) -> Self {
        self.handle = handle.into();
        self
    }
}

/// Identifies one live hold, for renew and release.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LeaseRef {
    /// The lock.
    pub key: Key,
    /// The holder.
    pub owner: Owner,
    /// The mode it holds in.
    pub mode: Mode,
    /// The TTL to renew to.
    pub ttl: Duration,
    /// The token of the grant.
    pub token: Option<FencingToken>,
    /// The grant's [`Grant::handle`].
    pub handle: String,
}

impl LeaseRef {
    /// The lease that `grant` created for `req`.
    pub fn new(req: &Request, grant: &Grant) -> Self {
        LeaseRef {
            key: req.key.clone(),
            owner: req.owner.clone(),
            mode: req.mode,
            ttl: grant.ttl,
            token: grant.token,
            handle: grant.handle.clone(),
        }
    }
}

/// The outcome of renewing one lease.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Renewal {
    /// Still held; valid for `ttl` from the start of the renew call.
    Held {
        /// The TTL now granted.
        ttl: Duration,
    },
    /// No longer held by this owner (expired, deleted, taken over).
    Lost {
        /// Why, in the backend's words.
        reason: String,
    },
    /// Nothing was learned about this lease (the server that keeps it did not
    /// answer), while others of the batch were renewed: the watchdog retries
    /// it until its deadline, as after an error of the whole batch.
    Unknown {
        /// Why, in the backend's words.
        reason: String,
    },
}

/// The outcome of a successful release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Released {
    /// Holds the owner still has (reentrant acquisitions); 0 when the owner let go.
    pub remaining: u32,
}

impl Released {
    /// A release that left `remaining` holds.
    pub const fn new(remaining: u32) -> Self {
        Released { remaining }
    }
}

/// One holder of a lock, as [`Backend::inspect`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HolderInfo {
    /// Who holds it.
    pub owner: String,
    /// In which mode.
    pub mode: Mode,
    /// The hold count (reentrancy).
    pub holds: u32,
    /// The fencing token of the hold.
    pub token: Option<FencingToken>,
    /// Time left before the hold expires if not renewed (`None`: no TTL).
    pub expires_in: Option<Duration>,
}

impl HolderInfo {
    /// A holder row.
    pub fn new(
        owner: impl Into<String>,
        mode: Mode,
        holds: u32,
        token: Option<FencingToken>,
        expires_in: Option<Duration>,
    ) -> Self {
        HolderInfo {
            owner: owner.into(),
            mode,
            holds,
            token,
            expires_in,
        }
    }
}

/// Who holds a key right now.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockInfo {
    /// The lock.
    pub key: String,
    /// Current holders (empty when free).
    pub holders: Vec<HolderInfo>,
    /// The last token handed out for this key, if the backend keeps one.
    pub last_token: Option<FencingToken>,
}

impl LockInfo {
    /// A report for `key`.
    pub fn new(
        key: impl Into<String>,
        holders: Vec<HolderInfo>,
        last_token: Option<FencingToken>,
    ) -> Self {
        LockInfo {
            key: key.into(),
            holders,
            last_token,
        }
    }
}

/// A lock backend: the small set of operations every algorithm of fencelock is
/// built from. The user-facing API ([`Locker`](crate::Locker), [`Guard`](crate::Guard),
/// the watchdog) lives once, in core, on top of this trait.
///
/// Implementations keep the contract of ARCHITECTURE.md §2: grants carry strictly
/// increasing tokens where [`Capabilities::fencing`] says so; renew never brings
/// back a lease that expired; release never touches another owner's hold.
///
/// # Examples
///
/// Using a backend directly (most code uses a [`Locker`](crate::Locker) instead):
///
/// ```
/// use std::time::Duration;
/// use fencelock_core::{Backend, Key, MemoryBackend, Mode, Owner};
/// use fencelock_core::backend::{Request};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock_core::Result<()> {
/// let backend = MemoryBackend::new();
/// let req = Request::new(Key::new("k")?, Owner::new("me")?, Mode::Exclusive, Duration::from_secs(5));
/// let grant = backend.try_acquire(&req).await?.expect("free");
/// assert_eq!(grant.holds, 1);
/// # Ok(()) }
/// ```
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// A short name: `memory`, `sqlite`, `redis`, …
    fn name(&self) -> &'static str;

    /// What this backend can do.
    fn capabilities(&self) -> Capabilities;

    /// Where it talks to, for messages (passwords redacted).
    fn address(&self) -> String {
        self.name().to_string()
    }

    /// The default TTL the backend's configuration asks for (a `ttl=` URL
    /// option), if any; a [`Locker`](crate::Locker) on this backend uses it.
    fn default_ttl(&self) -> Option<Duration> {
        None
    }

    /// One attempt: grant the lock now or return `None` if it is busy.
    ///
    /// The same owner asking again in the same mode gets its existing hold: with
    /// [`Request::reentrant`] (and [`Capabilities::reentrant`]) the hold count
    /// rises and the token stays; without it nothing changes (an idempotent retry).
    ///
    /// # Cancel safety
    ///
    /// A backend should undo a grant whose caller dropped the attempt while the
    /// request was in flight (the Redis backends do); one that cannot leaves a
    /// hold that nobody renews, which expires after the request's TTL, and says
    /// so in its docs.
    async fn try_acquire(&self, req: &Request) -> Result<Option<Grant>>;

    /// Renews many leases in one round trip (the watchdog's batch). Returns one
    /// [`Renewal`] per lease, in order. A lease that is no longer held is
    /// [`Renewal::Lost`]; it is never re-created. A renewal only extends: the
    /// hold's expiry becomes at least now + the lease's TTL, never earlier than
    /// it was (another hold of the same owner may have asked for more).
    /// Backends that keep leases on several servers report a lease whose
    /// server did not answer as [`Renewal::Unknown`], so one stalled server
    /// costs only its own leases.
    ///
    /// # Errors
    ///
    /// An error means nothing is known about any lease (connection trouble); the
    /// watchdog retries until the leases' local deadlines pass.
    async fn renew(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>>;

    /// Gives one hold back.
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] if the owner does not hold the key (then nothing changed).
    async fn release(&self, lease: &LeaseRef) -> Result<Released>;

    /// Gives one hold back and, if that lets an exclusive lock go, grants it to
    /// `next` in the same atomic step (a handoff to the next waiter of the same
    /// process: one round trip, and nobody else can slip in between). Returns the
    /// grant if the lock was handed over.
    ///
    /// The provided version releases and hands nothing over; backends that can do
    /// both in one step override it.
    ///
    /// # Errors
    ///
    /// As [`Backend::release`].
    async fn release_to(
        &self,
        lease: &LeaseRef,
        next: &Request,
    ) -> Result<(Released, Option<Grant>)> {
        let _ = next;
        Ok((self.release(lease).await?, None))
    }

    /// A signal that holds may have ended without a renewal having said so yet
    /// (the server closed the sessions they live in: a restart, a crash): the
    /// value changes, and the watchdog renews every lease at once, so `lost()`
    /// fires within a round trip instead of at the next renewal. `None` (the
    /// default) for backends whose holds outlive their connections.
    fn session_events(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }

    /// Acquires, waiting until `deadline` (`None`: forever). Returns `None` when
    /// the deadline passed first.
    ///
    /// The provided loop calls [`Backend::try_acquire`], then
    /// [`Backend::wait_change`], until granted or the deadline passes.
    /// Queue-based backends (ZooKeeper, etcd) override it and keep their queue node.
    ///
    /// # Cancel safety
    ///
    /// The provided loop is as cancel safe as [`Backend::try_acquire`]; an
    /// override must make sure a cancelled acquire leaves no queue entry behind,
    /// and no hold beyond what `try_acquire`'s contract allows.
    async fn acquire(&self, req: &Request, deadline: Option<Instant>) -> Result<Option<Grant>> {
        let mut backoff = Backoff::default();
        loop {
            if let Some(grant) = self.try_acquire(req).await? {
                return Ok(Some(grant));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(None);
            }
            self.wait_change(&req.key, &mut backoff, deadline).await?;
        }
    }

    /// Waits until `key` may have changed or `deadline` passes. The provided
    /// version sleeps with `backoff` (jittered exponential); backends with a
    /// notification (pub/sub, watches, LISTEN) override it and still return after
    /// a bounded time, so a lost notification costs a delay, never a hang.
    async fn wait_change(
        &self,
        key: &Key,
        backoff: &mut Backoff,
        deadline: Option<Instant>,
    ) -> Result<()> {
        let _ = key;
        backoff.sleep(deadline, None).await;
        Ok(())
    }

    /// Who holds `key` now; `None` if the backend has never seen it.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] unless [`Capabilities::inspect`].
    async fn inspect(&self, key: &Key) -> Result<Option<LockInfo>> {
        let _ = key;
        Err(Error::unsupported(self.name(), "inspecting locks"))
    }

    /// Every key starting with `prefix` that has holders.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] unless [`Capabilities::inspect`].
    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>> {
        let _ = prefix;
        Err(Error::unsupported(self.name(), "listing locks"))
    }
}

/// [`Backend::list`] for a backend that can name the keys that may be held
/// (`keys`, found under the prefix) but not read their holders in one go:
/// each key is inspected, and those with holders are returned.
///
/// # Errors
///
/// A name that is not a valid [`Key`] (a backend error of `backend`), and the
/// first error of [`Backend::inspect`].
pub async fn list_held<B: Backend + ?Sized>(
    backend: &B,
    keys: Vec<String>,
) -> Result<Vec<LockInfo>> {
    let mut out = Vec::with_capacity(keys.len());
    for k in keys {
        let key = Key::new(k).map_err(|e| Error::backend(backend.name(), e))?;
        if let Some(info) = backend.inspect(&key).await?
            && !info.holders.is_empty()
        {
            out.push(info);
        }
    }
    Ok(out)
}

/// Milliseconds since the Unix epoch by the local wall clock (for backends that
/// store expiry times).
pub fn unix_millis(t: SystemTime) -> i64 {
    match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => d.as_millis() as i64,
        Err(e) => -(e.duration().as_millis() as i64),
    }
}

/// Implements [`Backend`] for `$ty` by handing every call to
/// `self.$get()` (a `&dyn Backend`): for a backend whose modes are backends
/// of their own, picked when it connects.
///
/// ```ignore
/// impl PostgresBackend {
///     fn mode(&self) -> &dyn Backend { &*self.inner.mode }
/// }
/// fencelock_core::delegate_backend!(PostgresBackend, mode);
/// ```
#[macro_export]
macro_rules! delegate_backend {
    ($ty:ty, $get:ident) => {
        #[$crate::backend::async_trait]
        impl $crate::Backend for $ty {
            fn name(&self) -> &'static str {
                self.$get().name()
            }

            fn capabilities(&self) -> $crate::Capabilities {
                self.$get().capabilities()
            }

            fn address(&self) -> String {
                self.$get().address()
            }

            fn default_ttl(&self) -> Option<::std::time::Duration> {
                self.$get().default_ttl()
            }

            fn session_events(
                &self,
            ) -> Option<$crate::backend::__tokio::sync::watch::Receiver<u64>> {
                self.$get().session_events()
            }

            async fn try_acquire(
                &self,
                req: &$crate::backend::Request,
            ) -> $crate::Result<Option<$crate::backend::Grant>> {
                self.$get().try_acquire(req).await
            }

            async fn acquire(
                &self,
                req: &$crate::backend::Request,
                deadline: Option<$crate::backend::__tokio::time::Instant>,
            ) -> $crate::Result<Option<$crate::backend::Grant>> {
                self.$get().acquire(req, deadline).await
            }

            async fn renew(
                &self,
                leases: &[$crate::backend::LeaseRef],
            ) -> $crate::Result<Vec<$crate::backend::Renewal>> {
                self.$get().renew(leases).await
            }

            async fn release(
                &self,
                lease: &$crate::backend::LeaseRef,
            ) -> $crate::Result<$crate::backend::Released> {
                self.$get().release(lease).await
            }

            async fn release_to(
                &self,
                lease: &$crate::backend::LeaseRef,
                next: &$crate::backend::Request,
            ) -> $crate::Result<($crate::backend::Released, Option<$crate::backend::Grant>)> {
                self.$get().release_to(lease, next).await
            }

            async fn wait_change(
                &self,
                key: &$crate::Key,
                backoff: &mut $crate::backend::Backoff,
                deadline: Option<$crate::backend::__tokio::time::Instant>,
            ) -> $crate::Result<()> {
                self.$get().wait_change(key, backoff, deadline).await
            }

            async fn inspect(&self, key: &$crate::Key) -> $crate::Result<Option<$crate::LockInfo>> {
                self.$get().inspect(key).await
            }

            async fn list(&self, prefix: &str) -> $crate::Result<Vec<$crate::LockInfo>> {
                self.$get().list(prefix).await
            }
        }
    };
}
