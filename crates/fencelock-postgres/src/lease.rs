//! Lease mode: holders are rows of `fencelock_locks`, expiring by the server's
//! clock; each operation is one statement (a PL/pgSQL function for acquire and
//! release, a single `UPDATE … FROM unnest(…)` for the batched renew).

use std::time::Duration;

use fencelock_core::backend::{LeaseRef, Released, Renewal, Request};
use fencelock_core::{Error, FencingToken, HolderInfo, Key, LockInfo, Mode, Result};
use sqlx::Row;

use crate::NAME;
use crate::db::Db;

/// The table and functions, created on first use (idempotent; serialized by an
/// advisory transaction lock so that concurrent first users do not collide).
///
/// One table holds both the holders and, in the row whose owner is `''`, each
/// key's fence: that row is never deleted, so tokens keep rising.
const SCHEMA: &[&str] = &[
    r"CREATE TABLE IF NOT EXISTS fencelock_locks (
        key        text        NOT NULL,
        owner      text        NOT NULL,
        mode       text        NOT NULL,
        holds      integer     NOT NULL,
        fence      bigint      NOT NULL,
        expires_at timestamptz NOT NULL,
        PRIMARY KEY (key, owner)
    )",
    // Exclusive waiters of any process, in the order they came (`seq`): while
    // a live one stands, a free lock goes to the first, and a release hands
    // it there (see `fencelock_hand_on`). A place lapses at `stands_until`
    // unless its wait asks again; `gone` marks a wait that gave up (a late
    // attempt of it grants nothing).
    r"CREATE TABLE IF NOT EXISTS fencelock_waiters (
        key          text        NOT NULL,
        wait_id      text        NOT NULL,
        seq          bigserial   NOT NULL,
        owner        text        NOT NULL,
        ttl_ms       bigint      NOT NULL,
        chan         text,
        attempt      bigint      NOT NULL,
        gone         boolean     NOT NULL DEFAULT false,
        stands_until timestamptz NOT NULL,
        PRIMARY KEY (key, wait_id)
    )",
    // What older versions' tables lack, added only if missing (ALTER TABLE and
    // CREATE INDEX lock the table even when there is nothing to do, and this
    // runs at every connect): `grant_id`, the wait a hold was made for (NULL:
    // none), which leaving that wait takes back; the queue's indexes.
    r"DO $fl$ BEGIN
        IF NOT EXISTS (SELECT 1 FROM pg_attribute
                       WHERE attrelid = 'fencelock_locks'::regclass AND attname = 'grant_id' AND NOT attisdropped) THEN
            ALTER TABLE fencelock_locks ADD COLUMN grant_id text;
        END IF;
        IF to_regclass('fencelock_waiters_order') IS NULL THEN
            CREATE INDEX fencelock_waiters_order ON fencelock_waiters (key, seq);
        END IF;
        IF to_regclass('fencelock_waiters_lapse') IS NULL THEN
            CREATE INDEX fencelock_waiters_lapse ON fencelock_waiters (stands_until);
        END IF;
    END $fl$",
    // Lets the lock go to the first live waiter where it stands, if the key
    // has no holder left: a new token, the waiter's TTL from now, the hold
    // marked as its wait's. If the waiter asked for it (`chan`), the grant is
    // sent there as `wait_id attempt token` (the attempt whose request it
    // answers); else the key's waiters are woken and the waiter's next
    // attempt takes the hold up. True if it handed the lock on. The caller
    // holds the fence row.
    r"CREATE OR REPLACE FUNCTION fencelock_hand_on(k text) RETURNS boolean
    LANGUAGE plpgsql AS $fl$
    DECLARE
        f bigint;
        w record;
    BEGIN
        DELETE FROM fencelock_locks l WHERE l.key = k AND l.owner <> '' AND l.expires_at <= now();
        PERFORM 1 FROM fencelock_locks l WHERE l.key = k AND l.owner <> '';
        IF FOUND THEN
            RETURN false;
        END IF;
        SELECT q.wait_id, q.owner, q.ttl_ms, q.chan, q.attempt INTO w FROM fencelock_waiters q
            WHERE q.key = k AND q.stands_until > now() AND NOT q.gone ORDER BY q.seq LIMIT 1;
        IF NOT FOUND THEN
            RETURN false;
        END IF;
        UPDATE fencelock_locks l SET fence = l.fence + 1 WHERE l.key = k AND l.owner = '' RETURNING l.fence INTO f;
        -- The TTL counts from now, not from the start of this transaction
        -- (`now()`): the attempt the grant names ran before this statement
        -- but may have been sent after the transaction began.
        INSERT INTO fencelock_locks (key, owner, mode, holds, fence, expires_at, grant_id)
            VALUES (k, w.owner, 'exclusive', 1, f, clock_timestamp() + w.ttl_ms * interval '1 millisecond', w.wait_id);
        DELETE FROM fencelock_waiters q WHERE q.key = k AND q.wait_id = w.wait_id;
        -- A grant: durable before it is answered, as every grant.
        PERFORM set_config('synchronous_commit', 'on', true);
        IF w.chan IS NULL THEN
            PERFORM pg_notify('fencelock', k);
        ELSE
            PERFORM pg_notify(w.chan, w.wait_id || ' ' || w.attempt || ' ' || f);
        END IF;
        RETURN true;
    END
    $fl$",
    // One acquire attempt. `wid`: the wait it belongs to (NULL: a try); while
    // refused, an exclusive wait stands in the queue for `stand_ms`, with
    // `chan` if it can be handed the lock there. `barge`: a handoff within one
    // process, which goes ahead of the queue.
    r"CREATE OR REPLACE FUNCTION fencelock_acquire(k text, o text, m text, ttl_ms bigint, reent boolean, permits integer,
        wid text, chan text, attempt bigint, stand_ms bigint, barge boolean)
    RETURNS TABLE (ok boolean, tok bigint, cnt integer, wait bigint)
    LANGUAGE plpgsql AS $fl$
    DECLARE
        f bigint;
        h record;
        n integer;
        all_shared boolean;
        all_sema boolean;
        first_exp timestamptz;
        my_seq bigint;
        my_gone boolean;
        head_seq bigint;
        busy boolean;
        handed boolean := false;
    BEGIN
        -- A grant counts once it is durable, whatever the server, database or
        -- role sets: a grant lost in a crash would let another owner in (and
        -- hand out its token again).
        PERFORM set_config('synchronous_commit', 'on', true);
        INSERT INTO fencelock_locks (key, owner, mode, holds, fence, expires_at)
            VALUES (k, '', '', 0, 0, 'infinity') ON CONFLICT DO NOTHING;
        -- The fence row serializes every change of this key, its queue too.
        SELECT l.fence INTO f FROM fencelock_locks l WHERE l.key = k AND l.owner = '' FOR UPDATE;
        DELETE FROM fencelock_locks l WHERE l.key = k AND l.owner <> '' AND l.expires_at <= now();
        DELETE FROM fencelock_waiters q WHERE q.key = k AND q.stands_until <= now();
        IF wid IS NOT NULL THEN
            SELECT q.seq, q.gone INTO my_seq, my_gone FROM fencelock_waiters q WHERE q.key = k AND q.wait_id = wid;
            IF my_gone THEN
                -- A late attempt of a wait that gave up.
                RETURN QUERY SELECT false, 0::bigint, 0, 0::bigint;
                RETURN;
            END IF;
        END IF;
        SELECT l.mode, l.holds, l.fence, l.grant_id INTO h FROM fencelock_locks l WHERE l.key = k AND l.owner = o;
        IF FOUND THEN
            IF h.mode <> m THEN
                RAISE EXCEPTION 'owner % already holds % as %; a reentrant acquire must ask for the same mode (asked %)',
                    o, k, h.mode, m USING ERRCODE = 'FL001';
            END IF;
            -- Granted: the wait's place, if any, is left.
            IF my_seq IS NOT NULL THEN
                DELETE FROM fencelock_waiters q WHERE q.key = k AND q.wait_id = wid;
            END IF;
            IF wid IS NOT NULL AND h.grant_id = wid THEN
                -- The hold made for this wait (handed where it stood, or an
                -- earlier attempt's): taken up as it is.
                UPDATE fencelock_locks l SET expires_at = greatest(l.expires_at, now() + ttl_ms * interval '1 millisecond')
                    WHERE l.key = k AND l.owner = o;
                RETURN QUERY SELECT true, h.fence, h.holds, 0::bigint;
                RETURN;
            END IF;
            UPDATE fencelock_locks l SET holds = l.holds + reent::int,
                expires_at = greatest(l.expires_at, now() + ttl_ms * interval '1 millisecond')
                WHERE l.key = k AND l.owner = o;
            RETURN QUERY SELECT true, h.fence, h.holds + reent::int, 0::bigint;
            RETURN;
        END IF;
        SELECT count(*), coalesce(bool_and(l.mode = 'shared'), true),
               coalesce(bool_and(l.mode LIKE 'semaphore:%'), true), min(l.expires_at)
            INTO n, all_shared, all_sema, first_exp
            FROM fencelock_locks l WHERE l.key = k AND l.owner <> '';
        -- A key has one permit count while held.
        IF m LIKE 'semaphore:%' THEN
            SELECT l.mode INTO h FROM fencelock_locks l
                WHERE l.key = k AND l.owner <> '' AND l.mode LIKE 'semaphore:%' AND l.mode <> m LIMIT 1;
            IF FOUND THEN
                RAISE EXCEPTION 'semaphore % is held with % permits; asked with % (a key has one permit count while anyone holds it: use the same count everywhere, or change it only while the key is free)',
                    k, substr(h.mode, 11), substr(m, 11) USING ERRCODE = 'FL001';
            END IF;
        END IF;
        busy := n > 0 AND NOT ((m = 'shared' AND all_shared) OR (m LIKE 'semaphore:%' AND all_sema AND n < permits));
        IF NOT busy AND NOT barge THEN
            -- While a live waiter stands in the queue ahead of this request, a
            -- free lock goes to the first (handed to it here, as a release
            -- would), and new shared or semaphore holds wait behind it too
            -- (readers cannot starve a writer).
            SELECT q.seq INTO head_seq FROM fencelock_waiters q
                WHERE q.key = k AND q.stands_until > now() AND NOT q.gone ORDER BY q.seq LIMIT 1;
            IF FOUND AND (my_seq IS NULL OR head_seq < my_seq) THEN
                busy := true;
                IF n = 0 THEN
                    handed := fencelock_hand_on(k);
                    SELECT min(l.expires_at) INTO first_exp FROM fencelock_locks l WHERE l.key = k AND l.owner <> '';
                END IF;
            END IF;
        END IF;
        IF busy THEN
            IF wid IS NOT NULL AND m = 'exclusive' AND stand_ms > 0 THEN
                INSERT INTO fencelock_waiters AS q (key, wait_id, owner, ttl_ms, chan, attempt, stands_until)
                    VALUES (k, wid, o, ttl_ms, chan, attempt, now() + stand_ms * interval '1 millisecond')
                    ON CONFLICT (key, wait_id) DO UPDATE SET owner = EXCLUDED.owner, ttl_ms = EXCLUDED.ttl_ms,
                        chan = EXCLUDED.chan, attempt = EXCLUDED.attempt, stands_until = EXCLUDED.stands_until;
            END IF;
            IF NOT handed THEN
                -- Nothing granted: a place lost in a crash is asked for again.
                PERFORM set_config('synchronous_commit', 'off', true);
            END IF;
            RETURN QUERY SELECT false, 0::bigint, 0,
                coalesce(greatest(0, extract(epoch FROM first_exp - now()) * 1000)::bigint, 0);
            RETURN;
        END IF;
        f := f + 1;
        UPDATE fencelock_locks l SET fence = f WHERE l.key = k AND l.owner = '';
        INSERT INTO fencelock_locks (key, owner, mode, holds, fence, expires_at, grant_id)
            VALUES (k, o, m, 1, f, now() + ttl_ms * interval '1 millisecond', CASE WHEN m = 'exclusive' THEN wid END);
        IF my_seq IS NOT NULL THEN
            DELETE FROM fencelock_waiters q WHERE q.key = k AND q.wait_id = wid;
        END IF;
        RETURN QUERY SELECT true, f, 1, 0::bigint;
    END
    $fl$",
    // Gives one hold back: the holds left, or -1 if `o` holds no live row
    // with token `t` (an owner whose hold was broken may hold the key again,
    // anew: that grant is not this one's).
    // `notify`: let the lock go on to the next waiter (not when the caller
    // hands it over itself): hand it to the first in the queue where it
    // stands, else wake the waiters. A plain release commits without waiting
    // for the WAL flush: if a crash loses it, the row comes back and expires
    // after its TTL — later than asked, never two holders. Grants (a hold
    // handed on) and renewals stay synchronous.
    r"CREATE OR REPLACE FUNCTION fencelock_let_go(k text, o text, t bigint, notify boolean) RETURNS integer
    LANGUAGE plpgsql AS $fl$
    DECLARE
        c integer;
    BEGIN
        -- The fence row first, as in fencelock_acquire: every function locks
        -- a key's rows in that order, so none deadlocks with another.
        PERFORM 1 FROM fencelock_locks l WHERE l.key = k AND l.owner = '' FOR UPDATE;
        SELECT l.holds INTO c FROM fencelock_locks l
            WHERE l.key = k AND l.owner = o AND l.fence = t AND o <> '' AND l.expires_at > now() FOR UPDATE;
        IF NOT FOUND THEN
            RETURN -1;
        END IF;
        IF c > 1 THEN
            UPDATE fencelock_locks l SET holds = l.holds - 1 WHERE l.key = k AND l.owner = o;
            RETURN c - 1;
        END IF;
        DELETE FROM fencelock_locks l WHERE l.key = k AND l.owner = o;
        IF notify AND NOT fencelock_hand_on(k) THEN
            PERFORM set_config('synchronous_commit', 'off', true);
            PERFORM pg_notify('fencelock', k);
        END IF;
        RETURN 0;
    END
    $fl$",
    // Release by `o` and, if that frees the lock, acquire for `n` (the next
    // waiter of the releasing process) in the same transaction: nobody can
    // slip in between. If `n` cannot have it, the lock goes on as after a
    // release.
    r"CREATE OR REPLACE FUNCTION fencelock_hand_over(k text, o text, t bigint, n text, m text, ttl_ms bigint, reent boolean, permits integer)
    RETURNS TABLE (lft integer, ok boolean, tok bigint, cnt integer)
    LANGUAGE plpgsql AS $fl$
    DECLARE
        c integer;
        a record;
    BEGIN
        c := fencelock_let_go(k, o, t, false);
        IF c <> 0 THEN
            RETURN QUERY SELECT c, false, 0::bigint, 0;
            RETURN;
        END IF;
        SELECT * INTO a FROM fencelock_acquire(k, n, m, ttl_ms, reent, permits, NULL, NULL, 0, 0, true);
        IF NOT a.ok AND NOT fencelock_hand_on(k) THEN
            PERFORM pg_notify('fencelock', k);
        END IF;
        RETURN QUERY SELECT 0, a.ok, a.tok, a.cnt;
    END
    $fl$",
    // A wait gives up: it leaves the queue (its place marked gone, so that a
    // late attempt of it grants nothing) and takes back the hold made for it
    // that it did not take up: one hold of it (another acquire of the same
    // owner may have joined it), and if that was the last, the lock goes on.
    // True if it took one back. Also clears places lapsed long ago, of any key.
    r"CREATE OR REPLACE FUNCTION fencelock_leave(k text, wid text, stand_ms bigint) RETURNS boolean
    LANGUAGE plpgsql AS $fl$
    DECLARE
        h record;
    BEGIN
        PERFORM set_config('synchronous_commit', 'on', true);
        -- As acquire does: waits for a first acquire of the key that is still
        -- inserting the fence row (an attempt of this wait may be behind it).
        INSERT INTO fencelock_locks (key, owner, mode, holds, fence, expires_at)
            VALUES (k, '', '', 0, 0, 'infinity') ON CONFLICT DO NOTHING;
        PERFORM 1 FROM fencelock_locks l WHERE l.key = k AND l.owner = '' FOR UPDATE;
        -- (Rows another transaction has locked are skipped: this never waits
        -- for another key's transaction, so it cannot deadlock with one.)
        DELETE FROM fencelock_waiters q WHERE q.ctid IN (
            SELECT o.ctid FROM fencelock_waiters o WHERE o.stands_until < now() - interval '1 minute'
            LIMIT 100 FOR UPDATE SKIP LOCKED);
        INSERT INTO fencelock_waiters AS q (key, wait_id, owner, ttl_ms, chan, attempt, gone, stands_until)
            VALUES (k, wid, '', 0, NULL, 0, true, now() + stand_ms * interval '1 millisecond')
            ON CONFLICT (key, wait_id) DO UPDATE SET gone = true, chan = NULL, stands_until = EXCLUDED.stands_until;
        SELECT l.owner, l.holds INTO h FROM fencelock_locks l
            WHERE l.key = k AND l.owner <> '' AND l.grant_id = wid AND l.expires_at > now() FOR UPDATE;
        IF NOT FOUND THEN
            -- Nothing taken back: a lost leave only lets the place lapse.
            PERFORM set_config('synchronous_commit', 'off', true);
            RETURN false;
        END IF;
        IF h.holds > 1 THEN
            UPDATE fencelock_locks l SET holds = l.holds - 1, grant_id = NULL WHERE l.key = k AND l.owner = h.owner;
            RETURN true;
        END IF;
        DELETE FROM fencelock_locks l WHERE l.key = k AND l.owner = h.owner;
        IF NOT fencelock_hand_on(k) THEN
            PERFORM pg_notify('fencelock', k);
        END IF;
        RETURN true;
    END
    $fl$",
    // The calls of versions before the queue, kept for their clients. Such a
    // client connecting puts its own versions of these back (as they were),
    // which the calls above do not use: it neither stands in the queue nor
    // hands the lock on, and its attempts do not wait for the queue. (So a
    // function whose protocol changes gets a new name: no version's setup
    // may replace what another version calls.)
    r"CREATE OR REPLACE FUNCTION fencelock_acquire(k text, o text, m text, ttl_ms bigint, reent boolean, permits integer)
    RETURNS TABLE (ok boolean, tok bigint, cnt integer, wait bigint)
    LANGUAGE sql AS $fl$
        SELECT * FROM fencelock_acquire(k, o, m, ttl_ms, reent, permits, NULL, NULL, 0, 0, false)
    $fl$",
    r"CREATE OR REPLACE FUNCTION fencelock_release(k text, o text, t bigint, notify boolean) RETURNS integer
    LANGUAGE sql AS $fl$ SELECT fencelock_let_go(k, o, t, notify) $fl$",
    r"CREATE OR REPLACE FUNCTION fencelock_handoff(k text, o text, t bigint, n text, m text, ttl_ms bigint, reent boolean, permits integer)
    RETURNS TABLE (lft integer, ok boolean, tok bigint, cnt integer)
    LANGUAGE sql AS $fl$ SELECT * FROM fencelock_hand_over(k, o, t, n, m, ttl_ms, reent, permits) $fl$",
];

/// Creates the tables and functions of both modes (idempotently).
///
/// One transaction, sent as one message: the server runs it to its end
/// whatever the client does meanwhile, so a client that freezes (a paused VM)
/// or vanishes cannot hold its locks — which would block every other
/// client's setup, and its DDL every lock function. Setups run one at a time
/// (an advisory transaction lock); one that waits longer than 10 s for a lock
/// fails rather than queue everyone behind it.
pub(crate) async fn create_schema(db: &Db) -> Result<()> {
    let mut sql = String::from(
        "BEGIN;\nSET LOCAL lock_timeout = '10s';\n\
         SELECT pg_advisory_xact_lock(hashtextextended('fencelock schema', 0));\n",
    );
    for stmt in SCHEMA.iter().chain(crate::advisory::SCHEMA) {
        sql.push_str(stmt);
        sql.push_str(";\n");
    }
    sql.push_str("COMMIT;");
    let mut conn = db.pool.acquire().await.map_err(db.err())?;
    if let Err(e) = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&mut *conn)
        .await
    {
        // The statements after an error did not run: end the transaction
        // they left open before the connection goes back to the pool.
        let _ = sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await;
        return Err(db.err()(e));
    }
    Ok(())
}

/// Where an attempt stands while refused: the wait it belongs to and how it
/// may be handed the lock there (see `fencelock_hand_on`).
pub(crate) struct Standing<'a> {
    /// The wait's id: holds made for it carry it (`grant_id`).
    pub(crate) wait: &'a str,
    /// The backend's grant channel, if it listens on it already.
    pub(crate) channel: Option<&'a str>,
    /// This attempt's number within the wait (a handed grant names it).
    pub(crate) attempt: u64,
    /// How long the place lasts unless asked for again.
    pub(crate) place: Duration,
}

/// One acquire attempt: `Ok(token, holds)` or `Err(time until the first
/// holder expires or the queue's head must ask again)`. With `standing`, a
/// refused exclusive attempt keeps its wait's place in the key's queue.
pub(crate) async fn attempt(
    db: &Db,
    req: &Request,
    standing: Option<&Standing<'_>>,
) -> Result<std::result::Result<(u64, u32), Duration>> {
    let (ok, token, holds, wait): (bool, i64, i32, i64) = sqlx::query_as(
        "SELECT ok, tok, cnt, wait FROM fencelock_acquire($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, false)",
    )
    .bind(req.key.as_str())
    .bind(req.owner.as_str())
    .bind(req.mode.as_label())
    .bind(req.ttl.as_millis() as i64)
    .bind(req.reentrant)
    .bind(permits(req.mode))
    .bind(standing.map(|s| s.wait))
    .bind(standing.and_then(|s| s.channel))
    .bind(standing.map_or(0, |s| s.attempt as i64))
    .bind(standing.map_or(0, |s| s.place.as_millis() as i64))
    .fetch_one(&db.pool)
    .await
    .map_err(db.err())?;
    Ok(if ok {
        Ok((token as u64, holds as u32))
    } else {
        Err(Duration::from_millis(wait.max(0) as u64))
    })
}

/// The wait `wait` gives up: it leaves `key`'s queue and takes back a hold
/// made for it that it did not take up (passing the lock on). True if it
/// took one back.
pub(crate) async fn leave(db: &Db, key: &Key, wait: &str, place: Duration) -> Result<bool> {
    sqlx::query_scalar("SELECT fencelock_leave($1, $2, $3)")
        .bind(key.as_str())
        .bind(wait)
        .bind(place.as_millis() as i64)
        .fetch_one(&db.pool)
        .await
        .map_err(db.err())
}

pub(crate) async fn renew(db: &Db, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
    let keys: Vec<&str> = leases.iter().map(|l| l.key.as_str()).collect();
    let owners: Vec<&str> = leases.iter().map(|l| l.owner.as_str()).collect();
    let tokens: Vec<Option<i64>> = leases.iter().map(fence_of).collect();
    let ttls: Vec<i64> = leases.iter().map(|l| l.ttl.as_millis() as i64).collect();
    let renewed: Vec<(String, String, i64)> = sqlx::query_as(
        // Durable like a grant (a renewal lost in a crash would let the row
        // expire before the holder's deadline): synchronous_commit pinned on.
        // A lease's row is its grant's: key, owner and token (an owner whose
        // hold was broken may hold the key again, anew). Leases of one grant
        // (a reentrant hold with its own TTL) share a row: it is extended by
        // the longest of their TTLs (an `UPDATE … FROM` with two matching
        // rows would use either).
        "WITH durable AS (SELECT set_config('synchronous_commit', 'on', true))
         UPDATE fencelock_locks l SET expires_at = greatest(l.expires_at, now() + u.ttl * interval '1 millisecond')
         FROM (SELECT k, o, t, max(ttl) AS ttl
               FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[]) AS x(k, o, t, ttl)
               GROUP BY k, o, t) AS u, durable
         WHERE l.key = u.k AND l.owner = u.o AND l.fence = u.t AND u.o <> '' AND l.expires_at > now()
         RETURNING l.key, l.owner, l.fence",
    )
    .bind(&keys)
    .bind(&owners)
    .bind(&tokens)
    .bind(&ttls)
    .fetch_all(&db.pool)
    .await
    .map_err(db.err())?;
    let renewed: std::collections::HashSet<(String, String, Option<i64>)> = renewed
        .into_iter()
        .map(|(k, o, t)| (k, o, Some(t)))
        .collect();
    Ok(leases
        .iter()
        .map(|l| {
            let grant = (
                l.key.as_str().to_string(),
                l.owner.as_str().to_string(),
                fence_of(l),
            );
            if renewed.contains(&grant) {
                Renewal::Held { ttl: l.ttl }
            } else {
                Renewal::Lost {
                    reason: "no unexpired row for this grant in fencelock_locks".into(),
                }
            }
        })
        .collect())
}

pub(crate) async fn release(db: &Db, lease: &LeaseRef) -> Result<Released> {
    let left: i32 = sqlx::query_scalar("SELECT fencelock_let_go($1, $2, $3, true)")
        .bind(lease.key.as_str())
        .bind(lease.owner.as_str())
        .bind(fence_of(lease))
        .fetch_one(&db.pool)
        .await
        .map_err(db.err())?;
    if left < 0 {
        return Err(Error::NotHeld {
            key: lease.key.to_string(),
            owner: lease.owner.to_string(),
        });
    }
    Ok(Released::new(left as u32))
}

/// Releases `lease` and, if the lock became free, grants it to `next`.
pub(crate) async fn handoff(
    db: &Db,
    lease: &LeaseRef,
    next: &Request,
) -> Result<(Released, Option<(u64, u32)>)> {
    let (left, ok, token, holds): (i32, bool, i64, i32) = sqlx::query_as(
        "SELECT lft, ok, tok, cnt FROM fencelock_hand_over($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(lease.key.as_str())
    .bind(lease.owner.as_str())
    .bind(fence_of(lease))
    .bind(next.owner.as_str())
    .bind(next.mode.as_label())
    .bind(next.ttl.as_millis() as i64)
    .bind(next.reentrant)
    .bind(permits(next.mode))
    .fetch_one(&db.pool)
    .await
    .map_err(db.err())?;
    if left < 0 {
        return Err(Error::NotHeld {
            key: lease.key.to_string(),
            owner: lease.owner.to_string(),
        });
    }
    Ok((
        Released::new(left as u32),
        ok.then_some((token as u64, holds as u32)),
    ))
}

/// The token of `lease` as the fence column stores it (`NULL`, matching no
/// row, if it has none).
fn fence_of(lease: &LeaseRef) -> Option<i64> {
    lease.token.and_then(|t| i64::try_from(t.get()).ok())
}

fn permits(mode: Mode) -> i32 {
    match mode {
        Mode::Semaphore { permits } => permits.min(i32::MAX as u32) as i32,
        _ => 0,
    }
}

pub(crate) async fn force_release(db: &Db, key: &Key) -> Result<()> {
    sqlx::query(
        "WITH gone AS (DELETE FROM fencelock_locks WHERE key = $1 AND owner <> '' RETURNING key)
         SELECT pg_notify('fencelock', $1)",
    )
    .bind(key.as_str())
    .execute(&db.pool)
    .await
    .map_err(db.err())?;
    Ok(())
}

pub(crate) async fn inspect(db: &Db, key: &Key) -> Result<Option<LockInfo>> {
    let rows = sqlx::query(
        "SELECT owner, mode, holds, fence, CASE WHEN owner = '' THEN 0 ELSE (extract(epoch FROM expires_at - now()) * 1000)::bigint END AS left_ms
         FROM fencelock_locks WHERE key = $1 AND (owner = '' OR expires_at > now()) ORDER BY fence",
    )
    .bind(key.as_str())
    .fetch_all(&db.pool)
    .await
    .map_err(db.err())?;
    if rows.is_empty() {
        return Ok(None);
    }
    let mut last = None;
    let mut holders = Vec::new();
    for row in rows {
        let owner: String = row.try_get("owner").map_err(db.err())?;
        let fence: i64 = row.try_get("fence").map_err(db.err())?;
        if owner.is_empty() {
            last = (fence > 0).then(|| FencingToken::new(fence as u64));
            continue;
        }
        let mode: String = row.try_get("mode").map_err(db.err())?;
        let holds: i32 = row.try_get("holds").map_err(db.err())?;
        let left: i64 = row.try_get("left_ms").map_err(db.err())?;
        holders.push(HolderInfo::new(
            owner,
            Mode::parse(&mode).map_err(|e| Error::backend(NAME, e))?,
            holds as u32,
            Some(FencingToken::new(fence as u64)),
            Some(Duration::from_millis(left.max(0) as u64)),
        ));
    }
    Ok(Some(LockInfo::new(key.as_str(), holders, last)))
}

pub(crate) async fn held_keys(db: &Db, prefix: &str) -> Result<Vec<String>> {
    sqlx::query_scalar(
        "SELECT DISTINCT key FROM fencelock_locks
         WHERE owner <> '' AND expires_at > now() AND starts_with(key, $1) ORDER BY key",
    )
    .bind(prefix)
    .fetch_all(&db.pool)
    .await
    .map_err(db.err())
}
