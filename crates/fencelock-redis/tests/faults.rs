//! Fault tests of the Redis backend, each on a private server (or a proxy in
//! front of one) so that killing it hurts nobody else.

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fencelock_core::backend::{LeaseRef, Request};
use fencelock_core::{Backend, Error, Key, Locker, LostReason, Mode, Owner};
use fencelock_redis::RedisBackend;
use fencelock_testkit::{FaultProxy, ServerProcess, free_port};

const SHARED: &str = "redis://127.0.0.1:6379";

/// A throw-away redis-server on `port` (no persistence: a restart comes back empty).
fn redis_on(port: u16, extra: &[&str]) -> ServerProcess {
    let dir = std::env::temp_dir().join(format!("fencelock-redis-test-{port}"));
    let _ = std::fs::create_dir_all(&dir);
    let mut cmd = Command::new("redis-server");
    cmd.args([
        "--bind",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--save",
        "",
        "--appendonly",
        "no",
    ])
    .arg("--dir")
    .arg(&dir)
    .args(extra)
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    ServerProcess::spawn("redis-server", cmd, port, Duration::from_secs(20))
        .expect("start redis-server")
}

fn unique(name: &str) -> String {
    format!("faults/{name}/{}", uuid::Uuid::new_v4().simple())
}

async fn evalsha_calls(url: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(
            &mut redis::Client::open(url)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap(),
        )
        .await
        .unwrap();
    info.lines()
        .find(|l| l.starts_with("cmdstat_evalsha:"))
        .and_then(|l| l.split("calls=").nth(1))
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_empty_during_a_hold_fires_lost_and_new_grants_work() {
    let port = free_port();
    let mut server = redis_on(port, &[]);
    let url = format!("redis://127.0.0.1:{port}/?timeout=500ms");
    let locker = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let g = locker
        .lock("k")
        .ttl(Duration::from_secs(2))
        .acquire()
        .await
        .unwrap();
    let first = g.token().unwrap();
    server.kill();
    let _server = redis_on(port, &[]); // same port, empty
    // The next renewal finds the hold gone; it must not be re-created.
    let lost = tokio::time::timeout(Duration::from_secs(10), g.lost())
        .await
        .expect("lost() never fired");
    assert!(
        matches!(
            lost,
            Error::Lost {
                reason: LostReason::NotHeld(_),
                ..
            }
        ),
        "expected Lost(NotHeld), got {lost:?}"
    );
    let g2 = locker
        .lock("k")
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap();
    // The fence counter was lost with the data, yet tokens kept rising (time floor).
    assert!(
        g2.token().unwrap() > first,
        "token {:?} after {first:?}",
        g2.token()
    );
    g2.release().await.unwrap();
}

#[tokio::test]
async fn connection_refused_is_a_connection_error_without_the_password() {
    let port = free_port();
    let err = RedisBackend::connect(&format!(
        "redis://:s3cret@127.0.0.1:{port}/?connect_timeout=1s"
    ))
    .await
    .unwrap_err();
    assert!(matches!(err, Error::Connection { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains(&format!("127.0.0.1:{port}")), "{msg}");
    assert!(!msg.contains("s3cret"), "password leaked: {msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_mid_run_still_works() {
    let port = free_port();
    let _server = redis_on(port, &[]);
    let url = format!("redis://127.0.0.1:{port}");
    let locker = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let flusher = tokio::spawn({
        let url = url.clone();
        async move {
            let mut c = redis::Client::open(url.as_str())
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            for _ in 0..20 {
                let _: () = redis::cmd("SCRIPT")
                    .arg("FLUSH")
                    .query_async(&mut c)
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    });
    let mut last = None;
    for _ in 0..300 {
        let g = locker
            .lock("k")
            .acquire()
            .await
            .expect("acquire after SCRIPT FLUSH");
        assert!(g.token() > last);
        last = g.token();
        g.release().await.expect("release after SCRIPT FLUSH");
    }
    flusher.await.unwrap();
}

/// A backend whose connection goes through `proxy`, with a short response timeout.
async fn through(proxy: &FaultProxy) -> RedisBackend {
    let addr: SocketAddr = proxy.addr();
    RedisBackend::connect(&format!("redis://{addr}/?timeout=300ms"))
        .await
        .unwrap()
}

async fn holds_of(direct: &RedisBackend, key: &Key, owner: &str) -> Option<u32> {
    let info = direct.inspect(key).await.unwrap()?;
    info.holders
        .iter()
        .find(|h| h.owner == owner)
        .map(|h| h.holds)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retried_release_after_a_lost_reply_releases_once_and_never_a_later_holder() {
    let proxy = FaultProxy::start("127.0.0.1:6379".parse().unwrap())
        .await
        .unwrap();
    let proxied = through(&proxy).await;
    let direct = RedisBackend::connect(SHARED).await.unwrap();
    let key = Key::new(unique("latch")).unwrap();
    let ttl = Duration::from_secs(30);

    // 1. A partial release whose reply is lost, then retried: one hold goes, not two.
    let req = Request::new(
        key.clone(),
        Owner::new("reentrant-owner").unwrap(),
        Mode::Exclusive,
        ttl,
    );
    let g = proxied.try_acquire(&req).await.unwrap().unwrap();
    proxied.try_acquire(&req).await.unwrap().unwrap();
    assert_eq!(holds_of(&direct, &key, "reentrant-owner").await, Some(2));
    proxy.drop_replies();
    let releasing = tokio::spawn({
        let (proxied, lease) = (proxied.clone(), LeaseRef::new(&req, &g));
        async move { proxied.release(&lease).await }
    });
    // The script ran on the server; only its reply is held back.
    let start = Instant::now();
    while holds_of(&direct, &key, "reentrant-owner").await != Some(1) {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the release never reached the server"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.cut();
    tokio::time::sleep(Duration::from_millis(100)).await;
    proxy.restore();
    let released = releasing
        .await
        .unwrap()
        .expect("the retried release failed");
    assert_eq!(released.remaining, 1, "the retry reported {released:?}");
    assert_eq!(
        holds_of(&direct, &key, "reentrant-owner").await,
        Some(1),
        "the retry released a second hold"
    );

    // 2. A full release whose reply is lost; a later holder takes the lock before
    //    the retry arrives; the retry must leave the later holder alone.
    let key2 = Key::new(unique("latch2")).unwrap();
    let a = Request::new(
        key2.clone(),
        Owner::new("first").unwrap(),
        Mode::Exclusive,
        ttl,
    );
    let ga = proxied.try_acquire(&a).await.unwrap().unwrap();
    proxy.drop_replies();
    let releasing = tokio::spawn({
        let (proxied, lease) = (proxied.clone(), LeaseRef::new(&a, &ga));
        async move { proxied.release(&lease).await }
    });
    let b = Request::new(
        key2.clone(),
        Owner::new("later").unwrap(),
        Mode::Exclusive,
        ttl,
    );
    let start = Instant::now();
    let gb = loop {
        if let Some(g) = direct.try_acquire(&b).await.unwrap() {
            break g;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the first release never reached the server"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    proxy.cut();
    tokio::time::sleep(Duration::from_millis(100)).await;
    proxy.restore();
    releasing
        .await
        .unwrap()
        .expect("the retried release failed");
    assert_eq!(
        holds_of(&direct, &key2, "later").await,
        Some(1),
        "the retry released the later holder"
    );
    direct.release(&LeaseRef::new(&b, &gb)).await.unwrap();
    direct.force_release(&key).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_replicas_counts_a_grant_only_when_replicas_acknowledge() {
    let (mport, rport) = (free_port(), free_port());
    let _master = redis_on(mport, &[]);
    let mut replica = redis_on(rport, &["--replicaof", "127.0.0.1", &mport.to_string()]);
    let url = format!("redis://127.0.0.1:{mport}/?wait_replicas=1&wait_timeout=500ms");
    let backend = RedisBackend::connect(&url).await.unwrap();
    let locker = Locker::new(backend.clone());
    // Replication needs a moment to start.
    let start = Instant::now();
    let g = loop {
        match locker
            .lock("k")
            .wait(Duration::from_secs(2))
            .acquire()
            .await
        {
            Ok(g) => break g,
            Err(e) => assert!(
                start.elapsed() < Duration::from_secs(20),
                "never acknowledged: {e}"
            ),
        }
    };
    g.release().await.unwrap();
    replica.kill();
    let err = locker
        .lock("k")
        .wait(Duration::from_secs(2))
        .acquire()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("replicas acknowledged"), "{err}");
    // The unacknowledged grant was undone.
    let info = backend.inspect(&Key::new("k").unwrap()).await.unwrap();
    assert!(
        info.as_ref().is_none_or(|i| i.holders.is_empty()),
        "an unacknowledged grant was kept: {info:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_of_one_locker_cause_no_herd() {
    let port = free_port();
    let _server = redis_on(port, &[]);
    let url = format!("redis://127.0.0.1:{port}");
    let holder = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let waiters = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let g = holder
        .lock("k")
        .ttl(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let l = waiters.clone();
        tasks.push(tokio::spawn(async move {
            let g = l.lock("k").wait(Duration::from_secs(20)).acquire().await?;
            g.release().await
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = evalsha_calls(&url).await;
    g.release().await.unwrap();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let calls = evalsha_calls(&url).await - before;
    // One release of the holder, one attempt of the woken head, then ten releases
    // that each hand the lock to the next waiter (12). A herd would add ~9 per
    // release; a head polling while a local guard holds would add ~2 per waiter.
    assert!(
        calls <= 14,
        "{calls} scripts ran for 10 waiters: the waiters stampeded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_every_waiting_reader() {
    let writer = Locker::new(RedisBackend::connect(SHARED).await.unwrap());
    let key = unique("readers");
    let w = writer
        .lock(&key)
        .ttl(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    let mut readers = Vec::new();
    for _ in 0..3 {
        let l = Locker::new(RedisBackend::connect(SHARED).await.unwrap());
        let k = key.clone();
        readers.push(tokio::spawn(async move {
            l.read_lock(&k)
                .wait(Duration::from_secs(20))
                .acquire()
                .await
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let start = Instant::now();
    w.release().await.unwrap();
    let mut guards = Vec::new();
    for r in readers {
        guards.push(r.await.unwrap().unwrap());
    }
    // The writer's TTL was 60 s: only the notification can have woken them this soon.
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "readers woke after {:?}",
        start.elapsed()
    );
    assert!(
        guards.iter().all(|g| g.is_valid()),
        "all three readers hold together"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphore_permits_expire_one_by_one() {
    let key = unique("permits");
    let lockers: Vec<Locker> = futures_lockers(4).await;
    let ttl = Duration::from_millis(800);
    let kept1 = lockers[0]
        .semaphore(&key, 3)
        .ttl(ttl)
        .acquire()
        .await
        .unwrap();
    let kept2 = lockers[1]
        .semaphore(&key, 3)
        .ttl(ttl)
        .acquire()
        .await
        .unwrap();
    let crashed = lockers[2]
        .semaphore(&key, 3)
        .ttl(ttl)
        .acquire()
        .await
        .unwrap();
    let _ = crashed.leak(); // its holder "crashes": no renewal, no release
    assert!(
        lockers[3]
            .semaphore(&key, 3)
            .try_acquire()
            .await
            .unwrap()
            .is_none(),
        "a 4th permit of 3"
    );
    let start = Instant::now();
    let fourth = lockers[3]
        .semaphore(&key, 3)
        .ttl(ttl)
        .wait(Duration::from_secs(20))
        .acquire()
        .await
        .unwrap();
    assert!(
        start.elapsed() >= ttl / 2,
        "the crashed permit came back before its TTL"
    );
    // The renewed permits outlived the crashed one.
    assert!(kept1.is_valid() && kept2.is_valid());
    let info = lockers[0].inspect(&key).await.unwrap().unwrap();
    assert_eq!(info.holders.len(), 3, "{info:?}");
    for g in [kept1, kept2, fourth] {
        g.release().await.unwrap();
    }
}

async fn futures_lockers(n: usize) -> Vec<Locker> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(Locker::new(RedisBackend::connect(SHARED).await.unwrap()));
    }
    out
}

#[tokio::test]
async fn fenced_set_rejects_a_stale_token() {
    let backend = RedisBackend::connect(SHARED).await.unwrap();
    let locker = Locker::new(backend.clone());
    let key = unique("fenced");
    let resource = format!("{key}:resource");
    let old = locker.lock(&key).acquire().await.unwrap();
    let stale = old.token().unwrap();
    drop(old);
    let new = locker
        .lock(&key)
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .unwrap();
    assert!(
        backend
            .fenced_set(&resource, new.token().unwrap(), "new")
            .await
            .unwrap()
    );
    assert!(
        !backend.fenced_set(&resource, stale, "stale").await.unwrap(),
        "a stale write was accepted"
    );
    assert!(
        backend
            .fenced_set(&resource, new.token().unwrap(), "again")
            .await
            .unwrap(),
        "the same token may write again"
    );
    assert_eq!(
        backend.fenced_get(&resource).await.unwrap(),
        Some(("again".to_string(), new.token().unwrap()))
    );
    let _: () = redis::cmd("DEL")
        .arg(&resource)
        .query_async(
            &mut redis::Client::open(SHARED)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap(),
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn password_from_the_url_is_used_and_never_shown() {
    let port = free_port();
    let _server = redis_on(port, &["--requirepass", "s3cret"]);
    let ok = RedisBackend::connect(&format!("redis://:s3cret@127.0.0.1:{port}"))
        .await
        .unwrap();
    let locker = Locker::new(ok);
    locker
        .lock("k")
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let err = RedisBackend::connect(&format!("redis://:wrong-pw@127.0.0.1:{port}"))
        .await
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        !msg.contains("wrong-pw") && !msg.contains("s3cret"),
        "password leaked: {msg}"
    );
    assert!(msg.contains(&port.to_string()), "{msg}");
}

#[tokio::test]
async fn an_uncontended_cycle_is_one_script_each_way() {
    let port = free_port();
    let _server = redis_on(port, &[]);
    let url = format!("redis://127.0.0.1:{port}");
    let locker = Locker::new(RedisBackend::connect(&url).await.unwrap());
    // Warm up: the first calls load the scripts.
    locker
        .lock("k")
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let before = evalsha_calls(&url).await;
    for _ in 0..100 {
        let g = locker.lock("k").acquire().await.unwrap();
        g.release().await.unwrap();
    }
    let scripts = evalsha_calls(&url).await - before;
    assert_eq!(
        scripts, 200,
        "100 uncontended cycles ran {scripts} scripts, not one per acquire and one per release"
    );
}

/// Renewal goes 100 leases per script call: three calls, the last one partial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_held_locks_than_a_renewal_batch_are_all_renewed() {
    let locker = Locker::new(RedisBackend::connect(SHARED).await.unwrap());
    fencelock_testkit::faults::many_held_locks_are_all_renewed(&locker, 450).await;
}

/// Maintenance: the server goes down for a few seconds while a waiter waits
/// without a deadline. The waiter waits through the outage and is granted
/// once the server is back and the lock free; one with a deadline waits
/// until it, no longer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_waits_through_a_server_restart() {
    let port = free_port();
    let mut server = redis_on(port, &[]);
    let url = format!("redis://127.0.0.1:{port}/?timeout=500ms");
    let holder = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let _g = holder
        .lock("k")
        .ttl(Duration::from_secs(2))
        .acquire()
        .await
        .unwrap();
    let w = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let b = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let forever = tokio::spawn(async move {
        w.lock("k")
            .ttl(Duration::from_secs(2))
            .wait_forever()
            .acquire()
            .await
            .map(|g| g.token())
    });
    let bounded = tokio::spawn(async move {
        let start = Instant::now();
        let r = b
            .lock("k")
            .wait(Duration::from_secs(3))
            .acquire()
            .await
            .map(|g| g.token());
        (r, start.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.kill();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let _server = redis_on(port, &[]);
    let got = tokio::time::timeout(Duration::from_secs(60), forever)
        .await
        .expect("the waiter was not granted within 60 s of the restart")
        .unwrap();
    assert!(got.is_ok(), "the waiter gave up during the outage: {got:?}");
    let (r, took) = bounded.await.unwrap();
    assert!(
        r.is_err(),
        "a 3 s wait during a 4 s outage was granted: {r:?}"
    );
    assert!(
        took >= Duration::from_secs(3),
        "a 3 s wait gave up after {took:?}, during the outage: {r:?}"
    );
}

/// A frozen server (SIGSTOP: a stuck VM) cannot hold a waiter past its
/// deadline: it returns within a second or so of it (the bound is loose
/// here: a hang, or several request timeouts in a row, fails this test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_server_cannot_hold_a_waiter_past_its_deadline() {
    let port = free_port();
    let server = redis_on(port, &[]);
    let url = format!("redis://127.0.0.1:{port}");
    let holder = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let _g = holder.lock("k").acquire().await.unwrap();
    let waiter = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let w = tokio::spawn(async move {
        let start = Instant::now();
        let r = waiter
            .lock("k")
            .wait(Duration::from_secs(3))
            .acquire()
            .await;
        (r.map(|g| g.token()), start.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.pause().unwrap();
    let (r, took) = w.await.unwrap();
    server.resume().unwrap();
    assert!(r.is_err(), "granted by a frozen server: {r:?}");
    assert!(
        took < Duration::from_secs(8),
        "a 3 s wait returned after {took:?} from a frozen server: {r:?}"
    );
}
