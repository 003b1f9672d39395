//! Tokens and grants survive a crash of a server configured for speed over
//! durability (`synchronous_commit=off`): no token is handed out twice or
//! goes backwards, in both modes.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use fencelock_core::Locker;
use fencelock_postgres::PostgresBackend;
use support::PrivatePostgres;

/// Grants at full speed for a while, then a crash of the whole server in the
/// middle of them; after recovery the next grant's token must be above every
/// token handed out before the crash.
async fn tokens_survive_a_crash(mode: &str) {
    let mut pg = PrivatePostgres::start_with(&["synchronous_commit=off"]);
    let url = pg.url(mode);
    for trial in 0..3 {
        let locker = Locker::new(PostgresBackend::connect(&url).await.unwrap());
        let highest = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let granting = tokio::spawn({
            let (locker, highest, stop) = (locker.clone(), highest.clone(), stop.clone());
            async move {
                while !stop.load(Ordering::SeqCst) {
                    // A short TTL: the hold the crash interrupts lapses soon.
                    let Ok(g) = locker
                        .lock("k")
                        .ttl(Duration::from_secs(2))
                        // Room for advisory mode's restart gate (a TTL).
                        .wait(Duration::from_secs(10))
                        .acquire()
                        .await
                    else {
                        break;
                    };
                    if let Some(t) = g.token() {
                        highest.fetch_max(t.get(), Ordering::SeqCst);
                    }
                    if g.release().await.is_err() {
                        break;
                    }
                }
            }
        });
        // Grants run (after the previous trial's crash, advisory mode grants
        // nothing for a TTL), then the crash comes in their midst.
        while highest.load(Ordering::SeqCst) == 0 && !granting.is_finished() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
        pg.crash_and_restart();
        stop.store(true, Ordering::SeqCst);
        let _ = granting.await;
        let handed = highest.load(Ordering::SeqCst);
        assert!(handed > 0, "trial {trial}: no grant before the crash");
        let after = Locker::new(PostgresBackend::connect(&url).await.unwrap());
        let g = after
            .lock("k")
            .ttl(Duration::from_secs(2))
            .wait(Duration::from_secs(30))
            .acquire()
            .await
            .unwrap();
        let next = g.token().unwrap().get();
        assert!(
            next > handed,
            "{mode}, trial {trial}: token {next} after the crash, but {handed} was handed out before it"
        );
        g.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_tokens_survive_a_crash_with_synchronous_commit_off() {
    tokens_survive_a_crash("lease").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_tokens_survive_a_crash_with_synchronous_commit_off() {
    tokens_survive_a_crash("advisory").await;
}
