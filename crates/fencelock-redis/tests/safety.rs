//! Safety properties of the Redis backend that need a private server or a
//! proxy: a dropped acquire leaves no hold, a release that never reached Redis
//! reports `NotHeld`, a handoff counts only once replicas acknowledged it, a
//! release dropped during its handoff leaves no ghost holder, and every key
//! maps to one cluster slot.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use fencelock_core::backend::{LeaseRef, Request};
use fencelock_core::{Backend, Error, Key, Locker, Mode, Owner};
use fencelock_redis::RedisBackend;
use fencelock_testkit::{FaultProxy, ServerProcess, free_port};
use support::redis_on;

const SINGLE: &str = "redis://127.0.0.1:6379";
const CLUSTER: &str = "redis+cluster://127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103";

fn unique(name: &str) -> String {
    format!("{name}-{}", uuid::Uuid::new_v4().simple())
}

async fn through(proxy: &FaultProxy, query: &str) -> RedisBackend {
    let addr: SocketAddr = proxy.addr();
    RedisBackend::connect(&format!("redis://{addr}/{query}"))
        .await
        .unwrap()
}

/// A private Redis, a proxy in front of it, a locker through the proxy
/// (Redis knows its scripts: else a first call would only learn NOSCRIPT)
/// and one straight to it.
async fn slow_and_direct() -> (ServerProcess, FaultProxy, Locker, Locker) {
    let port = free_port();
    let server = redis_on(port, &[]);
    let proxy = FaultProxy::start(format!("127.0.0.1:{port}").parse().unwrap())
        .await
        .unwrap();
    let slow = Locker::new(through(&proxy, "").await);
    slow.lock("warm-up")
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let direct = Locker::new(
        RedisBackend::connect(&format!("redis://127.0.0.1:{port}"))
            .await
            .unwrap(),
    );
    (server, proxy, slow, direct)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_dropped_while_its_grant_is_in_flight_leaves_no_hold() {
    let (_server, proxy, slow, direct) = slow_and_direct().await;
    // The request reaches Redis a second after it is sent; its caller gives
    // up after half a second. Redis then grants it to nobody who listens.
    proxy.set_latency(Duration::from_secs(1));
    let gave_up = tokio::time::timeout(
        Duration::from_millis(500),
        slow.lock("k").ttl(Duration::from_secs(60)).acquire(),
    )
    .await;
    assert!(gave_up.is_err(), "granted through a 1 s link in 0.5 s");
    // The request has reached Redis (at 1 s) before anyone else asks.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let start = Instant::now();
    let g = direct
        .lock("k")
        .wait(Duration::from_secs(20))
        .acquire()
        .await
        .expect("the dropped acquire left a hold behind (its TTL is 60 s)");
    proxy.set_latency(Duration::ZERO);
    assert!(start.elapsed() < Duration::from_secs(20));
    g.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_never_reached_redis_is_not_held_once_another_owner_holds() {
    let port = free_port();
    let _server = redis_on(port, &[]);
    let proxy = FaultProxy::start(format!("127.0.0.1:{port}").parse().unwrap())
        .await
        .unwrap();
    let proxied = through(&proxy, "").await;
    let direct = RedisBackend::connect(&format!("redis://127.0.0.1:{port}"))
        .await
        .unwrap();
    let key = Key::new("k").unwrap();
    let req = |owner: &str, ttl| {
        Request::new(
            key.clone(),
            Owner::new(owner).unwrap(),
            Mode::Exclusive,
            ttl,
        )
    };
    let a = req("first", Duration::from_millis(500));
    let ga = proxied.try_acquire(&a).await.unwrap().unwrap();
    // A's hold runs out unrenewed and B takes the lock.
    let b = req("later", Duration::from_secs(60));
    let start = Instant::now();
    let gb = loop {
        if let Some(g) = direct.try_acquire(&b).await.unwrap() {
            break g;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "A's hold never expired"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Redis knows the release script (else the first call would only learn NOSCRIPT).
    let nobody = req("nobody", Duration::from_secs(1));
    let _ = proxied.release(&LeaseRef::new(&nobody, &gb)).await;
    // A's release is sent into a link that then breaks before delivering it;
    // it gets through on a retry, once the link is back.
    proxy.blackhole();
    let releasing = tokio::spawn({
        let (proxied, lease) = (proxied.clone(), LeaseRef::new(&a, &ga));
        async move { proxied.release(&lease).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.cut();
    tokio::time::sleep(Duration::from_secs(1)).await;
    proxy.restore();
    let r = releasing.await.unwrap();
    assert!(
        matches!(r, Err(Error::NotHeld { .. })),
        "a release of a hold that had gone to another owner answered {r:?}"
    );
    let info = direct.inspect(&key).await.unwrap().unwrap();
    assert_eq!(info.holders.len(), 1);
    assert_eq!(info.holders[0].owner, "later");
    direct.release(&LeaseRef::new(&b, &gb)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_counts_only_once_replicas_acknowledge_it() {
    let (mport, rport) = (free_port(), free_port());
    let _master = redis_on(mport, &[]);
    let mut replica = redis_on(rport, &["--replicaof", "127.0.0.1", &mport.to_string()]);
    let url = format!("redis://127.0.0.1:{mport}/?wait_replicas=1&wait_timeout=500ms");
    let backend = RedisBackend::connect(&url).await.unwrap();
    let locker = Locker::new(backend.clone());
    // Replication needs a moment to start.
    let start = Instant::now();
    let first = loop {
        match locker
            .lock("k")
            .wait(Duration::from_secs(2))
            .acquire()
            .await
        {
            Ok(g) => break g,
            Err(e) => assert!(
                start.elapsed() < Duration::from_secs(20),
                "never acknowledged: {e}"
            ),
        }
    };
    // A second guard of the same locker waits; the lock will be handed to it.
    let waiter = tokio::spawn({
        let locker = locker.clone();
        async move {
            locker
                .lock("k")
                .wait(Duration::from_secs(10))
                .acquire()
                .await
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    replica.kill();
    first.release().await.unwrap();
    let got = waiter.await.unwrap();
    let err = got.expect_err("a handoff no replica acknowledged was granted");
    assert!(err.to_string().contains("replicas acknowledged"), "{err}");
    let info = backend.inspect(&Key::new("k").unwrap()).await.unwrap();
    assert!(
        info.as_ref().is_none_or(|i| i.holders.is_empty()),
        "an unacknowledged grant was kept: {info:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_with_braces_and_percent_signs_work_everywhere() {
    for url in [SINGLE, CLUSTER] {
        let a = Locker::new(RedisBackend::connect(url).await.unwrap());
        let b = Locker::new(RedisBackend::connect(url).await.unwrap());
        let run = unique("");
        let keys = [
            format!("}}x{run}"),
            format!("}}{run}"),
            format!("{{}}x}}{run}"),
            format!("a}}b{run}"),
            format!("a%7Db{run}"),
            format!("100%}}{run}"),
        ];
        for key in &keys {
            let g = a
                .lock(key)
                .wait(Duration::from_secs(5))
                .acquire()
                .await
                .unwrap_or_else(|e| panic!("{url}: acquire {key:?}: {e}"));
            let r = a
                .read_lock(format!("{key}/r"))
                .acquire()
                .await
                .unwrap_or_else(|e| panic!("{url}: read lock {key:?}/r: {e}"));
            assert!(
                b.lock(key).try_acquire().await.unwrap().is_none(),
                "{url}: {key:?} granted twice"
            );
            let info = a.inspect(key).await.unwrap().expect("inspect");
            assert_eq!(info.key, *key);
            assert_eq!(info.holders.len(), 1, "{url}: {key:?}: {info:?}");
            let prefix: String = key.chars().take(3).collect();
            let listed: Vec<String> = a
                .list(&prefix)
                .await
                .unwrap()
                .into_iter()
                .map(|i| i.key)
                .collect();
            assert!(
                listed.contains(key),
                "{url}: {key:?} not listed under {prefix:?}: {listed:?}"
            );
            g.release().await.unwrap();
            r.release().await.unwrap();
        }
        // Escaped names do not collide: `a}b` and `a%7Db` are two locks.
        let g1 = a.lock(&keys[3]).acquire().await.unwrap();
        let g2 = b.lock(&keys[4]).try_acquire().await.unwrap();
        assert!(
            g2.is_some(),
            "{url}: {:?} and {:?} collide",
            keys[3],
            keys[4]
        );
        g1.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undone_handoff_never_takes_the_hold_the_waiter_counted_as_its_grant() {
    // A guard of a Locker is released while another guard of it waits. The
    // release hands the lock over, but no replica acknowledges the handoff
    // in time, so it is undone; meanwhile the waiter's own attempt found the
    // handed hold and counts it as its grant once the replica is back. The
    // undo must leave that hold alone: the waiter's guard is valid, so nobody
    // else may be granted the key.
    let (mport, rport) = (free_port(), free_port());
    let _master = redis_on(mport, &[]);
    let replica = redis_on(rport, &["--replicaof", "127.0.0.1", &mport.to_string()]);
    let url = format!("redis://127.0.0.1:{mport}/?wait_replicas=1&wait_timeout=3s");
    let locker = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let elsewhere = Locker::new(
        RedisBackend::connect(&format!("redis://127.0.0.1:{mport}"))
            .await
            .unwrap(),
    );
    let start = Instant::now();
    // Taken in the locker's line (a guard from try_acquire would not hand off).
    let first = loop {
        match locker
            .lock("k")
            .wait(Duration::from_secs(1))
            .acquire()
            .await
        {
            Ok(g) => break g,
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
                .wait(Duration::from_secs(30))
                .acquire()
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // The handoff's WAIT (3 s) sees no replica; the waiter's, which follows
    // it, sees the replica back.
    replica.pause().unwrap();
    let t0 = Instant::now();
    let released = tokio::spawn(first.release());
    tokio::time::sleep_until((t0 + Duration::from_millis(4500)).into()).await;
    replica.resume().unwrap();
    let _ = released.await.unwrap();
    let w = waiter.await.unwrap().expect("the waiter got the lock");
    let other = elsewhere.lock("k").try_acquire().await.unwrap();
    assert!(
        !(other.is_some() && w.is_valid()),
        "another owner was granted the key while the waiter's guard is valid"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_replicas_holds_up_no_renewal() {
    let (mport, rport) = (free_port(), free_port());
    let _master = redis_on(mport, &[]);
    let replica = redis_on(rport, &["--replicaof", "127.0.0.1", &mport.to_string()]);
    let url = format!("redis://127.0.0.1:{mport}/?wait_replicas=1&wait_timeout=3s");
    let backend = RedisBackend::connect(&url).await.unwrap();
    let ttl = Duration::from_secs(30);
    let key = Key::new("held").unwrap();
    let held = Request::new(
        key.clone(),
        Owner::new("holder").unwrap(),
        Mode::Exclusive,
        ttl,
    );
    let start = Instant::now();
    let g = loop {
        match backend.try_acquire(&held).await {
            Ok(Some(g)) => break g,
            r => {
                assert!(start.elapsed() < Duration::from_secs(20), "{r:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    // Five grants on other keys each wait 3 s for the stalled replica.
    replica.pause().unwrap();
    for i in 0..5 {
        let b = backend.clone();
        tokio::spawn(async move {
            let k = Key::new(format!("other-{i}")).unwrap();
            let r = Request::new(
                k,
                Owner::new(format!("o{i}")).unwrap(),
                Mode::Exclusive,
                ttl,
            );
            let _ = b.try_acquire(&r).await;
        });
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t = Instant::now();
    let renewed = backend.renew(&[LeaseRef::new(&held, &g)]).await;
    let took = t.elapsed();
    replica.resume().unwrap();
    assert!(renewed.is_ok(), "{renewed:?}");
    assert!(
        took < Duration::from_secs(5),
        "a renewal waited {took:?} behind other grants' WAITs (15 s of them)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_finds_locks_under_a_prefix_with_glob_characters() {
    let run = uuid::Uuid::new_v4().simple().to_string();
    let l = Locker::new(
        RedisBackend::connect("redis://127.0.0.1:6379/?prefix=glob[1]*?:")
            .await
            .unwrap(),
    );
    let g = l.lock(format!("k{run}")).acquire().await.unwrap();
    let listed = l.list(&format!("k{run}")).await.unwrap();
    g.release().await.unwrap();
    assert_eq!(listed.len(), 1, "a held lock is not listed: {listed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_dropped_during_its_handoff_leaves_no_ghost_holder() {
    // A guard's release hands the lock to the next waiter of its locker, and
    // the caller gives up on the release while the script is on its way; then
    // the waiter gives up too. The script still runs at Redis and hands the
    // lock to the waiter's owner: unless the handoff is finished (and the
    // gone waiter's hold given back), that hold blocks the key for its TTL.
    let (_server, proxy, slow, direct) = slow_and_direct().await;
    let first = slow
        .lock("k")
        .ttl(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    let waiter = tokio::spawn({
        let slow = slow.clone();
        async move {
            slow.lock("k")
                .ttl(Duration::from_secs(60))
                .wait(Duration::from_secs(60))
                .acquire()
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.set_latency(Duration::from_secs(1));
    let cut = tokio::time::timeout(Duration::from_millis(200), first.release()).await;
    assert!(cut.is_err(), "released through a 1 s link in 0.2 s");
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    let start = Instant::now();
    let g = direct
        .lock("k")
        .wait(Duration::from_secs(25))
        .acquire()
        .await
        .expect("the key stayed held by a waiter that was gone (its TTL is 60 s)");
    proxy.set_latency(Duration::ZERO);
    assert!(start.elapsed() < Duration::from_secs(25));
    g.release().await.unwrap();
}
