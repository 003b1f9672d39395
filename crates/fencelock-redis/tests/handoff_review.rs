//! A hostile review of the cross-process handoff (a release hands the lock to
//! the first waiter of another process where it stands; 41ae074). Every test
//! runs against the real Redis on 6379 (or the cluster on 7101–7103, or a
//! private server); two `Locker`s on their own `RedisBackend`s stand for two
//! processes. Known limit, not tested here: a hold handed to a waiter that
//! died or gave up without reaching Redis lapses with its TTL (`scripts`).

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fencelock_core::backend::Request;
use fencelock_core::{Backend, Key, Locker, Mode, Owner};
use fencelock_redis::{RedisBackend, RedisOptions};
use fencelock_testkit::FaultProxy;
use tokio::time::Instant;

const SHARED: &str = "redis://127.0.0.1:6379";
const CLUSTER: &str = "redis+cluster://127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103";

fn unique(name: &str) -> String {
    format!("review/{name}/{}", uuid::Uuid::new_v4().simple())
}

async fn backend() -> RedisBackend {
    RedisBackend::connect(SHARED).await.unwrap()
}

async fn locker() -> Locker {
    Locker::new(backend().await)
}

async fn raw() -> redis::aio::MultiplexedConnection {
    redis::Client::open(SHARED)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// The raw exclusive hold of `key` under `prefix`, if any.
async fn raw_hold(
    conn: &mut redis::aio::MultiplexedConnection,
    prefix: &str,
    key: &str,
) -> Option<String> {
    let name = format!("{prefix}{{{key}}}");
    let kind: String = redis::cmd("TYPE")
        .arg(&name)
        .query_async(conn)
        .await
        .unwrap();
    if kind != "string" {
        return None;
    }
    redis::cmd("GET")
        .arg(&name)
        .query_async(conn)
        .await
        .unwrap()
}

/// Waits (up to 20 s) until `n` waiters stand in `key`'s queue with a request
/// for a grant where they stand.
async fn standing(conn: &mut redis::aio::MultiplexedConnection, prefix: &str, key: &str, n: usize) {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let len: usize = redis::cmd("HLEN")
            .arg(format!("{prefix}{{{key}}}:qd"))
            .query_async(conn)
            .await
            .unwrap();
        if len >= n {
            return;
        }
        assert!(
            Instant::now() < end,
            "{len} of {n} waiters stand in the queue with a request after 20 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn field(hold: &str, i: usize) -> &str {
    hold.split('\t').nth(i).unwrap_or_default()
}

// ---------------------------------------------------------------------------
// Attack 1: a prefix with a space. The prefix is only checked for braces and
// control characters, so `"hand off:"` is accepted; the grant channel
// (`<prefix>grant:<client>`) is stored in `P{k}:qd` separated by spaces and
// parsed back with `^(%S+) (%S+) (%d+) (%S+)$`, which failed (before e8fb7ff):
// `hand_on` dropped the first waiter from the queue (silently) and freed the
// lock, so the releaser barged back in ahead of the waiter that stood first.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_prefix_with_a_space_still_hands_the_lock_where_the_waiter_stands() {
    let prefix = "hand off:";
    let opts = || RedisOptions::default().prefix(prefix);
    let proxy = FaultProxy::start("127.0.0.1:6379".parse().unwrap())
        .await
        .unwrap();
    proxy.set_latency(Duration::from_millis(50));
    let a = Locker::new(RedisBackend::connect_with(SHARED, opts()).await.unwrap());
    let b = Locker::new(
        RedisBackend::connect_with(&format!("redis://{}", proxy.addr()), opts())
            .await
            .unwrap(),
    );
    let mut raw = raw().await;
    let key = unique("space-prefix");
    let held = a.lock(&key).acquire().await.unwrap();
    let (b2, k) = (b.clone(), key.clone());
    let waiter =
        tokio::spawn(async move { b2.lock(&k).wait(Duration::from_secs(10)).acquire().await });
    standing(&mut raw, prefix, &key, 1).await;
    held.release().await.unwrap();
    let hold = raw_hold(&mut raw, prefix, &key).await;
    // The releaser comes straight back: it must not get ahead of the waiter.
    let barged = a.lock(&key).try_acquire().await.unwrap();
    let barged_in = barged.is_some();
    if let Some(g) = barged {
        g.release().await.unwrap();
    }
    let g = waiter.await.unwrap().unwrap();
    g.release().await.unwrap();
    assert!(
        !barged_in,
        "with prefix {prefix:?} the releaser took the lock back ahead of the waiter that stood \
         first (the hold right after the release: {hold:?})"
    );
    assert!(
        hold.is_some(),
        "with prefix {prefix:?} the release freed the lock instead of handing it to the waiter"
    );
}

// ---------------------------------------------------------------------------
// Attack 3: random load. Four lockers (two on one backend), default and
// explicit owners, TTLs of 0.4–5 s, random wait deadlines and cancellation,
// one of them 15 ms away: no two valid holds overlap, tokens rise, and a
// valid holder's fenced write is never refused.
// ---------------------------------------------------------------------------

/// A time a guard was valid.
#[derive(Clone, Debug)]
struct Window {
    owner: String,
    token: u64,
    from: Instant,
    to: Instant,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_no_two_holders_under_timeouts_cancellation_and_handoffs() {
    let proxy = FaultProxy::start("127.0.0.1:6379".parse().unwrap())
        .await
        .unwrap();
    proxy.set_latency(Duration::from_millis(15));
    let a = locker().await;
    let bb = backend().await;
    let (b1, b2) = (Locker::new(bb.clone()), Locker::new(bb.clone()));
    let c = Locker::new(
        RedisBackend::connect(&format!("redis://{}", proxy.addr()))
            .await
            .unwrap(),
    );
    let fence = backend().await;
    let key = unique("churn");
    let resource = format!("{{{key}}}:resource");
    let windows = Arc::new(std::sync::Mutex::new(Vec::<Window>::new()));
    let violations = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let granted = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs(25);
    let mut tasks = Vec::new();
    for t in 0..10u64 {
        let lockers = [a.clone(), b1.clone(), b2.clone(), c.clone()];
        let (key, resource, fence) = (key.clone(), resource.clone(), fence.clone());
        let (windows, violations, granted) = (windows.clone(), violations.clone(), granted.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(t * 7919 + 1);
            while Instant::now() < end {
                let l = &lockers[rng.usize(..lockers.len())];
                let ttl = Duration::from_millis([400, 800, 2000, 5000][rng.usize(..4)]);
                let wait = Duration::from_millis(rng.u64(20..1500));
                let cancel = Duration::from_millis(rng.u64(5..2500));
                let mut b = l.lock(&key).ttl(ttl).wait(wait);
                if rng.bool() {
                    b = b.owner(format!("task{t}"));
                }
                let got = tokio::time::timeout(cancel, b.acquire()).await;
                let Ok(Ok(g)) = got else { continue };
                let from = Instant::now();
                granted.fetch_add(1, Ordering::Relaxed);
                let token = g.token().unwrap().get();
                let owner = g.owner().to_string();
                tokio::time::sleep(Duration::from_millis(rng.u64(0..40))).await;
                let wrote = fence
                    .fenced_set(&resource, g.token().unwrap(), &owner)
                    .await
                    .unwrap();
                if !wrote && g.is_valid() {
                    violations.lock().unwrap().push(format!(
                        "{owner} (token {token}) still valid but its fenced write was refused: a newer token was granted while it held"
                    ));
                }
                tokio::time::sleep(Duration::from_millis(rng.u64(0..20))).await;
                let to = Instant::now().min(g.deadline());
                if g.is_valid() {
                    windows.lock().unwrap().push(Window {
                        owner: owner.clone(),
                        token,
                        from,
                        to,
                    });
                }
                let _ = g.release().await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let mut w = windows.lock().unwrap().clone();
    w.sort_by_key(|w| w.from);
    let mut bad = violations.lock().unwrap().clone();
    for pair in w.windows(2) {
        let (x, y) = (&pair[0], &pair[1]);
        if y.from < x.to && x.owner != y.owner {
            bad.push(format!("overlap: {x:?} and {y:?}"));
        }
        if y.token < x.token {
            bad.push(format!("token went back: {x:?} then {y:?}"));
        }
    }
    eprintln!(
        "{} grants, {} valid windows checked",
        granted.load(Ordering::Relaxed),
        w.len()
    );
    assert!(bad.is_empty(), "{} violations: {:#?}", bad.len(), bad);
    assert!(w.len() > 20, "too few grants to mean anything: {}", w.len());
}

// ---------------------------------------------------------------------------
// Attack 4: cancellation at every moment around a handoff. B (through a
// proxy, 40 ms each way) waits with a 60 s TTL; its acquire is aborted at a
// sweep of moments around the holder's release. Whatever B's acquire had
// reached, the lock must not stay with nobody for B's TTL: C is granted
// within a few seconds each round.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_cancelling_a_waiter_around_a_handoff_never_orphans_the_hold() {
    let proxy = FaultProxy::start("127.0.0.1:6379".parse().unwrap())
        .await
        .unwrap();
    proxy.set_latency(Duration::from_millis(40));
    let (a, c) = (locker().await, locker().await);
    let b = Locker::new(
        RedisBackend::connect(&format!("redis://{}", proxy.addr()))
            .await
            .unwrap(),
    );
    let mut raw = raw().await;
    let mut failures = Vec::new();
    for round in 0..24u64 {
        let key = unique("cancel");
        let held = a.lock(&key).acquire().await.unwrap();
        let (b2, k) = (b.clone(), key.clone());
        let waiter = tokio::spawn(async move {
            b2.lock(&k)
                .ttl(Duration::from_secs(60))
                .wait(Duration::from_secs(30))
                .acquire()
                .await
        });
        standing(&mut raw, "fencelock:", &key, 1).await;
        // Release, then cancel B 0..230 ms later (B hears of the grant ~40 ms
        // after the release; its leave reaches Redis 40 ms after the abort).
        held.release().await.unwrap();
        tokio::time::sleep(Duration::from_millis(round * 10)).await;
        waiter.abort();
        if let Ok(Ok(g)) = waiter.await {
            // Granted before the abort: it holds; let go.
            g.release().await.unwrap();
        }
        let started = Instant::now();
        match c.lock(&key).wait(Duration::from_secs(8)).acquire().await {
            Ok(g) => g.release().await.unwrap(),
            Err(e) => failures.push(format!(
                "round {round}: the next waiter not granted after {:?} ({e}); hold: {:?}",
                started.elapsed(),
                raw_hold(&mut raw, "fencelock:", &key).await
            )),
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

// ---------------------------------------------------------------------------
// Attack 5: claim 2 — a waiter that starts on the grant message counts its
// lease from the send time of the attempt the message names, which is never
// later than the server-side grant: its local deadline is never past the
// server's expiry (beyond the drift margin).
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_handed_lease_never_outlives_the_servers_hold() {
    let proxy = FaultProxy::start("127.0.0.1:6379".parse().unwrap())
        .await
        .unwrap();
    proxy.set_latency(Duration::from_millis(150));
    let a = locker().await;
    let b = Locker::new(
        RedisBackend::connect(&format!("redis://{}", proxy.addr()))
            .await
            .unwrap(),
    );
    let mut raw = raw().await;
    for ttl_ms in [1200u64, 3000, 10_000] {
        let key = unique("validity");
        let held = a.lock(&key).acquire().await.unwrap();
        let (b2, k) = (b.clone(), key.clone());
        let waiter = tokio::spawn(async move {
            b2.lock(&k)
                .lease(Duration::from_millis(ttl_ms))
                .wait(Duration::from_secs(20))
                .acquire()
                .await
        });
        standing(&mut raw, "fencelock:", &key, 1).await;
        held.release().await.unwrap();
        let g = waiter.await.unwrap().unwrap();
        let local_left = g.deadline().saturating_duration_since(Instant::now());
        let pttl: i64 = redis::cmd("PTTL")
            .arg(format!("fencelock:{{{key}}}"))
            .query_async(&mut raw)
            .await
            .unwrap();
        assert!(
            pttl >= 0 && local_left <= Duration::from_millis(pttl as u64 + 3),
            "ttl {ttl_ms} ms: the guard believes {local_left:?} left, the server keeps the hold {pttl} ms"
        );
        g.release().await.unwrap();
    }
}

// ---------------------------------------------------------------------------
// Attack 6: two Lockers on one RedisBackend (shared Subscriptions and grant
// channel) waiting with the same explicit owner behind another owner; the
// grant is handed to whichever wait last wrote `qd`. Both must end up holding
// (one reentrant hold each), the third owner must stay out while either
// does, and each release must act on its own hold only.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_two_lockers_one_backend_same_owner_are_two_holds_of_one_owner() {
    let other = locker().await;
    let shared = backend().await;
    let (l1, l2) = (Locker::new(shared.clone()), Locker::new(shared.clone()));
    let mut raw = raw().await;
    let key = unique("same-owner");
    let owner = format!("me-{}", uuid::Uuid::new_v4().simple());
    let held = other.lock(&key).acquire().await.unwrap();
    let w1 = {
        let (l, k, o) = (l1.clone(), key.clone(), owner.clone());
        tokio::spawn(async move {
            l.lock(&k)
                .owner(o)
                .wait(Duration::from_secs(20))
                .acquire()
                .await
        })
    };
    let w2 = {
        let (l, k, o) = (l2.clone(), key.clone(), owner.clone());
        tokio::spawn(async move {
            l.lock(&k)
                .owner(o)
                .wait(Duration::from_secs(20))
                .acquire()
                .await
        })
    };
    standing(&mut raw, "fencelock:", &key, 1).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    held.release().await.unwrap();
    let g1 = w1.await.unwrap().unwrap();
    let g2 = w2.await.unwrap().unwrap();
    assert_eq!(g1.token(), g2.token());
    let hold = raw_hold(&mut raw, "fencelock:", &key).await.unwrap();
    assert_eq!(field(&hold, 0), owner);
    assert_eq!(field(&hold, 1), "2", "two holds of one owner: {hold}");
    assert!(other.lock(&key).try_acquire().await.unwrap().is_none());
    g1.release().await.unwrap();
    assert!(g2.is_valid());
    assert!(
        other.lock(&key).try_acquire().await.unwrap().is_none(),
        "releasing one hold of the owner let the other owner in"
    );
    g2.release().await.unwrap();
    assert!(other.lock(&key).try_acquire().await.unwrap().is_some());
}

// ---------------------------------------------------------------------------
// Attack 7: a waiter standing on Redis Cluster is handed the lock where it
// stands (the grant is published from a script on the key's primary; the
// waiter hears it on whichever node its subscription went to).
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_cluster_hands_the_lock_where_the_waiter_stands() {
    let a = Locker::new(RedisBackend::connect(CLUSTER).await.unwrap());
    let b = Locker::new(RedisBackend::connect(CLUSTER).await.unwrap());
    let mut raw_nodes = Vec::new();
    for p in [7101u16, 7102, 7103] {
        raw_nodes.push(support::direct(p).await);
    }
    for round in 0..3 {
        let key = unique(&format!("cluster-{round}"));
        let held = a.lock(&key).acquire().await.unwrap();
        let (b2, k) = (b.clone(), key.clone());
        let waiter = tokio::spawn(async move {
            let g = b2.lock(&k).wait(Duration::from_secs(20)).acquire().await;
            (g, Instant::now())
        });
        // Wait until B stands with a request on the key's node.
        let qd = format!("fencelock:{{{key}}}:qd");
        let end = Instant::now() + Duration::from_secs(20);
        'stand: loop {
            for c in raw_nodes.iter_mut() {
                let n: redis::RedisResult<usize> = redis::cmd("HLEN").arg(&qd).query_async(c).await;
                if matches!(n, Ok(n) if n >= 1) {
                    break 'stand;
                }
            }
            assert!(Instant::now() < end, "B never stood with a request");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let released = Instant::now();
        held.release().await.unwrap();
        let (g, at) = waiter.await.unwrap();
        let g = g.unwrap();
        assert!(
            at - released < Duration::from_millis(400),
            "round {round}: granted {:?} after the release: the grant message did not arrive",
            at - released
        );
        g.release().await.unwrap();
    }
}

// ---------------------------------------------------------------------------
// Attack 8: Redis restarts empty (no persistence) while a waiter stands with
// a request: the holder's hold is gone, the waiter must be granted soon after
// the server is back, with a larger token.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_waiter_standing_across_a_redis_restart_is_granted() {
    let port = fencelock_testkit::free_port();
    let mut server = support::redis_on(port, &[]);
    let url = format!("redis://127.0.0.1:{port}");
    let a = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let b = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let key = unique("restart");
    let held = a
        .lock(&key)
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let first = held.token().unwrap().get();
    let (b2, k) = (b.clone(), key.clone());
    let waiter =
        tokio::spawn(async move { b2.lock(&k).wait(Duration::from_secs(40)).acquire().await });
    let mut conn = support::direct(port).await;
    standing(&mut conn, "fencelock:", &key, 1).await;
    server.kill();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _server2 = support::redis_on(port, &[]);
    let restarted = Instant::now();
    let g = tokio::time::timeout(Duration::from_secs(15), waiter)
        .await
        .expect("the waiter was not granted within 15 s of the restart")
        .unwrap()
        .unwrap();
    assert!(
        restarted.elapsed() < Duration::from_secs(10),
        "granted {:?} after the restart",
        restarted.elapsed()
    );
    assert!(g.token().unwrap().get() > first);
    drop(held);
    g.release().await.unwrap();
}

// ---------------------------------------------------------------------------
// Attack 9: the backend directly. A waiter B whose grant is handed to it
// where it stands, while its acquire is already at its deadline: the hold
// must go to the next waiter, never stay with B, never to two.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_hold_handed_at_the_deadline_goes_to_exactly_one() {
    let a = backend().await;
    let bk = backend().await;
    let ck = backend().await;
    let mut raw = raw().await;
    let mut issues = Vec::new();
    for round in 0..20u64 {
        let key = Key::new(unique("deadline")).unwrap();
        let req = |o: &str, ttl: u64| {
            Request::new(
                key.clone(),
                Owner::new(o).unwrap(),
                Mode::Exclusive,
                Duration::from_millis(ttl),
            )
            .with_reentrant(false)
        };
        let ra = req("a", 30_000);
        let rb = req("b", 30_000);
        let rc = req("c", 30_000);
        let ga = a.try_acquire(&ra).await.unwrap().unwrap();
        // B waits until a deadline; C waits long.
        let b_deadline = Instant::now() + Duration::from_millis(1500);
        let (bk2, rb2) = (bk.clone(), rb.clone());
        let bw = tokio::spawn(async move { bk2.acquire(&rb2, Some(b_deadline)).await });
        standing(&mut raw, "fencelock:", key.as_str(), 1).await;
        let (ck2, rc2) = (ck.clone(), rc.clone());
        let cw = tokio::spawn(async move {
            ck2.acquire(&rc2, Some(Instant::now() + Duration::from_secs(20)))
                .await
        });
        standing(&mut raw, "fencelock:", key.as_str(), 2).await;
        // Release at B's deadline, give or take a few ms.
        let at = b_deadline - Duration::from_millis(10) + Duration::from_millis(round);
        tokio::time::sleep_until(at).await;
        a.release(&fencelock_core::backend::LeaseRef::new(&ra, &ga))
            .await
            .unwrap();
        let gb = bw.await.unwrap().unwrap();
        let gc = cw.await.unwrap().unwrap();
        let hold = raw_hold(&mut raw, "fencelock:", key.as_str()).await;
        match (&gb, &gc) {
            (Some(_), Some(_)) => {
                issues.push(format!("round {round}: both B and C granted ({hold:?})"))
            }
            (None, None) => issues.push(format!("round {round}: nobody granted ({hold:?})")),
            (Some(g), None) | (None, Some(g)) => {
                let who = if gb.is_some() { "b" } else { "c" };
                let h = hold.clone().unwrap_or_default();
                if field(&h, 0) != who
                    || field(&h, 2).parse::<u64>().ok() != g.token.map(|t| t.get())
                {
                    issues.push(format!(
                        "round {round}: {who} granted {g:?} but the hold is {hold:?}"
                    ));
                }
            }
        }
        for (b, r, g) in [(&bk, &rb, gb), (&ck, &rc, gc)] {
            if let Some(g) = g {
                let _ = b
                    .release(&fencelock_core::backend::LeaseRef::new(r, &g))
                    .await;
            }
        }
    }
    assert!(issues.is_empty(), "{issues:#?}");
}

// ---------------------------------------------------------------------------
// Attack 10: the last reader's release hands the lock to the writer that
// stands in the queue.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_the_last_reader_hands_the_lock_to_the_writer_where_it_stands() {
    let (a, b) = (locker().await, locker().await);
    let mut raw = raw().await;
    let key = unique("readers");
    let r1 = a.read_lock(&key).acquire().await.unwrap();
    let r2 = a.read_lock(&key).acquire().await.unwrap();
    let (b2, k) = (b.clone(), key.clone());
    let w = tokio::spawn(async move { b2.lock(&k).wait(Duration::from_secs(20)).acquire().await });
    standing(&mut raw, "fencelock:", &key, 1).await;
    // A new reader waits behind the writer.
    assert!(a.read_lock(&key).try_acquire().await.unwrap().is_none());
    r1.release().await.unwrap();
    assert!(raw_hold(&mut raw, "fencelock:", &key).await.is_none());
    r2.release().await.unwrap();
    let hold = raw_hold(&mut raw, "fencelock:", &key)
        .await
        .expect("the last reader's release did not hand the lock on");
    let g = w.await.unwrap().unwrap();
    assert_eq!(field(&hold, 0), g.owner().as_str());
    assert!(a.read_lock(&key).try_acquire().await.unwrap().is_none());
    g.release().await.unwrap();
}

// ---------------------------------------------------------------------------
// Attack 11: replies (and the grant message) to the waiter are lost while the
// lock is handed to it: its request to take the hold up runs, the answer
// never comes; its leave runs and the lock goes to the next waiter. The
// waiter asks again (a connection error does not end a wait) and fails at
// its deadline. Exactly one holder at the end, and not the waiter that failed.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_waiter_whose_replies_are_lost_as_it_is_handed_the_lock_passes_it_on() {
    let proxy = FaultProxy::start("127.0.0.1:6379".parse().unwrap())
        .await
        .unwrap();
    let (a, c) = (locker().await, locker().await);
    let b = Locker::new(
        RedisBackend::connect(&format!("redis://{}?timeout=500ms", proxy.addr()))
            .await
            .unwrap(),
    );
    let mut raw = raw().await;
    let key = unique("lost-replies");
    let held = a.lock(&key).acquire().await.unwrap();
    let (b2, k) = (b.clone(), key.clone());
    let bw = tokio::spawn(async move {
        b2.lock(&k)
            .ttl(Duration::from_secs(30))
            .wait(Duration::from_secs(20))
            .acquire()
            .await
    });
    standing(&mut raw, "fencelock:", &key, 1).await;
    let (c2, k) = (c.clone(), key.clone());
    let cw = tokio::spawn(async move { c2.lock(&k).wait(Duration::from_secs(20)).acquire().await });
    standing(&mut raw, "fencelock:", &key, 2).await;
    proxy.drop_replies();
    held.release().await.unwrap();
    let gc = tokio::time::timeout(Duration::from_secs(15), cw)
        .await
        .expect("C was not granted: the hold handed to B was not passed on")
        .unwrap()
        .unwrap();
    // B's 20 s wait ends (the acquire's cap: a second after it).
    let rb = tokio::time::timeout(Duration::from_secs(40), bw)
        .await
        .expect("B hung past its deadline")
        .unwrap();
    let hold = raw_hold(&mut raw, "fencelock:", &key).await.unwrap();
    assert_eq!(field(&hold, 0), gc.owner().as_str(), "{hold}");
    assert!(
        rb.is_err(),
        "B granted without ever hearing an answer: {rb:?}"
    );
    proxy.restore();
    gc.release().await.unwrap();
}

// ---------------------------------------------------------------------------
// Attack 12: in-process handoffs (release_to) come first, 16 in a row at
// most: a waiter of another process standing in the queue with a request is
// then handed the lock, and does not starve behind a busy local line.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_busy_local_line_lets_the_remote_waiter_in_after_sixteen_handoffs() {
    let (a, b) = (locker().await, locker().await);
    let key = unique("line");
    let stop = Instant::now() + Duration::from_secs(8);
    let mut local = Vec::new();
    for _ in 0..6 {
        let (a, key) = (a.clone(), key.clone());
        local.push(tokio::spawn(async move {
            let mut n = 0u32;
            while Instant::now() < stop {
                let g = a.lock(&key).acquire().await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
                g.release().await.unwrap();
                n += 1;
            }
            n
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let g = b.lock(&key).wait(Duration::from_secs(5)).acquire().await;
    let waited = started.elapsed();
    let g = g.unwrap_or_else(|e| panic!("the remote waiter starved behind the local line: {e}"));
    g.release().await.unwrap();
    let mut total = 0;
    for t in local {
        total += t.await.unwrap();
    }
    eprintln!("remote granted after {waited:?}; {total} local grants");
    assert!(waited < Duration::from_secs(2), "remote waited {waited:?}");
}

// ---------------------------------------------------------------------------
// Attack 3b: the randomised run of attack 3 with network faults on one
// "process": its proxy flips between passing (with latency), holding replies
// (requests run, answers and grant messages are lost), black-holing and
// resetting, with a 400 ms response timeout — so attempts, leaves, undos and
// grant messages are lost or late at every moment around handoffs.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_no_two_holders_under_network_faults() {
    let proxy = Arc::new(
        FaultProxy::start("127.0.0.1:6379".parse().unwrap())
            .await
            .unwrap(),
    );
    let a = locker().await;
    let bb = backend().await;
    let (b1, b2) = (Locker::new(bb.clone()), Locker::new(bb.clone()));
    let d = Locker::new(
        RedisBackend::connect(&format!("redis://{}?timeout=400ms", proxy.addr()))
            .await
            .unwrap(),
    );
    let fence = backend().await;
    let key = unique("chaos");
    let resource = format!("{{{key}}}:resource");
    let windows = Arc::new(std::sync::Mutex::new(Vec::<Window>::new()));
    let violations = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let end = Instant::now() + Duration::from_secs(30);
    let chaos = {
        let proxy = proxy.clone();
        tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(42);
            while Instant::now() < end {
                tokio::time::sleep(Duration::from_millis(rng.u64(100..600))).await;
                match rng.u8(..4) {
                    0 => proxy.set_latency(Duration::from_millis(rng.u64(0..40))),
                    1 => proxy.drop_replies(),
                    2 => proxy.blackhole(),
                    _ => proxy.cut(),
                }
                tokio::time::sleep(Duration::from_millis(rng.u64(50..700))).await;
                proxy.restore();
            }
            proxy.restore();
        })
    };
    let mut tasks = Vec::new();
    for t in 0..10u64 {
        let lockers = [a.clone(), b1.clone(), b2.clone(), d.clone(), d.clone()];
        let (key, resource, fence) = (key.clone(), resource.clone(), fence.clone());
        let (windows, violations) = (windows.clone(), violations.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(t * 104_729 + 7);
            while Instant::now() < end {
                let l = &lockers[rng.usize(..lockers.len())];
                let ttl = Duration::from_millis([600, 1000, 2500, 6000][rng.usize(..4)]);
                let wait = Duration::from_millis(rng.u64(20..2000));
                let cancel = Duration::from_millis(rng.u64(5..3000));
                let mut b = l.lock(&key).ttl(ttl).wait(wait);
                if rng.bool() {
                    b = b.owner(format!("task{t}"));
                }
                let Ok(Ok(g)) = tokio::time::timeout(cancel, b.acquire()).await else {
                    continue;
                };
                let from = Instant::now();
                let token = g.token().unwrap().get();
                let owner = g.owner().to_string();
                tokio::time::sleep(Duration::from_millis(rng.u64(0..40))).await;
                if let Ok(wrote) = fence
                    .fenced_set(&resource, g.token().unwrap(), &owner)
                    .await
                    && !wrote
                    && g.is_valid()
                {
                    violations.lock().unwrap().push(format!(
                        "{owner} (token {token}) still valid but its fenced write was refused"
                    ));
                }
                let to = Instant::now().min(g.deadline());
                if g.is_valid() {
                    windows.lock().unwrap().push(Window {
                        owner,
                        token,
                        from,
                        to,
                    });
                }
                let _ = tokio::time::timeout(Duration::from_secs(2), g.release()).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    chaos.await.unwrap();
    let mut w = windows.lock().unwrap().clone();
    w.sort_by_key(|w| w.from);
    let mut bad = violations.lock().unwrap().clone();
    for pair in w.windows(2) {
        let (x, y) = (&pair[0], &pair[1]);
        if y.from < x.to && x.owner != y.owner {
            bad.push(format!("overlap: {x:?} and {y:?}"));
        }
        if y.token < x.token {
            bad.push(format!("token went back: {x:?} then {y:?}"));
        }
    }
    eprintln!("{} valid windows checked", w.len());
    assert!(bad.is_empty(), "{} violations: {:#?}", bad.len(), bad);
    assert!(w.len() > 20, "too few grants to mean anything: {}", w.len());
}

// ---------------------------------------------------------------------------
// Attack 13: Redlock must not use the handoff: its waiters never stand with
// a request (`qd`) on any instance, and a release there frees the lock.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_redlock_never_stands_with_a_request_nor_is_handed_the_lock() {
    const THREE: &str = "redlock://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003";
    let a = Locker::new(
        fencelock_redis::RedlockBackend::connect(THREE)
            .await
            .unwrap(),
    );
    let b = Locker::new(
        fencelock_redis::RedlockBackend::connect(THREE)
            .await
            .unwrap(),
    );
    let key = unique("redlock");
    let held = a.lock(&key).acquire().await.unwrap();
    let (b2, k) = (b.clone(), key.clone());
    let w = tokio::spawn(async move { b2.lock(&k).wait(Duration::from_secs(20)).acquire().await });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for p in [7001u16, 7002, 7003] {
        let mut c = support::direct(p).await;
        for suffix in [":q", ":qd"] {
            let n: usize = redis::cmd("EXISTS")
                .arg(format!("fencelock:{{{key}}}{suffix}"))
                .query_async(&mut c)
                .await
                .unwrap();
            assert_eq!(n, 0, "Redlock waiter stands in {suffix} on instance {p}");
        }
    }
    held.release().await.unwrap();
    let g = w.await.unwrap().unwrap();
    g.release().await.unwrap();
}

// ---------------------------------------------------------------------------
// Attack 14: `wait_replicas`: a waiter whose grants must wait for replicas
// never stands with a request (the handoff's `WAIT` would be the releaser's);
// a release then frees the lock and that waiter takes it by asking, its grant
// acknowledged by the replica.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_wait_replicas_waiters_are_not_handed_the_lock() {
    let (mport, rport) = (
        fencelock_testkit::free_port(),
        fencelock_testkit::free_port(),
    );
    let _master = support::redis_on(mport, &[]);
    let _replica = support::redis_on(rport, &["--replicaof", "127.0.0.1", &mport.to_string()]);
    let url = format!("redis://127.0.0.1:{mport}/?wait_replicas=1&wait_timeout=3s");
    let plain = Locker::new(
        RedisBackend::connect(&format!("redis://127.0.0.1:{mport}"))
            .await
            .unwrap(),
    );
    let acked = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let mut conn = support::direct(mport).await;
    let key = unique("replicas");
    // The replica may take a moment to attach.
    let start = Instant::now();
    let held = loop {
        match acked
            .lock(&key)
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
    let (p2, k) = (plain.clone(), key.clone());
    let acked2 = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let k2 = key.clone();
    let w = tokio::spawn(async move {
        acked2
            .lock(&k2)
            .wait(Duration::from_secs(20))
            .acquire()
            .await
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let qd: usize = redis::cmd("HLEN")
        .arg(format!("fencelock:{{{key}}}:qd"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(qd, 0, "a wait_replicas waiter stands with a request");
    // A plain waiter behind it.
    let w2 = tokio::spawn(async move { p2.lock(&k).wait(Duration::from_secs(20)).acquire().await });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    held.release().await.unwrap();
    let g = w
        .await
        .unwrap()
        .expect("the wait_replicas waiter was not granted");
    assert!(!w2.is_finished(), "the plain waiter went ahead");
    g.release().await.unwrap();
    let g2 = w2.await.unwrap().unwrap();
    g2.release().await.unwrap();
}
