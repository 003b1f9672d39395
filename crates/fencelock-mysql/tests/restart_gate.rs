//! `get_lock` mode across a server restart: a restart frees every `GET_LOCK`
//! at once, but a holder cut off from the server cannot hear of it and
//! believes in its hold until its deadline — so nobody may be granted the
//! lock before then.

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
