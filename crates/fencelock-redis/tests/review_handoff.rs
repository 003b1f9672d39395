//! Review (hostile): a handoff (`release_to`) that is undone after the
//! waiter's own concurrent attempt already counted the handed hold as its grant.
//!
//! The core runs exactly these two calls concurrently: a guard of a Locker
//! releases to the head of the key's local line (guard.rs `release_or_hand_off`)
//! while that head is itself asking the backend (locker.rs `wait_as_head`:
//! `backend.acquire` when no local guard is counted, else a `try_acquire`
//! re-check every second).

mod support;

use std::time::{Duration, Instant};

use fencelock_core::{Backend, Key, LeaseRef, Mode, Owner, Request};
use fencelock_redis::RedisBackend;
use fencelock_testkit::free_port;
use support::redis_on;

fn req(key: &Key, owner: &str, ttl: Duration) -> Request {
    Request::new(
        key.clone(),
        Owner::new(owner).unwrap(),
        Mode::Exclusive,
        ttl,
    )
    // As the Locker asks for a default (per-guard) owner.
    .with_reentrant(false)
}

/// Single Redis with `wait_replicas=1`: the replica stalls for a little over
/// `wait_timeout`. The handoff's WAIT times out, so the handoff is undone
/// (lib.rs `release_script` → `confirm_replicas` → `undo`). The waiter's own
/// try_acquire, pipelined on the same connection behind that WAIT, found the
/// handed hold (`existing`, mine = 0) and, its own WAIT answered once the
/// replica is back, reports a grant. The undo then deletes the hold (its op
/// created it), so the waiter holds a valid guard while Redis holds nothing,
/// and a third owner is granted the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_undone_handoff_leaves_the_waiters_own_grant_without_a_hold() {
    let (mport, rport) = (free_port(), free_port());
    let _master = redis_on(mport, &[]);
    let replica = redis_on(rport, &["--replicaof", "127.0.0.1", &mport.to_string()]);
    let url = format!("redis://127.0.0.1:{mport}/?wait_replicas=1&wait_timeout=1s");
    let backend = RedisBackend::connect(&url).await.unwrap();
    let other = RedisBackend::connect(&format!("redis://127.0.0.1:{mport}"))
        .await
        .unwrap();
    let key = Key::new("k").unwrap();
    let ttl = Duration::from_secs(30);
    let l = req(&key, "releaser", ttl);
    let w = req(&key, "waiter", ttl);
    // Replication needs a moment to start.
    let start = Instant::now();
    let gl = loop {
        match backend.try_acquire(&l).await {
            Ok(Some(g)) => break g,
            r => {
                assert!(start.elapsed() < Duration::from_secs(20), "{r:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    let lease_l = LeaseRef::new(&l, &gl);

    replica.pause().unwrap();
    let t0 = Instant::now();
    let handoff = tokio::spawn({
        let (b, lease_l, w) = (backend.clone(), lease_l.clone(), w.clone());
        async move { b.release_to(&lease_l, &w).await }
    });
    // The waiter's own attempt goes out while the handoff's WAIT blocks.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let own = tokio::spawn({
        let (b, w) = (backend.clone(), w.clone());
        async move { b.try_acquire(&w).await }
    });
    // The replica comes back just after the handoff's WAIT gave up.
    tokio::time::sleep_until((t0 + Duration::from_millis(1150)).into()).await;
    replica.resume().unwrap();

    let handed = handoff.await.unwrap();
    let own = own.await.unwrap();
    eprintln!("release_to -> {handed:?}");
    eprintln!("waiter's own try_acquire -> {own:?}");
    let info = other.inspect(&key).await.unwrap();
    eprintln!("inspect -> {info:?}");
    let third = other.try_acquire(&req(&key, "third", ttl)).await.unwrap();
    eprintln!("third owner's try_acquire -> {third:?}");
    let waiter_granted = matches!(own, Ok(Some(_))) || matches!(&handed, Ok((_, Some(_))));
    assert!(
        !(waiter_granted && third.is_some()),
        "EXCLUSION BROKEN: the waiter was granted (own attempt {own:?}, handoff {handed:?}) and a third owner got the key too ({third:?})"
    );
}

/// The same through the public API only: a guard taken with `try_acquire`
/// (not counted as a local holder) is released while a second guard of the
/// same Locker waits (head of the local line, asking Redis every second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_locker_waiter_holds_a_valid_guard_while_another_owner_holds_the_key() {
    use fencelock_core::Locker;
    let (mport, rport) = (free_port(), free_port());
    let _master = redis_on(mport, &[]);
    let replica = redis_on(rport, &["--replicaof", "127.0.0.1", &mport.to_string()]);
    let url = format!("redis://127.0.0.1:{mport}/?wait_replicas=1&wait_timeout=1s");
    let locker = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let elsewhere = Locker::new(
        RedisBackend::connect(&format!("redis://127.0.0.1:{mport}"))
            .await
            .unwrap(),
    );
    let start = Instant::now();
    let first = loop {
        match locker.lock("k").try_acquire().await {
            Ok(Some(g)) => break g,
            r => {
                assert!(start.elapsed() < Duration::from_secs(20), "{r:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    let waiter = tokio::spawn({
        let locker = locker.clone();
        async move {
            locker
                .lock("k")
                .wait(Duration::from_secs(20))
                .acquire()
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    replica.pause().unwrap();
    let t0 = Instant::now();
    let released = tokio::spawn(first.release());
    tokio::time::sleep_until((t0 + Duration::from_millis(1150)).into()).await;
    replica.resume().unwrap();
    eprintln!("first.release() -> {:?}", released.await.unwrap());
    let w = waiter.await.unwrap().expect("the waiter got the lock");
    eprintln!("waiter: valid={} token={:?}", w.is_valid(), w.token());
    let other = elsewhere.lock("k").try_acquire().await.unwrap();
    eprintln!(
        "another process: {:?}; waiter still valid: {}",
        other.as_ref().map(|g| g.token()),
        w.is_valid()
    );
    assert!(
        !(other.is_some() && w.is_valid()),
        "EXCLUSION BROKEN: another owner holds the key while the waiter's guard is valid"
    );
}
