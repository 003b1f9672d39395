//! ZooKeeper fault tests: the herd, a leader killed under held locks, a holder
//! process paused past its session, and empty lock paths cleaned up.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fencelock_core::backend::async_trait;
use fencelock_core::{Error, FencingToken, Key, Locker, Result};
use fencelock_testkit::faults::{self, FaultHarness};
use fencelock_testkit::{Signal, send_signal};
use fencelock_zookeeper::ZooKeeperBackend;

const STANDALONE: &str = "zk://127.0.0.1:2181?session_timeout=3s";

fn unique(name: &str) -> String {
    format!(
        "faults-{name}-{}-{}",
        std::process::id(),
        Instant::now().elapsed().as_nanos()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_waiters_one_wake_up_per_release() {
    let key = unique("herd");
    let holder = ZooKeeperBackend::connect(STANDALONE).await.unwrap();
    let g = Locker::new(holder.clone())
        .lock(&key)
        .acquire()
        .await
        .unwrap();
    // 50 waiters, each its own session (a Locker's local line would hide a herd).
    let mut backends = Vec::new();
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let b = ZooKeeperBackend::connect(STANDALONE).await.unwrap();
        backends.push(b.clone());
        let k = key.clone();
        tasks.push(tokio::spawn(async move {
            let g = Locker::new(b)
                .lock(&k)
                .wait(Duration::from_secs(60))
                .acquire()
                .await?;
            // Released at once: the releases come in a row.
            g.release().await
        }));
    }
    let start = Instant::now();
    while holder.queue(&Key::new(&key).unwrap()).await.unwrap().len() < 51 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the waiters never all queued"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Everybody waits on a watch now; nobody has been woken yet.
    let before: u64 = backends.iter().map(|b| b.watch_events()).sum();
    assert_eq!(before, 0, "waiters were woken before any release");
    g.release().await.unwrap();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let woken: u64 = backends.iter().map(|b| b.watch_events()).sum();
    // 50 releases (the holder's and 49 waiters') each woke exactly one waiter.
    assert_eq!(woken, 50, "{woken} watch events for 50 releases: a herd");
}

/// The testkit's fault scenarios against the standalone server.
struct Zk;

#[async_trait]
impl FaultHarness for Zk {
    async fn locker(&self, url: &str) -> Result<Locker> {
        Ok(Locker::new(ZooKeeperBackend::connect(url).await?))
    }

    async fn fenced_write(&self, key: &str, token: FencingToken) -> Result<bool> {
        Ok(fenced_write(&format!("/fencelock-test-resources/{key}"), token.get()).await)
    }
}

#[test]
#[ignore = "holder process of the testkit's SIGKILL scenarios"]
fn holder_worker() {
    faults::holder_worker(Zk);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_costs_its_own_ttl_not_the_session_timeout() {
    // The default session_timeout (10 s) is the session of long holds; a hold
    // of 2 s lives in a session of 2 s, so its holder's death frees it after
    // ~2 s (the test servers' tickTime of 500 ms allows sessions from 1 s).
    faults::killed_holder_frees_after_its_ttl(&Zk, "zk://127.0.0.1:2181").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_of_a_long_ttl_frees_after_the_session_timeout() {
    faults::killed_session_holder_frees_at_once(&Zk, STANDALONE).await;
}

/// The holder process of the SIGSTOP test; does nothing unless spawned by it.
#[test]
#[ignore = "holder process of a_paused_holder_loses_its_lock_and_its_stale_write"]
fn paused_holder_worker() {
    let Ok(key) = std::env::var("FENCELOCK_ZK_HOLD_KEY") else {
        return;
    };
    tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(async move {
            let backend = ZooKeeperBackend::connect("zk://127.0.0.1:2181?session_timeout=2s")
                .await
                .unwrap();
            let g = Locker::new(backend)
                .lock(&key)
                .ttl(Duration::from_secs(2))
                .acquire()
                .await
                .unwrap();
            let token = g.token().unwrap().get();
            println!("acquired {token}");
            // Paused here (SIGSTOP) past the session timeout, then resumed.
            let lost = g.lost().await;
            println!("lost {}", matches!(lost, Error::Lost { .. }));
            // The write a GC-paused holder would still try: fenced by the token.
            let written = fenced_write(&format!("/fencelock-test-resources/{key}"), token).await;
            println!(
                "stale-write {}",
                if written { "accepted" } else { "rejected" }
            );
        });
}

/// A fenced write to a resource kept in ZooKeeper: writes `token` unless the
/// resource has seen a larger one (compare-and-set on the node's version).
async fn fenced_write(path: &str, token: u64) -> bool {
    use zookeeper_client as zk;
    let c = zk::Client::connect("127.0.0.1:2181").await.unwrap();
    let dir = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
    let _ = c.mkdir("/fencelock-test-resources", &dir).await;
    loop {
        match c.get_data(path).await {
            Err(zk::Error::NoNode) => {
                match c.create(path, token.to_string().as_bytes(), &dir).await {
                    Ok(_) => return true,
                    Err(zk::Error::NodeExists) => continue,
                    Err(e) => panic!("{e}"),
                }
            }
            Ok((data, stat)) => {
                let seen: u64 = String::from_utf8_lossy(&data).parse().unwrap_or(0);
                if seen > token {
                    return false;
                }
                match c
                    .set_data(path, token.to_string().as_bytes(), Some(stat.version))
                    .await
                {
                    Ok(_) => return true,
                    Err(zk::Error::BadVersion) => continue,
                    Err(e) => panic!("{e}"),
                }
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holder_loses_its_lock_and_its_stale_write() {
    let key = unique("paused");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "paused_holder_worker",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("FENCELOCK_ZK_HOLD_KEY", &key)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut next = || {
        let mut line = String::new();
        let n = out.read_line(&mut line).unwrap_or(0);
        (n > 0).then(|| line.trim().to_string())
    };
    let stale: u64 = loop {
        match next() {
            Some(l) if l.contains("acquired ") => {
                break l.rsplit(' ').next().unwrap().parse().unwrap();
            }
            Some(_) => continue,
            None => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the holder exited before acquiring");
            }
        }
    };
    send_signal(child.id(), Signal::SIGSTOP).unwrap();
    // Past its session timeout the paused holder's node is gone: we get the lock.
    let locker = Locker::new(ZooKeeperBackend::connect(STANDALONE).await.unwrap());
    let start = Instant::now();
    let g = locker
        .lock(&key)
        .wait(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    assert!(
        start.elapsed() >= Duration::from_secs(1),
        "granted before the paused holder's session could expire"
    );
    assert!(g.token().unwrap().get() > stale);
    assert!(
        fenced_write(
            &format!("/fencelock-test-resources/{key}"),
            g.token().unwrap().get()
        )
        .await
    );
    send_signal(child.id(), Signal::SIGCONT).unwrap();
    let rest: Vec<String> = std::iter::from_fn(next).collect();
    let _ = child.wait();
    assert!(
        rest.iter().any(|l| l.ends_with("lost true")),
        "the resumed holder never learned: {rest:?}"
    );
    assert!(
        rest.iter().any(|l| l.ends_with("stale-write rejected")),
        "the resumed holder's stale write got through: {rest:?}"
    );
    g.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_lock_path_is_removed() {
    let key = unique("container");
    let backend = ZooKeeperBackend::connect(STANDALONE).await.unwrap();
    let locker = Locker::new(backend.clone());
    locker
        .lock(&key)
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    // The lock path is a container node: the server deletes it once empty.
    let start = Instant::now();
    loop {
        let listed = locker.list(&key).await.unwrap();
        let info = locker.inspect(&key).await.unwrap();
        if info.is_none() {
            break;
        }
        assert!(listed.is_empty());
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the empty lock path stayed: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A silent server (a frozen VM, a cut cable) cannot keep a waiter past its
/// wait, nor a connect running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_server_cannot_hold_a_waiter_past_its_wait() {
    faults::a_stalled_server_cannot_hold_a_waiter_past_its_deadline(&Zk, "zk://127.0.0.1:2181")
        .await;
}
