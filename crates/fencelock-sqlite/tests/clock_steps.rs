//! Steps of the wall clock neither free a live hold nor keep a dead one: the
//! SQLite file keeps expiry on the machine's boot-time clock. A binary of its
//! own: the wall-clock hook shifts the whole process.

use std::time::Duration;

use fencelock_core::Locker;
use fencelock_core::clock::shift_wall_clock_for_tests;
use fencelock_sqlite::SqliteBackend;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_of_the_wall_clock_neither_free_a_live_hold_nor_keep_a_dead_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locks.db");
    let a = Locker::new(SqliteBackend::open(&path).await.unwrap());
    let b = Locker::new(SqliteBackend::open(&path).await.unwrap());
    // Forward: an hour ahead, A's live hold must not look expired to B.
    let ga = a
        .lock("fwd")
        .ttl(Duration::from_secs(6))
        .acquire()
        .await
        .unwrap();
    shift_wall_clock_for_tests(3_600_000);
    let stolen = b.lock("fwd").try_acquire().await;
    shift_wall_clock_for_tests(0);
    assert!(
        matches!(stolen, Ok(None)),
        "with the clock an hour ahead B took A's live lock: {:?}",
        stolen.map(|g| g.is_some())
    );
    ga.release().await.unwrap();
    // Backward: a hold that nobody renews (a fixed lease, leaked) expires
    // after its TTL even with the clock an hour behind.
    let leaked = a
        .lock("back")
        .lease(Duration::from_secs(1))
        .acquire()
        .await
        .unwrap();
    let _ = leaked.leak();
    shift_wall_clock_for_tests(-3_600_000);
    let got = b.lock("back").wait(Duration::from_secs(10)).acquire().await;
    shift_wall_clock_for_tests(0);
    let g = got.expect("with the clock an hour behind, a dead 1 s hold blocked the key");
    g.release().await.unwrap();
}
