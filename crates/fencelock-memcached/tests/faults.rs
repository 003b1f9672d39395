//! memcached fault test: a restart empties the server, so a held lock is gone;
//! the holder must learn it at its next renewal (`lost()`, the backend saying
//! the item is gone), and another client can take the lock at once.

use std::process::Command;
use std::time::{Duration, Instant};

use fencelock_core::{Error, Locker, LostReason};
use fencelock_memcached::MemcachedBackend;
use fencelock_testkit::{ServerProcess, free_port};

fn memcached(port: u16) -> ServerProcess {
    let mut cmd = Command::new("memcached");
    cmd.args([
        "-l",
        "127.0.0.1",
        "-p",
        &port.to_string(),
        "-U",
        "0",
        "-m",
        "16",
        "-u",
        "memcache",
    ]);
    ServerProcess::spawn("memcached", cmd, port, Duration::from_secs(10)).expect("memcached starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_during_a_hold_fires_lost_at_the_next_renewal() {
    let port = free_port();
    let mut server = memcached(port);
    let url = format!("memcached://127.0.0.1:{port}");
    let locker = Locker::new(MemcachedBackend::connect(&url).await.unwrap());
    let ttl = Duration::from_secs(3);
    let g = locker.lock("restart").ttl(ttl).acquire().await.unwrap();
    server.kill();
    let _server = memcached(port);
    let start = Instant::now();
    let lost = tokio::time::timeout(ttl * 2, g.lost())
        .await
        .expect("lost() did not fire after the restart");
    assert!(
        matches!(
            &lost,
            Error::Lost {
                reason: LostReason::NotHeld(_),
                ..
            }
        ),
        "expected the backend to report the item gone, got {lost:?}"
    );
    // At the next renewal (every ttl/3), not at the deadline.
    assert!(
        start.elapsed() < ttl,
        "lost() fired only after {:?}",
        start.elapsed()
    );
    let other = Locker::new(MemcachedBackend::connect(&url).await.unwrap());
    let g2 = other
        .lock("restart")
        .try_acquire()
        .await
        .unwrap()
        .expect("free after the restart");
    // The stale holder's release does not touch the new holder's lock.
    assert!(matches!(g.release().await, Err(Error::NotHeld { .. })));
    assert!(other.lock("restart").try_acquire().await.unwrap().is_none());
    g2.release().await.unwrap();
}
