//! Lease mode on MariaDB: exclusive waiters of different processes stand in a
//! line (a `GET_LOCK` turnstile per key) and a free lock goes to its head, so
//! a releaser cannot take the lock straight back; a head that stops asking
//! holds the line up only until the server ends its idle session; a waiter
//! that gives up leaves the line.
//!
//! Each `MySqlBackend` here stands for a process of its own (its own pool,
//! no in-process wake-ups shared).

mod support;

use std::time::Duration;

use fencelock_core::Locker;
use fencelock_mysql::MySqlBackend;
use support::SHARED;
use support::line::{TURN_SQL, locker, raw, unique, until_head};
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_releaser_cannot_take_the_lock_back_from_a_waiter_of_another_process() {
    let key = unique("back");
    let (a, b) = (locker().await, locker().await);
    let mut raw = raw().await;
    let held = a.lock(&key).acquire().await.unwrap();
    let first = held.token().unwrap();
    let waiter = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move { b.lock(&key).wait(Duration::from_secs(60)).acquire().await })
    };
    until_head(&mut raw, &key, true).await;
    held.release().await.unwrap();
    // At once, as a busy process would: the waiter is next, not the releaser.
    assert!(
        a.lock(&key).try_acquire().await.unwrap().is_none(),
        "the releaser took the lock back from the waiter at the head of the line"
    );
    let got = waiter.await.unwrap().unwrap();
    assert!(got.token().unwrap() > first);
    got.release().await.unwrap();
    // With nobody in line the lock is anyone's again.
    until_head(&mut raw, &key, false).await;
    let again = a.lock(&key).try_acquire().await.unwrap();
    assert!(
        again.is_some(),
        "a free lock with an empty line was refused"
    );
    again.unwrap().release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_that_stops_asking_holds_the_line_up_only_until_its_session_idles_out() {
    let key = unique("stuck");
    let a = locker().await;
    // A head whose process stopped: its session holds the turnstile and
    // sends nothing more, with the idle limit the backend gives its seats.
    let mut stuck = raw().await;
    sqlx::query("SET SESSION wait_timeout = 2")
        .execute(&mut stuck)
        .await
        .unwrap();
    let got: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT GET_LOCK({TURN_SQL}, 0)"
    )))
    .bind(&key)
    .fetch_one(&mut stuck)
    .await
    .unwrap();
    assert_eq!(got, Some(1));
    assert!(
        a.lock(&key).try_acquire().await.unwrap().is_none(),
        "a free lock was taken past the head of its line"
    );
    // The server ends the idle session within a few seconds; the acquire
    // then takes the free lock.
    let started = Instant::now();
    let guard = a
        .lock(&key)
        .wait(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(50));
    guard.release().await.unwrap();
    drop(stuck);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_gives_up_leaves_the_line() {
    let key = unique("gives-up");
    let (a, b) = (locker().await, locker().await);
    let mut raw = raw().await;
    let held = a.lock(&key).acquire().await.unwrap();
    let timed_out = b
        .lock(&key)
        .wait(Duration::from_millis(1500))
        .acquire()
        .await;
    assert!(
        matches!(timed_out, Err(fencelock_core::Error::Timeout { .. })),
        "{timed_out:?}"
    );
    until_head(&mut raw, &key, false).await;
    held.release().await.unwrap();
    let next = b.lock(&key).try_acquire().await.unwrap();
    assert!(next.is_some(), "a waiter that gave up still held the line");
    next.unwrap().release().await.unwrap();

    // Cancelled rather than timed out: the same.
    let held = a.lock(&key).acquire().await.unwrap();
    let waiter = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move { b.lock(&key).acquire().await })
    };
    until_head(&mut raw, &key, true).await;
    waiter.abort();
    let _ = waiter.await;
    until_head(&mut raw, &key, false).await;
    held.release().await.unwrap();
    let next = a.lock(&key).try_acquire().await.unwrap();
    assert!(next.is_some(), "a cancelled waiter still held the line");
    next.unwrap().release().await.unwrap();
}

/// A process stands at most `pool` waiters in line at once (each on a
/// connection of its own); the others wait in the process for a place, and
/// every one of them is served, one holder at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_waiters_of_one_process_share_its_places_in_line() {
    let key = unique("many");
    let a = Locker::new(
        MySqlBackend::connect(&format!("{SHARED}?mode=lease&pool=2"))
            .await
            .unwrap(),
    );
    let b = locker().await;
    let inside = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let mut tasks = Vec::new();
    for i in 0..12 {
        let (locker, key, inside) = (
            if i % 3 == 0 { b.clone() } else { a.clone() },
            key.clone(),
            inside.clone(),
        );
        tasks.push(tokio::spawn(async move {
            for _ in 0..3 {
                let g = locker
                    .lock(&key)
                    .wait(Duration::from_secs(120))
                    .acquire()
                    .await
                    .unwrap();
                assert_eq!(
                    inside.fetch_add(1, std::sync::atomic::Ordering::SeqCst),
                    0,
                    "two holders"
                );
                tokio::task::yield_now().await;
                inside.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                g.release().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}
