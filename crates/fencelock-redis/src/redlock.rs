//! Redlock over N independent Redis masters (`redlock://h1:p1,h2:p2,…`), with a
//! fencing token that cannot go backwards and a lost-lease signal.
//!
//! # Algorithm
//!
//! - **Acquire**: run the Redis backend's acquire script on all N instances in
//!   parallel, each bounded by a per-instance timeout far below the TTL (default
//!   `min(ttl/10, 100 ms)`). The lock is granted when at least `N/2 + 1`
//!   instances granted it and the validity `ttl − elapsed − drift` (drift =
//!   `ttl × 1 % + 2 ms`) is still positive. Otherwise every instance that granted
//!   (or did not answer) is released and the attempt counts as busy; waiters
//!   retry after a jittered delay, or at once when an instance publishes a
//!   release.
//! - **Renew** (the watchdog's batch): one script per instance for all leases;
//!   a lease stays held only if a majority renewed it within its validity.
//! - **Release**: on every instance; `NotHeld` only if no instance held it. A
//!   release to the next waiter of the same `Locker` hands the lock over inside
//!   each instance's release script; the handoff counts when a majority handed
//!   it (its token settled as below), and is undone otherwise.
//! - Operations return as soon as a majority answered; the requests to the
//!   other instances still run, in the background. An instance that failed is
//!   skipped for a second, so a dead instance does not cost every operation its
//!   timeout.
//!
//! # Fencing: a quorum max-register
//!
//! Each instance keeps a fence counter `F_i`. The client proposes a floor `p`
//! (its clock in µs plus one second for skew, rising per client); an instance
//! that grants answers `max(F_i + 1, its own clock in µs, p)` and stores that in
//! `F_i`. A grant that reached a majority `M` takes the **largest** answer as its
//! token `t`. If every answer was `p`, the instances of `M` already store `t`;
//! otherwise `t` is written to every instance with a set-if-greater script
//! (`RAISE_FENCE`), and a majority must acknowledge before the grant counts.
//! Either way, after a grant with token `t`, a majority `W` holds `F ≥ t` — and
//! in the common case that cost no extra round trip.
//!
//! A later holder's acquire majority `M'` intersects `W` (two majorities of N
//! always share an instance), and that instance answers at least `t + 1`; the
//! later token is the largest answer, so it is `> t`. Tokens strictly increase
//! across successive holders, whatever minority of instances failed, restarted
//! or missed writes in between.
//!
//! The one case the register cannot cover alone is the classic objection: an
//! instance of `W` restarting **empty** during a hold, so that the later majority
//! meets the earlier one only in that forgetful instance. The clock floor covers
//! it: every answer is at least the instance's µs clock, so a later grant gets a
//! larger token as long as instance clocks do not step back (tested: the stale
//! holder's fenced write is rejected). Exclusion itself, as with every Redlock,
//! is only safe if restarted instances stay away for a TTL; the fencing token is
//! what protects the resource when it is not.
//!
//! # Modes
//!
//! Exclusive and shared: any reader majority and writer majority share an
//! instance, which never admits both, so readers and writers exclude each other.
//! A semaphore of N permits is **not** safe under a plain majority (three holders
//! of a 2-permit semaphore can each hold on a different majority of 5 instances),
//! so the capability says no.

use std::sync::Arc;
use std::time::Duration;

use fencelock_core::{
    Backend, Capabilities, Error, FencingToken, Grant, HolderInfo, Key, LeaseRef, LockInfo,
    Released, Renewal, Request, Result, async_trait, drift_allowance, redact_url,
};
use futures::future::join_all;
use tokio::sync::OnceCell;
use tokio::time::Instant;

use crate::node::{Attempt, Node};
use crate::options::{RedisOptions, Target};
use crate::subs::Watch;

const NAME: &str = "redlock";

/// The longest per-instance timeout when none is configured.
const DEFAULT_INSTANCE_TIMEOUT: Duration = Duration::from_millis(100);

/// A waiter re-tries at least this often (jittered), notifications aside.
const RETRY_DELAY: Duration = Duration::from_millis(50);

/// After a connection failure an instance is skipped for this long (a failed
/// instance must not cost every operation its timeout); then one call probes it.
const DOWN_FOR: Duration = Duration::from_secs(1);

/// One instance, connected lazily: an instance that is down when the backend
/// is created joins once it answers.
struct Instance {
    url: String,
    target: Target,
    node: OnceCell<Node>,
    /// Skip the instance until then (it failed recently).
    down_until: std::sync::Mutex<Option<Instant>>,
}

impl Instance {
    fn is_down(&self) -> bool {
        let down = self.down_until.lock().unwrap_or_else(|p| p.into_inner());
        down.is_some_and(|t| Instant::now() < t)
    }

    fn mark(&self, ok: bool) {
        let mut down = self.down_until.lock().unwrap_or_else(|p| p.into_inner());
        *down = (!ok).then(|| Instant::now() + DOWN_FOR);
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
    /// The last token floor this client proposed.
    last_proposal: std::sync::atomic::AtomicU64,
}

/// What one instance answered.
enum Answer<T> {
    Ok(T),
    Failed(Error),
}

/// The operations that run on every instance at once on the hot path.
enum Op {
    Acquire(Request, u64),
    Release(LeaseRef, Option<Request>, u64),
}

/// An instance's answer to an [`Op`].
enum OpAnswer {
    Acquire(Attempt),
    Release(i64, u64),
}

impl Op {
    async fn run(&self, node: &Node) -> Result<OpAnswer> {
        match self {
            Op::Acquire(req, proposal) => node
                .attempt(req, *proposal, Duration::ZERO)
                .await
                .map(OpAnswer::Acquire),
            Op::Release(lease, next, proposal) => node
                .release(lease, next.as_ref(), *proposal)
                .await
                .map(|(left, handed)| OpAnswer::Release(left, handed)),
        }
    }
}

impl Inner {
    /// Runs `f` on instance `i` (connecting it first if needed), each step
    /// bounded by `timeout`; skips an instance that failed within [`DOWN_FOR`],
    /// and marks it down when it fails now.
    async fn run_on<'a, T, Fut>(
        &'a self,
        i: usize,
        timeout: Duration,
        f: impl FnOnce(&'a Node) -> Fut,
    ) -> Answer<T>
    where
        Fut: Future<Output = Result<T>> + 'a,
    {
        let inst = &self.instances[i];
        if inst.is_down() {
            return Answer::Failed(Error::connection(
                NAME,
                &inst.url,
                format!("it failed within the last {DOWN_FOR:?}"),
            ));
        }
        let open = inst
            .node
            .get_or_try_init(|| Node::open(&inst.url, &inst.target, &self.options));
        let answer = match tokio::time::timeout(timeout, open).await {
            Ok(Ok(node)) => match tokio::time::timeout(timeout, f(node)).await {
                Ok(Ok(v)) => Answer::Ok(v),
                Ok(Err(e)) => Answer::Failed(e),
                Err(_) => Answer::Failed(Error::connection(
                    NAME,
                    &node.address,
                    format!("no answer within the instance timeout of {timeout:?}"),
                )),
            },
            Ok(Err(e)) => Answer::Failed(e),
            Err(_) => Answer::Failed(Error::connection(
                NAME,
                &inst.url,
                format!("no answer within {timeout:?}"),
            )),
        };
        // Only connection trouble marks an instance down; a script error is an answer.
        inst.mark(!matches!(&answer, Answer::Failed(e) if e.is_transient()));
        answer
    }
}

impl RedlockBackend {
    /// Connects to the instances a `redlock://[user:pass@]h1:p1,h2:p2,…[?opts]`
    /// URL names (at least 3). Options as for Redis (`prefix`, `ttl`, `timeout`,
    /// `connect_timeout`, `tls_ca`) plus `instance_timeout=` (default
    /// `min(ttl/10, 100 ms)`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a bad URL or fewer than 3 instances;
    /// [`Error::Connection`] if fewer than a majority of instances answer.
    pub async fn connect(url: &str) -> Result<RedlockBackend> {
        let (rest, query) = match url.split_once('?') {
            Some((r, q)) => (r, q),
            None => (url, ""),
        };
        let body = rest
            .strip_prefix("redlock://")
            .or_else(|| rest.strip_prefix("rediss+redlock://"))
            .ok_or_else(|| Error::config(format!("{:?} is not a redlock URL", redact_url(url))))?;
        let scheme = if rest.starts_with("rediss+") {
            "rediss"
        } else {
            "redis"
        };
        let mut instance_timeout = None;
        let mut passthrough = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("instance_timeout", v)) => {
                    instance_timeout = Some(humantime::parse_duration(v).map_err(|e| {
                        Error::config(format!(
                            "redlock option instance_timeout={v:?}: {e}; write e.g. 50ms"
                        ))
                    })?)
                }
                _ => passthrough.push(pair),
            }
        }
        let (auth, hosts) = match body.rfind('@') {
            Some(at) => (&body[..=at], &body[at + 1..]),
            None => ("", body),
        };
        let hosts: Vec<&str> = hosts
            .trim_end_matches('/')
            .split(',')
            .filter(|h| !h.is_empty())
            .collect();
        if hosts.len() < 3 {
            return Err(Error::config(format!(
                "redlock needs at least 3 independent instances, {:?} names {}",
                redact_url(url),
                hosts.len()
            )));
        }
        let query = passthrough.join("&");
        let mut instances = Vec::new();
        let mut options = None;
        for h in &hosts {
            let node_url = format!("{scheme}://{auth}{h}?{query}");
            let (target, opts) = crate::options::parse_url(&node_url)?;
            options = Some(opts);
            instances.push(Instance {
                url: node_url,
                target,
                node: OnceCell::new(),
                down_until: std::sync::Mutex::new(None),
            });
        }
        let options = options.unwrap_or_default();
        let backend = RedlockBackend {
            inner: Arc::new(Inner {
                instances,
                options,
                instance_timeout,
                address: redact_url(rest),
                last_proposal: std::sync::atomic::AtomicU64::new(0),
            }),
        };
        // Connect now; a minority may be down and join later.
        let answers = backend
            .on_all(Duration::from_secs(5), |_, _| async { Ok(()) })
            .await;
        let up = answers
            .iter()
            .filter(|a| matches!(a, Answer::Ok(())))
            .count();
        if up < backend.quorum() {
            let why = answers
                .into_iter()
                .find_map(|a| match a {
                    Answer::Failed(e) => Some(e.to_string()),
                    Answer::Ok(()) => None,
                })
                .unwrap_or_default();
            return Err(Error::connection(
                NAME,
                rest,
                format!(
                    "only {up} of {} instances answer, a majority is {} ({why})",
                    hosts.len(),
                    backend.quorum()
                ),
            ));
        }
        Ok(backend)
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
            .on_all(self.timeout_for(None), |_, n| n.force_release(key))
            .await;
        if answers.iter().any(|a| matches!(a, Answer::Ok(()))) {
            Ok(())
        } else {
            Err(self.no_quorum(0, &answers))
        }
    }

    fn timeout_for(&self, ttl: Option<Duration>) -> Duration {
        self.inner.instance_timeout.unwrap_or_else(|| {
            ttl.map_or(DEFAULT_INSTANCE_TIMEOUT, |t| {
                (t / 10).min(DEFAULT_INSTANCE_TIMEOUT)
            })
        })
    }

    /// Runs `f(index, node)` on every instance in parallel, each bounded by
    /// `timeout`; an instance that failed within [`DOWN_FOR`] is skipped.
    async fn on_all<'a, T, F, Fut>(&'a self, timeout: Duration, f: F) -> Vec<Answer<T>>
    where
        F: Fn(usize, &'a Node) -> Fut,
        Fut: Future<Output = Result<T>> + 'a,
    {
        let f = &f;
        let inner = &*self.inner;
        join_all(
            (0..inner.instances.len()).map(|i| inner.run_on(i, timeout, move |node| f(i, node))),
        )
        .await
    }

    /// Runs `op` on every instance in parallel and returns as soon as a
    /// majority answered with `success` (or everyone answered). The calls still
    /// running are moved to a background task, so every instance gets the
    /// request and its reply is handled (a late grant is renewed and released
    /// like the others).
    async fn on_quorum(
        &self,
        timeout: Duration,
        op: Op,
        success: fn(&OpAnswer) -> bool,
    ) -> Vec<Option<Answer<OpAnswer>>> {
        use futures::stream::{FuturesUnordered, StreamExt};
        let n = self.inner.instances.len();
        let op = Arc::new(op);
        let mut calls: FuturesUnordered<_> = (0..n)
            .map(|i| {
                let (inner, op) = (self.inner.clone(), op.clone());
                async move { (i, inner.run_on(i, timeout, |node| op.run(node)).await) }
            })
            .collect();
        let mut out: Vec<Option<Answer<OpAnswer>>> = (0..n).map(|_| None).collect();
        let mut ok = 0;
        while let Some((i, answer)) = calls.next().await {
            if matches!(&answer, Answer::Ok(a) if success(a)) {
                ok += 1;
            }
            out[i] = Some(answer);
            if ok >= self.quorum() {
                break;
            }
        }
        if !calls.is_empty() {
            tokio::spawn(async move { while calls.next().await.is_some() {} });
        }
        out
    }

    fn no_quorum<'a, T: 'a>(
        &self,
        ok: usize,
        answers: impl IntoIterator<Item = &'a Answer<T>>,
    ) -> Error {
        let failed: Vec<String> = answers
            .into_iter()
            .filter_map(|a| match a {
                Answer::Failed(e) => Some(e.to_string()),
                Answer::Ok(_) => None,
            })
            .collect();
        Error::connection(
            NAME,
            &self.inner.address,
            format!(
                "no quorum: {ok} of {} instances agreed, a majority is {}; {} failed ({})",
                self.inner.instances.len(),
                self.quorum(),
                failed.len(),
                failed.first().cloned().unwrap_or_default()
            ),
        )
    }

    /// A floor for the next token, proposed to every instance so that they can
    /// agree on it in the same round trip: this client's clock in µs plus a
    /// second of allowance for clock skew, strictly rising per client.
    fn propose(&self) -> u64 {
        let now = fencelock_core::clock::wall_now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        let want = now + 1_000_000;
        let prev = self
            .inner
            .last_proposal
            .fetch_max(want, std::sync::atomic::Ordering::Relaxed);
        if prev >= want {
            self.inner
                .last_proposal
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                + 1
        } else {
            want
        }
    }

    /// Turns the answers of a majority into the grant's token (the quorum
    /// max-register): the largest answer. If every answer is the proposal, the
    /// majority already stored it; otherwise it is written back to a majority.
    /// `None` if that write-back did not reach a majority.
    async fn settle_token(
        &self,
        req: &Request,
        answers: &[u64],
        proposal: u64,
        timeout: Duration,
    ) -> Option<u64> {
        let token = answers.iter().copied().max()?;
        if answers.iter().all(|t| *t == proposal) {
            return Some(token);
        }
        let raised = self
            .on_all(timeout, |_, n| {
                n.raise_fence(&req.key, req.owner.as_str(), token)
            })
            .await;
        let acks = raised
            .iter()
            .filter(|a| matches!(a, Answer::Ok(())))
            .count();
        (acks >= self.quorum()).then_some(token)
    }

    /// Releases `owner`'s hold on the instances listed in `on` (undoing a grant
    /// that did not reach a majority).
    async fn undo(&self, req: &Request, on: &[usize], timeout: Duration) {
        if on.is_empty() {
            return;
        }
        let lease = LeaseRef::new(req, &Grant::new(None, req.ttl, 1, Instant::now()));
        let lease = &lease;
        let _ = self
            .on_all(timeout, |i, n| async move {
                if on.contains(&i) {
                    n.release(lease, None, 0).await.map(|_| ())
                } else {
                    Ok(())
                }
            })
            .await;
    }

    /// One Redlock attempt: `Ok(Ok(grant))`, `Ok(Err(hint))` when busy (time until
    /// the first holder expires), or a no-quorum error when too few instances answer.
    async fn attempt(&self, req: &Request) -> Result<std::result::Result<Grant, Duration>> {
        let start = Instant::now();
        let timeout = self.timeout_for(Some(req.ttl));
        let proposal = self.propose();
        let answers = self
            .on_quorum(timeout, Op::Acquire(req.clone(), proposal), |a| {
                matches!(a, OpAnswer::Acquire(Attempt::Granted { .. }))
            })
            .await;
        let mut granted = Vec::new();
        let mut busy = 0;
        let mut hint = Duration::MAX;
        for (i, a) in answers.iter().enumerate() {
            match a {
                Some(Answer::Ok(OpAnswer::Acquire(Attempt::Granted { token, holds }))) => {
                    granted.push((i, *token, *holds))
                }
                Some(Answer::Ok(OpAnswer::Acquire(Attempt::Busy { left }))) => {
                    busy += 1;
                    hint = hint.min(*left);
                }
                Some(Answer::Failed(Error::InvalidConfig(m))) => {
                    return Err(Error::InvalidConfig(m.clone()));
                }
                _ => {}
            }
        }
        let valid = |at: Instant| at.duration_since(start) + drift_allowance(req.ttl) < req.ttl;
        if granted.len() >= self.quorum() && valid(Instant::now()) {
            let tokens: Vec<u64> = granted.iter().map(|(_, t, _)| *t).collect();
            if let Some(token) = self.settle_token(req, &tokens, proposal, timeout).await
                && valid(Instant::now())
            {
                let holds = granted.iter().map(|(_, _, h)| *h).max().unwrap_or(1);
                return Ok(Ok(Grant::new(
                    Some(FencingToken::new(token)),
                    req.ttl,
                    holds,
                    start,
                )));
            }
        }
        // Not granted: undo where it was (or may have been) granted.
        let undo: Vec<usize> = answers
            .iter()
            .enumerate()
            .filter(|(_, a)| match a {
                Some(Answer::Ok(OpAnswer::Acquire(Attempt::Granted { .. }))) => true,
                // A reentrant request must not take away a hold it had before.
                Some(Answer::Failed(_)) | None => !req.reentrant,
                Some(Answer::Ok(_)) => false,
            })
            .map(|(i, _)| i)
            .collect();
        self.undo(req, &undo, timeout).await;
        if granted.len() + busy < self.quorum() {
            return Err(self.no_quorum(granted.len() + busy, answers.iter().flatten()));
        }
        Ok(Err(if hint == Duration::MAX {
            RETRY_DELAY
        } else {
            hint
        }))
    }

    /// Releases `lease` on every instance; with `next`, each instance that lets
    /// the lock go hands it to `next` in the same script. The handoff counts if
    /// a majority handed it over within the validity (its token settled as for
    /// an acquire); otherwise it is undone and `next` waits on as usual.
    async fn release_on_all(
        &self,
        lease: &LeaseRef,
        next: Option<&Request>,
    ) -> Result<(Released, Option<Grant>)> {
        let start = Instant::now();
        let timeout = self.timeout_for(Some(lease.ttl));
        let proposal = if next.is_some() { self.propose() } else { 0 };
        let op = Op::Release(lease.clone(), next.cloned(), proposal);
        // With a handoff, a majority must hand over; without, a majority must answer.
        let success: fn(&OpAnswer) -> bool = if next.is_some() {
            |a| matches!(a, OpAnswer::Release(_, handed) if *handed > 0)
        } else {
            |a| matches!(a, OpAnswer::Release(..))
        };
        let answers = self.on_quorum(timeout, op, success).await;
        let left: Vec<i64> = answers
            .iter()
            .filter_map(|a| match a {
                Some(Answer::Ok(OpAnswer::Release(left, _))) => Some(*left),
                _ => None,
            })
            .collect();
        if left.is_empty() {
            return Err(self.no_quorum(0, answers.iter().flatten()));
        }
        let released = match left.iter().copied().max() {
            Some(l) if l >= 0 => Released::new(l as u32),
            _ => {
                return Err(Error::NotHeld {
                    key: lease.key.to_string(),
                    owner: lease.owner.to_string(),
                });
            }
        };
        let Some(next) = next else {
            return Ok((released, None));
        };
        let handed: Vec<(usize, u64)> = answers
            .iter()
            .enumerate()
            .filter_map(|(i, a)| match a {
                Some(Answer::Ok(OpAnswer::Release(_, t))) if *t > 0 => Some((i, *t)),
                _ => None,
            })
            .collect();
        if handed.is_empty() {
            return Ok((released, None));
        }
        let valid = start.elapsed() + drift_allowance(next.ttl) < next.ttl;
        if handed.len() >= self.quorum() && valid {
            let tokens: Vec<u64> = handed.iter().map(|(_, t)| *t).collect();
            if let Some(token) = self.settle_token(next, &tokens, proposal, timeout).await {
                return Ok((
                    released,
                    Some(Grant::new(
                        Some(FencingToken::new(token)),
                        next.ttl,
                        1,
                        start,
                    )),
                ));
            }
        }
        let on: Vec<usize> = handed.iter().map(|(i, _)| *i).collect();
        self.undo(next, &on, timeout).await;
        Ok((released, None))
    }

    async fn watches(&self, key: &Key) -> Vec<Watch> {
        let answers = self
            .on_all(self.timeout_for(None), |_, n| n.watch(key))
            .await;
        answers
            .into_iter()
            .filter_map(|a| match a {
                Answer::Ok(w) => Some(w),
                Answer::Failed(_) => None,
            })
            .collect()
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
        Ok(self.attempt(req).await?.ok())
    }

    async fn acquire(&self, req: &Request, deadline: Option<Instant>) -> Result<Option<Grant>> {
        if let Ok(g) = self.attempt(req).await? {
            return Ok(Some(g));
        }
        // Wake on a release published by any instance, or after a jittered delay
        // (so that competing clients do not retry in lock-step and split the vote).
        let watches = self.watches(&req.key).await;
        loop {
            let notified: Vec<_> = watches
                .iter()
                .map(|w| Box::pin(w.notify.notified()))
                .collect();
            let mut notified = notified;
            for n in &mut notified {
                n.as_mut().enable();
            }
            let hint = match self.attempt(req).await? {
                Ok(g) => return Ok(Some(g)),
                Err(hint) => hint,
            };
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(None);
            }
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
                _ = any => {}
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
            .unwrap_or(DEFAULT_INSTANCE_TIMEOUT);
        let answers = self
            .on_all(self.timeout_for(Some(min_ttl)), |_, n| n.renew(leases))
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
                return Err(self.no_quorum(held, &answers));
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
            .on_all(self.timeout_for(None), |_, n| n.inspect(key))
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
                    let token = infos
                        .iter()
                        .flat_map(|i| {
                            i.holders
                                .iter()
                                .filter(|x| x.owner == h.owner)
                                .map(|x| x.token)
                        })
                        .max()
                        .flatten();
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
            .on_all(self.timeout_for(None), |_, n| n.keys_under(prefix))
            .await;
        let mut keys: Vec<String> = answers
            .into_iter()
            .filter_map(|a| match a {
                Answer::Ok(k) => Some(k),
                Answer::Failed(_) => None,
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
