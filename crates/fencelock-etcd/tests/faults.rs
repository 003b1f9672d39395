//! etcd fault tests: a holder cut off by the testkit proxy loses its lease and
//! fires `lost()`, a later holder's token is larger and the stale fenced write
//! is rejected; a SIGKILLed holder's lock is free once its lease expires; a
//! SIGSTOPped holder loses its lock and its stale write; a hold outlives a
//! short restart of the server (etcd keeps leases across restarts); fifty
//! waiters are woken one per release, not as a herd.

mod support;

use std::time::{Duration, Instant};

use fencelock_core::{Error, Key, Locker, LostReason};
use fencelock_etcd::EtcdBackend;
use fencelock_testkit::FaultProxy;
use fencelock_testkit::faults::{self, unique_key};
use support::{Cluster, Etcd, SHARED, fenced_write, resource};

#[test]
#[ignore = "holder process of the SIGKILL and SIGSTOP tests"]
fn holder_worker() {
    faults::holder_worker(Etcd);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_cut_off_by_the_network_loses_its_lease_and_its_stale_write() {
    let proxy = FaultProxy::start("127.0.0.1:2379".parse().unwrap())
        .await
        .unwrap();
    let key = unique_key("cut");
    let cut_off = Locker::new(
        EtcdBackend::connect(&format!("etcd://{}?session_ttl=2s", proxy.addr()))
            .await
            .unwrap(),
    );
    let other = Locker::new(EtcdBackend::connect(SHARED).await.unwrap());
    let g = cut_off
        .lock(&key)
        .ttl(Duration::from_secs(2))
        .acquire()
        .await
        .unwrap();
    let stale = g.token().unwrap();
    assert!(
        other.lock(&key).try_acquire().await.unwrap().is_none(),
        "the lock was free while its holder was connected"
    );
    proxy.cut();
    let lost = tokio::time::timeout(Duration::from_secs(15), g.lost())
        .await
        .expect("lost() did not fire after the network was cut");
    assert!(
        matches!(
            lost,
            Error::Lost {
                reason: LostReason::RenewFailed(_) | LostReason::Expired | LostReason::NotHeld(_),
                ..
            }
        ),
        "{lost:?}"
    );
    // The server expires the holder's lease; the lock goes to the next client.
    let g2 = other
        .lock(&key)
        .wait(Duration::from_secs(15))
        .acquire()
        .await
        .expect("granted after the cut-off holder's lease expired");
    let token = g2.token().unwrap();
    assert!(token > stale, "token {token:?} after {stale:?}");
    assert!(
        fenced_write("127.0.0.1:2379", &key, token.get(), "by the new holder")
            .await
            .unwrap()
    );
    // The network comes back; the old holder's write is fenced off.
    proxy.restore();
    assert!(
        !fenced_write("127.0.0.1:2379", &key, stale.get(), "stale")
            .await
            .unwrap(),
        "the stale write got through"
    );
    assert_eq!(
        resource("127.0.0.1:2379", &key).await.as_deref(),
        Some("by the new holder")
    );
    assert!(!g.is_valid());
    // Back online, the old client queues behind the new holder again.
    assert!(
        cut_off.lock(&key).try_acquire().await.unwrap().is_none(),
        "the reconnected client got a held lock"
    );
    g2.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_frees_the_lock_when_its_lease_expires() {
    faults::killed_holder_frees_after_its_ttl(&Etcd, SHARED).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_costs_its_own_ttl_not_the_session_ttl() {
    // The default session_ttl (10 s) caps the lease of long holds; a hold of
    // 2 s lives on a 2 s lease, so its holder's death frees it after ~2 s.
    faults::killed_holder_frees_after_its_ttl(&Etcd, "etcd://127.0.0.1:2379").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holder_loses_its_lock_and_its_stale_write() {
    faults::paused_holder_loses_its_lock_and_its_stale_write(&Etcd, SHARED).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_outlives_a_short_server_restart() {
    let mut etcd = Cluster::start(1).await;
    let url = etcd.url("session_ttl=6s");
    faults::lease_outlives_a_short_restart(&Etcd, &url, async || etcd.restart(0).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_waiters_one_wake_up_per_release() {
    let key = unique_key("herd");
    let holder = EtcdBackend::connect(SHARED).await.unwrap();
    let g = Locker::new(holder.clone())
        .lock(&key)
        .acquire()
        .await
        .unwrap();
    // 50 waiters, each its own lease (a Locker's local line would hide a herd).
    let mut backends = Vec::new();
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let b = EtcdBackend::connect(SHARED).await.unwrap();
        backends.push(b.clone());
        let k = key.clone();
        tasks.push(tokio::spawn(async move {
            let g = Locker::new(b)
                .lock(&k)
                .wait(Duration::from_secs(60))
                .acquire()
                .await?;
            // Released at once: the releases come in a row.
            g.release().await
        }));
    }
    let start = Instant::now();
    while holder.queue(&Key::new(&key).unwrap()).await.unwrap().len() < 51 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the waiters never all queued"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before: u64 = backends.iter().map(|b| b.watch_events()).sum();
    assert_eq!(before, 0, "waiters were woken before any release");
    g.release().await.unwrap();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let woken: u64 = backends.iter().map(|b| b.watch_events()).sum();
    // 50 releases (the holder's and 49 waiters') each woke one waiter. A
    // waiter whose periodic re-read happens to land just after its
    // predecessor's deletion takes its turn without the event, so a few
    // fewer is possible; more would be a herd.
    assert!(
        (45..=50).contains(&woken),
        "{woken} watch events for 50 releases"
    );
}

/// etcd refuses a transaction of more than 128 operations (`--max-txn-ops`,
/// its default): one Locker holding more locks than that must still renew
/// them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_held_locks_than_a_transaction_takes_are_all_renewed() {
    let locker = Locker::new(EtcdBackend::connect(SHARED).await.unwrap());
    fencelock_testkit::faults::many_held_locks_are_all_renewed(&locker, 300).await;
}

/// Maintenance: the server restarts while a waiter waits without a deadline.
/// The waiter waits through it and is granted once the holder lets go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_waits_through_a_server_restart() {
    let mut cluster = support::Cluster::start(1).await;
    let url = cluster.url("request_timeout=1s&connect_timeout=1s");
    let holder = Locker::new(EtcdBackend::connect(&url).await.unwrap());
    let g = holder
        .lock("k")
        .ttl(Duration::from_secs(3))
        .acquire()
        .await
        .unwrap();
    let waiter = Locker::new(EtcdBackend::connect(&url).await.unwrap());
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
    cluster.kill(0);
    tokio::time::sleep(Duration::from_secs(4)).await;
    cluster.restart(0).await;
    drop(g);
    let got = tokio::time::timeout(Duration::from_secs(90), w)
        .await
        .expect("the waiter was not granted within 90 s of the restart")
        .unwrap();
    assert!(
        got.is_ok(),
        "the waiter gave up during the restart: {got:?}"
    );
}

/// A silent server (a frozen VM, a cut cable) cannot keep a waiter past its
/// wait, nor a connect running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_server_cannot_hold_a_waiter_past_its_wait() {
    faults::a_stalled_server_cannot_hold_a_waiter_past_its_deadline(&Etcd, SHARED).await;
}
