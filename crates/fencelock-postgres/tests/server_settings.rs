//! Settings operators give a server or database, in both modes: one that
//! ends idle sessions (`idle_session_timeout`), and a stricter default
//! isolation level.

mod support;

use std::time::Duration;

use fencelock_core::Locker;
use fencelock_postgres::PostgresBackend;
use support::PrivatePostgres;

/// Holds live on through their renewals, and later acquires, renewals and
/// releases work, although the server ends every session idle for 1 s.
async fn holds_outlive_the_idle_timeout(mode: &str) {
    let pg = PrivatePostgres::start_with(&["idle_session_timeout=1s"]);
    let url = pg.url(mode);
    let locker = Locker::new(PostgresBackend::connect(&url).await.unwrap());
    // A TTL of 6 s renews every 2 s: each renewal finds its connection idle
    // for longer than the server allows.
    let ttl = Duration::from_secs(6);
    let a = locker.lock("a").ttl(ttl).acquire().await.unwrap();
    tokio::time::sleep(Duration::from_secs(9)).await;
    assert!(
        a.is_valid(),
        "{mode}: the hold was lost: {:?}",
        a.lease().lost_reason()
    );
    let b = locker
        .lock("b")
        .ttl(ttl)
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("{mode}: an acquire after idle connections closed: {e}"));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(a.is_valid() && b.is_valid(), "{mode}: a hold was lost");
    a.release()
        .await
        .unwrap_or_else(|e| panic!("{mode}: release: {e}"));
    tokio::time::sleep(Duration::from_secs(2)).await;
    b.release()
        .await
        .unwrap_or_else(|e| panic!("{mode}: release after an idle spell: {e}"));
    // Both are free again.
    let other = Locker::new(PostgresBackend::connect(&url).await.unwrap());
    for key in ["a", "b"] {
        let got = other.lock(key).try_acquire().await.unwrap();
        assert!(
            got.is_some(),
            "{mode}: {key} was still held after its release"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_holds_outlive_the_servers_idle_session_timeout() {
    holds_outlive_the_idle_timeout("lease").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_holds_outlive_the_servers_idle_session_timeout() {
    holds_outlive_the_idle_timeout("advisory").await;
}

/// Clients contending for the same keys on a database whose default
/// isolation level is SERIALIZABLE: no acquire or release fails with a
/// serialization failure.
async fn contention_under_a_serializable_default(mode: &str) {
    let pg = PrivatePostgres::start_with(&["default_transaction_isolation=serializable"]);
    let url = pg.url(mode);
    let mut tasks = Vec::new();
    for c in 0..3 {
        let locker = Locker::new(PostgresBackend::connect(&url).await.unwrap());
        for t in 0..3 {
            let locker = locker.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..15 {
                    let key = format!("k{}", (c + t + i) % 2);
                    let g = locker
                        .lock(&key)
                        .ttl(Duration::from_secs(10))
                        .wait(Duration::from_secs(60))
                        .acquire()
                        .await
                        .map_err(|e| format!("acquire {key}: {e}"))?;
                    g.release()
                        .await
                        .map_err(|e| format!("release {key}: {e}"))?;
                }
                Ok::<(), String>(())
            }));
        }
    }
    for t in tasks {
        if let Err(e) = t.await.unwrap() {
            panic!("{mode}: {e}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_contention_under_a_serializable_default() {
    contention_under_a_serializable_default("lease").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_contention_under_a_serializable_default() {
    contention_under_a_serializable_default("advisory").await;
}
