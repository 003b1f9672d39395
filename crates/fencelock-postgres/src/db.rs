//! The pool, its address for messages, and the mapping of driver errors.

use fencelock_core::Error;
use fencelock_core::backend::redact_url;
use sqlx::PgPool;

use crate::NAME;

/// A pool and the (redacted) address it talks to.
#[derive(Clone)]
pub(crate) struct Db {
    pub(crate) pool: PgPool,
    pub(crate) addr: String,
}

impl Db {
    pub(crate) fn new(pool: PgPool, url: &str) -> Db {
        Db {
            pool,
            addr: redact_url(url),
        }
    }

    /// Maps a driver error: connection trouble becomes [`Error::Connection`]
    /// naming the address, anything the server said becomes [`Error::Backend`].
    pub(crate) fn err(&self) -> impl Fn(sqlx::Error) -> Error + '_ {
        move |e| map_err(&self.addr, e)
    }
}

/// SQLSTATEs that mean the session is gone or the server is going away.
fn is_connection_state(code: &str) -> bool {
    // 53300: too many connections (all waiters reconnect at once after a
    // restart), which a retry cures.
    code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03" | "57P05" | "53300")
}

/// What a pool that gave no connection within its timeout means.
const POOL_BUSY: &str = "no connection of the pool came free within 10 s: the server answers \
                         slowly, or more operations ran at once than the pool holds (raise \
                         `pool=`, default 8)";

pub(crate) fn map_err(addr: &str, e: sqlx::Error) -> Error {
    let err = match &e {
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            if is_connection_state(&code) {
                Error::connection(NAME, addr, db.message())
            } else if code == "FL001" {
                Error::config(db.message().to_string())
            } else {
                Error::backend(NAME, format!("{} (SQLSTATE {code})", db.message()))
            }
        }
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => Error::connection(NAME, addr, &e),
        sqlx::Error::PoolTimedOut => Error::connection(NAME, addr, POOL_BUSY),
        sqlx::Error::Configuration(_) => Error::config(format!("postgres: {e}")),
        _ => Error::backend(NAME, &e),
    };
    err.with_source(e)
}

/// True if the error says the session is gone (so nothing it held survives).
pub(crate) fn session_gone(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db.code().is_some_and(|c| is_connection_state(&c)),
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::Tls(_) => true,
        _ => false,
    }
}
