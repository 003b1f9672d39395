//! One Redis endpoint (a server or a cluster) and the lock operations on it:
//! the building block of [`RedisBackend`](crate::RedisBackend) (one node) and
//! [`RedlockBackend`](crate::RedlockBackend) (N independent nodes).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fencelock_core::backend::{LeaseRef, Request, redact_url};
use fencelock_core::{Error, FencingToken, HolderInfo, Key, LockInfo, Mode, Result};
use redis::Value;

use crate::conn::{Conn, map_err};
use crate::options::{RedisOptions, Target};
use crate::scripts;
use crate::subs::{GrantSlot, Subscriptions, Watch};

/// Leases renewed per script call (Redisson renews 100 locks per call too).
pub(crate) const RENEW_BATCH: usize = 100;

pub(crate) const NAME: &str = "redis";

/// The Redis keys of one lock.
pub(crate) struct LockKeys {
    pub(crate) hash: String,
    pub(crate) expiry: String,
    pub(crate) fence: String,
    pub(crate) channel: String,
    /// Exclusive waiters in the queue, and when their places lapse.
    pub(crate) queue: String,
    pub(crate) queue_lapse: String,
}

/// What the acquire script said.
pub(crate) enum Attempt {
    /// Held (created by this op, or an existing hold of the owner).
    Granted {
        token: u64,
        holds: u32,
        /// The server's clock when it answered (µs since the epoch).
        server_us: u64,
        /// The hold is the one a release handed to the wait op where it stood:
        /// its grant is the wait op's, not this attempt's.
        by_wait: bool,
    },
    Busy {
        left: Duration,
        server_us: u64,
    },
}

/// One operation's id: unique per call, so that a script that runs twice
/// (a re-sent request) or is undone recognises it (see `scripts`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Op(String);

impl Op {
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

/// Makes operation ids: a random prefix per client plus a counter.
pub(crate) struct OpIds {
    client: String,
    next: AtomicU64,
}

impl OpIds {
    pub(crate) fn new() -> OpIds {
        OpIds {
            client: format!("{:016x}", fastrand::u64(..)),
            next: AtomicU64::new(0),
        }
    }

    pub(crate) fn next(&self) -> Op {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        Op(format!("{}{n:x}", self.client))
    }
}

pub(crate) struct Node {
    pub(crate) conn: Conn,
    /// With `wait_replicas`, grants and their `WAIT` run on a connection of
    /// their own, and renewals and theirs on another: Redis blocks a client
    /// for the whole `WAIT`, which must not hold up the releases on `conn`,
    /// nor a renewal behind other grants' waits.
    grants: Option<Conn>,
    renewals: Option<Conn>,
    subs: Arc<Subscriptions>,
    /// The node's URL without options, password redacted.
    pub(crate) address: String,
    prefix: String,
    /// How long an operation's mark is kept (see `scripts`).
    mark_ms: u64,
    /// How long a release, an undo or a forced release is sent again on
    /// connection trouble (the response timeout).
    patience: Duration,
    ops: OpIds,
}

pub(crate) fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        Value::Double(d) => Some(*d as i64),
        _ => None,
    }
}

pub(crate) fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

pub(crate) fn unexpected(what: &str, v: &impl std::fmt::Debug) -> Error {
    Error::backend(NAME, format!("unexpected reply to {what}: {v:?}"))
}

impl Node {
    /// Connects to `target` and checks that it answers.
    pub(crate) async fn open(url: &str, target: &Target, options: &RedisOptions) -> Result<Node> {
        let address = redact_url(url.split('?').next().unwrap_or(url));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let conn = Conn::open(target, options, tx, &address).await?;
        // Fail at connect, not at the first lock, if the server does not answer.
        conn.query::<String>(&redis::cmd("PING"))
            .await
            .map_err(|e| map_err(e, &address))?;
        // Load the scripts now, so that no lock operation pays a NOSCRIPT
        // round trip (they are loaded again if the server forgets them).
        conn.preload(&scripts::ALL)
            .await
            .map_err(|e| map_err(e, &address))?;
        let (grants, renewals) = if options.wait_replicas > 0 {
            let (tx, _) = tokio::sync::mpsc::unbounded_channel();
            let grants = Conn::open(target, options, tx.clone(), &address).await?;
            (
                Some(grants),
                Some(Conn::open(target, options, tx, &address).await?),
            )
        } else {
            (None, None)
        };
        let ops = OpIds::new();
        let grant_channel = format!("{}grant:{}", options.prefix, ops.client);
        let subs = Subscriptions::start(conn.clone(), rx, grant_channel);
        Ok(Node {
            conn,
            grants,
            renewals,
            subs,
            address,
            prefix: options.prefix.clone(),
            mark_ms: mark_lifetime(options.response_timeout).as_millis() as u64,
            patience: options.response_timeout,
            ops,
        })
    }

    /// The connection grants (and their `WAIT`) go on.
    pub(crate) fn grant_conn(&self) -> &Conn {
        self.grants.as_ref().unwrap_or(&self.conn)
    }

    /// The connection renewals (and their `WAIT`) go on.
    pub(crate) fn renew_conn(&self) -> &Conn {
        self.renewals.as_ref().unwrap_or(&self.conn)
    }

    /// A new operation id.
    pub(crate) fn op(&self) -> Op {
        self.ops.next()
    }

    /// The name of `op`'s mark.
    fn mark(&self, k: &LockKeys, op: &Op) -> String {
        format!("{}:op:{}", k.hash, op.as_str())
    }

    /// A mark for an op on the user's key `resource`, in its cluster slot, or
    /// `None` where no name is sure to share it (a name with a `}` but no
    /// hash tag of its own).
    pub(crate) fn mark_beside(&self, resource: &str) -> Option<String> {
        let op = self.op();
        let tagged = resource.find('{').is_some_and(|open| {
            resource[open + 1..]
                .find('}')
                .is_some_and(|close| close > 0)
        });
        if tagged {
            Some(format!("{resource}:op:{}", op.as_str()))
        } else if !resource.contains('}') {
            Some(format!("{{{resource}}}:op:{}", op.as_str()))
        } else {
            None
        }
    }

    /// How long an op's mark is kept.
    pub(crate) fn mark_ms(&self) -> u64 {
        self.mark_ms
    }

    pub(crate) fn keys(&self, key: &Key) -> LockKeys {
        let hash = format!("{}{{{}}}", self.prefix, escape(key.as_str()));
        LockKeys {
            expiry: format!("{hash}:exp"),
            fence: format!("{hash}:fence"),
            channel: format!("{hash}:ch"),
            queue: format!("{hash}:q"),
            queue_lapse: format!("{hash}:qe"),
            hash,
        }
    }

    /// Sends again for no longer than `patience` (Redlock: its rounds are
    /// bounded by the instance timeout, and an instance that does not answer
    /// must count as failed, not slow).
    pub(crate) fn with_patience(mut self, patience: Duration) -> Node {
        self.patience = patience;
        self
    }

    pub(crate) fn err(&self, e: redis::RedisError) -> Error {
        map_err(e, &self.address)
    }

    /// Runs `send` (a call whose second run acts as its first: a marked op)
    /// again on connection trouble, with backoff, until [`Node::patience`]
    /// has passed since the first send. On a cluster, redis-rs re-sends at
    /// once a few times and then gives up with the last node's answer (often
    /// a `MOVED` from a node it fell back to), so a primary that is out of
    /// reach for a moment would fail the call within milliseconds.
    async fn resend<T, F, Fut>(&self, mut send: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let start = std::time::Instant::now();
        let mut pause = Duration::from_millis(50);
        loop {
            match send().await {
                Err(e) if is_transient(&e) && start.elapsed() + pause < self.patience => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
                other => return other.map_err(|e| self.err(e)),
            }
        }
    }

    /// One run of the acquire script as operation `op`; `proposal` floors a
    /// new token (0: none). A refused exclusive request stands in the key's
    /// queue for `queue` (zero: it does not), and with `wait` (the wait's op;
    /// the caller listens on the grant channel) can be handed the lock where
    /// it stands. With `behind`, an existing hold of the owner whose token is
    /// below the key's fence answers a new token (Redlock; see
    /// `scripts::ACQUIRE`).
    pub(crate) async fn attempt(
        &self,
        req: &Request,
        proposal: u64,
        queue: Duration,
        op: &Op,
        behind: bool,
        wait: Option<&Op>,
    ) -> Result<Attempt> {
        let k = self.keys(&req.key);
        let permits = match req.mode {
            Mode::Semaphore { permits } => permits,
            _ => 0,
        };
        let reply: Vec<Value> = self
            .grant_conn()
            .invoke(
                scripts::ACQUIRE
                    .key(&k.hash)
                    .key(&k.expiry)
                    .key(&k.fence)
                    .key(&k.queue)
                    .key(&k.queue_lapse)
                    .key(self.mark(&k, op))
                    .arg(req.owner.as_str())
                    .arg(req.mode.as_label())
                    .arg(req.ttl.as_millis() as u64)
                    .arg(u8::from(req.reentrant))
                    .arg(permits)
                    .arg(proposal)
                    .arg(queue.as_millis() as u64)
                    .arg(op.as_str())
                    .arg(self.mark_ms)
                    .arg(u8::from(behind))
                    .arg(wait.map_or("", Op::as_str))
                    .arg(if wait.is_some() {
                        self.subs.grant_channel()
                    } else {
                        ""
                    }),
            )
            .await
            .map_err(|e| self.err(e))?;
        let num = |i: usize| reply.get(i).and_then(int);
        match (num(0), reply.get(1)) {
            (Some(1), Some(token)) => match (int(token), num(2), num(4)) {
                (Some(token), Some(holds), Some(at)) => Ok(Attempt::Granted {
                    token: token as u64,
                    holds: holds as u32,
                    server_us: at.max(0) as u64,
                    by_wait: num(5) == Some(1),
                }),
                _ => Err(unexpected("acquire", &reply)),
            },
            (Some(0), Some(left)) => Ok(Attempt::Busy {
                left: Duration::from_millis(int(left).unwrap_or(0).max(0) as u64),
                server_us: num(2).unwrap_or(0).max(0) as u64,
            }),
            (Some(-2), Some(held)) => {
                let held = text(held).unwrap_or_default();
                let n = held.strip_prefix("semaphore:").unwrap_or(&held).to_string();
                Err(Error::permits_mismatch(req.key.as_str(), n, permits))
            }
            (Some(-1), Some(held)) => Err(Error::mode_mismatch(
                req.owner.as_str(),
                req.key.as_str(),
                text(held).unwrap_or_default(),
                req.mode,
            )),
            _ => Err(unexpected("acquire", &reply)),
        }
    }

    /// Renews `leases` in one script; `true` per lease whose own grant (its
    /// handle, the grant's op) is still held.
    /// Renews `leases`: whether each is still held. A script call per
    /// [`RENEW_BATCH`] leases, sent together on the multiplexed connection
    /// (one round trip), so that no single script holds the server for long
    /// (Redis runs a script alone; one for 10,000 leases ran ~100 ms).
    ///
    /// # Errors
    ///
    /// When a call is not answered (none of the answers is then used).
    pub(crate) async fn renew(&self, leases: &[LeaseRef]) -> Result<Vec<bool>> {
        let batches =
            futures::future::try_join_all(leases.chunks(RENEW_BATCH).map(|b| self.renew_batch(b)))
                .await?;
        Ok(batches.into_iter().flatten().collect())
    }

    async fn renew_batch(&self, leases: &[LeaseRef]) -> Result<Vec<bool>> {
        let mut inv = scripts::RENEW.call();
        for lease in leases {
            let k = self.keys(&lease.key);
            inv = inv
                .key(k.hash)
                .key(k.expiry)
                .arg(lease.owner.as_str())
                .arg(lease.ttl.as_millis() as u64)
                .arg(&lease.handle);
        }
        // With `wait_replicas`, on the renewals' connection: the `WAIT`
        // after it covers that connection's writes.
        let reply: Vec<i64> = self
            .renew_conn()
            .invoke(inv)
            .await
            .map_err(|e| self.err(e))?;
        if reply.len() != leases.len() {
            return Err(unexpected("renew", &reply));
        }
        Ok(reply.into_iter().map(|ok| ok == 1).collect())
    }

    /// Cluster: renews `leases`, whose keys all live on the primary at
    /// `host:port` (by the slot map), with one pipeline of one script call
    /// per lease (a script may touch one slot only): whether each is still
    /// held, or `None` where the node gave no such answer (its slot moved, it
    /// lacks the script) — to be renewed on the redirecting path.
    ///
    /// # Errors
    ///
    /// When the node does not answer the pipeline.
    pub(crate) async fn renew_at(
        &self,
        leases: &[&LeaseRef],
        host: &str,
        port: u16,
    ) -> Result<Vec<Option<bool>>> {
        let cmds = leases
            .iter()
            .map(|lease| {
                let k = self.keys(&lease.key);
                scripts::RENEW
                    .call()
                    .key(k.hash)
                    .key(k.expiry)
                    .arg(lease.owner.as_str())
                    .arg(lease.ttl.as_millis() as u64)
                    .arg(&lease.handle)
                    .evalsha()
            })
            .collect();
        let replies = self
            .conn
            .pipeline_at(cmds, host, port)
            .await
            .map_err(|e| self.err(e))?;
        if replies.len() != leases.len() {
            return Err(unexpected("renew", &replies));
        }
        Ok(replies
            .into_iter()
            .map(|reply| match reply {
                // The script's reply for one lease: a one-element array.
                redis::Value::Array(v) if v.len() == 1 => match v[0] {
                    redis::Value::Int(ok) => Some(ok == 1),
                    _ => None,
                },
                _ => None,
            })
            .collect())
    }

    /// Runs the release script as operation `op`: returns the holds left (-1:
    /// not held), with `next` the token of the handoff (0: none; `proposal`
    /// floors it), and the server's clock (µs). A retry after a lost reply runs the same op,
    /// whose kept answer it gets back, so it cannot release twice, and a
    /// release that never reached the server before reports -1 if the owner
    /// no longer holds the key.
    pub(crate) async fn release(
        &self,
        lease: &LeaseRef,
        next: Option<&Request>,
        proposal: u64,
        op: &Op,
    ) -> Result<(i64, u64, u64)> {
        let k = self.keys(&lease.key);
        let mark = self.mark(&k, op);
        let (next_owner, next_ttl) = match next {
            Some(n) if n.mode == Mode::Exclusive && n.key == lease.key => {
                (n.owner.as_str(), n.ttl.as_millis() as u64)
            }
            _ => ("", 0),
        };
        // A handoff is a grant: on the grants' connection, where its `WAIT` goes.
        let conn = if next_owner.is_empty() {
            &self.conn
        } else {
            self.grant_conn()
        };
        let send = || {
            conn.invoke(
                scripts::RELEASE
                    .key(&k.hash)
                    .key(&k.expiry)
                    .key(&mark)
                    .key(&k.fence)
                    .key(&k.queue)
                    .key(&k.queue_lapse)
                    .arg(lease.owner.as_str())
                    .arg(&k.channel)
                    .arg(self.mark_ms)
                    .arg(next_owner)
                    .arg(next_ttl)
                    .arg(proposal)
                    .arg(op.as_str())
                    .arg(&lease.handle),
            )
        };
        if next_owner.is_empty() {
            // The reply may have been lost after the script ran: run the same
            // op again.
            self.resend(send).await
        } else {
            // A handoff is not sent again: its next owner waits on.
            send().await.map_err(|e| self.err(e))
        }
    }

    /// Undoes acquire op `op` of `owner` on `key` (or the handoff to `owner` of
    /// release op `op`): takes back exactly the hold that op created or added,
    /// and makes sure it grants nothing should it arrive later. Returns whether
    /// a hold was taken back.
    pub(crate) async fn undo(&self, key: &Key, owner: &str, op: &Op) -> Result<bool> {
        let k = self.keys(key);
        let mark = self.mark(&k, op);
        // Undoing twice is undoing once: sent again on connection trouble.
        let undone: i64 = self
            .resend(|| {
                self.conn.invoke(
                    scripts::UNDO
                        .key(&k.hash)
                        .key(&k.expiry)
                        .key(&mark)
                        .key(&k.fence)
                        .key(&k.queue)
                        .key(&k.queue_lapse)
                        .arg(owner)
                        .arg(&k.channel)
                        .arg(self.mark_ms)
                        .arg(op.as_str()),
                )
            })
            .await?;
        Ok(undone == 1)
    }

    /// Takes `owner` out of `key`'s queue of waiters. With `wait` (the op of
    /// a wait that could be handed the lock where it stood), marks that wait
    /// given up and takes back a hold handed to it, passing the lock on.
    /// Returns whether such a hold was taken back. Sent again on connection
    /// trouble (a second run does nothing more).
    pub(crate) async fn leave_queue(
        &self,
        key: &Key,
        owner: &str,
        wait: Option<&Op>,
    ) -> Result<bool> {
        let k = self.keys(key);
        let took: i64 = self
            .resend(|| {
                self.conn.invoke(
                    scripts::LEAVE_QUEUE
                        .key(&k.queue)
                        .key(&k.queue_lapse)
                        .key(&k.hash)
                        .key(&k.fence)
                        .arg(owner)
                        .arg(&k.channel)
                        .arg(wait.map_or("", Op::as_str))
                        .arg(self.mark_ms),
                )
            })
            .await?;
        Ok(took == 1)
    }

    /// Deletes every hold of `key` and wakes its waiters; the fence stays.
    pub(crate) async fn force_release(&self, key: &Key) -> Result<()> {
        let k = self.keys(key);
        let mark = self.mark(&k, &self.op());
        // The op's mark makes a second run a no-op (it never deletes the
        // holds of an owner that came after the first).
        let _: i64 = self
            .resend(|| {
                self.conn.invoke(
                    scripts::FORCE_RELEASE
                        .key(&k.hash)
                        .key(&k.expiry)
                        .key(&mark)
                        .arg(&k.channel)
                        .arg(self.mark_ms),
                )
            })
            .await?;
        Ok(())
    }

    /// Raises the fence of `key` to at least `token`, and records `token` in
    /// `owner`'s hold if it is still that of grant `op` (so that a reentrant
    /// acquire gets it back).
    pub(crate) async fn raise_fence(
        &self,
        key: &Key,
        owner: &str,
        op: &Op,
        token: u64,
    ) -> Result<()> {
        let k = self.keys(key);
        let _: i64 = self
            .conn
            .invoke(
                scripts::RAISE_FENCE
                    .key(&k.hash)
                    .key(&k.fence)
                    .arg(owner)
                    .arg(token)
                    .arg(op.as_str()),
            )
            .await
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Subscribes to the lock's channel (for waiters).
    pub(crate) async fn watch(&self, key: &Key) -> Result<Watch> {
        let channel = self.keys(key).channel;
        self.subs.watch(&channel).await.map_err(|e| self.err(e))
    }

    /// Watches on the lock's channel and, with `wait_op`, the grant channel
    /// (registering the wait), if they are subscribed already (a recent wait
    /// here): no round trip. `None` if one is not.
    pub(crate) async fn watches_if_subscribed(
        &self,
        key: &Key,
        wait_op: Option<&Op>,
    ) -> Option<(Watch, Option<(Watch, GrantSlot)>)> {
        let lock = self
            .subs
            .watch_if_subscribed(&self.keys(key).channel)
            .await?;
        let grants = match wait_op {
            Some(w) => Some((
                self.subs
                    .watch_if_subscribed(self.subs.grant_channel())
                    .await?,
                self.subs.expect_grant(w.as_str()),
            )),
            None => None,
        };
        Some((lock, grants))
    }

    /// Subscribes to the client's grant channel and registers wait `wait_op`,
    /// so that a grant handed to it where it stands in a queue reaches it.
    pub(crate) async fn expect_grant(&self, wait_op: &Op) -> Result<(Watch, GrantSlot)> {
        let watch = self
            .subs
            .watch(self.subs.grant_channel())
            .await
            .map_err(|e| self.err(e))?;
        Ok((watch, self.subs.expect_grant(wait_op.as_str())))
    }

    pub(crate) async fn inspect(&self, key: &Key) -> Result<Option<LockInfo>> {
        let k = self.keys(key);
        let reply: Vec<Value> = self
            .conn
            .invoke(scripts::INSPECT.key(&k.hash).key(&k.expiry).key(&k.fence))
            .await
            .map_err(|e| self.err(e))?;
        parse_inspect(key.as_str(), &reply)
    }

    /// Keys (not names of Redis keys) of every lock under `prefix`.
    pub(crate) async fn keys_under(&self, prefix: &str) -> Result<Vec<String>> {
        let glob = |s: &str| -> String {
            s.chars()
                .flat_map(|c| {
                    let esc = matches!(c, '*' | '?' | '[' | ']' | '\\').then_some('\\');
                    esc.into_iter().chain(std::iter::once(c))
                })
                .collect()
        };
        let pattern = format!("{}{{{}*}}", glob(&self.prefix), glob(&escape(prefix)));
        let names = self
            .conn
            .scan_keys(&pattern)
            .await
            .map_err(|e| self.err(e))?;
        let start = self.prefix.len() + 1;
        let mut keys: Vec<String> = names
            .into_iter()
            .filter(|n| n.ends_with('}') && n.len() > start)
            .filter_map(|n| unescape(&n[start..n.len() - 1]))
            .collect();
        keys.sort();
        keys.dedup();
        Ok(keys)
    }
}

/// How long an op's mark is kept, for `response_timeout` T: longer than one
/// call can go on sending. `Node::resend` starts sends for up to T; the last
/// one's redis-rs cluster client may then send four times, each waiting up
/// to T, with up to three waits of its own between (1.28 s each, its
/// minimum retry wait): at most 5 T + 3.9 s after the first send. Six T
/// plus 10 s covers that for any T.
fn mark_lifetime(response_timeout: Duration) -> Duration {
    response_timeout * 6 + Duration::from_secs(10)
}

/// Connection trouble, after which a request may or may not have run, or a
/// cluster's answer that it did not run it here (`MOVED`, `ASK`, `TRYAGAIN`,
/// `CLUSTERDOWN`: redis-rs gave up following them).
fn is_transient(e: &redis::RedisError) -> bool {
    e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_cluster_error()
}

/// A key as it stands inside the hash tag: `%` and `}` percent-encoded, so
/// that no key can close the tag early (`{}x}` would hash every key of the
/// lock apart on a cluster).
fn escape(key: &str) -> std::borrow::Cow<'_, str> {
    if !key.contains(['%', '}']) {
        return key.into();
    }
    key.replace('%', "%25").replace('}', "%7D").into()
}

/// The inverse of [`escape`]; `None` for a name fencelock did not write.
fn unescape(name: &str) -> Option<String> {
    let mut out = String::with_capacity(name.len());
    let mut rest = name;
    while let Some(i) = rest.find('%') {
        out.push_str(&rest[..i]);
        match rest.get(i..i + 3) {
            Some("%25") => out.push('%'),
            Some("%7D") => out.push('}'),
            _ => return None,
        }
        rest = &rest[i + 3..];
    }
    out.push_str(rest);
    Some(out)
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
            let mut parts = items.first().map(|v| v.split('\t')).into_iter().flatten();
            if let (Some(owner), Some(holds), Some(token)) =
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
                let mut fields = value.split(' ');
                let (Some(exp), Some(holds), Some(token)) =
                    (expiries.get(*owner), fields.next(), fields.next())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaped_keys_keep_the_hash_tag_whole_and_round_trip() {
        for key in ["plain", "}x", "{}x}", "a%7Db", "%", "}", "{a}b{c}", "100%}"] {
            let e = escape(key);
            assert!(!e.contains('}'), "{key:?} → {e:?}");
            assert_eq!(unescape(&e).as_deref(), Some(key));
        }
        // A prefix of a key escapes to a prefix of the key's escape (listing).
        assert!(escape("a}b%c").starts_with(&*escape("a}b")));
        assert_ne!(escape("a%7D"), escape("a}"));
        assert_eq!(unescape("bad%zz"), None);
    }
}
