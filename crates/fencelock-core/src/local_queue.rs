//! Local FIFO lines: the waiters of one [`Locker`](crate::Locker) for one key
//! line up here, and only the head of the line waits at the backend.
//!
//! This removes the herd inside a process (one backend request per key and
//! locker instead of one per waiting task), and stops a releasing task from
//! barging back in ahead of the tasks that were already waiting next to it.
//!
//! Every waiter also stands in the line with an [`Offer`] to take a **handoff**:
//! a guard of the same locker that releases the key passes the lock straight to
//! the first waiter with [`Backend::release_to`](crate::Backend::release_to) —
//! one round trip where a release and a new acquire would take two, with no
//! window in which anybody else could take the lock. To keep waiters of other
//! processes from starving, at most [`MAX_HANDOFFS`] handoffs happen in a row;
//! then the lock is released plainly and every waiter races for it. (With the
//! Redis scripts, the handoff racing the head's own request is model-checked in
//! `crates/fencelock-models/src/redis_line.rs`, `docs/SAFETY.md`; this line
//! itself, with the head logic of `locker.rs` and the handoff of `guard.rs`,
//! runs under shuttle's schedulers in `src/shuttle_tests.rs`, `docs/SAFETY.md`
//! §3: a change here should keep those runs green.)
//!
//! While a guard of this locker holds the key through the line (a
//! [`LineHold`]), the head does not wait at the backend: the lock is busy, and
//! it will be handed over or released here, which wakes the head. It only
//! re-checks with one `try_acquire` a second, in case that guard's lease was
//! lost without the guard being dropped.
//!
//! Lines are used for exclusive requests with the default (per-guard) owner
//! only: an explicit owner may be reentrant, and queueing it behind a waiter
//! that waits for that same owner would deadlock; shared and semaphore holders
//! may hold together and must not wait for each other. Only a guard that holds
//! through the line hands off (the waiter carries its local hold on); a guard
//! from `try_acquire` or with its own owner releases plainly.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::backend::{Backend, Grant, LeaseRef, Request};
use crate::key::Key;
use crate::sync::{AtomicUsize, Mutex, lock, runtime_present, sleep_until, spawn};
#[cfg(shuttle)]
use crate::sync::{Mutation, mutated};

/// Handoffs in a row before a release lets every waiter race again.
pub(crate) const MAX_HANDOFFS: u32 = 16;

#[derive(Default)]
pub(crate) struct LocalQueues {
    lines: Mutex<HashMap<Key, Arc<Line>>>,
}

struct Line {
    /// One permit: the head of the line holds it.
    turn: Arc<Semaphore>,
    /// The waiters' offers, in arrival order (the order of the permit).
    waiters: Mutex<VecDeque<Arc<Offer>>>,
    handoffs_in_a_row: Mutex<u32>,
    /// Guards of this locker that hold the key through this line.
    holders: AtomicUsize,
    /// Fired when one of those guards is gone (released, dropped, leaked).
    holder_gone: Notify,
}

/// Where an offered handoff stands.
enum Stage {
    /// Waiting; a releaser may take the offer.
    Open,
    /// A releaser is running `release_to` for this waiter.
    InFlight,
    /// The handoff succeeded; the waiter has not picked the grant up yet.
    Delivered(Grant),
    /// The waiter has its grant (handed, or got by itself: the same hold).
    Done,
    /// The waiter gave up; a handoff still in flight is undone by its releaser.
    Abandoned,
}

/// A waiter's standing offer to receive the lock from a local releaser.
pub(crate) struct Offer {
    req: Request,
    backend: Arc<dyn Backend>,
    stage: Mutex<Stage>,
    delivered: Notify,
}

/// A waiter's place in a key's line. It is the head once it holds the permit.
/// Dropping it leaves the line (a delivered grant nobody took is given back).
pub(crate) struct Turn<'a> {
    queues: &'a LocalQueues,
    key: Key,
    line: Arc<Line>,
    offer: Arc<Offer>,
    permit: Option<OwnedSemaphorePermit>,
}

/// Marks a guard as a local holder of its line's key while it lives.
pub(crate) struct LineHold {
    queues: Arc<LocalQueues>,
    key: Key,
    line: Arc<Line>,
    /// Handed to the next waiter, who carries the hold on: nothing to count down.
    handed_on: bool,
}

impl LocalQueues {
    /// Joins `key`'s line with `req` and waits until this waiter is the head,
    /// a releaser handed it the lock, or `deadline` passed (then the turn is
    /// neither head nor handed, and the caller gives up).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a cancelled waiter leaves the line, and a grant handed to it
    /// in the meantime is given back.
    pub(crate) async fn join(
        &self,
        key: &Key,
        req: &Request,
        backend: &Arc<dyn Backend>,
        deadline: Option<Instant>,
    ) -> Turn<'_> {
        let line = lock(&self.lines)
            .entry(key.clone())
            .or_insert_with(|| {
                Arc::new(Line {
                    turn: Arc::new(Semaphore::new(1)),
                    waiters: Mutex::new(VecDeque::new()),
                    handoffs_in_a_row: Mutex::new(0),
                    holders: AtomicUsize::new(0),
                    holder_gone: Notify::new(),
                })
            })
            .clone();
        let offer = Arc::new(Offer {
            req: req.clone(),
            backend: backend.clone(),
            stage: Mutex::new(Stage::Open),
            delivered: Notify::new(),
        });
        lock(&line.waiters).push_back(offer.clone());
        // The line moves into the turn: no other reference of this call may
        // outlive a cancellation, or the turn's drop could not forget it.
        let mut turn = Turn {
            queues: self,
            key: key.clone(),
            line,
            offer,
            permit: None,
        };
        let acquire = turn.line.turn.clone().acquire_owned();
        let until = async {
            match deadline {
                Some(d) => sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            p = acquire => turn.permit = p.ok(),
            _ = turn.offer.wait_delivery() => {}
            _ = until => {}
        }
        turn
    }

    /// Takes the offer of the first waiter of `key` for a handoff, unless the
    /// line has handed off [`MAX_HANDOFFS`] times in a row (then the streak
    /// resets and the caller releases plainly).
    pub(crate) fn take_offer(&self, key: &Key) -> Option<Arc<Offer>> {
        let line = lock(&self.lines).get(key)?.clone();
        let mut in_a_row = lock(&line.handoffs_in_a_row);
        if *in_a_row >= MAX_HANDOFFS {
            *in_a_row = 0;
            return None;
        }
        let offer = lock(&line.waiters).front()?.clone();
        let mut stage = lock(&offer.stage);
        if !matches!(*stage, Stage::Open) {
            return None;
        }
        *stage = Stage::InFlight;
        drop(stage);
        *in_a_row += 1;
        Some(offer)
    }

    /// Notes a plain release of `key` (the handoff streak ends).
    pub(crate) fn released_plainly(&self, key: &Key) {
        if let Some(line) = lock(&self.lines).get(key) {
            *lock(&line.handoffs_in_a_row) = 0;
        }
    }

    /// Every line kept: its key, how many wait in it and how many local
    /// guards hold through it (for tests: both return to zero and the line
    /// is forgotten when everyone is gone).
    #[cfg(all(test, shuttle))]
    pub(crate) fn census(&self) -> Vec<(Key, usize, usize)> {
        lock(&self.lines)
            .iter()
            .map(|(k, l)| {
                (
                    k.clone(),
                    lock(&l.waiters).len(),
                    l.holders.load(Ordering::SeqCst),
                )
            })
            .collect()
    }

    /// Forgets `line` if nobody waits or holds (only the map and `refs` other
    /// references remain).
    fn forget_if_idle(&self, key: &Key, line: &Arc<Line>, refs: usize) {
        let mut lines = lock(&self.lines);
        if Arc::strong_count(line) == refs + 1
            && line.holders.load(Ordering::SeqCst) == 0
            && lines.get(key).is_some_and(|l| Arc::ptr_eq(l, line))
        {
            lines.remove(key);
        }
    }
}

impl Turn<'_> {
    /// Whether this waiter holds the permit (the head waits at the backend).
    pub(crate) fn is_head(&self) -> bool {
        self.permit.is_some()
    }

    /// This waiter's offer.
    pub(crate) fn offer(&self) -> &Offer {
        &self.offer
    }

    /// How many guards of this locker hold the key through this line.
    pub(crate) fn local_holders(&self) -> usize {
        self.line.holders.load(Ordering::SeqCst)
    }

    /// Resolves when a local holder is gone. Enable it before checking
    /// [`Turn::local_holders`], so that a departure in between is not missed.
    pub(crate) fn holder_gone(&self) -> tokio::sync::futures::Notified<'_> {
        self.line.holder_gone.notified()
    }

    /// Registers the granted guard as a local holder; `handed` when the grant
    /// came from a local releaser, whose hold this one carries on (the count of
    /// local holders does not change, so no waiter wakes for nothing).
    pub(crate) fn hold(&self, queues: &Arc<LocalQueues>, handed: bool) -> LineHold {
        if !handed {
            self.line.holders.fetch_add(1, Ordering::SeqCst);
        }
        LineHold {
            queues: queues.clone(),
            key: self.key.clone(),
            line: self.line.clone(),
            handed_on: false,
        }
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        lock(&self.line.waiters).retain(|o| !Arc::ptr_eq(o, &self.offer));
        // Not finished normally (cancelled): give back what was handed meanwhile.
        // Its releaser carried the local hold on to this waiter; it ends here.
        #[cfg(shuttle)]
        let keep_count = mutated(Mutation::DroppedWaiterKeepsCount);
        #[cfg(not(shuttle))]
        let keep_count = false;
        if self.offer.abandon_on_drop() && !keep_count {
            self.line.holders.fetch_sub(1, Ordering::SeqCst);
            self.line.holder_gone.notify_waiters();
        }
        self.permit.take();
        // Forgotten unless others wait or hold (the map and this turn refer to it).
        self.queues.forget_if_idle(&self.key, &self.line, 1);
    }
}

impl LineHold {
    /// The lock went to the next waiter of the line, who carries the hold on.
    pub(crate) fn hand_on(mut self) {
        self.handed_on = true;
    }
}

impl Drop for LineHold {
    fn drop(&mut self) {
        if !self.handed_on {
            self.line.holders.fetch_sub(1, Ordering::SeqCst);
            self.line.holder_gone.notify_waiters();
        }
        self.queues.forget_if_idle(&self.key, &self.line, 1);
    }
}

impl Offer {
    /// The request the waiter waits with.
    pub(crate) fn request(&self) -> &Request {
        &self.req
    }

    /// Waits until a grant is delivered (without taking it).
    async fn wait_delivery(&self) {
        loop {
            let notified = self.delivered.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if matches!(*lock(&self.stage), Stage::Delivered(_)) {
                return;
            }
            notified.await;
        }
    }

    /// Takes a delivered grant, if there is one.
    pub(crate) fn take_delivered(&self) -> Option<Grant> {
        let mut stage = lock(&self.stage);
        match std::mem::replace(&mut *stage, Stage::Done) {
            Stage::Delivered(g) => Some(g),
            other => {
                *stage = other;
                None
            }
        }
    }

    /// Resolves with the grant once a releaser handed the lock over, and takes it.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe; an untaken grant stays in the offer.
    pub(crate) async fn delivered(&self) -> Grant {
        loop {
            self.wait_delivery().await;
            if let Some(g) = self.take_delivered() {
                return g;
            }
        }
    }

    /// The releaser's side, after `release_to`: delivers `grant`, or re-opens the
    /// offer if there was none. If the waiter gave up meanwhile, the handed hold
    /// is released on its behalf. Returns whether the waiter carries the
    /// releaser's local hold on.
    pub(crate) fn complete(&self, grant: Option<Grant>) -> bool {
        let mut stage = lock(&self.stage);
        match (&*stage, grant) {
            (Stage::InFlight, Some(g)) => {
                *stage = Stage::Delivered(g);
                drop(stage);
                self.delivered.notify_waiters();
                true
            }
            (Stage::InFlight, None) => {
                *stage = Stage::Open;
                false
            }
            (Stage::Abandoned, Some(g)) => {
                drop(stage);
                self.give_back(g);
                false
            }
            // The waiter got the same hold by itself, or nothing was handed.
            _ => false,
        }
    }

    /// The waiter's side when its own attempt succeeded: a handoff in flight or
    /// delivered is for the very same hold, so it needs no undoing. Returns
    /// whether a handoff was delivered all the same (then its releaser carried
    /// the local hold on to this waiter).
    pub(crate) fn done(&self) -> bool {
        let mut stage = lock(&self.stage);
        match std::mem::replace(&mut *stage, Stage::Done) {
            #[cfg(shuttle)]
            Stage::Delivered(_) if mutated(Mutation::CountHandoffTwice) => false,
            #[cfg(shuttle)]
            Stage::Delivered(g) if mutated(Mutation::GiveBackOwnHold) => {
                drop(stage);
                self.give_back(g);
                true
            }
            Stage::Delivered(_) => true,
            Stage::Abandoned => {
                *stage = Stage::Abandoned;
                false
            }
            _ => false,
        }
    }

    /// The waiter's side when it gives up (deadline, error): returns a grant
    /// that was delivered after all, else makes sure a handoff still in flight
    /// is undone by its releaser.
    pub(crate) fn abandon(&self) -> Option<Grant> {
        let mut stage = lock(&self.stage);
        match std::mem::replace(&mut *stage, Stage::Abandoned) {
            Stage::Delivered(g) => {
                *stage = Stage::Done;
                Some(g)
            }
            Stage::Done => {
                *stage = Stage::Done;
                None
            }
            _ => None,
        }
    }

    /// [`Offer::abandon`] for a waiter that is dropped: a delivered grant is
    /// given back. Returns whether there was one.
    fn abandon_on_drop(&self) -> bool {
        match self.abandon() {
            #[cfg(shuttle)]
            Some(_) if mutated(Mutation::DroppedWaiterKeepsGrant) => true,
            Some(g) => {
                self.give_back(g);
                true
            }
            None => false,
        }
    }

    /// Releases a handed hold that nobody will use, best effort.
    fn give_back(&self, grant: Grant) {
        let lease = LeaseRef::new(&self.req, &grant);
        let backend = self.backend.clone();
        if runtime_present() {
            spawn(async move {
                let _ = backend.release(&lease).await;
            });
        }
    }
}

#[cfg(all(test, not(shuttle)))]
mod tests {
    use super::*;
    use crate::key::Owner;
    use crate::memory::MemoryBackend;
    use crate::mode::Mode;
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
        let q = Arc::new(LocalQueues::default());
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
        assert!(q.lines.lock().unwrap().is_empty(), "an idle line was kept");
    }

    #[tokio::test]
    async fn a_handoff_reaches_the_first_waiter_even_before_it_is_head() {
        let q = LocalQueues::default();
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

    #[crate::async_trait]
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
        async fn renew(&self, l: &[LeaseRef]) -> crate::Result<Vec<crate::Renewal>> {
            self.inner.renew(l).await
        }
        async fn release(&self, l: &LeaseRef) -> crate::Result<crate::Released> {
            self.inner.release(l).await
        }
        async fn release_to(
            &self,
            l: &LeaseRef,
            next: &Request,
        ) -> crate::Result<(crate::Released, Option<Grant>)> {
            if self.stall_handoffs.load(Ordering::SeqCst) {
                self.go.notified().await;
            }
            self.inner.release_to(l, next).await
        }
    }

    fn idle(locker: &crate::Locker) -> bool {
        locker.shared.queues.lines.lock().unwrap().is_empty()
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
}
