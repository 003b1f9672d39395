//! Shuttle tests of the in-process line (`src/line/`: places, offers, the
//! head's wait and re-check racing a handoff, the release that hands off),
//! release from `Drop` (through the watchdog task) and the watchdog's tick.
//! `docs/SAFETY.md` §3 says what they cover and what not.
//!
//! Built only with `--cfg shuttle`, which puts shuttle's locks, atomics,
//! tasks and time into the core (`crate::sync`):
//!
//! ```sh
//! RUSTFLAGS="--cfg shuttle" cargo test -p fencelock-core --lib --release \
//!     --target-dir target/shuttle shuttle_tests
//! ```
//!
//! The backend is the memory backend behind a [`Link`] whose every call gives
//! the scheduler a turn before it reaches the backend (and releases also
//! before their reply), so a call can be overtaken and a task cancelled there.
//! Cancellation is shuttle's `abort` of a task, which drops its future at
//! whatever await point it stands: the scheduler picks which.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use shuttle::future::{block_on, spawn, yield_now};
use tokio::time::Instant;

use crate::backend::{Backend, Grant, LeaseRef, LockInfo, Released, Renewal, Request};
use crate::sync::sim::{Mutation, Time, set_mutation, set_time};
use crate::{Capabilities, Key, Locker, MemoryBackend, Result};

/// Iterations per scheduler for a property check.
const ITERATIONS: usize = 20_000;
/// Iterations allowed to find a mutation's counterexample.
const MUTATION_ITERATIONS: usize = 20_000;
/// Turns the ender gives the waiters before it cancels those still there.
const ENDING_TURNS: usize = 40;

/// The memory backend behind a link that yields to the scheduler before
/// every request arrives, and before a release's reply arrives.
struct Link(MemoryBackend);

#[crate::backend::async_trait]
impl Backend for Link {
    fn name(&self) -> &'static str {
        "link"
    }

    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }

    async fn try_acquire(&self, req: &Request) -> Result<Option<Grant>> {
        yield_now().await;
        self.0.try_acquire(req).await
    }

    async fn acquire(&self, req: &Request, deadline: Option<Instant>) -> Result<Option<Grant>> {
        yield_now().await;
        self.0.acquire(req, deadline).await
    }

    async fn renew(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
        yield_now().await;
        self.0.renew(leases).await
    }

    async fn release(&self, lease: &LeaseRef) -> Result<Released> {
        yield_now().await;
        let released = self.0.release(lease).await;
        yield_now().await;
        released
    }

    async fn release_to(
        &self,
        lease: &LeaseRef,
        next: &Request,
    ) -> Result<(Released, Option<Grant>)> {
        yield_now().await;
        let outcome = self.0.release_to(lease, next).await;
        yield_now().await;
        outcome
    }

    async fn inspect(&self, key: &Key) -> Result<Option<LockInfo>> {
        self.0.inspect(key).await
    }
}

/// One run: a holder, waiters behind it in one locker, and what happens to them.
#[derive(Clone, Copy, Debug)]
struct Scenario {
    time: Time,
    /// The first holder took the lock with `try_acquire` (outside the line).
    first_outside: bool,
    waiters: usize,
    /// Each waiter joins only once the one before it stands in line, and
    /// the grants must come in that order.
    fifo: bool,
    /// Wait this long (with `Time::Flies`, a waiter can time out at any point
    /// before it is the head); `None`: wait forever.
    wait: Option<Duration>,
    /// Waiters still there a while after the first holder let go are
    /// cancelled (for runs in which a hold can stay until its TTL).
    end_by_cancelling: bool,
    /// The first two waiters are cancelled at points the scheduler picks.
    cancel_waiters: bool,
    /// The first holder's release is cancelled at a point the scheduler picks.
    cancel_release: bool,
    mutation: Option<Mutation>,
}

/// Waiters that time out, and the first two cancelled (time flies).
const CANCELLING: Scenario = Scenario {
    time: Time::Flies,
    fifo: false,
    wait: Some(Duration::from_secs(60)),
    end_by_cancelling: true,
    cancel_waiters: true,
    ..CALM
};

const CALM: Scenario = Scenario {
    time: Time::StandsStill,
    first_outside: false,
    waiters: 3,
    fifo: true,
    wait: None,
    end_by_cancelling: false,
    cancel_waiters: false,
    cancel_release: false,
    mutation: None,
};

/// Counts the guards inside the critical section; leaving it (also by a
/// cancellation that drops the task) counts down.
struct Inside(Arc<AtomicUsize>);

impl Inside {
    fn enter(count: &Arc<AtomicUsize>) -> Inside {
        let before = count.fetch_add(1, Ordering::SeqCst);
        assert_eq!(before, 0, "two guards of the key at once");
        Inside(count.clone())
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn waiting(locker: &Locker, key: &Key) -> usize {
    let census = locker.shared.lines.census();
    census
        .iter()
        .find(|(k, ..)| k == key)
        .map_or(0, |(_, waiters, _)| *waiters)
}

/// Runs `s` once (one schedule) and checks its properties.
fn run(s: Scenario) {
    set_time(s.time);
    set_mutation(s.mutation);
    let backend = MemoryBackend::new();
    let locker = Locker::new(Link(backend.clone()));
    let key = Key::new("k").expect("a valid key");
    block_on(async move {
        let inside = Arc::new(AtomicUsize::new(0));
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        // Owners whose own release was cancelled: their hold may stay until
        // its TTL (documented); nobody else's may.
        let cut = Arc::new(std::sync::Mutex::new(Vec::new()));
        let first = match s.first_outside {
            true => locker
                .lock("k")
                .try_acquire()
                .await
                .expect("memory answers"),
            false => Some(locker.lock("k").acquire().await.expect("a free key")),
        }
        .expect("a free key");
        let first_owner = first.owner().to_string();
        cut.lock()
            .expect("no panic holds it")
            .push(first_owner.clone());
        let mut tasks = Vec::new();
        for i in 0..s.waiters {
            let (l, inside, order, cut) =
                (locker.clone(), inside.clone(), order.clone(), cut.clone());
            tasks.push(spawn(async move {
                let builder = l.lock("k");
                let builder = match s.wait {
                    Some(w) => builder.wait(w),
                    None => builder.wait_forever(),
                };
                let Ok(guard) = builder.acquire().await else {
                    assert!(s.wait.is_some(), "a wait without end ended");
                    return;
                };
                let _inside = Inside::enter(&inside);
                order.lock().expect("no panic holds it").push(i);
                yield_now().await;
                drop(_inside);
                if i % 2 == 0 {
                    let owner = guard.owner().to_string();
                    cut.lock().expect("no panic holds it").push(owner.clone());
                    let _ = guard.release().await;
                    cut.lock()
                        .expect("no panic holds it")
                        .retain(|o| *o != owner);
                } else {
                    drop(guard);
                }
            }));
            if s.fifo {
                while waiting(&locker, &key) < i + 1 {
                    yield_now().await;
                }
            }
        }
        let aborts: Vec<_> = match s.cancel_waiters {
            true => tasks.iter().take(2).map(|t| t.abort_handle()).collect(),
            false => Vec::new(),
        };
        let canceller = spawn(async move {
            for a in aborts {
                yield_now().await;
                a.abort();
            }
        });
        let everyone: Vec<_> = tasks.iter().map(|t| t.abort_handle()).collect();
        let ender = spawn(async move {
            if s.end_by_cancelling {
                for _ in 0..ENDING_TURNS {
                    yield_now().await;
                }
                everyone.iter().for_each(|a| a.abort());
            }
        });
        if s.cancel_release {
            let (cut, first_owner) = (cut.clone(), first_owner.clone());
            let releasing = spawn(async move {
                let _ = first.release().await;
                cut.lock()
                    .expect("no panic holds it")
                    .retain(|o| *o != first_owner);
            });
            yield_now().await;
            releasing.abort();
        } else {
            first.release().await.expect("the first holder holds");
            cut.lock()
                .expect("no panic holds it")
                .retain(|o| *o != first_owner);
        }
        let _ = canceller.await;
        let _ = ender.await;
        for t in tasks {
            let _ = t.await;
        }
        if s.fifo && s.wait.is_none() && !s.cancel_waiters && !s.cancel_release {
            let order = order.lock().expect("no panic holds it").clone();
            assert_eq!(
                order,
                (0..s.waiters).collect::<Vec<_>>(),
                "not granted in line order"
            );
        }
        // Everyone is gone. Background releases (of dropped guards, of
        // handoffs nobody took) get their turns; then nothing may be left.
        let mut left = None;
        for _ in 0..2_000 {
            let lines = locker.shared.lines.census();
            let info = backend.inspect(&key).await.expect("memory answers");
            let holders: Vec<String> = info
                .map(|i| i.holders.into_iter().map(|h| h.owner).collect())
                .unwrap_or_default();
            let cut = cut.lock().expect("no panic holds it").clone();
            let stray: Vec<&String> = holders.iter().filter(|o| !cut.contains(o)).collect();
            if lines.is_empty() && stray.is_empty() {
                left = None;
                break;
            }
            left = Some(format!(
                "lines (key, waiting, local holders): {lines:?}; backend holders: {holders:?}"
            ));
            yield_now().await;
        }
        assert!(left.is_none(), "left behind: {}", left.unwrap_or_default());
    });
}

/// Checks `s` with the random and the PCT schedulers.
fn check(s: Scenario) {
    shuttle::check_random(move || run(s), ITERATIONS);
    shuttle::check_pct(move || run(s), ITERATIONS, 3);
}

/// Asserts that the checker finds a counterexample to `s` (with its mutation).
fn finds_counterexample(s: Scenario) {
    let found = catch_unwind(AssertUnwindSafe(|| {
        shuttle::check_random(move || run(s), MUTATION_ITERATIONS)
    }))
    .is_err();
    set_mutation(None);
    assert!(found, "no counterexample for {:?}", s.mutation);
}

#[test]
fn waiters_are_granted_in_line_order_and_no_wake_up_is_lost() {
    // Time stands still: no timer rescues a waiter whose wake-up was lost,
    // so a lost one is a deadlock, which shuttle reports.
    check(CALM);
}

#[test]
fn a_handoff_racing_the_heads_recheck_is_counted_once() {
    // Timers fire anywhere: the head re-checks the backend while a local
    // holder releases and hands it the lock; the watchdog ticks.
    check(Scenario {
        time: Time::Flies,
        ..CALM
    });
}

#[test]
fn a_guard_from_outside_the_line_hands_nothing_into_it() {
    check(Scenario {
        time: Time::Flies,
        first_outside: true,
        ..CALM
    });
}

#[test]
fn cancelled_and_timed_out_waiters_leave_nothing_behind() {
    check(CANCELLING);
}

#[test]
fn a_release_cancelled_during_its_handoff_leaves_nothing_behind() {
    // One waiter, cancelled too: a handoff cut midway left it holding at
    // the backend without knowing, a ghost holder until the TTL.
    check(Scenario {
        waiters: 1,
        cancel_release: true,
        ..CANCELLING
    });
}

#[test]
fn mutation_a_handoff_counted_twice_is_found() {
    finds_counterexample(Scenario {
        time: Time::Flies,
        mutation: Some(Mutation::CountHandoffTwice),
        ..CALM
    });
}

#[test]
fn mutation_giving_back_ones_own_hold_is_found() {
    finds_counterexample(Scenario {
        time: Time::Flies,
        mutation: Some(Mutation::GiveBackOwnHold),
        ..CALM
    });
}

#[test]
fn mutation_a_dropped_waiter_keeping_the_count_is_found() {
    finds_counterexample(Scenario {
        mutation: Some(Mutation::DroppedWaiterKeepsCount),
        ..CANCELLING
    });
}

#[test]
fn mutation_a_dropped_waiter_keeping_the_grant_is_found() {
    finds_counterexample(Scenario {
        mutation: Some(Mutation::DroppedWaiterKeepsGrant),
        ..CANCELLING
    });
}
