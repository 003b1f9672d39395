//! The two modes, each a backend of its own: the lease table (rows with a
//! fence and an expiry, `lease.rs`) and advisory locks (sessions that hold
//! `pg_advisory_lock`, `advisory.rs`). `PostgresBackend` hands every call to
//! the one its URL asked for.

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
        Ok(lease::attempt(&self.db, req)
            .await?
            .ok()
            .map(|(token, holds)| Self::grant(req, token, holds, requested_at)))
    }

    async fn acquire(&self, req: &Request, deadline: Option<Instant>) -> Result<Option<Grant>> {
        self.listen().await;
        let wake = self.waiters.of(req.key.as_str());
        // Woken by the release's NOTIFY, else re-check when the holder's
        // lease would end, and at least every MAX_RECHECK.
        let backoff = Backoff::new(Duration::from_millis(20), MAX_RECHECK);
        wait_for_grant(deadline, backoff, Some(&wake), |_| async {
            let requested_at = Instant::now();
            Ok(match lease::attempt(&self.db, req).await? {
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
