//! Lease mode across processes: a release hands the lock to the first waiter
//! of another process where it stands (`fencelock_waiters`), and tells it on
//! its own channel; a grant handed to a waiter that died lapses with its TTL
//! and the next is granted; a waiter that gives up as it is handed the lock
//! passes it on — never two holders, never a lock left to lapse.
//!
//! Each `PostgresBackend` here stands for a process of its own: its own pool,
//! its own LISTEN connection and grant channel.
//!
//! The second half is a hostile review's: each test states the claim it
//! attacks and fails if the claim breaks. The first five failed on the
//! queue's first version (two valid holders through a leave that deleted a
//! joined hold; a stale place handed the lock after a reentrant grant; a
//! cancelled wait on a new key handed the lock after it left; a dead waiter
//! without a channel kept the lock from everyone until its place lapsed; a
//! shared try barged ahead of the queue).

mod support;

use std::time::Duration;

use fencelock_core::{Error, Locker};
use fencelock_postgres::PostgresBackend;
use sqlx::{Connection, PgConnection};
use support::SHARED;
use tokio::time::Instant;

fn unique(name: &str) -> String {
    format!("xproc-{name}-{}-{}", std::process::id(), nanos())
}

fn nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64 % 1_000_000_007)
        .unwrap_or(0)
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

/// The live holders of `key`: owner, token and holds.
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

/// The live holders of `key`: owner and token.
async fn holding(raw: &mut PgConnection, key: &str) -> Vec<(String, i64)> {
    holders(raw, key)
        .await
        .into_iter()
        .map(|(owner, token, _)| (owner, token))
        .collect()
}

/// Waits until `n` waiters stand in `key`'s queue asking to be handed the
/// lock there.
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
            "{n} waiters did not stand in the queue of {key} with their channel ({count} did)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A waiter of a process that is not a fencelock client here: it stands in
/// the queue of `key` through the acquire function itself, asking for the
/// lock (TTL `ttl_ms`) to be handed to it on `chan`; its place lasts 20 s.
async fn ghost_stands(raw: &mut PgConnection, key: &str, ttl_ms: i64, chan: &str) {
    let (ok,): (bool,) = sqlx::query_as(
        "SELECT ok FROM fencelock_acquire($1, 'ghost', 'exclusive', $2, false, 0,
                                          'ghostwait', $3, 1, 20000, false)",
    )
    .bind(key)
    .bind(ttl_ms)
    .bind(chan)
    .fetch_one(raw)
    .await
    .unwrap();
    assert!(!ok, "the ghost was granted a held lock");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_hands_the_lock_to_a_waiter_of_another_process_where_it_stands() {
    let (a, b) = (locker().await, locker().await);
    let mut raw = raw().await;
    let key = unique("hand");
    let held = a
        .lock(&key)
        .ttl(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap();
    let first = held.token().unwrap().get();
    let (b2, k) = (b.clone(), key.clone());
    let waiter = tokio::spawn(async move {
        b2.lock(&k)
            .ttl(Duration::from_secs(10))
            .wait(Duration::from_secs(30))
            .acquire()
            .await
    });
    standing(&mut raw, &key, 1).await;
    held.release().await.unwrap();
    // The release itself made the waiter the holder: the row is there before
    // the waiter could have asked again.
    let now = holding(&mut raw, &key).await;
    assert_eq!(
        now.len(),
        1,
        "the release freed the lock instead of handing it to the waiter: {now:?}"
    );
    let g = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter did not start")
        .unwrap()
        .unwrap();
    assert_eq!(now[0].0, g.owner().as_str(), "handed to someone else");
    assert_eq!(now[0].1 as u64, g.token().unwrap().get());
    assert!(g.token().unwrap().get() > first);
    assert!(g.is_valid());
    assert!(
        g.lease().time_left() > Duration::from_secs(5),
        "the handed grant arrived with {:?} of its 10 s",
        g.lease().time_left()
    );
    // Nobody stands in the queue any more; the hold is the waiter's own.
    standing_none(&mut raw, &key).await;
    g.release().await.unwrap();
    assert!(holding(&mut raw, &key).await.is_empty());
}

async fn standing_none(raw: &mut PgConnection, key: &str) {
    let count: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM fencelock_waiters WHERE key = $1 AND NOT gone AND stands_until > now()",
    )
    .bind(key)
    .fetch_one(raw)
    .await
    .unwrap();
    assert_eq!(count, 0, "a granted waiter still stands in the queue");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_handed_to_a_dead_waiter_lapses_and_the_next_is_granted() {
    let (a, c) = (locker().await, locker().await);
    let mut raw = raw().await;
    let key = unique("dead");
    let held = a.lock(&key).acquire().await.unwrap();
    // A waiter that asked to be handed the lock (TTL 2 s) and died: nobody
    // listens on its channel.
    ghost_stands(&mut raw, &key, 2000, "fencelock_g_nobody").await;
    let (c2, k) = (c.clone(), key.clone());
    let next = tokio::spawn(async move {
        let g = c2.lock(&k).wait(Duration::from_secs(30)).acquire().await;
        (g, Instant::now())
    });
    standing(&mut raw, &key, 2).await;
    held.release().await.unwrap();
    let released = Instant::now();
    let now = holding(&mut raw, &key).await;
    assert_eq!(now.len(), 1, "{now:?}");
    assert_eq!(now[0].0, "ghost", "not handed to the first waiter: {now:?}");
    let ghost_token = now[0].1 as u64;
    assert!(
        a.lock(&key).try_acquire().await.unwrap().is_none(),
        "the handed hold is not a hold"
    );
    // The dead waiter's hold lapses with its TTL; the next waiter, asking
    // again within a second, is granted then (not when the dead one's place
    // would have lapsed, 20 s).
    let (g, at) = next.await.unwrap();
    let g = g.expect("the next waiter was not granted");
    assert!(g.token().unwrap().get() > ghost_token);
    assert!(
        at - released < Duration::from_secs(12),
        "granted {:?} after the release: the dead waiter held it up",
        at - released
    );
    g.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_gives_up_as_it_is_handed_the_lock_passes_it_on() {
    let (a, c) = (locker().await, locker().await);
    let mut raw = raw().await;
    let key = unique("leave");
    let held = a.lock(&key).acquire().await.unwrap();
    // The first waiter listens on its channel; its TTL is long (30 s), so a
    // hold left to lapse would keep the next waiter out for that long.
    let mut ear = sqlx::postgres::PgListener::connect(SHARED).await.unwrap();
    ear.listen("fencelock_g_leaver").await.unwrap();
    ghost_stands(&mut raw, &key, 30_000, "fencelock_g_leaver").await;
    let (c2, k) = (c.clone(), key.clone());
    let next =
        tokio::spawn(async move { c2.lock(&k).wait(Duration::from_secs(60)).acquire().await });
    standing(&mut raw, &key, 2).await;
    held.release().await.unwrap();
    let message = tokio::time::timeout(Duration::from_secs(10), ear.recv())
        .await
        .expect("no grant on the first waiter's channel")
        .unwrap();
    let fields: Vec<&str> = message.payload().split(' ').collect();
    assert_eq!(fields[0], "ghostwait", "{}", message.payload());
    let handed: u64 = fields[2].parse().unwrap();
    assert_eq!(
        holding(&mut raw, &key).await,
        vec![("ghost".to_string(), handed as i64)]
    );
    // It timed out at that moment: it leaves, and takes back the hold it did
    // not take up.
    let took_back: bool = sqlx::query_scalar("SELECT fencelock_leave($1, 'ghostwait', 3000)")
        .bind(&key)
        .fetch_one(&mut raw)
        .await
        .unwrap();
    assert!(took_back, "leaving did not find the hold handed to it");
    let g = tokio::time::timeout(Duration::from_secs(10), next)
        .await
        .expect("the hold was not passed on: the next waiter waits for the TTL")
        .unwrap()
        .expect("the next waiter was not granted");
    assert!(g.token().unwrap().get() > handed);
    let now = holding(&mut raw, &key).await;
    assert_eq!(
        now,
        vec![(g.owner().to_string(), g.token().unwrap().get() as i64)]
    );
    // A late attempt of the wait that left grants nothing, even once free.
    g.release().await.unwrap();
    let (ok,): (bool,) = sqlx::query_as(
        "SELECT ok FROM fencelock_acquire($1, 'ghost', 'exclusive', 30000, false, 0,
                                          'ghostwait', 'fencelock_g_leaver', 2, 20000, false)",
    )
    .bind(&key)
    .fetch_one(&mut raw)
    .await
    .unwrap();
    assert!(!ok, "a late attempt of a wait that left was granted");
    assert!(holding(&mut raw, &key).await.is_empty());
}

/// Rounds in which a waiter's deadline falls around the moment the holder
/// releases (a few ms either side): either it is granted, and holds alone, or
/// it times out, and the next waiter gets the lock at once — never both,
/// never neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_timing_out_as_the_lock_is_handed_to_it_never_doubles_nor_loses_it() {
    let (a, b, c) = (locker().await, locker().await, locker().await);
    let mut raw = raw().await;
    let (mut won, mut lost) = (0, 0);
    for round in 0..12u64 {
        let key = unique(&format!("race{round}"));
        let ttl = Duration::from_secs(30);
        let held = a.lock(&key).ttl(ttl).acquire().await.unwrap();
        let wait = Duration::from_millis(1500);
        let started = Instant::now();
        let (b2, k) = (b.clone(), key.clone());
        let waiter = tokio::spawn(async move { b2.lock(&k).ttl(ttl).wait(wait).acquire().await });
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
        // Release from 24 ms before the waiter's deadline to 20 ms after it.
        let offset = Duration::from_millis(4 * round);
        tokio::time::sleep_until(started + wait - Duration::from_millis(24) + offset).await;
        held.release().await.unwrap();
        match waiter.await.unwrap() {
            Ok(g) => {
                won += 1;
                assert!(g.is_valid());
                let now = holding(&mut raw, &key).await;
                assert_eq!(
                    now,
                    vec![(g.owner().to_string(), g.token().unwrap().get() as i64)],
                    "round {round}: the waiter holds, but so does another"
                );
                assert!(!next.is_finished(), "round {round}: two holders");
                g.release().await.unwrap();
            }
            Err(Error::Timeout { .. }) => lost += 1,
            Err(e) => panic!("round {round}: {e}"),
        }
        let g = tokio::time::timeout(Duration::from_secs(10), next)
            .await
            .unwrap_or_else(|_| {
                panic!("round {round}: the lock was lost: the next waiter was not granted")
            })
            .unwrap()
            .unwrap();
        let now = holding(&mut raw, &key).await;
        assert_eq!(
            now,
            vec![(g.owner().to_string(), g.token().unwrap().get() as i64)],
            "round {round}"
        );
        g.release().await.unwrap();
    }
    eprintln!("the waiter was granted in {won} rounds, timed out in {lost}");
}

/// The hold a release hands on expires a TTL after the hand-on itself, not
/// after the release's transaction began: the waiter counts its lease from an
/// attempt it may have sent after that (here a release inside a transaction
/// begun 4 s earlier stands for a releasing session that was held up between
/// starting and locking the key).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_hold_lasts_its_ttl_from_the_hand_on_not_from_the_releases_start() {
    let (a, b) = (locker().await, locker().await);
    let mut raw = raw().await;
    let key = unique("late-release");
    let ttl = Duration::from_secs(6);
    let held = a.lock(&key).ttl(ttl).acquire().await.unwrap();
    let token = held.token().unwrap().get() as i64;
    let owner = held.owner().to_string();
    let (b2, k) = (b.clone(), key.clone());
    let waiter = tokio::spawn(async move {
        b2.lock(&k)
            .ttl(ttl)
            .wait(Duration::from_secs(30))
            .acquire()
            .await
    });
    standing(&mut raw, &key, 1).await;
    let mut tx = sqlx::Connection::begin(&mut raw).await.unwrap();
    sqlx::query("SELECT now(), pg_sleep(4)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let left: i32 = sqlx::query_scalar("SELECT fencelock_release($1, $2, $3, true)")
        .bind(&key)
        .bind(&owner)
        .bind(token)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(left, 0);
    tx.commit().await.unwrap();
    std::mem::forget(held);
    let g = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let client_left = g.lease().time_left();
    let server_left: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM expires_at - clock_timestamp())::float8 FROM fencelock_locks
         WHERE key = $1 AND owner = $2",
    )
    .bind(&key)
    .bind(g.owner().as_str())
    .fetch_one(&mut raw)
    .await
    .unwrap();
    assert!(
        Duration::from_secs_f64(server_left.max(0.0)) + Duration::from_secs(1) >= client_left,
        "the guard thinks it holds for {client_left:?}, the server expires the hold in {server_left:.3} s"
    );
    g.release().await.unwrap();
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
    let key = unique("review-same-owner");
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
    let warm = unique("review-warm");
    w.lock(&warm)
        .wait(Duration::from_secs(1))
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;

    let key = unique("review-new-key");
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
    let key = unique("review-dead-nochan");
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
    let key = unique("review-shared-barge");
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
    let key = unique("review-reent-place");
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
