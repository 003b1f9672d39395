//! Lease mode: holders are rows of `fencelock_locks`, expiring by the server's
//! clock (`NOW(6)`); the row whose owner is empty keeps the key's fence and is
//! never deleted, so tokens keep rising.
//!
//! An acquire is one short transaction: upsert the fence row (which locks it,
//! serializing every change of the key), read the holders, decide with the
//! core's [`admit`] rule, write, commit. Release and renew are single
//! statements plus, for the batched renew, one read in the same transaction.

use std::time::Duration;

use fencelock_core::backend::{Admission, LeaseRef, Released, Renewal, Request, admit};
use fencelock_core::{Error, FencingToken, HolderInfo, Key, LockInfo, Mode, Result};
use sqlx::{MySqlConnection, Row};

use crate::NAME;
use crate::db::{Db, is_conflict, is_lock_wait_timeout};

/// When to ask again after the key's row stayed locked past the lock wait
/// timeout.
const BUSY_RETRY: Duration = Duration::from_millis(500);
use crate::turnstile::{self, TURN_SQL};

pub(crate) const SCHEMA: &str = r"CREATE TABLE IF NOT EXISTS fencelock_locks (
    lock_key   VARBINARY(256) NOT NULL,
    owner      VARBINARY(256) NOT NULL,
    mode       VARCHAR(40)    NOT NULL,
    holds      INT            NOT NULL,
    fence      BIGINT         NOT NULL,
    expires_at DATETIME(6)    NOT NULL,
    PRIMARY KEY (lock_key, owner)
) ENGINE=InnoDB";

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// One holder row as read inside the acquire transaction.
struct Row_ {
    owner: String,
    mode: Mode,
    holds: u32,
    fence: u64,
    left_us: i64,
}

/// Where a request stands in the key's line of exclusive waiters
/// (`turnstile.rs`; MariaDB only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Line {
    /// No line (MySQL; shared and semaphore requests): a free lock is taken.
    Off,
    /// Not the head: a free lock is refused while a head waits.
    Behind,
    /// The head, on the session with this connection id.
    Head(i64),
}

impl Line {
    /// Whether a grant must be refused, given the turnstile's session (`head`).
    fn defers_to(self, head: Option<i64>) -> bool {
        match self {
            Line::Off => false,
            Line::Behind => head.is_some(),
            Line::Head(me) => head.is_some_and(|h| h != me),
        }
    }
}

/// The key's fence, its holders, and (unless `line` is off) the session at
/// the head of its line.
async fn holders(
    conn: &mut MySqlConnection,
    db: &Db,
    key: &Key,
    line: Line,
) -> Result<(u64, Vec<Row_>, Option<i64>)> {
    let head_sql = if line == Line::Off {
        "CAST(NULL AS SIGNED)".to_string()
    } else {
        format!("CAST(IS_USED_LOCK({TURN_SQL}) AS SIGNED)")
    };
    // Only a constant expression is formatted in: the key is bound.
    let mut q = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT owner, mode, holds, fence, TIMESTAMPDIFF(MICROSECOND, NOW(6), expires_at) AS left_us,
                {head_sql} AS head
         FROM fencelock_locks WHERE lock_key = ? FOR UPDATE"
    )));
    if line != Line::Off {
        q = q.bind(key.as_str());
    }
    let rows = q
        .bind(key.as_str().as_bytes())
        .fetch_all(&mut *conn)
        .await
        .map_err(db.err())?;
    let mut fence = 0;
    let mut head = None;
    let mut out = Vec::new();
    for r in rows {
        head = head.or(r.try_get::<Option<i64>, _>("head").map_err(db.err())?);
        let owner: Vec<u8> = r.try_get("owner").map_err(db.err())?;
        let f: i64 = r.try_get("fence").map_err(db.err())?;
        if owner.is_empty() {
            fence = f as u64;
            continue;
        }
        let mode: String = r.try_get("mode").map_err(db.err())?;
        out.push(Row_ {
            owner: String::from_utf8_lossy(&owner).into_owned(),
            mode: Mode::parse(&mode).map_err(|e| Error::backend(NAME, e))?,
            holds: r.try_get::<i32, _>("holds").map_err(db.err())? as u32,
            fence: f as u64,
            left_us: r.try_get("left_us").map_err(db.err())?,
        });
    }
    Ok((fence, out, head))
}

/// One acquire attempt: `Ok(token, holds)` or `Err(time until the first
/// holder expires)` (zero if the lock is free but `line` defers to its head).
///
/// InnoDB may pick the transaction as a deadlock victim (first inserts of
/// neighbouring keys touch the same index gap); it is then retried.
pub(crate) async fn attempt(
    db: &Db,
    req: &Request,
    line: Line,
) -> Result<std::result::Result<(u64, u32), Duration>> {
    let mut tries = 0;
    loop {
        match attempt_once(db, req, line).await {
            // Another transaction kept the key's row locked past the lock
            // wait timeout (a frozen client, until the server ends it): busy.
            Err(e) if is_lock_wait_timeout(&e) => return Ok(Err(BUSY_RETRY)),
            Err(e) if is_conflict(&e) && tries < 5 => tries += 1,
            done => return done,
        }
    }
}

async fn attempt_once(
    db: &Db,
    req: &Request,
    line: Line,
) -> Result<std::result::Result<(u64, u32), Duration>> {
    let mut tx = db.pool.begin().await.map_err(db.err())?;
    let key = req.key.as_str().as_bytes();
    // Creates the fence row if needed, and locks it either way.
    sqlx::query(
        "INSERT INTO fencelock_locks (lock_key, owner, mode, holds, fence, expires_at)
         VALUES (?, '', '', 0, 0, '9999-12-31') ON DUPLICATE KEY UPDATE holds = holds",
    )
    .bind(key)
    .execute(&mut *tx)
    .await
    .map_err(db.err())?;
    let (fence, all, head) = holders(&mut tx, db, &req.key, line).await?;
    let (live, expired): (Vec<Row_>, Vec<Row_>) = all.into_iter().partition(|r| r.left_us > 0);
    if !expired.is_empty() {
        sqlx::query("DELETE FROM fencelock_locks WHERE lock_key = ? AND owner <> '' AND expires_at <= NOW(6)")
            .bind(key)
            .execute(&mut *tx)
            .await
            .map_err(db.err())?;
    }
    let ttl_us = micros(req.ttl);
    let outcome = match admit(
        req.key.as_str(),
        live.iter().map(|r| (r.owner.as_str(), r.mode)),
        req.owner.as_str(),
        req.mode,
    )? {
        Admission::Reenter { index } => {
            let r = &live[index];
            let holds = r.holds + u32::from(req.reentrant);
            sqlx::query(
                "UPDATE fencelock_locks SET holds = ?,
                 expires_at = GREATEST(expires_at, NOW(6) + INTERVAL ? MICROSECOND)
                 WHERE lock_key = ? AND owner = ?",
            )
            .bind(holds as i32)
            .bind(ttl_us)
            .bind(key)
            .bind(req.owner.as_str().as_bytes())
            .execute(&mut *tx)
            .await
            .map_err(db.err())?;
            Ok((r.fence, holds))
        }
        // Free, but another waiter is at the head of the line: it is next.
        Admission::Grant if line.defers_to(head) => Err(Duration::ZERO),
        Admission::Grant => {
            let f = fence + 1;
            sqlx::query("UPDATE fencelock_locks SET fence = ? WHERE lock_key = ? AND owner = ''")
                .bind(f as i64)
                .bind(key)
                .execute(&mut *tx)
                .await
                .map_err(db.err())?;
            sqlx::query(
                "INSERT INTO fencelock_locks (lock_key, owner, mode, holds, fence, expires_at)
                 VALUES (?, ?, ?, 1, ?, NOW(6) + INTERVAL ? MICROSECOND)",
            )
            .bind(key)
            .bind(req.owner.as_str().as_bytes())
            .bind(req.mode.as_label())
            .bind(f as i64)
            .bind(ttl_us)
            .execute(&mut *tx)
            .await
            .map_err(db.err())?;
            Ok((f, 1))
        }
        _ => {
            let left = live.iter().map(|r| r.left_us).min().unwrap_or(0);
            Err(Duration::from_micros(left.max(0) as u64))
        }
    };
    tx.commit().await.map_err(db.err())?;
    Ok(outcome)
}

/// Leases renewed per statement: two statements (an `UPDATE`, a `SELECT`)
/// per this many leases, one per 100.
const RENEW_CHUNK: usize = 200;

pub(crate) async fn renew(db: &Db, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
    let mut tx = db.pool.begin().await.map_err(db.err())?;
    let mut held = std::collections::HashSet::new();
    // Leases of one TTL, RENEW_CHUNK at a time: an UPDATE that extends the
    // unexpired rows of their grants (key, owner and token: an owner whose
    // hold was broken may hold the key again, anew), then a SELECT of those
    // still held.
    let mut ttls: Vec<Duration> = leases.iter().map(|l| l.ttl).collect();
    ttls.sort_unstable();
    ttls.dedup();
    for ttl in ttls {
        let same: Vec<&LeaseRef> = leases.iter().filter(|l| l.ttl == ttl).collect();
        for chunk in same.chunks(RENEW_CHUNK) {
            let grants = vec!["(?, ?, ?)"; chunk.len()].join(", ");
            let update = format!(
                "UPDATE fencelock_locks SET expires_at = GREATEST(expires_at, NOW(6) + INTERVAL ? MICROSECOND)
                 WHERE (lock_key, owner, fence) IN ({grants}) AND owner <> '' AND expires_at > NOW(6)"
            );
            // Only placeholders are formatted in: the values are bound.
            let mut q = sqlx::query(sqlx::AssertSqlSafe(update)).bind(micros(ttl));
            for l in chunk {
                q = q
                    .bind(l.key.as_str().as_bytes())
                    .bind(l.owner.as_str().as_bytes())
                    .bind(fence_of(l));
            }
            q.execute(&mut *tx).await.map_err(db.err())?;
            // Renewed rows now expire a TTL from now at the earliest; expired ones were left alone.
            let select = format!(
                "SELECT lock_key, owner, fence FROM fencelock_locks
                 WHERE (lock_key, owner, fence) IN ({grants}) AND owner <> '' AND expires_at > NOW(6)"
            );
            let mut q = sqlx::query(sqlx::AssertSqlSafe(select));
            for l in chunk {
                q = q
                    .bind(l.key.as_str().as_bytes())
                    .bind(l.owner.as_str().as_bytes())
                    .bind(fence_of(l));
            }
            for row in q.fetch_all(&mut *tx).await.map_err(db.err())? {
                let key: Vec<u8> = row.try_get(0).map_err(db.err())?;
                let owner: Vec<u8> = row.try_get(1).map_err(db.err())?;
                let fence: i64 = row.try_get(2).map_err(db.err())?;
                held.insert((key, owner, Some(fence)));
            }
        }
    }
    tx.commit().await.map_err(db.err())?;
    Ok(leases
        .iter()
        .map(|l| {
            let id = (
                l.key.as_str().as_bytes().to_vec(),
                l.owner.as_str().as_bytes().to_vec(),
                fence_of(l),
            );
            if held.contains(&id) {
                Renewal::Held { ttl: l.ttl }
            } else {
                Renewal::Lost {
                    reason: "no unexpired row for this grant in fencelock_locks".into(),
                }
            }
        })
        .collect())
}

/// Releases one hold. With `line` (MariaDB), the `DELETE` that lets the
/// last hold go also reads the head of the key's line, whose doorbell is then
/// rung.
pub(crate) async fn release(db: &Db, lease: &LeaseRef, line: bool) -> Result<Released> {
    let (key, owner) = (
        lease.key.as_str().as_bytes(),
        lease.owner.as_str().as_bytes(),
    );
    const GONE: &str = "DELETE FROM fencelock_locks
         WHERE lock_key = ? AND owner = ? AND fence = ? AND owner <> '' AND holds <= 1 AND expires_at > NOW(6)";
    if line {
        let gone: Option<Option<i64>> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "{GONE} RETURNING CAST(IS_USED_LOCK({TURN_SQL}) AS SIGNED)"
        )))
        .bind(key)
        .bind(owner)
        .bind(fence_of(lease))
        .bind(lease.key.as_str())
        .fetch_optional(&db.pool)
        .await
        .map_err(db.err())?;
        if let Some(head) = gone {
            if let Some(head) = head {
                turnstile::ring(db, head);
            }
            return Ok(Released::new(0));
        }
    } else {
        let gone = sqlx::query(GONE)
            .bind(key)
            .bind(owner)
            .bind(fence_of(lease))
            .execute(&db.pool)
            .await
            .map_err(db.err())?;
        if gone.rows_affected() == 1 {
            return Ok(Released::new(0));
        }
    }
    // A reentrant hold: one fewer; LAST_INSERT_ID(expr) hands back the count left.
    let fewer = sqlx::query(
        "UPDATE fencelock_locks SET holds = LAST_INSERT_ID(holds - 1)
         WHERE lock_key = ? AND owner = ? AND fence = ? AND owner <> '' AND holds > 1 AND expires_at > NOW(6)",
    )
    .bind(key)
    .bind(owner)
    .bind(fence_of(lease))
    .execute(&db.pool)
    .await
    .map_err(db.err())?;
    if fewer.rows_affected() == 1 {
        return Ok(Released::new(fewer.last_insert_id() as u32));
    }
    Err(Error::NotHeld {
        key: lease.key.to_string(),
        owner: lease.owner.to_string(),
    })
}

/// The token of `lease` as the fence column stores it (`NULL`, matching no
/// row, if it has none).
fn fence_of(lease: &LeaseRef) -> Option<i64> {
    lease.token.and_then(|t| i64::try_from(t.get()).ok())
}

pub(crate) async fn force_release(db: &Db, key: &Key) -> Result<()> {
    sqlx::query("DELETE FROM fencelock_locks WHERE lock_key = ? AND owner <> ''")
        .bind(key.as_str().as_bytes())
        .execute(&db.pool)
        .await
        .map_err(db.err())?;
    Ok(())
}

pub(crate) async fn inspect(db: &Db, key: &Key) -> Result<Option<LockInfo>> {
    let rows = sqlx::query(
        "SELECT owner, mode, holds, fence, TIMESTAMPDIFF(MICROSECOND, NOW(6), expires_at) AS left_us
         FROM fencelock_locks WHERE lock_key = ? AND (owner = '' OR expires_at > NOW(6)) ORDER BY fence",
    )
    .bind(key.as_str().as_bytes())
    .fetch_all(&db.pool)
    .await
    .map_err(db.err())?;
    if rows.is_empty() {
        return Ok(None);
    }
    let mut last = None;
    let mut list = Vec::new();
    for r in rows {
        let owner: Vec<u8> = r.try_get("owner").map_err(db.err())?;
        let fence: i64 = r.try_get("fence").map_err(db.err())?;
        if owner.is_empty() {
            last = (fence > 0).then(|| FencingToken::new(fence as u64));
            continue;
        }
        let mode: String = r.try_get("mode").map_err(db.err())?;
        let holds: i32 = r.try_get("holds").map_err(db.err())?;
        let left: i64 = r.try_get("left_us").map_err(db.err())?;
        list.push(HolderInfo::new(
            String::from_utf8_lossy(&owner).into_owned(),
            Mode::parse(&mode).map_err(|e| Error::backend(NAME, e))?,
            holds as u32,
            Some(FencingToken::new(fence as u64)),
            Some(Duration::from_micros(left.max(0) as u64)),
        ));
    }
    Ok(Some(LockInfo::new(key.as_str(), list, last)))
}

pub(crate) async fn held_keys(db: &Db, prefix: &str) -> Result<Vec<String>> {
    let keys: Vec<Vec<u8>> = sqlx::query_scalar(
        "SELECT DISTINCT lock_key FROM fencelock_locks
         WHERE owner <> '' AND expires_at > NOW(6) AND LEFT(lock_key, ?) = ? ORDER BY lock_key",
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
