//! Advisory mode keeps a session of its own to learn at once that the server
//! ended every session (a restart or crash). That session must not sit in a
//! statement: a running statement holds a snapshot, and the oldest snapshot of
//! any session is the horizon below which no dead row can be removed — in any
//! table of the cluster. Held for seconds at a time, again and again, it lets
//! dead versions of the fence rows (one per grant) pile up, every upsert walks
//! them, and a user's busy tables bloat.

mod support;

use std::time::Duration;

use fencelock_core::Locker;
use fencelock_postgres::PostgresBackend;
use sqlx::Connection;
use support::PrivatePostgres;

/// The client sessions of the server but `own`'s that hold a snapshot (their
/// `backend_xmin`): pid and what they run.
async fn holding_snapshots(own: &mut sqlx::PgConnection) -> Vec<(i32, String)> {
    sqlx::query_as(
        "SELECT pid, query FROM pg_stat_activity
         WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
           AND backend_xmin IS NOT NULL",
    )
    .fetch_all(own)
    .await
    .unwrap()
}

async fn client_sessions(own: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
    )
    .fetch_one(own)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_watch_holds_back_no_vacuum() {
    let pg = PrivatePostgres::start();
    let url = pg.url("advisory");
    let plain = url.split('?').next().unwrap().to_string();
    let locker = Locker::new(PostgresBackend::connect(&url).await.unwrap());
    let guard = locker
        .lock("vacuum-horizon")
        .ttl(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    let mut own = sqlx::PgConnection::connect(&plain).await.unwrap();
    // The hold's session and the watch (started by the first hold), at most
    // a few seconds on a loaded machine.
    let start = std::time::Instant::now();
    while client_sessions(&mut own).await < 2 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the backend's sessions did not show up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // A session that holds a snapshot in every one of 6 looks over a second
    // is not one caught in a short statement (a renewal's ping).
    let mut always = holding_snapshots(&mut own).await;
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = holding_snapshots(&mut own).await;
        always.retain(|(pid, _)| now.iter().any(|(p, _)| p == pid));
    }
    assert!(
        always.is_empty(),
        "sessions of the backend hold back the vacuum horizon: {always:?}"
    );
    guard.release().await.unwrap();
}

/// The idle watch still learns of a restart at once: the hold's `lost()`
/// fires within seconds of the server ending its sessions, long before the
/// first renewal (a third of the TTL) would find the session gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_idle_watch_learns_of_a_restart_before_any_renewal() {
    let mut pg = PrivatePostgres::start();
    let url = pg.url("advisory");
    let locker = Locker::new(PostgresBackend::connect(&url).await.unwrap());
    let guard = locker
        .lock("watch")
        .ttl(Duration::from_secs(90))
        .acquire()
        .await
        .unwrap();
    let lost_at = tokio::spawn({
        let lost = guard.lost();
        async move {
            lost.await;
            std::time::Instant::now()
        }
    });
    // Give the watch its session (it starts with the first hold).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let restarted = std::time::Instant::now();
    pg.restart();
    let lost_at = tokio::time::timeout(Duration::from_secs(60), lost_at)
        .await
        .expect("lost() did not fire within 60 s of the restart")
        .unwrap();
    assert!(
        lost_at < restarted + Duration::from_secs(10),
        "lost() fired {:?} after the restart began: not by the watch",
        lost_at - restarted
    );
    assert!(!guard.is_valid());
}
