//! MySQL/MariaDB fault tests, in both modes: the server restarted under a hold,
//! the holder process SIGKILLed and SIGSTOPped.
//!
//! What must happen: a restart ends GET_LOCK sessions, so a get_lock holder's
//! `lost()` fires, while a lease row outlives a restart shorter than its TTL; a
//! killed holder's lock is free after the TTL (lease) or at once (get_lock, the
//! session dies with the process); a paused holder loses the lock after the TTL
//! in every mode, learns it on resuming, and its stale write is fenced off.

mod support;

use std::time::{Duration, Instant};

use fencelock_core::{Error, Locker};
use fencelock_mysql::MySqlBackend;
use fencelock_testkit::{HolderProcess, Signal};
use support::{PrivateMariaDb, SHARED, fenced_write, unique};

async fn locker(url: &str) -> Locker {
    Locker::new(MySqlBackend::connect(url).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restart_ends_get_lock_holds() {
    let mut db = PrivateMariaDb::start();
    let url = db.url("get_lock");
    let key = unique("restart-get-lock");
    let g = locker(&url)
        .await
        .lock(&key)
        .ttl(Duration::from_secs(1))
        .acquire()
        .await
        .unwrap();
    let before = g.token().unwrap();
    db.restart();
    let lost = tokio::time::timeout(Duration::from_secs(10), g.lost())
        .await
        .expect("lost() did not fire after the server restarted");
    assert!(matches!(lost, Error::Lost { .. }), "{lost:?}");
    assert!(!g.is_valid());
    let g2 = locker(&url)
        .await
        .lock(&key)
        .try_acquire()
        .await
        .unwrap()
        .expect("free after the restart");
    assert!(
        g2.token().unwrap() > before,
        "token {:?} after {before:?}",
        g2.token()
    );
    g2.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_outlives_a_restart_shorter_than_its_ttl() {
    let mut db = PrivateMariaDb::start();
    let url = db.url("lease");
    let key = unique("restart-lease");
    let g = locker(&url)
        .await
        .lock(&key)
        .ttl(Duration::from_secs(6))
        .acquire()
        .await
        .unwrap();
    db.restart();
    // Two renewal periods after the restart the watchdog has renewed on new connections.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(g.is_valid(), "the lease was lost over a short restart");
    let other = locker(&url).await;
    assert!(
        other.lock(&key).try_acquire().await.unwrap().is_none(),
        "another client got a held lease"
    );
    g.release().await.unwrap();
    let g2 = other
        .lock(&key)
        .try_acquire()
        .await
        .unwrap()
        .expect("free after release");
    g2.release().await.unwrap();
}

/// The holder process: holds the key of FENCELOCK_MY_HOLD_KEY on the URL of
/// FENCELOCK_MY_HOLD_URL with a 2 s TTL, reports, and after losing the lock
/// tries the write a paused holder would still make.
#[test]
#[ignore = "holder process of the SIGKILL and SIGSTOP tests"]
fn holder_worker() {
    let (Ok(url), Ok(key)) = (
        std::env::var("FENCELOCK_MY_HOLD_URL"),
        std::env::var("FENCELOCK_MY_HOLD_KEY"),
    ) else {
        return;
    };
    let ttl: u64 = std::env::var("FENCELOCK_MY_HOLD_TTL_MS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(2000);
    tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(async move {
            let g = locker(&url)
                .await
                .lock(&key)
                .ttl(Duration::from_millis(ttl))
                .acquire()
                .await
                .unwrap();
            let token = g.token().unwrap();
            println!("acquired {}", token.get());
            let lost = g.lost().await;
            println!("lost {}", matches!(lost, Error::Lost { .. }));
            let written = fenced_write(&key, token).await;
            println!(
                "stale-write {}",
                if written { "accepted" } else { "rejected" }
            );
        });
}

fn hold(mode: &str, key: &str, ttl_ms: u64) -> (HolderProcess, u64) {
    let url = format!("{SHARED}?mode={mode}");
    let mut h = HolderProcess::spawn(
        "holder_worker",
        &[
            ("FENCELOCK_MY_HOLD_URL", &url),
            ("FENCELOCK_MY_HOLD_KEY", key),
            ("FENCELOCK_MY_HOLD_TTL_MS", &ttl_ms.to_string()),
        ],
    )
    .unwrap();
    let token = h.expect("acquired ").unwrap().parse().unwrap();
    (h, token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_lease_holder_frees_the_lock_after_its_ttl() {
    let key = unique("kill-lease");
    let (h, token) = hold("lease", &key, 2000);
    h.signal(Signal::SIGKILL).unwrap();
    let start = Instant::now();
    let g = locker(SHARED)
        .await
        .lock(&key)
        .wait(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    assert!(
        start.elapsed() >= Duration::from_secs(1),
        "granted {:?} after the kill, before the TTL",
        start.elapsed()
    );
    assert!(g.token().unwrap().get() > token);
    g.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_get_lock_holder_frees_the_lock_at_once() {
    let key = unique("kill-get-lock");
    // A TTL far longer than the wait below: only the session's end can free it.
    let (h, token) = hold("get_lock", &key, 60_000);
    let url = format!("{SHARED}?mode=get_lock");
    let other = locker(&url).await;
    assert!(other.lock(&key).try_acquire().await.unwrap().is_none());
    h.signal(Signal::SIGKILL).unwrap();
    let g = other
        .lock(&key)
        .wait(Duration::from_secs(20))
        .acquire()
        .await
        .unwrap();
    assert!(g.token().unwrap().get() > token);
    g.release().await.unwrap();
}

async fn paused_holder_loses_its_lock(mode: &str) {
    let key = unique(&format!("pause-{mode}"));
    let (h, stale) = hold(mode, &key, 2000);
    h.signal(Signal::SIGSTOP).unwrap();
    let start = Instant::now();
    let url = format!("{SHARED}?mode={mode}");
    let g = locker(&url)
        .await
        .lock(&key)
        .wait(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    assert!(
        start.elapsed() >= Duration::from_secs(1),
        "{mode}: granted before the paused holder's TTL"
    );
    let token = g.token().unwrap();
    assert!(token.get() > stale, "{mode}: token {token:?} after {stale}");
    assert!(
        fenced_write(&key, token).await,
        "{mode}: the new holder's write was refused"
    );
    h.signal(Signal::SIGCONT).unwrap();
    let rest = h.finish();
    assert!(
        rest.iter().any(|l| l == "lost true"),
        "{mode}: the resumed holder never learned: {rest:?}"
    );
    assert!(
        rest.iter().any(|l| l == "stale-write rejected"),
        "{mode}: the stale write got through: {rest:?}"
    );
    g.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_lease_holder_loses_its_lock_and_its_stale_write() {
    paused_holder_loses_its_lock("lease").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_get_lock_holder_loses_its_lock_and_its_stale_write() {
    paused_holder_loses_its_lock("get_lock").await;
}
