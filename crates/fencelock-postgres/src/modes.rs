//! The two modes, each a backend of its own: the lease table (rows with a
//! fence and an expiry, `lease.rs`) and advisory locks (sessions that hold
//! `pg_advisory_lock`, `advisory.rs`). `PostgresBackend` hands every call to
//! the one its URL asked for.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use fencelock_core::backend::{
    Backoff, Grant, LeaseRef, Released, Renewal, Request, TryOutcome, async_trait, list_held,
    wait_for_grant,
};
use fencelock_core::{Backend, Capabilities, FencingToken, Key, LockInfo, Mode, Result};
use sqlx::postgres::PgConnectOptions;
use tokio::sync::OnceCell;
use tokio::time::Instant;

use crate::advisory::{self, Advisory};
use crate::db::Db;
use crate::listen::{self, Waiters};
use crate::{NAME, lease};

/// Longest a lease-mode waiter sleeps between checks when no notification comes.
const MAX_RECHECK: Duration = Duration::from_secs(1);

/// How long a waiter's place in a key's queue lasts unless it asks again: its
/// TTL, within 1 to 3 s. The lock is handed to the place of a waiter that
/// died, and kept from others for that waiter's TTL, until the place lapses.
fn place(ttl: Duration) -> Duration {
    ttl.clamp(Duration::from_secs(1), Duration::from_secs(3))
}

/// How long a wait that left stays marked gone, so that a late attempt of it
/// grants nothing: the longest place, or its TTL if longer (an attempt later
/// still makes a hold that lapses with that TTL, as any acquire whose
/// request arrives after its caller gave up).
fn gone_mark(ttl: Duration) -> Duration {
    ttl.max(Duration::from_secs(3))
}

/// How long a wait that gives up waits for the server to confirm it left.
const LEAVE_PATIENCE: Duration = Duration::from_secs(1);

/// A wait's place in a key's queue: left when the wait ends without a grant,
/// also when it is cancelled (then by a spawned task). Leaving also takes back
/// a hold made for the wait that it did not take up, passing the lock on.
struct InQueue {
    db: Option<Db>,
    key: fencelock_core::Key,
    wait: String,
    ttl: Duration,
}

impl InQueue {
    /// The wait took its grant: nothing to leave.
    fn granted(mut self) {
        self.db = None;
    }

    async fn leave(mut self) {
        if let Some(db) = &self.db {
            // Best effort: a place that is not left lapses by itself, and a
            // hold made for the wait with its TTL. (If this is cancelled,
            // `Drop` tries again.)
            let _ = lease::leave(db, &self.key, &self.wait, gone_mark(self.ttl)).await;
        }
        self.db = None;
    }
}

impl Drop for InQueue {
    fn drop(&mut self) {
        if let Some(db) = self.db.take()
            && let Ok(h) = tokio::runtime::Handle::try_current()
        {
            let (key, wait, mark) = (
                self.key.clone(),
                std::mem::take(&mut self.wait),
                gone_mark(self.ttl),
            );
            h.spawn(fencelock_core::backend::tracked(async move {
                let _ = lease::leave(&db, &key, &wait, mark).await;
            }));
        }
    }
}

/// What both modes can do.
fn capabilities() -> Capabilities {
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

/// `?mode=lease`: a row per holder with a fence column and an expiry; a
/// release NOTIFYs the key's waiters.
pub(crate) struct LeaseTable {
    db: Db,
    connect: PgConnectOptions,
    waiters: Arc<Waiters>,
    listening: OnceCell<()>,
    default_ttl: Option<Duration>,
}

impl LeaseTable {
    pub(crate) fn new(db: Db, connect: PgConnectOptions, default_ttl: Option<Duration>) -> Self {
        LeaseTable {
            db,
            connect,
            waiters: Arc::new(Waiters::default()),
            listening: OnceCell::new(),
            default_ttl,
        }
    }

    fn grant(req: &Request, token: u64, holds: u32, requested_at: Instant) -> Grant {
        Grant::new(Some(FencingToken::new(token)), req.ttl, holds, requested_at)
    }

    /// An exclusive wait: it stands in the key's queue from its first
    /// attempt, and asks again when woken, when the holder's lease would end,
    /// and at least every third of its place (a quarter of its TTL if shorter) to
    /// keep its place. Once the backend listens on its grant channel, a
    /// release can make it the holder where it stands and send the grant
    /// there: it starts on receipt, its lease counted from the send time of
    /// the attempt the grant names (that attempt ran before the grant). A
    /// grant that does not arrive, or too late to leave half the TTL, is
    /// taken up by the next attempt (the hold carries the wait's id), its
    /// expiry raised to at least now + TTL.
    async fn wait_in_queue(
        &self,
        req: &Request,
        deadline: Option<Instant>,
    ) -> Result<Option<Grant>> {
        let wake = self.waiters.of(req.key.as_str());
        let wait = format!("{:016x}", fastrand::u64(..));
        let slot = self.waiters.expect_grant(&wait);
        // Set up before the first attempt, which stands in the queue.
        let in_queue = InQueue {
            db: Some(self.db.clone()),
            key: req.key.clone(),
            wait: wait.clone(),
            ttl: req.ttl,
        };
        // This wait's attempts (number, sent), the last few.
        let mut asked: VecDeque<(u64, Instant)> = VecDeque::new();
        let mut first_asked: Option<Instant> = None;
        let mut attempt = 0;
        let mut waited_for_ear = false;
        loop {
            if let Some(h) = slot.take() {
                // Sent before the grant ran: the earliest is safe when the
                // named attempt is no longer known.
                let sent = asked
                    .iter()
                    .find(|(n, _)| *n == h.attempt)
                    .map(|(_, at)| *at)
                    .or(first_asked);
                if let Some(sent) = sent
                    && sent + req.ttl / 2 > Instant::now()
                {
                    in_queue.granted();
                    return Ok(Some(Self::grant(req, h.token, 1, sent)));
                }
            }
            if attempt > 0 && deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
            // Listen before asking, so a release between the answer and the
            // wait is not missed.
            let notified = wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            attempt += 1;
            let channel = self.waiters.grant_channel();
            let sent = Instant::now();
            first_asked.get_or_insert(sent);
            asked.push_back((attempt, sent));
            if asked.len() > 8 {
                asked.pop_front();
            }
            let standing = lease::Standing {
                wait: &wait,
                channel,
                attempt,
                place: place(req.ttl),
            };
            let left = match lease::attempt(&self.db, req, Some(&standing)).await? {
                Ok((token, holds)) => {
                    in_queue.granted();
                    return Ok(Some(Self::grant(req, token, holds, sent)));
                }
                Err(left) => left,
            };
            if deadline.is_some_and(|d| Instant::now() >= d) {
                // A grant that arrived meanwhile is still taken (above).
                continue;
            }
            // Not yet listening for grants: ask again as soon as it is (waited
            // for once, within the deadline: a LISTEN that never works, as
            // behind a pooler in transaction mode, leaves the usual asking).
            if channel.is_none() && !waited_for_ear {
                waited_for_ear = true;
                let patience = deadline.map_or(MAX_RECHECK, |d| {
                    d.saturating_duration_since(Instant::now()).min(MAX_RECHECK)
                });
                if self.waiters.hearing(patience).await {
                    continue;
                }
            }
            let most = (place(req.ttl) / 3)
                .min(req.ttl / 4)
                .max(Duration::from_millis(10));
            let mut until = Instant::now() + left.clamp(Duration::from_millis(1), most);
            if let Some(d) = deadline {
                until = until.min(d);
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = slot.arrived() => {}
                _ = tokio::time::sleep_until(until) => {}
            }
        }
        // Out of time: a hold handed to this wait meanwhile is taken back by
        // leaving, and passed on. Not waited for long if the server does not
        // answer (the leave goes on in the background).
        let _ = tokio::time::timeout(LEAVE_PATIENCE, in_queue.leave()).await;
        Ok(None)
    }

    /// Starts the LISTEN task once.
    async fn listen(&self) {
        self.listening
            .get_or_init(|| async {
                let waiters = Arc::downgrade(&self.waiters);
                tokio::spawn(listen::run(self.connect.clone(), waiters));
            })
            .await;
    }
}

#[async_trait]
impl Backend for LeaseTable {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        capabilities()
    }

    fn address(&self) -> String {
        self.db.addr.clone()
    }

    fn default_ttl(&self) -> Option<Duration> {
        self.default_ttl
    }

    async fn try_acquire(&self, req: &Request) -> Result<Option<Grant>> {
        let requested_at = Instant::now();
        Ok(lease::attempt(&self.db, req, None)
            .await?
            .ok()
            .map(|(token, holds)| Self::grant(req, token, holds, requested_at)))
    }

    async fn acquire(&self, req: &Request, deadline: Option<Instant>) -> Result<Option<Grant>> {
        self.listen().await;
        if req.mode == Mode::Exclusive && deadline.is_none_or(|d| d > Instant::now()) {
            return self.wait_in_queue(req, deadline).await;
        }
        let wake = self.waiters.of(req.key.as_str());
        // Shared and semaphore requests do not stand in the queue. Woken by
        // the release's NOTIFY, else re-check when the holder's lease would
        // end, and at least every MAX_RECHECK.
        let backoff = Backoff::new(Duration::from_millis(20), MAX_RECHECK);
        wait_for_grant(deadline, backoff, Some(&wake), |_| async {
            let requested_at = Instant::now();
            Ok(match lease::attempt(&self.db, req, None).await? {
                Ok((token, holds)) => {
                    TryOutcome::Granted(Self::grant(req, token, holds, requested_at))
                }
                Err(left) => TryOutcome::Busy {
                    retry_in: Some(left + Duration::from_millis(1)),
                },
            })
        })
        .await
    }

    async fn renew(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
        lease::renew(&self.db, leases).await
    }

    async fn release(&self, lease: &LeaseRef) -> Result<Released> {
        lease::release(&self.db, lease).await
    }

    async fn release_to(
        &self,
        lease: &LeaseRef,
        next: &Request,
    ) -> Result<(Released, Option<Grant>)> {
        let requested_at = Instant::now();
        let (released, handed) = lease::handoff(&self.db, lease, next).await?;
        Ok((
            released,
            handed.map(|(token, holds)| Self::grant(next, token, holds, requested_at)),
        ))
    }

    async fn inspect(&self, key: &Key) -> Result<Option<LockInfo>> {
        lease::inspect(&self.db, key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>> {
        list_held(self, lease::held_keys(&self.db, prefix).await?).await
    }
}

/// `?mode=advisory`: each hold is a session holding `pg_advisory_lock`; the
/// server's own queue wakes waiters.
pub(crate) struct AdvisoryLocks {
    db: Db,
    advisory: Advisory,
    default_ttl: Option<Duration>,
}

impl AdvisoryLocks {
    pub(crate) fn new(db: Db, advisory: Advisory, default_ttl: Option<Duration>) -> Self {
        AdvisoryLocks {
            db,
            advisory,
            default_ttl,
        }
    }
}

#[async_trait]
impl Backend for AdvisoryLocks {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        capabilities()
    }

    fn address(&self) -> String {
        self.db.addr.clone()
    }

    fn default_ttl(&self) -> Option<Duration> {
        self.default_ttl
    }

    fn session_events(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        Some(self.advisory.events())
    }

    async fn try_acquire(&self, req: &Request) -> Result<Option<Grant>> {
        self.advisory.acquire(req, None).await
    }

    async fn acquire(&self, req: &Request, deadline: Option<Instant>) -> Result<Option<Grant>> {
        if let Mode::Semaphore { .. } = req.mode {
            // Permits are tried one by one: poll.
            let backoff = Backoff::new(Duration::from_millis(2), Duration::from_millis(200));
            return wait_for_grant(deadline, backoff, None, |_| async {
                Ok(TryOutcome::from_try(
                    self.advisory.acquire(req, None).await?,
                ))
            })
            .await;
        }
        self.advisory.acquire(req, Some(deadline)).await
    }

    async fn renew(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
        Ok(self.advisory.renew(leases).await)
    }

    async fn release(&self, lease: &LeaseRef) -> Result<Released> {
        self.advisory.release(lease).await
    }

    // The server's own queue hands the lock to its next waiter: release_to
    // is the trait's plain release.

    async fn inspect(&self, key: &Key) -> Result<Option<LockInfo>> {
        advisory::inspect(&self.db, key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>> {
        list_held(self, advisory::held_keys(&self.db, prefix).await?).await
    }
}
