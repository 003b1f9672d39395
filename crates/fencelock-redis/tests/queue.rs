//! The queue of exclusive waiters (see the `scripts` module): a free lock goes
//! to the first live waiter, so a releaser cannot barge back in ahead of a
//! waiter in another process; a waiter that gives up, is cancelled or dies
//! does not hold the queue up for long; new readers wait behind a waiting
//! writer. Two `Locker`s on their own connections
//! stand for two processes.

use std::time::Duration;

use fencelock_core::Locker;
use fencelock_redis::RedisBackend;
use fencelock_testkit::FaultProxy;

const SHARED: &str = "redis://127.0.0.1:6379";

fn unique(name: &str) -> String {
    format!("queue/{name}/{}", uuid::Uuid::new_v4().simple())
}

async fn locker() -> Locker {
    Locker::new(RedisBackend::connect(SHARED).await.unwrap())
}

/// Polls `try_acquire` on `key` until it grants or `within` passes.
async fn free_within(l: &Locker, key: &str, within: Duration) -> bool {
    let end = tokio::time::Instant::now() + within;
    loop {
        if let Some(g) = l.lock(key).try_acquire().await.unwrap() {
            g.release().await.unwrap();
            return true;
        }
        if tokio::time::Instant::now() >= end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_in_another_process_goes_before_the_releaser_comes_back() {
    // The waiter hears of a release and answers 50 ms late each way, far
    // behind the releaser: only the queue can put it first.
    let proxy = FaultProxy::start("127.0.0.1:6379".parse().unwrap())
        .await
        .unwrap();
    proxy.set_latency(Duration::from_millis(50));
    let a = locker().await;
    let b = Locker::new(
        RedisBackend::connect(&format!("redis://{}", proxy.addr()))
            .await
            .unwrap(),
    );
    let key = unique("barge");
    for round in 0..3 {
        let held = a.lock(&key).acquire().await.unwrap();
        let (b2, k) = (b.clone(), key.clone());
        let waiter =
            tokio::spawn(async move { b2.lock(&k).wait(Duration::from_secs(10)).acquire().await });
        // In the queue after its first (refused) attempt: 100 ms through the proxy.
        tokio::time::sleep(Duration::from_millis(400)).await;
        held.release().await.unwrap();
        // Straight back, before the waiter has even heard of the release.
        let again = a.lock(&key).try_acquire().await.unwrap();
        assert!(
            again.is_none(),
            "round {round}: the releaser took the lock back ahead of the waiter in the queue"
        );
        let g = waiter
            .await
            .unwrap()
            .expect("the waiter in the queue was not granted");
        g.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_times_out_leaves_the_line() {
    let (a, b, c) = (locker().await, locker().await, locker().await);
    let key = unique("timeout");
    let held = a.lock(&key).acquire().await.unwrap();
    let r = b
        .lock(&key)
        .wait(Duration::from_millis(200))
        .acquire()
        .await;
    assert!(r.is_err(), "granted a held lock: {r:?}");
    held.release().await.unwrap();
    // Its place would last 3 s had it not left.
    let g = c.lock(&key).try_acquire().await.unwrap();
    assert!(
        g.is_some(),
        "a free lock refused: the timed-out waiter still stands in the queue"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_waiter_leaves_the_line() {
    let (a, b, c) = (locker().await, locker().await, locker().await);
    let key = unique("cancel");
    let held = a.lock(&key).acquire().await.unwrap();
    let waiting = b.lock(&key).wait(Duration::from_secs(30)).acquire();
    assert!(
        tokio::time::timeout(Duration::from_millis(200), waiting)
            .await
            .is_err(),
        "granted a held lock"
    );
    held.release().await.unwrap();
    assert!(
        free_within(&c, &key, Duration::from_secs(1)).await,
        "the cancelled waiter's place held the lock up"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_waiters_place_lapses() {
    let c = locker().await;
    let key = unique("dead");
    // A waiter that stood in the queue and died: its place lapses in 600 ms.
    let mut conn = redis::Client::open(SHARED)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let (q, qe) = (
        format!("fencelock:{{{key}}}:q"),
        format!("fencelock:{{{key}}}:qe"),
    );
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    let now_ms = secs * 1000 + micros / 1000;
    redis::pipe()
        .zadd(&q, "ghost", secs * 1_000_000 + micros)
        .zadd(&qe, "ghost", now_ms + 600)
        .exec_async(&mut conn)
        .await
        .unwrap();
    assert!(
        c.lock(&key).try_acquire().await.unwrap().is_none(),
        "a free lock went past the first waiter in the queue"
    );
    assert!(
        free_within(&c, &key, Duration::from_secs(2)).await,
        "the dead waiter's place did not lapse"
    );
    let left: bool = redis::cmd("EXISTS")
        .arg(&q)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(!left, "the queue outlived its last waiter");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_readers_wait_behind_a_waiting_writer() {
    let (a, b, c) = (locker().await, locker().await, locker().await);
    let key = unique("writer");
    let r = a.read_lock(&key).acquire().await.unwrap();
    let (c2, k) = (c.clone(), key.clone());
    let writer =
        tokio::spawn(async move { c2.lock(&k).wait(Duration::from_secs(10)).acquire().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        b.read_lock(&key).try_acquire().await.unwrap().is_none(),
        "a new reader went past a writer waiting in the queue"
    );
    r.release().await.unwrap();
    let w = writer
        .await
        .unwrap()
        .expect("the waiting writer was not granted");
    assert!(b.read_lock(&key).try_acquire().await.unwrap().is_none());
    w.release().await.unwrap();
    assert!(
        b.read_lock(&key).try_acquire().await.unwrap().is_some(),
        "a reader was refused after the writer left"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_held_up_by_a_writer_that_gives_up_are_woken() {
    let (a, b, c) = (locker().await, locker().await, locker().await);
    let key = unique("gave-up");
    let r = a.read_lock(&key).acquire().await.unwrap();
    let (c2, k) = (c.clone(), key.clone());
    let writer =
        tokio::spawn(async move { c2.lock(&k).wait(Duration::from_millis(800)).acquire().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (b2, k) = (b.clone(), key.clone());
    let reader = tokio::spawn(async move {
        b2.read_lock(&k)
            .wait(Duration::from_secs(10))
            .acquire()
            .await
    });
    assert!(
        writer.await.unwrap().is_err(),
        "the writer got in beside a reader"
    );
    let gave_up = tokio::time::Instant::now();
    let g = reader.await.unwrap().expect("the reader was not granted");
    // Woken when the writer left, not when its place would have lapsed (3 s).
    assert!(
        gave_up.elapsed() < Duration::from_millis(1500),
        "the reader waited {:?} after the writer gave up",
        gave_up.elapsed()
    );
    g.release().await.unwrap();
    r.release().await.unwrap();
}

/// The raw value of `key`'s exclusive hold (`owner\tholds\ttoken\t…`), if any.
async fn raw_hold(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> Option<String> {
    let kind: String = redis::cmd("TYPE")
        .arg(format!("fencelock:{{{key}}}"))
        .query_async(conn)
        .await
        .unwrap();
    if kind != "string" {
        return None;
    }
    redis::cmd("GET")
        .arg(format!("fencelock:{{{key}}}"))
        .query_async(conn)
        .await
        .unwrap()
}

/// Waits (up to 20 s) until `n` waiters stand in `key`'s queue with a request
/// for a grant where they stand.
async fn standing(conn: &mut redis::aio::MultiplexedConnection, key: &str, n: usize) {
    let end = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let len: usize = redis::cmd("HLEN")
            .arg(format!("fencelock:{{{key}}}:qd"))
            .query_async(conn)
            .await
            .unwrap();
        if len >= n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "{len} of {n} waiters stand in the queue with a request after 20 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn field(hold: &str, i: usize) -> &str {
    hold.split('\t').nth(i).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_hands_the_lock_to_the_first_waiter_where_it_stands() {
    // The waiter hears of the grant 300 ms late: had it to ask for the lock
    // after the release, the releaser's try straight after would find it
    // free or see the waiter's hold only after ~600 ms; handed over inside
    // the release, the hold is the waiter's at once.
    let proxy = FaultProxy::start("127.0.0.1:6379".parse().unwrap())
        .await
        .unwrap();
    proxy.set_latency(Duration::from_millis(300));
    let a = locker().await;
    let b = Locker::new(
        RedisBackend::connect(&format!("redis://{}", proxy.addr()))
            .await
            .unwrap(),
    );
    let mut raw = redis::Client::open(SHARED)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let key = unique("handed");
    let held = a.lock(&key).acquire().await.unwrap();
    let first_token = held.token().unwrap().get();
    let (b2, k) = (b.clone(), key.clone());
    let waiter =
        tokio::spawn(async move { b2.lock(&k).wait(Duration::from_secs(20)).acquire().await });
    // Standing in the queue with its request after its second attempt.
    standing(&mut raw, &key, 1).await;
    held.release().await.unwrap();
    let hold = raw_hold(&mut raw, &key)
        .await
        .expect("the release freed the lock instead of handing it to the waiter");
    let g = waiter.await.unwrap().expect("the waiter was not granted");
    assert_eq!(
        field(&hold, 0),
        g.owner().as_str(),
        "handed to someone else: {hold}"
    );
    assert_eq!(
        field(&hold, 2).parse::<u64>().unwrap(),
        g.token().unwrap().get()
    );
    assert!(g.token().unwrap().get() > first_token);
    assert!(g.is_valid());
    // Its lease is its own: renewed past the TTL, released by its grant.
    g.release().await.unwrap();
    assert!(raw_hold(&mut raw, &key).await.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_handed_to_a_dead_waiter_lapses_and_the_next_is_granted() {
    let (a, c) = (locker().await, locker().await);
    let key = unique("dead-grant");
    let mut raw = redis::Client::open(SHARED)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let held = a.lock(&key).acquire().await.unwrap();
    // A waiter that asked for a grant where it stands (TTL 2 s) and died:
    // its place would last 20 s.
    let (q, qe, qd) = (
        format!("fencelock:{{{key}}}:q"),
        format!("fencelock:{{{key}}}:qe"),
        format!("fencelock:{{{key}}}:qd"),
    );
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut raw).await.unwrap();
    redis::pipe()
        .zadd(&q, "ghost", secs * 1_000_000 + micros)
        .zadd(&qe, "ghost", secs * 1000 + micros / 1000 + 20_000)
        .hset(
            &qd,
            "ghost",
            "ghostwait ghostask 2000 fencelock:grant:ghost",
        )
        .exec_async(&mut raw)
        .await
        .unwrap();
    let (c2, k) = (c.clone(), key.clone());
    let next = tokio::spawn(async move {
        let g = c2.lock(&k).wait(Duration::from_secs(30)).acquire().await;
        (g, tokio::time::Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    held.release().await.unwrap();
    let released = tokio::time::Instant::now();
    let hold = raw_hold(&mut raw, &key)
        .await
        .expect("the release did not hand the lock to the first waiter");
    assert_eq!(field(&hold, 0), "ghost", "{hold}");
    let ghost_token: u64 = field(&hold, 2).parse().unwrap();
    assert!(
        a.lock(&key).try_acquire().await.unwrap().is_none(),
        "the handed hold is not a hold"
    );
    // The dead waiter's hold lapses with its TTL; the next waiter, asking
    // within a second, is granted then (not when the dead one's place lapses).
    let (g, at) = next.await.unwrap();
    let g = g.expect("the next waiter was not granted");
    assert!(g.token().unwrap().get() > ghost_token);
    assert!(
        at - released < Duration::from_secs(12),
        "granted {:?} after the release: the dead waiter's place held it up",
        at - released
    );
    g.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_times_out_as_it_is_handed_the_lock_passes_it_on() {
    // The waiter is cut off (its traffic held, not lost) while a release
    // hands it the lock, and runs out of time before it hears: its leaving,
    // delivered when the way is open again, gives the lock to the next waiter.
    let proxy = FaultProxy::start("127.0.0.1:6379".parse().unwrap())
        .await
        .unwrap();
    let (a, c) = (locker().await, locker().await);
    let b = Locker::new(
        RedisBackend::connect(&format!("redis://{}", proxy.addr()))
            .await
            .unwrap(),
    );
    let mut raw = redis::Client::open(SHARED)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let key = unique("timeout-grant");
    let held = a.lock(&key).acquire().await.unwrap();
    let (b2, k) = (b.clone(), key.clone());
    let waiter =
        tokio::spawn(async move { b2.lock(&k).wait(Duration::from_secs(3)).acquire().await });
    standing(&mut raw, &key, 1).await;
    let (c2, k) = (c.clone(), key.clone());
    let next =
        tokio::spawn(async move { c2.lock(&k).wait(Duration::from_secs(60)).acquire().await });
    standing(&mut raw, &key, 2).await;
    proxy.blackhole();
    held.release().await.unwrap();
    let hold = raw_hold(&mut raw, &key)
        .await
        .expect("the release did not hand the lock to the first waiter");
    let handed_token: u64 = field(&hold, 2).parse().unwrap();
    // The first waiter gives up (its deadline, or its requests time out)
    // without hearing a thing; then the way opens.
    let r = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("the cut-off waiter did not give up")
        .unwrap();
    assert!(
        r.is_err(),
        "granted although it never heard of the grant: {r:?}"
    );
    assert!(
        !next.is_finished(),
        "the second waiter was granted a held lock"
    );
    proxy.restore();
    let g = tokio::time::timeout(Duration::from_secs(15), next)
        .await
        .expect("the handed hold was not passed on: the lock waits for its TTL")
        .unwrap()
        .expect("the second waiter was not granted");
    assert!(g.token().unwrap().get() > handed_token);
    let hold = raw_hold(&mut raw, &key).await.unwrap();
    assert_eq!(
        field(&hold, 0),
        g.owner().as_str(),
        "two holds at once: {hold}"
    );
    g.release().await.unwrap();
}
