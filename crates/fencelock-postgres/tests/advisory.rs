//! Advisory mode: readers and semaphore permit holders of one key exclude
//! each other (both take a shared advisory lock on the key, so this needs the
//! marks of `fencelock_advisory_take` / `_permit`), and a reader refused by
//! permits waits for them.

use std::time::Duration;

use fencelock_core::Locker;
use fencelock_postgres::PostgresBackend;

const URL: &str = "postgres://postgres:postgres@127.0.0.1:5432/test?mode=advisory";

async fn locker() -> Locker {
    Locker::new(PostgresBackend::connect(URL).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_and_permit_holders_exclude_each_other() {
    let (a, b) = (locker().await, locker().await);
    let key = format!(
        "kinds-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let r = a.read_lock(&key).acquire().await.unwrap();
    assert!(
        b.semaphore(&key, 3).try_acquire().await.unwrap().is_none(),
        "a permit beside a reader"
    );
    r.release().await.unwrap();
    let p = b.semaphore(&key, 3).try_acquire().await.unwrap();
    let p = p.expect("a permit of a free key refused");
    assert!(
        a.read_lock(&key).try_acquire().await.unwrap().is_none(),
        "a reader beside a permit holder"
    );
    let (a2, k) = (a.clone(), key.clone());
    let reader = tokio::spawn(async move {
        a2.read_lock(&k)
            .wait(Duration::from_secs(10))
            .acquire()
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !reader.is_finished(),
        "a waiting reader got in beside a permit holder"
    );
    p.release().await.unwrap();
    let r = reader
        .await
        .unwrap()
        .expect("the reader was not granted after the permit left");
    r.release().await.unwrap();
}
