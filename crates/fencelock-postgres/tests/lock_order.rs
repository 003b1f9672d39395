//! Lease mode: a handoff and an acquire that meet at the moment the releaser's
//! row expires must not deadlock (every function locks a key's fence row
//! before its holder rows).

mod support;

use std::time::Duration;

use fencelock_postgres::PostgresBackend;
use support::SHARED;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_and_an_acquire_at_the_releasers_expiry_do_not_deadlock() {
    let backend = PostgresBackend::connect(&format!("{SHARED}?mode=lease"))
        .await
        .unwrap();
    let pool = backend.pool().clone();
    let key = format!("lock-order/{}", now_nanos());
    let acquire = "SELECT ok FROM fencelock_acquire($1, $2, 'exclusive', $3, false, 0)";
    // The releaser holds for a second.
    let (ok, token): (bool, i64) =
        sqlx::query_as("SELECT ok, tok FROM fencelock_acquire($1, $2, 'exclusive', $3, false, 0)")
            .bind(&key)
            .bind("releaser")
            .bind(1000i64)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(ok);
    // A handoff is a release and an acquire in one transaction
    // (fencelock_handoff); here its two halves, with a pause between them.
    let mut handoff = pool.begin().await.unwrap();
    let left: i32 = sqlx::query_scalar("SELECT fencelock_release($1, $2, $3, false)")
        .bind(&key)
        .bind("releaser")
        .bind(token)
        .fetch_one(&mut *handoff)
        .await
        .unwrap();
    assert_eq!(left, 0);
    // Another client's acquire starts once the releaser's row has expired,
    // and waits for the handoff.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let other = tokio::spawn({
        let (pool, key) = (pool.clone(), key.clone());
        async move {
            sqlx::query_scalar::<_, bool>(acquire)
                .bind(&key)
                .bind("other")
                .bind(30_000i64)
                .fetch_one(&pool)
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let handed = sqlx::query_scalar::<_, bool>(acquire)
        .bind(&key)
        .bind("next")
        .bind(30_000i64)
        .fetch_one(&mut *handoff)
        .await;
    let committed = match handed {
        Ok(_) => handoff.commit().await.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    let other = other.await.unwrap().map_err(|e| e.to_string());
    assert!(
        committed.is_ok() && other.is_ok(),
        "handoff: {committed:?}; the other acquire: {other:?}"
    );
}

/// A number that differs between runs (the key must be new on the shared server).
fn now_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}
