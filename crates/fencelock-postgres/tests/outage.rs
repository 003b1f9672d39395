//! Maintenance: the server restarts while a waiter waits without a deadline.
//! The waiter waits through it and is granted once the server is back and
//! the holder has let go (a lease survives a restart; advisory locks do not),
//! in both modes.

mod support;

use std::time::Duration;

use fencelock_core::Locker;
use fencelock_postgres::PostgresBackend;
use support::PrivatePostgres;

async fn waiter_waits_through_a_restart(mode: &str) {
    let mut pg = PrivatePostgres::start();
    let url = pg.url(mode);
    let holder = Locker::new(PostgresBackend::connect(&url).await.unwrap());
    let g = holder
        .lock("k")
        .ttl(Duration::from_secs(3))
        .acquire()
        .await
        .unwrap();
    let waiter = Locker::new(PostgresBackend::connect(&url).await.unwrap());
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
    tokio::task::block_in_place(|| pg.restart());
    // A lease survives the restart (advisory locks do not): let it go.
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
async fn an_advisory_waiter_waits_through_a_server_restart() {
    waiter_waits_through_a_restart("advisory").await;
}

/// A server-side statement timeout (`statement_timeout`, set for the
/// database by an operator) does not cut a wait in `pg_advisory_lock` short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_timeout_does_not_end_an_advisory_wait() {
    use sqlx::Connection;
    let pg = PrivatePostgres::start();
    let url = pg.url("advisory");
    let mut c = sqlx::PgConnection::connect(&url.replace("?mode=advisory", ""))
        .await
        .unwrap();
    sqlx::query("ALTER DATABASE postgres SET statement_timeout = '1s'")
        .execute(&mut c)
        .await
        .unwrap();
    let holder = Locker::new(PostgresBackend::connect(&url).await.unwrap());
    let g = holder.lock("k").acquire().await.unwrap();
    let waiter = Locker::new(PostgresBackend::connect(&url).await.unwrap());
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
