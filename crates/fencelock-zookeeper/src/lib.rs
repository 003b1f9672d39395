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
//! (the matrix of docs/backends/zookeeper.md; `tests/interop.rs` checks every cell both ways round):
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
//!
//! # Defaults, restarts and frozen clients
//!
//! - A hold lives in a session of `min(ceil(TTL), session_timeout)` (30 s by
//!   default; the server may cap it, `maxSessionTimeout`), and is valid for at
//!   most ¾ of it: 22.5 s with the defaults. `Guard::ttl` is that
//!   lease; `run` renews and stops its command on it
//!   (`tests/sessions.rs::a_hold_never_outlives_the_negotiated_session_timeout`).
//! - Sessions survive a restart shorter than their timeout, and so does a
//!   job `run` holds with the defaults (the CLI's `tests/outage.rs`); a waiter whose
//!   session ended queues again (`tests/sessions.rs::a_waiter_waits_through_an_outage_longer_than_its_session`).
//! - A frozen holder keeps the key until its session expires
//!   (`tests/faults.rs::a_paused_holder_loses_its_lock_and_its_stale_write`); a
//!   silent server holds a waiter at most a second past its wait
//!   (`tests/faults.rs::a_stalled_server_cannot_hold_a_waiter_past_its_wait`).
#![warn(missing_docs)]

mod cleanup;
mod names;
mod options;
mod requests;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use fencelock_core::backend::{
    Grant, GrantTable, LeaseRef, Released, Renewal, Request, Tokened, async_trait, redact_url,
};
use fencelock_core::{
    Backend, Capabilities, Error, FencingToken, HolderInfo, Key, LockInfo, Mode, Result,
};
use tokio::time::Instant;
use zookeeper_client as zk;

use cleanup::{Connect, Orphan, PendingNode};
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
    holds: Mutex<GrantTable<Held>>,
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

impl Tokened for Held {
    fn token(&self) -> u64 {
        self.token
    }
}

fn zk_err(e: zk::Error, addr: &str) -> Error {
    let err = match &e {
        zk::Error::ConnectionLoss
        | zk::Error::NoHosts
        | zk::Error::Timeout
        | zk::Error::ClientClosed => Error::connection(NAME, addr, &e),
        zk::Error::SessionExpired => Error::connection(NAME, addr, "the ZooKeeper session expired"),
        zk::Error::NoAuth | zk::Error::AuthFailed => Error::login_refused(NAME, addr, &e),
        other => Error::backend(NAME, other),
    };
    err.with_source(e)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ZooKeeperBackend {
    /// Connects to the ensemble a `zk://[user:pass@]h1:p1,h2:p2[/chroot][?opts]`
    /// URL names (options in [`ZkOptions`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a bad URL or a chroot the server does not
    /// have; [`Error::Connection`] naming the address if no server answers
    /// within the connect timeout.
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
            .map_err(|e| match e {
                // The prefix's parents are made: only a chroot can be missing.
                zk::Error::NoNode => Error::config(format!(
                    "zookeeper: the chroot of {address} does not exist on the server; \
                     create it (zkCli.sh create /PATH) or leave it out of the URL"
                )),
                e => zk_err(e, &address),
            })?;
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
            holds: Mutex::new(GrantTable::new()),
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
        let (key, owner) = (&req.key, &req.owner);
        let node = {
            let holds = lock(&inner.holds);
            let Some(h) = holds.first(key, owner) else {
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
            (h.node.clone(), h.session.clone(), h.token)
        };
        let (node, session, token) = node;
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
            holds.remove(key, owner, token);
            return Ok(None);
        }
        let Some(h) = holds.get_mut(key, owner, token) else {
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
            &req.key,
            &req.owner,
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
                        .of_lease(l)
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
        let (node, session) = {
            let mut holds = lock(&inner.holds);
            let not_held = || Error::NotHeld {
                key: lease.key.to_string(),
                owner: lease.owner.to_string(),
            };
            let h = holds.of_lease_mut(lease).ok_or_else(not_held)?;
            if h.holds > 1 {
                h.holds -= 1;
                return Ok(Released::new(h.holds));
            }
            let token = h.token;
            let h = holds
                .remove(&lease.key, &lease.owner, token)
                .ok_or_else(not_held)?;
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
