//! Advisory mode across a server restart: a restart frees every advisory lock
//! at once, but a holder cut off from the server cannot hear of it and
//! believes in its hold until its deadline — so nobody may be granted the
//! lock before then. Also: sessions left idle by the restart are replaced,
//! and permit counts beyond what the mode checks are refused.

mod support;

use std::time::{Duration, Instant};

use fencelock_core::{Error, Locker};
use fencelock_postgres::PostgresBackend;
use fencelock_testkit::FaultProxy;
use support::{PrivatePostgres, SHARED};

/// A holder behind a partition (packets vanish both ways, no close gets
/// through) while the server restarts: the next holder is granted only once
/// the first can no longer believe it holds.
async fn partitioned_holder_across_a_restart(crash: bool) {
    let mut pg = PrivatePostgres::start();
    let direct = pg.url("advisory");
    let port: u16 = direct
        .split("127.0.0.1:")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .and_then(|p| p.parse().ok())
        .unwrap();
    let proxy = FaultProxy::start(([127, 0, 0, 1], port).into())
        .await
        .unwrap();
    let via_proxy = direct.replace(&format!(":{port}/"), &format!(":{}/", proxy.addr().port()));
    let a = Locker::new(PostgresBackend::connect(&via_proxy).await.unwrap());
    let ga = a
        .lock("k")
        .ttl(Duration::from_secs(4))
        .acquire()
        .await
        .unwrap();
    // The watcher's session is up.
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.blackhole();
    tokio::task::block_in_place(|| {
        if crash {
            pg.crash_and_restart()
        } else {
            pg.restart()
        }
    });
    let b = Locker::new(PostgresBackend::connect(&direct).await.unwrap());
    let start = Instant::now();
    let gb = b
        .lock("k")
        .ttl(Duration::from_secs(4))
        .wait(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let both = ga.is_valid();
    assert!(
        !both,
        "crash={crash}: B was granted {:?} after the restart while the cut-off A still believed \
         its hold valid ({:?} left)",
        start.elapsed(),
        ga.lease().time_left()
    );
    assert!(gb.token().unwrap() > ga.token().unwrap());
    gb.release().await.unwrap();
    proxy.restore();
    drop(ga);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_cut_off_during_a_restart_is_not_overlapped() {
    partitioned_holder_across_a_restart(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_cut_off_during_a_crash_is_not_overlapped() {
    partitioned_holder_across_a_restart(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_left_idle_by_a_restart_are_replaced() {
    let mut pg = PrivatePostgres::start();
    let a = Locker::new(PostgresBackend::connect(&pg.url("advisory")).await.unwrap());
    // Three sessions go idle.
    let mut held = Vec::new();
    for i in 0..3 {
        held.push(
            a.lock(format!("hold-{i}"))
                .ttl(Duration::from_secs(2))
                .acquire()
                .await
                .unwrap(),
        );
    }
    for g in held {
        g.release().await.unwrap();
    }
    tokio::task::block_in_place(|| pg.restart());
    for i in 0..5 {
        let got = a
            .lock(format!("idle-{i}"))
            .ttl(Duration::from_secs(2))
            .wait(Duration::from_secs(30))
            .acquire()
            .await;
        match got {
            Ok(g) => g.release().await.unwrap(),
            Err(e) => panic!("acquire {i} after the restart failed: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_counts_beyond_the_checked_range_are_refused() {
    let url = format!("{SHARED}?mode=advisory");
    let a = Locker::new(PostgresBackend::connect(&url).await.unwrap());
    let key = format!("big-semaphore-{}", std::process::id());
    match a.semaphore(&key, 2000).try_acquire().await {
        Err(Error::InvalidConfig(msg)) => assert!(msg.contains("1024"), "{msg}"),
        Ok(g) => {
            drop(g);
            panic!("a 2000-permit semaphore was granted; counts above 1024 go unchecked")
        }
        Err(e) => panic!("{e}"),
    }
    let g = a
        .semaphore(&key, 1024)
        .try_acquire()
        .await
        .unwrap()
        .unwrap();
    g.release().await.unwrap();
}

/// The docs let an operator delete the gate's record once every holder from
/// before a restart is dead; a process that knew the record must write it
/// again before its next grant, or the next crash opens the gate at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_record_is_written_again_before_the_next_grant() {
    use sqlx::Connection;
    let ttl = Duration::from_secs(2);
    let pg = PrivatePostgres::start();
    let url = pg.url("advisory");
    let a = Locker::new(PostgresBackend::connect(&url).await.unwrap());
    let g = a.lock("k").ttl(ttl).acquire().await.unwrap();
    let plain = url.replace("?mode=advisory", "");
    let mut c = sqlx::PgConnection::connect(&plain).await.unwrap();
    sqlx::query("DELETE FROM fencelock_restart_gate")
        .execute(&mut c)
        .await
        .unwrap();
    // A new session (the first is held): it passes the gate again.
    let g2 = a.lock("k2").ttl(ttl).acquire().await.unwrap();
    let recorded: Option<i64> = sqlx::query_scalar(
        "SELECT ttl_ms FROM fencelock_restart_gate WHERE started = pg_postmaster_start_time()",
    )
    .fetch_optional(&mut c)
    .await
    .unwrap();
    assert_eq!(
        recorded,
        Some(2000),
        "granted without the longest TTL recorded again"
    );
    g.release().await.unwrap();
    g2.release().await.unwrap();
}

/// Holds granted since the server started cannot be holds from before a
/// restart: on a server up for seconds, a hold with a TTL of minutes leaves
/// every other key to other clients at once, and a waiter on its key is
/// granted when it is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_granted_since_the_start_do_not_close_the_gate() {
    let pg = PrivatePostgres::start();
    let url = pg.url("advisory");
    let long = Duration::from_secs(600);
    let a = Locker::new(PostgresBackend::connect(&url).await.unwrap());
    let ga = a.lock("k").ttl(long).acquire().await.unwrap();
    let b = Locker::new(PostgresBackend::connect(&url).await.unwrap());
    let other = b
        .lock("other")
        .ttl(long)
        .wait(Duration::from_secs(20))
        .acquire()
        .await
        .expect("another key, on a new session, while a long hold granted since the start lives");
    other.release().await.unwrap();
    let waiter = tokio::spawn(async move {
        b.lock("k")
            .ttl(long)
            .wait(Duration::from_secs(60))
            .acquire()
            .await
            .map(|g| g.token())
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    let first = ga.token();
    ga.release().await.unwrap();
    let got = waiter
        .await
        .unwrap()
        .expect("the waiter, once the holder released");
    assert!(got > first);
}

/// While the gate is closed a waiter waits as long as its wait allows, no
/// longer, and is granted once the gate opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_gate_is_waited_out_within_the_wait() {
    use sqlx::Connection;
    let pg = PrivatePostgres::start();
    let url = pg.url("advisory");
    let a = Locker::new(PostgresBackend::connect(&url).await.unwrap());
    // Creates the schema.
    a.lock("setup")
        .try_acquire()
        .await
        .unwrap()
        .unwrap()
        .release()
        .await
        .unwrap();
    let plain = url.replace("?mode=advisory", "");
    let mut c = sqlx::PgConnection::connect(&plain).await.unwrap();
    // An earlier start with holds of a TTL that ends 4 s from now.
    sqlx::query(
        "INSERT INTO fencelock_restart_gate (started, ttl_ms)
         SELECT pg_postmaster_start_time() - interval '1 hour',
                (extract(epoch FROM clock_timestamp() - pg_postmaster_start_time()) * 1000)::bigint + 4000",
    )
    .execute(&mut c)
    .await
    .unwrap();
    let b = Locker::new(PostgresBackend::connect(&url).await.unwrap());
    match b.lock("k").wait(Duration::from_secs(1)).acquire().await {
        Err(Error::Timeout { .. }) => {}
        other => panic!("granted or failed otherwise while the gate was closed: {other:?}"),
    }
    let g = b
        .lock("k")
        .wait(Duration::from_secs(30))
        .acquire()
        .await
        .expect("granted once the gate opened");
    g.release().await.unwrap();
}
