//! A grant that waited behind a slow transaction on the key's row (another
//! client paused or slow inside its acquire) arrives valid: its lease counts
//! from a round trip after the wait, not from the request.

mod support;

use std::time::Duration;

use fencelock_core::Locker;
use fencelock_postgres::PostgresBackend;
use sqlx::Connection;
use support::SHARED;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_that_waited_behind_a_slow_transaction_is_valid_on_arrival() {
    let ttl = Duration::from_secs(2);
    let key = format!("slow-grant-{}", std::process::id());
    let url = format!("{SHARED}?mode=lease");
    let locker = Locker::new(PostgresBackend::connect(&url).await.unwrap());
    // The key's fence row exists.
    locker
        .lock(&key)
        .ttl(ttl)
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    // Another session locks it, as an acquire in progress does, for longer
    // than the TTL.
    let mut slow = sqlx::PgConnection::connect(SHARED).await.unwrap();
    let mut tx = slow.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM fencelock_locks WHERE key = $1 AND owner = '' FOR UPDATE")
        .bind(&key)
        .fetch_optional(&mut *tx)
        .await
        .unwrap()
        .expect("the fence row");
    let waiter = {
        let locker = locker.clone();
        let key = key.clone();
        tokio::spawn(async move {
            locker
                .lock(&key)
                .ttl(ttl)
                .wait(Duration::from_secs(30))
                .acquire()
                .await
        })
    };
    tokio::time::sleep(ttl + Duration::from_secs(1)).await;
    tx.commit().await.unwrap();
    let guard = waiter.await.unwrap().unwrap();
    let left = guard.lease().time_left();
    assert!(
        guard.is_valid(),
        "the grant arrived already invalid after waiting behind the slow transaction"
    );
    assert!(
        left > ttl / 4,
        "the grant arrived with {left:?} of {ttl:?} left"
    );
    guard.release().await.unwrap();
}
