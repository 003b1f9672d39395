//! The two modes, each a backend of its own: the lease table (rows with a
//! fence and an expiry, `lease.rs`) and `GET_LOCK` (sessions that hold named
//! locks, `get_lock.rs`). `MySqlBackend` hands every call to the one its URL
//! asked for.

use std::sync::Arc;
use std::time::Duration;

use fencelock_core::backend::{
    Backoff, Grant, LeaseRef, Released, Renewal, Request, TryOutcome, async_trait, list_held,
    wait_for_grant,
};
use fencelock_core::{Backend, Capabilities, FencingToken, Key, LockInfo, Mode, Result};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::db::Db;
use crate::get_lock::{self, GetLock};
use crate::lease::Line;
use crate::turnstile::{Seat, Turnstile};
use crate::{NAME, lease};

/// What both modes can do; the lease table also shares (readers), `GET_LOCK`
/// waits in the server.
fn capabilities(lease: bool) -> Capabilities {
    Capabilities::NONE
        .with_fencing(true)
        .with_shared(lease)
        .with_semaphore(true)
        .with_reentrant(true)
        .with_native_wait(!lease)
        .with_ttl(true)
        .with_inspect(true)
        .with_cross_process(true)
}

/// How a turn on a seat ended: with the acquire's outcome, or with the seat's
/// session failing (the line is joined again on a new one).
enum Turn {
    Done(Result<Option<Grant>>),
    SeatFailed(fencelock_core::Error),
}

/// How a wait for a place in line ended.
enum ForPlace {
    Place(tokio::sync::OwnedSemaphorePermit),
    Granted(Grant),
    TimedOut,
}

/// `?mode=lease`: a row per holder with a fence and an expiry.
pub(crate) struct LeaseTable {
    db: Db,
    /// Wakes this process's waiters when a hold is released here.
    released: Arc<Notify>,
    default_ttl: Option<Duration>,
    /// The line of exclusive waiters (MariaDB: `turnstile.rs`).
    line: Option<Arc<Turnstile>>,
}

impl LeaseTable {
    pub(crate) fn new(
        db: Db,
        released: Arc<Notify>,
        default_ttl: Option<Duration>,
        line: Option<Arc<Turnstile>>,
    ) -> Self {
        LeaseTable {
            db,
            released,
            default_ttl,
            line,
        }
    }

    fn grant(req: &Request, token: u64, holds: u32, requested_at: Instant) -> Grant {
        Grant::new(Some(FencingToken::new(token)), req.ttl, holds, requested_at)
    }

    /// Where `req` stands before it has a seat in the line.
    fn line_of(&self, req: &Request) -> Line {
        if self.line.is_some() && req.mode == Mode::Exclusive {
            Line::Behind
        } else {
            Line::Off
        }
    }

    /// While every place this process has in line is taken (by waits on
    /// other keys, perhaps held up by this very process's holds), asks as
    /// waiters did before the line — taking a free lock even while a head
    /// waits, polling with backoff, woken by releases in this process —
    /// until granted, a place frees (its turn kept while it asks), or
    /// `deadline`.
    async fn poll_for_place(
        &self,
        line: &Turnstile,
        req: &Request,
        deadline: Option<Instant>,
    ) -> Result<ForPlace> {
        let mut backoff = Backoff::new(Duration::from_millis(2), Duration::from_millis(100));
        let place = line.place();
        tokio::pin!(place);
        loop {
            let woken = self.released.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let requested_at = Instant::now();
            let retry_in = match lease::attempt(&self.db, req, Line::Off).await? {
                Ok((token, holds)) => {
                    let grant = Self::grant(req, token, holds, requested_at);
                    return Ok(ForPlace::Granted(grant));
                }
                Err(left) => (left > Duration::ZERO).then(|| left + Duration::from_millis(1)),
            };
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(ForPlace::TimedOut);
            }
            tokio::select! {
                place = &mut place => return Ok(ForPlace::Place(place?)),
                () = &mut woken => backoff.reset(),
                () = backoff.sleep(deadline, retry_in) => {}
            }
        }
    }

    /// An exclusive acquire that waits in the key's line (`turnstile.rs`):
    /// one ask without a seat; then a seat, a place in the line, and, as its
    /// head, asks between doorbell sleeps until granted or `deadline`.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future while it queues or sleeps drops the seat's
    /// session; the server ends it, and with it the place in line, when it
    /// sees the connection closed (`turnstile.rs`, "Leaving"). A grant is never held back by an await:
    /// the seat is let go in a task of its own.
    async fn acquire_in_line(
        &self,
        line: &Arc<Turnstile>,
        req: &Request,
        deadline: Option<Instant>,
    ) -> Result<Option<Grant>> {
        let requested_at = Instant::now();
        if let Ok((token, holds)) = lease::attempt(&self.db, req, Line::Behind).await? {
            return Ok(Some(Self::grant(req, token, holds, requested_at)));
        }
        // A reused seat the server has ended (idle too long) fails its first
        // statement, as does the head's seat of a process paused longer than
        // the seat's idle limit; the line is then joined again on a new
        // session. Three such failures in a row end the acquire with the error.
        let mut fresh = false;
        let mut failures = 0;
        loop {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(None);
            }
            let place = match line.place_now() {
                Some(place) => place,
                None => match self.poll_for_place(line, req, deadline).await? {
                    ForPlace::Place(place) => place,
                    ForPlace::Granted(grant) => return Ok(Some(grant)),
                    ForPlace::TimedOut => return Ok(None),
                },
            };
            let seat = line.seat(fresh, place).await?;
            match self
                .take_turn(line, seat, req, deadline, &mut failures)
                .await
            {
                Turn::Done(done) => return done,
                Turn::SeatFailed(e) => {
                    failures += 1;
                    if failures >= 3 {
                        return Err(e);
                    }
                    fresh = true;
                }
            }
        }
    }

    /// Queues on `seat`, then, as the head, asks between doorbell sleeps.
    /// A doorbell that rang resets `failures`.
    async fn take_turn(
        &self,
        line: &Arc<Turnstile>,
        mut seat: Seat,
        req: &Request,
        deadline: Option<Instant>,
        failures: &mut u32,
    ) -> Turn {
        match line.queue(&mut seat, &req.key, deadline).await {
            Ok(true) => {}
            Ok(false) => {
                line.unused(seat);
                return Turn::Done(Ok(None));
            }
            Err(e) => return Turn::SeatFailed(e),
        }
        // The head: nobody else takes the lock while it is free.
        let mut backoff = Backoff::new(Duration::from_millis(2), Duration::from_millis(100));
        loop {
            let requested_at = Instant::now();
            let left = match lease::attempt(&self.db, req, Line::Head(seat.id)).await {
                Ok(Err(left)) => left,
                done => {
                    // Granted or failed: the next in line goes on.
                    line.leave_later(seat, &req.key);
                    return Turn::Done(done.map(|granted| {
                        granted
                            .ok()
                            .map(|(token, holds)| Self::grant(req, token, holds, requested_at))
                    }));
                }
            };
            let mut nap = backoff.next_delay().min(left + Duration::from_millis(1));
            if let Some(d) = deadline {
                let now = Instant::now();
                if now >= d {
                    line.leave_later(seat, &req.key);
                    return Turn::Done(Ok(None));
                }
                nap = nap.min(d - now);
            }
            match line.doorbell(&mut seat, &req.key, nap).await {
                Ok(()) => *failures = 0,
                Err(e) => return Turn::SeatFailed(e),
            }
        }
    }
}

#[async_trait]
impl Backend for LeaseTable {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        capabilities(true)
    }

    fn address(&self) -> String {
        self.db.addr.clone()
    }

    fn default_ttl(&self) -> Option<Duration> {
        self.default_ttl
    }

    async fn try_acquire(&self, req: &Request) -> Result<Option<Grant>> {
        let requested_at = Instant::now();
        Ok(lease::attempt(&self.db, req, self.line_of(req))
            .await?
            .ok()
            .map(|(token, holds)| Self::grant(req, token, holds, requested_at)))
    }

    async fn acquire(&self, req: &Request, deadline: Option<Instant>) -> Result<Option<Grant>> {
        if let Some(line) = &self.line
            && req.mode == Mode::Exclusive
        {
            return self.acquire_in_line(line, req, deadline).await;
        }
        let backoff = Backoff::new(Duration::from_millis(2), Duration::from_millis(100));
        wait_for_grant(deadline, backoff, Some(&self.released), |_| async {
            let requested_at = Instant::now();
            Ok(match lease::attempt(&self.db, req, Line::Off).await? {
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
        let released = lease::release(&self.db, lease, self.line.is_some()).await?;
        if released.remaining == 0 {
            self.released.notify_waiters();
        }
        Ok(released)
    }

    async fn inspect(&self, key: &Key) -> Result<Option<LockInfo>> {
        lease::inspect(&self.db, key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>> {
        list_held(self, lease::held_keys(&self.db, prefix).await?).await
    }
}

/// `?mode=get_lock`: each hold is a session holding a `GET_LOCK` name; the
/// server's own queue wakes waiters.
pub(crate) struct GetLocks {
    db: Db,
    get_lock: GetLock,
    default_ttl: Option<Duration>,
}

impl GetLocks {
    pub(crate) fn new(db: Db, get_lock: GetLock, default_ttl: Option<Duration>) -> Self {
        GetLocks {
            db,
            get_lock,
            default_ttl,
        }
    }
}

#[async_trait]
impl Backend for GetLocks {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        capabilities(false)
    }

    fn address(&self) -> String {
        self.db.addr.clone()
    }

    fn default_ttl(&self) -> Option<Duration> {
        self.default_ttl
    }

    fn session_events(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        Some(self.get_lock.events())
    }

    async fn try_acquire(&self, req: &Request) -> Result<Option<Grant>> {
        self.get_lock.acquire(req, None).await
    }

    async fn acquire(&self, req: &Request, deadline: Option<Instant>) -> Result<Option<Grant>> {
        if let Mode::Semaphore { .. } = req.mode {
            // Permits are tried one by one: poll.
            let backoff = Backoff::new(Duration::from_millis(2), Duration::from_millis(200));
            return wait_for_grant(deadline, backoff, None, |_| async {
                Ok(TryOutcome::from_try(
                    self.get_lock.acquire(req, None).await?,
                ))
            })
            .await;
        }
        self.get_lock.acquire(req, Some(deadline)).await
    }

    async fn renew(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
        Ok(self.get_lock.renew(leases).await)
    }

    async fn release(&self, lease: &LeaseRef) -> Result<Released> {
        self.get_lock.release(lease).await
    }

    async fn inspect(&self, key: &Key) -> Result<Option<LockInfo>> {
        get_lock::inspect(&self.db, key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>> {
        list_held(self, get_lock::known_keys(&self.db, prefix).await?).await
    }
}
