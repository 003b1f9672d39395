//! Work that dropped guards and cancelled acquires leave to the background —
//! a release, leaving a server-side queue, deleting a waiter's node — and
//! [`settle`], which a program calls before it exits so that this work is
//! done rather than cut off with the runtime.
//!
//! A process that exits while such work is pending leaves what it would have
//! undone on the server until its TTL ends: a released lock handed to a
//! waiter that is gone, a queue node that others wait behind.

use std::future::Future;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

/// Pieces of background work not yet done, in this process.
static PENDING: AtomicUsize = AtomicUsize::new(0);

fn done() -> &'static Notify {
    static DONE: OnceLock<Notify> = OnceLock::new();
    DONE.get_or_init(Notify::new)
}

/// One piece of background work, counted from its creation until it is
/// dropped (done, or dropped with its runtime).
#[derive(Debug)]
pub struct Ticket(());

impl Ticket {
    /// Counts a piece of work from now on.
    pub fn new() -> Ticket {
        PENDING.fetch_add(1, Ordering::SeqCst);
        Ticket(())
    }
}

impl Default for Ticket {
    fn default() -> Self {
        Ticket::new()
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if PENDING.fetch_sub(1, Ordering::SeqCst) == 1 {
            done().notify_waiters();
        }
    }
}

/// `work`, counted by [`settle`] from this call until it ends. Call it where
/// the work is decided (in a `Drop`), then spawn the result.
pub fn tracked<F>(work: F) -> impl Future<Output = F::Output> + Send + 'static
where
    F: Future + Send + 'static,
{
    let ticket = Ticket::new();
    async move {
        let out = work.await;
        drop(ticket);
        out
    }
}

/// Waits until the background work of this process's dropped guards and
/// cancelled acquires is done, or `limit` has passed; `true` if it is done.
/// Call it before the process exits (the `fencelock` command does, after
/// `run`), so that a cancelled waiter leaves its place in a server-side line
/// and a dropped guard's lock is released rather than held until its TTL ends.
///
/// # Cancel safety
///
/// Cancel safe: it only waits.
pub async fn settle(limit: Duration) -> bool {
    let wait = async {
        loop {
            let notified = done().notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if PENDING.load(Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    };
    tokio::time::timeout(limit, wait).await.is_ok()
}
