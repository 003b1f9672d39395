//! Multi-locks whose earlier keys are lost while a later key is awaited.

use std::time::Duration;

use fencelock_core::{Key, Locker, MemoryBackend};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_lock_never_returns_a_lease_lost_while_it_waited() {
    let backend = MemoryBackend::new();
    let (a, b) = (Locker::new(backend.clone()), Locker::new(backend.clone()));
    let held = b.lock("multi/b").acquire().await.unwrap();
    let ttl = Duration::from_secs(1);
    let multi = tokio::spawn({
        let a = a.clone();
        async move {
            a.multi_lock(["multi/a", "multi/b"])
                .ttl(ttl)
                .wait(Duration::from_secs(30))
                .acquire()
                .await
        }
    });
    // The multi-lock holds "a" and waits for "b"; meanwhile "a" is taken from it.
    let start = tokio::time::Instant::now();
    while b
        .inspect("multi/a")
        .await
        .unwrap()
        .is_none_or(|i| i.holders.is_empty())
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "never took multi/a"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    backend.force_release(&Key::new("multi/a").unwrap());
    // Long enough for its renewal (every ttl/3) to find the hold gone.
    tokio::time::sleep(ttl * 2).await;
    held.release().await.unwrap();
    let both = multi.await.unwrap().expect("the multi-lock failed");
    for g in both.guards() {
        assert!(
            g.is_valid(),
            "returned with {} lost: {:?}",
            g.key(),
            g.lease().lost_reason()
        );
    }
    assert!(
        b.lock("multi/a").try_acquire().await.unwrap().is_none(),
        "multi/a is not held although the multi-lock says so"
    );
    both.release().await.unwrap();
}
