//! `get_lock` mode across a server restart: a restart frees every `GET_LOCK`
//! at once, but a holder cut off from the server cannot hear of it and
//! believes in its hold until its deadline — so nobody may be granted the
//! lock before then.
//! The gate itself: nothing is granted before the server has been up for the
//! longest TTL recorded, whatever fraction of a second it started at.

mod support;

use std::time::{Duration, Instant};

use fencelock_core::Locker;
use fencelock_mysql::MySqlBackend;
use fencelock_testkit::FaultProxy;
use support::PrivateMariaDb;

/// A holder behind a partition (packets vanish both ways, no close gets
/// through) while the server restarts: the next holder is granted only once
/// the first can no longer believe it holds.
async fn partitioned_holder_across_a_restart(crash: bool) {
    let mut db = PrivateMariaDb::start();
    let direct = db.url("get_lock");
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
    let a = Locker::new(MySqlBackend::connect(&via_proxy).await.unwrap());
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
            db.crash_and_restart()
        } else {
            db.restart()
        }
    });
    let b = Locker::new(MySqlBackend::connect(&direct).await.unwrap());
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

/// The server counts `Uptime` in whole seconds between whole-second
/// timestamps, so it can read 1 a moment after the start: each round's start
/// falls at another fraction of a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_granted_before_the_server_was_up_for_the_longest_ttl() {
    let ttl = Duration::from_secs(3);
    let mut db = PrivateMariaDb::start();
    let url = db.url("get_lock");
    let a = Locker::new(MySqlBackend::connect(&url).await.unwrap());
    let g = a.lock("k").ttl(ttl).acquire().await.unwrap();
    g.release().await.unwrap();
    for round in 0..8u64 {
        tokio::task::block_in_place(|| db.crash_and_restart());
        let b = Locker::new(MySqlBackend::connect(&url).await.unwrap());
        let g = b
            .lock("k")
            .ttl(ttl)
            .wait(Duration::from_secs(30))
            .acquire()
            .await
            .unwrap();
        let up = db.spawned().elapsed();
        assert!(
            up >= ttl,
            "round {round}: granted when the server had been up for {up:?}, less than the \
             longest TTL recorded ({ttl:?})"
        );
        g.release().await.unwrap();
        // The next round starts at another fraction of a second.
        tokio::time::sleep(Duration::from_millis(130 + 370 * round % 1000)).await;
    }
}

/// The docs let an operator delete the gate's record once every holder from
/// before a restart is dead; a process that knew the record must write it
/// again before its next grant, or the next crash opens the gate at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_record_is_written_again_before_the_next_grant() {
    use sqlx::Connection;
    let ttl = Duration::from_secs(2);
    let db = PrivateMariaDb::start();
    let url = db.url("get_lock");
    let a = Locker::new(MySqlBackend::connect(&url).await.unwrap());
    let g = a.lock("k").ttl(ttl).acquire().await.unwrap();
    let plain = url.replace("?mode=get_lock", "");
    let mut c = sqlx::MySqlConnection::connect(&plain).await.unwrap();
    sqlx::query("DELETE FROM fencelock_restart_gate")
        .execute(&mut c)
        .await
        .unwrap();
    // A new session (the first is held): it passes the gate again.
    let g2 = a.lock("k2").ttl(ttl).acquire().await.unwrap();
    let recorded: Option<i64> = sqlx::query_scalar(
        "SELECT g.ttl_ms FROM fencelock_restart_gate g JOIN fencelock_boot b ON b.boot = g.boot",
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
    let db = PrivateMariaDb::start();
    let url = db.url("get_lock");
    let long = Duration::from_secs(600);
    let a = Locker::new(MySqlBackend::connect(&url).await.unwrap());
    let ga = a.lock("k").ttl(long).acquire().await.unwrap();
    let b = Locker::new(MySqlBackend::connect(&url).await.unwrap());
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
    let db = PrivateMariaDb::start();
    let url = db.url("get_lock");
    let a = Locker::new(MySqlBackend::connect(&url).await.unwrap());
    // Creates the schema and notes this start.
    a.lock("setup")
        .try_acquire()
        .await
        .unwrap()
        .unwrap()
        .release()
        .await
        .unwrap();
    let plain = url.replace("?mode=get_lock", "");
    let mut c = sqlx::MySqlConnection::connect(&plain).await.unwrap();
    // An earlier start with holds of a TTL that ends 4 s from now.
    let (_, up): (String, String) = sqlx::query_as("SHOW GLOBAL STATUS LIKE 'Uptime'")
        .fetch_one(&mut c)
        .await
        .unwrap();
    let ttl_ms = up.parse::<i64>().unwrap() * 1000 + 4000;
    sqlx::query("INSERT INTO fencelock_restart_gate (boot, ttl_ms) VALUES (1, ?)")
        .bind(ttl_ms)
        .execute(&mut c)
        .await
        .unwrap();
    let b = Locker::new(MySqlBackend::connect(&url).await.unwrap());
    match b.lock("k").wait(Duration::from_secs(1)).acquire().await {
        Err(fencelock_core::Error::Timeout { .. }) => {}
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

/// `fencelock_boot` emptied while the server runs (an operator, a restore)
/// makes a new start row of the same start: the rows of the holds granted
/// before are kept, and still close the gate after the next restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emptying_the_boot_table_without_a_restart_forgets_no_hold() {
    use sqlx::Connection;
    let ttl = Duration::from_secs(3);
    let mut db = PrivateMariaDb::start();
    let url = db.url("get_lock");
    let a = Locker::new(MySqlBackend::connect(&url).await.unwrap());
    let g = a.lock("k").ttl(ttl).acquire().await.unwrap();
    // The server has been up longer than the TTL: a new start row's gate is
    // open at once.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let plain = url.replace("?mode=get_lock", "");
    let mut c = sqlx::MySqlConnection::connect(&plain).await.unwrap();
    sqlx::query("DELETE FROM fencelock_boot")
        .execute(&mut c)
        .await
        .unwrap();
    drop(c);
    let b = Locker::new(MySqlBackend::connect(&url).await.unwrap());
    b.lock("other")
        .ttl(Duration::from_secs(1))
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    drop(g);
    tokio::task::block_in_place(|| db.crash_and_restart());
    let c2 = Locker::new(MySqlBackend::connect(&url).await.unwrap());
    let g = c2
        .lock("k")
        .ttl(ttl)
        .wait(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let up = db.spawned().elapsed();
    assert!(
        up >= ttl,
        "granted when the server had been up for {up:?}, less than the TTL of a hold from \
         before the restart ({ttl:?})"
    );
    g.release().await.unwrap();
}
