//! Maintenance: the server restarts while a waiter waits without a deadline.
//! The waiter waits through it and is granted once the server is back and
//! the holder has let go (a lease survives a restart; GET_LOCK locks do not),
//! in both modes.

mod support;

use std::time::Duration;

use fencelock_core::Locker;
use fencelock_mysql::MySqlBackend;
use support::PrivateMariaDb;

async fn waiter_waits_through_a_restart(mode: &str) {
    let mut db = PrivateMariaDb::start();
    let url = db.url(mode);
    let holder = Locker::new(MySqlBackend::connect(&url).await.unwrap());
    let g = holder
        .lock("k")
        .ttl(Duration::from_secs(3))
        .acquire()
        .await
        .unwrap();
    let waiter = Locker::new(MySqlBackend::connect(&url).await.unwrap());
    let w = tokio::spawn(async move {
        waiter
            .lock("k")
            .ttl(Duration::from_secs(3))
            .wait_forever()
            .acquire()
            .await
            .map(|g| g.token())
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    tokio::task::block_in_place(|| db.restart());
    // A lease survives the restart (GET_LOCK locks do not): let it go.
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop(g);
    let got = tokio::time::timeout(Duration::from_secs(90), w)
        .await
        .unwrap_or_else(|_| panic!("{mode}: the waiter was not granted within 90 s of the restart"))
        .unwrap();
    assert!(
        got.is_ok(),
        "{mode}: the waiter gave up during the restart: {got:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_waiter_waits_through_a_server_restart() {
    waiter_waits_through_a_restart("lease").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_lock_waiter_waits_through_a_server_restart() {
    waiter_waits_through_a_restart("get_lock").await;
}

/// A server-side statement time limit (`max_statement_time`, set by an
/// operator) does not cut a wait in `GET_LOCK` short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_time_limit_does_not_end_a_get_lock_wait() {
    use sqlx::Connection;
    let db = PrivateMariaDb::start();
    let url = db.url("get_lock");
    let mut c = sqlx::MySqlConnection::connect(&url.replace("?mode=get_lock", ""))
        .await
        .unwrap();
    sqlx::query("SET GLOBAL max_statement_time = 1")
        .execute(&mut c)
        .await
        .unwrap();
    let holder = Locker::new(MySqlBackend::connect(&url).await.unwrap());
    let g = holder.lock("k").acquire().await.unwrap();
    let waiter = Locker::new(MySqlBackend::connect(&url).await.unwrap());
    let w = tokio::spawn(async move {
        waiter
            .lock("k")
            .wait_forever()
            .acquire()
            .await
            .map(|g| g.token())
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    g.release().await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(60), w)
        .await
        .expect("the waiter was not granted within 60 s of the release")
        .unwrap();
    assert!(got.is_ok(), "the waiter's wait was cut short: {got:?}");
}
