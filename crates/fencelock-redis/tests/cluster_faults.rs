//! Fault tests of the Redis backend on a private 3-master cluster whose
//! primaries are reached through fault proxies (see `support`).

mod support;

use std::time::{Duration, Instant};

use fencelock_core::backend::{LeaseRef, Request};
use fencelock_core::{Backend, Key, Locker, Mode, Owner};
use fencelock_redis::RedisBackend;
use support::{PrivateCluster, direct};

/// The hold count `owner` has on `key`, read on the node itself.
async fn holds_on(port: u16, key: &str, owner: &str) -> Option<u32> {
    let v: Option<String> = redis::cmd("GET")
        .arg(format!("fencelock:{{{key}}}"))
        .query_async(&mut direct(port).await)
        .await
        .unwrap();
    let v = v?;
    let mut f = v.split('\t');
    if f.next()? != owner {
        return None;
    }
    f.next()?.parse().ok()
}

/// Waits until `key`'s hold count for `owner` on its node is `want`.
async fn until_holds(port: u16, key: &str, owner: &str, want: Option<u32>, what: &str) {
    let start = Instant::now();
    while holds_on(port, key, owner).await != want {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{what} never reached the server: holds {:?}, want {want:?}",
            holds_on(port, key, owner).await
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Runs `op` while the primary's replies are held back; once the script ran
/// (`ran` is seen on the node; `None`: after a second), the connection is cut
/// (the reply is lost) and the way is opened again, so the client library
/// re-sends the request.
async fn with_lost_reply<T: Send + 'static>(
    cluster: &PrivateCluster,
    backend: &RedisBackend,
    node: usize,
    (key, owner): (&str, &str),
    ran: Option<u32>,
    op: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    // The client's connection to the node is up (not being set up anew).
    backend.inspect(&Key::new(key).unwrap()).await.unwrap();
    cluster.proxies[node].drop_replies();
    let task = tokio::spawn(op);
    match ran {
        Some(_) => until_holds(cluster.ports[node], key, owner, ran, "the request").await,
        None => tokio::time::sleep(Duration::from_secs(1)).await,
    }
    cluster.proxies[node].cut();
    tokio::time::sleep(Duration::from_millis(200)).await;
    cluster.proxies[node].restore();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the request never finished")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_sent_again_after_a_lost_reply_acts_once() {
    let cluster = PrivateCluster::start().await;
    let backend = RedisBackend::connect(&cluster.url("")).await.unwrap();
    let key = "resent";
    let name = format!("fencelock:{{{key}}}");
    let node = cluster.node_of(&name).await;
    let port = cluster.ports[node];
    let owner = "reentrant-owner";
    let req = Request::new(
        Key::new(key).unwrap(),
        Owner::new(owner).unwrap(),
        Mode::Exclusive,
        Duration::from_secs(60),
    );
    let g = backend.try_acquire(&req).await.unwrap().unwrap();
    assert_eq!(holds_on(port, key, owner).await, Some(1));

    // A reentrant acquire whose reply is lost adds one hold, not two.
    let again = with_lost_reply(&cluster, &backend, node, (key, owner), Some(2), {
        let (b, req) = (backend.clone(), req.clone());
        async move { b.try_acquire(&req).await }
    })
    .await;
    let again = again.expect("the re-sent acquire failed").expect("refused");
    assert_eq!(again.holds, 2, "the re-sent acquire answered {again:?}");
    assert_eq!(
        holds_on(port, key, owner).await,
        Some(2),
        "a re-sent reentrant acquire added a second hold"
    );

    // A renewal whose reply is lost changes no hold count.
    let lease = LeaseRef::new(&req, &g);
    let renewed = with_lost_reply(&cluster, &backend, node, (key, owner), None, {
        let (b, lease) = (backend.clone(), lease.clone());
        async move { b.renew(std::slice::from_ref(&lease)).await }
    })
    .await;
    assert!(renewed.is_ok(), "{renewed:?}");
    assert_eq!(holds_on(port, key, owner).await, Some(2));

    // A release whose reply is lost gives one hold back, not two. (One
    // release first, so that the node has the script when the reply is lost.)
    let third = backend.try_acquire(&req).await.unwrap().unwrap();
    let third = LeaseRef::new(&req, &third);
    assert_eq!(backend.release(&third).await.unwrap().remaining, 2);
    let released = with_lost_reply(&cluster, &backend, node, (key, owner), Some(1), {
        let (b, lease) = (backend.clone(), LeaseRef::new(&req, &again));
        async move { b.release(&lease).await }
    })
    .await
    .expect("the re-sent release failed");
    assert_eq!(
        released.remaining, 1,
        "the re-sent release answered {released:?}"
    );
    assert_eq!(
        holds_on(port, key, owner).await,
        Some(1),
        "a re-sent release gave back a second hold"
    );
    let other = Locker::new(RedisBackend::connect(&cluster.url("")).await.unwrap());
    assert!(
        other.lock(key).try_acquire().await.unwrap().is_none(),
        "another owner got a lock still held once"
    );
    backend.release(&lease).await.unwrap();
    assert!(other.lock(key).try_acquire().await.unwrap().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_primary_loses_only_its_own_leases() {
    let cluster = PrivateCluster::start().await;
    let locker = Locker::new(
        RedisBackend::connect(&cluster.url("?timeout=30s"))
            .await
            .unwrap(),
    );
    // Three keys on each primary.
    let mut keys: Vec<Vec<String>> = vec![Vec::new(); 3];
    for i in 0.. {
        let key = format!("renew-{i}");
        let node = cluster.node_of(&format!("fencelock:{{{key}}}")).await;
        if keys[node].len() < 3 {
            keys[node].push(key);
        }
        if keys.iter().all(|k| k.len() == 3) {
            break;
        }
    }
    // Renewals every 2 s leave a loaded machine room before a healthy lease
    // would lapse (3 s failed once beside a build).
    let ttl = Duration::from_secs(6);
    let mut guards = Vec::new();
    for (node, ks) in keys.iter().enumerate() {
        for k in ks {
            guards.push((node, locker.lock(k).ttl(ttl).acquire().await.unwrap()));
        }
    }
    cluster.servers[2].pause().unwrap();
    // Several renewal periods and more than a TTL.
    tokio::time::sleep(ttl * 2).await;
    let report: Vec<(usize, bool)> = guards.iter().map(|(n, g)| (*n, g.is_valid())).collect();
    cluster.servers[2].resume().unwrap();
    for (node, valid) in &report {
        if *node == 2 {
            assert!(
                !valid,
                "a lease on the stalled primary stayed valid: {report:?}"
            );
        } else {
            assert!(valid, "a lease on a healthy primary was lost: {report:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_force_release_sent_again_after_a_lost_reply_spares_the_next_owner() {
    let cluster = PrivateCluster::start().await;
    let admin = RedisBackend::connect(&cluster.url("")).await.unwrap();
    let key = "forced";
    let node = cluster.node_of(&format!("fencelock:{{{key}}}")).await;
    let port = cluster.ports[node];
    // Other processes reach the node on another path (straight to its port).
    let b = RedisBackend::connect(&format!("redis://127.0.0.1:{port}"))
        .await
        .unwrap();
    let req = |owner: &str| {
        Request::new(
            Key::new(key).unwrap(),
            Owner::new(owner).unwrap(),
            Mode::Exclusive,
            Duration::from_secs(60),
        )
        .with_reentrant(false)
    };
    b.try_acquire(&req("stuck")).await.unwrap().unwrap();
    admin.inspect(&Key::new(key).unwrap()).await.unwrap();
    cluster.proxies[node].drop_replies();
    let forcing = tokio::spawn({
        let admin = admin.clone();
        async move { admin.force_release(&Key::new(key).unwrap()).await }
    });
    until_holds(port, key, "stuck", None, "the force_release").await;
    // The next owner takes the lock; then the operator's request is sent again.
    b.try_acquire(&req("next-owner"))
        .await
        .unwrap()
        .expect("free after force_release");
    // The primary is out of reach for two seconds (failed the call with a
    // `MOVED` from another node before the call was sent again with backoff).
    cluster.proxies[node].cut();
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster.proxies[node].restore();
    tokio::time::timeout(Duration::from_secs(30), forcing)
        .await
        .expect("force_release never finished")
        .unwrap()
        .unwrap();
    assert!(
        b.try_acquire(&req("third")).await.unwrap().is_none(),
        "a force_release sent again deleted the next owner's hold"
    );
}

/// Renewals go to each primary as one pipeline, by a slot map the client
/// keeps: when a slot moves to another primary, the old one answers `MOVED`
/// (redis-rs follows it; a lease it does not answer for is sent again on its
/// own and the map read anew), and the lease must be renewed where the slot
/// went, not lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_follows_a_slot_that_moved() {
    let cluster = PrivateCluster::start().await;
    let locker = Locker::new(RedisBackend::connect(&cluster.url("")).await.unwrap());
    let key = "moving";
    let name = format!("fencelock:{{{key}}}");
    let from = cluster.node_of(&name).await;
    let to = (from + 1) % 3;
    let ttl = Duration::from_secs(3);
    let moving = locker.lock(key).ttl(ttl).acquire().await.unwrap();
    // A second hold on the node that keeps its slots.
    let mut staying_key = String::new();
    for i in 0.. {
        staying_key = format!("staying-{i}");
        if cluster
            .node_of(&format!("fencelock:{{{staying_key}}}"))
            .await
            == to
        {
            break;
        }
    }
    let staying = locker.lock(&staying_key).ttl(ttl).acquire().await.unwrap();
    // Renewed at least once: the slot map is kept.
    tokio::time::sleep(ttl).await;
    let slot: i64 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(&name)
        .query_async(&mut direct(cluster.ports[0]).await)
        .await
        .unwrap();
    let id = |i: usize| {
        let port = cluster.ports[i];
        async move {
            let id: String = redis::cmd("CLUSTER")
                .arg("MYID")
                .query_async(&mut direct(port).await)
                .await
                .unwrap();
            id
        }
    };
    let (from_id, to_id) = (id(from).await, id(to).await);
    let setslot = |i: usize, how: &'static str, node: String| {
        let port = cluster.ports[i];
        async move {
            let _: () = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg(how)
                .arg(node)
                .query_async(&mut direct(port).await)
                .await
                .unwrap();
        }
    };
    setslot(to, "IMPORTING", from_id.clone()).await;
    setslot(from, "MIGRATING", to_id.clone()).await;
    let keys: Vec<String> = redis::cmd("CLUSTER")
        .arg("GETKEYSINSLOT")
        .arg(slot)
        .arg(100)
        .query_async(&mut direct(cluster.ports[from]).await)
        .await
        .unwrap();
    assert!(keys.contains(&name), "the lock's keys: {keys:?}");
    let _: () = redis::cmd("MIGRATE")
        .arg("127.0.0.1")
        .arg(cluster.ports[to])
        .arg("")
        .arg(0)
        .arg(5000)
        .arg("KEYS")
        .arg(&keys)
        .query_async(&mut direct(cluster.ports[from]).await)
        .await
        .unwrap();
    for i in 0..3 {
        setslot(i, "NODE", to_id.clone()).await;
    }
    // Several renewal periods and more than a TTL after the move.
    tokio::time::sleep(ttl * 2).await;
    assert!(
        moving.is_valid(),
        "the hold whose slot moved was lost: {:?}",
        moving.lease().lost_reason()
    );
    assert!(staying.is_valid(), "the other hold was lost");
    let left: i64 = redis::cmd("PTTL")
        .arg(&name)
        .query_async(&mut direct(cluster.ports[to]).await)
        .await
        .unwrap();
    assert!(
        left > 0,
        "the lock's key on the node its slot moved to: PTTL {left}"
    );
    moving.release().await.unwrap();
    staying.release().await.unwrap();
}
