//! PostgreSQL fault tests, in both modes (the scenarios of
//! `fencelock_testkit::faults`): a restart ends advisory sessions, so an
//! advisory holder's `lost()` fires, while a lease row outlives a restart
//! shorter than its TTL; a killed holder's lock is free after the TTL (lease)
//! or at once (advisory: the session dies with the process); a paused holder
//! loses the lock after the TTL in both modes, learns it on resuming, and its
//! stale write is fenced off.

mod support;

use fencelock_testkit::faults;
use support::{Pg, PrivatePostgres, SHARED};

fn shared(mode: &str) -> String {
    format!("{SHARED}?mode={mode}")
}

#[test]
#[ignore = "holder process of the SIGKILL and SIGSTOP tests"]
fn holder_worker() {
    faults::holder_worker(Pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restart_ends_advisory_holds() {
    let mut pg = PrivatePostgres::start();
    let url = pg.url("advisory");
    faults::restart_ends_session_holds(&Pg, &url, async || pg.restart()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_outlives_a_restart_shorter_than_its_ttl() {
    let mut pg = PrivatePostgres::start();
    let url = pg.url("lease");
    faults::lease_outlives_a_short_restart(&Pg, &url, async || pg.restart()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_lease_holder_frees_the_lock_after_its_ttl() {
    faults::killed_holder_frees_after_its_ttl(&Pg, &shared("lease")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_advisory_holder_frees_the_lock_at_once() {
    faults::killed_session_holder_frees_at_once(&Pg, &shared("advisory")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_lease_holder_loses_its_lock_and_its_stale_write() {
    faults::paused_holder_loses_its_lock_and_its_stale_write(&Pg, &shared("lease")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_advisory_holder_loses_its_lock_and_its_stale_write() {
    faults::paused_holder_loses_its_lock_and_its_stale_write(&Pg, &shared("advisory")).await;
}

/// A silent server (a frozen VM, a cut cable) cannot keep a waiter past its
/// wait, nor a connect running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_server_cannot_hold_a_lease_waiter_past_its_wait() {
    faults::a_stalled_server_cannot_hold_a_waiter_past_its_deadline(&Pg, &shared("lease")).await;
}

/// A silent server (a frozen VM, a cut cable) cannot keep a waiter past its
/// wait, nor a connect running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_server_cannot_hold_a_advisory_waiter_past_its_wait() {
    faults::a_stalled_server_cannot_hold_a_waiter_past_its_deadline(&Pg, &shared("advisory")).await;
}
