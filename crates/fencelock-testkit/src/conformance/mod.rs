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

    /// Whether a reentrant acquire may answer a larger token than the hold
    /// it adds to (Redlock: an instance that missed the first hold grants it
    /// anew). Default `false`: the token stays.
    fn reentrant_token_may_rise(&self) -> bool {
        false
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

mod basics;
mod holds;
mod leases;
mod modes;

use basics::*;
use holds::*;
use leases::*;
use modes::*;

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
        mixed_ttl_reentrant_holds_keep_the_longest: needs_reentrant_ttl,
        a_grant_after_a_wait_longer_than_the_ttl_is_held: needs_ttl,
        repeated_request_is_idempotent: always,
        readers_coexist_and_exclude_writers: needs_shared,
        racing_shared_holds_of_one_owner_keep_their_grants: needs_shared,
        semaphore_admits_exactly_n: needs_semaphore,
        a_semaphore_keeps_one_permit_count_while_held: needs_semaphore,
        ttl_frees_a_leaked_guard: needs_ttl,
        watchdog_keeps_lock_past_3x_ttl: needs_ttl,
        fixed_lease_expires_and_fires_lost: needs_ttl,
        max_hold_stops_renewal: needs_ttl,
        lost_fires_when_lease_is_stolen: always,
        a_stale_guard_of_the_same_owner_leaves_the_new_hold_alone: always,
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
