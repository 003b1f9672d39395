//! Settings operators give a server, in both modes: one that ends idle
//! sessions (`wait_timeout`), and a stricter default isolation level.

mod support;

use std::time::Duration;

use fencelock_core::Locker;
use fencelock_mysql::MySqlBackend;
use support::PrivateMariaDb;

/// Holds live on through their renewals, and later acquires, renewals and
/// releases work, although the server ends every session idle for 1 s.
async fn holds_outlive_the_idle_timeout(mode: &str) {
    let db = tokio::task::block_in_place(|| PrivateMariaDb::start_with(&["--wait-timeout=1"]));
    let url = db.url(mode);
    let locker = Locker::new(MySqlBackend::connect(&url).await.unwrap());
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
    let other = Locker::new(MySqlBackend::connect(&url).await.unwrap());
    for key in ["a", "b"] {
        let got = other.lock(key).try_acquire().await.unwrap();
        assert!(
            got.is_some(),
            "{mode}: {key} was still held after its release"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_holds_outlive_the_servers_wait_timeout() {
    holds_outlive_the_idle_timeout("lease").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_lock_holds_outlive_the_servers_wait_timeout() {
    holds_outlive_the_idle_timeout("get_lock").await;
}

/// Clients contending for the same keys on a server whose default isolation
/// level is SERIALIZABLE: no acquire or release fails.
async fn contention_under_a_serializable_default(mode: &str) {
    let db = tokio::task::block_in_place(|| {
        PrivateMariaDb::start_with(&["--transaction-isolation=SERIALIZABLE"])
    });
    let url = db.url(mode);
    let mut tasks = Vec::new();
    for c in 0..3 {
        let locker = Locker::new(MySqlBackend::connect(&url).await.unwrap());
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
async fn get_lock_contention_under_a_serializable_default() {
    contention_under_a_serializable_default("get_lock").await;
}
