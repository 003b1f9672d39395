//! A client frozen inside a transaction (a paused VM, a link gone silent
//! without a FIN) keeps its row locks until the server ends its session. No
//! acquire may wait past its deadline behind it, and a fencelock session
//! idle in a transaction is ended within seconds, not hours.

mod support;

use std::time::Duration;

use fencelock_core::{Error, Locker};
use fencelock_mysql::MySqlBackend;
use sqlx::Connection;
use support::SHARED as URL;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_returns_by_its_deadline_behind_a_frozen_transaction() {
    let key = format!("frozen-tx-{}", std::process::id());
    let locker = Locker::new(MySqlBackend::connect(URL).await.unwrap());
    // The key's row exists.
    locker
        .lock(&key)
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    // Another session, frozen inside a transaction that locked the row.
    let mut frozen = sqlx::MySqlConnection::connect(URL).await.unwrap();
    sqlx::query("BEGIN").execute(&mut frozen).await.unwrap();
    sqlx::query("SELECT * FROM fencelock_locks WHERE lock_key = ? FOR UPDATE")
        .bind(key.as_bytes())
        .fetch_all(&mut frozen)
        .await
        .unwrap();
    // Generous bounds: an acquire stuck behind the row lock for the server's
    // lock wait timeout (50 s), retried, fails this test; a slow one does not.
    for wait in [Duration::ZERO, Duration::from_secs(3)] {
        let got = tokio::time::timeout(
            Duration::from_secs(40),
            locker.lock(&key).wait(wait).acquire(),
        )
        .await
        .unwrap_or_else(|_| panic!("an acquire with a {wait:?} wait was still blocked after 40 s"));
        // Busy at the deadline, or (a row lock waited for past it) no answer
        // by then: either way not granted, and back in time.
        assert!(
            matches!(got, Err(Error::Timeout { .. } | Error::Connection { .. })),
            "behind a row lock: {got:?}"
        );
    }
    sqlx::query("ROLLBACK").execute(&mut frozen).await.unwrap();
    let g = locker
        .lock(&key)
        .wait(Duration::from_secs(10))
        .acquire()
        .await;
    assert!(g.is_ok(), "{g:?}");
}

/// fencelock's own sessions are ended by the server when they sit idle in a
/// transaction (MariaDB's `idle_transaction_timeout`): a frozen client's
/// row locks last seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencelock_sessions_end_when_idle_in_a_transaction() {
    let backend = MySqlBackend::connect(URL).await.unwrap();
    let secs: u64 = sqlx::query_scalar("SELECT @@session.idle_transaction_timeout")
        .fetch_one(backend.pool())
        .await
        .unwrap();
    assert!(
        (1..=2).contains(&secs),
        "idle_transaction_timeout of a pool session: {secs}"
    );
}
