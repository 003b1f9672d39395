//! Lease-mode waiting: one `LISTEN fencelock` connection per backend wakes the
//! waiters of the key a release names.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::sync::Notify;

/// The channel releases `NOTIFY` with the key as payload.
pub(crate) const CHANNEL: &str = "fencelock";

/// Waiters by key. The listener task holds only a weak reference to this.
#[derive(Default)]
pub(crate) struct Waiters {
    by_key: Mutex<HashMap<String, Weak<Notify>>>,
}

impl Waiters {
    /// The wake-up of `key`, shared by every waiter of this backend on it.
    pub(crate) fn of(&self, key: &str) -> Arc<Notify> {
        let mut map = self.by_key.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = map.get(key).and_then(Weak::upgrade) {
            return n;
        }
        if map.len() >= 64 {
            map.retain(|_, w| w.strong_count() > 0);
        }
        let n = Arc::new(Notify::new());
        map.insert(key.to_string(), Arc::downgrade(&n));
        n
    }

    fn wake(&self, key: &str) {
        let map = self.by_key.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = map.get(key).and_then(Weak::upgrade) {
            n.notify_waiters();
        }
    }

    /// After the listener lost its connection notifications may be lost: every
    /// waiter re-checks.
    fn wake_all(&self) {
        let map = self.by_key.lock().unwrap_or_else(|p| p.into_inner());
        for n in map.values().filter_map(Weak::upgrade) {
            n.notify_waiters();
        }
    }
}

/// Runs until `waiters` is dropped (the backend's last clone went away).
pub(crate) async fn run(options: PgConnectOptions, waiters: Weak<Waiters>) {
    // A pool of one connection: the listener reconnects through it.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .max_lifetime(None)
        .idle_timeout(None)
        .connect_lazy_with(options);
    let mut pause = Duration::from_millis(50);
    let mut listener = None;
    loop {
        if listener.is_none() {
            let mut l = match PgListener::connect_with(&pool).await {
                Ok(l) => l,
                Err(e) => {
                    tracing::debug!(error = %e, "postgres LISTEN connection failed; waiters poll");
                    if waiters.upgrade().is_none() {
                        return;
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                    continue;
                }
            };
            l.ignore_pool_close_event(true);
            if l.listen(CHANNEL).await.is_err() {
                continue;
            }
            listener = Some(l);
        }
        let Some(l) = listener.as_mut() else { continue };
        let next = tokio::time::timeout(Duration::from_secs(5), l.try_recv()).await;
        let Some(w) = waiters.upgrade() else { return };
        match next {
            Ok(Ok(Some(n))) => {
                pause = Duration::from_millis(50);
                w.wake(n.payload());
            }
            // The connection dropped (the listener reconnects on the next call):
            // notifications may have been missed, so every waiter re-checks.
            Ok(Ok(None)) => w.wake_all(),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "postgres LISTEN failed; waiters poll");
                w.wake_all();
                listener = None;
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            // Quiet for a while: check that the backend is still in use.
            Err(_) => {}
        }
    }
}
