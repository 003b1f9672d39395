//! memcached backend of fencelock: exclusive locks with TTL, reentrancy and
//! owner-checked release, for fleets that already run memcached.
//!
//! # Algorithm
//!
//! A held lock is one item, `<prefix><key>` (hashed when the key is not a valid
//! memcached name), whose value names the owner and its hold count.
//!
//! - **acquire**: `add` with expiry (meta `ms … ME T<secs>`): only one client
//!   creates the item. If it exists and belongs to the same owner, a reentrant
//!   request adds a hold with a CAS-checked write.
//! - **renew**: read the item with its CAS value, check the owner, rewrite it
//!   with a new expiry only if the CAS value did not change (`ms … C<cas>`).
//!   Always read first: memcached counts CAS values from 1 again after a
//!   restart, so a remembered CAS value could match another owner's item.
//! - **release**: read, check the owner, then delete only if the CAS value did
//!   not change (`md … C<cas>`), or write back one hold fewer. A client can
//!   never delete a lock another owner took after its own expired.
//! - **waiting**: jittered backoff, bounded by the holder's remaining TTL; a
//!   release in the same process wakes its waiters at once.
//!
//! memcached counts expiry in whole seconds on a clock that ticks once a
//! second, so an item lives for its TTL rounded up **plus one second** (an item
//! set just before a tick would otherwise expire up to a second early); the
//! client's own deadline stays the TTL asked for.
//!
//! # No fencing tokens
//!
//! memcached is a cache: it may evict a held item under memory pressure, and a
//! restart empties it, so another client can acquire while the first still
//! believes it holds the lock, and nothing the server keeps survives to order
//! the two. A counter kept in memcached (`incr`) could restart from zero or be
//! evicted too, so a token from it could repeat — a made-up guarantee. This
//! backend therefore gives **no fencing token** (`Capabilities::fencing` is
//! false, `Guard::token()` is `None`). A lost item is noticed at the next
//! renewal and fires `lost()`. Use it for efficiency locks (avoiding duplicate
//! work), not for correctness; use Redis, etcd, ZooKeeper or a database when a
//! stale holder must be fenced off.
//!
//! Shared and semaphore modes are not offered: one item cannot keep several
//! holders with their own expiry atomically.
//!
//! # Listing
//!
//! `list` (`fencelock list`) walks every item with memcached's LRU crawler
//! (`lru_crawler metadump`), slow on a big cache. The crawler serves one walk
//! at a time; a list that finds it busy asks again for up to 10 s. A walk skips
//! an item another client touches at that instant (a renewal, a read: other
//! lists read what they find), so a list walks again until a walk finds
//! nothing new (at most 5 walks). Lists that overlap others can still miss a
//! held key now and then; `status KEY` reads the key itself.
//!
//! # Defaults, restarts and frozen clients
//!
//! - A hold gets the TTL asked for (30 s by default); its item lives one
//!   second longer than the TTL rounded up.
//! - A restart loses every hold; `lost()` fires at the next renewal
//!   (`tests/faults.rs::a_restart_during_a_hold_fires_lost_at_the_next_renewal`).
//! - A frozen holder keeps the key for its TTL
//!   (`tests/faults.rs::a_killed_holder_frees_the_lock_after_its_ttl` for a dead
//!   one). A frozen or silent server fails each request after `timeout=` (5 s)
//!   and holds a waiter at most a second past its wait
//!   (`tests/faults.rs::a_stalled_server_cannot_hold_a_waiter_past_its_wait`).
//!
//! # Examples
//!
//! ```
//! use fencelock_core::Locker;
//! use fencelock_memcached::MemcachedBackend;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock_core::Result<()> {
//! let locker = Locker::new(MemcachedBackend::connect("memcached://127.0.0.1:11211").await?);
//! let guard = locker.lock("doc-example/nightly-report").acquire().await?;
//! assert_eq!(guard.token(), None); // memcached gives no fencing token
//! guard.release().await?;
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

mod item;
mod options;
mod pipeline;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_memcached::{Client, MetaProtocol, Status};
use fencelock_core::backend::{
    Backoff, Grant, LeaseRef, Released, Renewal, Request, TryOutcome, async_trait, wait_for_grant,
};
use fencelock_core::{Backend, Capabilities, Error, HolderInfo, Key, LockInfo, Mode, Result};
use tokio::sync::Notify;
use tokio::time::Instant;

pub use options::MemcachedOptions;

use crate::item::{Holder, item_name};

const NAME: &str = "memcached";

/// How the `fencelock` facade opens this backend from a URL.
pub const DRIVER: fencelock_core::backend::Driver =
    fencelock_core::driver!(NAME, ["memcached"], MemcachedBackend::connect);

/// Leases renewed per batch: two round trips (a pipelined read, a pipeline
/// of writes) per this many, one per 100 leases.
const RENEW_BATCH: usize = 200;

/// The longest relative expiry memcached accepts (larger numbers are Unix times).
const MAX_EXPIRY_SECS: u64 = 30 * 24 * 3600;

/// Locks in one memcached server (`memcached://host:port`). Clones share the
/// connections.
#[derive(Clone)]
pub struct MemcachedBackend {
    inner: Arc<Inner>,
}

struct Inner {
    addr: String,
    options: MemcachedOptions,
    idle: Mutex<Vec<Client>>,
    /// The connection for batched renewals, while none uses it.
    pipe: Mutex<Option<pipeline::Pipe>>,
    /// Wakes this process's waiters when a hold is released here.
    released: Notify,
}

/// An item as read: its holder (if fencelock wrote it), CAS value and the
/// seconds it has left.
struct Read {
    holder: Option<Holder>,
    cas: u64,
    secs_left: i64,
}

/// The expiry to give an item for a hold of `ttl` (see the crate docs).
fn expiry_secs(ttl: Duration) -> Result<u64> {
    let secs = ttl.as_millis().div_ceil(1000) as u64 + 1;
    if secs > MAX_EXPIRY_SECS {
        return Err(Error::config(format!(
            "a TTL of {} needs an item expiry of {secs} s (the TTL in whole seconds, plus one), more than memcached's relative expiry of at most 30 days ({MAX_EXPIRY_SECS} s) allows; use a TTL of at most {}",
            humantime::format_duration(ttl),
            humantime::format_duration(Duration::from_secs(MAX_EXPIRY_SECS - 1))
        )));
    }
    Ok(secs)
}

impl MemcachedBackend {
    /// Connects to the server a `memcached://host:port[?prefix=&ttl=&pool=]` URL names.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a bad URL or option; [`Error::Connection`] if
    /// the server does not answer.
    pub async fn connect(url: &str) -> Result<MemcachedBackend> {
        let (addr, options) = options::parse_url(url)?;
        let backend = MemcachedBackend {
            inner: Arc::new(Inner {
                addr,
                options,
                idle: Mutex::new(Vec::new()),
                pipe: Mutex::new(None),
                released: Notify::new(),
            }),
        };
        backend.with_client(async |c| c.version().await).await?;
        Ok(backend)
    }

    /// The options in force.
    pub fn options(&self) -> &MemcachedOptions {
        &self.inner.options
    }

    fn err(&self, e: async_memcached::Error) -> Error {
        let err = match &e {
            async_memcached::Error::Protocol(s) => Error::backend(NAME, format!("{s:?}")),
            async_memcached::Error::ParseError(k) => {
                Error::backend(NAME, format!("unreadable reply: {k:?}"))
            }
            other => Error::connection(NAME, &self.inner.addr, format!("{other:?}")),
        };
        err.with_source(e)
    }

    /// A connect or request that got no answer within the timeout.
    fn no_answer(&self, what: &str) -> Error {
        Error::connection(
            NAME,
            &self.inner.addr,
            format!(
                "no answer to a {what} within {} (timeout=); the server may be frozen or overloaded",
                humantime::format_duration(self.inner.options.timeout)
            ),
        )
    }

    async fn client(&self) -> Result<Client> {
        let idle = self
            .inner
            .idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop();
        match idle {
            Some(c) if !c.is_closed() => Ok(c),
            _ => tokio::time::timeout(
                self.inner.options.timeout,
                Client::new(format!("tcp://{}", self.inner.addr)),
            )
            .await
            .map_err(|_| self.no_answer("connect"))?
            .map_err(|e| self.err(e)),
        }
    }

    /// Keeps a connection that finished its operations cleanly; one that failed
    /// is dropped by the caller instead.
    fn put_back(&self, c: Client) {
        let mut idle = self.inner.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < self.inner.options.pool {
            idle.push(c);
        }
    }

    fn name(&self, key: &Key) -> String {
        item_name(&self.inner.options.prefix, key.as_str())
    }

    /// Runs `op` on a pooled connection, returning it to the pool after success.
    async fn with_client<T>(
        &self,
        op: impl AsyncFnOnce(&mut Client) -> std::result::Result<T, async_memcached::Error>,
    ) -> Result<T> {
        let mut c = self.client().await?;
        // On a timeout the connection is dropped: its reply may still come.
        let out = tokio::time::timeout(self.inner.options.timeout, op(&mut c))
            .await
            .map_err(|_| self.no_answer("request"))?
            .map_err(|e| self.err(e))?;
        self.put_back(c);
        Ok(out)
    }

    /// Removes the lock item of `key` whoever holds it (an operator breaking a
    /// lock; the testkit's "stolen lease").
    ///
    /// # Errors
    ///
    /// Connection errors.
    pub async fn force_release(&self, key: &Key) -> Result<()> {
        let name = self.name(key);
        self.with_client(
            async |c| match c.meta_delete(&name, false, None, None).await {
                Ok(_) | Err(async_memcached::Error::Protocol(Status::NotFound)) => Ok(()),
                Err(e) => Err(e),
            },
        )
        .await?;
        self.inner.released.notify_waiters();
        Ok(())
    }

    async fn read(&self, name: &str) -> Result<Option<Read>> {
        let got = self
            .with_client(async |c| c.meta_get(name, false, None, Some(&["v", "c", "t"])).await)
            .await?;
        Ok(got.map(|v| Read {
            holder: v.data.as_deref().and_then(Holder::decode),
            cas: v.cas.unwrap_or(0),
            secs_left: v.ttl_remaining.unwrap_or(-1),
        }))
    }

    /// `add`: true if this call created the item.
    async fn add(&self, name: &str, holder: &Holder, secs: u64) -> Result<bool> {
        let value = holder.encode();
        let t = format!("T{secs}");
        let stored = self
            .with_client(async |c| {
                match c
                    .meta_set(
                        name,
                        value.as_str(),
                        false,
                        None,
                        Some(&["ME", t.as_str(), "c"]),
                    )
                    .await
                {
                    Ok(v) => Ok(stored_cas(v)),
                    Err(async_memcached::Error::Protocol(Status::NotStored | Status::Exists)) => {
                        Ok(None)
                    }
                    Err(e) => Err(e),
                }
            })
            .await?;
        Ok(stored.is_some())
    }

    /// Writes `holder` with expiry `secs` if the item's CAS value is still `cas`.
    async fn replace(&self, name: &str, holder: &Holder, cas: u64, secs: u64) -> Result<bool> {
        let value = holder.encode();
        let (c_flag, t) = (format!("C{cas}"), format!("T{secs}"));
        self.with_client(async |c| {
            match c
                .meta_set(
                    name,
                    value.as_str(),
                    false,
                    None,
                    Some(&[c_flag.as_str(), t.as_str(), "c"]),
                )
                .await
            {
                Ok(v) => Ok(stored_cas(v)),
                Err(async_memcached::Error::Protocol(
                    Status::Exists | Status::NotFound | Status::NotStored,
                )) => Ok(None),
                Err(e) => Err(e),
            }
        })
        .await
        .map(|stored| stored.is_some())
    }

    /// Deletes the item if its CAS value is still `cas`.
    async fn delete(&self, name: &str, cas: u64) -> Result<bool> {
        let c_flag = format!("C{cas}");
        self.with_client(async |c| {
            match c
                .meta_delete(name, false, None, Some(&[c_flag.as_str()]))
                .await
            {
                Ok(_) => Ok(true),
                Err(async_memcached::Error::Protocol(Status::Exists | Status::NotFound)) => {
                    Ok(false)
                }
                Err(e) => Err(e),
            }
        })
        .await
    }

    /// One attempt: the grant, or the seconds the holder has left.
    async fn attempt(&self, req: &Request) -> Result<std::result::Result<Grant, Duration>> {
        if req.mode != Mode::Exclusive {
            return Err(Error::unsupported(
                NAME,
                format!("{} locks (only exclusive)", req.mode),
            ));
        }
        let name = self.name(&req.key);
        let secs = expiry_secs(req.ttl)?;
        loop {
            let requested_at = Instant::now();
            let mine = Holder {
                holds: 1,
                secs,
                owner: req.owner.to_string(),
                key: req.key.to_string(),
                grant: Holder::new_grant(),
            };
            if self.add(&name, &mine, secs).await? {
                return Ok(Ok(
                    Grant::new(None, req.ttl, 1, requested_at).with_handle(mine.grant)
                ));
            }
            let Some(now) = self.read(&name).await? else {
                continue; // expired or released meanwhile: try again
            };
            match now.holder {
                Some(h) if h.owner == req.owner.as_str() => {
                    if !req.reentrant {
                        return Ok(Ok(
                            Grant::new(None, req.ttl, h.holds, requested_at).with_handle(h.grant)
                        ));
                    }
                    let more = h.with_holds(h.holds + 1).at_least(secs);
                    let keep = more.secs.max(u64::try_from(now.secs_left).unwrap_or(0));
                    if self.replace(&name, &more, now.cas, keep).await? {
                        return Ok(Ok(Grant::new(None, req.ttl, more.holds, requested_at)
                            .with_handle(more.grant)));
                    }
                }
                _ => {
                    let left = Duration::from_secs(u64::try_from(now.secs_left).unwrap_or(1));
                    return Ok(Err(left));
                }
            }
        }
    }

    /// Renews up to [`RENEW_BATCH`] leases in two round trips: one pipelined
    /// read of their items, then one pipeline of CAS-checked writes (see
    /// [`pipeline`]). A lease whose write lost a race (its item changed
    /// between the read and the write: a reentrant acquire, another lease of
    /// the same item in this batch) is renewed again on its own.
    async fn renew_batch(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
        let names: Vec<String> = leases.iter().map(|l| self.name(&l.key)).collect();
        let mut unique: Vec<&str> = names.iter().map(String::as_str).collect();
        unique.sort_unstable();
        unique.dedup();
        let got = self
            .with_client(async |c| c.meta_get_multi(&unique, Some(&["v", "c", "t"])).await)
            .await?;
        let items: std::collections::HashMap<Vec<u8>, Read> = got
            .into_iter()
            .filter_map(|v| {
                let key = v.key.clone()?;
                Some((
                    key,
                    Read {
                        holder: v.data.as_deref().and_then(Holder::decode),
                        cas: v.cas.unwrap_or(0),
                        secs_left: v.ttl_remaining.unwrap_or(-1),
                    },
                ))
            })
            .collect();
        let mut out: Vec<Option<Renewal>> = vec![None; leases.len()];
        let mut writes = Vec::new();
        let mut written = Vec::new();
        for (i, (lease, name)) in leases.iter().zip(&names).enumerate() {
            let Some(read) = items.get(name.as_bytes()) else {
                out[i] = Some(Renewal::Lost {
                    reason: "the item is gone (expired, evicted, or the server restarted)".into(),
                });
                continue;
            };
            let Some(h) = read
                .holder
                .as_ref()
                .filter(|h| h.is_grant(lease.owner.as_str(), &lease.handle))
            else {
                out[i] = Some(Renewal::Lost {
                    reason: "another grant holds the item now".into(),
                });
                continue;
            };
            let secs = expiry_secs(lease.ttl)?;
            writes.push(pipeline::CasWrite {
                name: name.clone(),
                value: h.encode(),
                cas: read.cas,
                secs: h.secs.max(secs),
            });
            written.push(i);
        }
        let stored = self.cas_write_all(&writes, leases).await?;
        for (i, stored) in written.into_iter().zip(stored) {
            out[i] = Some(if stored {
                Renewal::Held { ttl: leases[i].ttl }
            } else {
                self.renew_one(&leases[i]).await?
            });
        }
        Ok(out.into_iter().flatten().collect())
    }

    /// Sends `writes` on the batch connection (made anew after a failure or
    /// a cancelled batch), bounded by a third of the shortest TTL.
    async fn cas_write_all(
        &self,
        writes: &[pipeline::CasWrite],
        leases: &[LeaseRef],
    ) -> Result<Vec<bool>> {
        if writes.is_empty() {
            return Ok(Vec::new());
        }
        let io_err = |e: std::io::Error| {
            Error::connection(NAME, &self.inner.addr, format!("{e}")).with_source(e)
        };
        let idle = self
            .inner
            .pipe
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let mut pipe = match idle {
            Some(p) => p,
            None => tokio::time::timeout(
                self.inner.options.timeout,
                pipeline::Pipe::connect(&self.inner.addr),
            )
            .await
            .map_err(|_| self.no_answer("connect"))?
            .map_err(io_err)?,
        };
        let limit = leases.iter().map(|l| l.ttl).min().unwrap_or_default() / 3;
        let stored = pipe.cas_write_all(writes, limit).await.map_err(io_err)?;
        *self.inner.pipe.lock().unwrap_or_else(|p| p.into_inner()) = Some(pipe);
        Ok(stored)
    }

    async fn renew_one(&self, lease: &LeaseRef) -> Result<Renewal> {
        let name = self.name(&lease.key);
        let secs = expiry_secs(lease.ttl)?;
        // Read first, then a CAS-checked write: memcached counts CAS values
        // from 1 again after a restart, so a CAS value this client remembered
        // could match the item another owner added since.
        loop {
            let Some(now) = self.read(&name).await? else {
                return Ok(Renewal::Lost {
                    reason: "the item is gone (expired, evicted, or the server restarted)".into(),
                });
            };
            let Some(h) = now
                .holder
                .filter(|h| h.is_grant(lease.owner.as_str(), &lease.handle))
            else {
                return Ok(Renewal::Lost {
                    reason: "another grant holds the item now".into(),
                });
            };
            let keep = h.secs.max(secs);
            if self.replace(&name, &h, now.cas, keep).await? {
                return Ok(Renewal::Held { ttl: lease.ttl });
            }
        }
    }
}

#[async_trait]
impl Backend for MemcachedBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::NONE
            .with_reentrant(true)
            .with_ttl(true)
            .with_inspect(true)
            .with_cross_process(true)
    }

    fn address(&self) -> String {
        format!("memcached://{}", self.inner.addr)
    }

    fn default_ttl(&self) -> Option<Duration> {
        self.inner.options.default_ttl
    }

    async fn try_acquire(&self, req: &Request) -> Result<Option<Grant>> {
        Ok(self.attempt(req).await?.ok())
    }

    async fn acquire(&self, req: &Request, deadline: Option<Instant>) -> Result<Option<Grant>> {
        let backoff = Backoff::new(Duration::from_millis(2), Duration::from_millis(100));
        wait_for_grant(deadline, backoff, Some(&self.inner.released), |_| async {
            Ok(match self.attempt(req).await? {
                Ok(grant) => TryOutcome::Granted(grant),
                Err(left) => TryOutcome::Busy {
                    retry_in: Some(left.max(Duration::from_millis(1))),
                },
            })
        })
        .await
    }

    async fn renew(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
        let mut out = Vec::with_capacity(leases.len());
        for batch in leases.chunks(RENEW_BATCH) {
            out.extend(self.renew_batch(batch).await?);
        }
        Ok(out)
    }

    async fn release(&self, lease: &LeaseRef) -> Result<Released> {
        let name = self.name(&lease.key);
        let not_held = || Error::NotHeld {
            key: lease.key.to_string(),
            owner: lease.owner.to_string(),
        };
        // Read first (see `renew_one`).
        loop {
            let now = self.read(&name).await?.ok_or_else(not_held)?;
            let h = now
                .holder
                .filter(|h| h.is_grant(lease.owner.as_str(), &lease.handle))
                .ok_or_else(not_held)?;
            if h.holds > 1 {
                let fewer = h.with_holds(h.holds - 1);
                let keep = u64::try_from(now.secs_left).unwrap_or(1).max(1);
                if self.replace(&name, &fewer, now.cas, keep).await? {
                    return Ok(Released::new(fewer.holds));
                }
            } else if self.delete(&name, now.cas).await? {
                self.inner.released.notify_waiters();
                return Ok(Released::new(0));
            }
        }
    }

    async fn inspect(&self, key: &Key) -> Result<Option<LockInfo>> {
        let Some(now) = self.read(&self.name(key)).await? else {
            return Ok(None);
        };
        let holders = now
            .holder
            .map(|h| {
                let left = u64::try_from(now.secs_left).ok().map(Duration::from_secs);
                vec![HolderInfo::new(
                    h.owner,
                    Mode::Exclusive,
                    h.holds,
                    None,
                    left,
                )]
            })
            .unwrap_or_default();
        Ok(Some(LockInfo::new(key.as_str(), holders, None)))
    }

    /// Walks every item of the server (see *Listing* in the crate docs).
    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>> {
        let ours = self.inner.options.prefix.as_bytes();
        let busy_until = Instant::now() + CRAWLER_BUSY;
        let mut names = std::collections::BTreeSet::new();
        let mut walks = 0;
        loop {
            let walked = self
                .with_client(async |c| {
                    let mut names = Vec::new();
                    let mut dump = c.dump_keys().await?;
                    while let Some(entry) = dump.next().await {
                        match entry {
                            // The crawler prints names URI-encoded.
                            Ok(entry) => names.push(percent_decode(&entry.key)),
                            Err(e) if crawler_busy(&e) => return Ok(None),
                            Err(e) => return Err(e),
                        }
                    }
                    Ok(Some(names))
                })
                .await?;
            match walked {
                Some(walked) => {
                    walks += 1;
                    let before = names.len();
                    names.extend(walked.into_iter().filter(|n| n.starts_with(ours)));
                    // Done when a walk after the first found nothing new.
                    if walks == MAX_WALKS || (walks > 1 && names.len() == before) {
                        break;
                    }
                }
                None if Instant::now() >= busy_until => {
                    return Err(Error::backend(
                        NAME,
                        format!(
                            "memcached's LRU crawler stayed busy with other walks for {CRAWLER_BUSY:?}"
                        ),
                    ));
                }
                None => {}
            }
            // Out of step with other lists' walks.
            tokio::time::sleep(Duration::from_millis(50 + fastrand::u64(..150))).await;
        }
        let mut out = Vec::new();
        for name in names {
            let Ok(name) = String::from_utf8(name) else {
                continue;
            };
            let Some(now) = self.read(&name).await? else {
                continue;
            };
            let Some(h) = now.holder.filter(|h| h.key.starts_with(prefix)) else {
                continue;
            };
            let left = u64::try_from(now.secs_left).ok().map(Duration::from_secs);
            let key = h.key.clone();
            let holder = HolderInfo::new(h.owner, Mode::Exclusive, h.holds, None, left);
            out.push(LockInfo::new(key, vec![holder], None));
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }
}

/// How long `list` asks again while the LRU crawler serves other walks.
const CRAWLER_BUSY: Duration = Duration::from_secs(10);

/// The most walks `list` joins: it walks until a walk finds nothing new, as
/// a walk skips items other clients touch meanwhile.
const MAX_WALKS: usize = 5;

/// True if the crawler refused a walk because it is serving another.
fn crawler_busy(e: &async_memcached::Error) -> bool {
    matches!(e, async_memcached::Error::Protocol(Status::Error(async_memcached::ErrorKind::Generic(m))) if m.starts_with("BUSY"))
}

/// The outcome of a meta set asked to return the CAS value: `None` if not
/// stored (with return flags a refusal comes back as data with its status),
/// else the new CAS value if the server sent it.
fn stored_cas(v: Option<async_memcached::MetaValue>) -> Option<Option<u64>> {
    match v {
        None => Some(None),
        Some(v) => match v.status {
            None | Some(Status::Stored) => Some(v.cas),
            Some(_) => None,
        },
    }
}

/// Decodes `%XX` escapes.
fn percent_decode(raw: &[u8]) -> Vec<u8> {
    let hex = |b: u8| (b as char).to_digit(16);
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        if raw[i] == b'%'
            && i + 2 < raw.len()
            && let (Some(h), Some(l)) = (hex(raw[i + 1]), hex(raw[i + 2]))
        {
            out.push((h * 16 + l) as u8);
            i += 3;
        } else {
            out.push(raw[i]);
            i += 1;
        }
    }
    out
}

impl std::fmt::Debug for MemcachedBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemcachedBackend")
            .field("addr", &self.inner.addr)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn percent_decoding() {
        assert_eq!(
            super::percent_decode(b"fencelock%3Aa%2Fb"),
            b"fencelock:a/b"
        );
        assert_eq!(super::percent_decode(b"50%"), b"50%");
        assert_eq!(super::percent_decode(b"%zz"), b"%zz");
    }
}
