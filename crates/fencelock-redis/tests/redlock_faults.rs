//! Redlock fault tests, each on five private redis-server instances.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fencelock_core::backend::{LeaseRef, Request};
use fencelock_core::{Backend, Error, Hold, Key, Locker, LostReason, Mode, Owner, check_history};
use fencelock_redis::{RedisBackend, RedlockBackend};
use fencelock_testkit::{FaultProxy, ServerProcess, free_port};

fn redis_on(port: u16) -> ServerProcess {
    let dir = std::env::temp_dir().join(format!("fencelock-redlock-test-{port}"));
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
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    ServerProcess::spawn("redis-server", cmd, port, Duration::from_secs(20))
        .expect("start redis-server")
}

struct Five {
    ports: Vec<u16>,
    servers: Vec<Option<ServerProcess>>,
}

impl Five {
    fn start() -> Five {
        let ports: Vec<u16> = (0..5).map(|_| free_port()).collect();
        let servers = ports.iter().map(|p| Some(redis_on(*p))).collect();
        Five { ports, servers }
    }

    fn url(&self) -> String {
        let hosts: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redlock://{}", hosts.join(","))
    }

    fn kill(&mut self, i: usize) {
        if let Some(mut s) = self.servers[i].take() {
            s.kill();
        }
    }

    /// Starts instance `i` again on its port, empty, a second after it went
    /// down (the documented assumption: an emptied instance rejoins no sooner
    /// than the instances' clock difference + 100 ms).
    fn restart(&mut self, i: usize) {
        self.kill(i);
        std::thread::sleep(Duration::from_secs(1));
        self.servers[i] = Some(redis_on(self.ports[i]));
    }
}

/// 32 tasks in 4 lockers contend; the history must stay exclusive.
async fn contend(url: &str, cycles_per_task: usize) -> Vec<Hold> {
    let mut lockers = Vec::new();
    for _ in 0..4 {
        lockers.push(Locker::new(RedlockBackend::connect(url).await.unwrap()));
    }
    let holds = Arc::new(std::sync::Mutex::new(Vec::new()));
    let counter = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for t in 0..32 {
        let (l, holds, counter) = (lockers[t % 4].clone(), holds.clone(), counter.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..cycles_per_task {
                let g = l
                    .lock("hot")
                    .ttl(Duration::from_secs(10))
                    .wait(Duration::from_secs(60))
                    .acquire()
                    .await
                    .unwrap();
                let acquired_ns = Hold::now_ns();
                let v = counter.load(Ordering::SeqCst);
                tokio::task::yield_now().await;
                counter.store(v + 1, Ordering::SeqCst);
                holds.lock().unwrap().push(Hold {
                    holder: format!("task-{t}"),
                    mode: Mode::Exclusive,
                    token: g.token().map(|t| t.get()),
                    acquired_ns,
                    released_ns: Hold::now_ns(),
                });
                g.release().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(
        counter.load(Ordering::SeqCst),
        32 * cycles_per_task as u64,
        "updates were lost"
    );
    holds.lock().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_of_five_down_grants_continue_and_stay_exclusive() {
    let mut five = Five::start();
    five.kill(1);
    five.kill(3);
    let holds = contend(&five.url(), 5).await;
    let summary =
        check_history(&holds).unwrap_or_else(|v| panic!("exclusion broken with 2 of 5 down: {v}"));
    assert_eq!(summary.holds, 160);
}

/// Waiters ask the first instance not known to be down before the others
/// (against split votes): with that instance down, the next one leads, and
/// grants go on, exclusive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_go_on_when_the_lead_instance_is_down() {
    let mut five = Five::start();
    five.kill(0);
    let holds = contend(&five.url(), 5).await;
    let summary = check_history(&holds)
        .unwrap_or_else(|v| panic!("exclusion broken with the lead instance down: {v}"));
    assert_eq!(summary.holds, 160);
}

/// An instance that answers after the majority mints its own, later token for
/// the same hold (the first grant of a backend proposes none). `inspect` shows
/// the token the guard has — the one a majority of instances holds — not the
/// late instance's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_the_guards_token_when_an_instance_answered_late() {
    let five = Five::start();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", five.ports[4]).parse().unwrap())
        .await
        .unwrap();
    let hosts: Vec<String> = five.ports[..4]
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .chain(std::iter::once(proxy.addr().to_string()))
        .collect();
    let url = format!("redlock://{}?instance_timeout=2s", hosts.join(","));
    let locker = Locker::new(RedlockBackend::connect(&url).await.unwrap());
    proxy.set_latency(Duration::from_millis(300));
    let key = format!("late-{}", uuid_like());
    let g = locker
        .lock(&key)
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    // The late instance's grant has arrived.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let info = locker
        .inspect(&key)
        .await
        .unwrap()
        .expect("inspect found nothing");
    assert_eq!(info.holders.len(), 1, "{info:?}");
    assert_eq!(info.holders[0].token, g.token(), "{info:?}");
    g.release().await.unwrap();
}

/// A hold left on the lead instance alone (here: a holder whose hold went
/// from the others, as after a round it never finished, and which published no
/// release) keeps a waiter from a lock free on a majority for about a second,
/// not for that hold's TTL: a waiter that hears of no release asks every
/// instance at once now and then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_left_on_the_lead_alone_does_not_keep_waiters_for_its_ttl() {
    let five = Five::start();
    let url = five.url();
    let key = format!("ghost-{}", uuid_like());
    let holder = Locker::new(RedlockBackend::connect(&url).await.unwrap());
    let g = holder
        .lock(&key)
        .ttl(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    let waiter = Locker::new(RedlockBackend::connect(&url).await.unwrap());
    let wait = tokio::spawn({
        let key = key.clone();
        async move {
            let start = Instant::now();
            let got = waiter
                .lock(&key)
                .ttl(Duration::from_secs(10))
                .wait(Duration::from_secs(20))
                .acquire()
                .await;
            (got, start.elapsed())
        }
    });
    // The waiter is refused and waits, asking the lead (instance 0) first.
    tokio::time::sleep(Duration::from_secs(2)).await;
    for port in &five.ports[1..] {
        let _: i64 =
            on_instance(*port, redis::cmd("DEL").arg(format!("fencelock:{{{key}}}"))).await;
    }
    assert!(
        holder_on(five.ports[0], &key).await.is_some(),
        "the lead's hold is gone"
    );
    let (got, waited) = tokio::time::timeout(Duration::from_secs(60), wait)
        .await
        .expect("the waiter hung")
        .unwrap();
    let got = got.unwrap_or_else(|e| {
        panic!("a waiter gave up after {waited:?} on a lock free on 4 of 5 instances: {e}")
    });
    // Well before the lead's hold (60 s) would lapse.
    assert!(waited < Duration::from_secs(15), "granted after {waited:?}");
    got.release().await.unwrap();
    std::mem::forget(g);
}

/// The lead instance answers too slowly for its timeout: a waiter's round
/// asks the others after it, grants go on, exclusive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_go_on_when_the_lead_instance_is_slow() {
    let five = Five::start();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", five.ports[0]).parse().unwrap())
        .await
        .unwrap();
    let hosts: Vec<String> = std::iter::once(proxy.addr().to_string())
        .chain(five.ports[1..].iter().map(|p| format!("127.0.0.1:{p}")))
        .collect();
    let url = format!("redlock://{}?instance_timeout=100ms", hosts.join(","));
    proxy.set_latency(Duration::from_millis(500));
    let holds = contend(&url, 3).await;
    let summary = check_history(&holds)
        .unwrap_or_else(|v| panic!("exclusion broken with the lead instance slow: {v}"));
    assert_eq!(summary.holds, 96);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_of_five_down_is_a_no_quorum_error_never_a_grant() {
    let mut five = Five::start();
    let locker = Locker::new(RedlockBackend::connect(&five.url()).await.unwrap());
    five.kill(0);
    five.kill(2);
    five.kill(4);
    let start = Instant::now();
    let r = locker
        .lock("k")
        .wait(Duration::from_secs(2))
        .acquire()
        .await;
    let err = r.expect_err("granted without a majority");
    assert!(matches!(err, Error::Connection { .. }), "{err:?}");
    assert!(err.to_string().contains("no quorum"), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "the error came after {:?}",
        start.elapsed()
    );
    // Connecting needs a majority too.
    let err = RedlockBackend::connect(&five.url()).await.unwrap_err();
    assert!(err.to_string().contains("majority"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_restarted_empty_during_a_hold_cannot_make_tokens_go_backwards() {
    // The classic objection to Redlock: A holds on instances 0,1,2 (3 and 4 are
    // down); instance 2 restarts empty; 3 and 4 come back; B gets 2,3,4.
    let mut five = Five::start();
    five.kill(3);
    five.kill(4);
    let url = five.url();
    let a = Locker::new(RedlockBackend::connect(&url).await.unwrap());
    // Long enough to outlast the restarts (a second each).
    let ga = a
        .lock("k")
        .ttl(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap();
    let ta = ga.token().unwrap();
    five.restart(2);
    five.restart(3);
    five.restart(4);
    let b = Locker::new(RedlockBackend::connect(&url).await.unwrap());
    let gb = b
        .lock("k")
        .ttl(Duration::from_secs(3))
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .unwrap();
    // What happens: B is granted while A's lease has not run out — two holders;
    // Redlock alone cannot prevent it when an instance forgets ...
    println!(
        "B granted with A's lease still valid for {:?} (A: token {ta})",
        ga.deadline()
            .saturating_duration_since(tokio::time::Instant::now())
    );
    // ... but B's token is larger, so the resource can tell them apart ...
    let tb = gb.token().unwrap();
    assert!(tb > ta, "token went backwards: {tb} after {ta}");
    // ... and A learns at its next renewal that it lost the majority.
    let lost = tokio::time::timeout(Duration::from_secs(10), ga.lost())
        .await
        .expect("A never learned");
    assert!(
        matches!(
            lost,
            Error::Lost {
                reason: LostReason::NotHeld(_),
                ..
            }
        ),
        "{lost:?}"
    );
    // The fenced resource (kept on the shared Redis) rejects A's stale write.
    let store = RedisBackend::connect("redis://127.0.0.1:6379")
        .await
        .unwrap();
    let resource = format!("redlock-test:{}", uuid_like());
    assert!(
        store
            .fenced_set(&resource, tb, "written by B")
            .await
            .unwrap()
    );
    assert!(
        !store
            .fenced_set(&resource, ta, "stale write by A")
            .await
            .unwrap(),
        "A's stale write got through"
    );
    assert_eq!(
        store.fenced_get(&resource).await.unwrap().unwrap().0,
        "written by B"
    );
    gb.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_come_from_the_largest_fence_of_the_majority() {
    // The max-register, without the clock: raise the fence of a majority far
    // beyond any clock; every later majority meets one of them (a grant listens
    // to the first majority that answers, so a fence on one instance alone may
    // go unheard), and the next grant's token must exceed it.
    let five = Five::start();
    let url = five.url();
    let locker = Locker::new(RedlockBackend::connect(&url).await.unwrap());
    let g = locker.lock("k").acquire().await.unwrap();
    g.release().await.unwrap();
    let ahead: u64 = 9_000_000_000_000_000;
    for i in [0, 2, 4] {
        let mut c = redis::Client::open(format!("redis://127.0.0.1:{}", five.ports[i]).as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let _: () = redis::cmd("SET")
            .arg("fencelock:{k}:fence")
            .arg(ahead)
            .query_async(&mut c)
            .await
            .unwrap();
    }
    let g = locker.lock("k").acquire().await.unwrap();
    assert!(
        g.token().unwrap().get() > ahead,
        "token {:?} ignored a fence of {ahead}",
        g.token()
    );
    let t = g.token().unwrap();
    g.release().await.unwrap();
    // Written back to a majority: the next grant is larger still, even without instance 2.
    let mut five = five;
    five.kill(2);
    let g = locker.lock("k").acquire().await.unwrap();
    assert!(g.token().unwrap() > t);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_slow_instance_does_not_hold_grants_up() {
    let five = Five::start();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", five.ports[4]).parse().unwrap())
        .await
        .unwrap();
    let hosts: Vec<String> = five.ports[..4]
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .chain(std::iter::once(proxy.addr().to_string()))
        .collect();
    let url = format!("redlock://{}?instance_timeout=100ms", hosts.join(","));
    let locker = Locker::new(RedlockBackend::connect(&url).await.unwrap());
    proxy.set_latency(Duration::from_millis(500));
    for _ in 0..5 {
        let start = Instant::now();
        let g = locker
            .lock("k")
            .ttl(Duration::from_secs(10))
            .acquire()
            .await
            .unwrap();
        // Each grant waits for the slow instance only up to the instance timeout.
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "a grant took {:?}",
            start.elapsed()
        );
        g.release().await.unwrap();
    }
}

fn uuid_like() -> String {
    format!("{:x}", Hold::now_ns())
}

#[tokio::test]
async fn bad_urls_are_named() {
    let e = RedlockBackend::connect("redlock://127.0.0.1:1,127.0.0.1:2")
        .await
        .unwrap_err();
    assert!(e.to_string().contains("at least 3"), "{e}");
    let e = RedlockBackend::connect("redlock://a:1,b:2,c:3?instance_timeout=soon")
        .await
        .unwrap_err();
    assert!(e.to_string().contains("instance_timeout"), "{e}");
}

/// `n` proxies, one in front of each instance of `five` (dead ones too).
async fn proxies(five: &Five) -> Vec<FaultProxy> {
    let mut out = Vec::new();
    for p in &five.ports {
        out.push(
            FaultProxy::start(format!("127.0.0.1:{p}").parse().unwrap())
                .await
                .unwrap(),
        );
    }
    out
}

fn url_through(proxies: &[FaultProxy], query: &str) -> String {
    let hosts: Vec<String> = proxies.iter().map(|p| p.addr().to_string()).collect();
    format!("redlock://{}{query}", hosts.join(","))
}

/// Who holds `key` (exclusively) on instance `port`, read on the instance itself.
async fn holder_on(port: u16, key: &str) -> Option<String> {
    let mut c = redis::Client::open(format!("redis://127.0.0.1:{port}").as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .ok()?;
    let v: Option<String> = redis::cmd("GET")
        .arg(format!("fencelock:{{{key}}}"))
        .query_async(&mut c)
        .await
        .ok()?;
    Some(v?.split('\t').next()?.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_clocks_never_enter_tokens() {
    // A's clock is off when it is granted on instances 0, 1, 2 (3 and 4 are
    // down); instance 2 restarts empty and 3, 4 come back; B is granted on
    // 2, 3, 4. Whatever the two clients' clocks say, B's token is larger.
    for (a_off, b_off) in [(5_000, -5_000), (-5_000, 5_000), (5_000, 0)] {
        let mut five = Five::start();
        five.kill(3);
        five.kill(4);
        let url = five.url();
        fencelock_core::clock::shift_wall_clock_for_tests(a_off);
        let a = Locker::new(RedlockBackend::connect(&url).await.unwrap());
        let ga = a
            .lock("k")
            .ttl(Duration::from_secs(3))
            .acquire()
            .await
            .unwrap();
        let ta = ga.token().unwrap();
        five.restart(2);
        five.restart(3);
        five.restart(4);
        fencelock_core::clock::shift_wall_clock_for_tests(b_off);
        let b = Locker::new(RedlockBackend::connect(&url).await.unwrap());
        let gb = b
            .lock("k")
            .ttl(Duration::from_secs(3))
            .wait(Duration::from_secs(5))
            .acquire()
            .await
            .unwrap();
        fencelock_core::clock::shift_wall_clock_for_tests(0);
        let tb = gb.token().unwrap();
        assert!(
            tb > ta,
            "clocks {a_off:+} ms / {b_off:+} ms: B's token {tb} is not above A's {ta}"
        );
        let store = RedisBackend::connect("redis://127.0.0.1:6379")
            .await
            .unwrap();
        let resource = format!("redlock-clock-test:{}", uuid_like());
        assert!(store.fenced_set(&resource, tb, "B").await.unwrap());
        assert!(
            !store.fenced_set(&resource, ta, "stale A").await.unwrap(),
            "A's stale write got through"
        );
        drop((ga, gb));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_round_never_takes_back_a_hold_a_handoff_gave() {
    // The head of a line re-checks (an acquire round) while its locker hands
    // it the lock; the two reach the instances in different orders. The head's
    // round falls short of a majority and is undone: it must not take back
    // the handed holds. Two clients with their own proxies order each instance.
    let mut five = Five::start();
    let (px, py) = (proxies(&five).await, proxies(&five).await);
    let query = "?instance_timeout=10s";
    let releaser = RedlockBackend::connect(&url_through(&px, query))
        .await
        .unwrap();
    let head_client = RedlockBackend::connect(&url_through(&py, query))
        .await
        .unwrap();
    let key = Key::new("handoff").unwrap();
    let req = |owner: &str| {
        Request::new(
            key.clone(),
            Owner::new(owner).unwrap(),
            Mode::Exclusive,
            Duration::from_secs(30),
        )
        .with_reentrant(false)
    };
    let (holder, head) = (req("holder"), req("head"));
    let g = releaser.try_acquire(&holder).await.unwrap().unwrap();
    five.kill(3);
    five.kill(4);
    // Instance 0 sees the handoff first, 1 and 2 the head's round first.
    py[0].set_latency(Duration::from_secs(3));
    px[1].set_latency(Duration::from_secs(3));
    px[2].set_latency(Duration::from_secs(3));
    let round = tokio::spawn({
        let (c, head) = (head_client.clone(), head.clone());
        async move { c.try_acquire(&head).await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let handoff = tokio::spawn({
        let (c, lease, head) = (releaser.clone(), LeaseRef::new(&holder, &g), head.clone());
        async move { c.release_to(&lease, &head).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    for p in px.iter().chain(&py) {
        p.set_latency(Duration::ZERO);
    }
    let (_, handed) = handoff.await.unwrap().unwrap();
    let _ = round.await.unwrap();
    assert!(
        handed.is_some(),
        "the handoff reached a majority, yet was not granted"
    );
    let mut on = Vec::new();
    for i in 0..3 {
        if holder_on(five.ports[i], "handoff").await.as_deref() == Some("head") {
            on.push(i);
        }
    }
    assert!(
        on.len() >= 3,
        "the handed lock is held on instances {on:?} only: not a majority of 5"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_of_slow_instances_is_retried_until_the_deadline() {
    let five = Five::start();
    let px = proxies(&five).await;
    let locker = Locker::new(
        RedlockBackend::connect(&url_through(&px[..3], "?instance_timeout=100ms"))
            .await
            .unwrap(),
    );
    // Every instance alive but slower than the instance timeout, for 2 s.
    for p in &px {
        p.set_latency(Duration::from_millis(300));
    }
    let waiting = tokio::spawn({
        let locker = locker.clone();
        async move {
            locker
                .lock("k")
                .ttl(Duration::from_secs(10))
                .wait(Duration::from_secs(30))
                .acquire()
                .await
        }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    for p in &px {
        p.set_latency(Duration::ZERO);
    }
    let g = waiting
        .await
        .unwrap()
        .expect("slow (not dead) instances were reported as an error before the deadline");
    g.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redlock_acquire_dropped_in_flight_leaves_no_hold() {
    let five = Five::start();
    let px = proxies(&five).await;
    let slow = Locker::new(
        RedlockBackend::connect(&url_through(&px[..3], "?instance_timeout=5s"))
            .await
            .unwrap(),
    );
    slow.lock("warm-up")
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let direct = Locker::new(
        RedlockBackend::connect(&format!(
            "redlock://127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}",
            five.ports[0], five.ports[1], five.ports[2]
        ))
        .await
        .unwrap(),
    );
    for p in &px {
        p.set_latency(Duration::from_secs(1));
    }
    let gave_up = tokio::time::timeout(
        Duration::from_millis(500),
        slow.lock("k").ttl(Duration::from_secs(60)).acquire(),
    )
    .await;
    assert!(gave_up.is_err(), "granted through a 1 s link in 0.5 s");
    // The request has reached the instances (at 1 s) before anyone else asks.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let g = direct
        .lock("k")
        .wait(Duration::from_secs(20))
        .acquire()
        .await
        .expect("the dropped acquire left holds behind (their TTL is 60 s)");
    for p in &px {
        p.set_latency(Duration::ZERO);
    }
    g.release().await.unwrap();
}

/// Who holds `key` on each of `ports`.
async fn holders(ports: &[u16], key: &str) -> Vec<Option<String>> {
    let mut out = Vec::new();
    for p in ports {
        out.push(holder_on(*p, key).await);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_that_gave_up_on_slow_instances_is_undone_there() {
    let five = Five::start();
    let px = proxies(&five).await;
    let backend = RedlockBackend::connect(&url_through(&px[..3], "?instance_timeout=100ms"))
        .await
        .unwrap();
    let warm = Locker::new(backend.clone());
    warm.lock("warm-up")
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    // Every request takes 600 ms there and back; the instance timeout is 100 ms.
    for p in &px {
        p.set_latency(Duration::from_millis(300));
    }
    let req = Request::new(
        Key::new("k").unwrap(),
        Owner::new("gave-up").unwrap(),
        Mode::Exclusive,
        Duration::from_secs(60),
    )
    .with_reentrant(false);
    let got = backend
        .acquire(
            &req,
            Some(tokio::time::Instant::now() + Duration::from_millis(400)),
        )
        .await;
    assert!(!matches!(got, Ok(Some(_))), "granted through a slow link");
    for p in &px {
        p.set_latency(Duration::ZERO);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let direct = Locker::new(
        RedlockBackend::connect(&format!(
            "redlock://127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}",
            five.ports[0], five.ports[1], five.ports[2]
        ))
        .await
        .unwrap(),
    );
    let on = holders(&five.ports[..3], "k").await;
    let g = direct
        .lock("k")
        .wait(Duration::from_secs(5))
        .acquire()
        .await;
    assert!(
        g.is_ok(),
        "the acquire that gave up left holds {on:?} (TTL 60 s)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_cancelled_while_instances_are_slow_leaves_no_hold() {
    let five = Five::start();
    let px = proxies(&five).await;
    let slow = Locker::new(
        RedlockBackend::connect(&url_through(&px[..3], "?instance_timeout=100ms"))
            .await
            .unwrap(),
    );
    slow.lock("warm-up")
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    for p in &px {
        p.set_latency(Duration::from_millis(300));
    }
    let gave_up = tokio::time::timeout(
        Duration::from_millis(250),
        slow.lock("k").ttl(Duration::from_secs(60)).acquire(),
    )
    .await;
    assert!(gave_up.is_err(), "granted through a slow link");
    for p in &px {
        p.set_latency(Duration::ZERO);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let on = holders(&five.ports[..3], "k").await;
    let direct = Locker::new(
        RedlockBackend::connect(&format!(
            "redlock://127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}",
            five.ports[0], five.ports[1], five.ports[2]
        ))
        .await
        .unwrap(),
    );
    let g = direct
        .lock("k")
        .wait(Duration::from_secs(5))
        .acquire()
        .await;
    assert!(
        g.is_ok(),
        "the cancelled acquire left holds {on:?} (TTL 60 s)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reentrant_acquire_that_an_instance_grants_anew_takes_the_larger_token() {
    // Instances 3 and 4 miss the first hold (their connections reset); a
    // reentrant acquire then reaches all five, and 2, 3 and 4 answer first:
    // 2 adds to the hold, 3 and 4 grant it anew with larger tokens. The
    // larger token is the grant's; a later holder's is above it.
    let five = Five::start();
    let px = proxies(&five).await;
    let url = url_through(&px, "");
    let a = Locker::new(RedlockBackend::connect(&url).await.unwrap());
    px[3].cut();
    px[4].cut();
    let g1 = a
        .lock("re")
        .owner("same-owner")
        .ttl(Duration::from_secs(20))
        .acquire()
        .await
        .unwrap();
    px[3].restore();
    px[4].restore();
    px[0].set_latency(Duration::from_millis(500));
    px[1].set_latency(Duration::from_millis(500));
    // A client that has not seen 3 and 4 fail, with the same owner.
    let b = Locker::new(RedlockBackend::connect(&url).await.unwrap());
    let g2 = b
        .lock("re")
        .owner("same-owner")
        .ttl(Duration::from_secs(20))
        .try_acquire()
        .await
        .unwrap()
        .expect("the owner re-enters its hold");
    assert_eq!(g2.holds(), 2);
    assert!(
        g2.token() > g1.token(),
        "the reentrant grant took {:?}, not the larger answer of 3 and 4 (hold {:?})",
        g2.token(),
        g1.token()
    );
    let t2 = g2.token();
    g2.release().await.unwrap();
    g1.release().await.unwrap();
    let g3 = a.lock("re").try_acquire().await.unwrap().expect("free");
    assert!(g3.token() > t2);
    g3.release().await.unwrap();
}

/// Tries `req` on `backend` until granted (instances that were cut rejoin
/// after their connections come back); panics after 20 tries.
async fn granted(backend: &RedlockBackend, req: &Request) -> fencelock_core::backend::Grant {
    for _ in 0..20 {
        if let Ok(Some(g)) = backend.try_acquire(req).await {
            return g;
        }
        tokio::time::sleep(Duration::from_millis(1200)).await;
    }
    panic!("{req:?} was never granted");
}

/// Makes `backend` reconnect to instances that were cut: a few calls that go
/// to every instance (a lock nobody uses), past the second a failed instance
/// is skipped.
async fn reconnect(backend: &RedlockBackend) {
    let spare = Key::new("reconnect").unwrap();
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let _ = backend.force_release(&spare).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releasing_a_nested_hold_never_takes_the_outer_one_off_an_instance() {
    // The outer hold is on 0, 1, 2 (3 and 4 cut); the nested one on 0, 1, 3,
    // 4 (2 cut: it never saw it). Releasing the nested hold must leave the
    // outer one on 0, 1 and 2 — a majority — so that nobody else is granted.
    // Counting holds per instance took instance 2's only hold, the outer one.
    let five = Five::start();
    let px = proxies(&five).await;
    let a = RedlockBackend::connect(&url_through(&px, ""))
        .await
        .unwrap();
    let key = Key::new("nested").unwrap();
    let req = Request::new(
        key.clone(),
        Owner::new("owner").unwrap(),
        Mode::Exclusive,
        Duration::from_secs(30),
    );
    px[3].cut();
    px[4].cut();
    let outer = granted(&a, &req).await;
    px[2].cut();
    px[3].restore();
    px[4].restore();
    reconnect(&a).await;
    let nested = granted(&a, &req).await;
    assert_eq!(
        nested.holds, 2,
        "the nested acquire did not add to the hold"
    );
    px[2].restore();
    reconnect(&a).await;
    a.release(&LeaseRef::new(&req, &nested)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let on = holders(&five.ports, "nested").await;
    assert_eq!(
        on[..3],
        [
            Some("owner".to_string()),
            Some("owner".into()),
            Some("owner".into())
        ],
        "after the nested release the outer hold is on {on:?}"
    );
    assert_eq!(on[3..], [None, None], "the nested hold stayed: {on:?}");
    let b = RedlockBackend::connect(&five.url()).await.unwrap();
    let other = Request::new(
        key.clone(),
        Owner::new("other").unwrap(),
        Mode::Exclusive,
        Duration::from_secs(30),
    );
    assert!(
        b.try_acquire(&other).await.unwrap().is_none(),
        "granted to another owner while the outer hold is valid"
    );
    a.release(&LeaseRef::new(&req, &outer)).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let freed = b.acquire(&other, Some(deadline)).await;
    assert!(
        matches!(freed, Ok(Some(_))),
        "the outer release did not free the lock: {freed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_left_behind_on_an_instance_never_gives_an_old_token() {
    // Owner O's release misses instance 0 (cut), which keeps O's hold. C is
    // granted on 1 and 2 and lets go. O acquires again, and 0 and 1 answer
    // first: 0 as a reentrant acquire of the hold left there, with its old
    // token. O's token must still be above C's.
    let five = Five::start();
    let px = proxies(&five).await;
    let a = RedlockBackend::connect(&url_through(&px[..3], "?instance_timeout=1s"))
        .await
        .unwrap();
    let key = Key::new("left-behind").unwrap();
    let req = |owner: &str| {
        Request::new(
            key.clone(),
            Owner::new(owner).unwrap(),
            Mode::Exclusive,
            Duration::from_secs(30),
        )
    };
    let o = req("o");
    let first = granted(&a, &o).await;
    px[0].cut();
    a.release(&LeaseRef::new(&o, &first)).await.unwrap();
    assert_eq!(
        holder_on(five.ports[0], "left-behind").await.as_deref(),
        Some("o"),
        "the release reached the cut instance"
    );
    let c = RedlockBackend::connect(&format!(
        "redlock://127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}",
        five.ports[0], five.ports[1], five.ports[2]
    ))
    .await
    .unwrap();
    let cr = req("c");
    let between = granted(&c, &cr).await;
    c.release(&LeaseRef::new(&cr, &between)).await.unwrap();
    // The release's request to instance 0 has given up (its instance timeout).
    tokio::time::sleep(Duration::from_secs(2)).await;
    px[0].restore();
    reconnect(&a).await;
    // Instances 0 and 1 answer first, and make the majority.
    px[2].set_latency(Duration::from_millis(500));
    let again = granted(&a, &o).await;
    assert!(
        again.token > between.token,
        "O's new token {:?} is not above C's {:?}, granted before it (O's first: {:?})",
        again.token,
        between.token,
        first.token
    );
}

/// Runs a command on instance `port` directly.
async fn on_instance<T: redis::FromRedisValue>(port: u16, cmd: &mut redis::Cmd) -> T {
    let mut c = redis::Client::open(format!("redis://127.0.0.1:{port}").as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    cmd.query_async(&mut c).await.unwrap()
}

/// Instance `port`'s clock, in µs.
async fn clock_us(port: u16) -> u64 {
    let (s, us): (u64, u64) = on_instance(port, &mut redis::cmd("TIME")).await;
    s * 1_000_000 + us
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_left_behind_that_a_later_fence_passed_gets_a_new_token() {
    // W's release misses instance 0, which keeps W's hold. R is granted on 1
    // and 2, whose answers differ (instance 1's clock is a minute ahead), so
    // R's token is written back; the write-back reaches 0 and 1, not 2 (cut
    // while it was in flight — set here by hand: 2 keeps its own answer). R
    // lets go. W is granted on 0 and 2 (1 cut): 0 has W's old hold, 2 mints
    // from its own fence. W's token must be above R's: an instance whose
    // fence passed the hold it finds answers a new token.
    let five = Five::start();
    let ports = &five.ports[..3];
    let pw = proxies(&five).await;
    let w = RedlockBackend::connect(&url_through(&pw[..3], "?instance_timeout=1s"))
        .await
        .unwrap();
    let key = Key::new("passed").unwrap();
    let fence = "fencelock:{passed}:fence";
    let req = |owner: &str| {
        Request::new(
            key.clone(),
            Owner::new(owner).unwrap(),
            Mode::Exclusive,
            Duration::from_secs(30),
        )
    };
    let (wr, rr) = (req("w"), req("r"));
    let first = granted(&w, &wr).await;
    pw[0].cut();
    w.release(&LeaseRef::new(&wr, &first)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(holder_on(ports[0], "passed").await.as_deref(), Some("w"));
    let ahead = clock_us(ports[1]).await + 60_000_000;
    let _: () = on_instance(ports[1], redis::cmd("SET").arg(fence).arg(ahead)).await;
    let r = RedlockBackend::connect(&format!(
        "redlock://127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}",
        ports[0], ports[1], ports[2]
    ))
    .await
    .unwrap();
    let rg = granted(&r, &rr).await;
    let t_r = rg.token.unwrap();
    assert!(
        t_r.get() > ahead,
        "R's token {t_r:?} is not instance 1's answer"
    );
    let own = clock_us(ports[2]).await;
    let _: () = on_instance(ports[2], redis::cmd("SET").arg(fence).arg(own)).await;
    r.release(&LeaseRef::new(&rr, &rg)).await.unwrap();
    let store = RedisBackend::connect("redis://127.0.0.1:6379")
        .await
        .unwrap();
    let resource = format!("redlock-passed-test:{}", uuid_like());
    assert!(store.fenced_set(&resource, t_r, "R").await.unwrap());
    pw[0].restore();
    pw[1].cut();
    reconnect(&w).await;
    let again = granted(&w, &wr).await;
    let t_w = again.token.unwrap();
    assert!(
        t_w > t_r,
        "W, granted after R let go, got token {t_w:?} below R's {t_r:?}"
    );
    assert!(store.fenced_set(&resource, t_w, "W").await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_write_back_of_an_owners_old_token_never_makes_its_hold_look_current() {
    // B's grant is written back (its answers differ: instance 2's clock is
    // an hour ahead); the write-back to instance 0 is held up, and so is B's
    // release there, so 0 keeps B's hold. A is granted on 1 and 2 with a
    // larger token, written back to 0 (and lost on 1). Then B's old
    // write-back reaches 0. B's owner is granted on 0 and 1: 0 must not
    // answer B's old token as if its hold were current.
    let five = Five::start();
    let ports = &five.ports[..3];
    let px = proxies(&five).await;
    let key = Key::new("late").unwrap();
    let fence = "fencelock:{late}:fence";
    let req = |owner: &str| {
        Request::new(
            key.clone(),
            Owner::new(owner).unwrap(),
            Mode::Exclusive,
            Duration::from_secs(30),
        )
    };
    let (br, ar) = (req("b"), req("a"));
    let b = RedlockBackend::connect(&url_through(&px[..3], "?instance_timeout=5s"))
        .await
        .unwrap();
    let warm = granted(&b, &br).await;
    b.release(&LeaseRef::new(&br, &warm)).await.unwrap();
    let ahead = clock_us(ports[2]).await + 3_600_000_000;
    let _: () = on_instance(ports[2], redis::cmd("SET").arg(fence).arg(ahead)).await;
    // 1 and 2 answer late, 2 always two seconds before 1, so that 2's answer
    // is in the majority whether or not 0's reply gets out first (a round
    // returns at a majority); as soon as 0 has granted, everything to 0
    // waits 12 s.
    px[1].set_latency(Duration::from_millis(1500));
    px[2].set_latency(Duration::from_millis(500));
    let round = tokio::spawn({
        let (b, br) = (b.clone(), br.clone());
        async move { b.try_acquire(&br).await }
    });
    while holder_on(ports[0], "late").await.as_deref() != Some("b") {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    px[0].set_latency(Duration::from_secs(12));
    let bg = round
        .await
        .unwrap()
        .unwrap()
        .expect("B granted by a majority");
    let t_b = bg.token.unwrap();
    assert!(t_b.get() > ahead, "B's answers did not differ");
    px[1].set_latency(Duration::ZERO);
    px[2].set_latency(Duration::ZERO);
    px[0].set_latency(Duration::from_secs(60));
    b.release(&LeaseRef::new(&br, &bg)).await.unwrap();
    // A: refused by 0, granted by 1 and 2, written back to 0; lost on 1.
    let _: () = on_instance(
        ports[2],
        redis::cmd("SET").arg(fence).arg(t_b.get() + 10_000_000),
    )
    .await;
    let a = RedlockBackend::connect(&format!(
        "redlock://127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}",
        ports[0], ports[1], ports[2]
    ))
    .await
    .unwrap();
    let ag = granted(&a, &ar).await;
    let t_a = ag.token.unwrap();
    let _: () = on_instance(ports[1], redis::cmd("SET").arg(fence).arg(t_b.get() + 1)).await;
    a.release(&LeaseRef::new(&ar, &ag)).await.unwrap();
    // B's old write-back reaches 0.
    let name = "fencelock:{late}";
    let mut landed = false;
    for _ in 0..300 {
        let v: Option<String> = on_instance(ports[0], redis::cmd("GET").arg(name)).await;
        if v.unwrap_or_default().split('\t').nth(2) == Some(&t_b.get().to_string()) {
            landed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(landed, "B's write-back never reached instance 0");
    px[0].cut();
    tokio::time::sleep(Duration::from_millis(200)).await;
    px[0].restore();
    px[0].set_latency(Duration::ZERO);
    px[2].cut();
    let b = RedlockBackend::connect(&format!(
        "redlock://127.0.0.1:{},127.0.0.1:{},{}?instance_timeout=3s",
        ports[0],
        ports[1],
        px[2].addr()
    ))
    .await
    .unwrap();
    let again = granted(&b, &br).await;
    let t_again = again.token.unwrap();
    assert!(
        t_again > t_a,
        "B, granted after A let go, got token {t_again:?} below A's {t_a:?}"
    );
}
