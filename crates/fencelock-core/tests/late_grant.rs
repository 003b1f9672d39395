//! A grant whose reply comes late (a slow network, a slow transaction) is
//! renewed before it is handed out, and a cancellation meanwhile gives it back.

use std::sync::Arc;
use std::time::Duration;

use fencelock_core::{Locker, MemoryBackend};
use fencelock_testkit::FlakyBackend;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_grant_arrives_with_most_of_its_ttl() {
    let ttl = Duration::from_secs(4);
    let slow = Arc::new(FlakyBackend::new(Arc::new(MemoryBackend::new())));
    slow.slow_grants(Duration::from_millis(2500));
    let locker = Locker::from_arc(slow.clone());
    let g = locker.lock("k").ttl(ttl).acquire().await.unwrap();
    let left = g.lease().time_left();
    // Counted from the request, 1.5 s would be left at most.
    assert!(
        left > Duration::from_millis(2500),
        "the grant arrived with {left:?} of {ttl:?}"
    );
    g.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_cancelled_while_its_late_grant_is_renewed_gives_it_back() {
    let ttl = Duration::from_secs(10);
    let memory = Arc::new(MemoryBackend::new());
    let slow = Arc::new(FlakyBackend::new(memory.clone()));
    slow.slow_grants(Duration::from_secs(6));
    slow.slow_renewals(Duration::from_secs(30));
    let a = Locker::from_arc(slow.clone());
    let cancelled =
        tokio::time::timeout(Duration::from_secs(7), a.lock("k").ttl(ttl).acquire()).await;
    assert!(
        cancelled.is_err(),
        "the acquire finished before its cancellation"
    );
    // Without the release, the hold would last until 10 s after the request.
    let b = Locker::from_arc(memory);
    let got = b
        .lock("k")
        .ttl(ttl)
        .wait(Duration::from_secs(2))
        .acquire()
        .await;
    assert!(
        got.is_ok(),
        "the cancelled acquire's hold was not given back: {:?}",
        got.err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_grant_whose_renewal_hangs_ends_with_the_wait() {
    let ttl = Duration::from_secs(10);
    let memory = Arc::new(MemoryBackend::new());
    let slow = Arc::new(FlakyBackend::new(memory.clone()));
    slow.slow_grants(Duration::from_secs(6));
    slow.slow_renewals(Duration::from_secs(60));
    let a = Locker::from_arc(slow.clone());
    let start = std::time::Instant::now();
    let got = a
        .lock("k")
        .ttl(ttl)
        .wait(Duration::from_secs(8))
        .acquire()
        .await;
    let waited = start.elapsed();
    assert!(
        matches!(got, Err(fencelock_core::Error::Timeout { .. })),
        "{got:?}"
    );
    assert!(
        waited < Duration::from_secs(20),
        "the wait of 8 s took {waited:?}"
    );
    // And the hold was given back.
    let b = Locker::from_arc(memory);
    let got = b
        .lock("k")
        .ttl(ttl)
        .wait(Duration::from_secs(2))
        .acquire()
        .await;
    assert!(got.is_ok(), "the hold was not given back: {:?}", got.err());
}
