//! Metrics, through the [`metrics`](https://docs.rs/metrics) facade (cargo
//! feature `metrics`; `metrics` of the `fencelock` crate). (The module is
//! not called `metrics`, so that `use fencelock::*` leaves that name to the
//! facade crate.) fencelock records;
//! the program installs the recorder (an exporter) it wants. Without the
//! feature, or without a recorder, recording costs nothing worth measuring.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `fencelock_acquire_wait_seconds` | histogram | `backend`, `outcome` | from an acquire's call to its answer; `outcome`: `granted`, `busy` (a `try_acquire` that found the lock taken), `timeout`, `error` |
//! | `fencelock_hold_seconds` | histogram | `backend` | from a grant to its release or drop |
//! | `fencelock_renewals_total` | counter | `backend`, `outcome` | one per lease per renewal: `held`, `lost` (the backend no longer holds it), `unknown` (the backend could not tell), `failed` (the call failed or timed out) |
//! | `fencelock_leases_lost_total` | counter | `backend`, `reason` | leases lost while held (not released): `expired`, `not_held`, `renew_failed`, `session_ended`, `max_hold` — counted when fencelock notices (the watchdog's tick, or a task awaiting `lost()`) |
//! | `fencelock_waiters` | gauge | `backend` | acquires waiting now, summed over the process's lockers |
//! | `fencelock_handoffs_total` | counter | `backend` | releases that handed the lock straight to a waiter of the same locker |
//!
//! `backend` is the backend's name (`redis`, `sqlite`, …). The label sets are
//! small and fixed: no key or owner is ever a label.
//!
//! # Exporting them
//!
//! A service that serves Prometheus's format with
//! `metrics-exporter-prometheus` (not a dependency of fencelock):
//!
//! ```ignore
//! // Cargo.toml: fencelock = { version = "0.1", features = ["metrics", "redis"] }
//! //             metrics-exporter-prometheus = "0.17"
//! use metrics_exporter_prometheus::PrometheusBuilder;
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     // Serves http://0.0.0.0:9000/metrics.
//!     PrometheusBuilder::new()
//!         .with_http_listener(([0, 0, 0, 0], 9000))
//!         .install()?;
//!     let locker = fencelock::connect("redis://127.0.0.1:6379").await?;
//!     let guard = locker.lock("orders/42").acquire().await?;
//!     guard.release().await?;
//!     // fencelock_acquire_wait_seconds_count{backend="redis",outcome="granted"} 1
//!     Ok(())
//! }
//! ```

use crate::guard::LostReason;

/// Outcomes of an acquire, as the `outcome` label spells them.
pub(crate) mod outcome {
    pub(crate) const GRANTED: &str = "granted";
    pub(crate) const BUSY: &str = "busy";
    pub(crate) const TIMEOUT: &str = "timeout";
    pub(crate) const ERROR: &str = "error";
}

/// The `reason` label of a lost lease; `None` for a release.
fn reason_label(reason: &LostReason) -> Option<&'static str> {
    Some(match reason {
        LostReason::Expired => "expired",
        LostReason::NotHeld(_) => "not_held",
        LostReason::RenewFailed(_) => "renew_failed",
        LostReason::SessionEnded(_) => "session_ended",
        LostReason::MaxHold => "max_hold",
        LostReason::Released => return None,
    })
}

#[cfg(feature = "metrics")]
mod record {
    use std::time::Duration;

    use ::metrics::{counter, gauge, histogram};

    pub(crate) fn acquire(backend: &'static str, outcome: &'static str, waited: Duration) {
        histogram!("fencelock_acquire_wait_seconds", "backend" => backend, "outcome" => outcome)
            .record(waited.as_secs_f64());
    }

    pub(crate) fn hold(backend: &'static str, held: Duration) {
        histogram!("fencelock_hold_seconds", "backend" => backend).record(held.as_secs_f64());
    }

    pub(crate) fn renewals(backend: &'static str, outcome: &'static str, n: u64) {
        counter!("fencelock_renewals_total", "backend" => backend, "outcome" => outcome)
            .increment(n);
    }

    pub(crate) fn lost(backend: &'static str, reason: &'static str) {
        counter!("fencelock_leases_lost_total", "backend" => backend, "reason" => reason)
            .increment(1);
    }

    pub(crate) fn waiters(backend: &'static str, delta: f64) {
        gauge!("fencelock_waiters", "backend" => backend).increment(delta);
    }

    pub(crate) fn handoff(backend: &'static str) {
        counter!("fencelock_handoffs_total", "backend" => backend).increment(1);
    }
}

#[cfg(not(feature = "metrics"))]
mod record {
    use std::time::Duration;

    pub(crate) fn acquire(_: &'static str, _: &'static str, _: Duration) {}
    pub(crate) fn hold(_: &'static str, _: Duration) {}
    pub(crate) fn renewals(_: &'static str, _: &'static str, _: u64) {}
    pub(crate) fn lost(_: &'static str, _: &'static str) {}
    pub(crate) fn waiters(_: &'static str, _: f64) {}
    pub(crate) fn handoff(_: &'static str) {}
}

pub(crate) use record::{acquire, handoff, hold, renewals};

/// Counts a lease lost for `reason` (a release is not counted).
pub(crate) fn lost(backend: &'static str, reason: &LostReason) {
    if let Some(label) = reason_label(reason) {
        record::lost(backend, label);
    }
}

/// An acquire that waits: counted in `fencelock_waiters` while it lives.
pub(crate) struct Waiting(&'static str);

impl Waiting {
    pub(crate) fn new(backend: &'static str) -> Waiting {
        record::waiters(backend, 1.0);
        Waiting(backend)
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        record::waiters(self.0, -1.0);
    }
}

/// The `outcome` label of an acquire's answer (`busy`: a `try_acquire`'s
/// `Ok(None)`).
pub(crate) fn outcome_of<T>(result: &crate::Result<T>, busy: bool) -> &'static str {
    match result {
        Ok(_) if busy => outcome::BUSY,
        Ok(_) => outcome::GRANTED,
        Err(crate::Error::Timeout { .. }) => outcome::TIMEOUT,
        Err(_) => outcome::ERROR,
    }
}
