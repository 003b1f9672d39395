//! The seeds' failure, live: a master dies before its replica copied a grant,
//! the replica is promoted (by the Sentinels, or by the cluster), and a second
//! client is granted the same key. Each test runs a private master, replica
//! and three Sentinels, or a private cluster with a replica per primary
//! (`fencelock_testkit::replicated`).

use std::time::{Duration, Instant};

use fencelock_core::{Backend, Error, Key, Locker, LostReason};
use fencelock_redis::RedisBackend;
use fencelock_redis::drill::Drill;
use fencelock_testkit::replicated::{ClusterSetup, SentinelSetup, redis_cli};

/// How long the Sentinels may take to promote a replica here (down after 1 s,
/// then an election), with room for a loaded machine.
const FAILOVER: Duration = Duration::from_secs(30);

/// The first test's Sentinels' `down-after-milliseconds`: 1 s, or
/// `FENCELOCK_DOWN_AFTER` (to measure a failover with Sentinel's default,
/// `30s`: BENCHMARKS.md).
fn down_after() -> Duration {
    std::env::var("FENCELOCK_DOWN_AFTER")
        .ok()
        .and_then(|d| humantime::parse_duration(&d).ok())
        .unwrap_or(Duration::from_secs(1))
}

fn setup(name: &str, down_after: Duration) -> (tempfile::TempDir, SentinelSetup) {
    let dir = tempfile::Builder::new()
        .prefix(&format!("fencelock-failover-{name}-"))
        .tempdir()
        .expect("temp dir");
    let s = SentinelSetup::start(dir.path(), 1, down_after).expect("sentinel setup");
    (dir, s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_the_replica_missed_is_granted_again_after_a_failover_and_the_old_holder_is_fenced_off()
 {
    let (_dir, mut s) = setup("missed", down_after());
    let url = s.url("");
    let a = RedisBackend::connect(&url).await.expect("connect A");
    let key = Key::new("orders/1").unwrap();
    let old = s.master_port().unwrap();

    // A is granted on the master while its replica is cut off; the master
    // dies before the replica could copy the grant.
    s.isolate_replicas(old).unwrap();
    let guard_a = Locker::new(a.clone())
        .lock(key.as_str())
        .acquire()
        .await
        .expect("A is granted on the master");
    let token_a = guard_a.token().expect("redis fences");
    // B waits from the moment the master dies.
    let b = RedisBackend::connect(&url).await.expect("connect B");
    s.node(old).kill();
    let killed = Instant::now();
    let waiter = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move {
            let g = Locker::new(b)
                .lock(key.as_str())
                .wait(FAILOVER + down_after())
                .acquire()
                .await;
            (g, killed.elapsed())
        })
    };
    s.resume_replicas(old).unwrap();
    let new = s.wait_for_failover(old, FAILOVER + down_after()).unwrap();
    let failed_over = Instant::now();
    assert_ne!(new, old);

    // B is granted the same key on the new master: the hold was lost.
    let (guard_b, waited) = waiter.await.unwrap();
    let guard_b = guard_b.expect("B is granted on the new master");
    eprintln!("B waited {waited:?} from the master's death to its grant");
    let token_b = guard_b.token().expect("redis fences");
    assert!(
        token_b > token_a,
        "tokens are floored at the server clock: B's {token_b:?} must pass A's {token_a:?}"
    );

    // The fence keeps the resource safe: A's late write is refused.
    let resource = "{orders/1}:state";
    assert!(b.fenced_set(resource, token_b, "B").await.unwrap());
    // (A's first command after the failover finds its connection broken,
    // as on any reconnect; the next goes to the new master.)
    let mut late = a.fenced_set(resource, token_a, "A").await;
    for _ in 0..5 {
        match late {
            Err(ref e) if e.is_transient() => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                late = a.fenced_set(resource, token_a, "A").await;
            }
            _ => break,
        }
    }
    assert!(!late.unwrap(), "A's stale write went through");

    // A learns at its next renewal that the hold is gone (a third of the
    // 30 s TTL after its last renewal, plus the failover).
    let lost = tokio::time::timeout(Duration::from_secs(25), guard_a.lost())
        .await
        .expect("A never learned it lost the lock");
    assert!(
        matches!(
            &lost,
            Error::Lost {
                reason: LostReason::NotHeld(_),
                ..
            }
        ),
        "A should learn from the new master that the hold is gone, not by expiry: {lost}"
    );
    eprintln!(
        "A learned it lost the lock {:?} after the failover",
        failed_over.elapsed()
    );
    assert!(guard_b.is_valid());
    guard_b.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_wait_replicas_a_grant_outlives_the_failover_and_no_replica_means_no_grant() {
    let (_dir, mut s) = setup("wait", Duration::from_secs(1));
    let url = s.url("?wait_replicas=1");
    let a = RedisBackend::connect(&url).await.expect("connect A");
    let key = Key::new("orders/2").unwrap();
    let old = s.master_port().unwrap();

    // Granted only once the replica has it: the failover keeps the hold.
    let guard_a = Locker::new(a.clone())
        .lock(key.as_str())
        .acquire()
        .await
        .expect("A is granted with the replica's acknowledgement");
    s.node(old).kill();
    let new = s.wait_for_failover(old, FAILOVER).unwrap();
    let b = RedisBackend::connect(&s.url("")).await.expect("connect B");
    let refused = Locker::new(b.clone())
        .lock(key.as_str())
        .try_acquire()
        .await
        .expect("B asks the new master");
    assert!(refused.is_none(), "B was granted while A's hold lives");
    // A's next renewal reaches the new master and keeps the hold.
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert!(
        guard_a.is_valid(),
        "A lost its hold: {:?}",
        guard_a.lease().lost_reason()
    );
    let info = b.inspect(&key).await.unwrap().expect("the lock is held");
    assert_eq!(info.holders.len(), 1);
    guard_a.release().await.unwrap();

    // With no replica answering, no grant is made: each attempt is undone
    // after wait_timeout (1 s), a waiter asks again until its wait ends,
    // and nothing is left behind.
    s.isolate_replicas(new).unwrap();
    let started = Instant::now();
    let e = Locker::new(a.clone())
        .lock(key.as_str())
        .wait(Duration::from_secs(3))
        .acquire()
        .await
        .expect_err("no grant without a replica");
    s.resume_replicas(new).unwrap();
    assert!(
        e.to_string().contains("replicas acknowledged"),
        "the error should say why: {e}"
    );
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "the waiter gave up before its wait ended: {e}"
    );
    eprintln!(
        "refused after {:?} without a replica: {e}",
        started.elapsed()
    );
    let info = b.inspect(&key).await.unwrap();
    assert!(
        info.as_ref().is_none_or(|i| i.holders.is_empty()),
        "the refused grant was left behind: {info:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_grant_the_replica_missed_is_granted_again_after_a_failover_and_fenced_off()
{
    let dir = tempfile::Builder::new()
        .prefix("fencelock-failover-cluster-")
        .tempdir()
        .expect("temp dir");
    let mut c = ClusterSetup::start(dir.path(), Duration::from_secs(2)).expect("cluster setup");
    let url = c.url("");
    let a = RedisBackend::connect(&url).await.expect("connect A");
    let key = Key::new("orders/3").unwrap();
    let name = "fencelock:{orders/3}";
    let old = c.primary_of(name).unwrap();

    let replicas = c.isolate_replicas(old).unwrap();
    let guard_a = Locker::new(a.clone())
        .lock(key.as_str())
        .acquire()
        .await
        .expect("A is granted on the primary");
    let token_a = guard_a.token().expect("redis fences");
    c.node(old).kill();
    c.resume(&replicas).unwrap();
    let new = c.wait_for_failover(old, name, FAILOVER).unwrap();
    assert!(
        replicas.contains(&new),
        "{new} not in {replicas:?} (old {old})"
    );

    let b = RedisBackend::connect(&url).await.expect("connect B");
    let guard_b = Locker::new(b.clone())
        .lock(key.as_str())
        .wait(FAILOVER)
        .acquire()
        .await
        .expect("B is granted on the new primary");
    let token_b = guard_b.token().expect("redis fences");
    assert!(
        token_b > token_a,
        "B's {token_b:?} must pass A's {token_a:?}"
    );

    let resource = "{orders/3}:state";
    assert!(b.fenced_set(resource, token_b, "B").await.unwrap());
    let mut late = a.fenced_set(resource, token_a, "A").await;
    for _ in 0..5 {
        match late {
            Err(ref e) if e.is_transient() => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                late = a.fenced_set(resource, token_a, "A").await;
            }
            _ => break,
        }
    }
    assert!(!late.unwrap(), "A's stale write went through");

    let lost = tokio::time::timeout(Duration::from_secs(25), guard_a.lost())
        .await
        .expect("A never learned it lost the lock");
    assert!(
        matches!(
            &lost,
            Error::Lost {
                reason: LostReason::NotHeld(_),
                ..
            }
        ),
        "A should learn from the new primary that the hold is gone: {lost}"
    );
    guard_b.release().await.unwrap();
}

/// The PTTL of `key`'s hold on the node on `port` (as the default user).
fn pttl(port: u16, key: &str) -> i64 {
    fencelock_testkit::replicated::redis_cli(port, &["pttl", &format!("fencelock:{{{key}}}")])
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(-2)
}

/// The Sentinels replace a master that this client can still reach (the
/// Sentinels' user is shut out of it; the client logs in as another user):
/// the holder must move to the new master, not renew on the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_follows_a_failover_away_from_a_master_it_still_reaches() {
    let (_dir, s) = setup("reachable", Duration::from_secs(1));
    for port in s.node_ports() {
        fencelock_testkit::replicated::redis_cli(
            port,
            &["acl", "setuser", "app", "on", ">pw", "~*", "&*", "+@all"],
        )
        .unwrap();
    }
    let url = s
        .url("")
        .replace("redis+sentinel://", "redis+sentinel://app:pw@");
    let a = RedisBackend::connect(&url).await.expect("connect A");
    let key = "orders/4";
    let old = s.master_port().unwrap();
    let guard_a = Locker::new(a.clone())
        .lock(key)
        .ttl(Duration::from_secs(15))
        .acquire()
        .await
        .expect("A is granted");
    let replica = s.node_ports().into_iter().find(|p| *p != old).unwrap();
    let start = Instant::now();
    while pttl(replica, key) <= 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "never replicated"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The Sentinels (the default user) can no longer talk to the master.
    fencelock_testkit::replicated::redis_cli(old, &["acl", "setuser", "default", "-@all"]).unwrap();
    let new = s.wait_for_failover(old, FAILOVER).unwrap();
    let after = pttl(new, key);
    assert!(
        after > 0,
        "the replica had A's hold: pttl {after}; keys there: {:?}",
        fencelock_testkit::replicated::redis_cli(new, &["keys", "*"])
    );
    // A's next renewal (every 5 s) reaches the new master: its copy's
    // expiry jumps back up. Renewing on the old master instead would leave
    // it to run out while A believes it holds.
    let start = Instant::now();
    let mut lowest = after;
    loop {
        let now = pttl(new, key);
        if now > lowest + 1000 {
            break;
        }
        lowest = lowest.min(now);
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "A's renewals never reached the new master (pttl {now} there)"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(guard_a.is_valid());
    let b = RedisBackend::connect(&url).await.expect("connect B");
    let refused = Locker::new(b).lock(key).try_acquire().await.unwrap();
    assert!(refused.is_none(), "B was granted while A holds");
    guard_a.release().await.unwrap();
}

/// With `wait_replicas=1` a renewal the replica did not acknowledge does not
/// extend the hold: a holder never counts on time a promoted replica would
/// not give it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_wait_replicas_a_renewal_no_replica_acknowledged_does_not_extend_the_hold() {
    let (_dir, mut s) = setup("renew", Duration::from_secs(1));
    let a = RedisBackend::connect(&s.url("?wait_replicas=1"))
        .await
        .expect("connect A");
    let master = s.master_port().unwrap();
    let guard = Locker::new(a)
        .lock("orders/5")
        .ttl(Duration::from_secs(6))
        .acquire()
        .await
        .expect("A is granted with the replica's acknowledgement");
    s.isolate_replicas(master).unwrap();
    let lost = tokio::time::timeout(Duration::from_secs(15), guard.lost()).await;
    s.resume_replicas(master).unwrap();
    let lost = lost.expect("A renewed without its replica and kept the hold");
    assert!(
        !matches!(
            &lost,
            Error::Lost {
                reason: LostReason::NotHeld(_),
                ..
            }
        ),
        "the master still has the hold: A should lose it by its deadline: {lost}"
    );
}

/// A failover drill (`fencelock_redis::drill`): both replicas cut off, A
/// granted, the Sentinels asked to fail over. One replica is promoted; the
/// other cannot copy from it until the drill is over, so the failover stays
/// "in progress" (up to the Sentinels' `failover-timeout`, 10 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_master_is_used_while_the_other_replicas_still_catch_up() {
    let dir = tempfile::Builder::new()
        .prefix("fencelock-failover-drill-")
        .tempdir()
        .expect("temp dir");
    let s = SentinelSetup::start(dir.path(), 2, Duration::from_secs(5)).expect("sentinel setup");
    let url = s.url("");
    let old = s.master_port().unwrap();
    let a = RedisBackend::connect(&url).await.expect("connect A");
    let key = Key::new("orders/3").unwrap();

    let drill = Drill::cut(&url)
        .await
        .expect("the drill cuts the replicas off");
    assert_eq!(drill.master(), format!("127.0.0.1:{old}"));
    assert_eq!(drill.replicas(), 2);
    let guard_a = Locker::new(a.clone())
        .lock(key.as_str())
        .ttl(Duration::from_secs(9))
        .acquire()
        .await
        .expect("A is granted on the master");
    let token_a = guard_a.token().expect("redis fences");
    let new = drill
        .fail_over(FAILOVER)
        .await
        .expect("the Sentinels fail over");
    assert_ne!(new, drill.master());

    // A client that starts now finds the promoted master at once, though the
    // failover is still in progress (the other replica cannot follow).
    let b = tokio::time::timeout(Duration::from_secs(5), async {
        let b = RedisBackend::connect(&url).await?;
        Locker::new(b)
            .lock(key.as_str())
            .wait(Duration::from_secs(4))
            .acquire()
            .await
    })
    .await
    .expect("B's connect and acquire took over 5 s")
    .expect("B is granted on the promoted master while the failover is in progress");
    assert!(b.token().expect("redis fences") > token_a);
    // A's next renewal (every 3 s) reaches the new master and finds B there.
    let lost = tokio::time::timeout(Duration::from_secs(15), guard_a.lost())
        .await
        .expect("A never learned it lost the lock");
    assert!(
        matches!(
            &lost,
            Error::Lost {
                reason: LostReason::NotHeld(_),
                ..
            }
        ),
        "A should learn from the new master that the hold is gone: {lost}"
    );

    // The drill puts the replicas' login back: every node but the new master
    // copies from it again.
    drill
        .restore()
        .await
        .expect("the drill restores the replicas");
    let new_port: u16 = new.rsplit(':').next().unwrap().parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let linked = redis_cli(new_port, &["info", "replication"])
            .is_ok_and(|i| i.contains("connected_slaves:2"));
        if linked {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the replicas did not follow the new master within 60 s of the restore"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    b.release().await.unwrap();
}

/// `min-replicas-to-write` (the docs advise it) makes a master refuse writes
/// while its replicas are away: a waiter waits for them, within its wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_that_refuses_writes_without_replicas_holds_waiters_until_one_returns() {
    let (_dir, mut s) = setup("noreplicas", Duration::from_secs(5));
    let master = s.master_port().unwrap();
    redis_cli(master, &["config", "set", "min-replicas-to-write", "1"]).unwrap();
    redis_cli(master, &["config", "set", "min-replicas-max-lag", "2"]).unwrap();
    let locker = Locker::new(RedisBackend::connect(&s.url("")).await.unwrap());
    s.isolate_replicas(master).unwrap();
    // Until the master sees a replica again, nothing is granted...
    let started = Instant::now();
    let refused = locker
        .lock("orders/4")
        .wait(Duration::from_secs(2))
        .acquire()
        .await
        .expect_err("granted without a replica");
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "gave up after {:?}, before its 2 s wait: {refused}",
        started.elapsed()
    );
    assert!(refused.to_string().contains("NOREPLICAS"), "{refused}");
    // ...and a waiter is granted once one is back.
    let waiter = {
        let locker = locker.clone();
        tokio::spawn(async move {
            locker
                .lock("orders/4")
                .wait(Duration::from_secs(60))
                .acquire()
                .await
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    s.resume_replicas(master).unwrap();
    let guard = waiter
        .await
        .unwrap()
        .expect("granted once the replica is back");
    assert_eq!(s.master_port().unwrap(), master, "no failover happened");
    guard.release().await.unwrap();
}
