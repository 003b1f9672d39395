//! Local FIFO queues: the waiters of one [`Locker`](crate::Locker) for one key
//! line up here, and only the head of the line waits at the backend.
//!
//! This removes the herd inside a process (one backend request per key and
//! locker instead of one per waiting task), and stops a releasing task from
//! barging back in ahead of the tasks that were already waiting next to it. It
//! is used for exclusive requests with the default (per-guard) owner only: an
//! explicit owner may be reentrant, and queueing it behind a waiter that waits
//! for that same owner would deadlock; shared and semaphore holders may hold
//! together and must not wait for each other.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::key::Key;

#[derive(Default)]
pub(crate) struct LocalQueues {
    lines: Mutex<HashMap<Key, Arc<Semaphore>>>,
}

/// The head of a key's line; the next waiter moves up when it is dropped.
pub(crate) struct Turn<'a> {
    queues: &'a LocalQueues,
    key: Key,
    line: Arc<Semaphore>,
    permit: Option<OwnedSemaphorePermit>,
}

impl LocalQueues {
    /// Waits for the head of `key`'s line; `None` if `deadline` passed first.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a cancelled waiter leaves the line.
    pub(crate) async fn turn(&self, key: &Key, deadline: Option<Instant>) -> Option<Turn<'_>> {
        let line = {
            let mut lines = self.lines.lock().unwrap_or_else(|p| p.into_inner());
            lines
                .entry(key.clone())
                .or_insert_with(|| Arc::new(Semaphore::new(1)))
                .clone()
        };
        let mut turn = Turn {
            queues: self,
            key: key.clone(),
            line: line.clone(),
            permit: None,
        };
        let acquire = line.acquire_owned();
        let permit = match deadline {
            None => acquire.await.ok()?,
            Some(d) => tokio::time::timeout_at(d, acquire).await.ok()?.ok()?,
        };
        turn.permit = Some(permit);
        Some(turn)
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut lines = self.queues.lines.lock().unwrap_or_else(|p| p.into_inner());
        self.permit.take();
        // Nobody else waits or holds: forget the line (the map plus this turn).
        if Arc::strong_count(&self.line) == 2 {
            lines.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn waiters_take_turns_in_arrival_order_and_lines_are_forgotten() {
        let q = Arc::new(LocalQueues::default());
        let key = Key::new("k").unwrap();
        let first = q.turn(&key, None).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..5 {
            let (q, key, order) = (q.clone(), key.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let _t = q.turn(&key, None).await.unwrap();
                order.lock().unwrap().push(i);
            }));
            tokio::task::yield_now().await; // let it join the line before the next
        }
        let late = q
            .turn(&key, Some(Instant::now() + Duration::from_millis(20)))
            .await;
        assert!(late.is_none(), "a waiter got a turn while the head held it");
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
        assert!(q.lines.lock().unwrap().is_empty(), "an idle line was kept");
    }
}
