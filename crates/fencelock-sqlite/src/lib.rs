//! The embedded default backend of fencelock: locks in a SQLite file, shared by
//! every process on the machine that opens the same file.
//!
//! # Design
//!
//! - Two tables, created on first use: `fencelock_locks(key, fence)` keeps each
//!   key's fence counter forever (so tokens keep rising across releases), and
//!   `fencelock_holders(key, owner, mode, holds, token, expires_at, acquired_at)`
//!   has one row per holder.
//! - Every change is one `BEGIN IMMEDIATE` transaction (the write lock is taken
//!   up front, so two processes cannot both read "free" and both insert); reads
//!   for inspection and for polling waiters are plain WAL reads that never block
//!   the writer.
//! - Expiry follows the machine's wall clock stored in the row (`expires_at`, Unix
//!   milliseconds). A backwards or forwards jump of the wall clock shortens or
//!   lengthens live leases by as much; the fencing token still protects writes.
//! - Waiters in the same process are woken by the release; waiters in other
//!   processes poll with jittered backoff (1–50 ms) using a read-only check, and
//!   wake at the holder's expiry.
//! - Durability: `synchronous=NORMAL` in WAL mode survives process crashes; a power
//!   loss may forget the last transactions, fence increments included. Use
//!   `?synchronous=full` where tokens must survive power loss.
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
//! assert_eq!(guard.token().map(|t| t.get()), Some(1));
//! guard.release().await?;
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

mod options;
mod store;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock_core::{
    Backend, Backoff, Capabilities, Error, Grant, Key, LeaseRef, LockInfo, Released, Renewal,
    Request, Result, async_trait,
};
use rusqlite::Connection;
use tokio::sync::Notify;
use tokio::time::Instant;

pub use options::{SqliteOptions, Synchronous};

const NAME: &str = "sqlite";

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
    conn: Mutex<Connection>,
    /// Wakes waiters of this process when a hold is released here.
    released: Notify,
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
        let conn = tokio::task::spawn_blocking(move || store::open(&p, &options))
            .await
            .map_err(|e| Error::backend(NAME, format!("open task failed: {e}")))??;
        Ok(SqliteBackend {
            inner: Arc::new(Inner {
                path,
                busy_timeout,
                conn: Mutex::new(conn),
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
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || {
            let mut conn = inner.conn.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut conn)
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
        let r = req.clone();
        let busy = self.inner.busy_timeout;
        let granted = self
            .with_conn(move |c| store::try_acquire(c, &r, busy))
            .await?;
        // Valid from the transaction that set the expiry, not from the call:
        // another process may have kept the file's write lock meanwhile.
        Ok(granted.map(|(token, holds, began)| Grant::new(Some(token), req.ttl, holds, began)))
    }

    async fn acquire(&self, req: &Request, deadline: Option<Instant>) -> Result<Option<Grant>> {
        let mut backoff = Backoff::new(Duration::from_millis(1), Duration::from_millis(50));
        loop {
            let released = self.inner.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            if let Some(grant) = self.try_acquire(req).await? {
                return Ok(Some(grant));
            }
            // Poll with cheap reads until the lock looks free, then try again.
            loop {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Ok(None);
                }
                let r = req.clone();
                let busy_for = self.with_conn(move |c| store::busy_for(c, &r)).await?;
                let Some(left) = busy_for else { break };
                tokio::select! {
                    _ = &mut released => {
                        backoff.reset();
                        break;
                    }
                    _ = backoff.sleep(deadline, Some(left)) => {}
                }
            }
        }
    }

    async fn renew(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
        let leases = leases.to_vec();
        let busy = self.inner.busy_timeout;
        self.with_conn(move |c| store::renew(c, &leases, busy))
            .await
    }

    async fn release(&self, lease: &LeaseRef) -> Result<Released> {
        let l = lease.clone();
        let busy = self.inner.busy_timeout;
        let (released, _) = self
            .with_conn(move |c| store::release(c, &l, None, busy))
            .await?;
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
        let (released, handed) = self
            .with_conn(move |c| store::release(c, &l, Some(&n), busy))
            .await?;
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
