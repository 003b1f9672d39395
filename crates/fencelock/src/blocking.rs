//! A blocking API, for programs without an async runtime (cargo feature
//! `blocking`; the pattern of `reqwest::blocking`).
//!
//! A [`Locker`] owns a small tokio runtime (one worker thread) on which the
//! watchdog renews every guard while the calling threads do their blocking
//! work. Every method blocks the calling thread; none may be called from
//! inside an async runtime (they panic there, as `reqwest::blocking` does).
//!
//! # Examples
//!
//! ```
//! use std::time::Duration;
//! use fencelock::blocking::Locker;
//!
//! # fn main() -> fencelock::Result<()> {
//! # let dir = tempfile::tempdir().unwrap();
//! # let url = format!("sqlite://{}", dir.path().join("locks.db").display());
//! let locker = Locker::connect(&url)?;
//! let guard = locker.lock("orders/42").ttl(Duration::from_secs(30)).acquire()?;
//! let token = guard.token(); // send it with every write
//!
//! // A worker thread that must stop when the lock is lost.
//! let lease = guard.lease();
//! let worker = std::thread::spawn(move || match lease.wait_lost_timeout(Duration::from_millis(50)) {
//!     Some(lost) => Err(lost),
//!     None => Ok("work done while the lease held"),
//! });
//! assert_eq!(worker.join().unwrap()?, "work done while the lease held");
//! guard.release()?;
//! # let _ = token; Ok(()) }
//! ```

use std::sync::Arc;
use std::time::Duration;

use fencelock_core::{Error, FencingToken, Key, LockInfo, Result};
use tokio::runtime::Runtime;

/// The runtime the blocking types share; shut down without blocking when
/// the last of them goes.
struct Rt(Option<Runtime>);

impl Rt {
    fn get(&self) -> &Runtime {
        self.0
            .as_ref()
            .expect("the runtime lives until Rt is dropped")
    }

    fn block_on<F: Future>(&self, f: F) -> F::Output {
        self.get().block_on(f)
    }
}

impl Drop for Rt {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// A [`fencelock_core::Locker`] driven by a runtime of its own.
#[derive(Clone)]
pub struct Locker {
    inner: fencelock_core::Locker,
    rt: Arc<Rt>,
}

impl std::fmt::Debug for Locker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("blocking::Locker")
            .field(&self.inner)
            .finish()
    }
}

impl Locker {
    /// Connects to the backend `url` names (see [`crate::connect`]).
    ///
    /// # Errors
    ///
    /// As [`crate::connect`]; an I/O error if the runtime cannot start.
    ///
    /// # Panics
    ///
    /// Inside an async runtime.
    pub fn connect(url: &str) -> Result<Locker> {
        let rt = Arc::new(Rt(Some(runtime()?)));
        let inner = rt.block_on(crate::connect(url))?;
        Ok(Locker { inner, rt })
    }

    /// A locker on an already built backend. A backend that keeps tasks of
    /// its own (a network client) must have been built on a runtime that
    /// outlives this locker; [`Locker::connect`] builds it on the locker's.
    ///
    /// # Errors
    ///
    /// An I/O error if the runtime cannot start.
    pub fn new(backend: impl fencelock_core::Backend) -> Result<Locker> {
        // The locker starts its tasks on first use, inside `block_on`.
        Ok(Locker {
            inner: fencelock_core::Locker::new(backend),
            rt: Arc::new(Rt(Some(runtime()?))),
        })
    }

    /// An exclusive lock on `key`.
    pub fn lock(&self, key: impl AsRef<str>) -> LockBuilder {
        self.builder(self.inner.lock(key))
    }

    /// A shared (read) lock on `key`.
    pub fn read_lock(&self, key: impl AsRef<str>) -> LockBuilder {
        self.builder(self.inner.read_lock(key))
    }

    /// One of `permits` permits of `key`.
    pub fn semaphore(&self, key: impl AsRef<str>, permits: u32) -> LockBuilder {
        self.builder(self.inner.semaphore(key, permits))
    }

    /// Who holds `key` (see [`fencelock_core::Locker::inspect`]).
    ///
    /// # Errors
    ///
    /// As [`fencelock_core::Locker::inspect`].
    pub fn inspect(&self, key: impl AsRef<str>) -> Result<Option<LockInfo>> {
        self.rt.block_on(self.inner.inspect(key))
    }

    /// The async locker underneath. Use it on this locker's runtime only
    /// (the watchdog starts on the runtime of the first call).
    pub fn as_async(&self) -> &fencelock_core::Locker {
        &self.inner
    }

    fn builder(&self, inner: fencelock_core::LockBuilder) -> LockBuilder {
        LockBuilder {
            inner,
            rt: self.rt.clone(),
        }
    }
}

fn runtime() -> Result<Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("fencelock-blocking")
        .enable_all()
        .build()
        .map_err(|e| Error::config(format!("cannot start the blocking API's runtime: {e}")))
}

/// Builds one lock request (see [`fencelock_core::LockBuilder`]).
#[must_use = "a builder does nothing until acquire or try_acquire"]
pub struct LockBuilder {
    inner: fencelock_core::LockBuilder,
    rt: Arc<Rt>,
}

macro_rules! forward {
    ($($(#[$doc:meta])* $name:ident($($arg:ident: $ty:ty),*);)*) => {$(
        $(#[$doc])*
        pub fn $name(self, $($arg: $ty),*) -> Self {
            LockBuilder { inner: self.inner.$name($($arg),*), rt: self.rt }
        }
    )*};
}

impl LockBuilder {
    forward! {
        /// See [`fencelock_core::LockBuilder::ttl`].
        ttl(ttl: Duration);
        /// See [`fencelock_core::LockBuilder::lease`].
        lease(ttl: Duration);
        /// See [`fencelock_core::LockBuilder::wait`].
        wait(wait: Duration);
        /// See [`fencelock_core::LockBuilder::wait_forever`].
        wait_forever();
        /// See [`fencelock_core::LockBuilder::max_hold`].
        max_hold(max_hold: Duration);
    }

    /// See [`fencelock_core::LockBuilder::owner`].
    pub fn owner(self, owner: impl Into<String>) -> Self {
        LockBuilder {
            inner: self.inner.owner(owner),
            rt: self.rt,
        }
    }

    /// Acquires, blocking while it waits.
    ///
    /// # Errors
    ///
    /// As [`fencelock_core::LockBuilder::acquire`].
    pub fn acquire(self) -> Result<Guard> {
        let guard = self.rt.block_on(self.inner.acquire())?;
        Ok(Guard {
            inner: Some(guard),
            rt: self.rt,
        })
    }

    /// One attempt: `Ok(None)` if the lock is busy.
    ///
    /// # Errors
    ///
    /// As [`fencelock_core::LockBuilder::try_acquire`].
    pub fn try_acquire(self) -> Result<Option<Guard>> {
        let guard = self.rt.block_on(self.inner.try_acquire())?;
        Ok(guard.map(|g| Guard {
            inner: Some(g),
            rt: self.rt,
        }))
    }
}

/// A held lock (see [`fencelock_core::Guard`]): renewed by the locker's
/// runtime while it lives.
///
/// Dropping it releases the hold: outside an async runtime the drop waits
/// for the backend's answer (up to 5 s; a release that does not answer by
/// then leaves the hold to expire after its TTL); inside one a thread of its
/// own does that, so the drop does not block.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct Guard {
    inner: Option<fencelock_core::Guard>,
    rt: Arc<Rt>,
}

/// How long a dropped guard waits for its release.
const DROP_RELEASE: Duration = Duration::from_secs(5);

impl Guard {
    fn get(&self) -> &fencelock_core::Guard {
        self.inner.as_ref().expect("taken only by release and drop")
    }

    /// The lock's key.
    pub fn key(&self) -> &Key {
        self.get().key()
    }

    /// The fencing token (see [`fencelock_core::Guard::token`]).
    pub fn token(&self) -> Option<FencingToken> {
        self.get().token()
    }

    /// Whether the hold is surely still valid (see
    /// [`fencelock_core::Lease::is_valid`]).
    pub fn is_valid(&self) -> bool {
        self.get().is_valid()
    }

    /// A cloneable handle on the hold's validity, for other threads.
    pub fn lease(&self) -> Lease {
        Lease {
            inner: self.get().lease(),
            rt: self.rt.clone(),
        }
    }

    /// Blocks until the hold is lost (see [`fencelock_core::Guard::lost`]).
    pub fn wait_lost(&self) -> Error {
        self.lease().wait_lost()
    }

    /// Blocks until the hold is lost or `timeout` has passed (`None`).
    pub fn wait_lost_timeout(&self, timeout: Duration) -> Option<Error> {
        self.lease().wait_lost_timeout(timeout)
    }

    /// Gives the hold back and waits for the backend to confirm.
    ///
    /// # Errors
    ///
    /// As [`fencelock_core::Guard::release`].
    pub fn release(mut self) -> Result<()> {
        let guard = self.inner.take().expect("taken only by release and drop");
        self.rt.block_on(guard.release())
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let Some(guard) = self.inner.take() else {
            return;
        };
        // (The timer is made inside the runtime: tokio's timers need one.)
        let release = |rt: &Rt| {
            let _ =
                rt.block_on(async { tokio::time::timeout(DROP_RELEASE, guard.release()).await });
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            // Inside a runtime, blocking would stall it: a thread of its own
            // releases, and keeps the locker's runtime alive until then (had
            // the guard only queued its release, dropping the last handle on
            // the runtime would cut it).
            let rt = self.rt.clone();
            std::thread::spawn(move || release(&rt));
            return;
        }
        release(&self.rt);
    }
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("blocking::Guard").field(&self.inner).finish()
    }
}

/// A cloneable view of one hold's validity that threads can wait on.
#[derive(Clone)]
pub struct Lease {
    inner: fencelock_core::Lease,
    rt: Arc<Rt>,
}

impl Lease {
    /// Whether the hold is surely still valid.
    pub fn is_valid(&self) -> bool {
        self.inner.is_valid()
    }

    /// The fencing token of the hold.
    pub fn token(&self) -> Option<FencingToken> {
        self.inner.token()
    }

    /// Blocks until the hold is lost; returns [`Error::Lost`].
    pub fn wait_lost(&self) -> Error {
        self.rt.block_on(self.inner.lost())
    }

    /// Blocks until the hold is lost or `timeout` has passed (`None`).
    pub fn wait_lost_timeout(&self, timeout: Duration) -> Option<Error> {
        self.rt
            .block_on(async { tokio::time::timeout(timeout, self.inner.lost()).await })
            .ok()
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("blocking::Lease").field(&self.inner).finish()
    }
}
