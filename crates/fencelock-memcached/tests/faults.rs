//! memcached fault test: a restart empties the server, so a held lock is gone;
//! the holder must learn it at its next renewal (`lost()`, the backend saying
//! the item is gone), and another client can take the lock at once.

use std::process::Command;
use std::time::{Duration, Instant};

use fencelock_core::backend::{LeaseRef, Renewal, Request, async_trait};
use fencelock_core::{Backend, Error, FencingToken, Key, Locker, LostReason, Mode, Owner, Result};
use fencelock_memcached::MemcachedBackend;
use fencelock_testkit::faults::{self, FaultHarness};
use fencelock_testkit::{ServerProcess, free_port};

/// The testkit's holder-process scenarios (no tokens, so no fenced write).
struct Memcached;

#[async_trait]
impl FaultHarness for Memcached {
    async fn locker(&self, url: &str) -> Result<Locker> {
        Ok(Locker::new(MemcachedBackend::connect(url).await?))
    }

    async fn fenced_write(&self, _key: &str, _token: FencingToken) -> Result<bool> {
        Err(Error::config("memcached gives no fencing tokens"))
    }
}

#[test]
#[ignore = "holder process of the testkit's SIGKILL scenario"]
fn holder_worker() {
    faults::holder_worker(Memcached);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_frees_the_lock_after_its_ttl() {
    faults::killed_holder_frees_after_its_ttl(&Memcached, "memcached://127.0.0.1:11211").await;
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_from_before_a_restart_never_touches_the_next_owners_item() {
    // memcached counts CAS values from 1 again after a restart: what the
    // holder remembers of its item must not match the item another owner adds.
    let port = free_port();
    let mut server = memcached(port);
    let url = format!("memcached://127.0.0.1:{port}");
    let a = MemcachedBackend::connect(&url).await.unwrap();
    let req = Request::new(
        Key::new("cas").unwrap(),
        Owner::new("before").unwrap(),
        Mode::Exclusive,
        Duration::from_secs(30),
    );
    let ga = a.try_acquire(&req).await.unwrap().unwrap();
    server.kill();
    let _server = memcached(port);
    let b = Locker::new(MemcachedBackend::connect(&url).await.unwrap());
    let gb = b
        .lock("cas")
        .ttl(Duration::from_secs(30))
        .try_acquire()
        .await
        .unwrap()
        .expect("free after the restart");
    // A's pooled connections died with the server: let it make new ones.
    for _ in 0..4 {
        let _ = a.inspect(&Key::new("other").unwrap()).await;
    }
    // A renews what it believes it holds, then lets go of it: both must see
    // that the item is B's now, and leave it alone.
    let lease = LeaseRef::new(&req, &ga);
    let renewed = a.renew(std::slice::from_ref(&lease)).await.unwrap();
    assert!(
        matches!(renewed[0], Renewal::Lost { .. }),
        "the holder from before the restart renewed: {renewed:?}"
    );
    let released = a.release(&lease).await;
    assert!(
        matches!(released, Err(Error::NotHeld { .. })),
        "the holder from before the restart released: {released:?}"
    );
    let c = Locker::new(MemcachedBackend::connect(&url).await.unwrap());
    assert!(
        c.lock("cas").try_acquire().await.unwrap().is_none(),
        "the new owner's lock was deleted by a holder from before the restart"
    );
    assert!(gb.is_valid());
    gb.release().await.unwrap();
}

/// Renewal goes 200 leases at a time (a pipelined read, a pipeline of CAS
/// writes): three batches, the last one partial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_held_locks_than_a_renewal_batch_are_all_renewed() {
    let locker = Locker::new(
        MemcachedBackend::connect("memcached://127.0.0.1:11211")
            .await
            .unwrap(),
    );
    fencelock_testkit::faults::many_held_locks_are_all_renewed(&locker, 450).await;
}

/// A frozen server (SIGSTOP: a stuck VM) answers nothing: a waiter still
/// returns by its deadline (plus the request timeout), and a release returns
/// an error rather than hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_server_cannot_hold_a_waiter_or_a_release_past_its_limits() {
    let port = free_port();
    let server = memcached(port);
    let url = format!("memcached://127.0.0.1:{port}");
    let a = Locker::new(MemcachedBackend::connect(&url).await.unwrap());
    let g = a.lock("frozen").acquire().await.unwrap();
    let b = Locker::new(MemcachedBackend::connect(&url).await.unwrap());
    server.pause().unwrap();
    // Generous bounds: a hang, not a slow answer, fails this test.
    let waited = tokio::time::timeout(
        Duration::from_secs(60),
        b.lock("frozen").wait(Duration::from_secs(3)).acquire(),
    )
    .await
    .expect("a waiter's acquire hung on a frozen server past its 3 s wait");
    assert!(waited.is_err(), "granted on a frozen server");
    let released = tokio::time::timeout(Duration::from_secs(60), g.release())
        .await
        .expect("a release hung on a frozen server");
    assert!(released.is_err(), "a release on a frozen server succeeded");
    server.resume().unwrap();
}

/// A silent server (a frozen VM, a cut cable) cannot keep a waiter past its
/// wait, nor a connect running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_server_cannot_hold_a_waiter_past_its_wait() {
    faults::a_stalled_server_cannot_hold_a_waiter_past_its_deadline(
        &Memcached,
        "memcached://127.0.0.1:11211",
    )
    .await;
}
