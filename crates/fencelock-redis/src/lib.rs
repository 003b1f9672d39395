//! The Redis backend of fencelock: Redisson-grade locks on one Redis
//! (`redis://`, `rediss://`), a Redis Cluster (`redis+cluster://h1:p1,h2:p2`)
//! or the master of a service that Redis Sentinels watch
//! (`redis+sentinel://s1:p1,s2:p2,s3:p3/SERVICE[/db]`).
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
//! - **release** (one round trip): takes off the lease's own hold (the owner's
//!   value lists one grant per hold, each known by the op that made it), and
//!   when waiters may proceed PUBLISHes on the lock's channel.
//!
//! Every call carries an operation id, so that a script that runs twice (a
//! request re-sent after its reply was lost, by redis-rs's cluster client or
//! by fencelock's own retry of a release) acts once, and an acquire given up
//! by its caller is undone exactly (see the `scripts` module).
//!
//! Holders of shared and semaphore locks expire one by one (a sorted set of
//! expiry times), so a crashed reader's or permit holder's share comes back after
//! its TTL. All keys of one lock carry one hash tag (the key, with `%` and `}`
//! percent-encoded), so a lock lives in one cluster slot.
//!
//! # What is guaranteed, and under which assumptions
//!
//! On one Redis (`redis://`, or the master a Sentinel service names) and per
//! key on a Redis Cluster (a key lives on one primary):
//!
//! - **Exclusion.** While a guard [is valid](fencelock_core::Guard::is_valid),
//!   no other owner is granted the key (no writer beside readers, at most N
//!   permit holders), provided (1) Redis keeps its data while the hold lives:
//!   it is not restarted without persistence and does not fail over to a
//!   replica that missed the grant (`wait_replicas=N` makes a grant, handoffs
//!   included, and a renewal count only once N replicas acknowledged it,
//!   which narrows that window but does not close it: `WAIT` is not
//!   consensus; grants and renewals then run, each with their `WAIT`, on a
//!   connection of their own, so a stalled replica holds them up but no
//!   release, and no renewal waits behind grants); (2) the server's
//!   clock, which expires keys, does not jump forward; (3) it runs no faster
//!   than the client's monotonic clock by more than the drift allowance (1 %
//!   of the TTL + 2 ms); (4) the client machine is not suspended (see
//!   [`Lease::is_valid`](fencelock_core::Lease::is_valid)).
//! - **Fencing tokens** strictly increase per key across grants. While Redis
//!   keeps its data this needs nothing (a counter). When it loses them
//!   (restarted empty, failed over to a replica that missed the last grants),
//!   tokens are floored at the server's clock in µs, so they keep rising as
//!   long as the clock of the server that takes over is not behind the one
//!   that handed out the last token (a restarted server: its clock did not
//!   step back; a failover: the replica's clock is not behind the old
//!   primary's by more than the failover took). Use the token to fence writes
//!   ([`RedisBackend::fenced_set`], or `… WHERE last_token < $token`): that is
//!   what keeps the resource safe when (1)–(4) do not hold.
//! - **Renewal** only extends a hold (two holds of one owner with different
//!   TTLs share one expiry; the shorter one never cuts the longer). A hold that
//!   is gone is reported lost and never re-created. On a cluster a stalled
//!   primary costs only the leases it keeps.
//! - **Release** touches only the lease's own hold: never another owner's,
//!   nor another reentrant hold of the same owner. A release is sent again on
//!   connection trouble, with backoff, for up to the response timeout (a
//!   handoff is not: its waiter waits on); a release
//!   sent again after its reply was lost reports what the first run did; one that never reached
//!   Redis reports [`NotHeld`](fencelock_core::Error::NotHeld) if the hold has
//!   gone to another owner meanwhile.
//! - **Cancellation.** An acquire dropped while its request is in flight is
//!   undone: the hold it made (if any) is taken back by a spawned task, and a
//!   request that reaches Redis after its undo grants nothing. (If Redis cannot
//!   be reached for the undo, the hold expires after its TTL.)
//!
//! The marks that make scripts act once cost one short-lived key per release
//! (about 80 bytes, kept for six response timeouts plus 10 s,
//! 40 s by default).
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
//! Across processes, exclusive waiters stand in a queue kept in Redis (a sorted
//! set by arrival): while anyone waits in it, a free lock goes only to its first
//! live waiter, so a process that releases cannot take the lock straight back
//! ahead of a waiter elsewhere (a try, which never waits, is refused too); the
//! handoffs within a process above come first, up to 16 in a row. A release
//! that lets the lock go hands it to that first waiter where it stands: the
//! release script makes it the holder (new token, its TTL) and publishes the
//! grant on the waiter's client channel, so the waiter starts on receipt,
//! without an acquire round trip; its lease counts from the send time of the
//! request the grant answered. A lost message costs at most the waiter's next
//! asking. A waiter keeps its place by asking again at least every second; one
//! that times out or is cancelled leaves the queue, taking back a hold handed
//! to it meanwhile and passing it on; the place of one that died lapses after
//! 3 s, and a hold handed to it lapses with its TTL, as a dead holder's (also
//! one handed to a waiter that gave up but could not reach Redis). (Not with
//! `wait_replicas`: the `WAIT` for a grant would be the releaser's.) Shared and semaphore requests do not stand in the queue, but new ones
//! are refused while a writer waits there, so readers cannot starve writers
//! (as in a fair read-write lock: a second read lock taken, by another owner,
//! while holding one waits behind a waiting writer).
//!
//! # Sentinel and failover
//!
//! `redis+sentinel://[user:password@]s1:p1,s2:p2/SERVICE[/db]` names the
//! Sentinels (port 26379 if none is given) and the service they monitor; the
//! login is the data nodes', `sentinel_user=` and `sentinel_password=` are
//! the Sentinels'. The client asks every Sentinel that answers and follows
//! the newest configuration (the highest `config-epoch`); it connects to no
//! master while that one is objectively down or being replaced, connects to
//! the promoted replica as soon as it took the role (while the other replicas
//! still copy from it), and uses a
//! connection only once the server answers `ROLE` with `master`. The
//! connection is dropped, and the next command asks the Sentinels again,
//! when a command fails as commands fail in a failover (the connection drops
//! or times out, `READONLY`, `NOREPLICAS`, `MASTERDOWN`), and when the
//! Sentinels, asked once a second, name another master (a master cut off
//! from the Sentinels but not from this client answers on). So renewals,
//! releases and waiters reach the new master, a client never writes to a
//! replica, and it stops writing to an old master about a second after the
//! Sentinels switch. Every new connection needs a Sentinel that answers; a
//! connection in use does not. No TLS through Sentinel yet.
//!
//! Replication is asynchronous, so a failover can lose grants: a hold the
//! replica had not copied when the master died is gone on the new master,
//! which grants the key again (`tests/failover.rs`, for Sentinel and for a
//! cluster with a replica per primary; the same holds for a cluster's
//! primary). What stays true:
//!
//! - the new holder's token is larger than the lost holder's (tokens are
//!   floored at the server's µs clock: the promoted replica's clock must not
//!   be behind the old master's by more than the failover took), so the old
//!   holder's fenced writes are refused;
//! - the old holder's `lost()` fires at its first renewal that reaches the
//!   new master: within a third of its TTL after the Sentinels switch, plus
//!   a second and a connect (3.0 s after the promotion in that test, default
//!   TTL); until then it believes it holds the lock. A holder cut off from
//!   every Sentinel keeps renewing on the master it has while that master
//!   takes writes: set `min-replicas-to-write` on the servers so that a
//!   master cut off from its replicas refuses them (its `NOREPLICAS` is
//!   asked again: a waiter waits for the replicas until its wait ends,
//!   `tests/failover.rs`);
//! - a waiter is granted once the new master answers: 4.0 s after the
//!   master's death with `down-after-milliseconds` 1 s, 34.7 s with
//!   Sentinel's default of 30 s (BENCHMARKS.md).
//!
//! Every holder's renewals fail until the Sentinels have promoted a replica.
//! A failover that takes longer than a TTL ends every hold by its deadline
//! (`lost()` fires, `run` stops its command), with or without
//! `wait_replicas`: with Sentinel's default `down-after-milliseconds` of 30 s
//! that is every hold of the default 30 s TTL. Keep down-after plus the
//! election well under the TTL (5 s down-after for the default TTL), or
//! raise the TTL.
//!
//! With `wait_replicas=1` a grant counts only once a replica acknowledged it,
//! so after the same failover the new master still has the hold: the next
//! client is refused while it lives, and the holder's renewals go on. A
//! renewal counts only once acknowledged too (else the hold is not extended,
//! and the holder loses it by its deadline), so the holder never counts on
//! time the promoted replica would not give it. The
//! cost: with no replica answering nothing is granted (each attempt is undone
//! after `wait_timeout`, 1 s; a waiter asks again until its wait ends, then
//! fails saying why, and nothing is left behind), and a
//! grant takes a replica's round trip. `WAIT` is not consensus: a replica
//! that acknowledged can still lose the grant (it crashes too, or the
//! Sentinels promote another replica that did not have it).
//!
//! [`drill::Drill`] stages the failure on a setup you may break: the master's
//! replicas are cut off, then the Sentinels promote one (`fencelock demo`
//! shows it in act 4; `tests/failover.rs` checks that a client locks on the
//! promoted replica while the other replicas still catch up).
//!
//! # Defaults, restarts and frozen clients
//!
//! - A hold gets the TTL asked for (30 s by default); on Redlock, that less the
//!   round's time and the clock drift allowance.
//! - A restart that keeps the data (AOF, RDB) loses nothing; an empty restart
//!   loses the holds, whose `lost()` fires at the next renewal
//!   (`tests/faults.rs::restart_empty_during_a_hold_fires_lost_and_new_grants_work`).
//!   A waiter waits through a restart, until its deadline
//!   (`tests/faults.rs::a_waiter_waits_through_a_server_restart`).
//! - A frozen holder keeps the key for its TTL (`tests/dead_holder.rs`); nothing
//!   is held across round trips. A frozen or silent server holds a waiter at most
//!   a second past its wait, and a connect for `connect_timeout=`
//!   (`tests/dead_holder.rs::a_stalled_server_cannot_hold_a_waiter_past_its_wait`).
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
pub mod drill;
mod node;
mod options;
mod redlock;
mod scripts;
mod sentinel;
mod subs;

use std::sync::Arc;
use std::time::Duration;

use fencelock_core::backend::{Grant, LeaseRef, Released, Renewal, Request, async_trait};
use fencelock_core::{Backend, Capabilities, Error, FencingToken, Key, LockInfo, Result};
use tokio::time::Instant;

use node::{Attempt, NAME, Node, Op};
pub use options::RedisOptions;
use options::Target;
pub use redlock::RedlockBackend;

/// How the `fencelock` facade opens Redis and Redis Cluster from a URL.
pub const DRIVER: fencelock_core::backend::Driver = fencelock_core::driver!(
    "redis",
    [
        "redis",
        "rediss",
        "redis+cluster",
        "rediss+cluster",
        "redis+sentinel"
    ],
    RedisBackend::connect
);

/// How the `fencelock` facade opens Redlock from a URL.
pub const REDLOCK_DRIVER: fencelock_core::backend::Driver = fencelock_core::driver!(
    "redlock",
    ["redlock", "rediss+redlock"],
    RedlockBackend::connect
);

/// The longest a waiter sleeps without re-checking, whatever the holder's TTL.
const MAX_RECHECK: Duration = Duration::from_secs(5);

/// How long a waiter's place in a key's queue lasts unless it asks again (it
/// asks at least three times as often). A waiter that dies in first place
/// holds the others up this long at most.
const QUEUE_PLACE: Duration = Duration::from_secs(3);

/// How long a waiter that ran out of time waits for its leaving to be
/// answered before it returns (the leaving goes on in the background).
const LEAVE_PATIENCE: Duration = Duration::from_secs(1);

/// What the renew script's answer for `lease` means.
fn renewal(lease: &LeaseRef, held: bool) -> Renewal {
    if held {
        Renewal::Held { ttl: lease.ttl }
    } else {
        Renewal::Lost {
            reason: "the hold is gone from Redis (expired, deleted, or the server lost its data)"
                .into(),
        }
    }
}

/// A waiter's place in a key's queue: left when the wait ends without a grant,
/// also when the wait is cancelled (then by a spawned task). Leaving also
/// takes back a hold handed to the wait (`wait`) where it stood and not taken
/// up, passing the lock on.
struct InQueue {
    backend: Option<RedisBackend>,
    key: Key,
    owner: String,
    wait: Option<Op>,
}

impl InQueue {
    /// The grant took the waiter out of the queue.
    fn granted(mut self) {
        self.backend = None;
    }

    async fn leave(mut self) {
        if let Some(b) = &self.backend {
            // Best effort: a place that is not left lapses by itself. (If this
            // is cancelled, `Drop` tries again.)
            let _ = b
                .node()
                .leave_queue(&self.key, &self.owner, self.wait.as_ref())
                .await;
        }
        self.backend = None;
    }
}

impl Drop for InQueue {
    fn drop(&mut self) {
        if let Some(b) = self.backend.take()
            && let Ok(h) = tokio::runtime::Handle::try_current()
        {
            let (key, owner, wait) = (
                self.key.clone(),
                std::mem::take(&mut self.owner),
                self.wait.take(),
            );
            h.spawn(fencelock_core::backend::tracked(async move {
                let _ = b.node().leave_queue(&key, &owner, wait.as_ref()).await;
            }));
        }
    }
}

/// An acquire op in flight. If the caller drops it (a cancelled acquire)
/// before its outcome was taken, a spawned task undoes the op: exactly the
/// hold it created or added is taken back, and should the request reach Redis
/// only later, it grants nothing. So a dropped acquire leaves no orphan hold.
struct Pending {
    backend: Option<RedisBackend>,
    key: Key,
    owner: String,
    op: Op,
}

impl Pending {
    fn new(backend: &RedisBackend, req: &Request) -> Pending {
        Pending {
            backend: Some(backend.clone()),
            key: req.key.clone(),
            owner: req.owner.to_string(),
            op: backend.node().op(),
        }
    }

    /// The outcome was taken: nothing to undo.
    fn settle(mut self) {
        self.backend = None;
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(b) = self.backend.take()
            && let Ok(h) = tokio::runtime::Handle::try_current()
        {
            let (key, owner, op) = (
                self.key.clone(),
                std::mem::take(&mut self.owner),
                self.op.clone(),
            );
            h.spawn(fencelock_core::backend::tracked(async move {
                match b.node().undo(&key, &owner, &op).await {
                    Ok(_) => tracing::debug!(key = %key, "a cancelled acquire was undone"),
                    Err(e) => tracing::debug!(key = %key, error = %e, "undoing a cancelled acquire failed; a hold it made expires after its TTL"),
                }
            }));
        }
    }
}

/// Locks in Redis. Clones share one connection.
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

struct Inner {
    node: Node,
    options: RedisOptions,
    /// A cluster's slot map as last read for renewals; dropped when a
    /// renewal finds it out of date.
    slot_map: std::sync::Mutex<Option<Arc<Vec<conn::SlotRange>>>>,
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
        let node = Node::open(url, &target, &options).await?;
        Ok(RedisBackend {
            inner: Arc::new(Inner {
                node,
                options,
                slot_map: std::sync::Mutex::new(None),
            }),
        })
    }

    /// The options in force.
    pub fn options(&self) -> &RedisOptions {
        &self.inner.options
    }

    fn node(&self) -> &Node {
        &self.inner.node
    }

    /// `WAIT`s for the configured replicas; if too few answer, undoes what op
    /// `op` granted `owner` on `key` and fails.
    async fn confirm_replicas(&self, key: &Key, owner: &str, op: &Op) -> Result<()> {
        let want = self.inner.options.wait_replicas;
        if want == 0 {
            return Ok(());
        }
        let acked: Result<i64> = self
            .node()
            .grant_conn()
            .query(
                redis::cmd("WAIT")
                    .arg(want)
                    .arg(self.inner.options.wait_timeout.as_millis() as u64),
            )
            .await
            .map_err(|e| self.node().err(e));
        let acked = match acked {
            Ok(n) if n >= i64::from(want) => return Ok(()),
            Ok(n) => n,
            Err(e) => {
                let _ = self.node().undo(key, owner, op).await;
                return Err(e);
            }
        };
        let _ = self.node().undo(key, owner, op).await;
        // Worth waiting through (a replica restarting, a failover): a
        // waiter asks again until its deadline.
        Err(Error::connection(
            NAME,
            &format!("the replicas of {}", self.node().address),
            format!(
                "only {acked} of {want} replicas acknowledged the grant within {:?}; it was undone (lower wait_replicas or check the replicas)",
                self.inner.options.wait_timeout
            ),
        ))
    }

    /// With `wait_replicas`, a renewal counts only once the replicas
    /// acknowledged it: else the hold is not extended (reported unknown; the
    /// watchdog asks again until the lease's deadline), so a holder never
    /// believes in more time than a promoted replica would give it.
    async fn replicas_confirm(&self, renewed: Vec<Renewal>) -> Vec<Renewal> {
        let want = self.inner.options.wait_replicas;
        if want == 0 || !renewed.iter().any(|r| matches!(r, Renewal::Held { .. })) {
            return renewed;
        }
        let acked: Result<i64> = self
            .node()
            .renew_conn()
            .query(
                redis::cmd("WAIT")
                    .arg(want)
                    .arg(self.inner.options.wait_timeout.as_millis() as u64),
            )
            .await
            .map_err(|e| self.node().err(e));
        let why = match acked {
            Ok(n) if n >= i64::from(want) => return renewed,
            Ok(n) => format!("only {n} of {want} replicas acknowledged the renewal"),
            Err(e) => e.to_string(),
        };
        renewed
            .into_iter()
            .map(|r| match r {
                Renewal::Held { .. } => Renewal::Unknown {
                    reason: why.clone(),
                },
                other => other,
            })
            .collect()
    }

    /// One acquire attempt as its own op: the grant, or how long the first
    /// holder has left; also the op and when it was sent. The op is undone if
    /// the caller drops it before the outcome (including the replicas'
    /// acknowledgement) is known, or if it fails (then it may have run). With
    /// `wait`, a refused request can be handed the lock where it stands in
    /// the queue, and a hold so handed is found and taken up (its grant is
    /// the wait's op; its expiry was raised to at least now + TTL).
    async fn attempt(
        &self,
        req: &Request,
        queue: Duration,
        wait: Option<&Op>,
    ) -> Result<(std::result::Result<Grant, Duration>, Op, Instant)> {
        let pending = Pending::new(self, req);
        let requested_at = Instant::now();
        let attempt = self
            .node()
            .attempt(req, 0, queue, &pending.op, false, wait)
            .await?;
        let op = pending.op.clone();
        match attempt {
            Attempt::Granted {
                token,
                holds,
                by_wait,
                ..
            } => {
                let grant_op = match wait {
                    Some(w) if by_wait => w,
                    _ => &pending.op,
                };
                self.confirm_replicas(&req.key, req.owner.as_str(), grant_op)
                    .await?;
                let grant =
                    Grant::new(Some(FencingToken::new(token)), req.ttl, holds, requested_at)
                        .with_handle(grant_op.as_str());
                pending.settle();
                Ok((Ok(grant), op, requested_at))
            }
            Attempt::Busy { left, .. } => {
                pending.settle();
                Ok((Err(left), op, requested_at))
            }
        }
    }

    /// Deletes every hold of `key` at once (an operator breaking a lock; the
    /// testkit's "stolen lease") and wakes its waiters. The fence stays.
    ///
    /// On connection trouble the request is sent again, with backoff, for up
    /// to the response timeout; a second run never deletes the holds of an
    /// owner that took the lock after the first.
    ///
    /// # Errors
    ///
    /// Connection and server errors (after those re-sends).
    pub async fn force_release(&self, key: &Key) -> Result<()> {
        self.node().force_release(key).await
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
        // The op's mark keeps a request re-sent after its reply was lost from
        // writing again after a later write with the same token.
        let mut call = scripts::FENCED_SET.key(resource);
        if let Some(mark) = self.node().mark_beside(resource) {
            call = call.key(mark);
        }
        let written: i64 = self
            .node()
            .conn
            .invoke(call.arg(token.get()).arg(value).arg(self.node().mark_ms()))
            .await
            .map_err(|e| self.node().err(e))?;
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
            .node()
            .conn
            .query(redis::cmd("HMGET").arg(resource).arg("value").arg("token"))
            .await
            .map_err(|e| self.node().err(e))?;
        Ok(value.zip(token).map(|(v, t)| (v, FencingToken::new(t))))
    }

    /// Releases; with `next`, an exclusive lock that is let go passes to `next`
    /// in the same step and its grant is returned.
    async fn release_script(
        &self,
        lease: &LeaseRef,
        next: Option<&Request>,
    ) -> Result<(Released, Option<Grant>)> {
        let requested_at = Instant::now();
        let op = self.node().op();
        let (left, handed, _) = self.node().release(lease, next, 0, &op).await?;
        if left < 0 {
            return Err(Error::NotHeld {
                key: lease.key.to_string(),
                owner: lease.owner.to_string(),
            });
        }
        let released = Released::new(left as u32);
        let Some(n) = next.filter(|_| handed > 0) else {
            return Ok((released, None));
        };
        // A handoff is a grant like any other: it counts once the replicas
        // acknowledged it (undone otherwise; the waiter then waits on).
        if let Err(e) = self.confirm_replicas(&n.key, n.owner.as_str(), &op).await {
            tracing::debug!(key = %n.key, error = %e, "a handoff was undone");
            return Ok((released, None));
        }
        let grant = Grant::new(Some(FencingToken::new(handed)), n.ttl, 1, requested_at)
            .with_handle(op.as_str());
        Ok((released, Some(grant)))
    }

    /// Renews on a cluster. A script may touch one slot only: one call per
    /// lease, sent as one pipeline per primary (by the slot map, read when
    /// first needed and again after it proved out of date), each pipeline
    /// bounded well inside its leases' validity. A lease its primary did not
    /// renew for a reason the map explains (the slot moved: `MOVED`, `ASK`; a
    /// refused connection) is sent again on its own through the redirecting
    /// connection; a primary that does not answer in time costs only its own
    /// leases (reported unknown; the watchdog retries them until their
    /// deadlines).
    async fn renew_on_cluster(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
        let node = self.node();
        let bound = |of: &mut dyn Iterator<Item = &LeaseRef>| {
            of.map(|l| l.ttl).min().unwrap_or_default() / 3
        };
        let mut out: Vec<Option<Renewal>> = vec![None; leases.len()];
        let map = self.slot_map(bound(&mut leases.iter())).await;
        let mut stale = map.is_none();
        if let Some(ranges) = map {
            let mut by_node: std::collections::HashMap<(&str, u16), Vec<usize>> =
                std::collections::HashMap::new();
            for (i, l) in leases.iter().enumerate() {
                let slot = conn::slot_of(node.keys(&l.key).hash.as_bytes());
                match ranges.iter().find(|r| r.first <= slot && slot <= r.last) {
                    Some(r) => by_node
                        .entry((r.host.as_str(), r.port))
                        .or_default()
                        .push(i),
                    None => stale = true,
                }
            }
            let answers =
                futures::future::join_all(by_node.into_iter().map(|((host, port), of)| {
                    let batch: Vec<&LeaseRef> = of.iter().map(|&i| &leases[i]).collect();
                    async move {
                        let limit = bound(&mut batch.iter().copied());
                        (
                            of,
                            limit,
                            tokio::time::timeout(limit, node.renew_at(&batch, host, port)).await,
                        )
                    }
                }))
                .await;
            for (of, limit, answer) in answers {
                match answer {
                    Ok(Ok(held)) => {
                        for (i, held) in of.into_iter().zip(held) {
                            stale |= held.is_none();
                            out[i] = held.map(|held| renewal(&leases[i], held));
                        }
                    }
                    // The node is there but not where the map says, or gone.
                    Ok(Err(_)) => stale = true,
                    Err(_) => {
                        for i in of {
                            out[i] = Some(Renewal::Unknown {
                                reason: format!("no answer within {limit:?}"),
                            });
                        }
                    }
                }
            }
        }
        if stale {
            *self
                .inner
                .slot_map
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = None;
        }
        // The rest one by one, redirected as the cluster says.
        let rest = out
            .iter()
            .enumerate()
            .filter(|(_, r)| r.is_none())
            .map(|(i, _)| i);
        let calls = rest.map(|i| async move {
            let l = &leases[i];
            let one = self.renew_in_batches(std::slice::from_ref(l));
            let r = match tokio::time::timeout(l.ttl / 3, one).await {
                Ok(Ok(mut r)) if r.len() == 1 => r.remove(0),
                Ok(Ok(r)) => Renewal::Unknown {
                    reason: format!("{} answers for one lease", r.len()),
                },
                Ok(Err(e)) => Renewal::Unknown {
                    reason: e.to_string(),
                },
                Err(_) => Renewal::Unknown {
                    reason: format!("no answer within {:?}", l.ttl / 3),
                },
            };
            (i, r)
        });
        for (i, r) in futures::future::join_all(calls).await {
            out[i] = Some(r);
        }
        Ok(out.into_iter().flatten().collect())
    }

    /// The cluster's slot map for renewals: the one kept, or read anew
    /// (`None` if that is not answered within `limit`, or names a node
    /// without a usable address).
    async fn slot_map(&self, limit: Duration) -> Option<Arc<Vec<conn::SlotRange>>> {
        let kept = self
            .inner
            .slot_map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if kept.is_some() {
            return kept;
        }
        let read = tokio::time::timeout(limit, self.node().conn.slot_ranges()).await;
        let map = Arc::new(read.ok()?.ok()??);
        *self
            .inner
            .slot_map
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(map.clone());
        Some(map)
    }

    /// Renews on one server: a script call per [`node::RENEW_BATCH`] leases,
    /// sent together (see [`Node::renew`]); a batch not answered leaves its
    /// leases unknown, not the others.
    async fn renew_in_batches(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
        let node = self.node();
        let batches = futures::future::join_all(
            leases
                .chunks(node::RENEW_BATCH)
                .map(|batch| async move { (batch, node.renew(batch).await) }),
        )
        .await;
        let mut out = Vec::with_capacity(leases.len());
        let mut failed = None;
        for (batch, held) in batches {
            match held {
                Ok(held) => out.extend(
                    batch
                        .iter()
                        .zip(held)
                        .map(|(lease, held)| renewal(lease, held)),
                ),
                Err(e) => {
                    out.extend(batch.iter().map(|_| Renewal::Unknown {
                        reason: e.to_string(),
                    }));
                    failed.get_or_insert(e);
                }
            }
        }
        // Nothing learned at all: the error itself, as before batching.
        match failed {
            Some(e) if out.iter().all(|r| matches!(r, Renewal::Unknown { .. })) => Err(e),
            _ => Ok(out),
        }
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
        self.node().address.clone()
    }

    fn default_ttl(&self) -> Option<Duration> {
        self.inner.options.default_ttl
    }

    async fn try_acquire(&self, req: &Request) -> Result<Option<Grant>> {
        Ok(self.attempt(req, Duration::ZERO, None).await?.0.ok())
    }

    async fn acquire(&self, req: &Request, deadline: Option<Instant>) -> Result<Option<Grant>> {
        // A refused exclusive request stands in the key's queue (see `scripts`)
        // unless it gives up at once.
        let queue = if deadline.is_some_and(|d| d <= Instant::now()) {
            Duration::ZERO
        } else {
            QUEUE_PLACE
        };
        let queued = queue > Duration::ZERO && req.mode == fencelock_core::Mode::Exclusive;
        // A waiter in the queue can be handed the lock where it stands, known
        // by its wait op — unless grants must wait for replicas (`WAIT`
        // covers the writes of the connection that sends it: the releaser's).
        let wait = (queued && self.inner.options.wait_replicas == 0).then(|| self.node().op());
        // Set up before the first attempt, which may already stand in the queue.
        let in_queue = InQueue {
            backend: queued.then(|| self.clone()),
            key: req.key.clone(),
            owner: req.owner.to_string(),
            wait: wait.clone(),
        };
        // Listening already (a recent wait on this key): the first attempt
        // may wait where it stands. Else one attempt before subscribing
        // (uncontended: one round trip, no subscription); not yet listening
        // for grants, it does not ask for one.
        let (watch, handed) = match self
            .node()
            .watches_if_subscribed(&req.key, wait.as_ref())
            .await
        {
            Some(w) => w,
            None => {
                if let (Ok(grant), ..) = self.attempt(req, queue, None).await? {
                    in_queue.granted();
                    return Ok(Some(grant));
                }
                let watch = self.node().watch(&req.key).await?;
                let handed = match &wait {
                    Some(w) => Some(self.node().expect_grant(w).await?),
                    None => None,
                };
                (watch, handed)
            }
        };
        // This wait's attempts (op, sent), the last few: a handed grant names
        // the attempt it answered, whose send time starts the lease.
        let mut asked: std::collections::VecDeque<(Op, Instant)> = Default::default();
        let mut first_asked: Option<Instant> = None;
        loop {
            if let Some((_, slot)) = &handed
                && let Some(h) = slot.take()
                && h.owner == req.owner.as_str()
            {
                // Sent before the grant ran: the earliest is safe when the
                // named attempt is no longer known.
                let sent = asked
                    .iter()
                    .find(|(op, _)| op.as_str() == h.attempt)
                    .map(|(_, at)| *at)
                    .or(first_asked);
                // A message that comes too late to leave half the lease is
                // not used: asking again finds the hold if it is still there.
                if let Some(sent) = sent
                    && sent + req.ttl / 2 > Instant::now()
                    && let Some(w) = &wait
                {
                    in_queue.granted();
                    return Ok(Some(
                        Grant::new(Some(FencingToken::new(h.token)), req.ttl, 1, sent)
                            .with_handle(w.as_str()),
                    ));
                }
            }
            // Listen before asking, so a release between the answer and the wait
            // is not missed.
            let notified = watch.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let (outcome, op, sent) = self.attempt(req, queue, wait.as_ref()).await?;
            let left = match outcome {
                Ok(grant) => {
                    in_queue.granted();
                    return Ok(Some(grant));
                }
                Err(left) => left,
            };
            first_asked.get_or_insert(sent);
            asked.push_back((op, sent));
            if asked.len() > 4 {
                asked.pop_front();
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                in_queue.leave().await;
                return Ok(None);
            }
            // A waiter in the queue asks again before its place lapses, and
            // one standing with its request often enough that the attempt a
            // grant names leaves most of the handed window.
            let most = if wait.is_some() {
                (QUEUE_PLACE / 3)
                    .min(req.ttl / 4)
                    .max(Duration::from_millis(10))
            } else if in_queue.backend.is_some() {
                QUEUE_PLACE / 3
            } else {
                MAX_RECHECK
            };
            let mut until = Instant::now() + left.clamp(Duration::from_millis(1), most);
            if let Some(d) = deadline {
                until = until.min(d);
            }
            let arrived = async {
                match &handed {
                    Some((_, slot)) => slot.arrived().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = &mut notified => {}
                _ = arrived => {}
                _ = tokio::time::sleep_until(until) => {}
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                // Out of time: a hold handed to this wait meanwhile is taken
                // back by leaving, and passed on. Not waited for long if
                // Redis does not answer (the leave goes on in the background).
                let _ = tokio::time::timeout(LEAVE_PATIENCE, in_queue.leave()).await;
                return Ok(None);
            }
        }
    }

    async fn renew(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        if !self.node().conn.is_cluster() {
            let renewed = self.renew_in_batches(leases).await?;
            return Ok(self.replicas_confirm(renewed).await);
        }
        self.renew_on_cluster(leases).await
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
        self.node().inspect(key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>> {
        let mut out = Vec::new();
        for k in self.node().keys_under(prefix).await? {
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

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("address", &self.node().address)
            .field("options", &self.inner.options)
            .finish()
    }
}
