//! MySQL/MariaDB backend of fencelock, in two modes.
//!
//! # Modes
//!
//! - **lease** (`mysql://…`, `?mode=lease`, the default): each holder is a row
//!   of `fencelock_locks` whose `expires_at` follows the server's clock
//!   (`NOW(6)`); a per-key fence row survives release, so tokens keep rising.
//!   An acquire is one short transaction serialized by the key's fence row;
//!   release is one statement; the watchdog renews every lease of a tick in one
//!   transaction. All modes; reentrancy. On MariaDB, exclusive waiters of
//!   every process stand in a line per key (a `GET_LOCK` turnstile the server
//!   keeps in order): a free lock goes to the waiter at its head, so a
//!   releaser cannot take it straight back, and a release interrupts the
//!   head's sleep in the server (`KILL QUERY`), so it asks at once
//!   (`turnstile.rs`). Shared and semaphore waiters, and every waiter on
//!   MySQL, poll with jittered backoff (2–100 ms), woken at once by releases
//!   in the same process and never later than the holder's expiry.
//! - **get_lock** (`?mode=get_lock`): `GET_LOCK` on a session held for the
//!   guard's life; waiters wait in the server with `GET_LOCK`'s timeout. The
//!   session ending fires `lost()`: a server restart or crash at once (a
//!   session of the backend's own waits in `SLEEP` and, when the server ends
//!   it, every hold's session is pinged), `KILL` or a network loss at the next
//!   renewal (see the limits below); the session's `wait_timeout` is the TTL (whole seconds), so a
//!   paused holder loses the lock too. Exclusive and semaphore modes (no
//!   shared form). Keys of at most 64 characters are the lock names
//!   themselves, so other programs' `GET_LOCK('key')` and fencelock exclude
//!   each other.
//!
//! # What is guaranteed, and under which assumptions
//!
//! - **lease**: exclusion while a guard is valid, provided the server's clock
//!   does not jump forward and runs within the drift allowance of the client's
//!   monotonic clock, and provided a committed grant survives a crash: with
//!   InnoDB's `innodb_flush_log_at_trx_commit=1` (the default). With 0 or 2 a
//!   crash can lose the last second of grants and renewals (the holders learn
//!   it at their next renewal; meanwhile another owner can be granted).
//! - **get_lock**: tokens are `max(the key's last token + 1, the server's clock
//!   in µs)`; they strictly increase per key across restarts and crashes, at
//!   any durability setting, as long as the server's clock does not step back
//!   across a restart. Sessions use REPEATABLE READ (the one-statement try
//!   relies on its gap lock) and UTC, whatever the server's defaults.
//! - **lease**, a client frozen inside a transaction (a paused VM, a link gone
//!   silent without a FIN): its row locks last until the server ends its
//!   session — on MariaDB 2 s after the transaction went idle
//!   (`idle_transaction_timeout` of fencelock's sessions), on MySQL, which
//!   has no such setting, `wait_timeout` (8 h by default: lower it, or use
//!   MariaDB). Meanwhile no acquire waits past its deadline: a statement
//!   gives up on a row lock after 2 s (`innodb_lock_wait_timeout` of
//!   fencelock's sessions) and the key counts as busy
//!   (`tests/frozen_client.rs`).
//! - **get_lock** exclusion holds while the holder's session lives. A server
//!   restart or crash ends every session, and with them every lock, at once;
//!   a holder cut off from the server cannot hear of it. So after a restart
//!   no session grants anything until the server has been up (`Uptime`, a
//!   count of wall-clock seconds that can read one too many, so less one) for
//!   the longest TTL a `get_lock` hold had in the database under an earlier
//!   server start (recorded per start in the InnoDB table
//!   `fencelock_restart_gate` before the first grant of each longer TTL;
//!   durable with `innodb_flush_log_at_trx_commit=1`, and `sync_binlog=1` if
//!   the binary log is on; a start is known by the row of the MEMORY table
//!   `fencelock_boot`, which a restart empties): every hold from before the
//!   restart has lost its validity by then, as long as the server's clock
//!   does not step forward meanwhile. Holds granted since the start never
//!   close the gate. A waiter at a closed gate waits, without a session, as
//!   long as its wait allows, and logs a warning once that says when the
//!   gate opens. An operator who knows every holder from before a restart is
//!   dead may delete the rows of `fencelock_restart_gate` and of
//!   `fencelock_session_ttl`. Earlier versions kept one longest TTL in
//!   `fencelock_session_ttl`; it is read when a start is first seen, for
//!   their holds (so every restart waits for it until its row is deleted),
//!   and this version does not write it: stop the get_lock clients of
//!   earlier versions before the first of this version. Rows of earlier
//!   starts are forgotten once their holds are over — only those whose start
//!   (by `Uptime`) came before this one, so emptying `fencelock_boot` without
//!   a restart forgets nothing. Known limit: a promoted replica carries its
//!   source's `fencelock_boot` row, so the gate does not close for a
//!   failover. The record is per database while `GET_LOCK` names are per server:
//!   every fencelock client of one server must use one database in get_lock
//!   mode, or the gate of one can open before a hold of another has lapsed.
//!   Known limit: when the server ends one session while it keeps
//!   running (`KILL`, a connection the network reset), that lock is free at
//!   once, and its holder learns it at its next renewal (within ttl/3), or —
//!   if it is cut off — at its deadline (up to a TTL): another client can be
//!   granted meanwhile. Fencing tokens still reject the old holder's writes;
//!   lease mode has no such gap.
//! - A grant after a wait in `GET_LOCK` counts its lease from a round trip
//!   after the wait, so it is valid on arrival however long it waited.
//! - **lease**, the line (MariaDB): it orders exclusive waiters and never
//!   grants anything itself — every grant is the lease transaction's, so
//!   exclusion does not depend on it. A head that stops asking (its process
//!   paused, its host dead or cut off) keeps other exclusive requests from a
//!   free lock until the server ends its idle session, after 2 s
//!   (`wait_timeout` of the line's sessions); one whose process dies on a
//!   host that stays up leaves at once. The release that rings the head must
//!   be allowed to `KILL QUERY` its session (the same user, or `CONNECTION
//!   ADMIN`); otherwise the head notices within its sleep, at most 100 ms.
//!   At most `pool` waiters of a process stand in line at once, each on a
//!   connection of its own (usually up to twice `pool` connections with the
//!   pool's, briefly more after a seat fails or is cancelled); while all its
//!   places are taken, its other waiters poll, as before the line.
//!
//! The schema is created on first use (idempotently). `mariadb://` is accepted
//! as a synonym of `mysql://`.
//!
//! # Defaults, restarts and frozen clients
//!
//! - A hold gets the TTL asked for (30 s by default; `get_lock`: in whole seconds
//!   of `wait_timeout`).
//! - Lease mode: holds survive a restart (InnoDB with
//!   `innodb_flush_log_at_trx_commit=1`;
//!   `tests/faults.rs::a_lease_outlives_a_restart_shorter_than_its_ttl`).
//!   `get_lock`: a restart ends every hold (`lost()` fires), and nothing is
//!   granted until the server has been up for the longest TTL of the holds
//!   granted before it (`tests/restart_gate.rs`). A waiter waits through a restart
//!   (`tests/outage.rs`).
//! - A frozen holder keeps the key for its TTL (`tests/faults.rs`). A client
//!   frozen inside a transaction keeps its row locks 2 s on MariaDB
//!   (`idle_transaction_timeout`), `wait_timeout` on MySQL; no acquire waits past
//!   its deadline behind them (`tests/frozen_client.rs`). A silent server holds a
//!   waiter at most a second past its wait, and a connect for `connect_timeout=`
//!   (10 s) (`tests/faults.rs::a_stalled_server_cannot_hold_a_lease_waiter_past_its_wait`).
//!
//! # Examples
//!
//! ```
//! use fencelock_core::Locker;
//! use fencelock_mysql::MySqlBackend;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock_core::Result<()> {
//! let locker = Locker::new(MySqlBackend::connect("mysql://root@127.0.0.1:3306/test").await?);
//! let guard = locker.lock("doc-example/nightly-report").acquire().await?;
//! assert!(guard.token().is_some());
//! guard.release().await?;
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

mod db;
mod get_lock;
mod lease;
mod modes;
mod options;
mod turnstile;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use fencelock_core::{Backend, Error, Key, Result};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use tokio::sync::Notify;

pub use options::{MyMode, MyOptions};

use crate::db::Db;
use crate::get_lock::GetLock;
use crate::modes::{GetLocks, LeaseTable};
use crate::turnstile::Turnstile;

const NAME: &str = "mysql";

/// How the `fencelock` facade opens this backend from a URL.
pub const DRIVER: fencelock_core::backend::Driver =
    fencelock_core::driver!(NAME, ["mysql", "mariadb"], MySqlBackend::connect);

/// Locks in MySQL or MariaDB (`mysql://user:password@host:port/db[?mode=lease|get_lock]`).
/// Clones share the pool and the held sessions.
///
/// Each mode is a backend of its own (`modes::LeaseTable`, `modes::GetLocks`);
/// `connect` picks one by `?mode=` and this type hands every call to it.
#[derive(Clone)]
pub struct MySqlBackend {
    inner: Arc<Inner>,
}

struct Inner {
    db: Db,
    options: MyOptions,
    mode: Arc<dyn Backend>,
    /// Wakes this process's lease-mode waiters when a hold is released here.
    released: Arc<Notify>,
}

impl MySqlBackend {
    /// Connects to the database a `mysql://` URL names and creates the schema
    /// if needed.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a bad URL or option; [`Error::Connection`] if
    /// the server cannot be reached, refuses the login or does not answer
    /// within `connect_timeout=`.
    pub async fn connect(url: &str) -> Result<MySqlBackend> {
        let (driver_url, options) = options::parse_url(url)?;
        let limit = options.connect_timeout;
        // Nothing below bounds a connect to a server that accepts and then
        // says nothing (a frozen VM): this does. Dropping it closes what it
        // opened.
        tokio::time::timeout(limit, Self::open(url, &driver_url, options))
            .await
            .map_err(|_| {
                Error::connection(
                    NAME,
                    url,
                    format!(
                        "no answer within {} (connect_timeout=)",
                        humantime::format_duration(limit)
                    ),
                )
            })?
    }

    async fn open(url: &str, driver_url: &str, options: MyOptions) -> Result<MySqlBackend> {
        let connect = MySqlConnectOptions::from_str(driver_url)
            .map_err(|e| Error::config(format!("mysql URL: {e}")))?;
        // One connection first: a pool that cannot connect says only that it
        // timed out; the connection says why (refused, a bad password).
        let first = <sqlx::MySqlConnection as sqlx::Connection>::connect_with(&connect)
            .await
            .map_err(|e| db::map_err(&fencelock_core::backend::redact_url(url), e))?;
        let _ = sqlx::Connection::close(first).await;
        let pool = MySqlPoolOptions::new()
            .max_connections(options.pool)
            .acquire_timeout(Duration::from_secs(10))
            // A broken connection shows as an error of the statement itself; a
            // ping before each would double the round trips.
            .test_before_acquire(false)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    // Row locks only, no gap locks: acquires of different keys
                    // do not block each other.
                    sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                        .execute(&mut *conn)
                        .await?;
                    // A transaction's row locks are held for milliseconds by a
                    // live client: a statement that waits longer for one gives
                    // up (the key counts as busy) rather than hold its caller
                    // past its deadline.
                    sqlx::query("SET SESSION innodb_lock_wait_timeout = 2")
                        .execute(&mut *conn)
                        .await?;
                    // A client frozen inside a transaction (a paused VM)
                    // keeps its row locks until the server ends its session:
                    // MariaDB does so after 2 s idle in the transaction.
                    // MySQL has no such setting (error 1193): its default
                    // `wait_timeout` applies.
                    match sqlx::query("SET SESSION idle_transaction_timeout = 2")
                        .execute(&mut *conn)
                        .await
                    {
                        Err(sqlx::Error::Database(e))
                            if e.message().contains("Unknown system variable") =>
                        {
                            Ok(())
                        }
                        r => r.map(|_| ()),
                    }
                })
            })
            .connect_with(connect.clone())
            .await
            .map_err(|e| db::map_err(&fencelock_core::backend::redact_url(url), e))?;
        let db = Db::new(pool, url);
        sqlx::query(lease::SCHEMA)
            .execute(&db.pool)
            .await
            .map_err(db.err())?;
        let mariadb = get_lock::create_schema(&db).await?;
        let released = Arc::new(Notify::new());
        let mode: Arc<dyn Backend> = match options.mode {
            MyMode::Lease => Arc::new(LeaseTable::new(
                db.clone(),
                released.clone(),
                options.default_ttl,
                mariadb.then(|| {
                    Arc::new(Turnstile::new(
                        connect.clone(),
                        db.addr.clone(),
                        options.pool as usize,
                    ))
                }),
            )),
            MyMode::GetLock => Arc::new(GetLocks::new(
                db.clone(),
                GetLock::new(connect, db.addr.clone(), options.pool as usize, mariadb),
                options.default_ttl,
            )),
        };
        Ok(MySqlBackend {
            inner: Arc::new(Inner {
                db,
                options,
                mode,
                released,
            }),
        })
    }

    /// The options in force.
    pub fn options(&self) -> &MyOptions {
        &self.inner.options
    }

    /// The connection pool, for your own queries (fenced writes to resources in
    /// the same database, for example).
    pub fn pool(&self) -> &sqlx::MySqlPool {
        &self.inner.db.pool
    }

    /// Removes every holder of `key` at once (an operator breaking a lock; the
    /// testkit's "stolen lease"): lease rows are deleted, `GET_LOCK` sessions
    /// killed. The fence stays.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub async fn force_release(&self, key: &Key) -> Result<()> {
        match self.inner.options.mode {
            MyMode::Lease => lease::force_release(&self.inner.db, key).await?,
            MyMode::GetLock => get_lock::force_release(&self.inner.db, key).await?,
        }
        self.inner.released.notify_waiters();
        Ok(())
    }

    /// The backend of the mode in force.
    fn mode(&self) -> &dyn Backend {
        &*self.inner.mode
    }
}

// Every call goes to the mode's own backend.
fencelock_core::delegate_backend!(MySqlBackend, mode);

impl std::fmt::Debug for MySqlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlBackend")
            .field("addr", &self.inner.db.addr)
            .field("mode", &self.inner.options.mode)
            .finish()
    }
}
