//! The conformance suite: one generic suite that every backend runs against a
//! real server, switching cases on the backend's [`Capabilities`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock_core::backend::async_trait;
use fencelock_core::{
    Backend, Capabilities, Error, Guard, Hold, Key, Locker, LostReason, Mode, Owner, Result,
    check_history,
};
use tokio::time::Instant;

use crate::flaky::FlakyBackend;

/// What a backend crate provides to run the suite against its real server.
///
/// # Examples
///
/// The memory backend's harness (a backend crate writes the same for its own
/// backend, with [`Harness::backend`] opening a new client connection):
///
/// ```no_run
/// use std::sync::Arc;
/// use fencelock_core::{Backend, Key, MemoryBackend, Result};
/// use fencelock_core::backend::{async_trait};
/// use fencelock_testkit::{Harness, run_conformance};
///
/// struct Memory(MemoryBackend);
///
/// #[async_trait]
/// impl Harness for Memory {
///     async fn backend(&self) -> Result<Arc<dyn Backend>> {
///         Ok(Arc::new(self.0.clone()))
///     }
///     async fn steal(&self, key: &Key) -> Result<()> {
///         self.0.force_release(key);
///         Ok(())
///     }
/// }
///
/// # #[tokio::main] async fn main() {
/// run_conformance("memory", Memory(MemoryBackend::new())).await.assert_passed();
/// # }
/// ```
#[async_trait]
pub trait Harness: Send + Sync + 'static {
    /// A new client of the backend under test, with its own connection(s), as a
    /// separate process would have.
    async fn backend(&self) -> Result<Arc<dyn Backend>>;

    /// Deletes every hold of `key` behind the holders' backs (an operator breaking
    /// the lock, an expiry the holder missed).
    async fn steal(&self, key: &Key) -> Result<()>;

    /// A TTL short enough to keep the suite quick and long enough for this
    /// backend to renew reliably on a loaded 2-core machine: a renewal is due
    /// at ttl/3 and must be answered before ttl, so the default of 2 s leaves
    /// more than a second for a stalled machine.
    fn ttl(&self) -> Duration {
        Duration::from_secs(2)
    }

    /// Total acquisitions of the contention case, spread over 32 tasks. Default 320.
    fn contention_cycles(&self) -> usize {
        320
    }
}

/// How one case ended.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// It passed.
    Passed,
    /// Not applicable to this backend (the reason names the missing capability).
    Skipped(String),
    /// It failed.
    Failed(String),
}

/// One case's result.
#[derive(Debug, Clone)]
pub struct CaseReport {
    /// The case's name.
    pub name: &'static str,
    /// Its outcome.
    pub outcome: Outcome,
    /// How long it took.
    pub elapsed: Duration,
}

/// The results of one run of the suite.
#[derive(Debug, Clone)]
pub struct Report {
    /// The backend's label given to [`run_conformance`].
    pub backend: String,
    /// Every case, in order.
    pub cases: Vec<CaseReport>,
}

impl Report {
    /// Names of the cases that were skipped.
    pub fn skipped(&self) -> Vec<&'static str> {
        self.cases
            .iter()
            .filter(|c| matches!(c.outcome, Outcome::Skipped(_)))
            .map(|c| c.name)
            .collect()
    }

    /// The failed cases.
    pub fn failures(&self) -> Vec<&CaseReport> {
        self.cases
            .iter()
            .filter(|c| matches!(c.outcome, Outcome::Failed(_)))
            .collect()
    }

    /// Panics with every failure if any case failed.
    ///
    /// # Panics
    ///
    /// When a case failed (that is the point: call it from a `#[test]`).
    pub fn assert_passed(&self) {
        let failures = self.failures();
        assert!(
            failures.is_empty(),
            "conformance[{}]: {} case(s) failed:\n{}",
            self.backend,
            failures.len(),
            failures
                .iter()
                .map(|c| format!("  {}: {:?}", c.name, c.outcome))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in &self.cases {
            let (tag, detail) = match &c.outcome {
                Outcome::Passed => ("ok  ", String::new()),
                Outcome::Skipped(why) => ("skip", format!(" ({why})")),
                Outcome::Failed(why) => ("FAIL", format!(": {why}")),
            };
            writeln!(
                f,
                "conformance[{}] {tag} {} [{:.2}s]{detail}",
                self.backend,
                c.name,
                c.elapsed.as_secs_f64()
            )?;
        }
        let passed = self
            .cases
            .iter()
            .filter(|c| c.outcome == Outcome::Passed)
            .count();
        write!(
            f,
            "conformance[{}]: {passed} passed, {} skipped, {} failed",
            self.backend,
            self.skipped().len(),
            self.failures().len()
        )
    }
}

/// A case failure message.
struct Fail(String);

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        Fail(format!("unexpected error: {e}"))
    }
}

impl From<String> for Fail {
    fn from(s: String) -> Self {
        Fail(s)
    }
}

type CaseResult = std::result::Result<(), Fail>;
type CaseFuture<'a> = Pin<Box<dyn Future<Output = CaseResult> + Send + 'a>>;

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(Fail(format!($($msg)+)));
        }
    };
}

/// Everything a case needs.
struct Ctx {
    harness: Arc<dyn Harness>,
    caps: Capabilities,
    ttl: Duration,
    prefix: String,
}

impl Ctx {
    /// A new client wrapped for call counting and renewal faults.
    async fn client(&self) -> std::result::Result<(Locker, Arc<FlakyBackend>), Fail> {
        let flaky = Arc::new(FlakyBackend::new(self.harness.backend().await?));
        let locker = Locker::from_arc(flaky.clone());
        Ok((locker, flaky))
    }

    async fn locker(&self) -> std::result::Result<Locker, Fail> {
        Ok(self.client().await?.0)
    }

    fn key(&self, case: &str) -> String {
        format!("{}{case}", self.prefix)
    }

    /// A generous bound for things that should happen "soon" on a loaded machine.
    fn soon(&self) -> Duration {
        self.ttl * 5 + Duration::from_secs(5)
    }
}

struct Case {
    name: &'static str,
    /// `Some(reason)` when the backend lacks what the case needs.
    skip: fn(&Capabilities) -> Option<&'static str>,
    run: for<'a> fn(&'a Ctx) -> CaseFuture<'a>,
}

fn always(_: &Capabilities) -> Option<&'static str> {
    None
}
fn needs_fencing(c: &Capabilities) -> Option<&'static str> {
    (!c.fencing).then_some("no fencing tokens")
}
fn needs_reentrant(c: &Capabilities) -> Option<&'static str> {
    (!c.reentrant).then_some("not reentrant")
}
fn needs_shared(c: &Capabilities) -> Option<&'static str> {
    (!c.shared).then_some("no shared mode")
}
fn needs_semaphore(c: &Capabilities) -> Option<&'static str> {
    (!c.semaphore).then_some("no semaphore mode")
}
fn needs_ttl(c: &Capabilities) -> Option<&'static str> {
    (!c.ttl).then_some("holds do not expire")
}
fn needs_reentrant_ttl(c: &Capabilities) -> Option<&'static str> {
    needs_reentrant(c).or_else(|| needs_ttl(c))
}
fn needs_inspect(c: &Capabilities) -> Option<&'static str> {
    (!c.inspect).then_some("cannot inspect")
}

macro_rules! cases {
    ($($name:ident : $skip:expr),+ $(,)?) => {
        vec![$(Case { name: stringify!($name), skip: $skip, run: |cx| Box::pin($name(cx)) }),+]
    };
}

fn all_cases() -> Vec<Case> {
    cases![
        bad_input_fails_before_io: always,
        exclusion_under_contention: always,
        try_once_when_busy: always,
        wait_timeout_is_an_error_near_the_deadline: always,
        waiter_is_granted_after_release: always,
        dropped_guard_is_released: always,
        tokens_increase_across_holders: needs_fencing,
        reentrant_holds_count: needs_reentrant,
        reentry_after_a_stolen_hold_is_a_new_hold: needs_reentrant,
        mixed_ttl_reentrant_holds_keep_the_longest: needs_reentrant_ttl,
        a_grant_after_a_wait_longer_than_the_ttl_is_held: needs_ttl,
        repeated_request_is_idempotent: always,
        readers_coexist_and_exclude_writers: needs_shared,
        semaphore_admits_exactly_n: needs_semaphore,
        a_semaphore_keeps_one_permit_count_while_held: needs_semaphore,
        ttl_frees_a_leaked_guard: needs_ttl,
        watchdog_keeps_lock_past_3x_ttl: needs_ttl,
        fixed_lease_expires_and_fires_lost: needs_ttl,
        max_hold_stops_renewal: needs_ttl,
        lost_fires_when_lease_is_stolen: always,
        lost_fires_when_renewal_fails: needs_ttl,
        non_owner_release_is_not_held: always,
        run_cancels_closure_on_lost: always,
        multi_lock_is_all_or_nothing: always,
        inspect_shows_the_holder: needs_inspect,
    ]
}

/// The names of the conformance cases, in the order the suite runs them
/// (the tests [`conformance_tests!`](crate::conformance_tests) makes).
pub fn case_names() -> Vec<&'static str> {
    all_cases().iter().map(|c| c.name).collect()
}

/// Runs the whole suite against the backend behind `harness` and returns the
/// report (also printed). Call [`Report::assert_passed`] on it.
///
/// Every case uses its own keys under a random prefix, so runs against a shared
/// server do not interfere. `FENCELOCK_CASES=a,b` runs only the named cases.
/// A backend's tests rather use [`conformance_tests!`](crate::conformance_tests),
/// which makes each case a test of its own.
pub async fn run_conformance(backend: &str, harness: impl Harness) -> Report {
    let only: Option<Vec<String>> = std::env::var("FENCELOCK_CASES")
        .ok()
        .map(|v| v.split(',').map(|s| s.trim().to_string()).collect());
    run_cases(backend, harness, |name| {
        only.as_ref().is_none_or(|o| o.iter().any(|n| n == name))
    })
    .await
}

/// Runs the one case `name` of the suite (see [`run_conformance`]). Cases of
/// one test binary run one at a time, as in the whole suite: several timed
/// cases at once on a 2-core machine would measure the machine.
///
/// # Panics
///
/// If there is no case called `name`.
pub async fn run_case(backend: &str, name: &str, harness: impl Harness) -> Report {
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    assert!(case_names().contains(&name), "no conformance case {name:?}");
    let _turn = ONE_AT_A_TIME.lock().await;
    run_cases(backend, harness, |n| n == name).await
}

async fn run_cases(backend: &str, harness: impl Harness, wanted: impl Fn(&str) -> bool) -> Report {
    let harness: Arc<dyn Harness> = Arc::new(harness);
    let mut report = Report {
        backend: backend.to_string(),
        cases: Vec::new(),
    };
    let caps = match harness.backend().await {
        Ok(b) => b.capabilities(),
        Err(e) => {
            report.cases.push(CaseReport {
                name: "connect",
                outcome: Outcome::Failed(e.to_string()),
                elapsed: Duration::ZERO,
            });
            println!("{report}");
            return report;
        }
    };
    let run_id = uuid::Uuid::new_v4().simple().to_string();
    for case in all_cases() {
        if !wanted(case.name) {
            continue;
        }
        let start = Instant::now();
        let outcome = if let Some(why) = (case.skip)(&caps) {
            Outcome::Skipped(why.to_string())
        } else {
            let cx = Ctx {
                harness: harness.clone(),
                caps,
                ttl: harness.ttl(),
                prefix: format!("conformance/{}/{}/", &run_id[..8], case.name),
            };
            let limit = Duration::from_secs(120) + cx.ttl * 40;
            match tokio::time::timeout(limit, (case.run)(&cx)).await {
                Ok(Ok(())) => Outcome::Passed,
                Ok(Err(Fail(why))) => Outcome::Failed(why),
                Err(_) => Outcome::Failed(format!("did not finish within {limit:?}")),
            }
        };
        let c = CaseReport {
            name: case.name,
            outcome,
            elapsed: start.elapsed(),
        };
        report.cases.push(c);
    }
    println!("{report}");
    report
}

// ---------------------------------------------------------------- the cases

async fn bad_input_fails_before_io(cx: &Ctx) -> CaseResult {
    let (locker, flaky) = cx.client().await?;
    let long = "k".repeat(300);
    for (what, key) in [
        ("empty key", ""),
        ("300-byte key", long.as_str()),
        ("key with a newline", "a\nb"),
    ] {
        let r = locker.lock(key).try_acquire().await;
        ensure!(
            matches!(r, Err(Error::InvalidKey { .. })),
            "{what}: expected InvalidKey, got {r:?}"
        );
    }
    let key = cx.key("k");
    let cases: Vec<(&str, Result<Option<Guard>>)> = vec![
        (
            "zero ttl",
            locker.lock(&key).ttl(Duration::ZERO).try_acquire().await,
        ),
        (
            "zero lease",
            locker.lock(&key).lease(Duration::ZERO).try_acquire().await,
        ),
        ("0 permits", locker.semaphore(&key, 0).try_acquire().await),
        (
            "zero max_hold",
            locker
                .lock(&key)
                .max_hold(Duration::ZERO)
                .try_acquire()
                .await,
        ),
        (
            "empty owner",
            locker.lock(&key).owner("").try_acquire().await,
        ),
    ];
    for (what, r) in cases {
        ensure!(
            matches!(r, Err(Error::InvalidConfig(_))),
            "{what}: expected InvalidConfig, got {r:?}"
        );
    }
    let r = locker.multi_lock(["ok", ""]).acquire().await;
    ensure!(
        matches!(r, Err(Error::InvalidKey { .. })),
        "multi-lock with an empty key: got {r:?}"
    );
    let r = locker.inspect("").await;
    ensure!(
        matches!(r, Err(Error::InvalidKey { .. })),
        "inspect of an empty key: got {r:?}"
    );
    ensure!(
        flaky.calls() == 0,
        "bad input reached the backend ({} calls)",
        flaky.calls()
    );
    Ok(())
}

async fn exclusion_under_contention(cx: &Ctx) -> CaseResult {
    const TASKS: usize = 32;
    const CLIENTS: usize = 4;
    let key = cx.key("hot");
    let total = cx.harness.contention_cycles().max(TASKS);
    let per_task = total / TASKS;
    let mut lockers = Vec::new();
    for _ in 0..CLIENTS {
        lockers.push(cx.locker().await?);
    }
    let counter = Arc::new(AtomicU64::new(0));
    let holds = Arc::new(Mutex::new(Vec::with_capacity(total)));
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let locker = lockers[t % CLIENTS].clone();
        let (key, counter, holds, ttl) = (key.clone(), counter.clone(), holds.clone(), cx.ttl);
        tasks.push(tokio::spawn(async move {
            for _ in 0..per_task {
                let g = locker
                    .lock(&key)
                    .ttl(ttl)
                    .wait(Duration::from_secs(120))
                    .acquire()
                    .await?;
                let acquired_ns = Hold::now_ns();
                // An unprotected read-modify-write: only the lock keeps it exact.
                let v = counter.load(Ordering::SeqCst);
                tokio::task::yield_now().await;
                counter.store(v + 1, Ordering::SeqCst);
                let valid = g.is_valid();
                let hold = Hold {
                    holder: format!("task-{t}"),
                    mode: Mode::Exclusive,
                    token: g.token().map(|t| t.get()),
                    acquired_ns,
                    released_ns: Hold::now_ns(),
                };
                holds.lock().unwrap_or_else(|p| p.into_inner()).push(hold);
                g.release().await?;
                if !valid {
                    return Err(Error::backend(
                        "testkit",
                        "a lease was lost during a short hold",
                    ));
                }
            }
            Ok::<(), Error>(())
        }));
    }
    for t in tasks {
        t.await.map_err(|e| Fail(format!("task panicked: {e}")))??;
    }
    let expected = (per_task * TASKS) as u64;
    let got = counter.load(Ordering::SeqCst);
    ensure!(
        got == expected,
        "counter is {got}, expected {expected}: updates were lost"
    );
    let holds = holds.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if cx.caps.fencing {
        ensure!(
            holds.iter().all(|h| h.token.is_some()),
            "a fencing backend granted without a token"
        );
    } else {
        ensure!(
            holds.iter().all(|h| h.token.is_none()),
            "a backend without fencing handed out a token"
        );
    }
    check_history(&holds).map_err(|v| Fail(format!("history violated: {v}")))?;
    Ok(())
}

async fn try_once_when_busy(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let g = a.lock(&key).acquire().await?;
    let r = b.lock(&key).try_acquire().await?;
    ensure!(r.is_none(), "try_acquire got a busy lock");
    let r = b.lock(&key).wait(Duration::ZERO).acquire().await;
    ensure!(
        matches!(r, Err(Error::Timeout { .. })),
        "wait(0) on a busy lock: expected Timeout, got {r:?}"
    );
    g.release().await?;
    let r = b.lock(&key).try_acquire().await?;
    ensure!(r.is_some(), "try_acquire failed on a free lock");
    Ok(())
}

async fn wait_timeout_is_an_error_near_the_deadline(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let _g = a.lock(&key).acquire().await?;
    let wait = Duration::from_millis(400);
    let start = Instant::now();
    let r = b.lock(&key).wait(wait).acquire().await;
    let took = start.elapsed();
    ensure!(
        matches!(r, Err(Error::Timeout { .. })),
        "expected Timeout, got {r:?}"
    );
    ensure!(
        took >= wait,
        "gave up after {took:?}, before the {wait:?} wait"
    );
    let slack = Duration::from_secs(3);
    ensure!(
        took <= wait + slack,
        "gave up after {took:?}, long after the {wait:?} wait"
    );
    Ok(())
}

async fn waiter_is_granted_after_release(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    // A long TTL: only the release can free the lock within the wait.
    let g = a.lock(&key).ttl(Duration::from_secs(60)).acquire().await?;
    let first = g.token();
    let k = key.clone();
    let waiter =
        tokio::spawn(async move { b.lock(&k).wait(Duration::from_secs(20)).acquire().await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    ensure!(!waiter.is_finished(), "the waiter got a held lock");
    g.release().await?;
    let g2 = waiter.await.map_err(|e| Fail(e.to_string()))??;
    if cx.caps.fencing {
        ensure!(
            g2.token() > first,
            "token {:?} after {:?}",
            g2.token(),
            first
        );
    }
    g2.release().await?;
    Ok(())
}

async fn dropped_guard_is_released(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let g = a.lock(&key).ttl(Duration::from_secs(60)).acquire().await?;
    drop(g);
    // The TTL is 60 s: getting it within 20 s proves the drop released it.
    let g2 = b.lock(&key).wait(Duration::from_secs(20)).acquire().await?;
    g2.release().await?;
    Ok(())
}

async fn tokens_increase_across_holders(cx: &Ctx) -> CaseResult {
    let lockers = [cx.locker().await?, cx.locker().await?];
    let key = cx.key("k");
    let mut last = None;
    for i in 0..6 {
        let g = lockers[i % 2].lock(&key).acquire().await?;
        let t = g.token();
        ensure!(t.is_some(), "no token from a fencing backend");
        ensure!(t > last, "token {t:?} after {last:?}");
        last = t;
        g.release().await?;
    }
    Ok(())
}

async fn reentrant_holds_count(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let owner = format!("{}owner", cx.prefix).replace('/', "-");
    let g1 = a.lock(&key).owner(&owner).acquire().await?;
    let g2 = a
        .lock(&key)
        .owner(&owner)
        .wait(Duration::ZERO)
        .acquire()
        .await?;
    ensure!(
        g1.holds() == 1 && g2.holds() == 2,
        "hold counts {} and {}",
        g1.holds(),
        g2.holds()
    );
    ensure!(
        g1.token() == g2.token(),
        "reentrant token changed: {:?} → {:?}",
        g1.token(),
        g2.token()
    );
    ensure!(
        b.lock(&key).try_acquire().await?.is_none(),
        "another owner got a reentrant-held lock"
    );
    g1.release().await?;
    ensure!(
        b.lock(&key).try_acquire().await?.is_none(),
        "freed after one of two releases"
    );
    g2.release().await?;
    let g3 = b.lock(&key).try_acquire().await?;
    ensure!(g3.is_some(), "still held after both releases");
    Ok(())
}

async fn repeated_request_is_idempotent(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = Key::new(cx.key("k"))?;
    // What a retry after a lost reply sends: the same default-owner request again.
    let req = fencelock_core::backend::Request::new(
        key.clone(),
        Owner::new("retrying-owner")?,
        Mode::Exclusive,
        cx.ttl,
    )
    .with_reentrant(false);
    let first = a
        .backend()
        .try_acquire(&req)
        .await?
        .ok_or_else(|| Fail("free lock refused".into()))?;
    let again = a
        .backend()
        .try_acquire(&req)
        .await?
        .ok_or_else(|| Fail("a repeated request was refused".into()))?;
    ensure!(
        first.token == again.token,
        "a repeated request got a new token: {:?} → {:?}",
        first.token,
        again.token
    );
    ensure!(
        again.holds == 1,
        "a repeated request added a hold ({} holds)",
        again.holds
    );
    let lease = fencelock_core::backend::LeaseRef::new(&req, &first);
    let released = a.backend().release(&lease).await?;
    ensure!(
        released.remaining == 0,
        "one release left {} holds",
        released.remaining
    );
    ensure!(
        b.lock(key.as_str()).try_acquire().await?.is_some(),
        "still held after the one release"
    );
    Ok(())
}

async fn readers_coexist_and_exclude_writers(cx: &Ctx) -> CaseResult {
    let (a, b, c) = (cx.locker().await?, cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let r1 = a.read_lock(&key).acquire().await?;
    let r2 = b.read_lock(&key).wait(Duration::ZERO).acquire().await?;
    ensure!(
        c.lock(&key).try_acquire().await?.is_none(),
        "a writer got in beside readers"
    );
    let k = key.clone();
    let writer =
        tokio::spawn(async move { c.lock(&k).wait(Duration::from_secs(20)).acquire().await });
    r1.release().await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    ensure!(
        !writer.is_finished(),
        "a writer got in while a reader still held"
    );
    r2.release().await?;
    let w = writer.await.map_err(|e| Fail(e.to_string()))??;
    ensure!(
        a.read_lock(&key).try_acquire().await?.is_none(),
        "a reader got in beside a writer"
    );
    w.release().await?;
    ensure!(
        a.read_lock(&key).try_acquire().await?.is_some(),
        "a reader was refused a free lock"
    );
    Ok(())
}

async fn semaphore_admits_exactly_n(cx: &Ctx) -> CaseResult {
    const N: u32 = 3;
    let key = cx.key("k");
    let mut holders = Vec::new();
    for _ in 0..N {
        let l = cx.locker().await?;
        let g = l.semaphore(&key, N).try_acquire().await?;
        ensure!(g.is_some(), "permit {} of {N} refused", holders.len() + 1);
        holders.push(g);
    }
    let extra = cx.locker().await?;
    ensure!(
        extra.semaphore(&key, N).try_acquire().await?.is_none(),
        "permit {} of {N} granted",
        N + 1
    );
    ensure!(
        extra.lock(&key).try_acquire().await?.is_none(),
        "an exclusive lock beside semaphore holders"
    );
    if cx.caps.fencing {
        let mut tokens: Vec<_> = holders.iter().flatten().map(Guard::token).collect();
        tokens.dedup();
        ensure!(
            tokens.len() == N as usize,
            "permit holders share tokens: {tokens:?}"
        );
    }
    if let Some(Some(g)) = holders.pop() {
        g.release().await?;
    }
    ensure!(
        extra.semaphore(&key, N).try_acquire().await?.is_some(),
        "a released permit was not available"
    );
    Ok(())
}

/// A key has one permit count while held: the first holder's count fixes it,
/// a request with another count is refused at once with a clear error, the
/// same count still shares the permits, and a free key takes a new count.
async fn a_semaphore_keeps_one_permit_count_while_held(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let first = a.semaphore(&key, 2).acquire().await?;
    for asked in [1, 3] {
        match b.semaphore(&key, asked).wait(cx.soon()).acquire().await {
            Err(Error::InvalidConfig(msg)) => ensure!(
                msg.contains("permits"),
                "the refusal does not say why: {msg}"
            ),
            Ok(g) => {
                let _ = g.release().await;
                return Err(Fail(format!(
                    "a semaphore held with 2 permits granted a request for {asked}"
                )));
            }
            Err(e) => {
                return Err(Fail(format!(
                    "a request for {asked} permits of a 2-permit semaphore: {e}"
                )));
            }
        }
    }
    let second = b
        .semaphore(&key, 2)
        .try_acquire()
        .await?
        .ok_or_else(|| Fail("the second of 2 permits was refused".into()))?;
    first.release().await?;
    second.release().await?;
    let g = b.semaphore(&key, 3).wait(cx.soon()).acquire().await?;
    g.release().await?;
    Ok(())
}

async fn ttl_frees_a_leaked_guard(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let g = a.lock(&key).ttl(cx.ttl).acquire().await?;
    let first = g.token();
    let start = Instant::now();
    let _ = g.leak();
    ensure!(
        b.lock(&key).try_acquire().await?.is_none(),
        "a leaked lock was free at once"
    );
    let g2 = b.lock(&key).wait(cx.soon()).acquire().await?;
    let took = start.elapsed();
    ensure!(
        took >= cx.ttl / 2,
        "freed after {took:?}, well before the TTL {:?}",
        cx.ttl
    );
    if cx.caps.fencing {
        ensure!(
            g2.token() > first,
            "token {:?} after {:?}",
            g2.token(),
            first
        );
    }
    g2.release().await?;
    Ok(())
}

async fn watchdog_keeps_lock_past_3x_ttl(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let g = a.lock(&key).ttl(cx.ttl).acquire().await?;
    tokio::time::sleep(cx.ttl * 7 / 2).await;
    ensure!(g.is_valid(), "the guard is no longer valid after 3.5 × ttl");
    ensure!(
        b.lock(&key).try_acquire().await?.is_none(),
        "another client got the lock the watchdog keeps"
    );
    g.release().await?;
    Ok(())
}

async fn fixed_lease_expires_and_fires_lost(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let start = Instant::now();
    let g = a.lock(&key).lease(cx.ttl).acquire().await?;
    let lost = tokio::time::timeout(cx.soon(), g.lost())
        .await
        .map_err(|_| Fail("lost() did not fire for a fixed lease".into()))?;
    ensure!(
        matches!(
            lost,
            Error::Lost {
                reason: LostReason::Expired,
                ..
            }
        ),
        "expected Lost(Expired), got {lost:?}"
    );
    ensure!(
        start.elapsed() >= cx.ttl / 2,
        "a fixed lease was lost after {:?}",
        start.elapsed()
    );
    ensure!(!g.is_valid(), "is_valid() after lost()");
    let g2 = b.lock(&key).wait(cx.soon()).acquire().await?;
    g2.release().await?;
    Ok(())
}

async fn max_hold_stops_renewal(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let g = a.lock(&key).ttl(cx.ttl).max_hold(cx.ttl).acquire().await?;
    let lost = tokio::time::timeout(cx.soon(), g.lost())
        .await
        .map_err(|_| Fail("lost() did not fire after max_hold".into()))?;
    ensure!(
        matches!(
            lost,
            Error::Lost {
                reason: LostReason::MaxHold,
                ..
            }
        ),
        "expected Lost(MaxHold), got {lost:?}"
    );
    let g2 = b.lock(&key).wait(cx.soon()).acquire().await?;
    g2.release().await?;
    Ok(())
}

/// Re-entering a hold that was taken away (a steal, an expired session) must
/// not hand the old hold back: the backend takes the lock anew.
async fn reentry_after_a_stolen_hold_is_a_new_hold(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let owner = "reentry-owner";
    let g1 = a.lock(&key).owner(owner).ttl(cx.ttl).acquire().await?;
    cx.harness.steal(&Key::new(&key)?).await?;
    let g2 = a
        .lock(&key)
        .owner(owner)
        .ttl(cx.ttl)
        .wait(cx.soon())
        .acquire()
        .await?;
    if cx.caps.fencing {
        ensure!(
            g2.token() > g1.token(),
            "re-entry after the hold was stolen got token {:?}, the lost hold had {:?}",
            g2.token(),
            g1.token()
        );
    }
    ensure!(
        b.lock(&key).try_acquire().await?.is_none(),
        "re-entry after the hold was stolen granted a lock that nobody holds"
    );
    g2.release().await?;
    let _ = g1.release().await;
    Ok(())
}

/// A waiter that waited (in the server, or in a queue) for longer than its
/// TTL must be valid on arrival, and stay valid while renewed: its lease
/// counts from when the backend granted it, not from when it started to wait.
async fn a_grant_after_a_wait_longer_than_the_ttl_is_held(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let held = a.lock(&key).ttl(cx.ttl).acquire().await?;
    let waiting = tokio::spawn({
        let (b, key, ttl, wait) = (b.clone(), key.clone(), cx.ttl, cx.soon() + cx.ttl * 3);
        async move { b.lock(&key).ttl(ttl).wait(wait).acquire().await }
    });
    // The holder renews for three TTLs while the other waits.
    tokio::time::sleep(cx.ttl * 3).await;
    ensure!(held.is_valid(), "the holder lost its renewed lease");
    held.release().await?;
    let g = waiting
        .await
        .map_err(|e| Fail(format!("the waiter panicked: {e}")))??;
    ensure!(
        g.is_valid(),
        "granted after a wait of 3 × TTL, but lost on arrival: {:?}",
        g.lease().lost_reason()
    );
    tokio::time::sleep(cx.ttl * 2).await;
    ensure!(
        g.is_valid(),
        "granted after a long wait, then lost while renewed: {:?}",
        g.lease().lost_reason()
    );
    g.release().await?;
    Ok(())
}

/// Two holds of one owner with different TTLs: renewing the short one must not
/// cut the long one's expiry, so the key stays held after the short one goes.
async fn mixed_ttl_reentrant_holds_keep_the_longest(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let owner = format!("{}mixed", cx.prefix).replace('/', "-");
    let (long, short) = (cx.ttl * 20, cx.ttl);
    let g1 = a.lock(&key).owner(&owner).ttl(long).acquire().await?;
    let g2 = a
        .lock(&key)
        .owner(&owner)
        .ttl(short)
        .wait(Duration::ZERO)
        .acquire()
        .await?;
    // The watchdog renews the short hold a few times, then it goes.
    tokio::time::sleep(short * 2).await;
    g2.release().await?;
    // Well past the short TTL, within the long one.
    tokio::time::sleep(short * 3).await;
    ensure!(
        g1.is_valid(),
        "the long hold is no longer valid after the short one went: {:?}",
        g1.lease().lost_reason()
    );
    ensure!(
        b.lock(&key).try_acquire().await?.is_none(),
        "another client got the lock while the long hold (ttl {long:?}) was valid for {:?} more",
        g1.lease().time_left()
    );
    g1.release().await?;
    let g3 = b.lock(&key).wait(cx.soon()).acquire().await?;
    g3.release().await?;
    Ok(())
}

async fn lost_fires_when_lease_is_stolen(cx: &Ctx) -> CaseResult {
    let (a, b, c) = (cx.locker().await?, cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let g = a.lock(&key).ttl(cx.ttl).acquire().await?;
    cx.harness.steal(&Key::new(&key)?).await?;
    let lost = tokio::time::timeout(cx.soon(), g.lost())
        .await
        .map_err(|_| Fail("lost() did not fire after the lease was deleted".into()))?;
    ensure!(
        matches!(
            lost,
            Error::Lost {
                reason: LostReason::NotHeld(_) | LostReason::SessionEnded(_),
                ..
            }
        ),
        "expected Lost(NotHeld), got {lost:?}"
    );
    ensure!(!g.is_valid(), "is_valid() after lost()");
    let g2 = b.lock(&key).wait(cx.soon()).acquire().await?;
    // The old holder's release must not free the new holder's lock.
    let r = g.release().await;
    ensure!(
        matches!(r, Err(Error::NotHeld { .. })),
        "stale release: expected NotHeld, got {r:?}"
    );
    ensure!(
        c.lock(&key).try_acquire().await?.is_none(),
        "a stale release freed the new holder's lock"
    );
    g2.release().await?;
    Ok(())
}

async fn lost_fires_when_renewal_fails(cx: &Ctx) -> CaseResult {
    let (a, flaky) = cx.client().await?;
    let key = cx.key("k");
    let g = a.lock(&key).ttl(cx.ttl).acquire().await?;
    flaky.fail_renewals(true);
    let start = Instant::now();
    let lost = tokio::time::timeout(cx.soon(), g.lost())
        .await
        .map_err(|_| Fail("lost() did not fire while renewals failed".into()))?;
    ensure!(
        matches!(
            lost,
            Error::Lost {
                reason: LostReason::RenewFailed(_),
                ..
            }
        ),
        "expected Lost(RenewFailed), got {lost:?}"
    );
    ensure!(
        start.elapsed() <= cx.ttl + Duration::from_secs(2),
        "lost() fired {:?} after renewals began to fail (ttl {:?})",
        start.elapsed(),
        cx.ttl
    );
    ensure!(!g.is_valid(), "is_valid() after lost()");
    flaky.fail_renewals(false);
    // Never silently re-acquired: the guard stays lost even though renewals work again.
    tokio::time::sleep(cx.ttl / 2).await;
    ensure!(!g.is_valid(), "a lost guard became valid again");
    drop(g);
    Ok(())
}

async fn non_owner_release_is_not_held(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let g = a.lock(&key).acquire().await?;
    let mut intruder = g.lease_ref().clone();
    intruder.owner = Owner::new("intruder")?;
    let r = b.backend().release(&intruder).await;
    ensure!(
        matches!(r, Err(Error::NotHeld { .. })),
        "a non-owner release: expected NotHeld, got {r:?}"
    );
    ensure!(
        b.lock(&key).try_acquire().await?.is_none(),
        "a non-owner release freed the lock"
    );
    ensure!(
        g.is_valid(),
        "the holder lost its lock to a non-owner release"
    );
    g.release().await?;
    let r = b.backend().release(&intruder).await;
    ensure!(
        matches!(r, Err(Error::NotHeld { .. })),
        "releasing a free lock: expected NotHeld, got {r:?}"
    );
    Ok(())
}

async fn run_cancels_closure_on_lost(cx: &Ctx) -> CaseResult {
    let a = cx.locker().await?;
    let key = cx.key("k");
    let finished = Arc::new(AtomicBool::new(false));
    let (harness, k) = (cx.harness.clone(), Key::new(&key)?);
    let thief = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        harness.steal(&k).await
    });
    let f = finished.clone();
    let long = cx.soon() * 2;
    let start = Instant::now();
    let r = a
        .lock(&key)
        .ttl(cx.ttl)
        .run(|_lease| async move {
            tokio::time::sleep(long).await;
            f.store(true, Ordering::SeqCst);
        })
        .await;
    thief.await.map_err(|e| Fail(e.to_string()))??;
    ensure!(
        matches!(r, Err(Error::Lost { .. })),
        "expected Lost, got {r:?}"
    );
    ensure!(
        !finished.load(Ordering::SeqCst),
        "the closure ran to its end after the lease was lost"
    );
    ensure!(
        start.elapsed() < long,
        "run() returned only after the closure's own time"
    );
    Ok(())
}

async fn multi_lock_is_all_or_nothing(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let keys = [cx.key("c"), cx.key("a"), cx.key("b")];
    let blocker = b.lock(&keys[2]).acquire().await?;
    let r = a
        .multi_lock(&keys)
        .wait(Duration::from_millis(300))
        .acquire()
        .await;
    ensure!(
        matches!(r, Err(Error::Timeout { .. })),
        "expected Timeout, got {r:?}"
    );
    for k in [&keys[0], &keys[1]] {
        ensure!(
            b.lock(k).try_acquire().await?.is_some(),
            "{k} stayed held after the multi-lock failed"
        );
    }
    blocker.release().await?;
    let all = a
        .multi_lock(&keys)
        .wait(Duration::from_secs(20))
        .acquire()
        .await?;
    ensure!(
        all.guards().len() == 3,
        "multi-lock holds {} keys",
        all.guards().len()
    );
    for k in &keys {
        ensure!(
            b.lock(k).try_acquire().await?.is_none(),
            "{k} free while the multi-lock holds it"
        );
    }
    all.release().await?;
    Ok(())
}

async fn inspect_shows_the_holder(cx: &Ctx) -> CaseResult {
    let a = cx.locker().await?;
    let key = cx.key("k");
    let g = a.lock(&key).acquire().await?;
    let info = a
        .inspect(&key)
        .await?
        .ok_or_else(|| Fail("inspect found nothing".into()))?;
    ensure!(
        info.holders.len() == 1,
        "inspect shows {} holders",
        info.holders.len()
    );
    let h = &info.holders[0];
    ensure!(
        h.owner == g.owner().as_str(),
        "inspect shows owner {:?}, not {:?}",
        h.owner,
        g.owner()
    );
    ensure!(
        h.mode == Mode::Exclusive && h.holds == 1,
        "inspect shows {h:?}"
    );
    ensure!(
        h.token == g.token(),
        "inspect shows token {:?}, the guard has {:?}",
        h.token,
        g.token()
    );
    let listed = a.list(&cx.prefix).await?;
    ensure!(
        listed.iter().any(|i| i.key == key),
        "list({:?}) misses {key}",
        cx.prefix
    );
    g.release().await?;
    let after = a.inspect(&key).await?;
    ensure!(
        after.as_ref().is_none_or(|i| i.holders.is_empty()),
        "inspect after release shows {after:?}"
    );
    Ok(())
}
