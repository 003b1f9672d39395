//! Pub/sub wake-ups: one subscriber connection per backend (the RESP3 command
//! connection itself) and channels subscribed on demand while somebody waits.
//! Waiters of the same locker never need them: the core's local line hands the
//! lock over or wakes its head directly.
//!
//! The client's grant channel carries grants that a release handed to one of
//! its waiters where it stood in a queue (see `scripts`); each goes to the
//! [`GrantSlot`] of its wait op, if that wait is still on.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use redis::{PushInfo, PushKind, Value};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::{Mutex, Notify};
use tokio::time::Instant;

use fencelock_core::backend::GrantSlots;

use crate::conn::Conn;

/// A channel unused this long is unsubscribed.
const LINGER: Duration = Duration::from_secs(30);

struct Channel {
    notify: Arc<Notify>,
    watchers: usize,
    subscribed: bool,
    idle_since: Instant,
}

pub(crate) struct Subscriptions {
    conn: Conn,
    channels: Mutex<HashMap<String, Channel>>,
    /// The channel this client hears grants on.
    grant_channel: String,
    /// The waits that can take a grant where they stand, by wait op.
    slots: Arc<GrantSlots<Handed>>,
}

/// A grant handed to a waiter where it stood (a message on the grant channel).
#[derive(Debug)]
pub(crate) struct Handed {
    pub(crate) owner: String,
    pub(crate) token: u64,
    /// The attempt op whose request the grant answered.
    pub(crate) attempt: String,
}

/// Where the grant of one wait arrives; unregistered when dropped.
pub(crate) type GrantSlot = fencelock_core::backend::GrantSlot<Handed>;

/// Interest in one channel; wakes on its messages while alive.
pub(crate) struct Watch {
    subs: Arc<Subscriptions>,
    channel: String,
    pub(crate) notify: Arc<Notify>,
}

impl Subscriptions {
    /// Starts dispatching `pushes` and sweeping idle channels.
    pub(crate) fn start(
        conn: Conn,
        pushes: UnboundedReceiver<PushInfo>,
        grant_channel: String,
    ) -> Arc<Subscriptions> {
        let subs = Arc::new(Subscriptions {
            conn,
            channels: Mutex::new(HashMap::new()),
            grant_channel,
            slots: GrantSlots::new(),
        });
        tokio::spawn(dispatch(Arc::downgrade(&subs), pushes));
        subs
    }

    /// Subscribes to `channel` (if not yet) and returns a watch on it. The
    /// subscription is confirmed when this returns, so a message published after
    /// that is not missed.
    pub(crate) async fn watch(self: &Arc<Self>, channel: &str) -> redis::RedisResult<Watch> {
        let mut channels = self.channels.lock().await;
        let entry = channels
            .entry(channel.to_string())
            .or_insert_with(|| Channel {
                notify: Arc::new(Notify::new()),
                watchers: 0,
                subscribed: false,
                idle_since: Instant::now(),
            });
        if !entry.subscribed {
            self.conn.subscribe(channel).await?;
            entry.subscribed = true;
        }
        entry.watchers += 1;
        Ok(Watch {
            subs: self.clone(),
            channel: channel.to_string(),
            notify: entry.notify.clone(),
        })
    }

    /// The channel this client hears grants on.
    pub(crate) fn grant_channel(&self) -> &str {
        &self.grant_channel
    }

    /// Registers a wait that can take a grant where it stands. Subscribe to
    /// the grant channel (a [`Watch`] on it) before asking with `wait_op`.
    pub(crate) fn expect_grant(&self, wait_op: &str) -> GrantSlot {
        self.slots.expect(wait_op)
    }

    /// A message on the grant channel: `g\t<owner>\t<wait op>\t<token>\t<attempt op>`.
    fn deliver(&self, payload: &str) {
        let mut parts = payload.split('\t');
        let (Some("g"), Some(owner), Some(wait_op), Some(token), Some(attempt)) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next().and_then(|t| t.parse::<u64>().ok()),
            parts.next(),
        ) else {
            tracing::debug!(payload, "an unreadable grant message was ignored");
            return;
        };
        self.slots.deliver(
            wait_op,
            Handed {
                owner: owner.to_string(),
                token,
                attempt: attempt.to_string(),
            },
        );
    }

    /// A watch on `channel` if it is subscribed already (no round trip), else `None`.
    pub(crate) async fn watch_if_subscribed(self: &Arc<Self>, channel: &str) -> Option<Watch> {
        let mut channels = self.channels.lock().await;
        let entry = channels.get_mut(channel).filter(|c| c.subscribed)?;
        entry.watchers += 1;
        Some(Watch {
            subs: self.clone(),
            channel: channel.to_string(),
            notify: entry.notify.clone(),
        })
    }

    fn wake(channels: &HashMap<String, Channel>, channel: Option<&str>) {
        match channel {
            Some(ch) => {
                if let Some(c) = channels.get(ch) {
                    c.notify.notify_waiters();
                }
            }
            None => channels.values().for_each(|c| c.notify.notify_waiters()),
        }
    }

    async fn sweep(&self) {
        let mut channels = self.channels.lock().await;
        let idle: Vec<String> = channels
            .iter()
            .filter(|(_, c)| c.watchers == 0 && c.idle_since.elapsed() > LINGER)
            .map(|(k, _)| k.clone())
            .collect();
        for ch in idle {
            if self.conn.unsubscribe(&ch).await.is_ok() {
                channels.remove(&ch);
            }
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let subs = self.subs.clone();
        let channel = std::mem::take(&mut self.channel);
        // The map is a tokio mutex; update it without blocking the dropper.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let mut channels = subs.channels.lock().await;
                if let Some(c) = channels.get_mut(&channel) {
                    c.watchers = c.watchers.saturating_sub(1);
                    c.idle_since = Instant::now();
                }
            });
        }
    }
}

fn text(v: &Value) -> Option<&str> {
    match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok(),
        Value::SimpleString(s) => Some(s),
        _ => None,
    }
}

async fn dispatch(subs: Weak<Subscriptions>, mut pushes: UnboundedReceiver<PushInfo>) {
    let mut sweep = tokio::time::interval(LINGER / 3);
    loop {
        tokio::select! {
            push = pushes.recv() => {
                let Some(push) = push else { return };
                let Some(subs) = subs.upgrade() else { return };
                let channel = push.data.first().and_then(text);
                if push.kind == PushKind::Message && channel == Some(subs.grant_channel.as_str()) {
                    if let Some(payload) = push.data.get(1).and_then(text) {
                        subs.deliver(payload);
                    }
                    continue;
                }
                let channels = subs.channels.lock().await;
                match push.kind {
                    PushKind::Message => Subscriptions::wake(&channels, channel),
                    // After a reconnect every waiter re-checks (messages may be lost).
                    PushKind::Disconnection => Subscriptions::wake(&channels, None),
                    _ => {}
                }
            }
            _ = sweep.tick() => {
                let Some(subs) = subs.upgrade() else { return };
                subs.sweep().await;
            }
        }
    }
}
