//! MySQL/MariaDB fault tests, in both modes (the scenarios of
//! `fencelock_testkit::faults`): a restart ends GET_LOCK sessions, so a
//! get_lock holder's `lost()` fires, while a lease row outlives a restart
//! shorter than its TTL; a killed holder's lock is free after the TTL (lease)
//! or at once (get_lock: the session dies with the process); a paused holder
//! loses the lock after the TTL in both modes, learns it on resuming, and its
//! stale write is fenced off.

mod support;

use fencelock_testkit::faults;
use support::{My, PrivateMariaDb, SHARED};

fn shared(mode: &str) -> String {
    format!("{SHARED}?mode={mode}")
}

#[test]
#[ignore = "holder process of the SIGKILL and SIGSTOP tests"]
fn holder_worker() {
    faults::holder_worker(My);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restart_ends_get_lock_holds() {
    let mut db = PrivateMariaDb::start();
    let url = db.url("get_lock");
    faults::restart_ends_session_holds(&My, &url, async || db.restart()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_outlives_a_restart_shorter_than_its_ttl() {
    let mut db = PrivateMariaDb::start();
    let url = db.url("lease");
    faults::lease_outlives_a_short_restart(&My, &url, async || db.restart()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_lease_holder_frees_the_lock_after_its_ttl() {
    faults::killed_holder_frees_after_its_ttl(&My, &shared("lease")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_get_lock_holder_frees_the_lock_at_once() {
    faults::killed_session_holder_frees_at_once(&My, &shared("get_lock")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_lease_holder_loses_its_lock_and_its_stale_write() {
    faults::paused_holder_loses_its_lock_and_its_stale_write(&My, &shared("lease")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_get_lock_holder_loses_its_lock_and_its_stale_write() {
    faults::paused_holder_loses_its_lock_and_its_stale_write(&My, &shared("get_lock")).await;
}

/// Renewals go 100 leases to a statement, per TTL: one Locker holding 250
/// locks of two TTLs keeps them all past their TTLs, and a hold an operator
/// broke is reported lost, not renewed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_held_locks_of_two_ttls_are_renewed_and_a_broken_one_is_lost() {
    use std::time::Duration;

    let backend = fencelock_mysql::MySqlBackend::connect(&shared("lease"))
        .await
        .unwrap();
    let locker = fencelock_core::Locker::new(backend.clone());
    let base = fencelock_testkit::faults::unique_key("many");
    let mut guards = Vec::new();
    for i in 0..250u64 {
        let ttl = Duration::from_secs(3 + i % 2);
        let g = locker
            .lock(format!("{base}/{i}"))
            .ttl(ttl)
            .acquire()
            .await
            .unwrap();
        guards.push(g);
    }
    let broken = guards[137].key().clone();
    backend.force_release(&broken).await.unwrap();
    // Past both TTLs: only renewals keep them.
    tokio::time::sleep(Duration::from_secs(6)).await;
    for g in &guards {
        if *g.key() == broken {
            assert!(!g.is_valid(), "the broken hold was renewed");
        } else {
            assert!(
                g.is_valid(),
                "{} was lost: {:?}",
                g.key(),
                g.lease().lost_reason()
            );
        }
    }
    for g in guards {
        let _ = g.release().await;
    }
}

/// A silent server (a frozen VM, a cut cable) cannot keep a waiter past its
/// wait, nor a connect running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_server_cannot_hold_a_lease_waiter_past_its_wait() {
    faults::a_stalled_server_cannot_hold_a_waiter_past_its_deadline(&My, &shared("lease")).await;
}

/// A silent server (a frozen VM, a cut cable) cannot keep a waiter past its
/// wait, nor a connect running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_server_cannot_hold_a_get_lock_waiter_past_its_wait() {
    faults::a_stalled_server_cannot_hold_a_waiter_past_its_deadline(&My, &shared("get_lock")).await;
}
