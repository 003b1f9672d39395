//! The ZooKeeper backend of fencelock (`zk://h1:p1,h2:p2,h3:p3/chroot`): the
//! lock recipes of the ZooKeeper literature, named as Curator names them so that
//! Curator (Java) and kazurator (Python) services share locks with fencelock.
//!
//! # Algorithm
//!
//! A lock is the path `<prefix>/<escaped key>` (a container node, removed by the
//! server once empty). Each request creates an **ephemeral sequential** child,
//! in Curator's protected mode. With `writer=mutex` (the default) a writer is
//! `_c_<uuid>-lock-<seq>` (Curator's `InterProcessMutex`), a reader
//! `_c_<uuid>-__READ__lock-<seq>` and a permit `_c_<uuid>-__SEMA__lock-<seq>`;
//! with `writer=rwlock` a writer is `_c_<uuid>-__WRIT__<seq>`, a reader
//! `_c_<uuid>-__READ__<seq>` (Curator's `InterProcessReadWriteLock`) and a
//! permit `_c_<uuid>-__SEMA____WRIT__<seq>`. Curator orders a lock's children by
//! what follows its own fragment, so every node it must wait for ends in that
//! fragment (else it would sort after its own nodes and be ignored). The
//! lowest sequence wins:
//!
//! - a mutex or writer holds when it is first, else it watches **only the node
//!   just before it** — a release wakes one waiter, not the herd;
//! - a reader holds when no mutex or writer is before it, else it watches the
//!   last one before it (the improved read-write algorithm);
//! - a permit of N holds when only permits are before it, fewer than N; blocked by
//!   the count it watches the lock's children.
//!
//! A woken waiter re-reads the children (there is no watch on the parent). A
//! waiter that times out or is cancelled deletes its node. A create whose reply
//! was lost is recovered by finding the node by its uuid (protected mode).
//!
//! # Interoperating with Curator and kazurator
//!
//! What each fencelock mode does beside each Curator recipe on the same path
//! (the README's matrix; `tests/interop.rs` checks every cell both ways round):
//!
//! | `writer=` | fencelock | `InterProcessMutex` | RW lock, read | RW lock, write |
//! |---|---|---|---|---|
//! | `mutex` | exclusive | excludes | do not mix | do not mix |
//! | `mutex` | shared | excludes | shares | do not mix |
//! | `mutex` | semaphore | excludes | do not mix | do not mix |
//! | `rwlock` | exclusive | do not mix | excludes | excludes |
//! | `rwlock` | shared | do not mix | shares | excludes |
//! | `rwlock` | semaphore | do not mix | excludes | excludes |
//!
//! "Do not mix": fencelock waits for the Curator holder, but the Curator recipe
//! does not see fencelock's node (it sorts it after its own), so it may take
//! the lock beside a fencelock holder.
//!
//! # Leases and fencing
//!
//! A hold of TTL `t` lives in a ZooKeeper session of `min(ceil(t),
//! session_timeout)` whole seconds — one session per such TTL class, opened on
//! first use — so a holder that dies or is cut off frees its lock after about
//! its own TTL. The server may raise a session's timeout to its
//! `minSessionTimeout` (2 × `tickTime` by default, 4 s with the default
//! `tickTime` of 2 s) or lower it to `maxSessionTimeout`: a dead holder then
//! costs the negotiated timeout. A hold's validity is at most 3/4 of the
//! negotiated timeout: followers report their sessions' heartbeats to the
//! leader every half tick, and a timeout is at least two ticks, so the leader
//! may count a session's timeout from up to a quarter of it before this
//! client's check. Renewal is the session's heartbeat, and the watchdog's
//! renew checks (with a `sync` and one multi-read per session and tick) that
//! each node still exists and belongs to its session: the `sync` makes a
//! server cut off from the leader — which answers reads from stale state for
//! `syncLimit` ticks while the leader expires the session — fail the renewal
//! instead of confirming a node the leader has deleted. A waiter's deciding
//! read is synced the same way (the first read after its own create needs
//! no sync: it is no older than the create). A release whose future is
//! dropped before its delete is answered hands the node to this client's
//! janitor, which deletes it. Session expiry — or a
//! disconnection that outlasts the hold's validity — fires `lost()`; a short
//! disconnection that recovers does not (Curator's SUSPENDED vs LOST). A hold's
//! TTL also applies on this client: a hold nobody renews for its TTL (a leaked
//! guard, a fixed `.lease()`) is deleted, so it frees the lock like on every
//! other backend. The fencing token is the holder node's `czxid`, which rises
//! with every create in the ensemble. Reentrancy is kept per owner in this
//! client, with the owner's node.
//!
//! Tokens rise as long as the ensemble's zxid does. An ensemble rebuilt from
//! scratch starts its zxids again (and one restored from an old snapshot goes
//! back to it): fence the resources anew after that (a token from the new
//! ensemble may repeat one handed out before).
#![warn(missing_docs)]

mod names;
mod options;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use fencelock_core::backend::{
    Grant, LeaseRef, Released, Renewal, Request, async_trait, redact_url,
};
use fencelock_core::{
    Backend, Capabilities, Error, FencingToken, HolderInfo, Key, LockInfo, Mode, Owner, Result,
};
use tokio::time::Instant;
use zookeeper_client as zk;

use names::{Kind, Wait, blocker, escape_key, sorted_nodes, unescape_key};
pub use options::{Writer, ZkOptions};

const NAME: &str = "zookeeper";

/// How the `fencelock` facade opens this backend from a URL.
pub const DRIVER: fencelock_core::backend::Driver =
    fencelock_core::driver!(NAME, ["zk"], ZooKeeperBackend::connect);

/// How often this client looks for holds whose TTL ran out unrenewed.
const JANITOR_TICK: Duration = Duration::from_millis(50);

/// Locks in ZooKeeper. Clones share one session.
#[derive(Clone)]
pub struct ZooKeeperBackend {
    inner: Arc<Inner>,
}

struct Inner {
    /// The session of the `session_timeout` class: it also reads, watches
    /// and deletes for every class.
    primary: Arc<Session>,
    /// Sessions of shorter TTL classes, by their timeout in ms: a hold of TTL
    /// `t` lives in a session of `min(ceil(t), session_timeout)` whole
    /// seconds, so its holder's death costs its own TTL.
    classes: tokio::sync::Mutex<HashMap<u64, Arc<Session>>>,
    /// How to open a session.
    connect: Connect,
    options: ZkOptions,
    address: String,
    holds: Mutex<HashMap<(Key, Owner), Held>>,
    /// Nodes to delete that could not be deleted yet (`<lock path>/<prefix>*`:
    /// every node with that protected prefix), with the session that made them.
    orphans: Mutex<Vec<(String, Arc<Session>)>>,
    watch_events: AtomicU64,
}

/// One ZooKeeper session of this client, replaced when it expired.
struct Session {
    client: std::sync::RwLock<zk::Client>,
    /// The session timeout asked for.
    timeout: Duration,
    /// Serializes opening a new session.
    reconnecting: tokio::sync::Mutex<()>,
}

impl Session {
    fn client(&self) -> zk::Client {
        self.client
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn id(&self) -> i64 {
        self.client().session_id().0
    }
}

/// A hold of this client.
struct Held {
    /// The session its node lives in.
    session: Arc<Session>,
    node: String,
    token: u64,
    holds: u32,
    mode: Mode,
    ttl: Duration,
    /// The hold is deleted if not renewed by then.
    renewed_until: Instant,
}

fn zk_err(e: zk::Error, addr: &str) -> Error {
    let err = match &e {
        zk::Error::ConnectionLoss
        | zk::Error::NoHosts
        | zk::Error::Timeout
        | zk::Error::ClientClosed => Error::connection(NAME, addr, &e),
        zk::Error::SessionExpired => Error::connection(NAME, addr, "the ZooKeeper session expired"),
        zk::Error::NoAuth | zk::Error::AuthFailed => Error::connection(
            NAME,
            addr,
            format!("{e} (check the user and password in the URL)"),
        ),
        other => Error::backend(NAME, other),
    };
    err.with_source(e)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The queue node of an acquire in progress, armed before its create is sent:
/// if the acquire gives up, fails or is dropped, every node with its protected
/// prefix (`_c_<uuid>-`) is deleted — also one whose create is still in flight
/// (ZooKeeper answers a session's requests in order, so the cleanup's read
/// sees it) and duplicates a retried create made. So a dropped acquire leaves
/// no ghost holder.
struct PendingNode {
    inner: Option<Arc<Inner>>,
    /// The session that sends the create (and so sees it, in order).
    session: Arc<Session>,
    lock_path: String,
    protected: String,
}

impl PendingNode {
    fn keep(mut self) {
        self.inner = None;
    }

    /// Deletes the node(s) now: an acquire that gave up must not leave its
    /// node queued in front of the same client's next try. Cancelled, it
    /// leaves the delete to `Drop`.
    async fn delete(self) {
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
                h.spawn(async move {
                    inner
                        .delete_protected(&session, &lock_path, &protected)
                        .await
                });
            } else {
                lock(&inner.orphans).push((format!("{lock_path}/{protected}*"), session));
            }
        }
    }
}

/// A node whose delete did not finish: handed to the janitor when dropped.
struct Orphan(Option<(Arc<Inner>, String, Arc<Session>)>);

impl Drop for Orphan {
    fn drop(&mut self) {
        if let Some((inner, node, session)) = self.0.take() {
            lock(&inner.orphans).push((node, session));
        }
    }
}

/// How to open a session: kept to open more, and new ones after old ones
/// expired.
struct Connect {
    cluster: String,
    digest: Option<String>,
    connect_timeout: Duration,
}

impl Connect {
    async fn open(&self, address: &str, session_timeout: Duration) -> Result<zk::Client> {
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

impl Inner {
    /// The primary session's client, for reads about locks in general
    /// (`inspect`, `list`, operators' deletes); opened anew if it has ended.
    /// A hold's own operations go through the session its node lives in: a
    /// session sees its own writes in order, another may be behind.
    async fn client(&self) -> Result<zk::Client> {
        self.ensure_live(&self.primary).await?;
        Ok(self.primary.client())
    }

    /// [`Inner::client`], caught up with the leader on `path` (a `sync`): its
    /// reads see every write made before, through any session — this
    /// client's holds live in sessions of their own, on other servers maybe.
    async fn synced(&self, path: &str) -> Result<zk::Client> {
        let client = self.client().await?;
        client.sync(path).await.map_err(|e| self.err(e))?;
        Ok(client)
    }

    /// The live session for holds of `ttl`: of `min(ceil(ttl), session_timeout)`
    /// whole seconds, opened on first use, and opened anew if it has ended
    /// (expired, closed: the holds of the old one are gone, as their renewals
    /// say; new acquires work again).
    async fn session(&self, ttl: Duration) -> Result<Arc<Session>> {
        let secs = ttl.as_secs_f64().ceil().max(1.0) as u64;
        let timeout = Duration::from_secs(secs).min(self.options.session_timeout);
        let session = if timeout >= self.primary.timeout {
            self.primary.clone()
        } else {
            let key = timeout.as_millis() as u64;
            let mut classes = self.classes.lock().await;
            match classes.get(&key) {
                Some(s) => s.clone(),
                None => {
                    let client = self.connect.open(&self.address, timeout).await?;
                    let s = Arc::new(Session {
                        client: std::sync::RwLock::new(client),
                        timeout,
                        reconnecting: tokio::sync::Mutex::new(()),
                    });
                    classes.insert(key, s.clone());
                    s
                }
            }
        };
        self.ensure_live(&session).await?;
        Ok(session)
    }

    /// Opens `session` anew if it has ended.
    async fn ensure_live(&self, session: &Session) -> Result<()> {
        let ended = |c: &zk::Client| {
            matches!(
                c.state(),
                zk::SessionState::Expired | zk::SessionState::Closed | zk::SessionState::AuthFailed
            )
        };
        if !ended(&session.client()) {
            return Ok(());
        }
        let _one = session.reconnecting.lock().await;
        if !ended(&session.client()) {
            return Ok(());
        }
        tracing::warn!(address = %self.address, "a ZooKeeper session ended; opening a new one (its holds are lost)");
        let fresh = self.connect.open(&self.address, session.timeout).await?;
        *session.client.write().unwrap_or_else(|p| p.into_inner()) = fresh;
        Ok(())
    }

    fn err(&self, e: zk::Error) -> Error {
        zk_err(e, &self.address)
    }

    fn lock_path(&self, key: &Key) -> String {
        format!("{}/{}", self.options.prefix, escape_key(key.as_str()))
    }

    /// Deletes `path` through `session` (the one that made it, so that it
    /// sees it); a node that is already gone is fine; a failure is retried
    /// later.
    async fn delete_node(&self, session: &Arc<Session>, path: &str) {
        match session.client().delete(path, None).await {
            Ok(()) | Err(zk::Error::NoNode) => {}
            Err(_) => lock(&self.orphans).push((path.to_string(), session.clone())),
        }
    }

    /// Deletes every child of `lock_path` whose name starts with `protected`
    /// (the nodes of one acquire); retried by the janitor if ZooKeeper cannot
    /// be reached now.
    async fn delete_protected(&self, session: &Arc<Session>, lock_path: &str, protected: &str) {
        match session.client().list_children(lock_path).await {
            Ok(children) => {
                for c in children.into_iter().filter(|c| c.starts_with(protected)) {
                    self.delete_node(session, &format!("{lock_path}/{c}")).await;
                }
            }
            Err(zk::Error::NoNode) => {}
            Err(_) => {
                lock(&self.orphans).push((format!("{lock_path}/{protected}*"), session.clone()))
            }
        }
    }

    /// Creates the queue node (making the lock path if needed) with the
    /// protected prefix `protected`, and returns its name and czxid. After a
    /// lost reply the node is looked for by its prefix (Curator's protected
    /// mode) before another create is sent; if a retry made two, the later
    /// one is deleted.
    async fn create_node(
        &self,
        session: &Arc<Session>,
        lock_path: &str,
        protected: &str,
        kind: Kind,
        data: &[u8],
    ) -> Result<(String, u64)> {
        let path = format!(
            "{lock_path}/{protected}{}",
            kind.fragment(self.options.writer)
        );
        let options = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
        for _ in 0..5 {
            match session.client().create(&path, data, &options).await {
                Ok((stat, seq)) => {
                    return Ok((
                        format!("{protected}{}{seq}", kind.fragment(self.options.writer)),
                        stat.czxid as u64,
                    ));
                }
                Err(zk::Error::NoNode) => {
                    let dir = zk::CreateMode::Container.with_acls(zk::Acls::anyone_all());
                    session
                        .client()
                        .mkdir(lock_path, &dir)
                        .await
                        .map_err(|e| self.err(e))?;
                }
                Err(zk::Error::ConnectionLoss) => {
                    // The create may have happened: look for our prefix, and
                    // do not create again until the look succeeded.
                    if let Some(found) = self.find_protected(session, lock_path, protected).await? {
                        return Ok(found);
                    }
                }
                Err(e) => return Err(self.err(e)),
            }
        }
        Err(Error::backend(
            NAME,
            format!("could not create a lock node under {lock_path}"),
        ))
    }

    /// The node of `lock_path` with the prefix `protected` (the first, if a
    /// retried create made more: the others are deleted), read until the
    /// read succeeds (bounded).
    async fn find_protected(
        &self,
        session: &Arc<Session>,
        lock_path: &str,
        protected: &str,
    ) -> Result<Option<(String, u64)>> {
        for _ in 0..100 {
            match session.client().list_children(lock_path).await {
                Ok(children) => {
                    let mut ours: Vec<names::LockNode> = sorted_nodes(&children)
                        .into_iter()
                        .filter(|n| n.name.starts_with(protected))
                        .collect();
                    if ours.is_empty() {
                        return Ok(None);
                    }
                    for extra in ours.split_off(1) {
                        self.delete_node(session, &format!("{lock_path}/{}", extra.name))
                            .await;
                    }
                    let name = ours.remove(0).name;
                    let (_, stat) = session
                        .client()
                        .get_data(&format!("{lock_path}/{name}"))
                        .await
                        .map_err(|e| self.err(e))?;
                    return Ok(Some((name, stat.czxid as u64)));
                }
                Err(zk::Error::NoNode) => return Ok(None),
                Err(zk::Error::ConnectionLoss) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(self.err(e)),
            }
        }
        Err(Error::connection(
            NAME,
            &self.address,
            format!(
                "lost the connection while creating a lock node under {lock_path}, and could not look for it"
            ),
        ))
    }

    /// Waits until the node `name` holds the lock, and returns when the read
    /// that showed it so was sent (the hold's validity counts from there: the
    /// node, and so its session, was alive then); `None` if `deadline` passed.
    async fn wait_turn(
        &self,
        session: &Session,
        created: Instant,
        lock_path: &str,
        name: &str,
        permits: u32,
        deadline: Option<Instant>,
    ) -> Result<Option<Instant>> {
        let mut first = true;
        loop {
            let client = session.client();
            // The first look follows this session's own create, which reached
            // the leader after `created`: what it shows is no older than that,
            // and the session lived then. A later look may be served by a
            // server cut off from the leader (stale for up to syncLimit
            // ticks, while the leader expires this session): `sync` first, so
            // the look is as new as the leader's state when it was sent.
            let sent = if std::mem::take(&mut first) {
                created
            } else {
                let sent = Instant::now();
                match client.sync(lock_path).await {
                    Ok(()) => {}
                    Err(zk::Error::ConnectionLoss)
                        if deadline.is_none_or(|d| Instant::now() < d) =>
                    {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    Err(e) => return Err(self.err(e)),
                }
                sent
            };
            let children = match client.list_children(lock_path).await {
                Ok(c) => c,
                Err(zk::Error::ConnectionLoss) if deadline.is_none_or(|d| Instant::now() < d) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                Err(e) => return Err(self.err(e)),
            };
            let nodes = sorted_nodes(&children);
            let Some(index) = nodes.iter().position(|n| n.name == name) else {
                return Err(Error::backend(
                    NAME,
                    format!(
                        "the queue node {lock_path}/{name} vanished while waiting (session expired or deleted)"
                    ),
                ));
            };
            let watcher = match blocker(&nodes, index, permits) {
                None => return Ok(Some(sent)),
                Some(_) if deadline.is_some_and(|d| Instant::now() >= d) => return Ok(None),
                Some(Wait::Node(n)) => match client
                    .check_and_watch_stat(&format!("{lock_path}/{}", n.name))
                    .await
                {
                    // Gone already: look again.
                    Ok((None, _)) => continue,
                    Ok((Some(_), w)) => w,
                    Err(zk::Error::ConnectionLoss) => continue,
                    Err(e) => return Err(self.err(e)),
                },
                Some(Wait::Children) => {
                    match client.get_and_watch_children(lock_path).await {
                        Ok((now, _, w)) => {
                            let nodes = sorted_nodes(&now);
                            match nodes.iter().position(|n| n.name == name) {
                                // Free meanwhile: look again, synced.
                                Some(i) if blocker(&nodes, i, permits).is_none() => continue,
                                _ => w,
                            }
                        }
                        Err(zk::Error::ConnectionLoss) => continue,
                        Err(e) => return Err(self.err(e)),
                    }
                }
            };
            let until = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = watcher.changed() => {
                    self.watch_events.fetch_add(1, Ordering::Relaxed);
                }
                _ = until => {}
            }
        }
    }

    /// The permit count of another semaphore node of `lock_path` than `name`
    /// that differs from `permits`, if any (read from the nodes' data,
    /// `owner\tpermits`).
    async fn other_count(
        &self,
        session: &Session,
        lock_path: &str,
        name: &str,
        permits: u32,
    ) -> Result<Option<u32>> {
        let client = session.client();
        let children = client
            .list_children(lock_path)
            .await
            .map_err(|e| self.err(e))?;
        for n in sorted_nodes(&children) {
            if n.kind != Kind::Permit || n.name == name {
                continue;
            }
            let data = match client.get_data(&format!("{lock_path}/{}", n.name)).await {
                Ok((data, _)) => data,
                Err(zk::Error::NoNode) => continue,
                Err(e) => return Err(self.err(e)),
            };
            let held = std::str::from_utf8(&data)
                .ok()
                .and_then(|d| d.rsplit_once('\t'))
                .and_then(|(_, n)| n.parse::<u32>().ok());
            if let Some(held) = held.filter(|h| *h != permits) {
                return Ok(Some(held));
            }
        }
        Ok(None)
    }

    /// Deletes holds nobody renewed within their TTL, and retries orphans.
    async fn sweep(&self) {
        let now = Instant::now();
        let expired: Vec<(String, Arc<Session>)> = {
            let mut holds = lock(&self.holds);
            let gone: Vec<(Key, Owner)> = holds
                .iter()
                .filter(|(_, h)| h.renewed_until <= now)
                .map(|(k, _)| k.clone())
                .collect();
            gone.into_iter()
                .filter_map(|k| holds.remove(&k))
                .map(|h| (h.node, h.session))
                .collect()
        };
        let orphans = std::mem::take(&mut *lock(&self.orphans));
        for (path, session) in expired.into_iter().chain(orphans) {
            // `<lock path>/<protected prefix>*`: the nodes of one acquire.
            match path.strip_suffix('*').and_then(|p| p.rsplit_once('/')) {
                Some((lock_path, protected)) => {
                    self.delete_protected(&session, lock_path, protected).await
                }
                None => self.delete_node(&session, &path).await,
            }
        }
    }

    /// Renews the holds `of_session` (index into `leases`, node) of one
    /// session: a `sync` (so a server cut off from the leader, which would
    /// answer from stale state while the leader expires the session, fails
    /// instead), then one multi-read through that session, whose nodes must
    /// still be its own. The validity counts from before the `sync`.
    async fn renew_session(
        &self,
        leases: &[LeaseRef],
        session: &Arc<Session>,
        of_session: Vec<(usize, String)>,
    ) -> Vec<(usize, Renewal)> {
        let all = |r: Renewal| of_session.iter().map(|(i, _)| (*i, r.clone())).collect();
        let client = session.client();
        match client.state() {
            zk::SessionState::Expired | zk::SessionState::AuthFailed | zk::SessionState::Closed => {
                return all(Renewal::Lost {
                    reason: "the ZooKeeper session ended; its ephemeral nodes are gone".into(),
                });
            }
            zk::SessionState::Disconnected => {
                return all(Renewal::Unknown {
                    reason: "disconnected from ZooKeeper; the session may still recover".into(),
                });
            }
            _ => {}
        }
        let start = Instant::now();
        if let Err(e) = client.sync("/").await {
            return all(Renewal::Unknown {
                reason: format!("ZooKeeper did not sync with its leader: {e}"),
            });
        }
        let mut reader = client.new_multi_reader();
        for (_, node) in &of_session {
            if let Err(e) = reader.add_get_data(node) {
                return all(Renewal::Unknown {
                    reason: format!("cannot read {node}: {e}"),
                });
            }
        }
        let results = match reader.commit().await {
            Ok(r) => r,
            Err(e) => {
                return all(Renewal::Unknown {
                    reason: format!("ZooKeeper did not answer: {e}"),
                });
            }
        };
        let id = session.id();
        let mut holds = lock(&self.holds);
        of_session
            .iter()
            .zip(results)
            .map(|((i, node), result)| {
                let ours = matches!(result, zk::MultiReadResult::Data { stat, .. } if stat.ephemeral_owner == id);
                let key = (leases[*i].key.clone(), leases[*i].owner.clone());
                let renewal = match holds.get_mut(&key) {
                    Some(h) if ours && h.node == *node => {
                        h.renewed_until = start + h.ttl;
                        Renewal::Held { ttl: h.ttl }
                    }
                    _ => {
                        if !ours && holds.get(&key).is_some_and(|h| h.node == *node) {
                            holds.remove(&key);
                        }
                        Renewal::Lost {
                            reason: "the lock node is gone (deleted, or the session that owned it expired)"
                                .into(),
                        }
                    }
                };
                (*i, renewal)
            })
            .collect()
    }

    /// A hold's TTL in `session`: at most 3/4 of the session timeout the
    /// server granted (which may be below the one asked for,
    /// `maxSessionTimeout`), since the session's end ends the hold. The
    /// quarter is the leader's lag: a follower reports its sessions'
    /// heartbeats to the leader every half tick, and a timeout is at least
    /// two ticks, so the leader may count a session's timeout from up to a
    /// quarter of it before the check this client counts from.
    fn grant_ttl(&self, ttl: Duration, session: &Session) -> Duration {
        ttl.min(session.client().session_timeout().mul_f64(0.75))
    }
}

impl ZooKeeperBackend {
    /// Connects to the ensemble a `zk://[user:pass@]h1:p1,h2:p2[/chroot][?opts]`
    /// URL names (options in [`ZkOptions`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a bad URL; [`Error::Connection`] naming the
    /// address if no server answers within the connect timeout.
    pub async fn connect(url: &str) -> Result<ZooKeeperBackend> {
        let parsed = options::parse_url(url)?;
        let address = redact_url(url.split('?').next().unwrap_or(url));
        let connect = Connect {
            cluster: parsed.cluster,
            digest: parsed.digest,
            connect_timeout: parsed.options.connect_timeout,
        };
        let client = connect
            .open(&address, parsed.options.session_timeout)
            .await?;
        let dir = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        client
            .mkdir(&parsed.options.prefix, &dir)
            .await
            .map_err(|e| zk_err(e, &address))?;
        let primary = Arc::new(Session {
            client: std::sync::RwLock::new(client),
            timeout: parsed.options.session_timeout,
            reconnecting: tokio::sync::Mutex::new(()),
        });
        let inner = Arc::new(Inner {
            primary,
            classes: tokio::sync::Mutex::new(HashMap::new()),
            connect,
            options: parsed.options,
            address,
            holds: Mutex::new(HashMap::new()),
            orphans: Mutex::new(Vec::new()),
            watch_events: AtomicU64::new(0),
        });
        tokio::spawn(janitor(Arc::downgrade(&inner)));
        Ok(ZooKeeperBackend { inner })
    }

    /// The options in force.
    pub fn options(&self) -> &ZkOptions {
        &self.inner.options
    }

    /// How many watch events woke this client's waiters so far (a herd shows as
    /// many events per release).
    pub fn watch_events(&self) -> u64 {
        self.inner.watch_events.load(Ordering::Relaxed)
    }

    /// The queue of `key`: its lock nodes' names in sequence order (holders
    /// first), for tools and tests.
    ///
    /// # Errors
    ///
    /// Connection errors.
    pub async fn queue(&self, key: &Key) -> Result<Vec<String>> {
        let path = self.inner.lock_path(key);
        let client = self.inner.synced(&path).await?;
        match client.list_children(&path).await {
            Ok(children) => Ok(sorted_nodes(&children)
                .into_iter()
                .map(|n| n.name)
                .collect()),
            Err(zk::Error::NoNode) => Ok(Vec::new()),
            Err(e) => Err(self.inner.err(e)),
        }
    }

    /// The ZooKeeper session id (for tools and tests).
    pub fn session_id(&self) -> i64 {
        self.inner.primary.id()
    }

    /// Deletes every lock node of `key` (an operator breaking a lock; the
    /// testkit's "stolen lease").
    ///
    /// # Errors
    ///
    /// Connection errors.
    pub async fn force_release(&self, key: &Key) -> Result<()> {
        let path = self.inner.lock_path(key);
        let client = self.inner.client().await?;
        let children = match client.list_children(&path).await {
            Ok(c) => c,
            Err(zk::Error::NoNode) => return Ok(()),
            Err(e) => return Err(self.inner.err(e)),
        };
        for node in sorted_nodes(&children) {
            match client.delete(&format!("{path}/{}", node.name), None).await {
                Ok(()) | Err(zk::Error::NoNode) => {}
                Err(e) => return Err(self.inner.err(e)),
            }
        }
        Ok(())
    }

    fn kind(&self, mode: Mode) -> Kind {
        match mode {
            Mode::Shared => Kind::Read,
            Mode::Semaphore { .. } => Kind::Permit,
            _ => match self.inner.options.writer {
                Writer::ReadWriteLock => Kind::Write,
                _ => Kind::Mutex,
            },
        }
    }

    /// A hold this client already has for the request's owner, if any —
    /// checked on the server first: a node that is gone (deleted, or its
    /// session expired) is not handed back; the hold is forgotten and the lock
    /// taken anew.
    async fn reenter(&self, req: &Request, requested_at: Instant) -> Result<Option<Grant>> {
        let inner = &self.inner;
        let id = (req.key.clone(), req.owner.clone());
        let node = {
            let holds = lock(&inner.holds);
            let Some(h) = holds.get(&id) else {
                return Ok(None);
            };
            if h.mode != req.mode {
                return Err(Error::mode_mismatch(
                    req.owner.as_str(),
                    req.key.as_str(),
                    h.mode,
                    req.mode,
                ));
            }
            (h.node.clone(), h.session.clone())
        };
        let (node, session) = node;
        // Synced first: a server cut off from the leader may still show a
        // node whose session the leader has expired.
        let client = session.client();
        let checked_at = Instant::now();
        client.sync("/").await.map_err(|e| inner.err(e))?;
        let ours = match client.check_stat(&node).await {
            Ok(Some(stat)) => stat.ephemeral_owner == session.id(),
            Ok(None) => false,
            Err(e) => return Err(inner.err(e)),
        };
        let mut holds = lock(&inner.holds);
        if !ours {
            if holds.get(&id).is_some_and(|h| h.node == node) {
                holds.remove(&id);
            }
            return Ok(None);
        }
        let Some(h) = holds.get_mut(&id) else {
            return Ok(None);
        };
        if req.reentrant {
            h.holds += 1;
        }
        let ttl = self.inner.grant_ttl(req.ttl, &session);
        // The holds of one owner keep the longest TTL among them.
        h.ttl = h.ttl.max(ttl);
        h.renewed_until = h.renewed_until.max(checked_at + ttl);
        Ok(Some(Grant::new(
            Some(FencingToken::new(h.token)),
            ttl,
            h.holds,
            requested_at,
        )))
    }
}

async fn janitor(inner: Weak<Inner>) {
    loop {
        tokio::time::sleep(JANITOR_TICK).await;
        let Some(inner) = inner.upgrade() else { return };
        inner.sweep().await;
    }
}

#[async_trait]
impl Backend for ZooKeeperBackend {
    fn name(&self) -> &'static str {
        NAME
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
            .with_fair(true)
            .with_cross_process(true)
    }

    fn address(&self) -> String {
        self.inner.address.clone()
    }

    fn default_ttl(&self) -> Option<Duration> {
        self.inner.options.default_ttl
    }

    async fn try_acquire(&self, req: &Request) -> Result<Option<Grant>> {
        self.acquire(req, Some(Instant::now())).await
    }

    async fn acquire(&self, req: &Request, deadline: Option<Instant>) -> Result<Option<Grant>> {
        let requested_at = Instant::now();
        if let Some(g) = self.reenter(req, requested_at).await? {
            return Ok(Some(g));
        }
        let inner = &self.inner;
        let lock_path = inner.lock_path(&req.key);
        let (kind, permits) = match req.mode {
            Mode::Semaphore { permits } => (Kind::Permit, permits),
            m => (self.kind(m), 0),
        };
        let data = match req.mode {
            Mode::Semaphore { permits } => format!("{}\t{permits}", req.owner),
            _ => req.owner.to_string(),
        };
        let session = inner.session(req.ttl).await?;
        let protected = format!("_c_{}-", uuid::Uuid::new_v4());
        let pending = PendingNode {
            inner: Some(inner.clone()),
            session: session.clone(),
            lock_path: lock_path.clone(),
            protected: protected.clone(),
        };
        let created = Instant::now();
        let (name, czxid) = inner
            .create_node(&session, &lock_path, &protected, kind, data.as_bytes())
            .await?;
        let node = format!("{lock_path}/{name}");
        // A key has one permit count while held: created first, checked
        // second, so of two racers with different counts one sees the other.
        if kind == Kind::Permit
            && let Some(held) = inner
                .other_count(&session, &lock_path, &name, permits)
                .await?
        {
            pending.delete().await;
            return Err(Error::permits_mismatch(req.key.as_str(), held, permits));
        }
        let Some(checked_at) = inner
            .wait_turn(&session, created, &lock_path, &name, permits, deadline)
            .await?
        else {
            pending.delete().await;
            return Ok(None);
        };
        pending.keep();
        let ttl = inner.grant_ttl(req.ttl, &session);
        lock(&inner.holds).insert(
            (req.key.clone(), req.owner.clone()),
            Held {
                session,
                node,
                token: czxid,
                holds: 1,
                mode: req.mode,
                ttl,
                renewed_until: checked_at + ttl,
            },
        );
        // Valid from the read that showed the node holding.
        Ok(Some(Grant::new(
            Some(FencingToken::new(czxid)),
            ttl,
            1,
            checked_at,
        )))
    }

    async fn renew(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
        let inner = &self.inner;
        // Each lease's node and the session it lives in.
        let held: Vec<Option<(String, Arc<Session>)>> = {
            let holds = lock(&inner.holds);
            leases
                .iter()
                .map(|l| {
                    holds
                        .get(&(l.key.clone(), l.owner.clone()))
                        .map(|h| (h.node.clone(), h.session.clone()))
                })
                .collect()
        };
        let mut sessions: Vec<Arc<Session>> = Vec::new();
        for (_, s) in held.iter().flatten() {
            if !sessions.iter().any(|x| Arc::ptr_eq(x, s)) {
                sessions.push(s.clone());
            }
        }
        // Each session on its own, all at once: one that stalls (its server
        // cut off) holds up only its own leases.
        let per_session = futures::future::join_all(sessions.iter().map(|session| {
            let of_session: Vec<(usize, String)> = held
                .iter()
                .enumerate()
                .filter_map(|(i, h)| match h {
                    Some((node, s)) if Arc::ptr_eq(s, session) => Some((i, node.clone())),
                    _ => None,
                })
                .collect();
            inner.renew_session(leases, session, of_session)
        }))
        .await;
        let mut out: Vec<Option<Renewal>> = vec![None; leases.len()];
        for (i, r) in per_session.into_iter().flatten() {
            out[i] = Some(r);
        }
        Ok(out
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| Renewal::Lost {
                    reason:
                        "this client no longer holds it (released, or its TTL ran out unrenewed)"
                            .into(),
                })
            })
            .collect())
    }

    async fn release(&self, lease: &LeaseRef) -> Result<Released> {
        let inner = &self.inner;
        let id = (lease.key.clone(), lease.owner.clone());
        let (node, session) = {
            let mut holds = lock(&inner.holds);
            let not_held = || Error::NotHeld {
                key: lease.key.to_string(),
                owner: lease.owner.to_string(),
            };
            let h = holds.get_mut(&id).ok_or_else(not_held)?;
            if h.holds > 1 {
                h.holds -= 1;
                return Ok(Released::new(h.holds));
            }
            let h = holds.remove(&id).ok_or_else(not_held)?;
            (h.node, h.session)
        };
        // The hold is no longer in `holds`: if this future is dropped before
        // the delete is answered, the janitor must delete the node, or its
        // session's heartbeat keeps it holding for good.
        let mut unfinished = Orphan(Some((inner.clone(), node.clone(), session.clone())));
        let mut tries = 0;
        loop {
            tries += 1;
            match session.client().delete(&node, None).await {
                Ok(()) => {
                    unfinished.0 = None;
                    return Ok(Released::new(0));
                }
                Err(zk::Error::NoNode) => {
                    unfinished.0 = None;
                    return Err(Error::NotHeld {
                        key: lease.key.to_string(),
                        owner: lease.owner.to_string(),
                    });
                }
                Err(zk::Error::ConnectionLoss) if tries < 3 => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                // The janitor keeps trying (`unfinished` hands it the node);
                // the session's end deletes it anyway.
                Err(e) => return Err(inner.err(e)),
            }
        }
    }

    async fn inspect(&self, key: &Key) -> Result<Option<LockInfo>> {
        let inner = &self.inner;
        let path = inner.lock_path(key);
        let client = inner.synced(&path).await?;
        let children = match client.list_children(&path).await {
            Ok(c) => c,
            Err(zk::Error::NoNode) => return Ok(None),
            Err(e) => return Err(inner.err(e)),
        };
        let nodes = sorted_nodes(&children);
        let local: HashMap<String, u32> = lock(&inner.holds)
            .values()
            .map(|h| (h.node.clone(), h.holds))
            .collect();
        let mut holders = Vec::new();
        for (i, n) in nodes.iter().enumerate() {
            let full = format!("{path}/{}", n.name);
            let Ok((data, stat)) = client.get_data(&full).await else {
                continue;
            };
            let data = String::from_utf8_lossy(&data);
            let (owner, permits) = match data.split_once('\t') {
                Some((o, p)) => (o.to_string(), p.parse().unwrap_or(0)),
                None => (data.to_string(), 0),
            };
            if blocker(&nodes, i, permits).is_none() {
                holders.push(HolderInfo::new(
                    owner,
                    n.kind.mode(permits),
                    local.get(&full).copied().unwrap_or(1),
                    Some(FencingToken::new(stat.czxid as u64)),
                    None,
                ));
            }
        }
        Ok(Some(LockInfo::new(key.as_str(), holders, None)))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>> {
        let inner = &self.inner;
        let children = inner
            .synced(&inner.options.prefix)
            .await?
            .list_children(&inner.options.prefix)
            .await
            .map_err(|e| inner.err(e))?;
        let mut keys: Vec<String> = children
            .iter()
            .map(|c| unescape_key(c))
            .filter(|k| k.starts_with(prefix))
            .collect();
        keys.sort();
        let mut out = Vec::new();
        for k in keys {
            if let Ok(key) = Key::new(&k)
                && let Some(info) = self.inspect(&key).await?
                && !info.holders.is_empty()
            {
                out.push(info);
            }
        }
        Ok(out)
    }
}

impl std::fmt::Debug for ZooKeeperBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZooKeeperBackend")
            .field("address", &self.inner.address)
            .field("options", &self.inner.options)
            .finish()
    }
}
