//! What a dropped acquire or an unfinished delete leaves to clean up.

use super::*;

/// Deletes a queue key if the acquire that created it is dropped mid-way.
pub(crate) struct PendingNode {
    pub(crate) inner: Option<Arc<Inner>>,
    pub(crate) key: String,
    /// The lease the key is put with.
    pub(crate) lease: i64,
}

impl PendingNode {
    pub(crate) fn keep(mut self) {
        self.inner = None;
    }

    /// Deletes the node now: an acquire that gave up must not leave its
    /// node queued in front of the same client's next try. Cancelled, it
    /// leaves the delete to `Drop`.
    pub(crate) async fn delete(self) {
        if let Some(inner) = &self.inner {
            inner.delete_node(&self.key).await;
        }
        self.keep();
    }
}

impl Drop for PendingNode {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            let key = std::mem::take(&mut self.key);
            // The put may be in flight still: never reuse the name, and keep
            // looking for a key of it (see `Inner::cancelled`).
            lock(&inner.cancelled).push((
                key.clone(),
                self.lease,
                Instant::now() + CANCELLED_WINDOW,
            ));
            if let Ok(h) = tokio::runtime::Handle::try_current() {
                h.spawn(fencelock_core::backend::tracked(async move {
                    inner.delete_node(&key).await
                }));
            } else {
                lock(&inner.orphans).push(key);
            }
        }
    }
}

/// A key whose delete did not finish: handed to the janitor when dropped.
pub(crate) struct Orphan(pub(crate) Option<(Arc<Inner>, String)>);

impl Drop for Orphan {
    fn drop(&mut self) {
        if let Some((inner, key)) = self.0.take() {
            lock(&inner.orphans).push(key);
        }
    }
}
