//! A hostile review of the MariaDB lease line (`src/turnstile.rs`), kept as
//! tests: every grant stays exclusive under `KILL`s and cancels of the line's
//! sessions; cancelled and timed-out waiters leave no ghost head; reentrant,
//! shared and lapsing holds wake the head; waiters are granted in the order
//! they queued (failed when a queued `GET_LOCK` was sent again every second);
//! waits on other keys neither keep a waiter from a free lock nor deadlock
//! through the process's places in line (both failed with places that made
//! a waiter without one stop asking).

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock_core::Locker;
use sqlx::{Connection, MySqlConnection};
use support::line::{head, locker, locker_at, queued, raw, unique, until_head};
use tokio::time::Instant;

/// A hold as the chaos test logs it: key, token, start, end, task.
type Hold = (usize, u64, Instant, Instant, usize);

/// Claim: "the server keeps the order of the waiters". A queued waiter
/// that sent its `GET_LOCK` again every second went to the back of the
/// server's queue, and a later arrival overtook it (failed so). On a server
/// of its own, so that the processlist shows this test's waiters only.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_are_granted_in_the_order_they_queued() {
    let db = support::PrivateMariaDb::start();
    let url = db.url("lease");
    let key = unique("fifo");
    let (x, h, w1, w2) = (
        locker_at(&url).await,
        locker_at(&url).await,
        locker_at(&url).await,
        locker_at(&url).await,
    );
    let mut raw = MySqlConnection::connect(&url.replace("?mode=lease", ""))
        .await
        .unwrap();
    let held = x.lock(&key).acquire().await.unwrap();
    let order: Arc<Mutex<Vec<&'static str>>> = Arc::default();
    let spawn = |l: Locker, name: &'static str| {
        let (key, order) = (key.clone(), order.clone());
        tokio::spawn(async move {
            let g = l
                .lock(&key)
                .wait(Duration::from_secs(30))
                .acquire()
                .await
                .unwrap();
            order.lock().unwrap().push(name);
            tokio::time::sleep(Duration::from_millis(50)).await;
            g.release().await.unwrap();
        })
    };
    let th = spawn(h, "H");
    until_head(&mut raw, &key, true).await;
    let t1 = spawn(w1, "W1 (arrived first)");
    while queued(&mut raw).await < 1 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let w1_queued = Instant::now();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t2 = spawn(w2, "W2 (arrived 0.5 s later)");
    while queued(&mut raw).await < 2 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // W1's GET_LOCK ran out at ~1.0 s and was sent again, behind W2.
    tokio::time::sleep_until(w1_queued + Duration::from_millis(1200)).await;
    held.release().await.unwrap();
    for t in [th, t1, t2] {
        t.await.unwrap();
    }
    let order = order.lock().unwrap().clone();
    eprintln!("grant order: {order:?}");
    assert_eq!(order[1], "W1 (arrived first)", "FIFO broken: {order:?}");
    drop(db);
}

/// Claim 3: cancelled waiters (inside GET_LOCK, and the head inside its
/// doorbell) leave the line; how long until the key is usable again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_cancelled_waiters_leave_the_line() {
    let key = unique("cancel");
    let (x, w) = (locker().await, locker().await);
    let mut raw = raw().await;
    let held = x.lock(&key).acquire().await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..12 {
        let (w, key) = (w.clone(), key.clone());
        // Explicit owners: no local line, each waits at the backend.
        tasks.push(tokio::spawn(async move {
            w.lock(&key).owner(format!("o{i}")).acquire().await
        }));
    }
    until_head(&mut raw, &key, true).await;
    let until = Instant::now() + Duration::from_secs(10);
    while queued(&mut raw).await < 11 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!("queued in GET_LOCK: {}", queued(&mut raw).await);
    for t in &tasks {
        t.abort();
    }
    let cancelled = Instant::now();
    held.release().await.unwrap();
    let fresh = locker().await;
    let g = loop {
        if let Some(g) = fresh.lock(&key).try_acquire().await.unwrap() {
            break g;
        }
        assert!(
            cancelled.elapsed() < Duration::from_secs(10),
            "key unusable 10 s after cancelling its waiters"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    eprintln!(
        "try_acquire succeeded {:?} after the cancels",
        cancelled.elapsed()
    );
    g.release().await.unwrap();
    until_head(&mut raw, &key, false).await;
    eprintln!(
        "line empty {:?} after the cancels; queued now {}",
        cancelled.elapsed(),
        queued(&mut raw).await
    );
}

/// Claim 3: waiters whose deadlines run out around the moment the lock
/// lapses (fixed lease) and they become head: no ghost head, no invalid grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deadlines_expiring_as_waiters_become_head_leave_no_ghost() {
    for round in 0..3 {
        let key = unique(&format!("deadline{round}"));
        let (x, w, w2) = (locker().await, locker().await, locker().await);
        let mut raw = raw().await;
        let held = x
            .lock(&key)
            .lease(Duration::from_millis(1200))
            .acquire()
            .await
            .unwrap();
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..16u64 {
            let l = if i % 2 == 0 { w.clone() } else { w2.clone() };
            let key = key.clone();
            let wait = Duration::from_millis(1100 + 15 * i);
            tasks.push(tokio::spawn(async move {
                let r = l
                    .lock(&key)
                    .owner(format!("d{i}"))
                    .lease(Duration::from_secs(1))
                    .wait(wait)
                    .acquire()
                    .await;
                match r {
                    Ok(g) => {
                        let valid = g.is_valid();
                        let tok = g.token().unwrap().get();
                        g.release().await.unwrap();
                        Some((i, valid, tok))
                    }
                    Err(fencelock_core::Error::Timeout { .. }) => None,
                    Err(e) => panic!("waiter {i}: {e}"),
                }
            }));
        }
        let mut got = Vec::new();
        for t in tasks {
            if let Some(g) = t.await.unwrap() {
                got.push(g);
            }
        }
        drop(held);
        eprintln!("round {round}: granted {got:?} by {:?}", t0.elapsed());
        assert!(got.iter().all(|g| g.1), "a grant arrived invalid");
        let until = Instant::now() + Duration::from_secs(4);
        while head(&mut raw, &key).await.is_some() {
            assert!(Instant::now() < until, "ghost head");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let g = x.lock(&key).try_acquire().await.unwrap();
        assert!(g.is_some(), "key unusable after the deadline storm");
        g.unwrap().release().await.unwrap();
    }
}

/// Claim 3: the holder acquires again (explicit owner) while others wait in line.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_holder_reenters_while_others_wait_in_line() {
    let key = unique("reenter");
    let (a, b, c) = (locker().await, locker().await, locker().await);
    let mut raw = raw().await;
    let g1 = a.lock(&key).owner("o").acquire().await.unwrap();
    // Two waiters of other processes; each lets go as soon as it is granted
    // (which of them queued first is up to the scheduler).
    let waiter = |l: Locker| {
        let key = key.clone();
        tokio::spawn(async move {
            let g = l.lock(&key).wait(Duration::from_secs(30)).acquire().await?;
            let token = g.token();
            g.release().await?;
            Ok::<_, fencelock_core::Error>(token)
        })
    };
    let (tb, tc) = (waiter(b.clone()), waiter(c.clone()));
    until_head(&mut raw, &key, true).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t = Instant::now();
    let g2 = tokio::time::timeout(
        Duration::from_secs(5),
        a.lock(&key)
            .owner("o")
            .wait(Duration::from_secs(3))
            .acquire(),
    )
    .await
    .expect("reentrant acquire deadlocked behind the line")
    .unwrap();
    let g3 = a
        .lock(&key)
        .owner("o")
        .try_acquire()
        .await
        .unwrap()
        .expect("reentrant try refused");
    eprintln!(
        "reentrant acquire took {:?}; holds {}",
        t.elapsed(),
        g3.holds()
    );
    assert_eq!(g2.token(), g1.token());
    g3.release().await.unwrap();
    g2.release().await.unwrap();
    let first = g1.token();
    let t = Instant::now();
    g1.release().await.unwrap();
    let (b, c) = (tb.await.unwrap().unwrap(), tc.await.unwrap().unwrap());
    eprintln!(
        "both waiters served {:?} after the last release",
        t.elapsed()
    );
    assert!(b > first && c > first && b != c);
}

/// A shared holder, an exclusive head; the shared release rings the head.
/// Also: a fixed lease lapsing (no release) — how fast the head notices.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shared_release_and_a_lapse_wake_the_head() {
    let (r, w) = (locker().await, locker().await);
    let mut raw = raw().await;
    let mut lat = Vec::new();
    for i in 0..8 {
        let key = unique(&format!("shared{i}"));
        let held = r.read_lock(&key).acquire().await.unwrap();
        let tw = {
            let (w, key) = (w.clone(), key.clone());
            tokio::spawn(async move {
                let g = w
                    .lock(&key)
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await
                    .unwrap();
                let at = Instant::now();
                g.release().await.unwrap();
                at
            })
        };
        until_head(&mut raw, &key, true).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let t = Instant::now();
        held.release().await.unwrap();
        lat.push(tw.await.unwrap() - t);
    }
    eprintln!("shared release -> exclusive head grant: {lat:?}");
    let mut lapse = Vec::new();
    for i in 0..5 {
        let key = unique(&format!("lapse{i}"));
        let held = r
            .lock(&key)
            .lease(Duration::from_millis(800))
            .acquire()
            .await
            .unwrap();
        let expires = held.deadline();
        let tw = {
            let (w, key) = (w.clone(), key.clone());
            tokio::spawn(async move {
                let g = w
                    .lock(&key)
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await
                    .unwrap();
                let at = Instant::now();
                g.release().await.unwrap();
                at
            })
        };
        let at = tw.await.unwrap();
        lapse.push(at.saturating_duration_since(expires));
        drop(held);
    }
    eprintln!("lapse (local deadline) -> head grant: {lapse:?}");
}

/// 2288e8e: a process puts at most `pool` waiters in line; the others wait
/// in the process for a place and do not ask meanwhile. Eight long waits on
/// unrelated keys keep a waiter of a lock that is free from getting it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn long_waits_on_other_keys_do_not_keep_a_waiter_from_a_free_lock() {
    let base = unique("starve");
    let (p, q) = (locker().await, locker().await);
    let mut long = Vec::new();
    for i in 0..8 {
        long.push(q.lock(format!("{base}-L{i}")).acquire().await.unwrap());
    }
    let mut standby = Vec::new();
    for i in 0..8 {
        let (p, k) = (p.clone(), format!("{base}-L{i}"));
        standby.push(tokio::spawn(async move {
            p.lock(&k).wait(Duration::from_secs(60)).acquire().await
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let k = format!("{base}-K");
    let short = q.lock(&k).acquire().await.unwrap();
    let t0 = Instant::now();
    let waiter = {
        let (p, k) = (p.clone(), k.clone());
        tokio::spawn(async move { p.lock(&k).wait(Duration::from_secs(3)).acquire().await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    short.release().await.unwrap();
    let r = waiter.await.unwrap();
    let info = q.inspect(&k).await.unwrap();
    eprintln!("inspect({k}) after the timeout: {info:?}");
    let free = info.as_ref().is_none_or(|i| i.holders.is_empty());
    eprintln!(
        "waiter of {k}: {:?} after {:?}; the lock was released at 200 ms and is free now: {free}",
        r.as_ref().map(|g| g.token()).map_err(|e| e.to_string()),
        t0.elapsed()
    );
    for t in standby {
        t.abort();
    }
    drop(long);
    assert!(
        r.is_ok(),
        "an acquire timed out on a lock that was free for 2.8 s"
    );
}

/// 2288e8e: nested locks (hold Y, then want Z) deadlock through the places:
/// pool waiters hold every place waiting for keys whose holders wait for a place.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nested_locks_do_not_deadlock_on_the_places() {
    let base = unique("nest");
    let (p, q) = (locker().await, locker().await);
    let z = format!("{base}-Z");
    // Another process holds Z for 500 ms.
    let zq = q.lock(&z).acquire().await.unwrap();
    // Eight tasks of P hold Y_i (explicit owners, as a second Locker on the
    // same backend would) and will want Z next; eight other tasks of P wait for Y_i.
    let mut holders = Vec::new();
    for i in 0..8 {
        holders.push(
            p.lock(format!("{base}-Y{i}"))
                .owner(format!("h{i}"))
                .acquire()
                .await
                .unwrap(),
        );
    }
    let mut waiters = Vec::new();
    for i in 0..8 {
        let (p, k) = (p.clone(), format!("{base}-Y{i}"));
        waiters.push(tokio::spawn(async move {
            p.lock(&k)
                .wait(Duration::from_secs(8))
                .acquire()
                .await
                .map(|g| g.token())
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t0 = Instant::now();
    let mut nested = Vec::new();
    for (i, y) in holders.into_iter().enumerate() {
        let (p, z) = (p.clone(), z.clone());
        nested.push(tokio::spawn(async move {
            let r = p
                .lock(&z)
                .owner(format!("h{i}"))
                .wait(Duration::from_secs(6))
                .acquire()
                .await;
            let out = r.as_ref().map(|_| ()).map_err(|e| e.to_string());
            if let Ok(g) = r {
                g.release().await.unwrap();
            }
            y.release().await.unwrap();
            (out, Instant::now())
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    zq.release().await.unwrap();
    let mut ok = 0;
    for t in nested {
        let (r, at) = t.await.unwrap();
        eprintln!("holder wanting Z: {r:?} after {:?}", at - t0);
        ok += usize::from(r.is_ok());
    }
    for w in waiters {
        eprintln!(
            "waiter of Y: {:?}",
            w.await.unwrap().map_err(|e| e.to_string())
        );
    }
    assert_eq!(
        ok, 8,
        "nested acquires of a free lock timed out: deadlock on the line's places"
    );
}

/// Claim 1 under chaos (private server): random cancels, fixed leases that
/// lapse, KILL QUERY / KILL of the line's sessions at random statements.
/// No two valid holds overlap; tokens follow grant order; keys stay usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kills_and_cancels_in_the_line_keep_exclusion() {
    let db = support::PrivateMariaDb::start();
    let url = db.url("lease");
    let plain = url.replace("?mode=lease", "");
    let secs: u64 = std::env::var("CHAOS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let keys = ["c0", "c1"];
    // (key, token, start, end) of each hold.
    let log: Arc<Mutex<Vec<Hold>>> = Arc::default();
    let stop = Instant::now() + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    let mut seed = 0x9e3779b97f4a7c15u64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for p in 0..4 {
        let l = locker_at(&url).await;
        for t in 0..3 {
            let (l, log) = (l.clone(), log.clone());
            let mut s = rnd();
            tasks.push(tokio::spawn(async move {
                let mut r = move || {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    s
                };
                let (mut grants, mut cancels, mut timeouts, mut errors) = (0, 0, 0, 0);
                while Instant::now() < stop {
                    let k = (r() % 2) as usize;
                    let mut b = l
                        .lock(keys[k])
                        .lease(Duration::from_millis(300 + r() % 1200))
                        .wait(Duration::from_millis(50 + r() % 1500));
                    if t == 2 {
                        b = b.owner(format!("p{p}t{t}"));
                    }
                    let cancel_at = if r() % 3 == 0 {
                        Some(Duration::from_millis(r() % 300))
                    } else {
                        None
                    };
                    let res = match cancel_at {
                        Some(c) => match tokio::time::timeout(c, b.acquire()).await {
                            Ok(r) => r,
                            Err(_) => {
                                cancels += 1;
                                continue;
                            }
                        },
                        None => b.acquire().await,
                    };
                    match res {
                        Ok(g) => {
                            grants += 1;
                            let start = Instant::now();
                            assert!(g.is_valid(), "a grant arrived invalid");
                            tokio::time::sleep(Duration::from_millis(r() % 40)).await;
                            let end = Instant::now().min(g.deadline());
                            log.lock().unwrap().push((
                                k,
                                g.token().unwrap().get(),
                                start,
                                end,
                                p * 3 + t,
                            ));
                            let _ = g.release().await;
                        }
                        Err(fencelock_core::Error::Timeout { .. }) => timeouts += 1,
                        Err(_) => {
                            errors += 1;
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                }
                (grants, cancels, timeouts, errors)
            }));
        }
    }
    // The killer: the line's statements (GET_LOCK, doorbell, RELEASE_LOCK).
    let killer = {
        let plain = plain.clone();
        tokio::spawn(async move {
            let mut admin = MySqlConnection::connect(&plain).await.unwrap();
            let (mut kq, mut kc) = (0, 0);
            let mut s = 12345u64;
            while Instant::now() < stop {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                tokio::time::sleep(Duration::from_millis(20 + s % 80)).await;
                let ids: Vec<i64> = sqlx::query_scalar(
                    "SELECT CAST(id AS SIGNED) FROM information_schema.processlist
                     WHERE info LIKE 'SELECT GET_LOCK(CONCAT(LEFT(SHA2%' OR info LIKE 'SELECT RELEASE_LOCK(CONCAT(LEFT(SHA2%'
                        OR info LIKE 'SELECT IF(EXISTS(SELECT 1 FROM fencelock_locks%'",
                )
                .fetch_all(&mut admin)
                .await
                .unwrap_or_default();
                if ids.is_empty() {
                    continue;
                }
                let id = ids[(s as usize / 7) % ids.len()];
                let sql = if s.is_multiple_of(4) {
                    kc += 1;
                    "KILL ?"
                } else {
                    kq += 1;
                    "KILL QUERY ?"
                };
                let _ = sqlx::query(sql).bind(id).execute(&mut admin).await;
            }
            (kq, kc)
        })
    };
    let mut totals = (0, 0, 0, 0);
    for t in tasks {
        let (g, c, to, e) = t.await.unwrap();
        totals = (totals.0 + g, totals.1 + c, totals.2 + to, totals.3 + e);
    }
    let kills = killer.await.unwrap();
    let v = log.lock().unwrap().clone();
    let mut overlaps = 0;
    let mut order = 0;
    for (i, a) in v.iter().enumerate() {
        for b in v.iter().skip(i + 1) {
            if a.0 != b.0 || (a.1 == b.1 && a.4 == b.4) {
                continue;
            }
            if a.2 < b.3 && b.2 < a.3 {
                overlaps += 1;
                eprintln!(
                    "overlap on key {}: token {} {:?}..{:?} vs token {} {:?}..{:?}",
                    a.0, a.1, a.2, a.3, b.1, b.2, b.3
                );
            }
            let (first, second) = if a.2 <= b.2 { (a, b) } else { (b, a) };
            if first.3 <= second.2 && first.1 > second.1 {
                order += 1;
            }
        }
    }
    // One token of a key for two tasks. (A task with an explicit owner may
    // see its token again: an acquire of it cancelled after its grant left a
    // hold of that owner, which its next acquire re-enters, reentrantly.)
    let dup = {
        let mut t: Vec<(usize, u64, usize)> = v.iter().map(|e| (e.0, e.1, e.4)).collect();
        t.sort();
        t.dedup();
        let n = t.len();
        let mut keys: Vec<(usize, u64)> = t.iter().map(|e| (e.0, e.1)).collect();
        keys.dedup();
        n - keys.len()
    };
    eprintln!(
        "chaos {secs}s: grants {} cancels {} timeouts {} errors {}; KILL QUERY {} KILL {}; overlaps {overlaps}, token order violations {order}, duplicate tokens {dup}",
        totals.0, totals.1, totals.2, totals.3, kills.0, kills.1
    );
    // Every key usable again.
    let fresh = locker_at(&url).await;
    for k in keys {
        let t = Instant::now();
        let g = fresh
            .lock(k)
            .wait(Duration::from_secs(5))
            .acquire()
            .await
            .unwrap();
        eprintln!("key {k} acquired {:?} after the chaos", t.elapsed());
        g.release().await.unwrap();
    }
    assert_eq!((overlaps, order, dup), (0, 0, 0));
}
