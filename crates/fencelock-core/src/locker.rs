//! [`Locker`], the entry point, and [`LockBuilder`], the one way to ask for a lock.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::Instrument;

use crate::backend::{Backend, Grant, LeaseRef, LockInfo, Renewal, Request};
use crate::background::Ticket;
use crate::backoff::Backoff;
use crate::capabilities::Capabilities;
use crate::error::{Error, Result};
use crate::guard::{Guard, Lease, LeaseCell, LeaseState, LostReason, validity_deadline};
use crate::key::{Key, Owner};
use crate::line::{Lines, acquire_in_line};
use crate::mode::Mode;
use crate::multi::MultiLockBuilder;
use crate::sync::{AtomicU64, Mutex, lock, runtime_present, spawn, timeout_at};
use crate::watchdog::{self, DropRelease, Registration, Watchdog};

/// The TTL of a hold unless the builder says otherwise (Redisson's 30 s).
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);

/// The shortest TTL accepted: shorter leases cannot be renewed in time.
pub const MIN_TTL: Duration = Duration::from_millis(10);

/// State shared by a [`Locker`], its clones and its guards.
pub(crate) struct Shared {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) watchdog: Arc<Watchdog>,
    /// Releases queued by dropped guards, performed by the watchdog task.
    pub(crate) drops: mpsc::UnboundedSender<DropRelease>,
    /// The watchdog's receiver until the watchdog task is started.
    worker: Mutex<Option<mpsc::UnboundedReceiver<DropRelease>>>,
    id: String,
    next_id: AtomicU64,
    default_ttl: Duration,
    pub(crate) lines: Arc<Lines>,
}

impl Shared {
    /// Starts the watchdog task on the current runtime if it is not running yet.
    pub(crate) fn ensure_worker(&self) {
        let mut slot = lock(&self.worker);
        if slot.is_none() {
            return;
        }
        if runtime_present()
            && let Some(rx) = slot.take()
        {
            spawn(watchdog::run(
                self.backend.clone(),
                self.watchdog.clone(),
                rx,
            ));
        }
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

/// A client of one backend: the entry point of fencelock.
///
/// Cheap to clone (all clones share one connection and one watchdog task). Every
/// guard gets its own owner id (`<locker id>:<n>`) unless the builder sets one.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_core::{Locker, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock_core::Result<()> {
/// let locker = Locker::new(MemoryBackend::new());
///
/// // Exclusive, renewed by the watchdog while the guard lives.
/// let guard = locker.lock("orders/42").wait(Duration::from_secs(5)).acquire().await?;
/// guard.release().await?;
///
/// // Readers share; a semaphore admits N holders.
/// let r1 = locker.read_lock("catalog").acquire().await?;
/// let r2 = locker.read_lock("catalog").acquire().await?;
/// let p = locker.semaphore("gpu", 2).acquire().await?;
///
/// // Run a closure under the lock; it is cancelled if the lease is lost.
/// let n = locker.lock("report").run(|lease| async move { lease.token().map(|t| t.get()) }).await?;
/// assert!(n.is_some());
/// # drop((r1, r2, p)); Ok(()) }
/// ```
#[derive(Clone)]
pub struct Locker {
    pub(crate) shared: Arc<Shared>,
}

impl Locker {
    /// A locker on `backend`.
    pub fn new(backend: impl Backend) -> Self {
        Locker::from_arc(Arc::new(backend))
    }

    /// A locker on a shared backend.
    pub fn from_arc(backend: Arc<dyn Backend>) -> Self {
        let ttl = backend
            .default_ttl()
            .filter(|t| *t >= MIN_TTL)
            .unwrap_or(DEFAULT_TTL);
        Locker::with_options(backend, ttl)
    }

    /// A locker whose holds last `default_ttl` unless a builder says otherwise.
    ///
    /// # Panics
    ///
    /// If `default_ttl` is below [`MIN_TTL`] (a programming error).
    pub fn with_options(backend: Arc<dyn Backend>, default_ttl: Duration) -> Self {
        assert!(default_ttl >= MIN_TTL, "default ttl below {MIN_TTL:?}");
        let (tx, rx) = mpsc::unbounded_channel();
        let id = uuid::Uuid::new_v4().simple().to_string();
        Locker {
            shared: Arc::new(Shared {
                backend,
                watchdog: Arc::default(),
                drops: tx,
                worker: Mutex::new(Some(rx)),
                id,
                next_id: AtomicU64::new(1),
                default_ttl,
                lines: Arc::default(),
            }),
        }
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.shared.backend
    }

    /// What the backend can do.
    pub fn capabilities(&self) -> Capabilities {
        self.shared.backend.capabilities()
    }

    /// This locker's random id, the prefix of its default owners.
    pub fn id(&self) -> &str {
        &self.shared.id
    }

    /// The default TTL of this locker's holds.
    pub fn default_ttl(&self) -> Duration {
        self.shared.default_ttl
    }

    /// Asks for an exclusive lock on `key`. The key is validated when the builder
    /// runs, before any I/O.
    pub fn lock(&self, key: impl AsRef<str>) -> LockBuilder {
        LockBuilder::new(self.clone(), key.as_ref(), Mode::Exclusive)
    }

    /// Asks for a shared (read) lock on `key`.
    pub fn read_lock(&self, key: impl AsRef<str>) -> LockBuilder {
        LockBuilder::new(self.clone(), key.as_ref(), Mode::Shared)
    }

    /// Asks for one of `permits` permits of the semaphore `key`.
    ///
    /// A key has one permit count while held: the first holder's `permits`
    /// fixes it until the key is free, and a request with another count fails
    /// at once with [`Error::InvalidConfig`] (on every backend), so no holder
    /// is ever bounded by a count it did not ask for.
    pub fn semaphore(&self, key: impl AsRef<str>, permits: u32) -> LockBuilder {
        LockBuilder::new(self.clone(), key.as_ref(), Mode::Semaphore { permits })
    }

    /// Asks for exclusive locks on several keys, all or nothing.
    pub fn multi_lock<I, K>(&self, keys: I) -> MultiLockBuilder
    where
        I: IntoIterator<Item = K>,
        K: AsRef<str>,
    {
        MultiLockBuilder::new(self.clone(), keys)
    }

    /// Who holds `key` now.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`]; [`Error::Unsupported`] if the backend cannot inspect.
    pub async fn inspect(&self, key: impl AsRef<str>) -> Result<Option<LockInfo>> {
        let key = Key::new(key)?;
        self.shared.backend.inspect(&key).await
    }

    /// Every held key that starts with `prefix`.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] if the backend cannot list.
    pub async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>> {
        self.shared.backend.list(prefix).await
    }

    fn default_owner(&self) -> Owner {
        let n = self.shared.next_id();
        Owner::trusted(format!("{}:{n}", self.shared.id))
    }

    /// Builds the guard for a grant: computes its validity and registers it with
    /// the watchdog unless the lease is fixed.
    pub(crate) fn guard_for(&self, req: &Request, grant: Grant, opts: &LockOptions) -> Guard {
        // One copy, shared by the guard and its watchdog registration.
        let lease_ref = Arc::new(LeaseRef::new(req, &grant));
        let state = Arc::new(LeaseCell::new(LeaseState {
            deadline: validity_deadline(grant.requested_at, grant.ttl),
            lost: None,
            on_expiry: LostReason::Expired,
            backend: self.shared.backend.name(),
        }));
        let watchdog_id = if opts.renew {
            self.shared.ensure_worker();
            let id = self.shared.next_id();
            self.shared.watchdog.register(
                id,
                Registration {
                    lease: lease_ref.clone(),
                    state: state.clone(),
                    next_renew: grant.requested_at + grant.ttl / 3,
                    stop_at: opts.max_hold.map(|m| grant.requested_at + m),
                },
            );
            Some(id)
        } else {
            self.shared.ensure_worker();
            None
        };
        Guard::new(
            self.shared.clone(),
            lease_ref,
            state,
            grant.holds,
            watchdog_id,
        )
    }
}

impl fmt::Debug for Locker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locker")
            .field("backend", &self.shared.backend.name())
            .field("address", &self.shared.backend.address())
            .field("id", &self.shared.id)
            .finish()
    }
}

/// How long to wait for a busy lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    Forever,
    For(Duration),
}

/// The options shared by [`LockBuilder`] and [`MultiLockBuilder`].
#[derive(Debug, Clone)]
pub(crate) struct LockOptions {
    pub(crate) mode: Mode,
    pub(crate) ttl: Option<Duration>,
    pub(crate) renew: bool,
    pub(crate) wait: Wait,
    pub(crate) owner: Option<String>,
    pub(crate) max_hold: Option<Duration>,
}

impl LockOptions {
    pub(crate) fn new(mode: Mode) -> Self {
        LockOptions {
            mode,
            ttl: None,
            renew: true,
            wait: Wait::Forever,
            owner: None,
            max_hold: None,
        }
    }

    /// Validates everything but the key and builds the request for `key`.
    pub(crate) fn request(&self, locker: &Locker, key: Key) -> Result<Request> {
        let ttl = self.ttl.unwrap_or(locker.shared.default_ttl);
        if ttl < MIN_TTL {
            return Err(Error::config(format!(
                "ttl {ttl:?} is too short; use at least {MIN_TTL:?} (a few seconds is typical)"
            )));
        }
        if self.max_hold == Some(Duration::ZERO) {
            return Err(Error::config("max_hold must be positive"));
        }
        self.mode.validate()?;
        // Default owners are unique per guard, so a repeat can only be a retry.
        let (owner, reentrant) = match &self.owner {
            Some(o) => (Owner::new(o)?, true),
            None => (locker.default_owner(), false),
        };
        let caps = locker.capabilities();
        if !caps.supports(self.mode) {
            return Err(Error::unsupported(
                locker.shared.backend.name(),
                format!("{} locks", self.mode),
            ));
        }
        Ok(Request::new(key, owner, self.mode, ttl).with_reentrant(reentrant))
    }

    pub(crate) fn deadline(&self, start: Instant) -> Option<Instant> {
        match self.wait {
            Wait::Forever => None,
            Wait::For(d) => Some(start + d),
        }
    }
}

/// Generates the option setters shared by the single and the multi-key builder.
macro_rules! option_setters {
    () => {
        /// The TTL of the hold; the watchdog renews it at ttl/3 while the guard
        /// lives. Default: the locker's (30 s).
        pub fn ttl(mut self, ttl: std::time::Duration) -> Self {
            self.opts.ttl = Some(ttl);
            self.opts.renew = true;
            self
        }

        /// A fixed lease of `ttl` with no renewal: the hold ends after `ttl` even
        /// if the guard still lives (then `lost()` fires).
        pub fn lease(mut self, ttl: std::time::Duration) -> Self {
            self.opts.ttl = Some(ttl);
            self.opts.renew = false;
            self
        }

        /// Waits up to `wait` for a busy lock, then fails with
        /// [`Error::Timeout`](crate::Error::Timeout). `Duration::ZERO` tries once.
        pub fn wait(mut self, wait: std::time::Duration) -> Self {
            self.opts.wait = crate::locker::Wait::For(wait);
            self
        }

        /// Waits as long as it takes (the default).
        pub fn wait_forever(mut self) -> Self {
            self.opts.wait = crate::locker::Wait::Forever;
            self
        }

        /// Holds as `owner`. The same owner acquiring the same key again is
        /// reentrant (hold count + 1, same token) and must release as often.
        pub fn owner(mut self, owner: impl Into<String>) -> Self {
            self.opts.owner = Some(owner.into());
            self
        }

        /// Stops renewing after `max_hold`; the hold then expires at its TTL and
        /// `lost()` fires with [`LostReason::MaxHold`](crate::LostReason::MaxHold).
        pub fn max_hold(mut self, max_hold: std::time::Duration) -> Self {
            self.opts.max_hold = Some(max_hold);
            self
        }
    };
}
pub(crate) use option_setters;

/// Builds one lock request. Get one from [`Locker::lock`], [`Locker::read_lock`]
/// or [`Locker::semaphore`]; finish with [`acquire`](LockBuilder::acquire),
/// [`try_acquire`](LockBuilder::try_acquire) or [`run`](LockBuilder::run).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_core::{Error, Locker, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock_core::Result<()> {
/// let locker = Locker::new(MemoryBackend::new());
/// let held = locker.lock("k").ttl(Duration::from_secs(10)).acquire().await?;
///
/// // Try once: `None` when busy.
/// assert!(locker.lock("k").try_acquire().await?.is_none());
/// // Wait a bounded time: `Error::Timeout` when still busy.
/// let err = locker.lock("k").wait(Duration::from_millis(20)).acquire().await.unwrap_err();
/// assert!(matches!(err, Error::Timeout { .. }));
/// // Reentrant with an explicit owner.
/// let a = locker.lock("r").owner("me").acquire().await?;
/// let b = locker.lock("r").owner("me").acquire().await?;
/// assert_eq!((a.token(), b.holds()), (b.token(), 2));
/// # drop((held, a, b)); Ok(()) }
/// ```
#[must_use = "a lock builder does nothing until acquire(), try_acquire() or run() is awaited"]
#[derive(Debug)]
pub struct LockBuilder {
    locker: Locker,
    key: Result<Key>,
    opts: LockOptions,
}

impl LockBuilder {
    fn new(locker: Locker, key: &str, mode: Mode) -> Self {
        LockBuilder {
            locker,
            key: Key::new(key),
            opts: LockOptions::new(mode),
        }
    }

    option_setters!();

    fn request(&self) -> Result<Request> {
        let key = self.key.clone()?;
        self.opts.request(&self.locker, key)
    }

    /// Acquires the lock, waiting as configured (forever by default).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`] / [`Error::InvalidConfig`] before any I/O;
    /// [`Error::Unsupported`] for a mode the backend lacks; [`Error::Timeout`] when
    /// the wait ran out; backend errors. A connection error (a server restart,
    /// a network outage) does not end the wait: the acquire asks again, with
    /// backoff from 100 ms to 5 s, as a new default owner, logs a warning
    /// once, and returns the last connection error only when the wait has run
    /// out (at once for a wait of zero). A backend that does not answer
    /// cannot hold the acquire more than a second past its deadline: the
    /// call is then cancelled, and the error says the backend did not answer.
    ///
    /// # Cancel safety
    ///
    /// Cancelling while waiting leaves nothing behind. Cancelling while a grant is
    /// in flight leaves nothing behind on Redis, Redis Cluster and Redlock (the
    /// grant is undone); on other backends it can leave a hold that nobody
    /// renews, which expires after its TTL.
    pub async fn acquire(self) -> Result<Guard> {
        let req = self.request()?;
        acquire_one(&self.locker, &req, &self.opts).await
    }

    /// One attempt: `Ok(None)` if the lock is busy.
    ///
    /// # Errors
    ///
    /// As [`LockBuilder::acquire`], without [`Error::Timeout`].
    ///
    /// # Cancel safety
    ///
    /// As [`LockBuilder::acquire`].
    pub async fn try_acquire(self) -> Result<Option<Guard>> {
        let req = self.request()?;
        let start = Instant::now();
        let result = self.try_once(&req).await;
        let busy = matches!(result, Ok(None));
        let name = self.locker.shared.backend.name();
        crate::telemetry::acquire(
            name,
            crate::telemetry::outcome_of(&result, busy),
            start.elapsed(),
        );
        result
    }

    async fn try_once(&self, first: &Request) -> Result<Option<Guard>> {
        let backend = &self.locker.shared.backend;
        let span = acquire_span(backend.as_ref(), first);
        // A grant lost before it could be handed out (see `freshen`) is
        // tried once more: the key may be free by now.
        let mut anew: Option<Request> = None;
        for _ in 0..2 {
            let req = anew.as_ref().unwrap_or(first);
            let Some(g) = backend.try_acquire(req).instrument(span.clone()).await? else {
                return Ok(None);
            };
            if let Some(g) = freshen(&self.locker, req, g, None).await? {
                log_grant(req, &g, Duration::ZERO);
                return Ok(Some(self.locker.guard_for(req, g, &self.opts)));
            }
            anew = Some(ask_anew(&self.locker, req));
        }
        Ok(None)
    }

    /// Acquires, runs `f` with the hold's [`Lease`], and releases.
    ///
    /// If the lease is lost while `f` runs, `f`'s future is dropped (cancelled)
    /// and the result is [`Error::Lost`].
    ///
    /// # Errors
    ///
    /// As [`LockBuilder::acquire`], plus [`Error::Lost`]. An error of the final
    /// release is returned only if `f` completed.
    ///
    /// # Cancel safety
    ///
    /// Cancelling drops `f`'s future and the guard (which queues a release).
    ///
    /// # Examples
    ///
    /// ```
    /// use fencelock_core::{Locker, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock_core::Result<()> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let sum = locker.lock("sum").run(|_lease| async { 1 + 1 }).await?;
    /// assert_eq!(sum, 2);
    /// # Ok(()) }
    /// ```
    pub async fn run<F, Fut, T>(self, f: F) -> Result<T>
    where
        F: FnOnce(Lease) -> Fut,
        Fut: Future<Output = T>,
    {
        let guard = self.acquire().await?;
        let lease = guard.lease();
        let outcome = tokio::select! {
            err = lease.lost() => Err(err),
            v = f(lease.clone()) => Ok(v),
        };
        match outcome {
            Ok(v) => {
                guard.release().await?;
                Ok(v)
            }
            Err(e) => {
                drop(guard);
                Err(e)
            }
        }
    }
}

pub(crate) fn acquire_span(backend: &dyn Backend, req: &Request) -> tracing::Span {
    tracing::debug_span!(
        "fencelock.acquire",
        key = %req.key,
        backend = backend.name(),
        mode = %req.mode,
    )
}

pub(crate) fn log_grant(req: &Request, grant: &Grant, waited: Duration) {
    tracing::debug!(
        key = %req.key,
        owner = %req.owner,
        token = grant.token.map(|t| t.get()),
        holds = grant.holds,
        wait_ms = waited.as_millis() as u64,
        "acquired"
    );
}

/// Acquires one validated request with the wait of `opts`.
pub(crate) async fn acquire_one(
    locker: &Locker,
    req: &Request,
    opts: &LockOptions,
) -> Result<Guard> {
    let start = Instant::now();
    let name = locker.shared.backend.name();
    let waiting = crate::telemetry::Waiting::new(name);
    let result = acquire_waiting(locker, req, opts, start).await;
    drop(waiting);
    crate::telemetry::acquire(
        name,
        crate::telemetry::outcome_of(&result, false),
        start.elapsed(),
    );
    result
}

async fn acquire_waiting(
    locker: &Locker,
    req: &Request,
    opts: &LockOptions,
    start: Instant,
) -> Result<Guard> {
    let deadline = opts.deadline(start);
    let timeout = || Error::Timeout {
        key: req.key.to_string(),
        waited: start.elapsed(),
    };
    let backend = &locker.shared.backend;
    let span = acquire_span(backend.as_ref(), req);
    // Exclusive requests of default owners line up behind this locker's other
    // waiters for the key, and the head accepts handoffs (see `line`).
    let lined = req.mode == Mode::Exclusive && opts.owner.is_none();
    let first = req;
    let mut anew: Option<Request> = None;
    let mut outage = Outage::default();
    loop {
        let req = anew.as_ref().unwrap_or(first);
        let call = async {
            if lined {
                acquire_in_line(&locker.shared.lines, backend, req, deadline, &span).await
            } else {
                backend
                    .acquire(req, deadline)
                    .instrument(span.clone())
                    .await
                    .map(|g| (g, None))
            }
        };
        // A backend that does not answer (a frozen server) cannot hold the
        // waiter past its deadline: the call is dropped (cancelled) then.
        let asked = match deadline {
            None => call.await,
            Some(d) => timeout_at(d + OVERRUN, call).await.unwrap_or_else(|| {
                Err(Error::connection(
                    backend.name(),
                    &backend.address(),
                    outage.unanswered(),
                ))
            }),
        };
        let (grant, line_hold) = match asked {
            Ok(asked) => asked,
            Err(e) if outage.wait(backend.name(), req, &e, deadline).await => {
                anew = Some(ask_anew(locker, req));
                continue;
            }
            Err(e) => return Err(e),
        };
        let Some(grant) = grant else {
            return Err(timeout());
        };
        let fresh = match freshen(locker, req, grant, deadline).await {
            Ok(fresh) => fresh,
            Err(e) if outage.wait(backend.name(), req, &e, deadline).await => {
                anew = Some(ask_anew(locker, req));
                continue;
            }
            Err(e) => return Err(e),
        };
        outage.over();
        match fresh {
            Some(grant) => {
                log_grant(req, &grant, start.elapsed());
                let mut guard = locker.guard_for(req, grant, opts);
                guard.set_line_hold(line_hold);
                return Ok(guard);
            }
            // Lost before it was handed out: wait on, in line again.
            None => {
                drop(line_hold);
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(timeout());
                }
                anew = Some(ask_anew(locker, req));
            }
        }
    }
}

/// How long past its deadline an acquire waits for the backend's answer
/// before it gives up on it.
const OVERRUN: Duration = Duration::from_secs(1);

/// A waiter's view of a backend that does not answer (a restart, a network
/// outage): it waits on until its deadline, asking again with backoff, and
/// says so once.
#[derive(Default)]
struct Outage {
    backoff: Option<Backoff>,
    /// What the backend last said instead of an answer, if anything.
    last: Option<String>,
}

impl Outage {
    /// After `e`: `true` if the waiter should ask again (then it has slept),
    /// `false` if `e` is to be returned (not a connection error, or the
    /// deadline has passed).
    async fn wait(
        &mut self,
        backend: &str,
        req: &Request,
        e: &Error,
        deadline: Option<Instant>,
    ) -> bool {
        if !e.is_transient() || deadline.is_some_and(|d| Instant::now() >= d) {
            return false;
        }
        self.last = Some(match e {
            Error::Connection { message, .. } => message.clone(),
            other => other.to_string(),
        });
        let backoff = self.backoff.get_or_insert_with(|| {
            tracing::warn!(
                key = %req.key,
                backend,
                error = %e,
                "the backend does not answer; waiting on{}",
                if deadline.is_some() { " until the wait ends" } else { "" }
            );
            Backoff::new(Duration::from_millis(100), Duration::from_secs(5))
        });
        backoff.sleep(deadline, None).await;
        true
    }

    /// The backend answered.
    fn over(&mut self) {
        self.last = None;
        if self.backoff.take().is_some() {
            tracing::debug!("the backend answers again");
        }
    }

    /// Why a call cut off at the end of the wait failed: with what the
    /// backend said before, which is likelier the cause (a refused
    /// connection, a pool kept busy).
    fn unanswered(&self) -> String {
        match &self.last {
            Some(last) => format!("no answer by the end of the wait; before that: {last}"),
            None => "no answer by the end of the wait".to_string(),
        }
    }
}

/// The request to ask with after `freshen` gave a grant of `req` up. That
/// hold may live on until its background release runs (its renewal may have
/// reached the backend): a repeat of the same request would take it up again,
/// and that release would then free the lock under the new guard. A default
/// owner is per guard: ask as a new one. (An explicit owner's request is
/// reentrant: it adds a hold, which that release takes away again.)
fn ask_anew(locker: &Locker, req: &Request) -> Request {
    let mut next = req.clone();
    if !req.reentrant {
        next.owner = locker.default_owner();
    }
    next
}

/// A grant that arrives with less than half its TTL of validity left — its
/// request waited long in the server (behind another client's transaction on
/// the key) or its reply was slow — counts its lease from when the request
/// was sent, so it could be handed out already invalid. It is renewed first:
/// then its lease counts from the renewal's start. Returns `None` if the
/// renewal finds the hold gone (it expired meanwhile) or does not answer by
/// `wait_deadline` or within a TTL; then nothing is held (what may be left
/// is released in the background).
///
/// # Errors
///
/// The renewal's error; the hold is then released in the background.
///
/// # Cancel safety
///
/// Cancelled during the renewal, the hold is released in the background.
async fn freshen(
    locker: &Locker,
    req: &Request,
    mut grant: Grant,
    wait_deadline: Option<Instant>,
) -> Result<Option<Grant>> {
    let now = Instant::now();
    let deadline = validity_deadline(grant.requested_at, grant.ttl);
    if deadline.saturating_duration_since(now) >= grant.ttl / 2 {
        return Ok(Some(grant));
    }
    // The worker that performs queued releases.
    locker.shared.ensure_worker();
    let mut pending = ReleaseOnDrop {
        locker,
        lease: Some(LeaseRef::new(req, &grant)),
    };
    let lease = pending.lease.clone().into_iter().collect::<Vec<_>>();
    // The renewal may queue behind the very transaction that made the grant
    // late: it gets until the acquire's deadline, and at most a TTL. Given
    // up, the hold is released in the background and the grant counts as
    // lost.
    let limit = wait_deadline.map_or(now + grant.ttl, |d| d.min(now + grant.ttl));
    let Some(renewed) = timeout_at(limit, locker.shared.backend.renew(&lease)).await else {
        tracing::debug!(key = %req.key, "a late grant's renewal did not answer in time");
        return Ok(None);
    };
    let renewed = renewed?;
    pending.lease = None;
    match renewed.into_iter().next() {
        Some(Renewal::Held { ttl }) => {
            tracing::debug!(
                key = %req.key,
                late_ms = (now - grant.requested_at).as_millis() as u64,
                "a late grant was renewed before it was handed out"
            );
            grant.requested_at = now;
            grant.ttl = ttl;
            Ok(Some(grant))
        }
        Some(Renewal::Lost { reason }) => {
            tracing::debug!(key = %req.key, %reason, "a late grant was lost before it was handed out");
            Ok(None)
        }
        // Nothing learned: the guard tells how long it is valid.
        _ => Ok(Some(grant)),
    }
}

/// Queues the release of a hold not yet handed out, unless disarmed
/// (`lease` taken).
struct ReleaseOnDrop<'a> {
    locker: &'a Locker,
    lease: Option<LeaseRef>,
}

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            let _ = self
                .locker
                .shared
                .drops
                .send(DropRelease(lease, Ticket::new()));
        }
    }
}
