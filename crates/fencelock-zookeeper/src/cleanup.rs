//! What a dropped acquire or an unfinished delete leaves to clean up, and
//! how sessions are connected.

use super::*;

/// The queue node of an acquire in progress, armed before its create is sent:
/// if the acquire gives up, fails or is dropped, every node with its protected
/// prefix (`_c_<uuid>-`) is deleted — also one whose create is still in flight
/// (ZooKeeper answers a session's requests in order, so the cleanup's read
/// sees it) and duplicates a retried create made. So a dropped acquire leaves
/// no ghost holder.
pub(crate) struct PendingNode {
    pub(crate) inner: Option<Arc<Inner>>,
    /// The session that sends the create (and so sees it, in order).
    pub(crate) session: Arc<Session>,
    pub(crate) lock_path: String,
    pub(crate) protected: String,
}

impl PendingNode {
    pub(crate) fn keep(mut self) {
        self.inner = None;
    }

    /// Deletes the node(s) now: an acquire that gave up must not leave its
    /// node queued in front of the same client's next try. Cancelled, it
    /// leaves the delete to `Drop`.
    pub(crate) async fn delete(self) {
        if let Some(inner) = &self.inner {
            inner
                .delete_protected(&self.session, &self.lock_path, &self.protected)
                .await;
        }
        self.keep();
    }
}

impl Drop for PendingNode {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            let (session, lock_path, protected) = (
                self.session.clone(),
                std::mem::take(&mut self.lock_path),
                std::mem::take(&mut self.protected),
            );
            if let Ok(h) = tokio::runtime::Handle::try_current() {
                h.spawn(fencelock_core::backend::tracked(async move {
                    inner
                        .delete_protected(&session, &lock_path, &protected)
                        .await
                }));
            } else {
                lock(&inner.orphans).push((format!("{lock_path}/{protected}*"), session));
            }
        }
    }
}

/// A node whose delete did not finish: handed to the janitor when dropped.
pub(crate) struct Orphan(pub(crate) Option<(Arc<Inner>, String, Arc<Session>)>);

impl Drop for Orphan {
    fn drop(&mut self) {
        if let Some((inner, node, session)) = self.0.take() {
            lock(&inner.orphans).push((node, session));
        }
    }
}

/// How to open a session: kept to open more, and new ones after old ones
/// expired.
pub(crate) struct Connect {
    pub(crate) cluster: String,
    pub(crate) digest: Option<String>,
    pub(crate) connect_timeout: Duration,
}

impl Connect {
    pub(crate) async fn open(
        &self,
        address: &str,
        session_timeout: Duration,
    ) -> Result<zk::Client> {
        let mut connector = zk::Client::connector()
            .with_session_timeout(session_timeout)
            .with_connection_timeout(self.connect_timeout);
        if let Some(d) = &self.digest {
            connector = connector.with_auth("digest", d.as_bytes());
        }
        tokio::time::timeout(self.connect_timeout, connector.connect(&self.cluster))
            .await
            .map_err(|_| {
                Error::connection(
                    NAME,
                    address,
                    "no server answered within the connect timeout",
                )
            })?
            .map_err(|e| zk_err(e, address))
    }
}
