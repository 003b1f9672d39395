//! Tests of the line on tokio.

use super::*;
use crate::backend::{Grant, LeaseRef};
use crate::key::Owner;
use crate::memory::MemoryBackend;
use crate::mode::Mode;
use std::sync::atomic::Ordering;
use std::time::Duration;

fn req(n: u32) -> Request {
    Request::new(
        Key::new("k").unwrap(),
        Owner::new(format!("o{n}")).unwrap(),
        Mode::Exclusive,
        Duration::from_secs(5),
    )
}

#[tokio::test]
async fn waiters_take_turns_in_arrival_order_and_lines_are_forgotten() {
    let q = Arc::new(Lines::default());
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let key = Key::new("k").unwrap();
    let first = q.join(&key, &req(0), &backend, None).await;
    assert!(first.is_head());
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 1..=5 {
        let (q, key, order, backend) = (q.clone(), key.clone(), order.clone(), backend.clone());
        tasks.push(tokio::spawn(async move {
            let t = q.join(&key, &req(i), &backend, None).await;
            assert!(t.is_head());
            assert!(!t.offer().done());
            order.lock().unwrap().push(i);
        }));
        tokio::task::yield_now().await; // let it join the line before the next
    }
    let late = q
        .join(
            &key,
            &req(9),
            &backend,
            Some(Instant::now() + Duration::from_millis(20)),
        )
        .await;
    assert!(
        !late.is_head(),
        "a waiter got a turn while the head held it"
    );
    drop(late);
    assert!(!first.offer().done());
    drop(first);
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![1, 2, 3, 4, 5]);
    assert!(q.census().is_empty(), "an idle line was kept");
}

#[tokio::test]
async fn a_handoff_reaches_the_first_waiter_even_before_it_is_head() {
    let q = Lines::default();
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let key = Key::new("k").unwrap();
    let head = q.join(&key, &req(0), &backend, None).await;
    // A second waiter queues behind the head; the head leaves the line.
    let second_req = req(1);
    let second = q.join(&key, &second_req, &backend, None);
    tokio::pin!(second);
    assert!(
        futures::poll!(&mut second).is_pending(),
        "the second waiter got in beside the head"
    );
    assert!(!head.offer().done());
    drop(head);
    let offer = q.take_offer(&key).expect("the first waiter's offer");
    assert_eq!(offer.request().owner.as_str(), "o1");
    let grant = Grant::new(None, Duration::from_secs(5), 1, Instant::now());
    assert!(offer.complete(Some(grant)));
    let turn = second.await;
    assert_eq!(turn.offer().take_delivered().map(|g| g.holds), Some(1));
}

/// A memory backend whose `try_acquire` can be held at the door: it says
/// when a call arrived and lets it through when told (to order a head's
/// re-check after a handoff, as a slow link would).
struct Gated {
    inner: MemoryBackend,
    armed: std::sync::atomic::AtomicBool,
    arrived: Notify,
    go: Notify,
    /// While set, `release_to` waits for `go` before it reaches the backend.
    stall_handoffs: std::sync::atomic::AtomicBool,
}

#[crate::backend::async_trait]
impl Backend for Gated {
    fn name(&self) -> &'static str {
        "gated"
    }
    fn capabilities(&self) -> crate::Capabilities {
        self.inner.capabilities()
    }
    async fn try_acquire(&self, req: &Request) -> crate::Result<Option<Grant>> {
        if self.armed.swap(false, Ordering::SeqCst) {
            let go = self.go.notified();
            self.arrived.notify_one();
            go.await;
        }
        self.inner.try_acquire(req).await
    }
    async fn renew(&self, l: &[LeaseRef]) -> crate::Result<Vec<crate::backend::Renewal>> {
        self.inner.renew(l).await
    }
    async fn release(&self, l: &LeaseRef) -> crate::Result<crate::backend::Released> {
        self.inner.release(l).await
    }
    async fn release_to(
        &self,
        l: &LeaseRef,
        next: &Request,
    ) -> crate::Result<(crate::backend::Released, Option<Grant>)> {
        if self.stall_handoffs.load(Ordering::SeqCst) {
            self.go.notified().await;
        }
        self.inner.release_to(l, next).await
    }
}

fn idle(locker: &crate::Locker) -> bool {
    locker.shared.lines.census().is_empty()
}

#[tokio::test]
async fn a_handoff_that_lands_during_the_heads_recheck_is_counted_once() {
    let gated = Arc::new(Gated {
        inner: MemoryBackend::new(),
        armed: false.into(),
        arrived: Notify::new(),
        go: Notify::new(),
        stall_handoffs: false.into(),
    });
    let locker = crate::Locker::from_arc(gated.clone());
    let first = locker.lock("k").acquire().await.unwrap();
    // The head waits behind a local holder and re-checks the backend
    // after a second; that re-check is held at the door.
    gated.armed.store(true, Ordering::SeqCst);
    let head = tokio::spawn({
        let locker = locker.clone();
        async move { locker.lock("k").acquire().await }
    });
    gated.arrived.notified().await;
    // The holder releases meanwhile: the lock is handed to the head.
    first.release().await.unwrap();
    // Then the re-check reaches the backend and finds the handed hold.
    gated.go.notify_one();
    let second = head.await.unwrap().unwrap();
    second.release().await.unwrap();
    assert!(idle(&locker), "the line still counts a local holder");
}

#[tokio::test]
async fn a_waiter_dropped_after_a_handoff_reached_it_leaves_no_holder_behind() {
    let locker = crate::Locker::new(MemoryBackend::new());
    let first = locker.lock("k").acquire().await.unwrap();
    let mut waiter = Box::pin(locker.lock("k").acquire());
    assert!(
        futures::poll!(&mut waiter).is_pending(),
        "granted beside a holder"
    );
    // Handed to the waiter, which is dropped before it looks.
    first.release().await.unwrap();
    drop(waiter);
    tokio::task::yield_now().await;
    assert!(idle(&locker), "the line still counts a local holder");
    let g = locker.lock("k").try_acquire().await.unwrap();
    assert!(g.is_some(), "the handed hold was not given back");
}

#[tokio::test]
async fn a_guard_outside_the_line_hands_nothing_into_it() {
    // A guard from try_acquire holds without a local hold: were it to
    // hand off, the waiter would carry on a hold nobody counted, and
    // its release would count below zero.
    let locker = crate::Locker::new(MemoryBackend::new());
    let first = locker.lock("k").try_acquire().await.unwrap().unwrap();
    let mut waiter = Box::pin(locker.lock("k").acquire());
    assert!(futures::poll!(&mut waiter).is_pending());
    first.release().await.unwrap();
    let second = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("the waiter got the lock")
        .unwrap();
    second.release().await.unwrap();
    assert!(idle(&locker), "the line still counts a local holder");
    let again = tokio::time::timeout(
        Duration::from_secs(30),
        locker.lock("k").wait(Duration::from_secs(30)).acquire(),
    )
    .await
    .expect("a free key is granted at once")
    .unwrap();
    again.release().await.unwrap();
}

#[tokio::test]
async fn a_release_dropped_during_its_handoff_still_hands_the_lock_over() {
    let gated = Arc::new(Gated {
        inner: MemoryBackend::new(),
        armed: false.into(),
        arrived: Notify::new(),
        go: Notify::new(),
        stall_handoffs: true.into(),
    });
    let locker = crate::Locker::from_arc(gated.clone());
    let first = locker.lock("k").acquire().await.unwrap();
    let mut waiter = Box::pin(locker.lock("k").acquire());
    assert!(futures::poll!(&mut waiter).is_pending());
    // The release takes the waiter's offer and stalls on its way to the
    // backend; its caller gives up. The handoff goes on in the background.
    let mut releasing = Box::pin(first.release());
    assert!(futures::poll!(&mut releasing).is_pending());
    drop(releasing);
    gated.go.notify_one();
    let handed = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("the waiter was handed the lock")
        .unwrap();
    handed.release().await.unwrap();
    assert!(idle(&locker), "the line still counts a local holder");
    assert!(locker.lock("k").try_acquire().await.unwrap().is_some());
}
