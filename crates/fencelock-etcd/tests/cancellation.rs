//! Cancellation at every await point leaves no ghost holder: a release whose
//! future is dropped before its delete is answered, and acquires dropped at
//! tiny timeouts (whose put may land after the drop's delete), free their
//! keys within about the TTL; contenders that cancel never overlap.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fencelock_core::{Hold, Key, Locker, Mode, check_history};
use fencelock_etcd::EtcdBackend;
use fencelock_testkit::FaultProxy;

fn unique(name: &str) -> String {
    format!(
        "cancel-{name}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_release_whose_delete_is_lost_frees_the_lock_after_its_ttl() {
    let key = unique("cancel-release");
    let proxy = FaultProxy::start("127.0.0.1:2379".parse().unwrap())
        .await
        .unwrap();
    let a_backend = EtcdBackend::connect(&format!("etcd://{}?session_ttl=10s", proxy.addr()))
        .await
        .unwrap();
    let a = Locker::new(a_backend.clone());
    let b_backend = EtcdBackend::connect("etcd://127.0.0.1:2379").await.unwrap();
    let b = Locker::new(b_backend.clone());
    let g = a
        .lock(&key)
        .ttl(Duration::from_secs(3))
        .acquire()
        .await
        .unwrap();
    proxy.blackhole();
    let r = tokio::time::timeout(Duration::from_millis(200), g.release()).await;
    assert!(r.is_err(), "the release finished through a black hole?");
    // The held delete is lost with the connection; a new one comes at once,
    // well within the 3 s lease.
    proxy.cut();
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.restore();
    let start = Instant::now();
    let got = b
        .lock(&key)
        .ttl(Duration::from_secs(3))
        .wait(Duration::from_secs(20))
        .acquire()
        .await;
    let queue = b_backend.queue(&Key::new(&key).unwrap()).await.unwrap();
    match got {
        Ok(g) => {
            println!(
                "B granted {:?} after the cancelled release",
                start.elapsed()
            );
            g.release().await.unwrap();
        }
        Err(e) => panic!(
            "a cancelled release of a 3 s hold still blocks the lock {:?} later ({e}); queue: {queue:?}",
            start.elapsed()
        ),
    }
    drop(a_backend);
}

/// No network fault at all: a release cancelled after its first poll (a
/// `timeout` of a few microseconds, or a `select!` that another branch won).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_cancelled_at_any_point_leave_no_ghost() {
    let a_backend = EtcdBackend::connect("etcd://127.0.0.1:2379").await.unwrap();
    let a = Locker::new(a_backend.clone());
    let n = 40;
    let mut keys = Vec::new();
    for i in 0..n {
        let key = unique(&format!("cancel-nofault-{i}"));
        let g = a
            .lock(&key)
            .ttl(Duration::from_secs(2))
            .acquire()
            .await
            .unwrap();
        let cancel_after = Duration::from_micros((i as u64 % 10) * 50);
        let _ = tokio::time::timeout(cancel_after, g.release()).await;
        keys.push(key);
    }
    // Every hold had a 2 s TTL: give them 6 s.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let mut ghosts = Vec::new();
    for k in &keys {
        let q = a_backend.queue(&Key::new(k).unwrap()).await.unwrap();
        if !q.is_empty() {
            ghosts.push(q);
        }
    }
    println!(
        "{} of {n} cancelled releases left a key past its TTL",
        ghosts.len()
    );
    assert!(ghosts.is_empty(), "ghosts 6 s after 2 s holds: {ghosts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_acquires_leave_no_ghost_past_the_ttl() {
    let backend = EtcdBackend::connect("etcd://127.0.0.1:2379").await.unwrap();
    let a = Locker::new(backend.clone());
    let n = 600u64;
    let mut keys = Vec::new();
    for i in 0..n {
        let key = unique(&format!("cancel-acq-{i}"));
        let t = Duration::from_micros((i * 37) % 3000);
        if let Ok(Ok(g)) =
            tokio::time::timeout(t, a.lock(&key).ttl(Duration::from_secs(2)).acquire()).await
        {
            g.release().await.unwrap();
        }
        keys.push(key);
    }
    tokio::time::sleep(Duration::from_secs(6)).await;
    let mut ghosts = Vec::new();
    for k in &keys {
        let q = backend.queue(&Key::new(k).unwrap()).await.unwrap();
        if !q.is_empty() {
            ghosts.push((k.clone(), q));
        }
    }
    println!(
        "{} of {n} dropped acquires left a queue entry past the TTL",
        ghosts.len()
    );
    assert!(ghosts.is_empty(), "{ghosts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contenders_with_cancelled_acquires_never_overlap() {
    let key = unique("contend");
    let history = Arc::new(Mutex::new(Vec::<Hold>::new()));
    let mut tasks = Vec::new();
    for w in 0..3u64 {
        let key = key.clone();
        let history = history.clone();
        tasks.push(tokio::spawn(async move {
            let locker = Locker::new(EtcdBackend::connect("etcd://127.0.0.1:2379").await.unwrap());
            for i in 0..60u64 {
                let t = Duration::from_micros(((i * 7919 + w * 104729) % 40) * 500);
                let fut = locker
                    .lock(&key)
                    .ttl(Duration::from_secs(2))
                    .wait(Duration::from_secs(10))
                    .acquire();
                let Ok(Ok(g)) = tokio::time::timeout(t, fut).await else {
                    continue;
                };
                let acquired_ns = Hold::now_ns();
                tokio::time::sleep(Duration::from_millis(3)).await;
                let valid = g.is_valid();
                let released_ns = Hold::now_ns();
                let token = g.token().map(|t| t.get());
                let _ = g.release().await;
                if valid {
                    history.lock().unwrap().push(Hold {
                        holder: format!("w{w}"),
                        mode: Mode::Exclusive,
                        token,
                        acquired_ns,
                        released_ns,
                    });
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let h = history.lock().unwrap().clone();
    println!("{} holds recorded", h.len());
    check_history(&h).unwrap();
}
