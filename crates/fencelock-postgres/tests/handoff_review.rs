//! A hostile review of lease mode's cross-process queue (the handoff where a
//! waiter stands): each test states the claim it attacks and fails if the
//! claim breaks. The first five failed on the queue's first version (two
//! valid holders through a leave that deleted a joined hold; a stale place
//! handed the lock after a reentrant grant; a cancelled wait on a new key
//! handed the lock after it left; a dead waiter without a channel kept the
//! lock from everyone until its place lapsed; a shared try barged ahead of
//! the queue).

mod support;

use std::time::Duration;

use fencelock_core::Locker;
use fencelock_postgres::PostgresBackend;
use sqlx::{Connection, PgConnection};
use support::SHARED;
use tokio::time::Instant;

fn unique(name: &str) -> String {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64 % 1_000_000_007)
        .unwrap_or(0);
    format!("review-{name}-{}-{n}", std::process::id())
}

async fn locker() -> Locker {
    Locker::new(
        PostgresBackend::connect(&format!("{SHARED}?mode=lease"))
            .await
            .unwrap(),
    )
}

async fn raw() -> PgConnection {
    PgConnection::connect(SHARED).await.unwrap()
}

async fn holders(raw: &mut PgConnection, key: &str) -> Vec<(String, i64, i32)> {
    sqlx::query_as(
        "SELECT owner, fence, holds FROM fencelock_locks
         WHERE key = $1 AND owner <> '' AND expires_at > now() ORDER BY fence",
    )
    .bind(key)
    .fetch_all(raw)
    .await
    .unwrap()
}

async fn standing(raw: &mut PgConnection, key: &str, n: i64) {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let count: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM fencelock_waiters
             WHERE key = $1 AND chan IS NOT NULL AND NOT gone AND stands_until > now()",
        )
        .bind(key)
        .fetch_one(&mut *raw)
        .await
        .unwrap();
        if count >= n {
            return;
        }
        assert!(
            Instant::now() < until,
            "{n} waiters did not stand ({count})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Claim: never two valid holders. Two tasks of one process acquire with the
/// same explicit owner (reentrant by the API's contract). Task A waits in the
/// queue and is handed the lock; before A takes it up, task B's reentrant
/// acquire joins that hold (holds 2); then A's wait times out and
/// `fencelock_leave` deletes the whole row (grant_id = A's wait) and hands the
/// lock to C, while B's guard is still valid.
///
/// A is a real waiter on a runtime of its own that we stall (a GC pause, a busy
/// executor) across the hand-on and past its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaving_takes_back_one_hold_of_a_handed_hold_the_same_owner_joined() {
    let (a, b, c) = (locker().await, locker().await, locker().await);
    let mut raw = raw().await;
    let key = unique("same-owner");
    let ttl = Duration::from_secs(30);
    let held = a.lock(&key).ttl(ttl).acquire().await.unwrap();

    // Task A: same process as B in spirit; its own runtime so we can stall it.
    let (rt_tx, rt_rx) = std::sync::mpsc::channel();
    let (k2, started) = (key.clone(), Instant::now());
    let a_thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt_tx.send(rt.handle().clone()).unwrap();
        rt.block_on(async move {
            let wa = locker().await;
            let r = wa
                .lock(&k2)
                .owner("review-shared-owner")
                .ttl(Duration::from_secs(2))
                .wait(Duration::from_secs(3))
                .acquire()
                .await;
            // Let a spawned leave finish.
            tokio::time::sleep(Duration::from_millis(500)).await;
            r.map(|g| {
                let v = g.is_valid();
                std::mem::forget(g);
                v
            })
        })
    });
    let a_rt = rt_rx.recv().unwrap();
    standing(&mut raw, &key, 1).await;
    // Stall A's runtime past its deadline (started + 3 s).
    let stall = (started + Duration::from_millis(3600)).saturating_duration_since(Instant::now());
    a_rt.spawn(async move { std::thread::sleep(stall) });
    tokio::time::sleep(Duration::from_millis(100)).await;

    held.release().await.unwrap();
    let now = holders(&mut raw, &key).await;
    assert_eq!(now.len(), 1, "{now:?}");
    assert_eq!(now[0].0, "review-shared-owner", "{now:?}");

    // Task B, same owner: reentrant acquire joins the hold.
    let gb = b
        .lock(&key)
        .owner("review-shared-owner")
        .ttl(ttl)
        .try_acquire()
        .await
        .unwrap()
        .expect("B's reentrant acquire was refused");
    eprintln!("B holds token {:?} holds {}", gb.token(), gb.holds());

    // C waits for the lock.
    let (c2, k) = (c.clone(), key.clone());
    let next = tokio::spawn(async move {
        c2.lock(&k)
            .ttl(ttl)
            .wait(Duration::from_secs(20))
            .acquire()
            .await
    });

    let a_result = tokio::task::spawn_blocking(move || a_thread.join().unwrap())
        .await
        .unwrap();
    eprintln!(
        "A's wait ended: {:?}",
        a_result.as_ref().map_err(|e| e.to_string())
    );
    let gc = tokio::time::timeout(Duration::from_secs(3), next).await;
    let now = holders(&mut raw, &key).await;
    eprintln!("server holders now: {now:?}; B valid: {}", gb.is_valid());
    if let Ok(Ok(Ok(gc))) = gc {
        assert!(
            !(gb.is_valid() && gc.is_valid()),
            "TWO VALID HOLDERS: B (owner review-shared-owner, token {:?}, {:?} left) and C (token {:?}, {:?} left); server: {now:?}",
            gb.token(),
            gb.lease().time_left(),
            gc.token(),
            gc.lease().time_left()
        );
    }
    assert!(
        now.iter().any(|h| h.0 == "review-shared-owner"),
        "B's valid reentrant hold was deleted by A's leave: {now:?}"
    );
}

/// Claim: a wait that left (`fencelock_leave`) is never handed the lock ("a late
/// attempt of that wait grants nothing"). On a key whose fence row is not yet
/// committed (its first use), the leave finds no fence row, marks nothing and
/// returns false; the cancelled wait's attempt, still in flight, then stands
/// with its channel and a release hands it the lock: a hold nobody will take,
/// for the cancelled waiter's TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_cancelled_on_a_new_key_is_not_handed_the_lock_after_it_left() {
    let (w, c) = (locker().await, locker().await);
    // Start w's listener (it hears its grant channel before the real wait).
    let warm = unique("warm");
    w.lock(&warm)
        .wait(Duration::from_secs(1))
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;

    let key = unique("new-key");
    let mut x = raw().await;
    let mut raw = raw().await;
    let mut tx = x.begin().await.unwrap();
    let (ok, tok): (bool, i64) = sqlx::query_as(
        "SELECT ok, tok FROM fencelock_acquire($1, 'X', 'exclusive', 30000, false, 0)",
    )
    .bind(&key)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert!(ok);
    // The waiter's first attempt blocks behind X's uncommitted fence row (in
    // production: X's commit waiting for its WAL flush); the acquire is
    // cancelled meanwhile.
    let r = tokio::time::timeout(
        Duration::from_millis(500),
        w.lock(&key)
            .ttl(Duration::from_secs(30))
            .wait(Duration::from_secs(10))
            .acquire(),
    )
    .await;
    assert!(r.is_err(), "the acquire was not cancelled");
    tx.commit().await.unwrap();
    // The spawned leave (it waited for X's fence row) marks the wait gone.
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let gone: i64 =
            sqlx::query_scalar("SELECT count(*) FROM fencelock_waiters WHERE key = $1 AND gone")
                .bind(&key)
                .fetch_one(&mut raw)
                .await
                .unwrap();
        if gone > 0 {
            break;
        }
        assert!(Instant::now() < until, "the cancelled wait never left");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let left: i32 = sqlx::query_scalar("SELECT fencelock_release($1, 'X', $2, true)")
        .bind(&key)
        .bind(tok)
        .fetch_one(&mut raw)
        .await
        .unwrap();
    assert_eq!(left, 0);
    let now = holders(&mut raw, &key).await;
    // Nobody wants the lock now (the only waiter was cancelled and left): it
    // must be free.
    let got = c.lock(&key).wait(Duration::from_secs(2)).acquire().await;
    assert!(
        now.is_empty() && got.is_ok(),
        "the lock was handed to a wait that had left: holders {now:?}; a new acquire: {:?}",
        got.as_ref().map(|g| g.token()).map_err(|e| e.to_string())
    );
}

/// A waiter whose first attempt stood without a channel (its backend did not
/// listen yet) and that died: the release hands it the lock anyway (its next
/// attempt would take the hold up), so the lock is held by nobody for at most
/// that waiter's TTL (100 ms), not for as long as its place lasts (here 20 s;
/// a client's own is 3 s). Before, nobody could take the free lock until the
/// place lapsed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_waiter_without_a_channel_keeps_a_lock_from_others_for_its_ttl_only() {
    let (a, c) = (locker().await, locker().await);
    let mut raw = raw().await;
    let key = unique("dead-nochan");
    let ttl = Duration::from_millis(100);
    let held = a
        .lock(&key)
        .ttl(Duration::from_secs(5))
        .acquire()
        .await
        .unwrap();
    let (ok,): (bool,) = sqlx::query_as(
        "SELECT ok FROM fencelock_acquire($1, 'ghost', 'exclusive', 100, false, 0,
                                          'ghostwait', NULL, 1, 20000, false)",
    )
    .bind(&key)
    .fetch_one(&mut raw)
    .await
    .unwrap();
    assert!(!ok);
    held.release().await.unwrap();
    let freed = Instant::now();
    let now = holders(&mut raw, &key).await;
    assert!(
        now.is_empty() || (now.len() == 1 && now[0].0 == "ghost"),
        "handed to someone else than the first waiter: {now:?}"
    );
    let g = c
        .lock(&key)
        .ttl(ttl)
        .wait(Duration::from_secs(30))
        .acquire()
        .await;
    let took = freed.elapsed();
    assert!(g.is_ok(), "{g:?}");
    assert!(
        took < Duration::from_secs(10),
        "the lock was free but nobody could take it for {took:?} (TTLs 100 ms)"
    );
}

/// Claim: while a live waiter stands, a free lock goes only to the first. A
/// shared request takes a free lock ahead of a standing exclusive waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_try_waits_behind_a_standing_writer() {
    let a = locker().await;
    let mut raw = raw().await;
    let key = unique("shared-barge");
    let (ok,): (bool,) =
        sqlx::query_as("SELECT ok FROM fencelock_acquire($1, 'H', 'exclusive', 60000, false, 0)")
            .bind(&key)
            .fetch_one(&mut raw)
            .await
            .unwrap();
    assert!(ok);
    let (ok,): (bool,) = sqlx::query_as(
        "SELECT ok FROM fencelock_acquire($1, 'ghost', 'exclusive', 60000, false, 0,
                                          'ghostwait', NULL, 1, 3000, false)",
    )
    .bind(&key)
    .fetch_one(&mut raw)
    .await
    .unwrap();
    assert!(!ok);
    sqlx::query("DELETE FROM fencelock_locks WHERE key = $1 AND owner = 'H'")
        .bind(&key)
        .execute(&mut raw)
        .await
        .unwrap();
    let g = a.read_lock(&key).try_acquire().await.unwrap();
    assert!(
        g.is_none(),
        "a shared try took the free lock while an exclusive waiter stood first"
    );
}

/// Claim: no lock left held by nobody beyond... (here: a release with no
/// waiter left frees the lock). Two tasks of one process wait with the same
/// explicit owner; the first is handed the lock, the second's next attempt
/// joins it reentrantly — a grant that does not remove its place from the
/// queue. Both release; the last release hands the lock to that stale place
/// (a wait that already returned): held by nobody for the TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reentrant_grant_leaves_the_queue_too() {
    let (a, b, c) = (locker().await, locker().await, locker().await);
    let mut raw = raw().await;
    let key = unique("reent-place");
    let ttl = Duration::from_secs(30);
    let held = a.lock(&key).ttl(ttl).acquire().await.unwrap();
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let (b2, k) = (b.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            b2.lock(&k)
                .owner("review-reent-owner")
                .ttl(ttl)
                .wait(Duration::from_secs(20))
                .acquire()
                .await
        }));
    }
    standing(&mut raw, &key, 2).await;
    held.release().await.unwrap();
    let mut guards = Vec::new();
    for t in tasks {
        guards.push(
            tokio::time::timeout(Duration::from_secs(5), t)
                .await
                .expect("a same-owner waiter was not granted")
                .unwrap()
                .unwrap(),
        );
    }
    for g in guards {
        g.release().await.unwrap();
    }
    let now = holders(&mut raw, &key).await;
    let places: Vec<(String, bool)> =
        sqlx::query_as("SELECT wait_id, gone FROM fencelock_waiters WHERE key = $1")
            .bind(&key)
            .fetch_all(&mut raw)
            .await
            .unwrap();
    let got = c.lock(&key).try_acquire().await.unwrap();
    assert!(
        now.is_empty() && got.is_some(),
        "every guard released, yet the lock is held: {now:?} (places left: {places:?})"
    );
}

/// Listener reconnect: the waiter's LISTEN session is killed just before the
/// release hands it the lock (the grant NOTIFY is lost). Expected to hold: the
/// waiter's next attempt takes the hold up; one holder; its guard no longer
/// than the server's row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_lost_with_the_listener_is_taken_up_by_the_next_attempt() {
    let (a, b) = (locker().await, locker().await);
    let mut raw = raw().await;
    for round in 0..4 {
        let key = unique(&format!("listener-kill{round}"));
        let held = a
            .lock(&key)
            .ttl(Duration::from_secs(10))
            .acquire()
            .await
            .unwrap();
        let (b2, k) = (b.clone(), key.clone());
        let waiter = tokio::spawn(async move {
            b2.lock(&k)
                .ttl(Duration::from_secs(4))
                .wait(Duration::from_secs(30))
                .acquire()
                .await
        });
        standing(&mut raw, &key, 1).await;
        let chan: String = sqlx::query_scalar(
            "SELECT chan FROM fencelock_waiters WHERE key = $1 AND chan IS NOT NULL LIMIT 1",
        )
        .bind(&key)
        .fetch_one(&mut raw)
        .await
        .unwrap();
        let killed: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE query LIKE '%' || $1 || '%' AND pid <> pg_backend_pid()",
        )
        .bind(&chan)
        .fetch_all(&mut raw)
        .await
        .unwrap();
        held.release().await.unwrap();
        let released = Instant::now();
        let g = tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("not granted")
            .unwrap()
            .unwrap();
        let took = released.elapsed();
        let server_left: f64 = sqlx::query_scalar(
            "SELECT extract(epoch FROM expires_at - clock_timestamp())::float8 FROM fencelock_locks
             WHERE key = $1 AND owner = $2",
        )
        .bind(&key)
        .bind(g.owner().as_str())
        .fetch_one(&mut raw)
        .await
        .unwrap();
        eprintln!(
            "round {round}: killed {killed:?}; granted {took:?} after the release; guard {:?} left, server {server_left:.3} s",
            g.lease().time_left()
        );
        assert!(g.is_valid());
        assert!(
            Duration::from_secs_f64(server_left.max(0.0)) + Duration::from_millis(50)
                >= g.lease().time_left()
        );
        let now = holders(&mut raw, &key).await;
        assert_eq!(now.len(), 1);
        assert_eq!(now[0].1 as u64, g.token().unwrap().get());
        g.release().await.unwrap();
    }
}

/// Cancellation (the acquire future dropped, not a deadline) around the
/// moment the lock is handed to the waiter: the spawned leave must take the
/// hold back and pass it on; never two holders, never a lock left to lapse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_cancelled_as_the_lock_is_handed_to_it_passes_it_on() {
    let (a, b, c) = (locker().await, locker().await, locker().await);
    let mut raw = raw().await;
    let (mut won, mut cancelled) = (0, 0);
    for round in 0..16u64 {
        let key = unique(&format!("cancel{round}"));
        let ttl = Duration::from_secs(30);
        let held = a.lock(&key).ttl(ttl).acquire().await.unwrap();
        let (b2, k) = (b.clone(), key.clone());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let waiter = tokio::spawn(async move {
            tokio::select! {
                g = b2.lock(&k).ttl(ttl).wait(Duration::from_secs(60)).acquire() => Some(g),
                _ = rx => None,
            }
        });
        standing(&mut raw, &key, 1).await;
        let (c2, k) = (c.clone(), key.clone());
        let next = tokio::spawn(async move {
            c2.lock(&k)
                .ttl(ttl)
                .wait(Duration::from_secs(60))
                .acquire()
                .await
        });
        standing(&mut raw, &key, 2).await;
        let offset = round % 8;
        let release_first = round % 2 == 0;
        if release_first {
            held.release().await.unwrap();
            tokio::time::sleep(Duration::from_micros(300 * offset)).await;
            let _ = tx.send(());
        } else {
            let _ = tx.send(());
            tokio::time::sleep(Duration::from_micros(300 * offset)).await;
            held.release().await.unwrap();
        }
        match waiter.await.unwrap() {
            Some(Ok(g)) => {
                won += 1;
                let now = holders(&mut raw, &key).await;
                assert_eq!(now.len(), 1, "round {round}: {now:?}");
                assert!(!next.is_finished(), "round {round}: two holders");
                g.release().await.unwrap();
            }
            Some(Err(e)) => panic!("round {round}: {e}"),
            None => cancelled += 1,
        }
        let g = tokio::time::timeout(Duration::from_secs(8), next)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "round {round}: lock lost (next not granted in 8 s): {:?}",
                    0
                )
            })
            .unwrap()
            .unwrap();
        let now = holders(&mut raw, &key).await;
        assert_eq!(
            now,
            vec![(g.owner().to_string(), g.token().unwrap().get() as i64, 1)],
            "round {round}"
        );
        g.release().await.unwrap();
    }
    eprintln!("granted {won}, cancelled {cancelled}");
}
