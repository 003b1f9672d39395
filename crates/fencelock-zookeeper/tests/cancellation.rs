//! `Guard::release` promises: "If cancelled, the release may or may not have
//! reached the backend; the watchdog no longer renews the hold either way, so
//! it expires after its TTL." A release cancelled while its delete is lost
//! must not leave the node in a live session (a ghost holder that outlives its
//! TTL for as long as the process lives).

use std::time::{Duration, Instant};

use fencelock_core::{Key, Locker};
use fencelock_testkit::FaultProxy;
use fencelock_zookeeper::ZooKeeperBackend;

fn unique(name: &str) -> String {
    format!(
        "cancel-{name}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_release_whose_delete_is_lost_frees_the_lock_after_its_ttl() {
    let key = unique("cancel-release");
    let proxy = FaultProxy::start("127.0.0.1:2181".parse().unwrap())
        .await
        .unwrap();
    let a_backend =
        ZooKeeperBackend::connect(&format!("zk://{}?session_timeout=10s", proxy.addr()))
            .await
            .unwrap();
    let a = Locker::new(a_backend.clone());
    let b_backend = ZooKeeperBackend::connect("zk://127.0.0.1:2181?session_timeout=10s")
        .await
        .unwrap();
    let b = Locker::new(b_backend.clone());
    let g = a
        .lock(&key)
        .ttl(Duration::from_secs(4))
        .acquire()
        .await
        .unwrap();
    // The release's delete is held by the network; the caller gives up on it.
    proxy.blackhole();
    let r = tokio::time::timeout(Duration::from_millis(200), g.release()).await;
    assert!(r.is_err(), "the release finished through a black hole?");
    // The connection breaks (the held delete is lost with it) and comes back
    // well within the 4 s session: the session lives on.
    proxy.cut();
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.restore();
    let start = Instant::now();
    let got = b
        .lock(&key)
        .ttl(Duration::from_secs(4))
        .wait(Duration::from_secs(20))
        .acquire()
        .await;
    let queue = b_backend.queue(&Key::new(&key).unwrap()).await.unwrap();
    match got {
        Ok(g) => {
            println!(
                "B granted {:?} after the cancelled release",
                start.elapsed()
            );
            g.release().await.unwrap();
        }
        Err(e) => panic!(
            "a cancelled release of a 4 s hold still blocks the lock {:?} later ({e}); queue: {queue:?}",
            start.elapsed()
        ),
    }
    drop(a_backend);
}

/// No network fault at all: a release cancelled after its first poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_cancelled_at_any_point_leave_no_ghost() {
    let a_backend = ZooKeeperBackend::connect("zk://127.0.0.1:2181?session_timeout=10s")
        .await
        .unwrap();
    let a = Locker::new(a_backend.clone());
    let n = 40;
    let mut keys = Vec::new();
    for i in 0..n {
        let key = unique(&format!("cancel-nofault-{i}"));
        let g = a
            .lock(&key)
            .ttl(Duration::from_secs(2))
            .acquire()
            .await
            .unwrap();
        let cancel_after = Duration::from_micros((i as u64 % 10) * 50);
        let _ = tokio::time::timeout(cancel_after, g.release()).await;
        keys.push(key);
    }
    tokio::time::sleep(Duration::from_secs(6)).await;
    let mut ghosts = Vec::new();
    for k in &keys {
        let q = a_backend.queue(&Key::new(k).unwrap()).await.unwrap();
        if !q.is_empty() {
            ghosts.push(q);
        }
    }
    println!(
        "{} of {n} cancelled releases left a node past its TTL",
        ghosts.len()
    );
    assert!(ghosts.is_empty(), "ghosts 6 s after 2 s holds: {ghosts:?}");
}
