//! The locks, atomics, timers and task spawning of the core, in one place.
//!
//! Normally these are std's and tokio's. Built with `--cfg shuttle` (the
//! shuttle tests of the in-process line, `src/shuttle_tests.rs`, run by
//! `scripts/test.sh`), they are [shuttle](https://docs.rs/shuttle)'s, so that its
//! schedulers can try the interleavings of every lock and await point, and
//! time is a choice of the test: sleeps either never end (a wait that
//! relies on one would hang, so a lost wake-up shows as a deadlock) or may
//! end at any scheduling point ([`sim::set_time`]); the time bounds of
//! backend calls never fire (calls answer in time). tokio's `Notify`,
//! `Semaphore`, `watch` and `mpsc` work under any executor and stay.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::time::Instant;

#[cfg(not(shuttle))]
pub(crate) use std::sync::atomic::AtomicU64;
#[cfg(not(shuttle))]
pub(crate) use std::sync::{Mutex, MutexGuard};

#[cfg(shuttle)]
pub(crate) use ::shuttle::sync::atomic::AtomicU64;
#[cfg(shuttle)]
pub(crate) use ::shuttle::sync::{Mutex, MutexGuard};

/// Locks `m`, taking the data of a poisoned lock as it is (every critical
/// section of the core leaves its data consistent before it can panic).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether the caller runs inside a runtime that [`spawn`] can use.
pub(crate) fn runtime_present() -> bool {
    #[cfg(not(shuttle))]
    return tokio::runtime::Handle::try_current().is_ok();
    #[cfg(shuttle)]
    return true;
}

/// Spawns `task` on the current runtime.
///
/// # Panics
///
/// Outside a runtime (as `tokio::spawn`).
pub(crate) fn spawn(task: impl Future<Output = ()> + Send + 'static) {
    #[cfg(not(shuttle))]
    drop(tokio::spawn(task));
    #[cfg(shuttle)]
    drop(::shuttle::future::spawn(task));
}

/// Sleeps until `deadline`.
///
/// # Cancel safety
///
/// Cancel safe.
pub(crate) async fn sleep_until(deadline: Instant) {
    #[cfg(not(shuttle))]
    tokio::time::sleep_until(deadline).await;
    #[cfg(shuttle)]
    sim::sleep(deadline).await;
}

/// Runs `task` until `deadline`: `None` if the deadline came first (then
/// `task` is dropped).
///
/// # Cancel safety
///
/// As cancel safe as `task`.
#[cfg(not(shuttle))]
pub(crate) async fn timeout_at<F: Future>(deadline: Instant, task: F) -> Option<F::Output> {
    tokio::time::timeout_at(deadline, task).await.ok()
}

/// Runs `task` for at most `limit`: `None` if it did not end in time.
///
/// # Cancel safety
///
/// As cancel safe as `task`.
#[cfg(not(shuttle))]
pub(crate) async fn timeout<F: Future>(limit: Duration, task: F) -> Option<F::Output> {
    // A task that is ready at once (the memory backend's) needs no timer:
    // registering one costs more than the whole call.
    let mut task = std::pin::pin!(task);
    if let Poll::Ready(out) = futures::poll!(task.as_mut()) {
        return Some(out);
    }
    tokio::time::timeout(limit, task).await.ok()
}

// Under shuttle a call always answers in time: backend errors are not what
// the shuttle runs are about (docs/SAFETY.md §3), and a bound of a TTL that
// fired early would make a world in which the hold it waited for is still
// live.
#[cfg(shuttle)]
pub(crate) async fn timeout_at<F: Future>(_deadline: Instant, task: F) -> Option<F::Output> {
    Some(task.await)
}

#[cfg(shuttle)]
pub(crate) async fn timeout<F: Future>(_limit: Duration, task: F) -> Option<F::Output> {
    Some(task.await)
}

/// Polls a future in place; dropped before it ended, hands the rest of it to
/// a task of the runtime, so that it still runs to its end (without a
/// runtime, or while a panic unwinds, the rest is dropped).
pub(crate) struct FinishOnDrop<T: Send + 'static> {
    task: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
}

impl<T: Send + 'static> FinishOnDrop<T> {
    pub(crate) fn new(task: impl Future<Output = T> + Send + 'static) -> Self {
        FinishOnDrop {
            task: Some(Box::pin(task)),
        }
    }
}

impl<T: Send + 'static> Future for FinishOnDrop<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let Some(task) = self.task.as_mut() else {
            panic!("FinishOnDrop polled after it ended");
        };
        let out = ready!(task.as_mut().poll(cx));
        self.task = None;
        Poll::Ready(out)
    }
}

impl<T: Send + 'static> Drop for FinishOnDrop<T> {
    fn drop(&mut self) {
        if let Some(task) = self.task.take()
            && !std::thread::panicking()
            && runtime_present()
        {
            spawn(crate::background::tracked(async move {
                let _ = task.await;
            }));
        }
    }
}

/// Time and mutations under shuttle.
#[cfg(shuttle)]
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) mod sim {
    use std::cell::Cell;

    use tokio::time::Instant;

    /// How timers behave in a shuttle test.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(crate) enum Time {
        /// No timer fires: only notifications wake anybody.
        StandsStill,
        /// A timer may fire at any scheduling point, early or late.
        Flies,
    }

    /// A buggy variant of the line that a review found, put back for a
    /// mutation check.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(crate) enum Mutation {
        /// A waiter whose own attempt succeeded while a handoff was delivered
        /// counts itself as a new local holder (the releaser already carried
        /// its hold on): the count never returns to zero.
        CountHandoffTwice,
        /// A waiter dropped with a handoff delivered gives the grant back but
        /// keeps the local holder count the releaser carried on to it.
        DroppedWaiterKeepsCount,
        /// A waiter dropped with a handoff delivered keeps the grant: the hold
        /// stays taken.
        DroppedWaiterKeepsGrant,
        /// A waiter whose own attempt succeeded gives back the handoff
        /// delivered meanwhile, which is the very hold it now has.
        GiveBackOwnHold,
    }

    thread_local! {
        static TIME: Cell<Time> = const { Cell::new(Time::StandsStill) };
        static MUTATION: Cell<Option<Mutation>> = const { Cell::new(None) };
    }

    /// Sets how timers behave for the shuttle tests run on this thread.
    pub(crate) fn set_time(time: Time) {
        TIME.with(|t| t.set(time));
    }

    /// Puts `mutation` (or none) into the code run on this thread.
    pub(crate) fn set_mutation(mutation: Option<Mutation>) {
        MUTATION.with(|m| m.set(mutation));
    }

    /// Whether `mutation` is on.
    pub(crate) fn mutated(mutation: Mutation) -> bool {
        MUTATION.with(|m| m.get()) == Some(mutation)
    }

    pub(super) async fn sleep(_deadline: Instant) {
        match TIME.with(|t| t.get()) {
            Time::StandsStill => std::future::pending().await,
            Time::Flies => ::shuttle::future::yield_now().await,
        }
    }
}

/// Whether the buggy variant `m` is put back (shuttle mutation checks only).
#[cfg(shuttle)]
pub(crate) use sim::{Mutation, mutated};
