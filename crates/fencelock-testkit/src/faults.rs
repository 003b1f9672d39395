//! Fault scenarios shared by the backends' fault tests: a holder process
//! SIGKILLed or SIGSTOPped, the server restarted under a hold, and a client
//! whose wall clock is off. Each backend's test binary provides a
//! [`FaultHarness`], runs [`holder_worker`] from an ignored test named
//! `holder_worker`, and calls the scenarios; the bodies live here once.
//!
//! Every scenario states what must happen and panics (a test failure) if it
//! does not.

use std::future::Future;
use std::time::{Duration, Instant};

use fencelock_core::backend::async_trait;
use fencelock_core::clock::shift_wall_clock_for_tests;
use fencelock_core::{Error, FencingToken, Locker, Result};
use nix::sys::signal::Signal;

use crate::holder::HolderProcess;

/// What a backend provides to the fault scenarios.
#[async_trait]
pub trait FaultHarness: Send + Sync + 'static {
    /// A new client (its own connections) of the backend at `url`.
    async fn locker(&self, url: &str) -> Result<Locker>;

    /// Writes to the resource the lock `key` protects, fenced by `token`: true
    /// if written, false if a write with a token at least as large came first.
    async fn fenced_write(&self, key: &str, token: FencingToken) -> Result<bool>;
}

const URL_VAR: &str = "FENCELOCK_HOLD_URL";
const KEY_VAR: &str = "FENCELOCK_HOLD_KEY";
const TTL_VAR: &str = "FENCELOCK_HOLD_TTL_MS";

/// The body of the holder process; call it from an ignored test named
/// `holder_worker`. Does nothing unless started by a scenario: it holds the
/// key with the TTL the scenario gave, prints `acquired <token>` (`acquired -`
/// on a backend without tokens), waits for the lease to be lost, prints
/// `lost true`, then — given a token — tries the write a paused holder would
/// still make and prints `stale-write accepted|rejected`.
pub fn holder_worker<H: FaultHarness>(harness: H) {
    let (Ok(url), Ok(key)) = (std::env::var(URL_VAR), std::env::var(KEY_VAR)) else {
        return;
    };
    let ttl = std::env::var(TTL_VAR)
        .ok()
        .and_then(|t| t.parse().ok())
        .map_or(Duration::from_secs(2), Duration::from_millis);
    let Ok(runtime) = tokio::runtime::Runtime::new() else {
        panic!("no tokio runtime for the holder");
    };
    runtime.block_on(async move {
        let locker = harness.locker(&url).await.expect("holder: connect");
        let g = locker
            .lock(&key)
            .ttl(ttl)
            .acquire()
            .await
            .expect("holder: acquire");
        let Some(token) = g.token() else {
            println!("acquired -");
            let lost = g.lost().await;
            println!("lost {}", matches!(lost, Error::Lost { .. }));
            return;
        };
        println!("acquired {}", token.get());
        let lost = g.lost().await;
        println!("lost {}", matches!(lost, Error::Lost { .. }));
        let written = harness
            .fenced_write(&key, token)
            .await
            .expect("holder: fenced write");
        println!(
            "stale-write {}",
            if written { "accepted" } else { "rejected" }
        );
    });
}

/// A key no other test run uses.
pub fn unique_key(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("faults-{name}-{}-{nanos}", std::process::id())
}

/// A holder process of `key`, and its token (`None` on a backend without).
fn spawn_holder_of(url: &str, key: &str, ttl: Duration) -> (HolderProcess, Option<u64>) {
    let ttl_ms = ttl.as_millis().to_string();
    let mut h = HolderProcess::spawn(
        "holder_worker",
        &[(URL_VAR, url), (KEY_VAR, key), (TTL_VAR, &ttl_ms)],
    )
    .expect("spawn the holder process");
    let said = h.expect("acquired ").expect("the holder acquires");
    let token = (said != "-").then(|| said.parse().expect("a token"));
    (h, token)
}

fn spawn_holder(url: &str, key: &str, ttl: Duration) -> (HolderProcess, u64) {
    let (h, token) = spawn_holder_of(url, key, ttl);
    (h, token.expect("the holder has a fencing token"))
}

async fn locker<H: FaultHarness>(h: &H, url: &str) -> Locker {
    h.locker(url).await.expect("connect")
}

/// A holder process SIGKILLed under a lease that lives by its TTL (2 s):
/// another client gets the lock no sooner than about the TTL and no later
/// than the TTL plus a few seconds of server granularity, with a larger token
/// (on a backend with tokens).
pub async fn killed_holder_frees_after_its_ttl<H: FaultHarness>(h: &H, url: &str) {
    let key = unique_key("kill-ttl");
    let (holder, token) = spawn_holder_of(url, &key, Duration::from_secs(2));
    let other = locker(h, url).await;
    assert!(
        other.lock(&key).try_acquire().await.expect("try").is_none(),
        "the lock was free while the holder lived"
    );
    holder.signal(Signal::SIGKILL).expect("kill the holder");
    let start = Instant::now();
    let g = other
        .lock(&key)
        .wait(Duration::from_secs(30))
        .acquire()
        .await
        .expect("granted after the killed holder's TTL");
    assert!(
        start.elapsed() >= Duration::from_secs(1),
        "granted {:?} after the kill, before the TTL",
        start.elapsed()
    );
    // What a dead holder costs is its own TTL (2 s), plus a round trip and the
    // server's granularity (whole seconds of a lease, an expiry sweep): well
    // under 6 s, never a longer session's or lease's timeout.
    assert!(
        start.elapsed() < Duration::from_secs(6),
        "granted only {:?} after a holder with a 2 s TTL was killed",
        start.elapsed()
    );
    if let Some(token) = token {
        assert!(g.token().expect("token").get() > token);
    }
    g.release().await.expect("release");
}

/// A holder process SIGKILLed under a session-bound lock (its TTL far longer
/// than the wait): the session dies with the process, so another client gets
/// the lock at once, with a larger token.
pub async fn killed_session_holder_frees_at_once<H: FaultHarness>(h: &H, url: &str) {
    let key = unique_key("kill-session");
    let (holder, token) = spawn_holder(url, &key, Duration::from_secs(60));
    let other = locker(h, url).await;
    assert!(
        other.lock(&key).try_acquire().await.expect("try").is_none(),
        "the lock was free while the holder lived"
    );
    holder.signal(Signal::SIGKILL).expect("kill the holder");
    let g = other
        .lock(&key)
        .wait(Duration::from_secs(20))
        .acquire()
        .await
        .expect("granted well before the 60 s TTL");
    assert!(g.token().expect("token").get() > token);
    g.release().await.expect("release");
}

/// A holder process SIGSTOPped past its 2 s TTL: another client is granted the
/// lock after it with a larger token and writes; the resumed holder's `lost()`
/// fires and its stale fenced write is rejected.
pub async fn paused_holder_loses_its_lock_and_its_stale_write<H: FaultHarness>(h: &H, url: &str) {
    let key = unique_key("pause");
    let (holder, stale) = spawn_holder(url, &key, Duration::from_secs(2));
    holder.signal(Signal::SIGSTOP).expect("pause the holder");
    let start = Instant::now();
    let g = locker(h, url)
        .await
        .lock(&key)
        .wait(Duration::from_secs(30))
        .acquire()
        .await
        .expect("granted after the paused holder's TTL");
    assert!(
        start.elapsed() >= Duration::from_secs(1),
        "granted before the paused holder's TTL"
    );
    let token = g.token().expect("token");
    assert!(token.get() > stale, "token {token:?} after {stale}");
    assert!(
        h.fenced_write(&key, token).await.expect("write"),
        "the new holder's write was refused"
    );
    holder.signal(Signal::SIGCONT).expect("resume the holder");
    let rest = holder.finish();
    assert!(
        rest.iter().any(|l| l == "lost true"),
        "the resumed holder never learned: {rest:?}"
    );
    assert!(
        rest.iter().any(|l| l == "stale-write rejected"),
        "the stale write got through: {rest:?}"
    );
    g.release().await.expect("release");
}

/// The server restarted (by `restart`) under a session-bound hold: the guard's
/// `lost()` fires no later than the next holder is granted on the restarted
/// server, and the next token is larger. (Session modes grant nothing for a
/// TTL after a restart: a holder cut off from the server could not hear of it.)
pub async fn restart_ends_session_holds<H, F, Fut>(h: &H, url: &str, restart: F)
where
    H: FaultHarness,
    F: FnOnce() -> Fut,
    Fut: Future<Output = ()>,
{
    let key = unique_key("restart-session");
    let ttl = Duration::from_secs(12);
    let g = locker(h, url)
        .await
        .lock(&key)
        .ttl(ttl)
        .acquire()
        .await
        .expect("acquire");
    let before = g.token().expect("token");
    let lost_at = tokio::spawn({
        let lost = g.lost();
        async move {
            let e = lost.await;
            (Instant::now(), e)
        }
    });
    restart().await;
    // The next holder, as soon as the server takes it.
    let other = locker(h, url).await;
    let start = Instant::now();
    let g2 = loop {
        match other.lock(&key).try_acquire().await {
            Ok(Some(g)) => break g,
            Ok(None) | Err(_) => {
                assert!(
                    start.elapsed() < ttl + Duration::from_secs(30),
                    "the lock never came free after the restart"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let granted_at = Instant::now();
    let (lost_at, lost) = tokio::time::timeout(Duration::from_secs(30), lost_at)
        .await
        .expect("lost() did not fire after the server restarted")
        .expect("the lost() task panicked");
    assert!(matches!(lost, Error::Lost { .. }), "{lost:?}");
    assert!(!g.is_valid());
    assert!(
        lost_at <= granted_at,
        "the holder learned of its loss {:?} after the next holder was granted",
        lost_at - granted_at
    );
    assert!(
        g2.token().expect("token") > before,
        "token {:?} after {before:?}",
        g2.token()
    );
    g2.release().await.expect("release");
}

/// The server restarted (by `restart`, quickly) under a lease with a 6 s TTL:
/// the watchdog renews on new connections, the guard stays valid and others
/// are refused.
pub async fn lease_outlives_a_short_restart<H, F, Fut>(h: &H, url: &str, restart: F)
where
    H: FaultHarness,
    F: FnOnce() -> Fut,
    Fut: Future<Output = ()>,
{
    let key = unique_key("restart-lease");
    let g = locker(h, url)
        .await
        .lock(&key)
        .ttl(Duration::from_secs(6))
        .acquire()
        .await
        .expect("acquire");
    restart().await;
    // Two renewal periods after the restart.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(g.is_valid(), "the lease was lost over a short restart");
    let other = locker(h, url).await;
    assert!(
        other.lock(&key).try_acquire().await.expect("try").is_none(),
        "another client got a held lease"
    );
    g.release().await.expect("release");
    let g2 = other
        .lock(&key)
        .try_acquire()
        .await
        .expect("try")
        .expect("free after release");
    g2.release().await.expect("release");
}

/// Expiry follows the server's clock: with this process's wall clock an hour
/// behind, then ahead (the core's test hook), a 2 s fixed lease is busy at
/// once and free after about its TTL. A backend computing expiry on the client
/// frees it at once (behind) or an hour late (ahead). The offset is
/// process-wide: run this in a test binary of its own.
pub async fn expiry_follows_the_server_clock<H: FaultHarness>(h: &H, url: &str) {
    for (offset_ms, label) in [(-3_600_000, "behind"), (3_600_000, "ahead")] {
        shift_wall_clock_for_tests(offset_ms);
        let key = unique_key(&format!("clock-{label}"));
        let (a, b) = (locker(h, url).await, locker(h, url).await);
        let ttl = Duration::from_secs(2);
        let start = Instant::now();
        let g = a.lock(&key).lease(ttl).acquire().await.expect("acquire");
        assert!(
            b.lock(&key).try_acquire().await.expect("try").is_none(),
            "client clock {label}: the lease was free at once"
        );
        let g2 = b
            .lock(&key)
            .wait(Duration::from_secs(20))
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("client clock {label}: not freed after its TTL: {e}"));
        let took = start.elapsed();
        assert!(
            took >= ttl / 2,
            "client clock {label}: freed after {took:?}"
        );
        g2.release().await.expect("release");
        drop(g);
    }
    shift_wall_clock_for_tests(0);
}

/// Holds `n` locks on `locker` (TTL 3 s) past several TTLs and asserts that
/// renewals kept every one: for backends that renew in batches (a script per
/// 100 leases, a pipeline per 200, a transaction per 128), `n` should span
/// several batches and end in a partial one.
///
/// # Panics
///
/// If a lock cannot be taken, or one was lost.
pub async fn many_held_locks_are_all_renewed(locker: &Locker, n: usize) {
    let base = unique_key("many");
    let mut guards = Vec::with_capacity(n);
    for i in 0..n {
        let g = locker
            .lock(format!("{base}/{i}"))
            .ttl(Duration::from_secs(3))
            .acquire()
            .await
            .expect("acquire");
        guards.push(g);
    }
    // Past the TTL: only renewals keep them.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let lost: Vec<_> = guards
        .iter()
        .filter(|g| !g.is_valid())
        .map(|g| (g.key().to_string(), g.lease().lost_reason()))
        .collect();
    assert!(
        lost.is_empty(),
        "{} of {n} lost, e.g. {:?}",
        lost.len(),
        lost.first()
    );
    for g in guards {
        g.release().await.expect("release");
    }
}

/// The server goes silent (a proxy between client and server that forwards
/// nothing: a frozen VM, a cut cable without a reset) while a waiter waits,
/// and before a client connects. The waiter returns an error by its 3 s
/// deadline plus a few seconds; the connect ends by the backend's connect
/// timeout (an error, or a client whose first acquire then ends by its
/// deadline). The bounds are loose: a hang, retries stacked on a timeout, or
/// a request timeout stacked on the wait, fail the case.
///
/// The first `127.0.0.1:PORT` of `url` is put behind the proxy (on Redlock:
/// one instance of several).
///
/// # Panics
///
/// If a wait or a connect outlives its bound, or a grant crosses a silent link.
pub async fn a_stalled_server_cannot_hold_a_waiter_past_its_deadline<H: FaultHarness>(
    h: &H,
    url: &str,
) {
    const WAIT: Duration = Duration::from_secs(3);
    const LATE: Duration = Duration::from_secs(5);
    let Some(port) = url
        .split("127.0.0.1:")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|p| p.parse::<u16>().ok())
    else {
        panic!("{url}: no 127.0.0.1:PORT to put a proxy in front of");
    };
    let proxy = crate::FaultProxy::start(([127, 0, 0, 1], port).into())
        .await
        .expect("start the proxy");
    let proxied = url.replacen(
        &format!("127.0.0.1:{port}"),
        &format!("127.0.0.1:{}", proxy.addr().port()),
        1,
    );
    let key = unique_key("stalled");
    let holder = locker(h, url).await;
    let held = holder.lock(&key).acquire().await.expect("hold");

    // Silent while waiting.
    let waiter = locker(h, &proxied).await;
    let wait_key = key.clone();
    let waiting = tokio::spawn(async move {
        let start = Instant::now();
        let r = waiter.lock(&wait_key).wait(WAIT).acquire().await;
        (r.map(|g| g.token()), start.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.blackhole();
    let (r, took) = tokio::time::timeout(Duration::from_secs(60), waiting)
        .await
        .expect("a 3 s wait still ran 60 s into a silent server")
        .expect("the waiter's task");
    assert!(r.is_err(), "granted across a silent link: {r:?}");
    assert!(
        took < WAIT + LATE,
        "a 3 s wait returned {took:?} after it began, the server silent: {r:?}"
    );

    // Silent before the connect: it ends by the backend's connect timeout
    // (5 s or 10 s by default), with an error or with a client whose first
    // acquire then ends by its deadline.
    let start = Instant::now();
    let connected = tokio::time::timeout(Duration::from_secs(60), h.locker(&proxied))
        .await
        .expect("a connect to a silent server still ran after 60 s");
    let took = start.elapsed();
    assert!(
        took < Duration::from_secs(10) + LATE,
        "a connect to a silent server took {took:?}"
    );
    if let Ok(late) = connected {
        let start = Instant::now();
        let r = tokio::time::timeout(
            Duration::from_secs(60),
            late.lock(&key).wait(WAIT).acquire(),
        )
        .await
        .expect("a 3 s wait of a client of a silent server still ran after 60 s");
        let took = start.elapsed();
        assert!(
            r.is_err(),
            "granted by a silent server: {:?}",
            r.map(|g| g.token())
        );
        assert!(
            took < WAIT + LATE,
            "a 3 s wait of a client of a silent server returned after {took:?}"
        );
    }
    proxy.restore();
    held.release().await.expect("release");
}
