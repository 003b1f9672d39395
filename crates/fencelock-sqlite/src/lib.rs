//! The embedded default backend of fencelock: locks in a SQLite file, shared by
//! every process on the machine that opens the same file.
//!
//! # Design
//!
//! - Tables, created on first use: `fencelock_locks(key, fence)` keeps each
//!   key's last token forever, `fencelock_holders(key, owner, mode, holds,
//!   token, expires_at, acquired_at)` has one row per holder, and
//!   `fencelock_meta` names the clock the expiry times are on.
//! - Every change is one `BEGIN IMMEDIATE` transaction (the write lock is taken
//!   up front, so two processes cannot both read "free" and both insert); reads
//!   for inspection and for polling waiters are plain WAL reads that never block
//!   the writer. An acquire or renewal waits at most a third of its TTL for the
//!   write lock (`busy_timeout`, default 5 s, caps it); a busy file is "not
//!   now" for an acquire, which tries again until its deadline, and a grant's
//!   lease counts from its transaction.
//! - Expiry is kept on the machine's boot-time clock (Linux `CLOCK_BOOTTIME`),
//!   not the wall clock: a step of the wall clock (NTP, an operator) neither
//!   frees a live hold nor keeps a dead one. The file records the boot's id;
//!   holder rows of another boot belong to processes that are gone and are
//!   deleted. (Elsewhere than Linux the wall clock is used, and its steps
//!   shorten or lengthen leases by as much.)
//! - Tokens: `max(the key's last token + 1, the wall clock in µs)`, so a file
//!   recreated or restored from an older copy never hands out a token again,
//!   as long as the wall clock does not step back across that.
//! - Each operation checks that the file, its `-wal` and its `-shm` are still
//!   the ones it opened (device and inode) and that the file has one name: a
//!   file deleted, replaced or hard-linked while in use is opened anew, and
//!   the holds in the old one are lost (their renewal says so).
//! - Waiters in the same process are woken by the release; waiters in other
//!   processes poll with jittered backoff (1–50 ms) using a read-only check, and
//!   wake at the holder's expiry.
//! - Durability: `synchronous=NORMAL` in WAL mode survives process crashes; a power
//!   loss may forget the last transactions, fence increments included (the
//!   clock floor still keeps tokens rising). Use `?synchronous=full` where
//!   grants must survive power loss.
//!
//! # What an operator must never do with the file
//!
//! Exclusion holds among the processes of one machine that open the same
//! file, on a local filesystem (WAL needs shared memory: never a network
//! filesystem), while nobody touches the file. So never, while any process
//! uses it:
//!
//! - delete, move or replace the file (or its `-wal` / `-shm`), or restore an
//!   older copy: the holders learn it at their next renewal (within ttl/3),
//!   but until then a newcomer on the new file can hold the lock beside them
//!   (its token is larger, so fenced writes stay safe);
//! - give it a second name (a hard link, or a bind mount of the file itself,
//!   as `docker -v file:file` makes): it is refused while it has one (a bind
//!   mount on the side where the file is the mount point) — mount the
//!   directory instead;
//! - let processes of different fencelock versions share it (0.1 files are
//!   moved onto the boot-time clock when a new version opens them).
//!
//! A symlink to the file is fine: SQLite follows it to the one real file, and
//! the checks watch the real file's `-wal` and `-shm`. Expiry counts on the
//! machine's boot-time clock also inside a time namespace (its offset is taken
//! off); on Linux the backend needs `/proc` (the boot's id) and refuses to open
//! without it.
//!
//! # Defaults, restarts and frozen clients
//!
//! - A hold gets the TTL asked for (30 s by default); renewals rewrite it.
//! - No server to restart. A holder frozen (SIGSTOP, a paused VM) keeps the key
//!   for its TTL, then loses it and learns so on resume
//!   (`tests/cross_process.rs::sigstopped_holder_loses_the_lock_and_learns_it_on_resume`).
//! - A process stopped *inside* its short write transaction keeps the file's
//!   write lock until it resumes: other processes' acquires wait, within their
//!   wait, and say why on stderr; their renewals cannot write, so their holds are
//!   lost at their deadline (a known limit; the CLI's `tests/outage.rs`).
//!
//! # Examples
//!
//! ```
//! use fencelock_core::Locker;
//! use fencelock_sqlite::SqliteBackend;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock_core::Result<()> {
//! let dir = tempfile::tempdir().unwrap();
//! let backend = SqliteBackend::open(dir.path().join("locks.db")).await?;
//! let locker = Locker::new(backend);
//! let guard = locker.lock("nightly-report").acquire().await?;
//! let token = guard.token().expect("SQLite gives fencing tokens");
//! // Tokens rise with every grant of the key, floored at the wall clock in µs.
//! assert!(token.get() > 1_600_000_000_000_000);
//! guard.release().await?;
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

mod options;
mod store;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock_core::backend::{
    Backoff, Grant, LeaseRef, Released, Renewal, Request, TryOutcome, async_trait, wait_for_grant,
};
use fencelock_core::{Backend, Capabilities, Error, Key, LockInfo, Result};
use rusqlite::Connection;
use tokio::sync::Notify;
use tokio::time::Instant;

pub use options::{SqliteOptions, Synchronous};

const NAME: &str = "sqlite";

/// How the `fencelock` facade opens this backend from a URL.
pub const DRIVER: fencelock_core::backend::Driver =
    fencelock_core::driver!(NAME, ["sqlite"], SqliteBackend::connect);

/// Locks in a SQLite file (`sqlite://PATH`). Clones share one connection.
#[derive(Clone)]
pub struct SqliteBackend {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    /// The longest an operation waits for the file's write lock (an acquire or
    /// a renewal at most a third of its TTL).
    busy_timeout: Duration,
    /// To open the file anew when it was replaced.
    options: SqliteOptions,
    conn: Mutex<File>,
    /// Wakes waiters of this process when a hold is released here.
    released: Notify,
}

/// The open lock file.
struct File {
    conn: Connection,
    id: store::Identity,
}

/// Whether the lock file an operation ran on is the one at the path.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Current {
    /// The file this backend had open, still at the path throughout.
    Yes,
    /// It was deleted, replaced or given a second name (why): what this
    /// backend held in it is worth nothing now.
    No(String),
}

impl Current {
    /// `NotHeld` for a release of a hold that was in a file replaced since.
    fn check_release(self, lease: &LeaseRef) -> Result<()> {
        match self {
            Current::Yes => Ok(()),
            Current::No(why) => Err(Error::NotHeld {
                key: format!("{} ({why})", lease.key),
                owner: lease.owner.to_string(),
            }),
        }
    }
}

impl SqliteBackend {
    /// Opens (creating if needed) the lock file at `path` with default options.
    ///
    /// # Errors
    ///
    /// [`Error::Connection`] if the file cannot be opened or its schema created.
    pub async fn open(path: impl AsRef<Path>) -> Result<SqliteBackend> {
        SqliteBackend::open_with(path, SqliteOptions::default()).await
    }

    /// Opens the lock file at `path` with `options`.
    ///
    /// # Errors
    ///
    /// [`Error::Connection`] if the file cannot be opened or its schema created.
    pub async fn open_with(
        path: impl AsRef<Path>,
        options: SqliteOptions,
    ) -> Result<SqliteBackend> {
        let path = path.as_ref().to_path_buf();
        let p = path.clone();
        let busy_timeout = options.busy_timeout;
        let o = options.clone();
        let (conn, id) = tokio::task::spawn_blocking(move || store::open(&p, &o))
            .await
            .map_err(|e| Error::backend(NAME, format!("open task failed: {e}")))??;
        Ok(SqliteBackend {
            inner: Arc::new(Inner {
                path,
                busy_timeout,
                options,
                conn: Mutex::new(File { conn, id }),
                released: Notify::new(),
            }),
        })
    }

    /// Opens the backend a `sqlite://PATH[?options]` URL names; an empty path
    /// means [`default_path`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a bad URL or option; [`Error::Connection`] if
    /// the file cannot be opened.
    pub async fn connect(url: &str) -> Result<SqliteBackend> {
        let (path, options) = options::parse_url(url)?;
        SqliteBackend::open_with(path.unwrap_or_else(default_path), options).await
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Removes every holder of `key` at once (an operator breaking a lock; the
    /// testkit's "stolen lease"). The fence counter stays.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub async fn force_release(&self, key: &Key) -> Result<()> {
        let key = key.clone();
        self.with_conn(move |c| store::force_release(c, &key))
            .await?;
        self.inner.released.notify_waiters();
        Ok(())
    }

    async fn with_conn<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    {
        self.on_file(true, |c, _| f(c)).await.map(|(t, _)| t)
    }

    /// [`Backend::try_acquire`] waiting at most `busy` for another
    /// process's write to the file.
    async fn try_within(&self, req: &Request, busy: Duration) -> Result<Option<Grant>> {
        let r = req.clone();
        let (granted, current) = self
            .on_file(true, move |c, _| store::try_acquire(c, &r, busy))
            .await?;
        // A grant in a file that was replaced meanwhile is worth nothing.
        let granted = granted.filter(|_| current == Current::Yes);
        // Valid from the transaction that set the expiry, not from the call:
        // another process may have kept the file's write lock meanwhile.
        Ok(granted.map(|(token, holds, began)| Grant::new(Some(token), req.ttl, holds, began)))
    }

    /// Runs `f` on the lock file at the path, and says whether that file was
    /// this backend's throughout: one deleted, replaced or given a second name
    /// since it was opened is opened anew first if `reopen` (the holds in the
    /// old one are gone; `f` is told so: `true`), and one that changed while
    /// `f` ran makes `f`'s result stale.
    async fn on_file<T, F>(&self, reopen: bool, f: F) -> Result<(T, Current)>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection, bool) -> Result<T> + Send + 'static,
    {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || {
            let mut file = inner.conn.lock().unwrap_or_else(|p| p.into_inner());
            let mut current = Current::Yes;
            if let Err(why) = file.id.check() {
                if reopen {
                    let (conn, id) = store::open(&inner.path, &inner.options)?;
                    *file = File { conn, id };
                }
                current = Current::No(why);
            }
            let out = f(&mut file.conn, current != Current::Yes)?;
            if current == Current::Yes
                && let Err(why) = file.id.check()
            {
                current = Current::No(why);
            }
            Ok((out, current))
        })
        .await
        .map_err(|e| Error::backend(NAME, format!("database task failed: {e}")))?
    }
}

/// The lock file used when no path is given: `fencelock.sqlite3` in the system's
/// temporary directory, shared by every process of the machine.
pub fn default_path() -> PathBuf {
    std::env::temp_dir().join("fencelock.sqlite3")
}

#[async_trait]
impl Backend for SqliteBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::NONE
            .with_fencing(true)
            .with_shared(true)
            .with_semaphore(true)
            .with_reentrant(true)
            .with_ttl(true)
            .with_inspect(true)
            .with_cross_process(true)
    }

    fn address(&self) -> String {
        format!("sqlite://{}", self.inner.path.display())
    }

    async fn try_acquire(&self, req: &Request) -> Result<Option<Grant>> {
        self.try_within(req, self.inner.busy_timeout).await
    }

    async fn acquire(&self, req: &Request, deadline: Option<Instant>) -> Result<Option<Grant>> {
        let backoff = Backoff::new(Duration::from_millis(1), Duration::from_millis(50));
        wait_for_grant(
            deadline,
            backoff,
            Some(&self.inner.released),
            |fresh| async move {
                // After a timed wait, a cheap read first: write only once the lock
                // looks free.
                if !fresh {
                    let r = req.clone();
                    if let Some(left) = self.with_conn(move |c| store::busy_for(c, &r)).await? {
                        return Ok(TryOutcome::Busy {
                            retry_in: Some(left),
                        });
                    }
                }
                // Another process's write may keep the file busy: wait for
                // it no longer than the wait has left.
                let busy = match deadline {
                    Some(d) => self
                        .inner
                        .busy_timeout
                        .min(d.saturating_duration_since(Instant::now()))
                        .max(Duration::from_millis(1)),
                    None => self.inner.busy_timeout,
                };
                Ok(TryOutcome::from_try(self.try_within(req, busy).await?))
            },
        )
        .await
    }

    async fn renew(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
        let n = leases.len();
        let leases = leases.to_vec();
        let busy = self.inner.busy_timeout;
        // A renewal in a file that is not (or no longer) the one at the path
        // renews nothing another process sees.
        match self
            // Not reopened here: a file with a second name cannot be, and
            // its holds are lost either way.
            .on_file(false, move |c, reopened| {
                if reopened {
                    Ok(Vec::new())
                } else {
                    store::renew(c, &leases, busy)
                }
            })
            .await?
        {
            (renewals, Current::Yes) => Ok(renewals),
            (_, Current::No(why)) => Ok(vec![Renewal::Lost { reason: why }; n]),
        }
    }

    async fn release(&self, lease: &LeaseRef) -> Result<Released> {
        let l = lease.clone();
        let busy = self.inner.busy_timeout;
        let ((released, _), current) = self
            .on_file(true, move |c, reopened| {
                if reopened {
                    Ok((Released::new(0), None))
                } else {
                    store::release(c, &l, None, busy)
                }
            })
            .await?;
        current.check_release(lease)?;
        if released.remaining == 0 {
            self.inner.released.notify_waiters();
        }
        Ok(released)
    }

    async fn release_to(
        &self,
        lease: &LeaseRef,
        next: &Request,
    ) -> Result<(Released, Option<Grant>)> {
        let (l, n) = (lease.clone(), next.clone());
        let busy = self.inner.busy_timeout;
        let ((released, handed), current) = self
            .on_file(true, move |c, reopened| {
                if reopened {
                    Ok((Released::new(0), None))
                } else {
                    store::release(c, &l, Some(&n), busy)
                }
            })
            .await?;
        current.check_release(lease)?;
        let grant =
            handed.map(|(token, holds, began)| Grant::new(Some(token), next.ttl, holds, began));
        if released.remaining == 0 && grant.is_none() {
            self.inner.released.notify_waiters();
        }
        Ok((released, grant))
    }

    async fn inspect(&self, key: &Key) -> Result<Option<LockInfo>> {
        let key = key.clone();
        self.with_conn(move |c| store::inspect(c, &key)).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>> {
        let prefix = prefix.to_string();
        self.with_conn(move |c| store::list(c, &prefix)).await
    }
}

impl std::fmt::Debug for SqliteBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteBackend")
            .field("path", &self.inner.path)
            .finish()
    }
}
