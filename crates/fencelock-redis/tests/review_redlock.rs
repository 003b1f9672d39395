//! Review (hostile): Redlock attacks on private redis-server instances
//! reached through fault proxies.

mod support;

use std::time::{Duration, Instant};

use fencelock_core::{Backend, Key, LeaseRef, Locker, Mode, Owner, Request};
use fencelock_redis::RedlockBackend;
use fencelock_testkit::{FaultProxy, ServerProcess, free_port};
use support::redis_on;

struct Insts {
    ports: Vec<u16>,
    _servers: Vec<ServerProcess>,
    proxies: Vec<FaultProxy>,
}

async fn instances(n: usize) -> Insts {
    let ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
    let servers = ports.iter().map(|p| redis_on(*p, &[])).collect();
    let mut proxies = Vec::new();
    for p in &ports {
        proxies.push(
            FaultProxy::start(format!("127.0.0.1:{p}").parse().unwrap())
                .await
                .unwrap(),
        );
    }
    Insts {
        ports,
        _servers: servers,
        proxies,
    }
}

impl Insts {
    fn proxied(&self, query: &str) -> String {
        let hosts: Vec<String> = self.proxies.iter().map(|p| p.addr().to_string()).collect();
        format!("redlock://{}{query}", hosts.join(","))
    }
    fn direct(&self, query: &str) -> String {
        let hosts: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redlock://{}{query}", hosts.join(","))
    }
}

/// Raw value of the exclusive hold of `key` on instance `port`.
async fn raw_on(port: u16, key: &str) -> Option<String> {
    let mut c = support::direct(port).await;
    redis::cmd("GET")
        .arg(format!("fencelock:{{{key}}}"))
        .query_async(&mut c)
        .await
        .ok()?
}

fn req(key: &str, owner: &str, ttl: Duration) -> Request {
    Request::new(
        Key::new(key).unwrap(),
        Owner::new(owner).unwrap(),
        Mode::Exclusive,
        ttl,
    )
    .with_reentrant(false)
}

/// Claim (redlock.rs module docs): "Otherwise the operation is undone on every
/// instance that granted it or may have run it". A round whose instances are
/// slow marks them down (`run_on`, redlock.rs:298) and then sends its undo
/// through `run_on` too, which skips instances marked down (redlock.rs:265):
/// the undo never reaches the instances that were late. The acquire gives up
/// (deadline) and returns an error, yet the requests, once they arrive, grant
/// a majority to an owner nobody will ever renew or release: the key is
/// blocked for the whole TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_redlock_acquire_that_gave_up_on_slow_instances_leaves_a_majority_hold() {
    let five = instances(3).await;
    let backend = RedlockBackend::connect(&five.proxied("?instance_timeout=100ms"))
        .await
        .unwrap();
    let ttl = Duration::from_secs(60);
    // Warm up (connections, scripts).
    let w = req("warm", "warm", ttl);
    let g = backend.try_acquire(&w).await.unwrap().unwrap();
    backend.release(&LeaseRef::new(&w, &g)).await.unwrap();
    for p in &five.proxies {
        p.set_latency(Duration::from_millis(300));
    }
    let o = req("k", "gave-up", ttl);
    let got = backend
        .acquire(
            &o,
            Some(tokio::time::Instant::now() + Duration::from_millis(400)),
        )
        .await;
    eprintln!("acquire with a 400 ms deadline -> {got:?}");
    assert!(!matches!(got, Ok(Some(_))), "granted through a slow link");
    for p in &five.proxies {
        p.set_latency(Duration::ZERO);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut on = Vec::new();
    for p in &five.ports {
        on.push(raw_on(*p, "k").await);
    }
    eprintln!("holds on the instances 2 s later: {on:?}");
    let other = RedlockBackend::connect(&five.direct("")).await.unwrap();
    let third = other
        .acquire(
            &req("k", "someone-else", ttl),
            Some(tokio::time::Instant::now() + Duration::from_secs(3)),
        )
        .await
        .unwrap();
    eprintln!("another owner waiting 3 s -> {third:?}");
    assert!(
        third.is_some(),
        "the acquire that gave up left holds {on:?} on the instances (TTL 60 s): the key is blocked"
    );
}
