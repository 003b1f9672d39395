//! The cluster's leader killed while locks are held and waited for (its own
//! test binary, so that it does not share the machine with the other fault
//! tests): holders keep their locks through the election, and waiters are
//! granted after it.

mod support;

use std::time::{Duration, Instant};

use fencelock_core::Locker;
use fencelock_etcd::EtcdBackend;
use support::Cluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_keeps_held_locks_and_grants_follow_the_election() {
    let mut cluster = Cluster::start(3).await;
    // A hold survives an outage shorter than about 2/3 of its TTL (renewals
    // every third of it): 12 s rides out an election on a loaded machine. A
    // request waits for the election up to its timeout: 20 s (a CI run saw an
    // election outlast the default 5 s while the machine compiled).
    let url = cluster.url("session_ttl=15s&request_timeout=20s");
    let a = Locker::new(EtcdBackend::connect(&url).await.unwrap());
    let b = Locker::new(EtcdBackend::connect(&url).await.unwrap());
    let c = Locker::new(EtcdBackend::connect(&url).await.unwrap());
    let ttl = Duration::from_secs(12);
    let held = a.lock("held").ttl(ttl).acquire().await.unwrap();
    let token = held.token().unwrap();
    let waiter = tokio::spawn({
        let b = b.clone();
        async move {
            b.lock("held")
                .ttl(ttl)
                .wait(Duration::from_secs(60))
                .acquire()
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let leader = cluster.wait_leader().await;
    cluster.kill(leader);
    // A new grant after the election, on the surviving majority.
    let start = Instant::now();
    let other = c
        .lock("other")
        .ttl(ttl)
        .wait(Duration::from_secs(30))
        .acquire()
        .await
        .expect("no grant after the election");
    println!("granted {:?} after the leader was killed", start.elapsed());
    assert!(other.token().unwrap() > token);
    // Past the hold's TTL: the holder renewed through the election, still
    // holds, and the waiter still waits.
    tokio::time::sleep(ttl + Duration::from_secs(1)).await;
    assert!(held.is_valid(), "the holder lost its lock to an election");
    assert!(!waiter.is_finished(), "the waiter got a held lock");
    assert!(
        c.lock("held").try_acquire().await.unwrap().is_none(),
        "a held lock was granted after the election"
    );
    held.release().await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("the waiter was not granted after the release")
        .unwrap()
        .expect("the waiter's acquire failed");
    assert!(next.token().unwrap() > token);
    next.release().await.unwrap();
    other.release().await.unwrap();
}
