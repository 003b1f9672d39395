//! Helpers of the lease-mode line's tests (`line.rs`, `line_review.rs`).

use std::time::Duration;

use fencelock_core::Locker;
use fencelock_mysql::MySqlBackend;
use sqlx::{Connection, MySqlConnection};
use tokio::time::Instant;

use super::SHARED;

/// The turnstile's name of a key, as the backend computes it.
pub const TURN_SQL: &str =
    "CONCAT(LEFT(SHA2(CONCAT(DATABASE(), CHAR(31), ?), 256), 58), CHAR(31), 'turn')";

/// A key of its own for one test.
pub fn unique(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("line-{name}-{}-{nanos}", std::process::id())
}

/// A backend of its own (a process of its own, as far as the line goes).
pub async fn locker_at(url: &str) -> Locker {
    Locker::new(MySqlBackend::connect(url).await.unwrap())
}

/// [`locker_at`] the shared server, lease mode.
pub async fn locker() -> Locker {
    locker_at(&format!("{SHARED}?mode=lease")).await
}

/// A plain session of the shared server.
pub async fn raw() -> MySqlConnection {
    MySqlConnection::connect(SHARED).await.unwrap()
}

/// The session at the head of `key`'s line, if any.
pub async fn head(raw: &mut MySqlConnection, key: &str) -> Option<i64> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT CAST(IS_USED_LOCK({TURN_SQL}) AS SIGNED)"
    )))
    .bind(key)
    .fetch_one(raw)
    .await
    .unwrap()
}

/// Waits (up to 20 s) until `key`'s line has a head, or has none.
pub async fn until_head(raw: &mut MySqlConnection, key: &str, present: bool) {
    let until = Instant::now() + Duration::from_secs(20);
    while head(raw, key).await.is_some() != present {
        assert!(
            Instant::now() < until,
            "the line of {key} never {} a head",
            if present { "had" } else { "lost" }
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Sessions of the server waiting in a turnstile's `GET_LOCK`.
pub async fn queued(raw: &mut MySqlConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.processlist
         WHERE info LIKE 'SELECT GET_LOCK(CONCAT(LEFT(SHA2%'",
    )
    .fetch_one(raw)
    .await
    .unwrap()
}
