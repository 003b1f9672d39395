//! The database lock patterns of the classic articles, for resources that live
//! in PostgreSQL: an optimistic version column, pessimistic `SELECT … FOR
//! UPDATE`, and the fenced write that makes a fencing token count.
//!
//! Each helper names a table and its columns once (identifiers are checked:
//! letters, digits and `_`, optionally `schema.table`), then runs one short
//! statement per call. Rows are addressed by a `bigint` id.
//!
//! # Which one
//!
//! - [`Versioned`] — optimistic concurrency: read a row and its version, compute,
//!   write back only if the version did not move (`UPDATE … SET v = $1, ver =
//!   ver + 1 WHERE id = $2 AND ver = $3`). No lock is held while you compute;
//!   the loser learns it lost and retries. Best when conflicts are rare.
//! - [`lock_rows`] — pessimistic: a transaction that locks rows with `SELECT …
//!   FOR UPDATE` (in id order, so two callers never deadlock each other) under a
//!   `lock_timeout`. A busy row is [`Error::Timeout`]; a deadlock with other code
//!   that locks in another order is a clear [`Error::Backend`] ([`explain`]).
//! - [`Fenced`] — the write of a lock holder: `… WHERE last_token < $token`, so a
//!   holder that paused past its lease (and whose token is therefore older than
//!   the next holder's) cannot overwrite newer data.
//!
//! # Examples
//!
//! A flash sale's stock counter, decremented optimistically:
//!
//! ```
//! use fencelock_postgres::patterns::Versioned;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock_core::Result<()> {
//! let pool = sqlx::PgPool::connect("postgres://postgres:postgres@127.0.0.1:5432/test").await.unwrap();
//! sqlx::query("CREATE TABLE IF NOT EXISTS doc_stock (id bigint PRIMARY KEY, qty bigint NOT NULL, ver bigint NOT NULL)")
//!     .execute(&pool).await.unwrap();
//! sqlx::query("INSERT INTO doc_stock VALUES (1, 10, 0) ON CONFLICT (id) DO UPDATE SET qty = 10, ver = 0")
//!     .execute(&pool).await.unwrap();
//!
//! let stock = Versioned::new("doc_stock", "id", "qty", "ver")?;
//! let (qty, ver): (i64, i64) = stock.read(&pool, 1).await?.expect("row 1 exists");
//! assert!(stock.write(&pool, 1, qty - 1, ver).await?);      // this writer won
//! assert!(!stock.write(&pool, 1, qty - 1, ver).await?);     // a second writer with the same version loses
//! // Or let the helper retry: read, compute, write until it wins.
//! let left = stock.update(&pool, 1, 5, |q: i64| (q > 0).then(|| q - 1)).await?;
//! assert_eq!(left, Some(8));
//! # Ok(()) }
//! ```

use std::time::Duration;

use fencelock_core::{Error, FencingToken, Result};
use sqlx::postgres::{PgConnection, PgRow};
use sqlx::{AssertSqlSafe, Decode, Encode, PgPool, Postgres, Row, Transaction, Type};

use crate::NAME;
use crate::db::map_err;

/// A value the helpers can read and write: any type sqlx maps to a column.
pub trait Value:
    for<'q> Encode<'q, Postgres>
    + for<'r> Decode<'r, Postgres>
    + Type<Postgres>
    + Send
    + Unpin
    + 'static
{
}

impl<T> Value for T where
    T: for<'q> Encode<'q, Postgres>
        + for<'r> Decode<'r, Postgres>
        + Type<Postgres>
        + Send
        + Unpin
        + 'static
{
}

/// Maps errors of statements on `pool`, naming its server in connection errors.
fn pool_err(pool: &PgPool) -> impl Fn(sqlx::Error) -> Error {
    let o = pool.connect_options();
    let addr = format!("{}:{}", o.get_host(), o.get_port());
    move |e| map_err(&addr, e)
}

/// Checks a table or column name; `schema.table` is allowed for tables.
fn ident(what: &str, name: &str, dotted: bool) -> Result<String> {
    let part_ok = |p: &str| {
        let mut chars = p.chars();
        chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
            && p.len() <= 63
    };
    let parts: Vec<&str> = name.split('.').collect();
    let ok = match parts.len() {
        1 => part_ok(name),
        2 if dotted => parts.iter().all(|p| part_ok(p)),
        _ => false,
    };
    if ok {
        Ok(name.to_string())
    } else {
        Err(Error::config(format!(
            "{what} name {name:?}: use letters, digits and _ (not starting with a digit){}",
            if dotted {
                ", optionally schema.table"
            } else {
                ""
            }
        )))
    }
}

/// Maps an error of a statement run in a locking transaction: `lock_timeout`
/// (SQLSTATE 55P03) becomes [`Error::Timeout`], a deadlock (40P01) an
/// [`Error::Backend`] that says what happened and how to avoid it, and
/// connection trouble [`Error::Connection`].
///
/// `what` names the rows or lock for the timeout message.
pub fn explain(what: &str, waited: Duration, e: sqlx::Error) -> Error {
    if let sqlx::Error::Database(db) = &e {
        match db.code().as_deref() {
            Some("55P03") => {
                return Error::Timeout {
                    key: what.to_string(),
                    waited,
                };
            }
            Some("40P01") => {
                return Error::backend(
                    NAME,
                    format!(
                        "deadlock on {what}: two transactions locked the same rows in opposite orders and the server aborted this one ({}); lock rows in one order (lock_rows sorts ids) and retry",
                        db.message()
                    ),
                );
            }
            _ => {}
        }
    }
    map_err("the database server", e)
}

/// Optimistic concurrency by a version column. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct Versioned {
    read: String,
    write: String,
}

impl Versioned {
    /// Names the table, its `bigint` id column, the value column and the
    /// `bigint` version column.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a bad identifier.
    pub fn new(table: &str, id: &str, value: &str, version: &str) -> Result<Versioned> {
        let t = ident("table", table, true)?;
        let (id, v, ver) = (
            ident("column", id, false)?,
            ident("column", value, false)?,
            ident("column", version, false)?,
        );
        Ok(Versioned {
            read: format!("SELECT {v}, {ver} FROM {t} WHERE {id} = $1"),
            write: format!(
                "UPDATE {t} SET {v} = $1, {ver} = {ver} + 1 WHERE {id} = $2 AND {ver} = $3"
            ),
        })
    }

    /// The row's value and version; `None` if there is no such row.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub async fn read<T: Value>(&self, pool: &PgPool, id: i64) -> Result<Option<(T, i64)>> {
        let row: Option<PgRow> = sqlx::query(AssertSqlSafe(self.read.clone()))
            .bind(id)
            .fetch_optional(pool)
            .await
            .map_err(pool_err(pool))?;
        row.map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .transpose()
            .map_err(pool_err(pool))
    }

    /// Writes `value` if the row's version is still `expected`; true if this
    /// writer won (the version is now `expected + 1`), false if another writer
    /// got there first (nothing changed; read again and retry).
    ///
    /// # Errors
    ///
    /// Database errors.
    pub async fn write<T: Value>(
        &self,
        pool: &PgPool,
        id: i64,
        value: T,
        expected: i64,
    ) -> Result<bool> {
        let done = sqlx::query(AssertSqlSafe(self.write.clone()))
            .bind(value)
            .bind(id)
            .bind(expected)
            .execute(pool)
            .await
            .map_err(pool_err(pool))?;
        Ok(done.rows_affected() == 1)
    }

    /// Read, compute, write, retried up to `attempts` times while other writers
    /// win. `change` returns the new value, or `None` to leave the row alone
    /// (then `Ok(None)`). Returns the value written.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] if the row does not exist or every attempt lost;
    /// database errors.
    pub async fn update<T: Value + Clone>(
        &self,
        pool: &PgPool,
        id: i64,
        attempts: u32,
        mut change: impl FnMut(T) -> Option<T>,
    ) -> Result<Option<T>> {
        for _ in 0..attempts.max(1) {
            let Some((value, ver)) = self.read::<T>(pool, id).await? else {
                return Err(Error::backend(
                    NAME,
                    format!("versioned update: no row with id {id}"),
                ));
            };
            let Some(next) = change(value) else {
                return Ok(None);
            };
            if self.write(pool, id, next.clone(), ver).await? {
                return Ok(Some(next));
            }
        }
        Err(Error::backend(
            NAME,
            format!(
                "versioned update of id {id}: other writers won {attempts} times in a row; retry later or lock the row"
            ),
        ))
    }
}

/// A transaction holding `FOR UPDATE` locks on some rows; commit or drop it
/// (dropping rolls back and lets the rows go).
#[derive(Debug)]
pub struct RowLocks<'a> {
    tx: Transaction<'a, Postgres>,
    what: String,
    timeout: Duration,
}

impl RowLocks<'_> {
    /// The transaction, to read and write the locked rows.
    pub fn conn(&mut self) -> &mut PgConnection {
        &mut self.tx
    }

    /// Maps an error of your statements in this transaction as [`explain`] does.
    pub fn explain(&self, e: sqlx::Error) -> Error {
        explain(&self.what, self.timeout, e)
    }

    /// Commits, letting the rows go.
    ///
    /// # Errors
    ///
    /// Database errors (then nothing was committed).
    pub async fn commit(self) -> Result<()> {
        let (what, timeout) = (self.what, self.timeout);
        self.tx
            .commit()
            .await
            .map_err(|e| explain(&what, timeout, e))
    }
}

/// Begins a transaction and locks the rows of `table` whose `id_column` is in
/// `ids`, in ascending id order, waiting at most `timeout` for each (the
/// transaction's `lock_timeout`).
///
/// # Errors
///
/// [`Error::Timeout`] if a row stayed locked by another transaction for
/// `timeout`; [`Error::InvalidConfig`] for a bad identifier; database errors.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_postgres::patterns::lock_rows;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock_core::Result<()> {
/// let pool = sqlx::PgPool::connect("postgres://postgres:postgres@127.0.0.1:5432/test").await.unwrap();
/// sqlx::query("CREATE TABLE IF NOT EXISTS doc_accounts (id bigint PRIMARY KEY, balance bigint NOT NULL)")
///     .execute(&pool).await.unwrap();
/// sqlx::query("INSERT INTO doc_accounts VALUES (1, 100), (2, 0) ON CONFLICT (id) DO UPDATE SET balance = EXCLUDED.balance")
///     .execute(&pool).await.unwrap();
///
/// // A transfer: both rows locked (in id order), moved, committed.
/// let mut rows = lock_rows(&pool, "doc_accounts", "id", &[2, 1], Duration::from_secs(2)).await?;
/// for (id, delta) in [(1_i64, -30_i64), (2, 30)] {
///     sqlx::query("UPDATE doc_accounts SET balance = balance + $1 WHERE id = $2")
///         .bind(delta).bind(id).execute(rows.conn()).await.map_err(|e| rows.explain(e))?;
/// }
/// rows.commit().await?;
/// # Ok(()) }
/// ```
pub async fn lock_rows<'a>(
    pool: &'a PgPool,
    table: &str,
    id_column: &str,
    ids: &[i64],
    timeout: Duration,
) -> Result<RowLocks<'a>> {
    let t = ident("table", table, true)?;
    let id = ident("column", id_column, false)?;
    let what = format!("rows {ids:?} of {t}");
    let mut tx = pool.begin().await.map_err(pool_err(pool))?;
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128).to_string();
    sqlx::query("SELECT set_config('lock_timeout', $1, true)")
        .bind(ms)
        .execute(&mut *tx)
        .await
        .map_err(|e| explain(&what, timeout, e))?;
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    sqlx::query(AssertSqlSafe(format!(
        "SELECT 1 FROM {t} WHERE {id} = ANY($1) ORDER BY {id} FOR UPDATE"
    )))
    .bind(&sorted)
    .execute(&mut *tx)
    .await
    .map_err(|e| explain(&what, timeout, e))?;
    Ok(RowLocks { tx, what, timeout })
}

/// Fenced writes: a row keeps the token of its last writer, and a write with a
/// token that is not larger is refused. See the [module docs](self).
///
/// # Examples
///
/// ```
/// use fencelock_core::FencingToken;
/// use fencelock_postgres::patterns::Fenced;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock_core::Result<()> {
/// let pool = sqlx::PgPool::connect("postgres://postgres:postgres@127.0.0.1:5432/test").await.unwrap();
/// sqlx::query("CREATE TABLE IF NOT EXISTS doc_files (id bigint PRIMARY KEY, body text NOT NULL, last_token bigint NOT NULL)")
///     .execute(&pool).await.unwrap();
/// sqlx::query("DELETE FROM doc_files").execute(&pool).await.unwrap();
///
/// let files = Fenced::new("doc_files", "id", "body", "last_token")?;
/// assert!(files.write(&pool, 7, "from holder 34", FencingToken::new(34)).await?);
/// // The holder with token 33 woke up from a long pause: its write is refused.
/// assert!(!files.write(&pool, 7, "stale", FencingToken::new(33)).await?);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Fenced {
    write: String,
}

impl Fenced {
    /// Names the table (whose id column must be unique), its `bigint` id
    /// column, the value column and the `bigint` token column.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a bad identifier.
    pub fn new(table: &str, id: &str, value: &str, token: &str) -> Result<Fenced> {
        let t = ident("table", table, true)?;
        let (id, v, tok) = (
            ident("column", id, false)?,
            ident("column", value, false)?,
            ident("column", token, false)?,
        );
        Ok(Fenced {
            write: format!(
                "INSERT INTO {t} AS cur ({id}, {v}, {tok}) VALUES ($1, $2, $3)
                 ON CONFLICT ({id}) DO UPDATE SET {v} = EXCLUDED.{v}, {tok} = EXCLUDED.{tok}
                 WHERE cur.{tok} < EXCLUDED.{tok}"
            ),
        })
    }

    /// Writes `value` to row `id` (creating it) unless the row was last written
    /// with a token at least as large as `token`. True if written.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub async fn write<T>(
        &self,
        pool: &PgPool,
        id: i64,
        value: T,
        token: FencingToken,
    ) -> Result<bool>
    where
        T: for<'q> Encode<'q, Postgres> + Type<Postgres> + Send,
    {
        let token = i64::try_from(token.get()).map_err(|_| {
            Error::config(format!(
                "fencing token {} does not fit a bigint column",
                token.get()
            ))
        })?;
        let done = sqlx::query(AssertSqlSafe(self.write.clone()))
            .bind(id)
            .bind(value)
            .bind(token)
            .execute(pool)
            .await
            .map_err(pool_err(pool))?;
        Ok(done.rows_affected() == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_checked() {
        assert!(ident("table", "public.stock", true).is_ok());
        assert!(ident("column", "public.stock", false).is_err());
        assert!(ident("table", "stock; DROP TABLE x", true).is_err());
        assert!(ident("column", "1st", false).is_err());
        assert!(Versioned::new("t", "id", "v", "ver\"").is_err());
    }
}
