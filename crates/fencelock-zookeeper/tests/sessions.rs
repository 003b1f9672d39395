//! ZooKeeper sessions: an acquire dropped while its create is in flight leaves
//! no ghost holder, and a hold never outlives the session timeout the server
//! negotiated (which may be below the one asked for).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fencelock_core::Locker;
use fencelock_testkit::{FaultProxy, ServerProcess};
use fencelock_zookeeper::ZooKeeperBackend;

/// A private standalone server with `maxSessionTimeout` = `max_session_ms`.
fn private_zk(max_session_ms: u64) -> (ServerProcess, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let server =
        fencelock_testkit::zookeeper(dir.path(), &format!("maxSessionTimeout={max_session_ms}"))
            .unwrap();
    (server, dir)
}

/// Connects, giving a server that has just started (a JVM on a busy machine)
/// up to a minute to take sessions.
async fn connect(url: &str) -> ZooKeeperBackend {
    let start = Instant::now();
    loop {
        match ZooKeeperBackend::connect(url).await {
            Ok(b) => return b,
            Err(e) => assert!(start.elapsed() < Duration::from_secs(60), "{url}: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_dropped_while_its_create_is_in_flight_leaves_no_ghost() {
    let (server, _dir) = private_zk(60_000);
    let direct = format!("zk://127.0.0.1:{}?session_timeout=20s", server.port());
    let proxy = FaultProxy::start(server.addr()).await.unwrap();
    let slow_backend = connect(&format!("zk://{}?session_timeout=20s", proxy.addr())).await;
    let slow = Locker::new(slow_backend.clone());
    let b = Locker::new(connect(&direct).await);
    let held = b.lock("k").acquire().await.unwrap();
    // A's create reaches the server 2 s after it is sent; A gives up at 0.5 s.
    proxy.set_latency(Duration::from_secs(2));
    let gave_up = tokio::time::timeout(
        Duration::from_millis(500),
        slow.lock("k").wait(Duration::from_secs(30)).acquire(),
    )
    .await;
    assert!(
        gave_up.is_err(),
        "granted while another client held the lock"
    );
    // The create has reached the server (at 2 s) before B lets go.
    tokio::time::sleep(Duration::from_secs(3)).await;
    proxy.set_latency(Duration::ZERO);
    held.release().await.unwrap();
    // A's session lives on (its backend is kept); its node must not block C.
    let c = Locker::new(connect(&direct).await);
    let g = c
        .lock("k")
        .wait(Duration::from_secs(20))
        .acquire()
        .await
        .expect("a dropped acquire left its node queued: a ghost holder");
    g.release().await.unwrap();
    drop(slow_backend);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_never_outlives_the_negotiated_session_timeout() {
    // The server grants sessions of 4 s at most; the client asks for 10 s.
    let (server, _dir) = private_zk(4_000);
    let proxy = FaultProxy::start(server.addr()).await.unwrap();
    let a = Locker::new(connect(&format!("zk://{}?session_timeout=10s", proxy.addr())).await);
    let g = a
        .lock("k")
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    assert!(
        g.ttl() <= Duration::from_secs(4),
        "a hold of a 4 s session claims a TTL of {:?}",
        g.ttl()
    );
    let lost_at = tokio::spawn({
        let lost = g.lost();
        async move {
            lost.await;
            Instant::now()
        }
    });
    // A is cut off; its session expires on the server after 4 s.
    proxy.blackhole();
    let b = Locker::new(connect(&format!("zk://127.0.0.1:{}", server.port())).await);
    let gb = b
        .lock("k")
        .wait(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let granted_at = Instant::now();
    let lost_at = tokio::time::timeout(Duration::from_secs(30), lost_at)
        .await
        .expect("A never learned it lost the lock")
        .unwrap();
    assert!(
        lost_at <= granted_at,
        "A believed it held the lock {:?} after B was granted it",
        lost_at - granted_at
    );
    gb.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_session_follows_an_expired_one() {
    let (server, _dir) = private_zk(60_000);
    let proxy = FaultProxy::start(server.addr()).await.unwrap();
    let a = Locker::new(connect(&format!("zk://{}?session_timeout=2s", proxy.addr())).await);
    let g = a
        .lock("before")
        .ttl(Duration::from_secs(2))
        .acquire()
        .await
        .unwrap();
    // Cut off well past the session timeout: the server expires the session.
    proxy.blackhole();
    let lost = tokio::time::timeout(Duration::from_secs(20), g.lost()).await;
    assert!(lost.is_ok(), "the hold of an expired session stayed valid");
    tokio::time::sleep(Duration::from_secs(4)).await;
    proxy.restore();
    // The client learns that its session expired, and opens a new one.
    let start = Instant::now();
    let g2 = loop {
        match a.lock("after").wait(Duration::from_secs(5)).acquire().await {
            Ok(g) => break g,
            Err(e) => {
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "no acquire works after the session expired: {e}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert!(g2.is_valid());
    g2.release().await.unwrap();
}

/// Maintenance: the server is down for longer than the sessions live while
/// a waiter waits without a deadline. The waiter's session (and its place in
/// line) ends; it queues again on a new one once the server is back, and is
/// granted, since the holder's session ended too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_waits_through_an_outage_longer_than_its_session() {
    let (server, dir) = private_zk(60_000);
    let port = server.port();
    let url = format!("zk://127.0.0.1:{port}?session_timeout=4s&connect_timeout=2s");
    let holder = Locker::new(connect(&url).await);
    let _g = holder
        .lock("k")
        .ttl(Duration::from_secs(4))
        .acquire()
        .await
        .unwrap();
    let waiter = Locker::new(connect(&url).await);
    let w = tokio::spawn(async move {
        waiter
            .lock("k")
            .ttl(Duration::from_secs(4))
            .wait_forever()
            .acquire()
            .await
            .map(|g| g.token())
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop(server);
    tokio::time::sleep(Duration::from_secs(8)).await;
    let _server = restart_zk(dir.path(), port);
    let got = tokio::time::timeout(Duration::from_secs(120), w)
        .await
        .expect("the waiter was not granted within 120 s of the restart")
        .unwrap();
    assert!(got.is_ok(), "the waiter gave up during the outage: {got:?}");
}

/// Starts the server of `dir` (see [`private_zk`]) again on `port`.
fn restart_zk(dir: &std::path::Path, port: u16) -> ServerProcess {
    let mut cmd = Command::new("java");
    cmd.args([
        "-cp",
        "/etc/zookeeper/conf_example:/usr/share/java/zookeeper.jar",
    ])
    .arg(format!("-Dzookeeper.log.dir={}", dir.display()))
    .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
    .arg(dir.join("zoo.cfg"))
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    ServerProcess::spawn("zookeeper", cmd, port, Duration::from_secs(60)).unwrap()
}
