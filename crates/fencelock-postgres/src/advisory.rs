//! Advisory mode: `pg_advisory_lock` on a session held for the guard's life.
//!
//! Each hold owns one database session (taken from a small idle list, opened
//! when the list is empty). The lock id is `hashtextextended(key, 0)`, a stable
//! 64-bit hash; two keys whose hashes collide share one lock (for a million keys
//! the chance of any collision is about 3·10⁻⁸), and so does any other program
//! that takes advisory locks with the same ids in the same database.
//!
//! - The TTL contract: the session's `idle_session_timeout` is the TTL, and the
//!   watchdog pings the session at ttl/3, so a holder that stops (a SIGSTOPped
//!   process whose TCP connection stays open) loses the lock when the server
//!   ends its idle session; `client_connection_check_interval` ends a session
//!   whose client went away while it waited.
//! - Fencing: at grant, in the same statement, the token is `max(the key's
//!   last token + 1, the server's clock in µs)`; the last tokens live in the
//!   UNLOGGED table `fencelock_advisory_fences`, which costs no WAL and which
//!   a crash empties (as it ends every hold); the clock floor then keeps
//!   tokens rising, as long as the server's clock does not step back across
//!   the crash. (A sequence, the first design, handed out values before the
//!   WAL that logged them was flushed: after `kill -9` with
//!   `synchronous_commit=off` tokens went back.) No grant waits for a flush.
//! - Waiting: exclusive and shared waiters block in the server
//!   (`pg_advisory_lock` with `lock_timeout` = the time left); semaphore
//!   waiters, and readers refused by permit holders, poll with backoff.
//! - Semaphores: permit `i` is the advisory lock `hashtextextended(key, i)`,
//!   taken with a shared hold of the key's lock, so writers exclude permit
//!   holders. Readers and permit holders, both shared holders of that lock,
//!   exclude each other through marks (`hashtextextended(key, -1)` for readers,
//!   `-2` for permits): each side holds its own mark shared and then tries the
//!   other's exclusively, letting go if that fails; a reader refused so polls.
//!   A key has one permit count while held: a permit holder of `n` also holds
//!   `hashtextextended(key, -1000 - n)` shared, and a request that finds
//!   another count's mark held is refused with an error.

use std::time::Duration;

use fencelock_core::backend::{
    Backoff, Grant, LeaseRef, Released, Renewal, Request, SessionHolds, lease_start,
};
use fencelock_core::{Error, FencingToken, HolderInfo, Key, LockInfo, Mode, Result};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgListener, PgPoolOptions};
use sqlx::{Connection, Row};
use tokio::time::Instant;

use crate::db::{Db, map_err, session_gone};

/// Created on first use with the lease schema.
pub(crate) const SCHEMA: &[&str] = &[
    // The longest TTL a session-mode hold ever had in this database (see
    // `Advisory::gate`). Logged: it must survive a crash.
    r"CREATE TABLE IF NOT EXISTS fencelock_session_ttl (id integer PRIMARY KEY, ttl_ms bigint NOT NULL)",
    // Raises it, durably before it returns whatever the server's
    // `synchronous_commit`; returns the longest TTL now recorded.
    r"CREATE OR REPLACE FUNCTION fencelock_session_ttl_raise(ms bigint) RETURNS bigint
    LANGUAGE plpgsql AS $fl$
    DECLARE
        m bigint;
    BEGIN
        PERFORM set_config('synchronous_commit', 'on', true);
        INSERT INTO fencelock_session_ttl AS t (id, ttl_ms) VALUES (1, ms)
            ON CONFLICT (id) DO UPDATE SET ttl_ms = greatest(t.ttl_ms, excluded.ttl_ms)
            RETURNING t.ttl_ms INTO m;
        RETURN m;
    END
    $fl$",
    // The restart gate (see `Advisory::gate`): per server start
    // (`pg_postmaster_start_time()`), the longest TTL of the advisory holds
    // granted under it, and what the table of earlier versions said when this
    // start was first seen (their holds from before it).
    r"CREATE TABLE IF NOT EXISTS fencelock_restart_gate (started timestamptz PRIMARY KEY, ttl_ms bigint NOT NULL, legacy_ms bigint NOT NULL DEFAULT 0)",
    // How long the gate stays closed (ms; <= 0: open), the TTL recorded under
    // this start, the longest TTL from before it, and this start (µs since
    // the epoch). Notes this start on its first call; forgets earlier starts
    // once their holds are over.
    r"CREATE OR REPLACE FUNCTION fencelock_restart_gate_check(OUT closed_ms float8, OUT recorded_ms bigint, OUT longest_ms bigint, OUT started_us bigint)
    LANGUAGE plpgsql AS $fl$
    DECLARE
        s timestamptz := pg_postmaster_start_time();
    BEGIN
        SELECT g.ttl_ms INTO recorded_ms FROM fencelock_restart_gate g WHERE g.started = s;
        IF NOT FOUND THEN
            INSERT INTO fencelock_restart_gate (started, ttl_ms, legacy_ms)
                VALUES (s, 0, coalesce((SELECT t.ttl_ms FROM fencelock_session_ttl t WHERE t.id = 1), 0))
                ON CONFLICT (started) DO NOTHING;
            recorded_ms := 0;
        END IF;
        SELECT greatest(coalesce(max(g.ttl_ms) FILTER (WHERE g.started <> s), 0),
                        coalesce(max(g.legacy_ms) FILTER (WHERE g.started = s), 0))
            INTO longest_ms FROM fencelock_restart_gate g;
        closed_ms := longest_ms - extract(epoch FROM clock_timestamp() - s) * 1000;
        started_us := (extract(epoch FROM s) * 1000000)::bigint;
        IF closed_ms <= 0 AND EXISTS (SELECT 1 FROM fencelock_restart_gate g WHERE g.started <> s) THEN
            DELETE FROM fencelock_restart_gate g WHERE g.started <> s;
        END IF;
    END
    $fl$",
    // Raises this start's TTL, durably before it returns whatever the
    // server's `synchronous_commit`; returns it.
    r"CREATE OR REPLACE FUNCTION fencelock_restart_gate_raise(ms bigint) RETURNS bigint
    LANGUAGE plpgsql AS $fl$
    DECLARE
        m bigint;
    BEGIN
        PERFORM set_config('synchronous_commit', 'on', true);
        INSERT INTO fencelock_restart_gate AS g (started, ttl_ms) VALUES (pg_postmaster_start_time(), ms)
            ON CONFLICT (started) DO UPDATE SET ttl_ms = greatest(g.ttl_ms, excluded.ttl_ms)
            RETURNING g.ttl_ms INTO m;
        RETURN m;
    END
    $fl$",
    // Each key's last token (see the module docs); also the keys `list` and
    // `inspect` look at. UNLOGGED: no WAL, emptied by a crash.
    r"CREATE UNLOGGED TABLE IF NOT EXISTS fencelock_advisory_fences (key text PRIMARY KEY, fence bigint NOT NULL)",
    // Called in the statement that took the lock: the token, the TTL contract
    // and `fl:<token>:<owner>` as the session's name for inspection.
    r"CREATE OR REPLACE FUNCTION fencelock_advisory_granted(k text, o text, ttl_ms bigint) RETURNS bigint
    LANGUAGE plpgsql AS $fl$
    DECLARE
        f bigint;
    BEGIN
        INSERT INTO fencelock_advisory_fences AS t (key, fence)
            VALUES (k, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint)
            ON CONFLICT (key) DO UPDATE SET fence = greatest(t.fence + 1, excluded.fence)
            RETURNING t.fence INTO f;
        PERFORM set_config('idle_session_timeout', ttl_ms::text, false);
        PERFORM set_config('application_name', left('fl:' || f || ':' || o, 63), false);
        RETURN f;
    END
    $fl$",
    // wait_ms < 0: try once; 0: wait forever; else wait that long. Returns the
    // token, NULL when not taken in time, -1 when semaphore permits hold the key
    // (a reader let go again: readers and permit holders exclude each other —
    // each side marks its kind with a shared lock first and then tries the
    // other kind's mark exclusively, so of two racers at least one sees the other).
    r"CREATE OR REPLACE FUNCTION fencelock_advisory_take(k text, o text, shared boolean, wait_ms bigint, ttl_ms bigint)
    RETURNS bigint LANGUAGE plpgsql AS $fl$
    DECLARE
        id bigint := hashtextextended(k, 0);
    BEGIN
        IF wait_ms < 0 THEN
            IF NOT (CASE WHEN shared THEN pg_try_advisory_lock_shared(id) ELSE pg_try_advisory_lock(id) END) THEN
                RETURN NULL;
            END IF;
        ELSE
            PERFORM set_config('lock_timeout', wait_ms::text, true);
            BEGIN
                IF shared THEN
                    PERFORM pg_advisory_lock_shared(id);
                ELSE
                    PERFORM pg_advisory_lock(id);
                END IF;
            EXCEPTION WHEN lock_not_available THEN
                RETURN NULL;
            END;
        END IF;
        IF shared THEN
            PERFORM pg_advisory_lock_shared(hashtextextended(k, -1));
            IF NOT pg_try_advisory_lock(hashtextextended(k, -2)) THEN
                PERFORM pg_advisory_unlock_all();
                RETURN -1;
            END IF;
            PERFORM pg_advisory_unlock(hashtextextended(k, -2));
        END IF;
        RETURN fencelock_advisory_granted(k, o, ttl_ms);
    END
    $fl$",
    r"CREATE OR REPLACE FUNCTION fencelock_advisory_permit(k text, o text, permits integer, ttl_ms bigint)
    RETURNS TABLE (tok bigint, slot integer) LANGUAGE plpgsql AS $fl$
    DECLARE
        first integer := floor(random() * permits)::integer;
        s integer;
    BEGIN
        IF NOT pg_try_advisory_lock_shared(hashtextextended(k, 0)) THEN
            RETURN;
        END IF;
        -- Readers hold the key: let go (see fencelock_advisory_take).
        PERFORM pg_advisory_lock_shared(hashtextextended(k, -2));
        IF NOT pg_try_advisory_lock(hashtextextended(k, -1)) THEN
            PERFORM pg_advisory_unlock_all();
            RETURN;
        END IF;
        PERFORM pg_advisory_unlock(hashtextextended(k, -1));
        -- A key has one permit count while held: each holder marks its count
        -- (shared) and then looks for another count's mark, so of two racers
        -- with different counts at least one sees the other.
        PERFORM pg_advisory_lock_shared(hashtextextended(k, -1000 - permits));
        IF EXISTS (
            SELECT 1 FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND ((l.classid::bigint << 32) | l.objid::bigint) IN (
                  SELECT hashtextextended(k, -1000 - c) FROM generate_series(1, 1024) c WHERE c <> permits)
        ) THEN
            PERFORM pg_advisory_unlock_all();
            RAISE EXCEPTION 'semaphore % is held with another permit count; asked with % permits (a key has one permit count while anyone holds it: use the same count everywhere, or change it only while the key is free)',
                k, permits USING ERRCODE = 'FL001';
        END IF;
        FOR i IN 0 .. permits - 1 LOOP
            s := (first + i) % permits + 1;
            IF pg_try_advisory_lock(hashtextextended(k, s)) THEN
                RETURN QUERY SELECT fencelock_advisory_granted(k, o, ttl_ms), s;
                RETURN;
            END IF;
        END LOOP;
        PERFORM pg_advisory_unlock_all();
    END
    $fl$",
    // Lets go of the hold (false if the session did not have it), then of
    // anything else (a session serves one hold), and makes the session fit for
    // the idle list again.
    r"CREATE OR REPLACE FUNCTION fencelock_advisory_let_go(k text, shared boolean, slot integer) RETURNS boolean
    LANGUAGE plpgsql AS $fl$
    DECLARE
        held boolean;
    BEGIN
        IF slot > 0 THEN
            held := pg_advisory_unlock(hashtextextended(k, slot));
            held := pg_advisory_unlock_shared(hashtextextended(k, 0)) AND held;
        ELSIF shared THEN
            held := pg_advisory_unlock_shared(hashtextextended(k, 0));
        ELSE
            held := pg_advisory_unlock(hashtextextended(k, 0));
        END IF;
        PERFORM pg_advisory_unlock_all();
        PERFORM set_config('idle_session_timeout', '0', false);
        PERFORM set_config('application_name', 'fencelock', false);
        RETURN held;
    END
    $fl$",
];

/// Advisory lock ids of a key (seed 0) and its permits (seeds 1…) as `pg_locks`
/// shows them: `(classid << 32) | objid`, for granted advisory locks.
const HOLDERS: &str = "
    SELECT a.application_name AS owner, l.mode AS lmode, l.objid, l.classid,
           ((l.classid::bigint << 32) | l.objid::bigint) AS id
    FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())";

/// The most permits a semaphore may have in advisory mode: the seeds of the
/// permits' and counts' lock ids that inspection, `force_release` and the
/// one-count check look at.
const MAX_PERMIT_SEED: i32 = 1024;

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

/// The channel the server watch listens on (nothing is sent on it: the
/// listening session only waits, idle, for the server to end it).
const WATCH_CHANNEL: &str = "fencelock_server_watch";

/// This backend's holds, each on a session of its own, and idle sessions.
pub(crate) struct Advisory {
    options: PgConnectOptions,
    addr: String,
    holds: SessionHolds<PgConnection>,
    /// The server start the gate last saw (µs since the epoch) and the
    /// longest TTL known to be recorded durably under it (ms).
    recorded: std::sync::Mutex<(i64, i64)>,
    /// The server watcher runs (started with the first hold).
    watching: std::sync::atomic::AtomicBool,
}

impl Advisory {
    pub(crate) fn new(options: PgConnectOptions, addr: String, max_idle: usize) -> Advisory {
        Advisory {
            // A wait in `pg_advisory_lock` lasts as long as its caller's
            // wait, whatever statement timeout the database or role sets.
            options: options.options([
                ("client_connection_check_interval", "1000"),
                ("statement_timeout", "0"),
            ]),
            addr,
            holds: SessionHolds::new("pg-advisory", max_idle),
            recorded: std::sync::Mutex::new((0, -1)),
            watching: std::sync::atomic::AtomicBool::new(false),
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

    /// A session, and whether it was reused (a reused idle session may have
    /// been ended by the server meanwhile: a restart ends every session);
    /// `None` if a new session's [`Advisory::gate`] does not open by the end
    /// of `wait`. While the gate is closed it waits without a session (a
    /// server's idle timeout cannot end it) and asks again when it should
    /// open.
    async fn session(&self, wait: Option<Option<Instant>>) -> Result<Option<(PgConnection, bool)>> {
        if let Some((c, _)) = self.holds.take_idle() {
            return Ok(Some((c, true)));
        }
        let mut told = false;
        loop {
            let mut c = PgConnection::connect_with(&self.options)
                .await
                .map_err(|e| self.err(e))?;
            let Some(closed) = self.gate(&mut c).await? else {
                return Ok(Some((c, false)));
            };
            drop(c);
            let deadline = match wait {
                None => return Ok(None),
                Some(d) => d,
            };
            if !std::mem::replace(&mut told, true) {
                tracing::warn!(
                    server = %self.addr,
                    "the server restarted {} ago: advisory locks are granted only in {}, once the holds from before the restart (TTL up to {}) have lapsed; an operator who knows every such holder is dead may delete the rows of fencelock_restart_gate and of fencelock_session_ttl (the table of earlier versions)",
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
    /// restart no session grants anything until the server has been up for
    /// the longest TTL an advisory hold had under an earlier start (recorded
    /// durably, per start, before each grant that raises it); holds granted
    /// since the start never close it. A session that passed it is good for
    /// as long as it lives: a restart ends it too. `None` if open.
    async fn gate(&self, conn: &mut PgConnection) -> Result<Option<Closed>> {
        let (closed_ms, recorded, longest, started): (f64, i64, i64, i64) =
            sqlx::query_as("SELECT * FROM fencelock_restart_gate_check()")
                .fetch_one(&mut *conn)
                .await
                .map_err(|e| self.err(e))?;
        // What the table says now (an operator may have deleted the row, the
        // server restarted): the next grant records its TTL again if that is
        // less.
        *self.recorded.lock().unwrap_or_else(|p| p.into_inner()) = (started, recorded);
        if closed_ms <= 0.0 {
            return Ok(None);
        }
        let longest_ttl = Duration::from_millis(longest.max(0) as u64);
        let opens_in = Duration::from_secs_f64(closed_ms / 1000.0);
        Ok(Some(Closed {
            opens_in,
            longest_ttl,
            restarted_ago: longest_ttl.saturating_sub(opens_in),
        }))
    }

    /// Records `ttl` as a session-mode TTL of this server start (durably)
    /// before a grant of it, unless a TTL as long is known to be recorded.
    async fn record_ttl(&self, conn: &mut PgConnection, ttl: Duration) -> Result<()> {
        let ms = ttl.as_millis().min(i64::MAX as u128) as i64;
        let (started, recorded) = *self.recorded.lock().unwrap_or_else(|p| p.into_inner());
        if recorded >= ms {
            return Ok(());
        }
        let now: i64 = sqlx::query_scalar("SELECT fencelock_restart_gate_raise($1)")
            .bind(ms)
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| self.err(e))?;
        let mut r = self.recorded.lock().unwrap_or_else(|p| p.into_inner());
        if r.0 == started {
            r.1 = r.1.max(now);
        }
        Ok(())
    }

    /// Acquires on a session of its own. `wait`: `None` tries once, `Some(None)`
    /// waits forever, `Some(Some(deadline))` waits until then.
    pub(crate) async fn acquire(
        &self,
        req: &Request,
        wait: Option<Option<Instant>>,
    ) -> Result<Option<Grant>> {
        if let Mode::Semaphore { permits } = req.mode
            && permits > MAX_PERMIT_SEED as u32
        {
            return Err(Error::config(format!(
                "a semaphore of {permits} permits: advisory mode allows at most {MAX_PERMIT_SEED}; use mode=lease"
            )));
        }
        let requested_at = Instant::now();
        if let Some(grant) = self.holds.reenter(req, requested_at, ping).await? {
            return Ok(Some(grant));
        }
        let mut backoff = Backoff::new(Duration::from_millis(2), Duration::from_millis(200));
        loop {
            match self.take(req, wait).await? {
                Taken::Granted(grant) => return Ok(Some(grant)),
                Taken::No => return Ok(None),
                // A reader refused by semaphore permits: they are not queued in
                // the server, so poll until the deadline.
                Taken::OtherKind => {
                    let deadline = match wait {
                        None => return Ok(None),
                        Some(d) => d,
                    };
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Ok(None);
                    }
                    backoff.sleep(deadline, None).await;
                }
            }
        }
    }

    /// One try (waiting in the server as `wait` says) on a session of its own.
    async fn take(&self, req: &Request, wait: Option<Option<Instant>>) -> Result<Taken> {
        let requested_at = Instant::now();
        let (mut conn, taken) = loop {
            let Some((mut conn, reused)) = self.session(wait).await? else {
                return Ok(Taken::No);
            };
            match self.record_ttl(&mut conn, req.ttl).await {
                Err(e) if reused && e.is_transient() => continue,
                r => r?,
            }
            match self.take_on(&mut conn, req, wait).await {
                // An idle session the server ended meanwhile: take a new one.
                Err(e) if reused && session_gone(&e) => continue,
                // On an error the connection is dropped: closing the session
                // lets go of anything it may have taken.
                taken => break (conn, taken.map_err(|e| self.err(e))?),
            }
        };
        let Some((token, slot)) = taken.filter(|(token, _)| *token >= 0) else {
            self.holds.put_idle(conn, 0);
            return Ok(if taken.is_some() {
                Taken::OtherKind
            } else {
                Taken::No
            });
        };
        let requested_at = lease_start(requested_at, req.ttl, &mut conn, ping)
            .await
            .map_err(|e| Error::connection(crate::NAME, &self.addr, e))?;
        let grant = self
            .holds
            .insert(req, token as u64, slot as u32, conn, requested_at);
        self.watch_server();
        Ok(Taken::Granted(grant))
    }

    /// The statement of one try on `conn`: `(token, slot)` if taken (a
    /// negative token: refused by the other kind of shared holder).
    async fn take_on(
        &self,
        conn: &mut PgConnection,
        req: &Request,
        wait: Option<Option<Instant>>,
    ) -> std::result::Result<Option<(i64, i32)>, sqlx::Error> {
        let ttl_ms = req.ttl.as_millis().min(i32::MAX as u128) as i64;
        match req.mode {
            Mode::Semaphore { permits } => {
                sqlx::query("SELECT tok, slot FROM fencelock_advisory_permit($1, $2, $3, $4)")
                    .bind(req.key.as_str())
                    .bind(req.owner.as_str())
                    .bind(permits.min(i32::MAX as u32) as i32)
                    .bind(ttl_ms)
                    .fetch_optional(&mut *conn)
                    .await
                    .and_then(|row| {
                        row.map(|r| Ok((r.try_get::<i64, _>(0)?, r.try_get::<i32, _>(1)?)))
                            .transpose()
                    })
            }
            _ => {
                let wait_ms: i64 = match wait {
                    None => -1,
                    Some(None) => 0,
                    Some(Some(deadline)) => {
                        let left = deadline
                            .saturating_duration_since(Instant::now())
                            .as_millis();
                        if left == 0 {
                            -1
                        } else {
                            left.min(i32::MAX as u128) as i64
                        }
                    }
                };
                sqlx::query_scalar::<_, Option<i64>>(
                    "SELECT fencelock_advisory_take($1, $2, $3, $4, $5)",
                )
                .bind(req.key.as_str())
                .bind(req.owner.as_str())
                .bind(req.mode == Mode::Shared)
                .bind(wait_ms)
                .bind(ttl_ms)
                .fetch_one(&mut *conn)
                .await
                .map(|token| token.map(|t| (t, 0)))
            }
        }
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
        match sqlx::query_scalar::<_, bool>("SELECT fencelock_advisory_let_go($1, $2, $3)")
            .bind(last.key.as_str())
            .bind(last.mode == Mode::Shared)
            .bind(last.slot as i32)
            .fetch_one(&mut conn)
            .await
        {
            Ok(true) => {
                self.holds.put_idle(conn, 0);
                Ok(Released::new(0))
            }
            Ok(false) => Err(not_held()),
            Err(e) if session_gone(&e) => Err(not_held()),
            // Dropping the connection ends the session, and the lock with it.
            Err(e) => Err(self.err(e)),
        }
    }
}

/// Ends every session holding `key` or one of its permits (an operator breaking
/// the lock; the holders' next renewal reports it lost).
pub(crate) async fn force_release(db: &Db, key: &Key) -> Result<()> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT pg_terminate_backend(a.pid) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
           AND ((l.classid::bigint << 32) | l.objid::bigint) IN
               (SELECT hashtextextended($1, s) FROM generate_series(0, {MAX_PERMIT_SEED}) s)"
    )))
    .bind(key.as_str())
    .execute(&db.pool)
    .await
    .map_err(db.err())?;
    Ok(())
}

/// Holders as `pg_locks` shows them, named by their sessions'
/// `application_name` (`fl:<token>:<owner>`, the owner cut to fit 63 bytes).
/// Holds are not counted; the last token is known only while the lock is held.
pub(crate) async fn inspect(db: &Db, key: &Key) -> Result<Option<LockInfo>> {
    let known: Option<i32> =
        sqlx::query_scalar("SELECT 1 FROM fencelock_advisory_fences WHERE key = $1")
            .bind(key.as_str())
            .fetch_optional(&db.pool)
            .await
            .map_err(db.err())?;
    if known.is_none() {
        return Ok(None);
    }
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT h.owner, h.lmode, h.id = hashtextextended($1, 0) AS main FROM ({HOLDERS}) h
         WHERE h.id IN (SELECT hashtextextended($1, s) FROM generate_series(0, {MAX_PERMIT_SEED}) s)"
    )))
    .bind(key.as_str())
    .fetch_all(&db.pool)
    .await
    .map_err(db.err())?;
    // The key's permit count, as its holders mark it (see
    // `fencelock_advisory_permit`).
    let count: Option<i32> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT c FROM generate_series(1, {MAX_PERMIT_SEED}) c
         WHERE hashtextextended($1, -1000 - c) IN (SELECT h.id FROM ({HOLDERS}) h) LIMIT 1"
    )))
    .bind(key.as_str())
    .fetch_optional(&db.pool)
    .await
    .map_err(db.err())?;
    let mut in_use = 0;
    let mut parsed = Vec::new();
    for row in &rows {
        let name: String = row.try_get("owner").map_err(db.err())?;
        let lmode: String = row.try_get("lmode").map_err(db.err())?;
        let main: bool = row.try_get("main").map_err(db.err())?;
        in_use += u32::from(!main);
        let (token, owner) = match name.strip_prefix("fl:").and_then(|r| r.split_once(':')) {
            Some((t, o)) => (t.parse::<u64>().ok().map(FencingToken::new), o.to_string()),
            None => (None, name),
        };
        parsed.push((owner, lmode, main, token));
    }
    let mut holders = Vec::new();
    for (owner, lmode, main, token) in parsed {
        let mode = match (main, lmode.as_str()) {
            (true, "ExclusiveLock") => Mode::Exclusive,
            (true, _) if in_use > 0 => continue, // a permit holder's shared hold
            (true, _) => Mode::Shared,
            // Without a mark (a holder between its permit and its mark), the
            // permits in use.
            (false, _) => Mode::Semaphore {
                permits: count.map_or(in_use, |c| c.unsigned_abs()),
            },
        };
        holders.push(HolderInfo::new(owner, mode, 1, token, None));
    }
    let last = holders.iter().filter_map(|h| h.token).max();
    Ok(Some(LockInfo::new(key.as_str(), holders, last)))
}

pub(crate) async fn held_keys(db: &Db, prefix: &str) -> Result<Vec<String>> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT k.key FROM fencelock_advisory_fences k
         WHERE starts_with(k.key, $1) AND hashtextextended(k.key, 0) IN (SELECT h.id FROM ({HOLDERS}) h)
         ORDER BY k.key"
    )))
    .bind(prefix)
    .fetch_all(&db.pool)
    .await
    .map_err(db.err())
}

/// Keeps a session of its own open: when the server ends it (a restart or
/// crash ends every session at once), the holds' sessions are pinged at once,
/// so their `lost()` fires before another client can be granted the lock on
/// the restarted server — not at their next renewal.
///
/// The session idles in a `LISTEN` and never runs a statement while it waits:
/// a running statement holds a snapshot, and the oldest snapshot of any
/// session bounds what VACUUM may remove in every table of the cluster (the
/// fence rows' dead versions, one per grant, and the user's own).
async fn watch_server(options: PgConnectOptions, watch: fencelock_core::backend::SessionWatch) {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .max_lifetime(None)
        .idle_timeout(None)
        // A server that does not take sessions is reported soon (the pool
        // would otherwise try to connect for 30 s).
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(options);
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    while watch.alive() {
        let listener = match PgListener::connect_with(&pool).await {
            Ok(mut l) => l.listen(WATCH_CHANNEL).await.map(|()| l),
            Err(e) => Err(e),
        };
        let Ok(mut listener) = listener else {
            // The server does not take sessions now: those of the holds may
            // be gone too (the pings tell).
            watch.sessions_may_have_ended();
            backoff.sleep(None, None).await;
            continue;
        };
        backoff.reset();
        while watch.alive() {
            // Woken now and then to see whether the backend is still in use.
            match tokio::time::timeout(Duration::from_secs(5), listener.try_recv()).await {
                Err(_) | Ok(Ok(Some(_))) => {}
                // The connection closed (`None`) or failed.
                Ok(Ok(None) | Err(_)) => {
                    tracing::debug!("the server ended the watching session; pinging every hold");
                    watch.sessions_may_have_ended();
                    break;
                }
            }
        }
    }
}

/// One round trip on a held session: it is alive (and its idle timeout
/// restarts).
async fn ping(c: &mut PgConnection) -> std::result::Result<(), String> {
    sqlx::query("SELECT 1")
        .execute(c)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// How one try of [`Advisory::take`] ended.
enum Taken {
    Granted(Grant),
    /// Not taken (busy, or the wait ran out).
    No,
    /// A reader refused because semaphore permits hold the key.
    OtherKind,
}
