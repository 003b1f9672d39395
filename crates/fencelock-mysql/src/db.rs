//! The pool, its address for messages, and the mapping of driver errors.

use fencelock_core::Error;
use fencelock_core::backend::redact_url;
use sqlx::MySqlPool;

use crate::NAME;

/// A pool and the (redacted) address it talks to.
#[derive(Clone)]
pub(crate) struct Db {
    pub(crate) pool: MySqlPool,
    pub(crate) addr: String,
}

impl Db {
    pub(crate) fn new(pool: MySqlPool, url: &str) -> Db {
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

/// Server error numbers that mean the session is gone or the server is going
/// away (killed connection, shutdown in progress, lost connection).
fn is_connection_code(code: &str) -> bool {
    matches!(
        code,
        // 1040: too many connections (all waiters reconnect at once after a
        // restart), which a retry cures.
        "1040"
            | "1053"
            | "1077"
            | "1078"
            | "1079"
            | "1080"
            | "1152"
            | "1153"
            | "1158"
            | "1159"
            | "1160"
            | "1161"
            | "1927"
            | "2006"
            | "2013"
            | "4031"
    )
}

fn code_of(db: &dyn sqlx::error::DatabaseError) -> String {
    db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .map(|e| e.number().to_string())
        .unwrap_or_default()
}

/// What a pool that gave no connection within its timeout means.
const POOL_BUSY: &str = "no connection of the pool came free within 10 s: the server answers \
                         slowly, or more operations ran at once than the pool holds (raise \
                         `pool=`, default 8)";

pub(crate) fn map_err(addr: &str, e: sqlx::Error) -> Error {
    let err = match &e {
        sqlx::Error::Database(db) => {
            let code = code_of(db.as_ref());
            if is_connection_code(&code) {
                Error::connection(NAME, addr, db.message())
            } else {
                Error::backend(NAME, format!("{} (error {code})", db.message()))
            }
        }
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => Error::connection(NAME, addr, &e),
        sqlx::Error::PoolTimedOut => Error::connection(NAME, addr, POOL_BUSY),
        sqlx::Error::Configuration(_) => Error::config(format!("mysql: {e}")),
        _ => Error::backend(NAME, &e),
    };
    err.with_source(e)
}

/// True for an error [`map_err`] made of a deadlock (1213) or a lock wait
/// timeout (1205): the transaction was rolled back and may simply be retried.
pub(crate) fn is_conflict(e: &Error) -> bool {
    matches!(e, Error::Backend { message, .. }
        if message.ends_with("(error 1213)") || message.ends_with("(error 1205)"))
}

/// True for an error [`map_err`] made of a lock wait timeout (1205).
pub(crate) fn is_lock_wait_timeout(e: &Error) -> bool {
    matches!(e, Error::Backend { message, .. } if message.ends_with("(error 1205)"))
}

/// True if the error says the session is gone (so nothing it held survives).
pub(crate) fn session_gone(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => is_connection_code(&code_of(db.as_ref())),
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::Tls(_) => true,
        _ => false,
    }
}

/// True if the statement was interrupted by a `KILL QUERY` (1317).
pub(crate) fn is_interrupted(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if code_of(db.as_ref()) == "1317")
}

/// Lifts the server's statement time limit (MariaDB's `max_statement_time`,
/// MySQL's `max_execution_time`) for a session whose statements wait on
/// purpose: a `GET_LOCK` lasts as long as its caller's wait, whatever the
/// server, database or account sets.
pub(crate) async fn unlimited_statements(conn: &mut sqlx::MySqlConnection) -> sqlx::Result<()> {
    for stmt in [
        "SET SESSION max_statement_time = 0",
        "SET SESSION max_execution_time = 0",
    ] {
        match sqlx::query(stmt).execute(&mut *conn).await {
            Err(sqlx::Error::Database(e)) if e.message().contains("Unknown system variable") => {}
            r => return r.map(|_| ()),
        }
    }
    Ok(())
}
