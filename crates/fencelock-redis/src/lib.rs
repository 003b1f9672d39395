//! The Redis backend of fencelock: Redisson-grade locks on one Redis
//! (`redis://`, `rediss://`) or a Redis Cluster (`redis+cluster://h1:p1,h2:p2`).
//!
//! # Algorithm
//!
//! Every operation is one Lua script, loaded once and called with `EVALSHA`
//! (reloaded on `NOSCRIPT`), so there is no read-then-write race anywhere:
//!
//! - **acquire** (one round trip): purge expired holders, then grant exclusive,
//!   shared or semaphore holds in one script; the same owner re-enters (hold
//!   count + 1, same token) or, for a default per-guard owner, gets its hold back
//!   unchanged (a retried request). A new grant takes a fencing token; a refusal
//!   returns the time left of the first holder to expire, which bounds the wait.
//! - **renew**: all leases of the watchdog's tick in one script (one per key on a
//!   cluster, sent concurrently); a hold that is gone is reported lost, never
//!   re-created.
//! - **release** (one round trip): owner-checked, decrements the hold count, and
//!   when waiters may proceed PUBLISHes on the lock's channel. Each release has a
//!   request id; the script stores its answer briefly under that id (Redisson's
//!   unlock latch), so a release retried after a lost reply cannot take a second
//!   hold away.
//!
//! Holders of shared and semaphore locks expire one by one (a sorted set of
//! expiry times), so a crashed reader's or permit holder's share comes back after
//! its TTL. All keys of one lock carry the hash tag `{key}`, so a lock lives in one
//! cluster slot. See the `scripts` module docs for the key layout.
//!
//! # Fencing
//!
//! Tokens are `max(last token + 1, server time in µs)`: they rise with every grant,
//! and keep rising even when Redis loses the counter (restarted without
//! persistence, failed over to a replica that missed the last writes), as long
//! as the server clock does not step back across that event.
//!
//! # Waiting
//!
//! Waiters of one [`Locker`](fencelock_core::Locker) line up locally per key. A
//! release by a guard of the same locker hands the lock straight to the first
//! waiter inside the release script ([`Backend::release_to`]: new owner, new
//! token, one round trip), at most 16 times in a row so that other processes get
//! their turn. While the holder is elsewhere, the head subscribes to the lock's
//! channel on the backend's own RESP3 connection and re-checks when a message
//! arrives, or at the latest when the holder's time runs out (capped at 5 s), so
//! a lost message costs a bounded delay, never a hang.
//!
//! # Examples
//!
//! ```no_run
//! use std::time::Duration;
//! use fencelock_core::Locker;
//! use fencelock_redis::RedisBackend;
//!
//! # #[tokio::main] async fn main() -> fencelock_core::Result<()> {
//! let backend = RedisBackend::connect("redis://127.0.0.1:6379/?prefix=app:").await?;
//! let locker = Locker::new(backend.clone());
//! let guard = locker.lock("orders/42").wait(Duration::from_secs(5)).acquire().await?;
//! let token = guard.token().expect("redis fences");
//! // A fenced write to a resource kept in Redis: refused if a newer holder wrote.
//! assert!(backend.fenced_set("{orders/42}:state", token, "paid").await?);
//! guard.release().await?;
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

mod conn;
mod options;
mod scripts;
mod subs;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fencelock_core::{
    Backend, Capabilities, Error, FencingToken, Grant, HolderInfo, Key, LeaseRef, LockInfo, Mode,
    Released, Renewal, Request, Result, async_trait, redact_url,
};
use redis::Value;
use tokio::time::Instant;

use conn::{Conn, map_err};
pub use options::RedisOptions;
use options::Target;
use subs::Subscriptions;

const NAME: &str = "redis";

/// The longest a waiter sleeps without re-checking, whatever the holder's TTL.
const MAX_RECHECK: Duration = Duration::from_secs(5);

/// Locks in Redis. Clones share one connection.
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

struct Inner {
    conn: Conn,
    subs: Arc<Subscriptions>,
    options: RedisOptions,
    address: String,
    /// Makes release request ids unique: a random id per backend plus a counter.
    client_id: String,
    releases: AtomicU64,
}

/// The Redis keys of one lock.
struct LockKeys {
    hash: String,
    expiry: String,
    fence: String,
    channel: String,
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        Value::Double(d) => Some(*d as i64),
        _ => None,
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn unexpected(what: &str, v: &impl std::fmt::Debug) -> Error {
    Error::backend(NAME, format!("unexpected reply to {what}: {v:?}"))
}

/// What the acquire script said.
enum Attempt {
    Granted { token: u64, holds: u32 },
    Busy { left: Duration },
}

impl RedisBackend {
    /// Connects to the server or cluster a URL names, with the options in its query.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a bad URL or option; [`Error::Connection`]
    /// naming the address (password redacted) if it cannot connect.
    pub async fn connect(url: &str) -> Result<RedisBackend> {
        let (target, options) = options::parse_url(url)?;
        RedisBackend::open(url, target, options).await
    }

    /// Connects with `options` instead of those of the URL's query.
    ///
    /// # Errors
    ///
    /// As [`RedisBackend::connect`].
    pub async fn connect_with(url: &str, options: RedisOptions) -> Result<RedisBackend> {
        let (target, _) = options::parse_url(url)?;
        options.validate(matches!(target, Target::Cluster(_)))?;
        RedisBackend::open(url, target, options).await
    }

    async fn open(url: &str, target: Target, options: RedisOptions) -> Result<RedisBackend> {
        let address = redact_url(url.split('?').next().unwrap_or(url));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let conn = Conn::open(&target, &options, tx, &address).await?;
        // Fail at connect, not at the first lock, if the server does not answer.
        conn.query::<String>(&redis::cmd("PING"))
            .await
            .map_err(|e| map_err(e, &address))?;
        let subs = Subscriptions::start(conn.clone(), rx);
        Ok(RedisBackend {
            inner: Arc::new(Inner {
                conn,
                subs,
                options,
                address,
                client_id: uuid::Uuid::new_v4().simple().to_string(),
                releases: AtomicU64::new(0),
            }),
        })
    }

    /// The options in force.
    pub fn options(&self) -> &RedisOptions {
        &self.inner.options
    }

    fn keys(&self, key: &Key) -> LockKeys {
        let hash = format!("{}{{{}}}", self.inner.options.prefix, key.as_str());
        LockKeys {
            expiry: format!("{hash}:exp"),
            fence: format!("{hash}:fence"),
            channel: format!("{hash}:ch"),
            hash,
        }
    }

    fn err(&self, e: redis::RedisError) -> Error {
        map_err(e, &self.inner.address)
    }

    async fn attempt(&self, req: &Request) -> Result<Attempt> {
        let k = self.keys(&req.key);
        let permits = match req.mode {
            Mode::Semaphore { permits } => permits,
            _ => 0,
        };
        let reply: Vec<Value> = self
            .inner
            .conn
            .invoke(
                scripts::ACQUIRE
                    .key(&k.hash)
                    .key(&k.expiry)
                    .key(&k.fence)
                    .arg(req.owner.as_str())
                    .arg(req.mode.as_label())
                    .arg(req.ttl.as_millis() as u64)
                    .arg(u8::from(req.reentrant))
                    .arg(permits),
            )
            .await
            .map_err(|e| self.err(e))?;
        match (
            reply.first().and_then(int),
            reply.get(1),
            reply.get(2).and_then(int),
        ) {
            (Some(1), Some(token), Some(holds)) => Ok(Attempt::Granted {
                token: int(token).ok_or_else(|| unexpected("acquire", &reply))? as u64,
                holds: holds as u32,
            }),
            (Some(0), Some(left), _) => Ok(Attempt::Busy {
                left: Duration::from_millis(int(left).unwrap_or(0).max(0) as u64),
            }),
            (Some(-1), Some(held), _) => Err(Error::config(format!(
                "owner {:?} already holds {:?} as {}; a reentrant acquire must ask for the same mode (asked {})",
                req.owner.as_str(),
                req.key.as_str(),
                text(held).unwrap_or_default(),
                req.mode
            ))),
            _ => Err(unexpected("acquire", &reply)),
        }
    }

    /// `WAIT`s for the configured replicas; undoes the grant if too few answer.
    async fn confirm_replicas(&self, req: &Request, grant: &Grant) -> Result<()> {
        let want = self.inner.options.wait_replicas;
        if want == 0 {
            return Ok(());
        }
        let acked: i64 = self
            .inner
            .conn
            .query(
                redis::cmd("WAIT")
                    .arg(want)
                    .arg(self.inner.options.wait_timeout.as_millis() as u64),
            )
            .await
            .map_err(|e| self.err(e))?;
        if acked >= i64::from(want) {
            return Ok(());
        }
        let _ = self.release(&LeaseRef::new(req, grant)).await;
        Err(Error::backend(
            NAME,
            format!(
                "only {acked} of {want} replicas acknowledged the grant within {:?}; it was undone (lower wait_replicas or check the replicas)",
                self.inner.options.wait_timeout
            ),
        ))
    }

    /// Deletes every hold of `key` at once (an operator breaking a lock; the
    /// testkit's "stolen lease") and wakes its waiters. The fence stays.
    ///
    /// # Errors
    ///
    /// Connection and server errors.
    pub async fn force_release(&self, key: &Key) -> Result<()> {
        let k = self.keys(key);
        let _: i64 = self
            .inner
            .conn
            .invoke(
                scripts::FORCE_RELEASE
                    .key(&k.hash)
                    .key(&k.expiry)
                    .arg(&k.channel),
            )
            .await
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// A fenced write to a resource kept in Redis: stores `value` in the hash
    /// `resource` (fields `value` and `token`) only if no larger token has written
    /// it before, and records `token`. Returns whether the write happened.
    ///
    /// A holder that was paused past its lease carries an older token than the
    /// holder after it, so its late write is refused. On a cluster the resource is
    /// one key, so any slot works.
    ///
    /// # Errors
    ///
    /// Connection and server errors.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use fencelock_core::FencingToken;
    /// # async fn f(backend: fencelock_redis::RedisBackend) -> fencelock_core::Result<()> {
    /// assert!(backend.fenced_set("stock:42", FencingToken::new(8), "99").await?);
    /// // A paused holder with token 7 wakes up and writes: refused.
    /// assert!(!backend.fenced_set("stock:42", FencingToken::new(7), "100").await?);
    /// assert_eq!(backend.fenced_get("stock:42").await?, Some(("99".into(), FencingToken::new(8))));
    /// # Ok(()) }
    /// ```
    pub async fn fenced_set(
        &self,
        resource: &str,
        token: FencingToken,
        value: &str,
    ) -> Result<bool> {
        let written: i64 = self
            .inner
            .conn
            .invoke(
                scripts::FENCED_SET
                    .key(resource)
                    .arg(token.get())
                    .arg(value),
            )
            .await
            .map_err(|e| self.err(e))?;
        Ok(written == 1)
    }

    /// Reads a resource written by [`RedisBackend::fenced_set`]: its value and the
    /// token of its last write.
    ///
    /// # Errors
    ///
    /// Connection and server errors.
    pub async fn fenced_get(&self, resource: &str) -> Result<Option<(String, FencingToken)>> {
        let (value, token): (Option<String>, Option<u64>) = self
            .inner
            .conn
            .query(redis::cmd("HMGET").arg(resource).arg("value").arg("token"))
            .await
            .map_err(|e| self.err(e))?;
        Ok(value.zip(token).map(|(v, t)| (v, FencingToken::new(t))))
    }

    /// Runs the release script; with `next`, an exclusive lock that is let go
    /// passes to `next` in the same step and its grant is returned.
    async fn release_script(
        &self,
        lease: &LeaseRef,
        next: Option<&Request>,
    ) -> Result<(Released, Option<Grant>)> {
        let k = self.keys(&lease.key);
        let seq = self.inner.releases.fetch_add(1, Ordering::Relaxed);
        let latch = format!("{}:latch:{}:{seq}", k.hash, self.inner.client_id);
        let latch_ms = (self.inner.options.response_timeout * 4).as_millis() as u64;
        let (next_owner, next_ttl) = match next {
            Some(n) if n.mode == Mode::Exclusive && n.key == lease.key => {
                (n.owner.as_str(), n.ttl.as_millis() as u64)
            }
            _ => ("", 0),
        };
        let mut attempt = 0u64;
        let requested_at = Instant::now();
        let (left, handed): (i64, u64) = loop {
            attempt += 1;
            let r = self
                .inner
                .conn
                .invoke(
                    scripts::RELEASE
                        .key(&k.hash)
                        .key(&k.expiry)
                        .key(&latch)
                        .key(&k.fence)
                        .arg(lease.owner.as_str())
                        .arg(&k.channel)
                        .arg(latch_ms)
                        .arg(u8::from(attempt > 1))
                        .arg(next_owner)
                        .arg(next_ttl),
                )
                .await;
            match r {
                Ok(v) => break v,
                // The reply may have been lost after the script ran: retry with the
                // same latch, which returns the first answer instead of releasing twice.
                // (A handoff is not retried: its next owner simply waits on.)
                Err(e)
                    if attempt < 3
                        && next_owner.is_empty()
                        && (e.is_io_error() || e.is_timeout() || e.is_connection_dropped()) =>
                {
                    tokio::time::sleep(Duration::from_millis(50 * attempt)).await;
                }
                Err(e) => return Err(self.err(e)),
            }
        };
        if left < 0 {
            return Err(Error::NotHeld {
                key: lease.key.to_string(),
                owner: lease.owner.to_string(),
            });
        }
        let grant = match next {
            Some(n) if handed > 0 => Some(Grant::new(
                Some(FencingToken::new(handed)),
                n.ttl,
                1,
                requested_at,
            )),
            _ => None,
        };
        Ok((Released::new(left as u32), grant))
    }

    async fn renew_single_script(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
        let mut inv = scripts::RENEW.prepare_invoke();
        for lease in leases {
            let k = self.keys(&lease.key);
            inv.key(k.hash).key(k.expiry);
            inv.arg(lease.owner.as_str())
                .arg(lease.ttl.as_millis() as u64);
        }
        let reply: Vec<i64> = self
            .inner
            .conn
            .invoke(&inv)
            .await
            .map_err(|e| self.err(e))?;
        if reply.len() != leases.len() {
            return Err(unexpected("renew", &reply));
        }
        Ok(leases
            .iter()
            .zip(reply)
            .map(|(lease, ok)| {
                if ok == 1 {
                    Renewal::Held { ttl: lease.ttl }
                } else {
                    Renewal::Lost {
                        reason: "the hold is gone from Redis (expired, deleted, or the server lost its data)".into(),
                    }
                }
            })
            .collect())
    }
}

#[async_trait]
impl Backend for RedisBackend {
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
            .with_cross_process(true)
    }

    fn address(&self) -> String {
        self.inner.address.clone()
    }

    fn default_ttl(&self) -> Option<Duration> {
        self.inner.options.default_ttl
    }

    async fn try_acquire(&self, req: &Request) -> Result<Option<Grant>> {
        let requested_at = Instant::now();
        match self.attempt(req).await? {
            Attempt::Granted { token, holds } => {
                let grant =
                    Grant::new(Some(FencingToken::new(token)), req.ttl, holds, requested_at);
                self.confirm_replicas(req, &grant).await?;
                Ok(Some(grant))
            }
            Attempt::Busy { .. } => Ok(None),
        }
    }

    async fn acquire(&self, req: &Request, deadline: Option<Instant>) -> Result<Option<Grant>> {
        let granted = |token: u64, holds: u32, at: Instant| {
            Grant::new(Some(FencingToken::new(token)), req.ttl, holds, at)
        };
        // Uncontended: one round trip, no subscription.
        let requested_at = Instant::now();
        if let Attempt::Granted { token, holds } = self.attempt(req).await? {
            let grant = granted(token, holds, requested_at);
            self.confirm_replicas(req, &grant).await?;
            return Ok(Some(grant));
        }
        let channel = self.keys(&req.key).channel;
        let watch = self
            .inner
            .subs
            .watch(&channel)
            .await
            .map_err(|e| self.err(e))?;
        loop {
            // Listen before asking, so a release between the answer and the wait
            // is not missed.
            let notified = watch.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let requested_at = Instant::now();
            let left = match self.attempt(req).await? {
                Attempt::Granted { token, holds } => {
                    let grant = granted(token, holds, requested_at);
                    self.confirm_replicas(req, &grant).await?;
                    return Ok(Some(grant));
                }
                Attempt::Busy { left } => left,
            };
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(None);
            }
            let mut until = Instant::now() + left.clamp(Duration::from_millis(1), MAX_RECHECK);
            if let Some(d) = deadline {
                until = until.min(d);
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(until) => {}
            }
        }
    }

    async fn renew(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        if !self.inner.conn.is_cluster() {
            return self.renew_single_script(leases).await;
        }
        // A cluster script may only touch one slot: one script per lease, concurrently.
        let calls = leases
            .iter()
            .map(|l| self.renew_single_script(std::slice::from_ref(l)));
        let replies = futures::future::join_all(calls).await;
        let mut out = Vec::with_capacity(leases.len());
        for r in replies {
            out.extend(r?);
        }
        Ok(out)
    }

    async fn release(&self, lease: &LeaseRef) -> Result<Released> {
        Ok(self.release_script(lease, None).await?.0)
    }

    async fn release_to(
        &self,
        lease: &LeaseRef,
        next: &Request,
    ) -> Result<(Released, Option<Grant>)> {
        self.release_script(lease, Some(next)).await
    }

    async fn inspect(&self, key: &Key) -> Result<Option<LockInfo>> {
        let k = self.keys(key);
        let reply: Vec<Value> = self
            .inner
            .conn
            .invoke(scripts::INSPECT.key(&k.hash).key(&k.expiry).key(&k.fence))
            .await
            .map_err(|e| self.err(e))?;
        parse_inspect(key.as_str(), &reply)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>> {
        let escaped: String = prefix
            .chars()
            .flat_map(|c| {
                let esc = matches!(c, '*' | '?' | '[' | ']' | '\\').then_some('\\');
                esc.into_iter().chain(std::iter::once(c))
            })
            .collect();
        let pattern = format!("{}{{{escaped}*}}", self.inner.options.prefix);
        let mut cmd = redis::cmd("KEYS");
        cmd.arg(&pattern);
        let names: Vec<String> = self
            .inner
            .conn
            .query_all_primaries(cmd)
            .await
            .map_err(|e| self.err(e))?;
        let start = self.inner.options.prefix.len() + 1;
        let mut keys: Vec<String> = names
            .into_iter()
            .filter(|n| n.ends_with('}') && n.len() > start)
            .map(|n| n[start..n.len() - 1].to_string())
            .collect();
        keys.sort();
        keys.dedup();
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

fn parse_inspect(key: &str, reply: &[Value]) -> Result<Option<LockInfo>> {
    let [now, fence, kind, fields, expiries, pttl] = reply else {
        return Err(unexpected("inspect", &reply));
    };
    let now = int(now).ok_or_else(|| unexpected("inspect", &reply))?;
    let fence = int(fence).map(|f| FencingToken::new(f as u64));
    let Value::Array(fields) = fields else {
        return Err(unexpected("inspect", &reply));
    };
    let items: Vec<String> = fields.iter().filter_map(text).collect();
    let mut holders = Vec::new();
    match text(kind).as_deref() {
        Some("string") => {
            let left = int(pttl).unwrap_or(0).max(0) as u64;
            let mut parts = items
                .first()
                .map(|v| v.rsplitn(3, '\t'))
                .into_iter()
                .flatten();
            if let (Some(token), Some(holds), Some(owner)) =
                (parts.next(), parts.next(), parts.next())
            {
                holders.push(HolderInfo::new(
                    owner,
                    Mode::Exclusive,
                    holds.parse().unwrap_or(1),
                    token.parse().ok().map(FencingToken::new),
                    Some(Duration::from_millis(left)),
                ));
            }
        }
        Some("hash") => {
            let pairs: Vec<(&str, &str)> = items
                .chunks(2)
                .filter_map(|c| Some((c.first()?.as_str(), c.get(1)?.as_str())))
                .collect();
            let mode = pairs
                .iter()
                .find(|(f, _)| *f == "\tm")
                .and_then(|(_, m)| Mode::parse(m).ok())
                .unwrap_or(Mode::Shared);
            let expiries: std::collections::HashMap<String, i64> = match expiries {
                Value::Array(e) => e
                    .chunks(2)
                    .filter_map(|c| {
                        Some((
                            text(c.first()?)?,
                            text(c.get(1)?)?.parse::<f64>().ok()? as i64,
                        ))
                    })
                    .collect(),
                _ => Default::default(),
            };
            for (owner, value) in pairs.iter().filter(|(f, _)| !f.starts_with('\t')) {
                let (Some(exp), Some((holds, token))) =
                    (expiries.get(*owner), value.split_once(' '))
                else {
                    continue;
                };
                holders.push(HolderInfo::new(
                    *owner,
                    mode,
                    holds.parse().unwrap_or(1),
                    token.parse().ok().map(FencingToken::new),
                    Some(Duration::from_millis((exp - now).max(0) as u64)),
                ));
            }
        }
        _ => {}
    }
    if holders.is_empty() && fence.is_none() {
        return Ok(None);
    }
    Ok(Some(LockInfo::new(key, holders, fence)))
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("address", &self.inner.address)
            .field("options", &self.inner.options)
            .finish()
    }
}
