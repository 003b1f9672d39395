//! The etcd backend of fencelock (`etcd://h1:p1,h2:p2,h3:p3`): the lock of
//! Go's `go.etcd.io/etcd/client/v3/concurrency.Mutex`, in its key layout, so
//! that `etcdctl lock` and Go services share locks with fencelock.
//!
//! # Algorithm
//!
//! Each backend holds one etcd **lease** per TTL class (Go's session): a hold
//! of TTL `t` lives on the lease of `ceil(t)` seconds (at most `session_ttl`,
//! 30 s by default; etcd raises a lease below its minimum, about 2 s), kept
//! alive by one task per lease — so a holder that dies costs its own TTL. A
//! request puts the key
//! `<prefix><key>/<lease id in hex>` attached to the lease, if absent (one
//! transaction that also reads the lock's keys), and the lowest create
//! revision wins:
//!
//! - a writer holds when its key is first; otherwise it watches the deletion of
//!   **only the key just before it** (the greatest create revision below its
//!   own) — a release wakes one waiter, not the herd;
//! - a reader holds when no writer is before it, else it watches the last
//!   writer before it;
//! - a permit of N holds when only permits are before it, fewer than N; blocked
//!   by the count it watches the lock's deletions.
//!
//! Keys fencelock did not write (`etcdctl lock`, Go's `Mutex`, whose value is
//! empty) are writers. A waiter opens its watch (at the current revision) and
//! then reads the queue again, so a deletion before the watch shows in the
//! read and one after it in the watch; it also reads again after 20 ms without
//! an event, then at doubling intervals up to 5 s (20, 60, 140 ms … after the
//! watch opened). etcd serves a watch made while a write was applied late: it
//! catches such a watch up in a pass every 100 ms. A deletion such a watch
//! holds back is seen at the next read or that pass, whichever comes first —
//! within about 40 ms of it rather than 100 ms (longer only if a pass has more
//! lagging watchers than it takes at once) — and a lost watch costs a delay,
//! never a hang. A waiter
//! that times out or is cancelled deletes its key. An acquire dropped while
//! its put is unanswered may see that put land after its key's delete (etcd
//! serves one request's stream and a later delete independently): its name
//! is never used again while its lease lives, and for a minute the janitor
//! looks each second at the keys on this client's leases and deletes such a
//! key. A release dropped before its delete is answered hands the key to
//! the janitor. More holds of one key by this backend at once (readers,
//! permits) add `-<n>` to the key.
//!
//! # Leases and fencing
//!
//! The keepalive is the renewal of every hold; the watchdog's renew checks (one
//! transaction per tick) that each key still exists with its create revision.
//! A lease that expires — or whose keepalives fail past its TTL — makes its
//! holds lost (`lost()` fires) and is never silently replaced under them: later
//! acquires take a new lease. A hold's TTL also applies on this client: a hold
//! nobody renews for its TTL (a leaked guard, a fixed `.lease()`) is deleted,
//! so it frees the lock like on every other backend. The fencing token is the
//! key's create revision, which rises with every write to the cluster.
//! Reentrancy is kept per owner in this client, with the owner's key.
//!
//! Tokens rise as long as the cluster's revision does. An operator who
//! rebuilds the cluster from scratch, or restores it from a snapshot, sets
//! the revision back: restore with `etcdutl snapshot restore
//! --bump-revision <more than the writes since the snapshot>
//! --mark-compacted`, or fence the resources anew (a token from the rebuilt
//! cluster may repeat one handed out before). Keys are used as they are, not
//! escaped: a key `a/b` is the lock `<prefix>a/b/`; a queue ignores the nodes
//! of longer keys under it, so `a` and `a/b` are two locks.
//!
//! # Defaults, restarts and frozen clients
//!
//! - A hold lives in a lease of `min(ceil(TTL), session_ttl)` (30 s by default);
//!   `run` renews and stops its command on that lease.
//! - Leases survive a restart shorter than them
//!   (`tests/faults.rs::a_hold_outlives_a_short_server_restart`), and so does a
//!   job `run` holds with the defaults (the CLI's `tests/outage.rs`); a waiter waits
//!   through a restart (`tests/faults.rs::a_waiter_waits_through_a_server_restart`).
//! - A frozen holder keeps the key until its lease expires
//!   (`tests/faults.rs::a_paused_holder_loses_its_lock_and_its_stale_write`); a
//!   silent server holds a waiter at most a second past its wait
//!   (`tests/faults.rs::a_stalled_server_cannot_hold_a_waiter_past_its_wait`).
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//! use fencelock_core::Locker;
//! use fencelock_etcd::EtcdBackend;
//!
//! # #[tokio::main] async fn main() -> fencelock_core::Result<()> {
//! // `prefix=` (empty) shares locks with `etcdctl lock nightly`.
//! let backend = EtcdBackend::connect("etcd://127.0.0.1:2379?prefix=&session_ttl=10s").await?;
//! let locker = Locker::new(backend);
//! let guard = locker.lock("nightly").wait(Duration::from_secs(30)).acquire().await?;
//! let token = guard.token(); // the key's create revision
//! guard.release().await?;
//! # let _ = token; Ok(()) }
//! ```
#![warn(missing_docs)]

mod cleanup;
mod errors;
mod options;
mod queue;
mod requests;
mod session;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, GetResponse,
    LeaseTimeToLiveOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
    WatchFilterType, WatchOptions, WatchStream,
};
use fencelock_core::backend::{
    Grant, GrantTable, LeaseRef, QueueRole, Released, Renewal, Request, Tokened, async_trait,
    redact_url,
};
use fencelock_core::{
    Backend, Capabilities, Error, FencingToken, HolderInfo, Key, LockInfo, Mode, Result,
};
use tokio::time::Instant;

use cleanup::{Orphan, PendingNode};
use errors::{etcd_err, transient};
pub use options::EtcdOptions;
use queue::{Node, Wait, blocker};
use requests::range;
use session::Session;

const NAME: &str = "etcd";

/// How the `fencelock` facade opens this backend from a URL.
pub const DRIVER: fencelock_core::backend::Driver =
    fencelock_core::driver!(NAME, ["etcd", "etcds"], EtcdBackend::connect);

/// How often this client looks at its leases' keys for the puts of dropped
/// acquires that landed after their key's delete.
const CANCELLED_SWEEP: Duration = Duration::from_secs(1);

/// How long after a dropped acquire the janitor looks for its late put: well
/// past etcd's own request timeout (5 s plus two election timeouts), after
/// which the server has applied or refused the proposal. The name stays
/// reserved for as long as its lease lives.
const CANCELLED_WINDOW: Duration = Duration::from_secs(60);

/// How often this client looks for holds whose TTL ran out unrenewed.
const JANITOR_TICK: Duration = Duration::from_millis(50);

/// A waiter reads its queue again after `FIRST_RECHECK` without a watch event,
/// then after twice as long each time, up to `RECHECK`. etcd registers a watch
/// made while a write is being applied as behind ("unsynced": it computes the
/// start revision before it takes the store's lock) and delivers its events
/// only at its next catch-up pass, up to 100 ms later; measured under
/// contention, about one wait in fifty met that, and the whole queue stalled
/// behind it.
const FIRST_RECHECK: Duration = Duration::from_millis(20);
const RECHECK: Duration = Duration::from_secs(5);

/// Pause between tries of a request that met a transient failure (a leader
/// election, a member going away).
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// Locks in etcd. Clones share one lease.
#[derive(Clone)]
pub struct EtcdBackend {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) client: Client,
    pub(crate) options: EtcdOptions,
    address: String,
    /// One session (lease) per TTL class, by its seconds.
    pub(crate) sessions: Mutex<HashMap<i64, Arc<Session>>>,
    holds: Mutex<GrantTable<Held>>,
    /// Keys this client created and has not yet seen deleted: a name is not
    /// used again before its key is gone.
    names: Mutex<HashSet<String>>,
    /// Keys to delete that could not be deleted yet.
    orphans: Mutex<Vec<String>>,
    /// Names of acquires dropped before their put was answered, with the
    /// lease they were put with: such a put may still land after the drop's
    /// delete (etcd serves a request's stream and a later delete
    /// independently), so these names are never used again and a key of one
    /// found on this client's lease is deleted (the janitor looks every
    /// second, for [`CANCELLED_WINDOW`] or until the lease ends).
    cancelled: Mutex<Vec<(String, i64, Instant)>>,
    /// When the janitor last looked for `cancelled` keys.
    cancelled_swept: Mutex<Option<Instant>>,
    next_name: AtomicU64,
    watch_events: AtomicU64,
}

/// A hold of this client.
struct Held {
    node: String,
    token: i64,
    /// The lease its key was put with, and that lease's session.
    lease: i64,
    session: Arc<Session>,
    holds: u32,
    mode: Mode,
    ttl: Duration,
    /// The hold is deleted if not renewed by then.
    renewed_until: Instant,
}

impl Tokened for Held {
    fn token(&self) -> u64 {
        u64::try_from(self.token).unwrap_or(0)
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl EtcdBackend {
    /// Connects to the cluster an `etcd://[user:pass@]h1:p1,h2:p2[?opts]` URL
    /// names (`etcds://` for TLS; options in [`EtcdOptions`]) and takes the
    /// backend's lease.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a bad URL; [`Error::Connection`] naming the
    /// address if no server answers within the connect timeout.
    pub async fn connect(url: &str) -> Result<EtcdBackend> {
        let parsed = options::parse_url(url)?;
        let address = redact_url(url.split('?').next().unwrap_or(url));
        let mut connect = ConnectOptions::new()
            .with_connect_timeout(parsed.options.connect_timeout)
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            .with_keep_alive_while_idle(true);
        if let Some((user, password)) = parsed.user {
            connect = connect.with_user(user, password);
        }
        if let Some(tls) = &parsed.tls {
            connect = with_tls(connect, tls)?;
        }
        let client = tokio::time::timeout(
            parsed.options.connect_timeout,
            Client::connect(&parsed.endpoints, Some(connect)),
        )
        .await
        .map_err(|_| {
            Error::connection(
                NAME,
                &address,
                "no server answered within the connect timeout",
            )
        })?
        .map_err(|e| etcd_err(e, &address))?;
        let inner = Arc::new(Inner {
            client,
            options: parsed.options,
            address,
            sessions: Mutex::new(HashMap::new()),
            holds: Mutex::new(GrantTable::new()),
            names: Mutex::new(HashSet::new()),
            orphans: Mutex::new(Vec::new()),
            cancelled: Mutex::new(Vec::new()),
            cancelled_swept: Mutex::new(None),
            next_name: AtomicU64::new(0),
            watch_events: AtomicU64::new(0),
        });
        // Fail at connect, not at the first lock, if the server does not
        // answer: the lease of the default TTL class, granted now.
        let default_class = inner.session(
            inner
                .options
                .default_ttl
                .unwrap_or(fencelock_core::DEFAULT_TTL),
        );
        tokio::time::timeout(
            inner.options.connect_timeout,
            inner.live_lease(&default_class),
        )
        .await
        .map_err(|_| {
            Error::connection(
                NAME,
                &inner.address,
                "no server answered within the connect timeout",
            )
        })??;
        tokio::spawn(janitor(Arc::downgrade(&inner)));
        Ok(EtcdBackend { inner })
    }

    /// The options in force.
    pub fn options(&self) -> &EtcdOptions {
        &self.inner.options
    }

    /// The id of the etcd lease new holds of `ttl` attach to (for tools and
    /// tests).
    pub fn lease_id(&self, ttl: Duration) -> i64 {
        self.inner.session(ttl).lease().id
    }

    /// How many watch events woke this client's waiters so far (a herd shows as
    /// many events per release).
    pub fn watch_events(&self) -> u64 {
        self.inner.watch_events.load(Ordering::Relaxed)
    }

    /// The queue of `key`: its etcd keys in create-revision order (holders
    /// first), for tools and tests.
    ///
    /// # Errors
    ///
    /// Connection errors.
    pub async fn queue(&self, key: &Key) -> Result<Vec<String>> {
        let nodes = self
            .inner
            .queue(&self.inner.lock_prefix(key.as_str()))
            .await?;
        Ok(nodes.into_iter().map(|n| n.key).collect())
    }

    /// Deletes every key of `key`'s queue (an operator breaking a lock; the
    /// testkit's "stolen lease").
    ///
    /// # Errors
    ///
    /// Connection errors.
    pub async fn force_release(&self, key: &Key) -> Result<()> {
        for node in self.queue(key).await? {
            self.inner
                .call(|mut c| {
                    let k = node.clone();
                    async move { c.delete(k, None).await }
                })
                .await?;
        }
        Ok(())
    }

    /// A hold this client already has for the request's owner, if any —
    /// checked on the server first: a key that is gone (deleted, or its lease
    /// expired) is not handed back; the hold is forgotten and the lock taken
    /// anew.
    async fn reenter(&self, req: &Request, requested_at: Instant) -> Result<Option<Grant>> {
        let inner = &self.inner;
        let (key, owner) = (&req.key, &req.owner);
        let (node, token, lease) = {
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
            let lease = h.session.lease();
            if h.lease != lease.id {
                // Its lease expired: the watchdog reports it lost; a new hold is made.
                return Ok(None);
            }
            (h.node.clone(), h.token, lease)
        };
        let n = node.clone();
        let resp = inner
            .call(|mut c| {
                let n = n.clone();
                async move { c.get(n, Some(GetOptions::new().with_keys_only())).await }
            })
            .await?;
        let ours = resp.kvs().first().map(|kv| kv.create_revision()) == Some(token);
        let mut holds = lock(&inner.holds);
        let grant = u64::try_from(token).unwrap_or(0);
        if !ours {
            if holds.remove(key, owner, grant).is_some() {
                // The janitor's delete frees the name for reuse.
                lock(&inner.orphans).push(node);
            }
            return Ok(None);
        }
        let Some(h) = holds.get_mut(key, owner, grant) else {
            return Ok(None);
        };
        let Some(ttl) = inner.grant_ttl(req.ttl, &lease, requested_at) else {
            return Err(inner.lease_overdue());
        };
        if req.reentrant {
            h.holds += 1;
        }
        h.renewed_until = h.renewed_until.max(Instant::now() + req.ttl);
        Ok(Some(
            Grant::new(
                Some(FencingToken::new(h.token as u64)),
                ttl,
                h.holds,
                requested_at,
            )
            .with_handle(h.node.clone()),
        ))
    }
}

#[cfg(feature = "tls")]
fn with_tls(connect: ConnectOptions, tls: &options::Tls) -> Result<ConnectOptions> {
    use etcd_client::{Certificate, Identity, TlsOptions};
    let read = |what: &str, path: &str| {
        std::fs::read(path).map_err(|e| Error::config(format!("etcd TLS {what}={path}: {e}")))
    };
    let mut options = TlsOptions::new();
    if let Some(ca) = &tls.ca {
        options = options.ca_certificate(Certificate::from_pem(read("ca", ca)?));
    }
    if let (Some(cert), Some(key)) = (&tls.cert, &tls.key) {
        options = options.identity(Identity::from_pem(read("cert", cert)?, read("key", key)?));
    }
    if let Some(domain) = &tls.domain {
        options = options.domain_name(domain.clone());
    }
    Ok(connect.with_tls(options))
}

#[cfg(not(feature = "tls"))]
fn with_tls(_: ConnectOptions, _: &options::Tls) -> Result<ConnectOptions> {
    Err(Error::config(
        "etcds:// needs TLS support: build fencelock with the `etcd-tls` feature",
    ))
}

async fn janitor(inner: Weak<Inner>) {
    loop {
        tokio::time::sleep(JANITOR_TICK).await;
        let Some(inner) = inner.upgrade() else { return };
        inner.sweep().await;
    }
}

/// The most operations etcd takes in one transaction (its `--max-txn-ops`
/// default; a server set lower refuses the renewals of a client holding more
/// locks than that).
const MAX_TXN_OPS: usize = 128;

#[async_trait]
impl Backend for EtcdBackend {
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
        let session = inner.session(req.ttl);
        let lease = inner.live_lease(&session).await?;
        let lock_prefix = inner.lock_prefix(req.key.as_str());
        let node = inner.reserve_name(&lock_prefix, lease.id);
        let pending = PendingNode {
            inner: Some(inner.clone()),
            key: node.clone(),
            lease: lease.id,
        };
        let permits = match req.mode {
            Mode::Semaphore { permits } => permits,
            _ => 0,
        };
        let sent = Instant::now();
        let queue = inner
            .enqueue(
                &lock_prefix,
                &node,
                lease.id,
                queue::value(req.mode, &req.owner),
            )
            .await?;
        // A key has one permit count while held (the queue read is of the same
        // transaction as the put, so of two racers one sees the other).
        if let Some(other) = queue
            .iter()
            .find(|n| n.key != node && n.kind == QueueRole::Permit && n.permits != permits)
            .filter(|_| matches!(req.mode, Mode::Semaphore { .. }))
        {
            let held = other.permits;
            pending.delete().await;
            return Err(Error::permits_mismatch(req.key.as_str(), held, permits));
        }
        let Some((seen_at, rev)) = inner
            .wait_turn(&lock_prefix, &node, permits, deadline, queue, sent)
            .await?
        else {
            pending.delete().await;
            return Ok(None);
        };
        // The hold lives on the lease its key was put with: if this client gave
        // that lease up while the key waited (keepalives failed), the key dies
        // with it even though a new lease is current now — no grant then.
        // The validity counts from the read that showed it holding, and never
        // outlasts what is known of the lease.
        let now_lease = session.lease();
        let Some(ttl) = (now_lease.id == lease.id)
            .then(|| inner.grant_ttl(req.ttl, &now_lease, seen_at))
            .flatten()
        else {
            pending.delete().await;
            return Err(inner.lease_overdue());
        };
        let lease = now_lease;
        pending.keep();
        lock(&inner.holds).insert(
            &req.key,
            &req.owner,
            Held {
                node: node.clone(),
                token: rev,
                lease: lease.id,
                session: session.clone(),
                holds: 1,
                mode: req.mode,
                ttl: req.ttl,
                renewed_until: Instant::now() + req.ttl,
            },
        );
        Ok(Some(
            Grant::new(Some(FencingToken::new(rev as u64)), ttl, 1, seen_at).with_handle(node),
        ))
    }

    async fn renew(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
        let inner = &self.inner;
        let start = Instant::now();
        let expired = "the etcd lease expired (keepalives failed past its TTL); its keys are gone";
        // Which leases still have a key to check: (node, create revision, and
        // the lease the key lives on, as this client knows it now).
        let checks: Vec<std::result::Result<(String, i64, session::Lease), &str>> = {
            let holds = lock(&inner.holds);
            leases
                .iter()
                .map(|l| match holds.of_lease(l) {
                    None => Err(
                        "this client no longer holds it (released, or its TTL ran out unrenewed)",
                    ),
                    Some(h) => {
                        let lease = h.session.lease();
                        if h.lease != lease.id || !lease.alive {
                            Err(expired)
                        } else {
                            Ok((h.node.clone(), h.token, lease))
                        }
                    }
                })
                .collect()
        };
        let gets: Vec<TxnOp> = checks
            .iter()
            .flatten()
            .map(|(node, _, _)| TxnOp::get(node.as_str(), Some(GetOptions::new().with_keys_only())))
            .collect();
        // etcd refuses a transaction of more than `--max-txn-ops` operations:
        // one transaction per `MAX_TXN_OPS` keys, sent together.
        let answers = futures::future::try_join_all(gets.chunks(MAX_TXN_OPS).map(|chunk| {
            let txn = Txn::new().and_then(chunk.to_vec());
            inner.call(move |mut c| {
                let t = txn.clone();
                async move { c.txn(t).await }
            })
        }))
        .await?;
        let found: Vec<Option<i64>> = answers
            .into_iter()
            .flat_map(|resp| resp.op_responses())
            .map(|r| match r {
                TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.create_revision()),
                _ => None,
            })
            .collect();
        let mut found = found.into_iter();
        let mut out = Vec::with_capacity(leases.len());
        let mut holds = lock(&inner.holds);
        for (l, check) in leases.iter().zip(checks) {
            let reason = match check {
                Err(reason) => reason,
                Ok((_, token, lease)) if found.next().flatten() == Some(token) => {
                    let Some(left) = inner.grant_ttl(Duration::MAX, &lease, start) else {
                        out.push(Renewal::Unknown {
                            reason: "the etcd lease's keepalives are overdue".into(),
                        });
                        continue;
                    };
                    if let Some(h) = holds.of_lease_mut(l) {
                        h.renewed_until = start + h.ttl;
                        out.push(Renewal::Held {
                            ttl: h.ttl.min(left),
                        });
                        continue;
                    }
                    "this client no longer holds it (released meanwhile)"
                }
                Ok(_) => "its key is gone (deleted, or its lease expired)",
            };
            if let Some(token) = l.token
                && let Some(h) = holds.remove(&l.key, &l.owner, token.get())
            {
                lock(&inner.orphans).push(h.node);
            }
            out.push(Renewal::Lost {
                reason: reason.into(),
            });
        }
        Ok(out)
    }

    async fn release(&self, lease: &LeaseRef) -> Result<Released> {
        let inner = &self.inner;
        let not_held = || Error::NotHeld {
            key: lease.key.to_string(),
            owner: lease.owner.to_string(),
        };
        let (node, token) = {
            let mut holds = lock(&inner.holds);
            let h = holds.of_lease_mut(lease).ok_or_else(not_held)?;
            if h.holds > 1 {
                h.holds -= 1;
                return Ok(Released::new(h.holds));
            }
            let grant = h.token();
            let h = holds
                .remove(&lease.key, &lease.owner, grant)
                .ok_or_else(not_held)?;
            (h.node, h.token)
        };
        // The hold is no longer in `holds`: if this future is dropped before
        // the delete is answered, the janitor must delete the key, or the
        // lease's keepalive keeps it holding for good.
        let mut unfinished = Orphan(Some((inner.clone(), node.clone())));
        // Owner-checked: only the key this hold created goes.
        let txn = Txn::new()
            .when([Compare::create_revision(
                node.as_str(),
                CompareOp::Equal,
                token,
            )])
            .and_then([TxnOp::delete(node.as_str(), None)]);
        match inner
            .call(|mut c| {
                let t = txn.clone();
                async move { c.txn(t).await }
            })
            .await
        {
            Ok(resp) => {
                unfinished.0 = None;
                lock(&inner.names).remove(&node);
                if resp.succeeded() {
                    Ok(Released::new(0))
                } else {
                    // Gone already; a later key of the same name is not ours to
                    // delete, and the name may be used again.
                    Err(not_held())
                }
            }
            // The janitor keeps trying (`unfinished` hands it the key); the
            // lease's end deletes it anyway.
            Err(e) => Err(e),
        }
    }

    async fn inspect(&self, key: &Key) -> Result<Option<LockInfo>> {
        let inner = &self.inner;
        let nodes = inner.queue(&inner.lock_prefix(key.as_str())).await?;
        if nodes.is_empty() {
            return Ok(None);
        }
        let holders = holders(inner, &nodes, &mut HashMap::new()).await;
        Ok(Some(LockInfo::new(key.as_str(), holders, None)))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>> {
        let inner = &self.inner;
        let from = format!("{}{prefix}", inner.options.prefix);
        let resp = inner
            .call(|mut c| {
                let f = from.clone();
                async move { c.get(f, Some(range())).await }
            })
            .await?;
        // Group keys by lock: `<prefix><key>/<leaf>`.
        let mut locks: HashMap<String, Vec<Node>> = HashMap::new();
        for kv in resp.kvs() {
            let Ok(full) = std::str::from_utf8(kv.key()) else {
                continue;
            };
            let Some((name, _)) = full
                .strip_prefix(inner.options.prefix.as_str())
                .and_then(|rest| rest.rsplit_once('/'))
            else {
                continue;
            };
            let lock_prefix = inner.lock_prefix(name);
            if let Some(n) = queue::parse(
                &lock_prefix,
                kv.key(),
                kv.value(),
                kv.create_revision(),
                kv.lease(),
            ) {
                locks.entry(name.to_string()).or_default().push(n);
            }
        }
        let mut out = Vec::new();
        let mut leases = HashMap::new();
        for (name, nodes) in locks {
            let holders = holders(inner, &nodes, &mut leases).await;
            if !holders.is_empty() {
                out.push(LockInfo::new(name, holders, None));
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }
}

/// The nodes of a queue that hold, as holder rows. The time left of a hold is
/// its lease's — how long the lock outlives a holder that stops now (`leases`
/// caches it per lease; unknown if the lookup fails) — or, for this client's
/// own holds, its TTL if that ends first.
async fn holders(
    inner: &Inner,
    nodes: &[Node],
    leases: &mut HashMap<i64, Option<Duration>>,
) -> Vec<HolderInfo> {
    let now = Instant::now();
    let local: HashMap<String, (u32, Duration)> = lock(&inner.holds)
        .values()
        .map(|h| {
            (
                h.node.clone(),
                (h.holds, h.renewed_until.saturating_duration_since(now)),
            )
        })
        .collect();
    let mut out = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        if blocker(nodes, i, n.permits).is_some() {
            continue;
        }
        let left = match leases.get(&n.lease) {
            Some(left) => *left,
            None => {
                let left = lease_left(inner, n.lease).await;
                leases.insert(n.lease, left);
                left
            }
        };
        // A hold of this client also ends when its own TTL runs out unrenewed.
        let (holds, left) = match local.get(&n.key) {
            Some(&(holds, own)) => (holds, left.map(|l| l.min(own))),
            None => (1, left),
        };
        out.push(HolderInfo::new(
            n.owner.clone(),
            n.mode(),
            holds,
            Some(FencingToken::new(n.rev as u64)),
            left,
        ));
    }
    out
}

/// What is left of `lease` (etcd counts in whole seconds), if it is alive.
async fn lease_left(inner: &Inner, lease: i64) -> Option<Duration> {
    if lease == 0 {
        return None;
    }
    let resp = inner
        .call(|mut c| async move { c.lease_time_to_live(lease, None).await })
        .await
        .ok()?;
    u64::try_from(resp.ttl()).ok().map(Duration::from_secs)
}

impl std::fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("address", &self.inner.address)
            .field("options", &self.inner.options)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bad_urls_fail_before_any_io() {
        let e = EtcdBackend::connect("etcd://h?colour=red")
            .await
            .unwrap_err();
        assert!(matches!(e, Error::InvalidConfig(_)), "{e}");
    }
}
