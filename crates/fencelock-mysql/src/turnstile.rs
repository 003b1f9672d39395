//! The line of exclusive waiters in lease mode (MariaDB): fairness across
//! processes, and a doorbell a release rings.
//!
//! A waiter that finds the key held queues for the key's *turnstile*, a
//! `GET_LOCK` name of its own taken on a session of its own: the server
//! grants it in the order the waiters asked for it (a waiter whose call is
//! interrupted — by a late ring meant for its seat's earlier turn as head —
//! or runs its hour out asks again, at the back), handing it to the next as
//! the last leaves. The waiter holding it (the *head*) asks for the lease; while it
//! is there, an exclusive request of anyone else that finds the lock free is
//! refused (it queues instead), so a releaser cannot take the lock straight
//! back. Between asks the head sleeps in the server (`SLEEP` while a live
//! holder row remains); a release reads the head's session from the turnstile
//! (`IS_USED_LOCK`, in the `DELETE`'s `RETURNING`) and interrupts that sleep
//! (`KILL QUERY`), so the head asks again at once.
//!
//! None of this is needed for exclusion, which rests on the lease
//! transaction alone: the turnstile only ever makes a request refuse a grant
//! it could have had. What it can cost is time:
//!
//! - a head that stops asking (a paused or cut-off process, a host that
//!   died) keeps every other exclusive request from a free lock until the
//!   server ends its idle session: the turnstile sessions' `wait_timeout` is
//!   [`IDLE_SECS`]; a head whose process dies on a host that stays up leaves
//!   at once (its connection closes);
//! - a `KILL QUERY` the releaser may not send (another user, without
//!   `CONNECTION ADMIN`) or one that arrives between the head's statements
//!   (the server drops it; the head's next check sees the lock free) costs the
//!   head at most its sleep, at most 100 ms;
//! - shared and semaphore requests neither queue nor defer: a writer in line
//!   can wait behind a stream of readers, as without the line;
//! - a process stands at most `pool` waiters in line at once, each on a
//!   session of its own (a *seat*: usually up to twice `pool` connections
//!   with the pool's, briefly more after a seat fails or is cancelled); while
//!   all its places are taken, its other waiters poll as before the line,
//!   taking a free lock even while a head waits (waits on other keys, held up
//!   perhaps by this process's own holds, must not keep them from a free
//!   lock);
//! - any other session that takes a turnstile's name is taken for a head: a
//!   release interrupts its statements.
//!
//! The session a release rings is the one `IS_USED_LOCK` names in the
//! release's own statement; connection ids count up while the server runs, so
//! the `KILL QUERY` reaches that session or, if it has ended, none (a restart
//! of the server between the two statements is the exception).
//!
//! # Leaving
//!
//! A waiter that times out lets its `GET_LOCK` call run out at its deadline.
//! One that is cancelled drops its session; the server checks each second
//! whether the connection of a session waiting in `GET_LOCK` has closed, and
//! ends it then. If no FIN or RST reaches the server (its host down, the
//! network cut), the session stays queued until its call times out: the
//! acquire's deadline, else an hour ([`QUEUE_STEP`]), or sooner if the server's
//! TCP keepalive (`tcp_keepalive_time`) is set shorter; should its turn come
//! first, it holds the line as a head that stopped asking, for up to
//! [`IDLE_SECS`].
//!
//! The name is `<first 58 hex digits of SHA-256(database ␟ key)>␟turn`: never
//! a key (keys hold no control characters) nor a `get_lock`-mode name, and
//! separate per database.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock_core::{Error, Key, Result};
use sqlx::mysql::MySqlConnectOptions;
use sqlx::{Connection, MySqlConnection};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::db::{Db, is_interrupted, map_err};

/// The turnstile's `GET_LOCK` name of a key, server-side (binds: the key).
pub(crate) const TURN_SQL: &str = "CONCAT(LEFT(SHA2(CONCAT(CONVERT(DATABASE() USING utf8mb4), CHAR(31), ?), 256), 58), CHAR(31), 'turn')";

/// A turnstile session idle this long (seconds) is ended by the server: the
/// longest a head that stopped asking keeps others from a free lock.
pub(crate) const IDLE_SECS: u64 = 2;

/// How long one `GET_LOCK` call waits at most before it is sent again. A
/// call sent again goes to the back of the server's queue, so it is long: a
/// waiter that is cancelled does not need it to leave (see "Leaving" above).
const QUEUE_STEP: Duration = Duration::from_secs(3600);

/// A session of the line and its connection id (what `IS_USED_LOCK` names).
pub(crate) struct Seat {
    conn: MySqlConnection,
    pub(crate) id: i64,
    /// One of the process's places in line, while the seat is in use.
    place: Option<OwnedSemaphorePermit>,
}

/// Sessions for the line, opened on demand, kept idle for reuse; at most
/// `seats` in use at once (each is a connection of its own).
pub(crate) struct Turnstile {
    options: MySqlConnectOptions,
    addr: String,
    idle: Mutex<Vec<Seat>>,
    places: Arc<Semaphore>,
    seats: usize,
}

impl Turnstile {
    pub(crate) fn new(options: MySqlConnectOptions, addr: String, seats: usize) -> Self {
        let seats = seats.max(1);
        Turnstile {
            options,
            addr,
            idle: Mutex::new(Vec::new()),
            places: Arc::new(Semaphore::new(seats)),
            seats,
        }
    }

    fn err(&self, e: sqlx::Error) -> Error {
        map_err(&self.addr, e)
    }

    /// One of this process's places in line, if one is free now.
    pub(crate) fn place_now(&self) -> Option<OwnedSemaphorePermit> {
        self.places.clone().try_acquire_owned().ok()
    }

    /// Waits for one of this process's places in line.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future gives up the wait and takes nothing.
    pub(crate) async fn place(&self) -> Result<OwnedSemaphorePermit> {
        self.places
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Error::backend(crate::NAME, "the line's places were closed"))
    }

    /// A seat for `place`: an idle one, or a new session. A reused seat may
    /// have been ended by the server meanwhile (its next statement fails; the
    /// caller takes a new one).
    pub(crate) async fn seat(&self, fresh: bool, place: OwnedSemaphorePermit) -> Result<Seat> {
        if !fresh && let Some(mut s) = self.idle.lock().ok().and_then(|mut v| v.pop()) {
            s.place = Some(place);
            return Ok(s);
        }
        let mut conn = MySqlConnection::connect_with(&self.options)
            .await
            .map_err(|e| self.err(e))?;
        sqlx::query("SET SESSION wait_timeout = ?")
            .bind(IDLE_SECS)
            .execute(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        crate::db::unlimited_statements(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        let id: i64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS SIGNED)")
            .fetch_one(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(Seat {
            conn,
            id,
            place: Some(place),
        })
    }

    /// Keeps a seat that holds no turnstile for reuse; its place goes back.
    fn put_back(&self, mut seat: Seat) {
        seat.place = None;
        if let Ok(mut v) = self.idle.lock()
            && v.len() < self.seats
        {
            v.push(seat);
        }
    }

    /// Queues `seat` for `key`'s turnstile until it is the head (true) or
    /// `deadline` passes (false; the seat holds nothing then).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops the session; the server ends it, and with
    /// it the place in line, when it sees the connection closed (see
    /// "Leaving" above).
    pub(crate) async fn queue(
        &self,
        seat: &mut Seat,
        key: &Key,
        deadline: Option<Instant>,
    ) -> Result<bool> {
        loop {
            let mut step = QUEUE_STEP;
            if let Some(d) = deadline {
                step = step.min(d.saturating_duration_since(Instant::now()));
            }
            // NULL: interrupted (a KILL QUERY meant for the seat's earlier
            // head turn); 0: timed out.
            let got: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT GET_LOCK({TURN_SQL}, ?)"
            )))
            .bind(key.as_str())
            .bind(step.as_secs_f64())
            .fetch_one(&mut seat.conn)
            .await
            .map_err(|e| self.err(e))?;
            if got == Some(1) {
                return Ok(true);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(false);
            }
        }
    }

    /// The head waits for a release: sleeps in the server for at most `max`
    /// while `key` has a live holder. A release's `KILL QUERY` ends it early.
    pub(crate) async fn doorbell(&self, seat: &mut Seat, key: &Key, max: Duration) -> Result<()> {
        let slept = sqlx::query(
            "SELECT IF(EXISTS(SELECT 1 FROM fencelock_locks
                              WHERE lock_key = ? AND owner <> '' AND expires_at > NOW(6)),
                       SLEEP(?), 0)",
        )
        .bind(key.as_str().as_bytes())
        .bind(max.as_secs_f64())
        .execute(&mut seat.conn)
        .await;
        match slept {
            Ok(_) => Ok(()),
            Err(e) if is_interrupted(&e) => Ok(()),
            Err(e) => Err(self.err(e)),
        }
    }

    /// [`Turnstile::leave`] in a task of its own, so that the caller (an
    /// acquire holding a grant) has no await left that could lose it.
    pub(crate) fn leave_later(self: &Arc<Self>, seat: Seat, key: &Key) {
        let (line, key) = (self.clone(), key.clone());
        tokio::spawn(async move { line.leave(seat, &key).await });
    }

    /// Leaves the line: lets the turnstile go and keeps the seat for reuse, or
    /// drops the session if that fails (the server lets go as it ends it).
    async fn leave(&self, mut seat: Seat, key: &Key) {
        let released: sqlx::Result<Option<i64>> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT RELEASE_LOCK({TURN_SQL})"
        )))
        .bind(key.as_str())
        .fetch_one(&mut seat.conn)
        .await;
        if matches!(released, Ok(Some(1))) {
            self.put_back(seat);
        }
    }

    /// Gives back a seat that does not hold the turnstile.
    pub(crate) fn unused(&self, seat: Seat) {
        self.put_back(seat);
    }
}

/// Rings the head's doorbell: interrupts what its session runs (its sleep).
/// Sent from a task of its own, so that a release returns without waiting for
/// it and a cancelled release still rings.
pub(crate) fn ring(db: &Db, head: i64) {
    let db = db.clone();
    tokio::spawn(fencelock_core::backend::tracked(async move {
        if let Err(e) = sqlx::query("KILL QUERY ?")
            .bind(head)
            .execute(&db.pool)
            .await
        {
            // Another user's session without the right to kill it, or one
            // that just ended: the head's sleep runs out instead.
            tracing::debug!(head, error = %e, "mysql lease: could not ring the head of the line");
        }
    }));
}
