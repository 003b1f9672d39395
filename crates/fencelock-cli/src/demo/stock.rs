//! The protected resource of the demo: a stock row and a sales table in their own
//! SQLite file, apart from the lock.

use std::path::Path;
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension, params};

pub type Result<T> = std::result::Result<T, String>;

fn err(e: rusqlite::Error) -> String {
    format!("stock database: {e}")
}

/// A connection to the stock file.
pub struct Stock {
    conn: Connection,
}

/// What the sales table says after an act.
pub struct Tally {
    pub sold: u64,
    pub left: i64,
    /// Tokens of the sales, in the order they were written.
    pub tokens: Vec<Option<u64>>,
}

impl Tally {
    /// True if every recorded token is larger than the one before.
    pub fn tokens_increase(&self) -> bool {
        let t: Vec<u64> = self.tokens.iter().flatten().copied().collect();
        t.len() == self.tokens.len() && t.windows(2).all(|w| w[0] < w[1])
    }
}

impl Stock {
    pub fn open(path: &Path) -> Result<Stock> {
        let conn = Connection::open(path).map_err(err)?;
        conn.busy_timeout(Duration::from_secs(30)).map_err(err)?;
        conn.query_row("PRAGMA journal_mode=WAL", [], |_| Ok(()))
            .map_err(err)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS stock (id INTEGER PRIMARY KEY, n INTEGER NOT NULL, last_token INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS sales (id INTEGER PRIMARY KEY AUTOINCREMENT, buyer TEXT NOT NULL, token INTEGER);",
        )
        .map_err(err)?;
        Ok(Stock { conn })
    }

    /// Puts `n` items on the shelf and forgets earlier sales and tokens.
    pub fn reset(&self, n: u32) -> Result<()> {
        self.conn
            .execute_batch("DELETE FROM sales; DELETE FROM stock;")
            .map_err(err)?;
        self.conn
            .execute(
                "INSERT INTO stock (id, n, last_token) VALUES (1, ?1, 0)",
                params![n],
            )
            .map_err(err)?;
        Ok(())
    }

    pub fn read(&self) -> Result<i64> {
        self.conn
            .query_row("SELECT n FROM stock WHERE id = 1", [], |r| r.get(0))
            .optional()
            .map_err(err)?
            .ok_or_else(|| "stock row missing".to_string())
    }

    /// A plain write: whoever writes last wins.
    pub fn write(&self, n: i64, token: Option<u64>) -> Result<()> {
        let token = token.map_or(0, |t| t as i64);
        self.conn
            .execute(
                "UPDATE stock SET n = ?1, last_token = max(last_token, ?2) WHERE id = 1",
                params![n, token],
            )
            .map_err(err)?;
        Ok(())
    }

    /// The fenced write: applied only if `token` is newer than every token the
    /// stock has seen. Returns whether it was applied.
    pub fn write_fenced(&self, n: i64, token: u64) -> Result<bool> {
        let changed = self
            .conn
            .execute(
                "UPDATE stock SET n = ?1, last_token = ?2 WHERE id = 1 AND last_token < ?2",
                params![n, token as i64],
            )
            .map_err(err)?;
        Ok(changed == 1)
    }

    pub fn record_sale(&self, buyer: &str, token: Option<u64>) -> Result<()> {
        self.conn
            .execute(
                "INSERT INTO sales (buyer, token) VALUES (?1, ?2)",
                params![buyer, token.map(|t| t as i64)],
            )
            .map_err(err)?;
        Ok(())
    }

    pub fn tally(&self) -> Result<Tally> {
        let mut stmt = self
            .conn
            .prepare("SELECT token FROM sales ORDER BY id")
            .map_err(err)?;
        let tokens = stmt
            .query_map([], |r| r.get::<_, Option<i64>>(0))
            .map_err(err)?
            .map(|t| t.map(|t| t.map(|t| t as u64)))
            .collect::<rusqlite::Result<Vec<_>>>()
            .map_err(err)?;
        Ok(Tally {
            sold: tokens.len() as u64,
            left: self.read()?,
            tokens,
        })
    }
}
