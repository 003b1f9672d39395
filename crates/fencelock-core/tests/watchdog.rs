//! Watchdog behaviour that the conformance suite does not cover: batching and
//! dropping guards outside a runtime.

use std::sync::Arc;
use std::time::Duration;

use fencelock_core::{Locker, MemoryBackend};
use fencelock_testkit::FlakyBackend;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_of_many_guards_are_batched() {
    let flaky = Arc::new(FlakyBackend::new(Arc::new(MemoryBackend::new())));
    let locker = Locker::from_arc(flaky.clone());
    let ttl = Duration::from_millis(300);
    let mut guards = Vec::new();
    for i in 0..40 {
        guards.push(
            locker
                .lock(format!("batch/{i}"))
                .ttl(ttl)
                .acquire()
                .await
                .unwrap(),
        );
    }
    let before = flaky.renew_calls();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let calls = flaky.renew_calls() - before;
    // At ttl/3 = 100 ms, 1.2 s is about 12 ticks. One call per guard per tick
    // would be about 480; batching makes it one call per tick.
    assert!(
        calls >= 4,
        "only {calls} renew calls in 4 TTLs: the watchdog is not renewing"
    );
    assert!(
        calls <= 40,
        "{calls} renew calls for 40 guards over ~12 ticks: not batched"
    );
    assert!(guards.iter().all(|g| g.is_valid()));
    for g in guards {
        g.release().await.unwrap();
    }
}

#[test]
fn dropping_a_guard_after_its_runtime_is_gone_does_not_panic() {
    let backend = MemoryBackend::new();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (locker, guard) = rt.block_on(async {
        let locker = Locker::new(backend.clone());
        let guard = locker.lock("outlives-runtime").acquire().await.unwrap();
        (locker, guard)
    });
    drop(rt);
    drop(guard); // no runtime: the release is queued to a watchdog that is gone
    drop(locker);
}

#[tokio::test]
async fn dropped_guard_wakes_a_waiter_in_the_same_locker() {
    let locker = Locker::new(MemoryBackend::new());
    let g = locker
        .lock("k")
        .ttl(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    let l2 = locker.clone();
    let waiter =
        tokio::spawn(async move { l2.lock("k").wait(Duration::from_secs(10)).acquire().await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    drop(g);
    let g2 = waiter.await.unwrap().unwrap();
    assert!(g2.token().unwrap().get() >= 2);
}
