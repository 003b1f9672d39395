//! A pass-through backend wrapper that counts calls, can make renewals fail,
//! and can slow replies down.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use fencelock_core::backend::{Backoff, Grant, LeaseRef, Released, Renewal, Request, async_trait};
use fencelock_core::{Backend, Capabilities, Error, Key, LockInfo, Result};
use tokio::time::Instant;

/// Wraps a real backend: every call goes through to it, is counted, and
/// [`FlakyBackend::fail_renewals`] makes `renew` fail as a broken connection
/// would (the backend's server keeps running; only this client's renewals fail).
///
/// [`FlakyBackend::slow_grants`] and [`FlakyBackend::slow_renewals`] hold
/// replies back as a slow network would (the server has acted already).
///
/// The suite uses it to prove that bad input never reaches a backend (zero
/// calls) and that the watchdog turns failing renewals into `lost()`.
pub struct FlakyBackend {
    inner: Arc<dyn Backend>,
    calls: AtomicUsize,
    renew_calls: AtomicUsize,
    fail_renewals: AtomicBool,
    grant_delay_ms: AtomicU64,
    renew_delay_ms: AtomicU64,
}

impl FlakyBackend {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Backend>) -> Self {
        FlakyBackend {
            inner,
            calls: AtomicUsize::new(0),
            renew_calls: AtomicUsize::new(0),
            fail_renewals: AtomicBool::new(false),
            grant_delay_ms: AtomicU64::new(0),
            renew_delay_ms: AtomicU64::new(0),
        }
    }

    /// From now on, a grant's reply arrives `delay` after the server granted it.
    pub fn slow_grants(&self, delay: Duration) {
        self.grant_delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    /// From now on, a renewal is sent `delay` late.
    pub fn slow_renewals(&self, delay: Duration) {
        self.renew_delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    async fn hold_back(delay_ms: &AtomicU64) {
        let ms = delay_ms.load(Ordering::SeqCst);
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }

    /// How many backend operations were called so far.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// How many `renew` calls were made so far (each renews a batch).
    pub fn renew_calls(&self) -> usize {
        self.renew_calls.load(Ordering::SeqCst)
    }

    /// From now on, `renew` fails with a connection error (or works again).
    pub fn fail_renewals(&self, fail: bool) {
        self.fail_renewals.store(fail, Ordering::SeqCst);
    }

    fn count(&self) {
        self.calls.fetch_add(1, Ordering::SeqCst);
    }
}

#[async_trait]
impl Backend for FlakyBackend {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn address(&self) -> String {
        self.inner.address()
    }

    async fn try_acquire(&self, req: &Request) -> Result<Option<Grant>> {
        self.count();
        let got = self.inner.try_acquire(req).await?;
        if got.is_some() {
            Self::hold_back(&self.grant_delay_ms).await;
        }
        Ok(got)
    }

    async fn renew(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
        self.count();
        self.renew_calls.fetch_add(1, Ordering::SeqCst);
        if self.fail_renewals.load(Ordering::SeqCst) {
            return Err(Error::connection(
                self.inner.name(),
                &self.inner.address(),
                "connection cut by the testkit",
            ));
        }
        Self::hold_back(&self.renew_delay_ms).await;
        self.inner.renew(leases).await
    }

    async fn release(&self, lease: &LeaseRef) -> Result<Released> {
        self.count();
        self.inner.release(lease).await
    }

    async fn acquire(&self, req: &Request, deadline: Option<Instant>) -> Result<Option<Grant>> {
        self.count();
        let got = self.inner.acquire(req, deadline).await?;
        if got.is_some() {
            Self::hold_back(&self.grant_delay_ms).await;
        }
        Ok(got)
    }

    async fn wait_change(
        &self,
        key: &Key,
        backoff: &mut Backoff,
        deadline: Option<Instant>,
    ) -> Result<()> {
        self.count();
        self.inner.wait_change(key, backoff, deadline).await
    }

    async fn inspect(&self, key: &Key) -> Result<Option<LockInfo>> {
        self.count();
        self.inner.inspect(key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>> {
        self.count();
        self.inner.list(prefix).await
    }
}
