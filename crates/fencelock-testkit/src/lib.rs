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
pub mod replicated;
mod server;

pub use conformance::{
    CaseReport, Harness, Outcome, Report, case_names, run_case, run_conformance,
};
pub use docs::{assert_options_documented, documented_options};
pub use fencelock_core::{HistorySummary, Hold, Violation, check_history};
pub use flaky::FlakyBackend;
pub use holder::HolderProcess;
pub use proxy::{FaultProxy, ProxyMode};
pub use server::{
    ServerProcess, account_ids, free_port, postgres_program, send_signal, wait_for_port, zookeeper,
    zookeeper_on,
};

/// Re-exported for fault tests that signal processes.
pub use nix::sys::signal::Signal;

/// Makes each conformance case a `#[tokio::test]` of its own for the backend
/// behind `harness` (an expression, evaluated once per test), so that libtest
/// lists, filters (`cargo test -p fencelock-redis -- exclusion`) and reports
/// them one by one. Put each use in a module of its own.
///
/// A third argument says which cases the backend must skip (for lack of a
/// capability): `none_skipped`, or `skips: [case, …]`; a case skipped or run
/// against it fails. Without it, skips are not checked.
///
/// ```ignore
/// mod single {
///     use super::*;
///     fencelock_testkit::conformance_tests!("redis", Redis { url: SINGLE }, none_skipped);
/// }
/// ```
#[macro_export]
macro_rules! conformance_tests {
    ($label:expr, $harness:expr) => {
        $crate::conformance_tests!(@cases [$label, $harness, None]);
    };
    ($label:expr, $harness:expr, none_skipped) => {
        $crate::conformance_tests!(@cases [$label, $harness, Some(&[])]);
    };
    ($label:expr, $harness:expr, skips: [$($skip:ident),* $(,)?]) => {
        $crate::conformance_tests!(@cases [$label, $harness, Some(&[$(stringify!($skip)),*])]);
    };
    (@cases $args:tt) => {
        $crate::__conformance_tests!(
            $args
            bad_input_fails_before_io
            exclusion_under_contention
            try_once_when_busy
            wait_timeout_is_an_error_near_the_deadline
            waiter_is_granted_after_release
            dropped_guard_is_released
            tokens_increase_across_holders
            reentrant_holds_count
            mixed_ttl_reentrant_holds_keep_the_longest
            a_grant_after_a_wait_longer_than_the_ttl_is_held
            repeated_request_is_idempotent
            readers_coexist_and_exclude_writers
            racing_shared_holds_of_one_owner_keep_their_grants
            semaphore_admits_exactly_n
            a_semaphore_keeps_one_permit_count_while_held
            ttl_frees_a_leaked_guard
            watchdog_keeps_lock_past_3x_ttl
            fixed_lease_expires_and_fires_lost
            max_hold_stops_renewal
            lost_fires_when_lease_is_stolen
            a_stale_guard_of_the_same_owner_leaves_the_new_hold_alone
            lost_fires_when_renewal_fails
            non_owner_release_is_not_held
            run_cancels_closure_on_lost
            multi_lock_is_all_or_nothing
            inspect_shows_the_holder
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_tests {
    ([$label:expr, $harness:expr, $skips:expr] $($case:ident)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let name = stringify!($case);
                let report = $crate::run_case($label, name, $harness).await;
                report.assert_passed();
                let expected: Option<&[&str]> = $skips;
                if let Some(expected) = expected {
                    assert_eq!(
                        report.skipped().contains(&name),
                        expected.contains(&name),
                        "{report}"
                    );
                }
            }
        )*

        #[test]
        fn every_conformance_case_has_a_test() {
            assert_eq!($crate::case_names(), [$(stringify!($case)),*]);
            let expected: Option<&[&str]> = $skips;
            for skip in expected.unwrap_or_default() {
                assert!($crate::case_names().contains(skip), "no case {skip:?}");
            }
        }
    };
}
