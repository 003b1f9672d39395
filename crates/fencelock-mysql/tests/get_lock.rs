//! get_lock mode specifics. It names its locks as the module docs say, so other programs'
//! `GET_LOCK` calls and fencelock exclude each other: a key of at most 64
//! characters is its own lock name (however many bytes it takes, and whatever
//! quotes it holds), a longer key is named by its SHA-256 in hex.

use fencelock_core::Locker;
use fencelock_mysql::MySqlBackend;
use sqlx::Connection;
use sqlx::mysql::MySqlConnection;

const URL: &str = "mysql://root@127.0.0.1:3306/test";

/// The lock name another program would use for `key`, computed by the server.
async fn name_of(conn: &mut MySqlConnection, key: &str) -> String {
    if key.chars().count() <= 64 {
        return key.to_string();
    }
    sqlx::query_scalar("SELECT SHA2(?, 256)")
        .bind(key)
        .fetch_one(conn)
        .await
        .unwrap()
}

async fn get_lock(conn: &mut MySqlConnection, name: &str) -> Option<i64> {
    sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
        .bind(name)
        .fetch_one(conn)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencelock_and_plain_get_lock_exclude_each_other() {
    let backend = MySqlBackend::connect(&format!("{URL}?mode=get_lock"))
        .await
        .unwrap();
    let locker = Locker::new(backend);
    let mut other = MySqlConnection::connect(URL).await.unwrap();
    let run = fastrand::u32(..);
    let keys = [
        format!("names-{run}-plain"),
        format!("names-{run}-it's \"quoted\"; -- \\ too"),
        // 64 characters, 2 bytes each: one name, not a hash.
        format!("names-{run}-{}", "я".repeat(64 - 7 - run.to_string().len())),
        format!("names-{run}-{}", "long".repeat(20)),
    ];
    for key in &keys {
        let name = name_of(&mut other, key).await;
        let g = locker.lock(key).try_acquire().await.unwrap();
        let g = g.unwrap_or_else(|| panic!("{key:?} was not free"));
        assert!(g.token().is_some(), "{key:?}: no token");
        assert_eq!(
            get_lock(&mut other, &name).await,
            Some(0),
            "{key:?}: another session took {name:?} while fencelock held it"
        );
        g.release().await.unwrap();
        assert_eq!(
            get_lock(&mut other, &name).await,
            Some(1),
            "{key:?}: {name:?} not free after the release"
        );
        assert!(
            locker.lock(key).try_acquire().await.unwrap().is_none(),
            "{key:?}: fencelock took the lock another session holds as {name:?}"
        );
        let _: Option<i64> = sqlx::query_scalar("SELECT RELEASE_LOCK(?)")
            .bind(&name)
            .fetch_one(&mut other)
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exclusive_lock_on_a_semaphores_key_waits_for_its_permits() {
    let url = format!("{URL}?mode=get_lock");
    let a = Locker::new(MySqlBackend::connect(&url).await.unwrap());
    let b = Locker::new(MySqlBackend::connect(&url).await.unwrap());
    let key = format!("modes-{}", fastrand::u32(..));
    let permit = a.semaphore(&key, 2).try_acquire().await.unwrap();
    let permit = permit.expect("a free semaphore refused a permit");
    assert!(
        b.lock(&key).try_acquire().await.unwrap().is_none(),
        "an exclusive lock beside a permit holder"
    );
    let waiter = tokio::spawn(async move {
        let g = b
            .lock(&key)
            .wait(std::time::Duration::from_secs(10))
            .acquire()
            .await;
        (b, key, g)
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "granted while a permit was held");
    permit.release().await.unwrap();
    let (b, key, g) = waiter.await.unwrap();
    let g = g.expect("not granted after the permit was released");
    assert!(g.token().is_some());
    g.release().await.unwrap();
    // The key stays marked as a semaphore's; a try still finds it free.
    let g = b.lock(&key).try_acquire().await.unwrap();
    assert!(
        g.is_some(),
        "a try refused a free key that a semaphore used"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exclusive_grant_reads_the_permits_after_taking_the_lock() {
    let locker = Locker::new(
        MySqlBackend::connect(&format!("{URL}?mode=get_lock"))
            .await
            .unwrap(),
    );
    let key = format!("order-{}", fastrand::u32(..));
    // Permit 1's lock name (see the get_lock module docs).
    let permit = format!("{key}\x1f1");
    let mut other = MySqlConnection::connect(URL).await.unwrap();
    assert_eq!(get_lock(&mut other, &key).await, Some(1));
    let (l, k) = (locker.clone(), key.clone());
    let waiter = tokio::spawn(async move {
        l.lock(&k)
            .wait(std::time::Duration::from_secs(10))
            .acquire()
            .await
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    // While the exclusive taker waits in GET_LOCK, a semaphore is announced on
    // the key and a permit taken; then the lock name comes free.
    sqlx::query(
        "INSERT INTO fencelock_semaphores (lock_key, permits) VALUES (?, 2)
         ON DUPLICATE KEY UPDATE permits = GREATEST(permits, 2)",
    )
    .bind(key.as_bytes())
    .execute(&mut other)
    .await
    .unwrap();
    assert_eq!(get_lock(&mut other, &permit).await, Some(1));
    release_lock(&mut other, &key).await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(
        !waiter.is_finished(),
        "an exclusive grant beside a permit holder (the permits were read before GET_LOCK)"
    );
    release_lock(&mut other, &permit).await;
    let g = waiter.await.unwrap();
    let g = g.expect("not granted after the permit was released");
    g.release().await.unwrap();
}

async fn release_lock(conn: &mut MySqlConnection, name: &str) {
    let released: Option<i64> = sqlx::query_scalar("SELECT RELEASE_LOCK(?)")
        .bind(name)
        .fetch_one(conn)
        .await
        .unwrap();
    assert_eq!(released, Some(1), "{name:?} was not held");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_names_are_no_other_keys() {
    // Permit 1 of key `x` was once named `x#1`: the very name of key `x#1`.
    let backend = MySqlBackend::connect(&format!("{URL}?mode=get_lock"))
        .await
        .unwrap();
    let locker = Locker::new(backend.clone());
    let key = format!("names-{}", fastrand::u32(..));
    let other_key = format!("{key}#1");
    let permits: Vec<_> = {
        let mut v = Vec::new();
        for _ in 0..2 {
            v.push(locker.semaphore(&key, 2).acquire().await.unwrap());
        }
        v
    };
    let g = locker
        .lock(&other_key)
        .try_acquire()
        .await
        .unwrap()
        .expect("key x#1 is busy because key x has permits");
    // Breaking key `x` must leave key `x#1` alone.
    backend
        .force_release(&fencelock_core::Key::new(&key).unwrap())
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(
        locker
            .lock(&other_key)
            .try_acquire()
            .await
            .unwrap()
            .is_none(),
        "force_release of {key:?} freed {other_key:?}"
    );
    assert!(g.is_valid());
    g.release().await.unwrap();
    drop(permits);
}
