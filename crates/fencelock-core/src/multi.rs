//! Several keys at once, all or nothing.

use std::fmt;

use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::guard::{Guard, LostReason};
use crate::key::Key;
use crate::locker::{LockOptions, Locker, Wait, acquire_one, option_setters};
use crate::mode::Mode;
use crate::token::FencingToken;

/// Builds an all-or-nothing request for several exclusive locks. Get one from
/// [`Locker::multi_lock`].
///
/// Keys are taken in sorted order (so two multi-locks over overlapping keys
/// cannot deadlock), duplicates once; if one cannot be had within the wait, those
/// already taken are released and the error is returned. A hold lost while a
/// later key was awaited is never returned: when all keys are taken, every
/// lease is checked, and if one was lost, all are released and the keys are
/// taken again, in order, within the same wait.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_core::{Locker, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock_core::Result<()> {
/// let locker = Locker::new(MemoryBackend::new());
/// let both = locker.multi_lock(["accounts/b", "accounts/a"]).wait(Duration::from_secs(1)).acquire().await?;
/// assert_eq!(both.keys().map(|k| k.as_str()).collect::<Vec<_>>(), ["accounts/a", "accounts/b"]);
/// both.release().await?;
/// # Ok(()) }
/// ```
#[must_use = "a lock builder does nothing until acquire() is awaited"]
#[derive(Debug)]
pub struct MultiLockBuilder {
    locker: Locker,
    keys: Result<Vec<Key>>,
    opts: LockOptions,
}

impl MultiLockBuilder {
    pub(crate) fn new<I, K>(locker: Locker, keys: I) -> Self
    where
        I: IntoIterator<Item = K>,
        K: AsRef<str>,
    {
        let keys = keys
            .into_iter()
            .map(Key::new)
            .collect::<Result<Vec<_>>>()
            .and_then(|mut keys| {
                if keys.is_empty() {
                    return Err(Error::config("a multi-lock needs at least one key"));
                }
                keys.sort();
                keys.dedup();
                Ok(keys)
            });
        MultiLockBuilder {
            locker,
            keys,
            opts: LockOptions::new(Mode::Exclusive),
        }
    }

    option_setters!();

    /// Acquires every key or none.
    ///
    /// # Errors
    ///
    /// As [`LockBuilder::acquire`](crate::LockBuilder::acquire), plus
    /// [`Error::Lost`] when a hold was lost while a later key was awaited and
    /// the wait ran out before all could be taken again; on any error the keys
    /// already taken have been released.
    ///
    /// # Cancel safety
    ///
    /// Cancelling drops the guards already taken, which queues their release.
    pub async fn acquire(self) -> Result<MultiGuard> {
        let keys = self.keys?;
        let owner_opts = self.opts.clone();
        let requests = keys
            .into_iter()
            .map(|k| owner_opts.request(&self.locker, k))
            .collect::<Result<Vec<_>>>()?;
        let start = Instant::now();
        let deadline = self.opts.deadline(start);
        loop {
            let guards = take_all(&self.locker, &self.opts, &requests, deadline, start).await?;
            let Some(lost) = guards.iter().find(|g| !g.is_valid()) else {
                return Ok(MultiGuard { guards });
            };
            let key = lost.key().to_string();
            let reason = lost.lease().lost_reason().unwrap_or(LostReason::Expired);
            tracing::debug!(%key, %reason, "a multi-lock hold was lost while a later key was awaited; taking every key again");
            for g in guards.into_iter().rev() {
                let _ = g.release().await;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Error::Lost { key, reason });
            }
        }
    }
}

/// Takes every key in order within `deadline`, or none.
async fn take_all(
    locker: &Locker,
    options: &LockOptions,
    requests: &[crate::backend::Request],
    deadline: Option<Instant>,
    start: Instant,
) -> Result<Vec<Guard>> {
    let mut guards = Vec::with_capacity(requests.len());
    for req in requests {
        // Every key shares the one deadline of the whole request.
        let mut opts = options.clone();
        opts.wait = match deadline {
            None => Wait::Forever,
            Some(d) => Wait::For(d.saturating_duration_since(Instant::now())),
        };
        match acquire_one(locker, req, &opts).await {
            Ok(g) => guards.push(g),
            Err(e) => {
                for g in guards.into_iter().rev() {
                    let _ = g.release().await;
                }
                return Err(match e {
                    Error::Timeout { key, .. } => Error::Timeout {
                        key,
                        waited: start.elapsed(),
                    },
                    other => other,
                });
            }
        }
    }
    Ok(guards)
}

/// Holds several locks taken together by [`MultiLockBuilder::acquire`].
#[must_use = "the locks are released as soon as the guard is dropped"]
pub struct MultiGuard {
    guards: Vec<Guard>,
}

impl MultiGuard {
    /// The keys, sorted.
    pub fn keys(&self) -> impl Iterator<Item = &Key> {
        self.guards.iter().map(Guard::key)
    }

    /// The fencing token of each key, in key order.
    pub fn tokens(&self) -> Vec<(Key, Option<FencingToken>)> {
        self.guards
            .iter()
            .map(|g| (g.key().clone(), g.token()))
            .collect()
    }

    /// The guards, in key order.
    pub fn guards(&self) -> &[Guard] {
        &self.guards
    }

    /// Splits into the individual guards.
    pub fn into_guards(self) -> Vec<Guard> {
        self.guards
    }

    /// True while every hold is valid.
    pub fn is_valid(&self) -> bool {
        self.guards.iter().all(Guard::is_valid)
    }

    /// Resolves with the first [`Error::Lost`] among the holds.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn lost(&self) -> Error {
        let futures: Vec<_> = self.guards.iter().map(|g| Box::pin(g.lost())).collect();
        futures::future::select_all(futures).await.0
    }

    /// Releases every hold (in reverse key order).
    ///
    /// # Errors
    ///
    /// The first error met; the other holds are still released.
    pub async fn release(self) -> Result<()> {
        let mut first = Ok(());
        for g in self.guards.into_iter().rev() {
            if let Err(e) = g.release().await
                && first.is_ok()
            {
                first = Err(e);
            }
        }
        first
    }
}

impl fmt::Debug for MultiGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(&self.guards).finish()
    }
}
