//! `get_lock` mode: `GET_LOCK` on a session held for the guard's life.
//!
//! - Names: a key of at most 64 characters is its own lock name (so other
//!   programs' `GET_LOCK('name')` exclude fencelock and vice versa); a longer
//!   key is named by its SHA-256 in hex (64 characters, the server's limit).
//!   Semaphore permit `i` is the lock `<key>\x1f<i>` (hashed the same way): a
//!   key cannot contain the control character `\x1f`, so no permit's name is
//!   another key's.
//! - The TTL contract: the session's `wait_timeout` is the TTL (whole seconds,
//!   rounded up — the server's unit), and the watchdog pings the session at
//!   ttl/3, so a holder that stops (a paused process whose TCP connection stays
//!   open) loses the lock when the server closes its idle session.
//! - Fencing: the token is `max(the key's last token + 1, the server's clock
//!   in µs)`, drawn in the statement that records the holder (sessions use
//!   UTC, so no time zone shift enters it). The last token lives in the
//!   MEMORY table below, which a server restart empties; the clock floor keeps
//!   tokens rising across a restart or crash as long as the server's clock
//!   does not step back across it — so no grant waits for a flush, whatever
//!   the server's durability settings (a sequence's cached values, by
//!   contrast, came back below tokens already handed out after `kill -9`).
//! - Holders (owner, connection id, token) and the permit marker live in the
//!   MEMORY table `fencelock_getlock`: like the locks themselves they do not
//!   survive a server restart, and writing them costs no flush.
//! - Round trips: on MariaDB an exclusive acquire of a free lock is one
//!   statement (`GET_LOCK` without waiting, the permit marker, the token and
//!   the holder's record in one `INSERT … SELECT`); a release is one more.
//!   One that had to wait costs, after the try, the `RELEASE_LOCK` that tells
//!   a busy lock from a marked key, the waiting `GET_LOCK`, and one statement
//!   with the lock held (the marker read locking, the token, the record).
//! - Waiting: `GET_LOCK`'s own timeout (the server queues the waiters);
//!   semaphore waiters poll the permits with backoff.
//! - Shared (reader) locks are not supported: `GET_LOCK` has no shared form.

use std::time::Duration;

use fencelock_core::backend::{
    Backoff, Grant, LeaseRef, Released, Renewal, Request, SessionHolds, lease_start,
};
use fencelock_core::{Error, FencingToken, HolderInfo, Key, LockInfo, Mode, Result};
use sqlx::mysql::{MySqlConnectOptions, MySqlConnection};
use sqlx::{Connection, Row};
use tokio::time::Instant;

use crate::db::{Db, map_err, session_gone};

/// A grant's token, in the statement that records the holder: the server's
/// clock in µs (the session's time zone is UTC) for a key's first row, else
/// the greater of that and the key's last token + 1 (kept in
/// `fencelock_getlock`).
const TOKEN_SQL: &str = "CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED)";
const NEXT_TOKEN_SQL: &str = "fence = LAST_INSERT_ID(GREATEST(fence + 1, VALUES(fence)))";

/// One row per key: the last grant's token, holder and connection, for
/// inspection. (A MEMORY table locks whole tables: no statement that waits for
/// a lock may read it.)
const HOLDERS: &str = r"CREATE TABLE IF NOT EXISTS fencelock_getlock (
    lock_key VARBINARY(256) NOT NULL PRIMARY KEY,
    fence    BIGINT         NOT NULL,
    holder   VARBINARY(256) NOT NULL,
    conn_id  BIGINT         NOT NULL
) ENGINE=MEMORY";

/// The most permits a semaphore on a key ever had; exclusive takers of a key
/// without a row need not check permits. Read by an exclusive taker after it
/// has the key's lock: on MariaDB with a locking read in the statement that
/// draws the token, else in a statement of its own.
const SEMAPHORES: &str = r"CREATE TABLE IF NOT EXISTS fencelock_semaphores (
    lock_key VARBINARY(256) NOT NULL PRIMARY KEY,
    permits  INT            NOT NULL
) ENGINE=InnoDB";

/// Each permit holder's count, by the session that holds the permit's lock
/// (`conn_id`): a key has one permit count while held. MEMORY, like the locks
/// themselves: a restart forgets both.
const PERMIT_COUNTS: &str = r"CREATE TABLE IF NOT EXISTS fencelock_permits (
    lock_key VARBINARY(256) NOT NULL,
    slot     INT            NOT NULL,
    permits  INT            NOT NULL,
    conn_id  BIGINT         NOT NULL,
    PRIMARY KEY (lock_key, slot)
) ENGINE=MEMORY";

/// Each permit's holder and token as recorded at its grant, by the session
/// that holds the permit's lock (`conn_id`), for inspection (the key's row of
/// `fencelock_getlock` names only the last grant). MEMORY: a restart forgets
/// it with the locks.
const PERMIT_HOLDERS: &str = r"CREATE TABLE IF NOT EXISTS fencelock_permit_holders (
    lock_key VARBINARY(256) NOT NULL,
    slot     INT            NOT NULL,
    conn_id  BIGINT         NOT NULL,
    holder   VARBINARY(256) NOT NULL,
    fence    BIGINT         NOT NULL,
    PRIMARY KEY (lock_key, slot)
) ENGINE=MEMORY";

/// A row of `fencelock_permit_holders` with its permit count: slot, session,
/// holder, token, count.
type PermitRecord = (i32, i64, Vec<u8>, i64, Option<i32>);

/// Why the restart gate is closed, and for how long.
struct Closed {
    opens_in: Duration,
    longest_ttl: Duration,
    restarted_ago: Duration,
}

/// `d` to a tenth of a second, for messages.
fn round(d: Duration) -> Duration {
    Duration::from_millis(d.as_millis() as u64 / 100 * 100)
}

/// The longest TTL a `get_lock` hold ever had in this database (earlier
/// versions' restart gate, read once per server start for their holds: see
/// `GetLock::gate`). InnoDB: it must survive a crash.
const SESSION_TTL: &str = r"CREATE TABLE IF NOT EXISTS fencelock_session_ttl (
    id     INT    NOT NULL PRIMARY KEY,
    ttl_ms BIGINT NOT NULL
) ENGINE=InnoDB";

/// The restart gate (see `GetLock::gate`): the server start, as the time it
/// was first seen (µs). MEMORY: a restart empties it.
const BOOT: &str = r"CREATE TABLE IF NOT EXISTS fencelock_boot (
    id   INT    NOT NULL PRIMARY KEY,
    boot BIGINT NOT NULL
) ENGINE=MEMORY";

/// Notes the current server start in `fencelock_boot` if nobody has.
const NOTE_BOOT: &str = "INSERT IGNORE INTO fencelock_boot (id, boot)
     VALUES (1, CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED))";

/// Per server start, the longest TTL of the `get_lock` holds granted under it,
/// and what the table of earlier versions said when this start was first seen
/// (their holds from before it). InnoDB: it must survive a crash.
const RESTART_GATE: &str = r"CREATE TABLE IF NOT EXISTS fencelock_restart_gate (
    boot      BIGINT NOT NULL PRIMARY KEY,
    ttl_ms    BIGINT NOT NULL,
    legacy_ms BIGINT NOT NULL DEFAULT 0,
    started_s BIGINT NOT NULL DEFAULT 0
) ENGINE=InnoDB";

/// Creates the tables; returns whether the server is MariaDB (which takes an
/// exclusive try in one statement).
pub(crate) async fn create_schema(db: &Db) -> Result<bool> {
    for stmt in [
        HOLDERS,
        SEMAPHORES,
        PERMIT_COUNTS,
        PERMIT_HOLDERS,
        SESSION_TTL,
        BOOT,
        RESTART_GATE,
    ] {
        sqlx::query(stmt)
            .execute(&db.pool)
            .await
            .map_err(db.err())?;
    }
    let version: String = sqlx::query_scalar("SELECT VERSION()")
        .fetch_one(&db.pool)
        .await
        .map_err(db.err())?;
    Ok(version.contains("MariaDB"))
}

/// The server-side expression of a lock name (binds: the name three times).
const NAME_SQL: &str = "IF(CHAR_LENGTH(?) <= 64, ?, SHA2(?, 256))";

/// The lock name of `key`, or of its permit `slot` (1…): `<key>\x1f<slot>`,
/// which no key can be (keys hold no control characters).
fn lock_name(key: &Key, slot: u32) -> String {
    if slot == 0 {
        key.as_str().to_string()
    } else {
        format!("{}\x1f{slot}", key.as_str())
    }
}

/// This backend's holds, each on a session of its own, and idle sessions
/// (tagged with their `wait_timeout` in seconds).
pub(crate) struct GetLock {
    options: MySqlConnectOptions,
    addr: String,
    holds: SessionHolds<MySqlConnection>,
    /// MariaDB: an exclusive try is one statement (see `try_with_token`).
    one_statement_try: bool,
    /// The server watcher runs (started with the first hold).
    watching: std::sync::atomic::AtomicBool,
    /// The server start the gate last saw (`fencelock_boot`) and the longest
    /// TTL known to be recorded under it (ms).
    recorded: std::sync::Mutex<(i64, i64)>,
}

impl GetLock {
    pub(crate) fn new(
        options: MySqlConnectOptions,
        addr: String,
        max_idle: usize,
        one_statement_try: bool,
    ) -> GetLock {
        GetLock {
            options,
            addr,
            holds: SessionHolds::new("mysql-get-lock", max_idle),
            one_statement_try,
            watching: std::sync::atomic::AtomicBool::new(false),
            recorded: std::sync::Mutex::new((0, -1)),
        }
    }

    /// See [`Backend::session_events`](fencelock_core::Backend::session_events).
    pub(crate) fn events(&self) -> tokio::sync::watch::Receiver<u64> {
        self.holds.events()
    }

    /// Starts the task that watches the server from a session of its own, once.
    fn watch_server(&self) {
        if !self
            .watching
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            tokio::spawn(watch_server(self.options.clone(), self.holds.watcher()));
        }
    }

    fn err(&self, e: sqlx::Error) -> Error {
        map_err(&self.addr, e)
    }

    /// A session with `wait_timeout` = `ttl`, and whether it was reused (a
    /// reused idle session may have been closed by the server meanwhile);
    /// `None` if a new session's [`GetLock::gate`] does not open by the end
    /// of `wait`. While the gate is closed it waits without a session (a
    /// server's `wait_timeout` cannot end it) and asks again when it should
    /// open.
    async fn session(
        &self,
        ttl: Duration,
        wait: Option<Option<Instant>>,
    ) -> Result<Option<(MySqlConnection, bool)>> {
        let secs = wait_secs(ttl);
        let (mut conn, reused) = match self.holds.take_idle() {
            Some((c, had)) if had == secs => return Ok(Some((c, true))),
            Some((c, _)) => (c, true),
            None => match self.new_session(wait).await? {
                Some(c) => (c, false),
                None => return Ok(None),
            },
        };
        sqlx::query("SET SESSION wait_timeout = ?, time_zone = '+00:00'")
            .bind(secs)
            .execute(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(Some((conn, reused)))
    }

    /// A new session that passed the gate; see [`GetLock::session`].
    async fn new_session(&self, wait: Option<Option<Instant>>) -> Result<Option<MySqlConnection>> {
        let mut told = false;
        loop {
            let mut c = MySqlConnection::connect_with(&self.options)
                .await
                .map_err(|e| self.err(e))?;
            // The one-statement try's locking read of a missing marker row
            // relies on the gap lock of REPEATABLE READ, whatever the
            // server's default; tokens read the clock in UTC.
            sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                .execute(&mut c)
                .await
                .map_err(|e| self.err(e))?;
            crate::db::unlimited_statements(&mut c)
                .await
                .map_err(|e| self.err(e))?;
            let Some(closed) = self.gate(&mut c).await? else {
                return Ok(Some(c));
            };
            drop(c);
            let deadline = match wait {
                None => return Ok(None),
                Some(d) => d,
            };
            if !std::mem::replace(&mut told, true) {
                tracing::warn!(
                    server = %self.addr,
                    "the server restarted {} ago: GET_LOCK locks are granted only in {}, once the holds from before the restart (TTL up to {}) have lapsed; an operator who knows every such holder is dead may delete the rows of fencelock_restart_gate and of fencelock_session_ttl (the table of earlier versions)",
                    humantime::format_duration(round(closed.restarted_ago)),
                    humantime::format_duration(round(closed.opens_in)),
                    humantime::format_duration(round(closed.longest_ttl)),
                );
            }
            let until = Instant::now() + closed.opens_in;
            match deadline {
                Some(d) if d <= until => {
                    tokio::time::sleep_until(d).await;
                    return Ok(None);
                }
                _ => tokio::time::sleep_until(until).await,
            }
        }
    }

    /// The restart gate, passed by every new session before it is used. A
    /// restart (or crash) of the server ends every session, and so frees every
    /// lock at once — but a holder that could not hear of it (cut off from
    /// the server) believes in its hold until its own deadline, at most its
    /// TTL after its last renewal, which came before the restart. So after a
    /// restart no session grants anything until the server has been up
    /// (`Uptime` less a second: see below) for the longest TTL a hold had
    /// under an earlier start (recorded per start before each grant that
    /// raises it; a start is known by the row of the MEMORY table
    /// `fencelock_boot`, which a restart empties); holds granted since the
    /// start never close it. A session that passed it is good for as long as
    /// it lives: a restart ends it too. `None` if open.
    async fn gate(&self, conn: &mut MySqlConnection) -> Result<Option<Closed>> {
        // One statement while this start is known; the first session of a
        // start notes it (and what earlier versions recorded) first.
        let (boot, longest, recorded, others, started_s) = loop {
            let row: Option<(i64, i64, i64, i64, i64, i64)> = sqlx::query_as(
                "SELECT b.boot,
                        GREATEST(COALESCE(MAX(CASE WHEN g.boot <> b.boot THEN g.ttl_ms END), 0),
                                 COALESCE(MAX(CASE WHEN g.boot = b.boot THEN g.legacy_ms END), 0)),
                        COALESCE(MAX(CASE WHEN g.boot = b.boot THEN g.ttl_ms END), 0),
                        COUNT(CASE WHEN g.boot <> b.boot THEN 1 END),
                        COALESCE(MAX(CASE WHEN g.boot = b.boot THEN g.started_s END), 0),
                        COUNT(CASE WHEN g.boot = b.boot THEN 1 END)
                 FROM fencelock_boot b LEFT JOIN fencelock_restart_gate g ON TRUE
                 WHERE b.id = 1 GROUP BY b.boot",
            )
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| self.err(e))?;
            match row {
                Some((boot, longest, recorded, others, started_s, 1..)) => {
                    break (boot, longest, recorded, others, started_s);
                }
                // This start's row, with the second the server started (by
                // `Uptime`: see `uptime_s`).
                Some(_) => {
                    let up = self.uptime_s(conn).await?;
                    sqlx::query(
                        "INSERT IGNORE INTO fencelock_restart_gate (boot, ttl_ms, legacy_ms, started_s)
                         SELECT b.boot, 0, COALESCE((SELECT t.ttl_ms FROM fencelock_session_ttl t WHERE t.id = 1), 0),
                                UNIX_TIMESTAMP() - ?
                         FROM fencelock_boot b WHERE b.id = 1",
                    )
                    .bind(up)
                    .execute(&mut *conn)
                    .await
                    .map_err(|e| self.err(e))?;
                }
                None => {
                    sqlx::query(NOTE_BOOT)
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| self.err(e))?;
                }
            }
        };
        // What the table says now (an operator may have deleted the row, the
        // server restarted): the next grant records its TTL again if that is
        // less.
        *self.recorded.lock().unwrap_or_else(|p| p.into_inner()) = (boot, recorded);
        if longest <= 0 && others == 0 {
            return Ok(None);
        }
        // `Uptime` is the difference of two whole-second timestamps (the
        // statement's and the start's), so it reads up to a second more than
        // the time the server has really been up (1 at 0.4 s was seen).
        let up_ms = (self.uptime_s(conn).await? - 1).max(0).saturating_mul(1000);
        let closed_ms = longest - up_ms;
        if closed_ms <= 0 {
            // The holds of earlier starts are over: forget them — only rows
            // of starts before this one (`fencelock_boot` emptied while the
            // server ran makes a new row of the same start, whose holds may
            // live).
            if others > 0 {
                sqlx::query(
                    "DELETE FROM fencelock_restart_gate WHERE boot <> ? AND started_s < ? - 2",
                )
                .bind(boot)
                .bind(started_s)
                .execute(&mut *conn)
                .await
                .map_err(|e| self.err(e))?;
            }
            return Ok(None);
        }
        let longest_ttl = Duration::from_millis(longest as u64);
        let opens_in = Duration::from_millis(closed_ms as u64);
        Ok(Some(Closed {
            opens_in,
            longest_ttl,
            restarted_ago: longest_ttl.saturating_sub(opens_in),
        }))
    }

    /// The server's `Uptime` in seconds. `SHOW GLOBAL STATUS` works on
    /// MySQL 8, which has no `information_schema.GLOBAL_STATUS`, and on
    /// MariaDB.
    async fn uptime_s(&self, conn: &mut MySqlConnection) -> Result<i64> {
        let (_, up_s): (String, String) = sqlx::query_as("SHOW GLOBAL STATUS LIKE 'Uptime'")
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(up_s.trim().parse::<i64>().unwrap_or(0))
    }

    /// Records `ttl` as a TTL of this server start (durably, with InnoDB's
    /// default `innodb_flush_log_at_trx_commit=1`) before a grant of it,
    /// unless a TTL as long is known to be recorded. The start is the
    /// server's (`fencelock_boot` now), not what a gate saw earlier.
    async fn record_ttl(&self, conn: &mut MySqlConnection, ttl: Duration) -> Result<()> {
        let ms = ttl.as_millis().min(i64::MAX as u128) as i64;
        let (boot, recorded) = *self.recorded.lock().unwrap_or_else(|p| p.into_inner());
        if recorded >= ms {
            return Ok(());
        }
        sqlx::query(NOTE_BOOT)
            .execute(&mut *conn)
            .await
            .map_err(|e| self.err(e))?;
        // A row made here (an operator deleted this start's) gets the time
        // of now as its start: never taken for an earlier start's.
        sqlx::query(
            "INSERT INTO fencelock_restart_gate (boot, ttl_ms, started_s)
             SELECT b.boot, ?, UNIX_TIMESTAMP() FROM fencelock_boot b WHERE b.id = 1
             ON DUPLICATE KEY UPDATE ttl_ms = GREATEST(ttl_ms, VALUES(ttl_ms))",
        )
        .bind(ms)
        .execute(&mut *conn)
        .await
        .map_err(|e| self.err(e))?;
        let mut r = self.recorded.lock().unwrap_or_else(|p| p.into_inner());
        if r.0 == boot {
            r.1 = r.1.max(ms);
        }
        Ok(())
    }

    /// `GET_LOCK` of `name` with `timeout` seconds (0: try once). MariaDB takes a
    /// negative timeout as 0, so "forever" is a long wait repeated.
    async fn get_lock(conn: &mut MySqlConnection, name: &str, timeout: f64) -> sqlx::Result<bool> {
        let got: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT GET_LOCK({NAME_SQL}, ?)"
        )))
        .bind(name)
        .bind(name)
        .bind(name)
        .bind(timeout)
        .fetch_one(&mut *conn)
        .await?;
        Ok(got == Some(1))
    }

    /// Acquires on a session of its own. `wait`: `None` tries once, `Some(None)`
    /// waits forever, `Some(Some(deadline))` waits until then.
    pub(crate) async fn acquire(
        &self,
        req: &Request,
        wait: Option<Option<Instant>>,
    ) -> Result<Option<Grant>> {
        let requested_at = Instant::now();
        if req.mode == Mode::Shared {
            return Err(Error::unsupported(
                crate::NAME,
                "shared (reader) locks in get_lock mode; use mode=lease",
            ));
        }
        if let Some(grant) = self.holds.reenter(req, requested_at, ping).await? {
            return Ok(Some(grant));
        }
        let (mut conn, slot) = loop {
            let Some((mut conn, reused)) = self.session(req.ttl, wait).await? else {
                return Ok(None);
            };
            match self.record_ttl(&mut conn, req.ttl).await {
                Err(e) if reused && e.is_transient() => continue,
                r => r?,
            }
            // On an error the connection is dropped: closing the session lets
            // go of any lock it may have taken.
            let taken = match req.mode {
                Mode::Semaphore { permits } => self
                    .take_permit(&mut conn, &req.key, permits)
                    .await
                    .map(|slot| slot.map(|slot| Taken { slot, token: None })),
                _ => self.take_exclusive(&mut conn, req, wait).await,
            };
            match taken {
                Ok(slot) => break (conn, slot),
                // An idle session the server closed meanwhile: take a new one.
                Err(e) if reused && e.is_transient() => continue,
                Err(e) => return Err(e),
            }
        };
        let Some(Taken { slot, token }) = slot else {
            self.holds.put_idle(conn, wait_secs(req.ttl));
            return Ok(None);
        };
        let token = match token {
            Some(t) => t,
            None => self.grant_token(&mut conn, req).await?,
        };
        if slot > 0 {
            sqlx::query(
                "REPLACE INTO fencelock_permit_holders (lock_key, slot, conn_id, holder, fence)
                 VALUES (?, ?, CONNECTION_ID(), ?, ?)",
            )
            .bind(req.key.as_str().as_bytes())
            .bind(slot as i32)
            .bind(req.owner.as_str().as_bytes())
            .bind(token as i64)
            .execute(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        }
        let requested_at = lease_start(requested_at, req.ttl, &mut conn, ping)
            .await
            .map_err(|e| Error::connection(crate::NAME, &self.addr, e))?;
        let grant = self.holds.insert(req, token, slot, conn, requested_at);
        self.watch_server();
        Ok(Some(grant))
    }

    /// Draws the token of a grant and records the holder.
    async fn grant_token(&self, conn: &mut MySqlConnection, req: &Request) -> Result<u64> {
        let key = req.key.as_str().as_bytes();
        let done = sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO fencelock_getlock (lock_key, fence, holder, conn_id)
             VALUES (?, LAST_INSERT_ID({TOKEN_SQL}), ?, CONNECTION_ID())
             ON DUPLICATE KEY UPDATE {NEXT_TOKEN_SQL}, holder = VALUES(holder), conn_id = VALUES(conn_id)"
        )))
        .bind(key)
        .bind(req.owner.as_str().as_bytes())
        .execute(&mut *conn)
        .await
        .map_err(|e| self.err(e))?;
        Ok(done.last_insert_id())
    }

    /// Takes a free permit of `key`, unless an exclusive holder has the key.
    async fn take_permit(
        &self,
        conn: &mut MySqlConnection,
        key: &Key,
        permits: u32,
    ) -> Result<Option<u32>> {
        if permits > MAX_PERMITS {
            return Err(Error::config(format!(
                "a semaphore of {permits} permits: get_lock mode allows at most {MAX_PERMITS}; use mode=lease"
            )));
        }
        // Announced before any permit is taken: an exclusive taker that reads
        // the count after this sees that it must check the permits.
        sqlx::query(
            "INSERT INTO fencelock_semaphores (lock_key, permits) VALUES (?, ?)
             ON DUPLICATE KEY UPDATE permits = GREATEST(permits, VALUES(permits))",
        )
        .bind(key.as_str().as_bytes())
        .bind(permits as i32)
        .execute(&mut *conn)
        .await
        .map_err(|e| self.err(e))?;
        let first = fastrand::u32(0..permits);
        for i in 0..permits {
            let slot = (first + i) % permits + 1;
            let name = lock_name(key, slot);
            if !Self::get_lock(conn, &name, 0.0)
                .await
                .map_err(|e| self.err(e))?
            {
                continue;
            }
            // Taken first, checked second (an exclusive taker does the same two
            // steps on its own name), so of two racers at least one sees the other.
            if !users(&mut *conn, key, 0)
                .await
                .map_err(|e| self.err(e))?
                .is_empty()
            {
                Self::let_go(conn, &name).await.map_err(|e| self.err(e))?;
                return Ok(None);
            }
            // A key has one permit count while held: recorded first, checked
            // second, so of two racers with different counts one sees the other.
            if let Err(e) = self.check_count(conn, key, slot, permits).await {
                Self::let_go(conn, &name).await.map_err(|e| self.err(e))?;
                return Err(e);
            }
            return Ok(Some(slot));
        }
        // Every slot of this count is taken; holders with another count (say
        // 2 of 2 permits held, 1 asked: slot 1 busy) refuse it at once rather
        // than keep it waiting for a slot it may never be allowed.
        match self.held_count(conn, key, permits).await? {
            Some(held) => Err(Error::permits_mismatch(key.as_str(), held, permits)),
            None => Ok(None),
        }
    }

    /// Records this permit holder's count and fails if a live holder of
    /// another permit of `key` took it with another count.
    async fn check_count(
        &self,
        conn: &mut MySqlConnection,
        key: &Key,
        slot: u32,
        permits: u32,
    ) -> Result<()> {
        let k = key.as_str().as_bytes();
        sqlx::query(
            "INSERT INTO fencelock_permits (lock_key, slot, permits, conn_id)
             VALUES (?, ?, ?, CONNECTION_ID())
             ON DUPLICATE KEY UPDATE permits = VALUES(permits), conn_id = VALUES(conn_id)",
        )
        .bind(k)
        .bind(slot as i32)
        .bind(permits as i32)
        .execute(&mut *conn)
        .await
        .map_err(|e| self.err(e))?;
        match self.held_count(conn, key, permits).await? {
            Some(held) => Err(Error::permits_mismatch(key.as_str(), held, permits)),
            None => Ok(()),
        }
    }

    /// The count of a live holder of a permit of `key` (one whose session
    /// still holds that permit's lock) that is not `permits`, if any.
    async fn held_count(
        &self,
        conn: &mut MySqlConnection,
        key: &Key,
        permits: u32,
    ) -> Result<Option<i64>> {
        let k = key.as_str().as_bytes();
        sqlx::query_scalar(
            "SELECT permits FROM fencelock_permits
             WHERE lock_key = ? AND permits <> ?
               AND IS_USED_LOCK(IF(CHAR_LENGTH(CONCAT(?, CHAR(31), slot)) <= 64,
                   CONCAT(?, CHAR(31), slot), SHA2(CONCAT(?, CHAR(31), slot), 256))) = conn_id
             LIMIT 1",
        )
        .bind(k)
        .bind(permits as i32)
        .bind(key.as_str())
        .bind(key.as_str())
        .bind(key.as_str())
        .fetch_optional(&mut *conn)
        .await
        .map_err(|e| self.err(e))
    }

    /// Takes `req.key` exclusively, waiting as `wait` says, and only while no
    /// permit of it is held.
    async fn take_exclusive(
        &self,
        conn: &mut MySqlConnection,
        req: &Request,
        wait: Option<Option<Instant>>,
    ) -> Result<Option<Taken>> {
        const A_DAY: f64 = 86_400.0;
        let key = &req.key;
        if self.one_statement_try {
            match self.try_with_token(conn, req).await? {
                FastTry::Granted(token) => {
                    return Ok(Some(Taken {
                        slot: 0,
                        token: Some(token),
                    }));
                }
                FastTry::Busy if wait.is_none() => return Ok(None),
                // A semaphore's key: the permits are checked below.
                FastTry::Busy | FastTry::Marked => {}
            }
        }
        let mut backoff = Backoff::new(Duration::from_millis(5), Duration::from_millis(200));
        loop {
            let timeout = match wait {
                None => 0.0,
                Some(None) => A_DAY,
                Some(Some(deadline)) => deadline
                    .saturating_duration_since(Instant::now())
                    .as_secs_f64(),
            };
            // The permit count is read in a statement of its own after the lock
            // is taken: within one statement MariaDB reads a constant subquery
            // while optimizing, before GET_LOCK runs.
            let taken = Self::get_lock(conn, key.as_str(), timeout)
                .await
                .map_err(|e| self.err(e))?;
            if taken && self.one_statement_try {
                // MariaDB: the token with the check, one round trip after the
                // wait (the lock is held meanwhile).
                if let Some(token) = self.token_if_unmarked(conn, req).await? {
                    return Ok(Some(Taken {
                        slot: 0,
                        token: Some(token),
                    }));
                }
            }
            let permits = if taken {
                sqlx::query_scalar::<_, i64>(
                    "SELECT COALESCE(MAX(permits), 0) FROM fencelock_semaphores WHERE lock_key = ?",
                )
                .bind(key.as_str().as_bytes())
                .fetch_one(&mut *conn)
                .await
                .map_err(|e| self.err(e))?
            } else {
                -1
            };
            if permits >= 0 {
                let taken = Taken {
                    slot: 0,
                    token: None,
                };
                if permits == 0 {
                    return Ok(Some(taken));
                }
                let used = users(&mut *conn, key, permits as u32)
                    .await
                    .map_err(|e| self.err(e))?;
                if used.iter().all(|(slot, _)| *slot == 0) {
                    return Ok(Some(taken));
                }
                // Permit holders have the key: let go and wait for them.
                Self::let_go(conn, key.as_str())
                    .await
                    .map_err(|e| self.err(e))?;
            } else if wait != Some(None) {
                return Ok(None);
            }
            let Some(deadline) = wait else {
                return Ok(None);
            };
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(None);
            }
            backoff.sleep(deadline, None).await;
        }
    }

    /// MariaDB's try of an exclusive lock in one statement: `GET_LOCK` without
    /// waiting, then — if taken — the key's permit marker, and — if no
    /// semaphore ever used the key — the token and the holder's record. Returns the token, or what stopped it, with the lock
    /// not held.
    ///
    /// It never waits in `GET_LOCK`: the statement writes the MEMORY table,
    /// whose table lock would stall every other grant meanwhile.
    ///
    /// MariaDB reads the marker while optimizing, before `GET_LOCK` runs; the
    /// read is a locking one (`LOCK IN SHARE MODE`, held to the statement's
    /// end), so a semaphore taker's announcement — which comes before it takes
    /// a permit and checks this lock — either is seen here or waits until this
    /// statement has taken the lock, and then sees it taken.
    async fn try_with_token(&self, conn: &mut MySqlConnection, req: &Request) -> Result<FastTry> {
        let key = req.key.as_str();
        let done = sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO fencelock_getlock (lock_key, fence, holder, conn_id)
             SELECT ?, LAST_INSERT_ID({TOKEN_SQL}), ?, CONNECTION_ID() FROM DUAL
             WHERE IF(GET_LOCK({NAME_SQL}, 0) = 1,
                 (SELECT COALESCE(MAX(permits), 0) FROM fencelock_semaphores
                  WHERE lock_key = ? LOCK IN SHARE MODE), -1) = 0
             ON DUPLICATE KEY UPDATE {NEXT_TOKEN_SQL}, holder = VALUES(holder), conn_id = VALUES(conn_id)"
        )))
        .bind(key.as_bytes())
        .bind(req.owner.as_str().as_bytes())
        .bind(key)
        .bind(key)
        .bind(key)
        .bind(key.as_bytes())
        .execute(&mut *conn)
        .await
        .map_err(|e| self.err(e))?;
        if done.rows_affected() > 0 {
            return Ok(FastTry::Granted(done.last_insert_id()));
        }
        // Taken on a key with a permit marker (let go), or busy.
        Ok(if Self::let_go(conn, key).await.map_err(|e| self.err(e))? {
            FastTry::Marked
        } else {
            FastTry::Busy
        })
    }

    /// With `req.key`'s lock held: draws the token and records the holder in
    /// one statement if no semaphore ever used the key (the marker is read
    /// locking, as in [`Self::try_with_token`]); `None` if one did (the lock
    /// is still held: its permits must be checked).
    async fn token_if_unmarked(
        &self,
        conn: &mut MySqlConnection,
        req: &Request,
    ) -> Result<Option<u64>> {
        let key = req.key.as_str().as_bytes();
        let done = sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO fencelock_getlock (lock_key, fence, holder, conn_id)
             SELECT ?, LAST_INSERT_ID({TOKEN_SQL}), ?, CONNECTION_ID() FROM DUAL
             WHERE (SELECT COALESCE(MAX(permits), 0) FROM fencelock_semaphores
                    WHERE lock_key = ? LOCK IN SHARE MODE) = 0
             ON DUPLICATE KEY UPDATE {NEXT_TOKEN_SQL}, holder = VALUES(holder), conn_id = VALUES(conn_id)"
        )))
        .bind(key)
        .bind(req.owner.as_str().as_bytes())
        .bind(key)
        .execute(&mut *conn)
        .await
        .map_err(|e| self.err(e))?;
        Ok((done.rows_affected() > 0).then(|| done.last_insert_id()))
    }

    /// `RELEASE_LOCK` of `name`: true if this session held it.
    async fn let_go(conn: &mut MySqlConnection, name: &str) -> sqlx::Result<bool> {
        let released: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT RELEASE_LOCK({NAME_SQL})"
        )))
        .bind(name)
        .bind(name)
        .bind(name)
        .fetch_one(&mut *conn)
        .await?;
        Ok(released == Some(1))
    }

    /// Pings each lease's session (which also restarts its idle timeout).
    pub(crate) async fn renew(&self, leases: &[LeaseRef]) -> Vec<Renewal> {
        self.holds.ping(leases, ping).await
    }

    pub(crate) async fn release(&self, lease: &LeaseRef) -> Result<Released> {
        let not_held = || Error::NotHeld {
            key: lease.key.to_string(),
            owner: lease.owner.to_string(),
        };
        let last = self.holds.release(lease).await?;
        if last.remaining > 0 {
            return Ok(Released::new(last.remaining));
        }
        let Some(mut conn) = last.session else {
            return Err(not_held());
        };
        match Self::let_go(&mut conn, &lock_name(&last.key, last.slot)).await {
            Ok(true) => {
                self.holds.put_idle(conn, wait_secs(last.ttl));
                Ok(Released::new(0))
            }
            Ok(false) => Err(not_held()),
            Err(e) if session_gone(&e) => Err(not_held()),
            // Dropping the connection ends the session, and the lock with it.
            Err(e) => Err(self.err(e)),
        }
    }
}

/// Ids of the sessions holding `key` (slot 0) and its permits `1..=permits`,
/// in one query.
async fn users<'c, E>(conn: E, key: &Key, permits: u32) -> sqlx::Result<Vec<(u32, i64)>>
where
    E: sqlx::Executor<'c, Database = sqlx::MySql>,
{
    let rows: Vec<(i64, i64)> = sqlx::query_as(
        "WITH RECURSIVE s(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM s WHERE i < ?)
         SELECT i, id FROM (
             SELECT i, IS_USED_LOCK(IF(CHAR_LENGTH(n) <= 64, n, SHA2(n, 256))) AS id
             FROM (SELECT i, IF(i = 0, ?, CONCAT(?, CHAR(31), i)) AS n FROM s) names
         ) used WHERE id IS NOT NULL",
    )
    .bind(i64::from(permits))
    .bind(key.as_str())
    .bind(key.as_str())
    .fetch_all(conn)
    .await?;
    Ok(rows.into_iter().map(|(i, id)| (i as u32, id)).collect())
}

/// What an acquire took: the lock (slot 0) or a permit (1…), and the token
/// if it was drawn in the same round trip.
struct Taken {
    slot: u32,
    token: Option<u64>,
}

/// How [`GetLock::try_with_token`] ended.
enum FastTry {
    Granted(u64),
    /// Another session holds the lock.
    Busy,
    /// A semaphore used the key once: its permits must be checked.
    Marked,
}

/// `wait_timeout` for a TTL: whole seconds, rounded up.
fn wait_secs(ttl: Duration) -> u64 {
    ttl.as_millis().div_ceil(1000).clamp(1, 31_536_000) as u64
}

/// The most permits a semaphore may have in get_lock mode (each is a lock name
/// that exclusive takers check).
const MAX_PERMITS: u32 = 64;

/// Kills every session holding `key` or one of its first permits (an operator
/// breaking the lock; the holders' next renewal reports it lost).
pub(crate) async fn force_release(db: &Db, key: &Key) -> Result<()> {
    for (_, id) in users(&db.pool, key, MAX_PERMITS).await.map_err(db.err())? {
        // The session may have ended meanwhile (unknown thread id): fine.
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!("KILL {id}")))
            .execute(&db.pool)
            .await;
    }
    Ok(())
}

/// The exclusive holder as `fencelock_getlock` recorded it at grant (checked
/// against the session that holds the lock now), and permit holders by their
/// connection ids.
pub(crate) async fn inspect(db: &Db, key: &Key) -> Result<Option<LockInfo>> {
    let row =
        sqlx::query("SELECT fence, holder, conn_id FROM fencelock_getlock WHERE lock_key = ?")
            .bind(key.as_str().as_bytes())
            .fetch_optional(&db.pool)
            .await
            .map_err(db.err())?;
    let Some(row) = row else { return Ok(None) };
    let fence: i64 = row.try_get("fence").map_err(db.err())?;
    let holder: Vec<u8> = row.try_get("holder").map_err(db.err())?;
    let conn_id: i64 = row.try_get("conn_id").map_err(db.err())?;
    let used = users(&db.pool, key, MAX_PERMITS).await.map_err(db.err())?;
    // Permits: their holders and count as recorded at grant, where the
    // session that recorded them still holds the permit.
    let recorded: Vec<PermitRecord> = sqlx::query_as(
        "SELECT h.slot, h.conn_id, h.holder, h.fence, p.permits
         FROM fencelock_permit_holders h
         LEFT JOIN fencelock_permits p ON p.lock_key = h.lock_key AND p.slot = h.slot AND p.conn_id = h.conn_id
         WHERE h.lock_key = ?",
    )
    .bind(key.as_str().as_bytes())
    .fetch_all(&db.pool)
    .await
    .map_err(db.err())?;
    let in_use = used.iter().filter(|(slot, _)| *slot > 0).count() as u32;
    let mut holders = Vec::new();
    for (slot, id) in used {
        let permit = recorded
            .iter()
            .find(|r| r.0 as u32 == slot && r.1 == id && slot > 0);
        let (owner, token) = if let Some((_, _, h, f, _)) = permit {
            (
                String::from_utf8_lossy(h).into_owned(),
                Some(FencingToken::new(*f as u64)),
            )
        } else if id == conn_id {
            (
                String::from_utf8_lossy(&holder).into_owned(),
                Some(FencingToken::new(fence as u64)),
            )
        } else {
            (format!("connection {id}"), None)
        };
        let mode = if slot == 0 {
            Mode::Exclusive
        } else {
            // Without a record (a holder between its permit and its
            // record), the permits in use.
            Mode::Semaphore {
                permits: permit
                    .and_then(|p| p.4)
                    .map_or(in_use, |c| c.unsigned_abs()),
            }
        };
        holders.push(HolderInfo::new(owner, mode, 1, token, None));
    }
    Ok(Some(LockInfo::new(
        key.as_str(),
        holders,
        Some(FencingToken::new(fence as u64)),
    )))
}

/// Keys under `prefix` ever locked in this mode; [`inspect`] tells which are held.
pub(crate) async fn known_keys(db: &Db, prefix: &str) -> Result<Vec<String>> {
    let keys: Vec<Vec<u8>> = sqlx::query_scalar(
        "SELECT lock_key FROM fencelock_getlock WHERE LEFT(lock_key, ?) = ? ORDER BY lock_key",
    )
    .bind(prefix.len() as i64)
    .bind(prefix.as_bytes())
    .fetch_all(&db.pool)
    .await
    .map_err(db.err())?;
    Ok(keys
        .into_iter()
        .map(|k| String::from_utf8_lossy(&k).into_owned())
        .collect())
}

/// Keeps a session of its own waiting in a statement: when the server ends it
/// (a restart or crash ends every session at once), the holds' sessions are
/// pinged at once, so their `lost()` fires before another client can be
/// granted the lock on the restarted server — not at their next renewal.
async fn watch_server(options: MySqlConnectOptions, watch: fencelock_core::backend::SessionWatch) {
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    while watch.alive() {
        let connected = match MySqlConnection::connect_with(&options).await {
            Ok(mut c) => crate::db::unlimited_statements(&mut c).await.map(|_| c),
            Err(e) => Err(e),
        };
        let Ok(mut conn) = connected else {
            // The server does not take sessions now: those of the holds may
            // be gone too (the pings tell).
            watch.sessions_may_have_ended();
            backoff.sleep(None, None).await;
            continue;
        };
        backoff.reset();
        while watch.alive() {
            // SLEEP answers 1 when the server interrupts it (shutting down).
            match sqlx::query_scalar::<_, i64>("SELECT SLEEP(5)")
                .fetch_one(&mut conn)
                .await
            {
                Ok(0) => {}
                outcome => {
                    tracing::debug!(
                        ?outcome,
                        "the server interrupted the watching session; pinging every hold"
                    );
                    watch.sessions_may_have_ended();
                    break;
                }
            }
        }
    }
}

/// One round trip on a held session: it is alive (and its idle timeout
/// restarts).
async fn ping(c: &mut MySqlConnection) -> std::result::Result<(), String> {
    sqlx::query("SELECT 1")
        .execute(c)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}
