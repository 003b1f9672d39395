//! Lease mode across processes: a release hands the lock to the first waiter
//! of another process where it stands (`fencelock_waiters`), and tells it on
//! its own channel; a grant handed to a waiter that died lapses with its TTL
//! and the next is granted; a waiter that gives up as it is handed the lock
//! passes it on — never two holders, never a lock left to lapse.
//!
//! Each `PostgresBackend` here stands for a process of its own: its own pool,
//! its own LISTEN connection and grant channel.

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

/// The live holders of `key`: owner and token.
async fn holders(raw: &mut PgConnection, key: &str) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT owner, fence FROM fencelock_locks
         WHERE key = $1 AND owner <> '' AND expires_at > now() ORDER BY fence",
    )
    .bind(key)
    .fetch_all(raw)
    .await
    .unwrap()
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
    let now = holders(&mut raw, &key).await;
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
    assert!(holders(&mut raw, &key).await.is_empty());
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
    let now = holders(&mut raw, &key).await;
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
        holders(&mut raw, &key).await,
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
    let now = holders(&mut raw, &key).await;
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
    assert!(holders(&mut raw, &key).await.is_empty());
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
                let now = holders(&mut raw, &key).await;
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
        let now = holders(&mut raw, &key).await;
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
