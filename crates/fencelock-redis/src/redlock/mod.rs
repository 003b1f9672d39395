//! Redlock over N independent Redis masters (`redlock://h1:p1,h2:p2,…`), with a
//! fencing token that cannot go backwards and a lost-lease signal.
//!
//! # Algorithm
//!
//! - **Acquire**: run the Redis backend's acquire script on all N instances in
//!   parallel, as one operation (see the `scripts` module), each bounded by a
//!   per-instance timeout (default a fifth of the TTL, between 20 ms and 1 s).
//!   The lock is granted when at least `N/2 + 1` instances granted it and the
//!   validity `ttl − elapsed − drift` (drift = `ttl × 1 % + 2 ms`) is still
//!   positive. Otherwise the operation is undone on every instance that granted
//!   it or may have run it — exactly what it granted, never a hold that came
//!   another way (a concurrent handoff to the same waiter) — and the attempt
//!   counts as busy; waiters retry after a jittered delay, or when an instance
//!   publishes a release. A waiter's retries ask the first instance that has
//!   not failed for 10 s alone first, and the others only when it grants:
//!   waiters that all ask it first do not split the votes between them (such
//!   a round is two rounds of requests; a lead that fails costs it the
//!   instance timeout once). A waiter that heard of no release for a second
//!   asks every instance at once instead, so that a hold left on the lead
//!   alone keeps no one from a lock free on a majority for longer. A round
//!   whose votes split anyway (a first attempt meeting a waiter's round,
//!   clients that disagree on the lead, an instance that restarted empty)
//!   backs off before the next, for a random time in a window that doubles
//!   with each split (2 ms to 50 ms), after a wake-up too. A round in which
//!   too few instances answered in time (alive but slow) is retried until the
//!   caller's deadline; one in which too few can be reached fails at once (a
//!   waiter's lead round, refused by the lead, learns it within about a
//!   second, at its next round to every instance). An acquire dropped while in
//!   flight is undone in the background.
//! - **Renew** (the watchdog's batch): one script per instance for all leases;
//!   a lease stays held only if a majority renewed it within its validity.
//! - **Release**: on every instance (also those that failed a moment ago);
//!   `NotHeld` when none of the first majority of instances to answer held it
//!   (the lease had lost its majority; the others still release it). A
//!   release to the next waiter of the same `Locker` hands the lock over inside
//!   each instance's release script; the handoff counts when a majority handed
//!   it (its token settled as below), and is undone otherwise.
//! - Operations return as soon as a majority answered; the requests to the
//!   other instances still run, in the background. An instance that failed is
//!   skipped for a second, so a dead instance does not cost every operation its
//!   timeout.
//!
//! # Fencing: a quorum max-register, floored at the instances' clocks
//!
//! (Model-checked in `crates/fencelock-models/src/redlock_token.rs`, which
//! abstracts `acquire`, `propose`, `observe`, `settle_token` and the scripts'
//! `mint`: change both together; bounds in `docs/SAFETY.md`.)
//!
//! Each instance keeps a fence counter `F_i`. An instance that grants answers
//! `max(F_i + 1, its own clock in µs, p)` and stores that in `F_i`, where `p`
//! is a proposal that lets the instances agree on one value: the latest clock
//! reading an instance sent this client (every answer carries one), plus the
//! time since it arrived, plus 100 ms — or 0 without a reading of the last
//! second. **No client wall clock enters a token**: a client whose clock is
//! off by any amount proposes nothing higher than the fastest instance's clock
//! plus 100 ms (and its monotonic clock's error over a second).
//!
//! A grant that reached a majority `M` takes the **largest** answer as its
//! token `t`. If every answer was the same, the instances of `M` already store
//! `t`; otherwise `t` is written to every instance with a set-if-greater script
//! (`RAISE_FENCE`), and a majority must acknowledge before the grant counts.
//! Either way, after a grant with token `t`, a majority `W` holds `F ≥ t` — and
//! in the common case (instance clocks within 100 ms of each other) that cost
//! no extra round trip.
//!
//! A later holder's acquire majority `M'` intersects `W` (two majorities of N
//! always share an instance), and that instance answers at least `t + 1`; the
//! later token is the largest answer, so it is `> t`. Tokens strictly increase
//! across successive holders, whatever minority of instances failed, restarted
//! or missed writes in between.
//!
//! The one case the register cannot cover alone is the classic objection: an
//! instance of `W` restarting **empty**, so that a later majority meets the
//! earlier one only in that forgetful instance. The clock floor covers it:
//! every answer is at least the instance's µs clock, and no token exceeds the
//! fastest instance clock of its time by more than 100 ms. So tokens keep
//! rising provided **instance clocks never step back, and an instance
//! restarted empty rejoins no sooner than the largest difference between
//! instance clocks plus 100 ms after it went down** (tested with client clocks
//! ±5 s off: the stale holder's fenced write is rejected). Exclusion itself, as with every Redlock,
//! holds only if a restarted instance stays away for a TTL, instance clocks run
//! within the drift allowance of the client's monotonic clock, and the client
//! machine is not suspended; the fencing token is what protects the resource
//! when they do not.
//!
//! A reentrant acquire takes the largest answer too: the token of the hold it
//! adds to where every instance of its majority has that hold, a larger one
//! where an instance that missed the hold grants it anew. An instance's hold
//! of the owner may also be one a release missed (the instance was cut off),
//! older than another owner's grant since; that grant's token reached the
//! instance's fence only by its write-back, and an instance answers a hold
//! whose fence passed it since its owner last acted on it there with a new
//! token (`max(F + 1, …)`), not the old one — so the step "that instance
//! answers at least `t + 1`" above holds for such holds too. What the owner
//! last saw is the largest token of its own grants there: a write-back
//! (`RAISE_FENCE`) touches only a hold that still lists its grant and raises
//! what the hold saw to its own token, never to the fence, which may have
//! passed it by another owner's grant when the write-back arrives late (tests
//! `a_hold_left_behind_on_an_instance_never_gives_an_old_token`,
//! `a_hold_left_behind_that_a_later_fence_passed_gets_a_new_token`,
//! `a_late_write_back_of_an_owners_old_token_never_makes_its_hold_look_current`).
//!
//! **Nested holds.** Each instance keeps, per owner, one grant per hold, each
//! known by the op that made it (see `scripts`), and a lease renews and
//! releases only its own grant. So an instance that missed one of two nested
//! acquires (skipped as failed, timed out, or where the outer one fell short)
//! keeps the other hold when the nested one is released: releasing a nested
//! hold never costs the outer one an instance (test
//! `releasing_a_nested_hold_never_takes_the_outer_one_off_an_instance`; before
//! this rule, found by the torture campaign, Redlock `minority` seed 1031).
//!
//! **Known limit (liveness only).** When a waiter's own round and a handoff
//! from a guard of its own `Locker` both succeed, the guard keeps its own
//! round's grant (the same hold, counted once); instances where only the
//! handoff landed — never a majority, since the round was granted on one
//! elsewhere — keep the handed hold until its TTL ends after the release.
//!
//! # Modes
//!
//! Exclusive and shared: any reader majority and writer majority share an
//! instance, which never admits both, so readers and writers exclude each other.
//! A semaphore of N permits is **not** safe under a plain majority (three holders
//! of a 2-permit semaphore can each hold on a different majority of 5 instances),
//! so the capability says no.

mod rounds;
mod token;

use std::sync::Arc;
use std::time::Duration;

use fencelock_core::backend::{
    BackendUrl, Grant, LeaseRef, Released, Renewal, Request, async_trait, drift_allowance,
    redact_url,
};
use fencelock_core::{
    Backend, Capabilities, Error, FencingToken, HolderInfo, Key, LockInfo, Result,
};
use futures::future::join_all;
use tokio::sync::OnceCell;
use tokio::time::Instant;

use crate::node::{Attempt, Node, Op, OpIds};

/// How long a Redlock instance's release or undo is sent again on
/// connection trouble: within its round's instance timeout, so that an
/// instance out of reach counts as failed, not slow.
const REDLOCK_RESEND: Duration = Duration::from_millis(200);
use crate::options::{RedisOptions, Target};
use crate::subs::Watch;

const NAME: &str = "redlock";

/// The per-instance timeout when none is configured is a fifth of the TTL,
/// within these bounds. A round in which too few instances answer in time is
/// retried until the caller's deadline, so a loaded machine costs a delay,
/// never an "unreachable" error.
const MIN_INSTANCE_TIMEOUT: Duration = Duration::from_millis(20);
const MAX_INSTANCE_TIMEOUT: Duration = Duration::from_secs(1);

/// A token proposal is made from an instance clock reading at most this old.
const FRESH_READING: Duration = Duration::from_secs(1);

/// How far above the instances' clocks (as last read) a proposal may be:
/// enough that every instance's answer equals it even when replies take a
/// while on a loaded machine (else every grant needs a write-back round trip),
/// far below the time an instance takes to restart.
const PROPOSAL_MARGIN: Duration = Duration::from_millis(100);

/// A waiter re-tries at least this often (jittered), notifications aside.
const RETRY_DELAY: Duration = Duration::from_millis(50);

/// The first backoff window after a split vote; it doubles with each split in
/// a row, up to [`RETRY_DELAY`].
const SPLIT_BACKOFF: Duration = Duration::from_millis(2);

/// After a connection failure an instance is skipped for this long (a failed
/// instance must not cost every operation its timeout); then one call probes it.
const DOWN_FOR: Duration = Duration::from_secs(1);

/// An instance leads a waiter's round (see `attempt`) only when it has not
/// failed for this long: a lead that does not answer costs the round its
/// timeout before the others are asked.
const LEAD_AFTER_FAILURE: Duration = Duration::from_secs(10);

/// A waiter that heard of no release for this long asks every instance at
/// once, not the lead first (see `acquire`).
const LEADERLESS_AFTER: Duration = Duration::from_secs(1);

/// The most split votes a waiter remembers (its backoff window is then the
/// largest, and it fades within this many refusals by a holder).
const MAX_SPLITS: u32 = 8;

/// One instance, connected lazily: an instance that is down when the backend
/// is created joins once it answers.
struct Instance {
    url: String,
    target: Target,
    node: OnceCell<Node>,
    /// Skip the instance until then (it failed recently), and whether it was
    /// slow (timed out) rather than unreachable.
    down_until: std::sync::Mutex<Option<(Instant, bool)>>,
    /// When the instance last failed (connection trouble or no answer in time).
    failed_at: std::sync::Mutex<Option<Instant>>,
}

impl Instance {
    /// `Some(slow)` while the instance is skipped.
    fn is_down(&self) -> Option<bool> {
        let down = self.down_until.lock().unwrap_or_else(|p| p.into_inner());
        down.filter(|(t, _)| Instant::now() < *t)
            .map(|(_, slow)| slow)
    }

    fn mark(&self, failed: Option<bool>) {
        let mut down = self.down_until.lock().unwrap_or_else(|p| p.into_inner());
        *down = failed.map(|slow| (Instant::now() + DOWN_FOR, slow));
        if failed.is_some() {
            *self.failed_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        }
    }

    /// Whether the instance may lead a waiter's round: it has not failed for
    /// [`LEAD_AFTER_FAILURE`].
    fn may_lead(&self) -> bool {
        self.failed_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none_or(|t| t.elapsed() >= LEAD_AFTER_FAILURE)
    }
}

/// Redlock over N independent Redis masters. Clones share the connections.
#[derive(Clone)]
pub struct RedlockBackend {
    inner: Arc<Inner>,
}

struct Inner {
    instances: Vec<Instance>,
    options: RedisOptions,
    instance_timeout: Option<Duration>,
    address: String,
    /// The latest instance clock reading (µs) and when it arrived.
    reading: std::sync::Mutex<Option<(u64, Instant)>>,
    ops: OpIds,
}

/// What one instance answered.
enum Answer<T> {
    Ok(T),
    Failed(Error),
    /// No answer within the instance timeout (alive but slow, or cut off).
    Late(Error),
}

impl<T> Answer<T> {
    fn error(&self) -> Option<&Error> {
        match self {
            Answer::Ok(_) => None,
            Answer::Failed(e) | Answer::Late(e) => Some(e),
        }
    }
}

/// The operations that run on every instance at once on the hot path.
enum Call {
    Acquire(Request, u64, Op),
    Release(LeaseRef, Option<Request>, u64, Op),
}

/// An instance's answer to an [`Op`].
enum OpAnswer {
    Acquire(Attempt),
    /// Holds left, the handed token, the instance's clock (µs).
    Release(i64, u64, u64),
}

impl Call {
    async fn run(&self, node: &Node) -> Result<OpAnswer> {
        match self {
            Call::Acquire(req, proposal, op) => node
                .attempt(req, *proposal, Duration::ZERO, op, true, None)
                .await
                .map(OpAnswer::Acquire),
            Call::Release(lease, next, proposal, op) => node
                .release(lease, next.as_ref(), *proposal, op)
                .await
                .map(|(left, handed, at)| OpAnswer::Release(left, handed, at)),
        }
    }
}

/// Whether an operation skips instances that failed a moment ago.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Skip {
    /// Skip them (acquire rounds, renewals, reads: an answer is not needed).
    Down,
    /// Send to every instance (releases and undos).
    Never,
}

/// The outcome of one Redlock round.
enum Round {
    Granted(Grant),
    /// Refused by enough instances; retry after about this long. `split`:
    /// some instances granted it, too few (most often other waiters' requests
    /// took the rest; also when an instance missed a holder's hold).
    Busy {
        hint: Duration,
        split: bool,
    },
    /// Too few instances answered; `slow` when some did not answer in time
    /// (then the round is retried until the caller's deadline).
    NoQuorum {
        error: Error,
        slow: bool,
    },
}

/// An acquire op in flight on the instances. If the caller drops it before
/// its outcome was taken, a spawned task undoes the op on every instance (see
/// `scripts`: exactly what it granted, and nothing should it arrive later).
struct Pending {
    backend: Option<RedlockBackend>,
    key: Key,
    owner: String,
    op: Op,
}

impl Pending {
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
                let all: Vec<usize> = (0..b.inner.instances.len()).collect();
                b.undo(&key, &owner, &op, &all, b.timeout_for(None)).await;
            }));
        }
    }
}

impl Inner {
    /// Runs `f` on instance `i` (connecting it first if needed), each step
    /// bounded by `timeout`; with `skip`, skips an instance that failed within
    /// [`DOWN_FOR`] (acquire rounds, which need not wait for it); marks it down
    /// when it fails now. Releases and undos never skip: they must reach every
    /// instance the request may have reached.
    async fn run_on<'a, T, Fut>(
        &'a self,
        i: usize,
        timeout: Duration,
        skip: Skip,
        f: impl FnOnce(&'a Node) -> Fut,
    ) -> Answer<T>
    where
        Fut: Future<Output = Result<T>> + 'a,
    {
        let inst = &self.instances[i];
        if let (Skip::Down, Some(slow)) = (skip, inst.is_down()) {
            let e = Error::connection(
                NAME,
                &inst.url,
                format!("it failed within the last {DOWN_FOR:?}"),
            );
            return if slow {
                Answer::Late(e)
            } else {
                Answer::Failed(e)
            };
        }
        let open = inst.node.get_or_try_init(|| async {
            // Releases and undos: three sends at most, 50 and 100 ms apart.
            let node = Node::open(&inst.url, &inst.target, &self.options).await?;
            Ok::<_, Error>(node.with_patience(REDLOCK_RESEND))
        });
        let answer = match tokio::time::timeout(timeout, open).await {
            Ok(Ok(node)) => match tokio::time::timeout(timeout, f(node)).await {
                Ok(Ok(v)) => Answer::Ok(v),
                Ok(Err(e)) => Answer::Failed(e),
                Err(_) => Answer::Late(Error::connection(
                    NAME,
                    &node.address,
                    format!("no answer within the instance timeout of {timeout:?}"),
                )),
            },
            Ok(Err(e)) => Answer::Failed(e),
            Err(_) => Answer::Late(Error::connection(
                NAME,
                &inst.url,
                format!("no answer within {timeout:?}"),
            )),
        };
        // Only connection trouble marks an instance down; a script error is an answer.
        inst.mark(match &answer {
            Answer::Late(_) => Some(true),
            Answer::Failed(e) if e.is_transient() => Some(false),
            _ => None,
        });
        answer
    }
}

impl RedlockBackend {
    /// Connects to the instances a `redlock://[user:pass@]h1:p1,h2:p2,…[?opts]`
    /// URL names (at least 3). Options as for Redis (`prefix`, `ttl`, `timeout`,
    /// `connect_timeout`, `tls_ca`) plus `instance_timeout=` (default a fifth
    /// of the TTL, between 20 ms and 1 s).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a bad URL or fewer than 3 instances;
    /// [`Error::Connection`] if fewer than a majority of instances answer.
    pub async fn connect(url: &str) -> Result<RedlockBackend> {
        let mut u = BackendUrl::parse("redlock", url, &["redlock", "rediss+redlock"])?;
        let instance_timeout = u.take_duration("instance_timeout")?;
        let (instances, options) = instances_of(&u)?;
        let backend = RedlockBackend {
            inner: Arc::new(Inner {
                instances,
                options,
                instance_timeout,
                address: redact_url(u.base()),
                reading: std::sync::Mutex::new(None),
                ops: OpIds::new(),
            }),
        };
        backend.connect_majority().await?;
        Ok(backend)
    }

    /// Connects to every instance now; fails unless a majority answers (a
    /// minority may be down and join later).
    async fn connect_majority(&self) -> Result<()> {
        let answers = self
            .on_all(Duration::from_secs(5), Skip::Never, |_, _| async { Ok(()) })
            .await;
        let up = answers
            .iter()
            .filter(|a| matches!(a, Answer::Ok(())))
            .count();
        if up >= self.quorum() {
            return Ok(());
        }
        let why = answers
            .iter()
            .find_map(|a| a.error().map(ToString::to_string))
            .unwrap_or_default();
        Err(Error::connection(
            NAME,
            &self.inner.address,
            format!(
                "only {up} of {} instances answer, a majority is {} ({why})",
                answers.len(),
                self.quorum()
            ),
        ))
    }

    /// How many instances make a majority.
    pub fn quorum(&self) -> usize {
        self.inner.instances.len() / 2 + 1
    }

    /// Deletes every hold of `key` on every instance (an operator breaking a lock).
    ///
    /// # Errors
    ///
    /// A connection error if no instance could be reached.
    pub async fn force_release(&self, key: &Key) -> Result<()> {
        let answers = self
            .on_all(self.timeout_for(None), Skip::Never, |_, n| {
                n.force_release(key)
            })
            .await;
        if answers.iter().any(|a| matches!(a, Answer::Ok(()))) {
            Ok(())
        } else {
            Err(self.no_quorum(0, &answers))
        }
    }

    fn timeout_for(&self, ttl: Option<Duration>) -> Duration {
        self.inner.instance_timeout.unwrap_or_else(|| {
            ttl.map_or(MAX_INSTANCE_TIMEOUT, |t| {
                (t / 5).clamp(MIN_INSTANCE_TIMEOUT, MAX_INSTANCE_TIMEOUT)
            })
        })
    }
}

#[async_trait]
impl Backend for RedlockBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::NONE
            .with_fencing(true)
            .with_shared(true)
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
        match self.attempt(req, false).await? {
            Round::Granted(g) => Ok(Some(g)),
            Round::Busy { .. } => Ok(None),
            Round::NoQuorum { error, .. } => Err(error),
        }
    }

    async fn acquire(&self, req: &Request, deadline: Option<Instant>) -> Result<Option<Grant>> {
        // What to do after a round: stop with a result, or wait about this
        // long (and whether the round was a split vote).
        let after =
            |round: Round| -> Result<std::ops::ControlFlow<Option<Grant>, (Duration, bool)>> {
                use std::ops::ControlFlow::{Break, Continue};
                let next = match round {
                    Round::Granted(g) => return Ok(Break(Some(g))),
                    Round::Busy { hint, split } => (hint, split),
                    // Instances alive but slow (a loaded machine, a slow link): try
                    // again until the deadline. Unreachable ones fail at once.
                    Round::NoQuorum { error, slow } => {
                        if !slow || deadline.is_some_and(|d| Instant::now() >= d) {
                            return Err(error);
                        }
                        tracing::debug!(key = %req.key, %error, "too few instances answered in time; retrying");
                        (RETRY_DELAY, false)
                    }
                };
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Ok(Break(None));
                }
                Ok(Continue(next))
            };
        let (_, split) = match after(self.attempt(req, false).await?)? {
            std::ops::ControlFlow::Break(g) => return Ok(g),
            std::ops::ControlFlow::Continue(next) => next,
        };
        // Wake on a release published by any instance, or after a jittered delay
        // (so that competing clients do not retry in lock-step and split the vote).
        let watches = self.watches(&req.key).await;
        // Split votes. Every waiter woken by one release asks every instance
        // at once, and their requests split the votes (undoing them publishes
        // more wake-ups). After a split a waiter backs off for a random time in
        // a window that doubles with each split, as on a shared Ethernet, so
        // that one of them soon asks alone; before asking again after a wake-up,
        // too, while the splits it saw have not faded.
        let mut splits = u32::from(split);
        // When this waiter last heard of a release.
        let mut news = Instant::now();
        loop {
            if splits > 0 {
                let window = SPLIT_BACKOFF
                    .saturating_mul(1 << (splits - 1))
                    .min(RETRY_DELAY);
                let pause = Duration::from_micros(fastrand::u64(0..=window.as_micros() as u64));
                let mut until = Instant::now() + pause;
                if let Some(d) = deadline {
                    until = until.min(d);
                }
                tokio::time::sleep_until(until).await;
            }
            let mut notified: Vec<_> = watches
                .iter()
                .map(|w| Box::pin(w.notify.notified()))
                .collect();
            for n in &mut notified {
                n.as_mut().enable();
            }
            // A waiter asks the lead instance first (see `attempt`), but every
            // instance at once when it heard of no release for a while, so
            // that a hold left on the lead alone (a holder killed mid-round,
            // an undo that did not reach it) keeps no one waiting for long.
            let lead_first = news.elapsed() < LEADERLESS_AFTER;
            if !lead_first {
                news = Instant::now();
            }
            let (hint, split) = match after(self.attempt(req, lead_first).await?)? {
                std::ops::ControlFlow::Break(g) => return Ok(g),
                std::ops::ControlFlow::Continue(next) => next,
            };
            if split {
                splits = (splits + 1).min(MAX_SPLITS);
                continue;
            }
            // Refused by a holder: the contention it learned fades slowly, so
            // that the rush after the next release is spread too.
            splits = splits.saturating_sub(1);
            let max = RETRY_DELAY.as_micros() as u64;
            let jitter = Duration::from_micros(fastrand::u64(max / 2..=max));
            let mut until = Instant::now() + hint.min(jitter).max(Duration::from_millis(1));
            if let Some(d) = deadline {
                until = until.min(d);
            }
            let any = async {
                if notified.is_empty() {
                    std::future::pending::<()>().await;
                } else {
                    futures::future::select_all(notified).await;
                }
            };
            tokio::select! {
                _ = any => news = Instant::now(),
                _ = tokio::time::sleep_until(until) => {}
            }
        }
    }

    async fn renew(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
        let start = Instant::now();
        let min_ttl = leases
            .iter()
            .map(|l| l.ttl)
            .min()
            .unwrap_or(MAX_INSTANCE_TIMEOUT);
        let answers = self
            .on_all(self.timeout_for(Some(min_ttl)), Skip::Down, |_, n| {
                n.renew(leases)
            })
            .await;
        let n = self.inner.instances.len();
        let mut out = Vec::with_capacity(leases.len());
        for (i, lease) in leases.iter().enumerate() {
            let held = answers
                .iter()
                .filter(|a| matches!(a, Answer::Ok(v) if v[i]))
                .count();
            let denied = answers
                .iter()
                .filter(|a| matches!(a, Answer::Ok(v) if !v[i]))
                .count();
            let in_time = start.elapsed() + drift_allowance(lease.ttl) < lease.ttl;
            if held >= self.quorum() && in_time {
                out.push(Renewal::Held { ttl: lease.ttl });
            } else if denied > n - self.quorum() || (held >= self.quorum() && !in_time) {
                out.push(Renewal::Lost {
                    reason: format!(
                        "renewed on {held} of {n} instances, a majority is {}",
                        self.quorum()
                    ),
                });
            } else {
                // Too few answers either way: nothing is known about it.
                out.push(Renewal::Unknown {
                    reason: self.no_quorum(held, &answers).to_string(),
                });
            }
        }
        Ok(out)
    }

    async fn release(&self, lease: &LeaseRef) -> Result<Released> {
        Ok(self.release_on_all(lease, None).await?.0)
    }

    async fn release_to(
        &self,
        lease: &LeaseRef,
        next: &Request,
    ) -> Result<(Released, Option<Grant>)> {
        self.release_on_all(lease, Some(next)).await
    }

    async fn inspect(&self, key: &Key) -> Result<Option<LockInfo>> {
        let answers = self
            .on_all(self.timeout_for(None), Skip::Down, |_, n| n.inspect(key))
            .await;
        let infos: Vec<LockInfo> = answers
            .into_iter()
            .filter_map(|a| match a {
                Answer::Ok(Some(i)) => Some(i),
                _ => None,
            })
            .collect();
        if infos.is_empty() {
            return Ok(None);
        }
        // A holder counts if a majority of instances has it.
        let mut holders: Vec<HolderInfo> = Vec::new();
        for info in &infos {
            for h in &info.holders {
                let on = infos
                    .iter()
                    .filter(|i| i.holders.iter().any(|x| x.owner == h.owner))
                    .count();
                if on >= self.quorum() && !holders.iter().any(|x| x.owner == h.owner) {
                    // The token a majority holds (at least): the guard's. An
                    // instance that granted after the majority answered may
                    // hold a later one of its own.
                    let mut tokens: Vec<_> = infos
                        .iter()
                        .flat_map(|i| {
                            i.holders
                                .iter()
                                .filter(|x| x.owner == h.owner)
                                .map(|x| x.token)
                        })
                        .collect();
                    tokens.sort_unstable_by(|a, b| b.cmp(a));
                    let token = tokens.get(self.quorum() - 1).copied().flatten();
                    holders.push(HolderInfo::new(
                        h.owner.clone(),
                        h.mode,
                        h.holds,
                        token,
                        h.expires_in,
                    ));
                }
            }
        }
        let last = infos.iter().filter_map(|i| i.last_token).max();
        Ok(Some(LockInfo::new(key.as_str(), holders, last)))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>> {
        let answers = self
            .on_all(self.timeout_for(None), Skip::Down, |_, n| {
                n.keys_under(prefix)
            })
            .await;
        let mut keys: Vec<String> = answers
            .into_iter()
            .filter_map(|a| match a {
                Answer::Ok(k) => Some(k),
                _ => None,
            })
            .flatten()
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

impl std::fmt::Debug for RedlockBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedlockBackend")
            .field("address", &self.inner.address)
            .field("instances", &self.inner.instances.len())
            .finish()
    }
}

/// The instances a `redlock://` URL names (at least 3), each with the Redis
/// URL it is reached by (the login as written, and the options left in `u`,
/// which are every instance's), and those options.
fn instances_of(u: &BackendUrl) -> Result<(Vec<Instance>, RedisOptions)> {
    let scheme = if u.scheme().starts_with("rediss+") {
        "rediss"
    } else {
        "redis"
    };
    let query = u.rest().join("&");
    // The login as written (still percent-encoded), for each instance's URL.
    let base = u.base();
    let authority = base[u.scheme().len() + 3..].split('/').next().unwrap_or("");
    let auth = authority.rfind('@').map_or("", |at| &authority[..=at]);
    let hosts: Vec<&str> = u.hosts().collect();
    if hosts.len() < 3 {
        return Err(Error::config(format!(
            "redlock needs at least 3 independent instances, {:?} names {}",
            u.redacted(),
            hosts.len()
        )));
    }
    let mut instances = Vec::new();
    let mut options = RedisOptions::default();
    for h in &hosts {
        let url = format!("{scheme}://{auth}{h}?{query}");
        let (target, opts) = crate::options::parse_url(&url)?;
        options = opts;
        instances.push(Instance {
            url,
            target,
            node: OnceCell::new(),
            down_until: std::sync::Mutex::new(None),
            failed_at: std::sync::Mutex::new(None),
        });
    }
    Ok((instances, options))
}
