//! The fencelock test kit: the conformance suite every backend runs against a
//! real server, the history checker, a TCP fault proxy, and helpers that start
//! throw-away servers on free loopback ports.
//!
//! A backend crate implements [`Harness`] in its tests and calls
//! [`run_conformance`] once; the suite never copies test bodies per backend.
#![warn(missing_docs)]

mod conformance;
mod docs;
pub mod faults;
mod flaky;
mod holder;
mod proxy;
mod server;

pub use conformance::{CaseReport, Harness, Outcome, Report, run_conformance};
pub use docs::{assert_options_documented, documented_options};
pub use fencelock_core::{HistorySummary, Hold, Violation, check_history};
pub use flaky::FlakyBackend;
pub use holder::HolderProcess;
pub use proxy::{FaultProxy, ProxyMode};
pub use server::{
    ServerProcess, account_ids, free_port, postgres_program, send_signal, wait_for_port,
};

/// Re-exported for fault tests that signal processes.
pub use nix::sys::signal::Signal;
