//! PostgreSQL backend of fencelock, in two modes, plus the database lock
//! patterns of the literature ([`patterns`]).
//!
//! # Modes
//!
//! - **lease** (`postgres://…`, `?mode=lease`, the default): each holder is a
//!   row of `fencelock_locks` whose `expires_at` follows the server's clock; a
//!   per-key `fence` survives release, so tokens keep rising. Acquire, release
//!   and the watchdog's batched renew are one statement each (acquire and
//!   release are PL/pgSQL functions serialized by the key's fence row, which
//!   every function locks before any holder row, so none deadlocks with
//!   another). Exclusive waiters of every process stand in the key's queue
//!   (`fencelock_waiters`, by arrival): the release that lets the lock go
//!   makes the first of them the holder and `NOTIFY`s the grant on the
//!   channel its backend listens on, so it starts without an acquire round
//!   trip (a handoff to the next waiter of the releasing process comes first,
//!   up to 16 in a row; new shared and semaphore holds wait behind a standing
//!   writer). Other waiters are woken by a `NOTIFY` on channel
//!   `fencelock`. Every waiter re-checks after a bounded time (at most a
//!   second), so a lost notification costs a delay, never a hang. All modes;
//!   reentrancy. See ARCHITECTURE.md §4, "Handing the lock to another
//!   process", for the queue's rules.
//! - **advisory** (`?mode=advisory`): `pg_advisory_lock` on a session held for
//!   the guard's life; waiters block in the server. The session ending fires
//!   the guard's `lost()`: a server restart or crash at once (a session of the
//!   backend's own idles in a `LISTEN` — never in a statement, whose snapshot
//!   would hold back VACUUM — and, when the server ends it, every
//!   hold's session is pinged), `pg_terminate_backend` or a network loss at
//!   the next renewal (see the limits below). The session's `idle_session_timeout` is the TTL, so a
//!   paused holder loses the lock too. Lock ids are 64-bit hashes of the keys
//!   (`hashtextextended(key, 0)`): two keys whose hashes collide share a lock
//!   (for a million keys the chance of any collision is about 3·10⁻⁸), as does
//!   another program that takes advisory locks with the same ids in the same
//!   database.
//!
//! # What is guaranteed, and under which assumptions
//!
//! - **lease**: exclusion while a guard is valid, provided the server's clock
//!   (which expires rows) does not jump forward and runs no faster than the
//!   client's monotonic clock by more than the drift allowance (1 % of the TTL
//!   plus 2 ms). Grants and renewals are durable before they are answered —
//!   they pin `synchronous_commit=on` whatever the server, database or role
//!   sets (a release does not: if a crash loses it, the row expires after its
//!   TTL) — so a crash and restart keeps every hold and every token: tokens
//!   strictly increase per key. Cost: one WAL flush per grant and renewal.
//! - **advisory**: exclusion while a guard is valid, provided the server ends
//!   idle sessions on time; a restart ends every hold (see above). Tokens are
//!   `max(the key's last token + 1, the server's clock in µs)`, the last
//!   tokens kept in an UNLOGGED table: they strictly increase per key across
//!   crashes as long as the server's clock does not step back across a crash
//!   (the sequence of the first design came back below tokens already handed
//!   out after `kill -9` with `synchronous_commit=off`). No grant waits for a
//!   flush.
//! - **advisory** after a restart or crash: it ends every session, and with
//!   them every lock, at once, and a holder cut off from the server cannot
//!   hear of it. So no session grants anything until the server has been up
//!   (`pg_postmaster_start_time()`) for the longest TTL an advisory hold had
//!   in the database under an earlier start (recorded durably, per start, in
//!   `fencelock_restart_gate` before the first grant of each longer TTL):
//!   every hold from before the restart has lost its validity by then. Holds
//!   granted since the start never close the gate. A waiter at a closed gate
//!   waits, without a session, as long as its wait allows, and logs a warning
//!   once that says when the gate opens. An operator who knows every holder
//!   from before a restart is dead may delete the rows of
//!   `fencelock_restart_gate` and of `fencelock_session_ttl`. Earlier
//!   versions kept one longest TTL in `fencelock_session_ttl`; it is read when
//!   a start is first seen, for their holds (so every restart waits for it
//!   until its row is deleted), and this version does not write it: stop the
//!   advisory clients of earlier versions before the first of this version,
//!   or their gate may open before its holds have lapsed. Known limits: a
//!   crash that the server survives by reinitializing in place, and a
//!   promoted standby, keep `pg_postmaster_start_time()` of before, so the
//!   gate does not close for them. Known limit:
//!   when the server ends one session while it keeps running
//!   (`pg_terminate_backend`, a connection the network reset), that lock is
//!   free at once, and its holder learns it at its next renewal (within
//!   ttl/3), or — if it is cut off — at its deadline (up to a TTL): another
//!   client can be granted meanwhile. Fencing tokens still reject the old
//!   holder's writes; lease mode has no such gap.
//! - **lease** releases are not flushed before they are answered (the row of
//!   a lost release expires after its TTL): after a crash, a release answered
//!   up to `wal_writer_delay` before it may be undone — the key stays held
//!   until that TTL, and the same explicit owner acquiring again re-enters the
//!   old hold (its token, one more hold) instead of a new grant.
//! - A grant after a wait in the server counts its lease from a round trip
//!   after the wait, so it is valid on arrival however long it waited.
//! - **lease**, a hold handed to a waiter where it stands: it expires a TTL
//!   after the hand-on by the server's clock, and the waiter counts its lease
//!   from the send time of the attempt the grant names (which the server ran
//!   before the hand-on), so the waiter's deadline is never later than the
//!   row's expiry under the clock assumption above. A hold handed to a waiter
//!   that died lapses with its TTL; a waiter that gives up takes back its
//!   hold of the one handed to it (not one another acquire of the same owner
//!   joined) and passes the lock on; if it cannot reach the server, that hold
//!   lapses with its TTL.
//!
//! The schema is created on first use (idempotently). PostgreSQL 14 or later
//! (`idle_session_timeout`, `client_connection_check_interval`). fencelock's
//! sessions run at READ COMMITTED and turn `idle_session_timeout` off (a
//! hold's session sets it to the TTL), whatever the database or role sets.
//!
//! # Defaults, restarts and frozen clients
//!
//! - A hold gets the TTL asked for (30 s by default), counted on the server's clock.
//! - Lease mode: holds and tokens survive a restart
//!   (`tests/faults.rs::a_lease_outlives_a_restart_shorter_than_its_ttl`).
//!   Advisory mode: a restart ends every hold (`lost()` fires), and nothing is
//!   granted until the server has been up for the longest TTL of the holds granted
//!   before it; holds granted since never delay anyone (`tests/restart_gate.rs`).
//!   A waiter waits through a restart (`tests/outage.rs`).
//! - A frozen holder keeps the key for its TTL (lease) or its session's
//!   `idle_session_timeout` = TTL (advisory) (`tests/faults.rs`); no lock is held
//!   across a round trip (`tests/frozen_client.rs`). A silent server holds a waiter
//!   at most a second past its wait, and a connect for `connect_timeout=` (10 s)
//!   (`tests/faults.rs::a_stalled_server_cannot_hold_a_lease_waiter_past_its_wait`).
//!
//! # Examples
//!
//! ```
//! use fencelock_core::Locker;
//! use fencelock_postgres::PostgresBackend;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock_core::Result<()> {
//! let url = "postgres://postgres:postgres@127.0.0.1:5432/test";
//! let locker = Locker::new(PostgresBackend::connect(url).await?);
//! let guard = locker.lock("doc-example/nightly-report").acquire().await?;
//! assert!(guard.token().is_some());
//! guard.release().await?;
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

mod advisory;
mod db;
mod lease;
mod listen;
mod modes;
mod options;
pub mod patterns;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use fencelock_core::{Backend, Error, Key, Result};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

pub use options::{PgMode, PgOptions};

use crate::advisory::Advisory;
use crate::db::Db;
use crate::modes::{AdvisoryLocks, LeaseTable};

const NAME: &str = "postgres";

/// How the `fencelock` facade opens this backend from a URL.
pub const DRIVER: fencelock_core::backend::Driver =
    fencelock_core::driver!(NAME, ["postgres", "postgresql"], PostgresBackend::connect);

/// Locks in PostgreSQL (`postgres://user:password@host:port/db[?mode=lease|advisory]`).
/// Clones share the pool, the listener and the held sessions.
///
/// Each mode is a backend of its own (`modes::LeaseTable`,
/// `modes::AdvisoryLocks`); `connect` picks one by `?mode=` and this type
/// hands every call to it.
#[derive(Clone)]
pub struct PostgresBackend {
    inner: Arc<Inner>,
}

struct Inner {
    db: Db,
    options: PgOptions,
    mode: Arc<dyn Backend>,
}

impl PostgresBackend {
    /// Connects to the database a `postgres://` URL names and creates the schema
    /// if needed.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a bad URL or option; [`Error::Connection`] if
    /// the server cannot be reached, refuses the login or does not answer
    /// within `connect_timeout=`.
    pub async fn connect(url: &str) -> Result<PostgresBackend> {
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

    async fn open(url: &str, driver_url: &str, options: PgOptions) -> Result<PostgresBackend> {
        let connect = PgConnectOptions::from_str(driver_url)
            .map_err(|e| Error::config(format!("postgres URL: {e}")))?
            .application_name("fencelock")
            // fencelock's sessions hold nothing while idle (a hold's
            // session sets its own timeout: the TTL), and its pool closes
            // idle ones itself: a server's `idle_session_timeout` would
            // only make the next statement fail on a closed connection.
            // Every statement is written for READ COMMITTED: a stricter
            // default would fail contended ones with serialization errors.
            .options([
                ("idle_session_timeout", "0"),
                ("default_transaction_isolation", "read committed"),
            ]);
        // One connection first: a pool that cannot connect says only that it
        // timed out; the connection says why (refused, a bad password).
        let first = <sqlx::PgConnection as sqlx::Connection>::connect_with(&connect)
            .await
            .map_err(|e| db::map_err(&fencelock_core::backend::redact_url(url), e))?;
        let _ = sqlx::Connection::close(first).await;
        let pool = PgPoolOptions::new()
            .max_connections(options.pool)
            .acquire_timeout(Duration::from_secs(10))
            // A broken connection shows as an error of the statement itself; a
            // ping before each would double the round trips.
            .test_before_acquire(false)
            .connect_with(connect.clone())
            .await
            .map_err(|e| db::map_err(&fencelock_core::backend::redact_url(url), e))?;
        let db = Db::new(pool, url);
        lease::create_schema(&db).await?;
        let mode: Arc<dyn Backend> = match options.mode {
            PgMode::Lease => Arc::new(LeaseTable::new(db.clone(), connect, options.default_ttl)),
            PgMode::Advisory => Arc::new(AdvisoryLocks::new(
                db.clone(),
                Advisory::new(connect, db.addr.clone(), options.pool as usize),
                options.default_ttl,
            )),
        };
        Ok(PostgresBackend {
            inner: Arc::new(Inner { db, options, mode }),
        })
    }

    /// The options in force.
    pub fn options(&self) -> &PgOptions {
        &self.inner.options
    }

    /// The connection pool (lease mode's statements run on it), for the
    /// [`patterns`] helpers and your own queries.
    pub fn pool(&self) -> &sqlx::PgPool {
        &self.inner.db.pool
    }

    /// Removes every holder of `key` at once (an operator breaking a lock; the
    /// testkit's "stolen lease"): lease rows are deleted, advisory sessions
    /// terminated. The fence stays.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub async fn force_release(&self, key: &Key) -> Result<()> {
        match self.inner.options.mode {
            PgMode::Lease => lease::force_release(&self.inner.db, key).await,
            PgMode::Advisory => advisory::force_release(&self.inner.db, key).await,
        }
    }

    /// The backend of the mode in force.
    fn mode(&self) -> &dyn Backend {
        &*self.inner.mode
    }
}

// Every call goes to the mode's own backend.
fencelock_core::delegate_backend!(PostgresBackend, mode);

impl std::fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresBackend")
            .field("addr", &self.inner.db.addr)
            .field("mode", &self.inner.options.mode)
            .finish()
    }
}
