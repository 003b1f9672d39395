//! Lease-mode waiting: one LISTEN connection per backend wakes the waiters of
//! the key a release names (channel `fencelock`), and brings the grants that a
//! release handed to one of this backend's waits where it stood in the queue
//! (the backend's own grant channel; see `fencelock_hand_on`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use fencelock_core::backend::{GrantSlot, GrantSlots};
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::sync::Notify;

/// The channel releases `NOTIFY` with the key as payload.
pub(crate) const CHANNEL: &str = "fencelock";

/// Waiters by key, and waits that can be handed the lock by wait id. The
/// listener task holds only a weak reference to this.
pub(crate) struct Waiters {
    by_key: Mutex<HashMap<String, Weak<Notify>>>,
    /// This backend's grant channel.
    grant_channel: String,
    slots: Arc<GrantSlots<Handed>>,
    /// True once the listener listens on the grant channel.
    hearing: tokio::sync::watch::Sender<bool>,
}

/// A grant handed to a wait where it stood: its token, and the attempt whose
/// request it answered.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Handed {
    pub(crate) token: u64,
    pub(crate) attempt: u64,
}

impl Default for Waiters {
    fn default() -> Self {
        Waiters {
            by_key: Mutex::default(),
            grant_channel: format!("fencelock_g_{:016x}", fastrand::u64(..)),
            slots: GrantSlots::new(),
            hearing: tokio::sync::watch::Sender::new(false),
        }
    }
}

impl Waiters {
    /// Registers `wait`: a grant handed to it arrives in the returned slot
    /// (until the slot is dropped).
    pub(crate) fn expect_grant(&self, wait: &str) -> GrantSlot<Handed> {
        self.slots.expect(wait)
    }

    /// The grant channel, if the listener listens on it.
    pub(crate) fn grant_channel(&self) -> Option<&str> {
        (*self.hearing.borrow()).then_some(self.grant_channel.as_str())
    }

    /// Waits (at most `patience`) until the listener hears the grant
    /// channel; true if it does.
    pub(crate) async fn hearing(&self, patience: Duration) -> bool {
        let mut rx = self.hearing.subscribe();
        matches!(
            tokio::time::timeout(patience, rx.wait_for(|h| *h)).await,
            Ok(Ok(_))
        )
    }

    /// A grant on the grant channel: `wait_id attempt token`.
    fn handed(&self, payload: &str) {
        let mut fields = payload.split(' ');
        let (Some(wait), Some(attempt), Some(token)) =
            (fields.next(), fields.next(), fields.next())
        else {
            return;
        };
        let (Ok(attempt), Ok(token)) = (attempt.parse(), token.parse()) else {
            return;
        };
        self.slots.deliver(wait, Handed { token, attempt });
    }

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
            let Some(w) = waiters.upgrade() else { return };
            if let Err(e) = l.listen_all([CHANNEL, w.grant_channel.as_str()]).await {
                tracing::debug!(error = %e, "postgres LISTEN failed; waiters poll");
                drop(w);
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
                continue;
            }
            w.hearing.send_replace(true);
            listener = Some(l);
        }
        let Some(l) = listener.as_mut() else { continue };
        let next = tokio::time::timeout(Duration::from_secs(5), l.try_recv()).await;
        let Some(w) = waiters.upgrade() else { return };
        match next {
            Ok(Ok(Some(n))) => {
                pause = Duration::from_millis(50);
                if n.channel() == CHANNEL {
                    w.wake(n.payload());
                } else {
                    w.handed(n.payload());
                }
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
