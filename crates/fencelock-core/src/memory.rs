//! The in-memory backend: one process, every mode, tokens, notification waiting.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::admission::{Admission, admit};
use crate::backend::{Backend, Grant, HolderInfo, LeaseRef, LockInfo, Released, Renewal, Request};
use crate::backoff::Backoff;
use crate::capabilities::Capabilities;
use crate::error::{Error, Result};
use crate::key::{Key, Owner};
use crate::mode::Mode;
use crate::sync::{Mutex, MutexGuard, lock, sleep_until};
use crate::token::FencingToken;

/// Locks in this process's memory (`memory://`): for tests, for single-process
/// programs, and as the reference implementation of the contract.
///
/// Every mode, reentrancy, TTL expiry and fencing tokens are supported; waiters
/// are woken by a [`Notify`] on release and at the holder's expiry. Clones share
/// the same locks. Nothing survives the process, and other processes see nothing
/// (`cross_process` is false).
///
/// A key's fence counter is kept after release so that tokens keep rising; the
/// map therefore grows with the number of distinct keys ever locked.
///
/// # Examples
///
/// ```
/// use fencelock_core::{Locker, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock_core::Result<()> {
/// let backend = MemoryBackend::new();
/// let a = Locker::new(backend.clone());
/// let b = Locker::new(backend);
/// let g = a.lock("k").acquire().await?;
/// assert!(b.lock("k").try_acquire().await?.is_none());
/// g.release().await?;
/// assert!(b.lock("k").try_acquire().await?.is_some());
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct MemoryBackend {
    slots: Arc<Mutex<HashMap<Key, Slot>>>,
}

#[derive(Default)]
struct Slot {
    fence: u64,
    holders: Vec<Holding>,
    notify: Arc<Notify>,
}

struct Holding {
    owner: Owner,
    mode: Mode,
    holds: u32,
    token: u64,
    expires_at: Instant,
}

impl Holding {
    /// Whether this is the hold `lease` was granted: the same owner name and
    /// the same token (an owner whose hold was broken and who took the key
    /// again holds a new grant, which the old lease must not touch).
    fn is_grant_of(&self, lease: &LeaseRef) -> bool {
        self.owner == lease.owner && lease.token.is_none_or(|t| t.get() == self.token)
    }
}

impl Slot {
    /// Drops expired holders; returns whether any were dropped.
    fn purge(&mut self, now: Instant) -> bool {
        let before = self.holders.len();
        self.holders.retain(|h| h.expires_at > now);
        self.holders.len() != before
    }

    fn next_expiry(&self) -> Option<Instant> {
        self.holders.iter().map(|h| h.expires_at).min()
    }
}

impl MemoryBackend {
    /// A fresh, empty set of locks.
    pub fn new() -> Self {
        MemoryBackend::default()
    }

    /// The process-wide instance called `name` (`memory://name` in URLs; `""` is
    /// the default instance), created on first use.
    pub fn named(name: &str) -> MemoryBackend {
        static REGISTRY: OnceLock<std::sync::Mutex<HashMap<String, MemoryBackend>>> =
            OnceLock::new();
        let registry = REGISTRY.get_or_init(Default::default);
        let mut map = registry.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(name.to_string()).or_default().clone()
    }

    /// Removes every holder of `key` at once (an operator breaking a lock; the
    /// testkit's "stolen lease"). The fence counter stays.
    pub fn force_release(&self, key: &Key) {
        let mut slots = self.lock_slots();
        if let Some(slot) = slots.get_mut(key) {
            slot.holders.clear();
            slot.notify.notify_waiters();
        }
    }

    fn lock_slots(&self) -> MutexGuard<'_, HashMap<Key, Slot>> {
        lock(&self.slots)
    }

    fn try_grant(slot: &mut Slot, req: &Request, now: Instant) -> Result<Option<Grant>> {
        if slot.purge(now) {
            slot.notify.notify_waiters();
        }
        let admission = admit(
            req.key.as_str(),
            slot.holders.iter().map(|h| (h.owner.as_str(), h.mode)),
            req.owner.as_str(),
            req.mode,
        )?;
        let expires_at = now + req.ttl;
        match admission {
            Admission::Reenter { index } => {
                let h = &mut slot.holders[index];
                if req.reentrant {
                    h.holds += 1;
                }
                h.expires_at = h.expires_at.max(expires_at);
                Ok(Some(Grant::new(
                    Some(FencingToken::new(h.token)),
                    req.ttl,
                    h.holds,
                    now,
                )))
            }
            Admission::Grant => {
                slot.fence += 1;
                slot.holders.push(Holding {
                    owner: req.owner.clone(),
                    mode: req.mode,
                    holds: 1,
                    token: slot.fence,
                    expires_at,
                });
                Ok(Some(Grant::new(
                    Some(FencingToken::new(slot.fence)),
                    req.ttl,
                    1,
                    now,
                )))
            }
            Admission::Busy => Ok(None),
        }
    }

    /// Releases one hold; if that frees the key and `next` asks for it, grants
    /// it to `next` under the same lock.
    fn release_locked(
        &self,
        lease: &LeaseRef,
        next: Option<&Request>,
    ) -> Result<(Released, Option<Grant>)> {
        let mut slots = self.lock_slots();
        let now = Instant::now();
        let not_held = || Error::NotHeld {
            key: lease.key.to_string(),
            owner: lease.owner.to_string(),
        };
        let slot = slots.get_mut(&lease.key).ok_or_else(not_held)?;
        if slot.purge(now) {
            slot.notify.notify_waiters();
        }
        let index = slot
            .holders
            .iter()
            .position(|h| h.is_grant_of(lease))
            .ok_or_else(not_held)?;
        let h = &mut slot.holders[index];
        h.holds -= 1;
        let remaining = h.holds;
        if remaining > 0 {
            return Ok((Released::new(remaining), None));
        }
        slot.holders.swap_remove(index);
        if let Some(next) = next.filter(|n| n.key == lease.key && slot.holders.is_empty())
            && let Some(grant) = MemoryBackend::try_grant(slot, next, now)?
        {
            return Ok((Released::new(0), Some(grant)));
        }
        slot.notify.notify_waiters();
        Ok((Released::new(0), None))
    }

    fn info(key: &Key, slot: &Slot, now: Instant) -> LockInfo {
        let holders = slot
            .holders
            .iter()
            .filter(|h| h.expires_at > now)
            .map(|h| {
                HolderInfo::new(
                    h.owner.as_str(),
                    h.mode,
                    h.holds,
                    Some(FencingToken::new(h.token)),
                    Some(h.expires_at - now),
                )
            })
            .collect();
        LockInfo::new(
            key.as_str(),
            holders,
            (slot.fence > 0).then(|| FencingToken::new(slot.fence)),
        )
    }
}

#[async_trait]
impl Backend for MemoryBackend {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::NONE
            .with_fencing(true)
            .with_shared(true)
            .with_semaphore(true)
            .with_reentrant(true)
            .with_native_wait(true)
            .with_ttl(true)
            .with_inspect(true)
    }

    fn address(&self) -> String {
        "memory://".into()
    }

    async fn try_acquire(&self, req: &Request) -> Result<Option<Grant>> {
        let mut slots = self.lock_slots();
        let slot = slots.entry(req.key.clone()).or_default();
        MemoryBackend::try_grant(slot, req, Instant::now())
    }

    async fn acquire(&self, req: &Request, deadline: Option<Instant>) -> Result<Option<Grant>> {
        loop {
            let (notified, wake_at) = {
                let mut slots = self.lock_slots();
                let slot = slots.entry(req.key.clone()).or_default();
                let now = Instant::now();
                if let Some(grant) = MemoryBackend::try_grant(slot, req, now)? {
                    return Ok(Some(grant));
                }
                if deadline.is_some_and(|d| now >= d) {
                    return Ok(None);
                }
                // Registered under the map lock: a release after this point wakes us.
                let mut notified = Box::pin(slot.notify.clone().notified_owned());
                notified.as_mut().enable();
                let wake_at = match (slot.next_expiry(), deadline) {
                    (Some(e), Some(d)) => Some(e.min(d)),
                    (e, d) => e.or(d),
                };
                (notified, wake_at)
            };
            match wake_at {
                Some(at) => {
                    tokio::select! {
                        _ = notified => {}
                        _ = sleep_until(at) => {}
                    }
                }
                None => notified.await,
            }
        }
    }

    async fn wait_change(
        &self,
        key: &Key,
        backoff: &mut Backoff,
        deadline: Option<Instant>,
    ) -> Result<()> {
        let notify = self
            .lock_slots()
            .entry(key.clone())
            .or_default()
            .notify
            .clone();
        tokio::select! {
            _ = notify.notified() => {}
            _ = backoff.sleep(deadline, None) => {}
        }
        Ok(())
    }

    async fn renew(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
        let mut slots = self.lock_slots();
        let now = Instant::now();
        Ok(leases
            .iter()
            .map(|lease| {
                let held = slots.get_mut(&lease.key).and_then(|slot| {
                    slot.holders
                        .iter_mut()
                        .find(|h| h.is_grant_of(lease) && h.expires_at > now)
                });
                match held {
                    Some(h) => {
                        h.expires_at = h.expires_at.max(now + lease.ttl);
                        Renewal::Held { ttl: lease.ttl }
                    }
                    None => Renewal::Lost {
                        reason: format!(
                            "{:?} holds no unexpired lock on {:?}",
                            lease.owner.as_str(),
                            lease.key.as_str()
                        ),
                    },
                }
            })
            .collect())
    }

    async fn release(&self, lease: &LeaseRef) -> Result<Released> {
        Ok(self.release_locked(lease, None)?.0)
    }

    async fn release_to(
        &self,
        lease: &LeaseRef,
        next: &Request,
    ) -> Result<(Released, Option<Grant>)> {
        self.release_locked(lease, Some(next))
    }

    async fn inspect(&self, key: &Key) -> Result<Option<LockInfo>> {
        let slots = self.lock_slots();
        Ok(slots
            .get(key)
            .map(|slot| MemoryBackend::info(key, slot, Instant::now())))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>> {
        let slots = self.lock_slots();
        let now = Instant::now();
        let mut out: Vec<LockInfo> = slots
            .iter()
            .filter(|(k, s)| {
                k.as_str().starts_with(prefix) && s.holders.iter().any(|h| h.expires_at > now)
            })
            .map(|(k, s)| MemoryBackend::info(k, s, now))
            .collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }
}

impl std::fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBackend").finish_non_exhaustive()
    }
}
