//! Expiry follows the server's clock, not the client's: with this process's
//! wall clock an hour behind or ahead (the core's test hook), a lease lasts its
//! TTL. A backend that computed expiry on the client would free the lock at
//! once (clock behind) or an hour late (clock ahead).
//!
//! Its own test binary: the clock offset is process-wide.

use std::time::{Duration, Instant};

use fencelock_core::Locker;
use fencelock_core::clock::shift_wall_clock_for_tests;
use fencelock_mysql::MySqlBackend;

const URL: &str = "mysql://root@127.0.0.1:3306/test";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_follows_the_server_clock() {
    for (offset_ms, label) in [(-3_600_000, "behind"), (3_600_000, "ahead")] {
        shift_wall_clock_for_tests(offset_ms);
        let key = format!("clock-{label}-{}", std::process::id());
        let a = Locker::new(MySqlBackend::connect(URL).await.unwrap());
        let b = Locker::new(MySqlBackend::connect(URL).await.unwrap());
        let ttl = Duration::from_secs(2);
        let start = Instant::now();
        let g = a.lock(&key).lease(ttl).acquire().await.unwrap();
        assert!(
            b.lock(&key).try_acquire().await.unwrap().is_none(),
            "client clock {label}: the lease was free at once"
        );
        let g2 = b
            .lock(&key)
            .wait(Duration::from_secs(20))
            .acquire()
            .await
            .unwrap();
        let took = start.elapsed();
        assert!(
            took >= ttl / 2,
            "client clock {label}: freed after {took:?}"
        );
        g2.release().await.unwrap();
        drop(g);
    }
    shift_wall_clock_for_tests(0);
}
