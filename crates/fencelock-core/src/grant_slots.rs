//! Grants handed to waits where they stood: a backend whose release makes a
//! waiter of another process the holder tells that waiter on a channel of its
//! own (Redis pub/sub, PostgreSQL `NOTIFY`); the message goes to the slot of
//! the wait it names, if that wait is still on.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// The slots of one client's waits, by wait id.
///
/// # Examples
///
/// ```
/// use fencelock_core::backend::GrantSlots;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let slots = GrantSlots::<u64>::new();
/// let slot = slots.expect("wait-1");
/// // The client's listener hears a grant for wait-1, token 42:
/// assert!(slots.deliver("wait-1", 42));
/// slot.arrived().await;
/// assert_eq!(slot.take(), Some(42));
/// // A wait that ended takes nothing.
/// drop(slot);
/// assert!(!slots.deliver("wait-1", 43));
/// # }
/// ```
pub struct GrantSlots<T> {
    slots: Mutex<HashMap<String, Arc<Slot<T>>>>,
}

struct Slot<T> {
    notify: Notify,
    handed: Mutex<Option<T>>,
}

impl<T> GrantSlots<T> {
    /// No wait expects anything yet.
    pub fn new() -> Arc<Self> {
        Arc::new(GrantSlots {
            slots: Mutex::new(HashMap::new()),
        })
    }

    /// Registers `wait`, which can be handed a grant where it stands, until
    /// the slot is dropped.
    pub fn expect(self: &Arc<Self>, wait: &str) -> GrantSlot<T> {
        let slot = Arc::new(Slot {
            notify: Notify::new(),
            handed: Mutex::new(None),
        });
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(wait.to_string(), slot.clone());
        GrantSlot {
            slots: self.clone(),
            wait: wait.to_string(),
            slot,
        }
    }

    /// Hands `grant` to the slot of `wait`; false if no such wait is on.
    pub fn deliver(&self, wait: &str, grant: T) -> bool {
        let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let Some(slot) = slots.get(wait) else {
            return false;
        };
        *slot.handed.lock().unwrap_or_else(|p| p.into_inner()) = Some(grant);
        slot.notify.notify_one();
        true
    }
}

/// Where the grant of one wait arrives; unregistered when dropped.
pub struct GrantSlot<T> {
    slots: Arc<GrantSlots<T>>,
    wait: String,
    slot: Arc<Slot<T>>,
}

impl<T> GrantSlot<T> {
    /// Waits until a grant may have arrived (a permit is kept, so one that
    /// arrived before this call is not missed).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the grant stays in the slot.
    pub async fn arrived(&self) {
        self.slot.notify.notified().await;
    }

    /// The grant handed to this wait, if one arrived.
    pub fn take(&self) -> Option<T> {
        self.slot
            .handed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

impl<T> Drop for GrantSlot<T> {
    fn drop(&mut self) {
        self.slots
            .slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.wait);
    }
}
