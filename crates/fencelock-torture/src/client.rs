//! One torture client: a separate OS process (the binary re-executing itself)
//! that loops on three keys — exclusive, read/write, a 2-permit semaphore —
//! writes to the register under every exclusive hold, and prints each event
//! (see [`crate::events`]) on stdout.
//!
//! Stdin carries the controller's commands: `clock MS` shifts this process's
//! wall clock as fencelock reads it (the clock-offset fault); end of input
//! ends the process at once, so no client outlives its controller.

use std::net::SocketAddr;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fencelock::{Error, Guard, Hold, Lease, Locker, Mode};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::events::Event;
use crate::register::RegisterClient;

/// What one client does.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The backend URL (through this client's fault proxies).
    pub backend: String,
    /// The client's name; holds are `NAME#N`.
    pub name: String,
    /// The register's address.
    pub register: SocketAddr,
    /// The usual TTL of a hold; each acquire draws its own around it (see
    /// `draw_ttl`).
    pub ttl: Duration,
    /// The seed of this client's choices.
    pub seed: u64,
    /// A negative control: write on after `lost()` fired or the deadline passed.
    pub ignore_lost: bool,
    /// The prefix of the three keys.
    pub prefix: String,
}

/// The keys a campaign uses under `prefix`, with the mode each is taken in.
pub fn keys(prefix: &str) -> [String; 3] {
    [
        format!("{prefix}/x"),
        format!("{prefix}/rw"),
        format!("{prefix}/sem"),
    ]
}

/// How many times the usual TTL the longest drawn TTL is.
pub const LONGEST_TTL: u32 = 4;

/// The TTL of one acquire: the usual one half the time, else one drawn
/// between a quarter of it (at least 0.5 s) and [`LONGEST_TTL`] times it —
/// as users set them, and above a server's cap (a ZooKeeper session).
pub fn draw_ttl(rng: &mut fastrand::Rng, usual: Duration) -> Duration {
    match rng.u32(0..4) {
        0 | 1 => usual,
        2 => {
            let lo = (usual / 4).max(Duration::from_millis(500)).min(usual);
            lo + (usual - lo).mul_f64(rng.f64())
        }
        _ => usual + (usual * (LONGEST_TTL - 1)).mul_f64(rng.f64()),
    }
}

/// Permits of the semaphore key.
pub const PERMITS: u32 = 2;

/// The share of acquires and of releases (in percent) dropped in flight.
const CANCEL_PERCENT: u32 = 15;

/// The share of exclusive holds (in percent), where the backend is reentrant,
/// that take the key a second time as the same owner with a quarter of the TTL
/// (see [`nested`]).
const NEST_PERCENT: u32 = 25;

/// The hold this client works under, if any. Its end is reported under this
/// lock, by [`work`] or, when input ends first, by [`commands`] just before
/// the process exits — so every hold gets exactly one end, and a hold cut
/// short by the end of the campaign ends at its own deadline if that came
/// first (with `--ignore-lost` the client works on past it).
static CURRENT: Mutex<Option<(String, Lease)>> = Mutex::new(None);

fn current() -> MutexGuard<'static, Option<(String, Lease)>> {
    CURRENT.lock().unwrap_or_else(|p| p.into_inner())
}

/// The end of `hold`, now or at its deadline if that passed.
fn emit_end(hold: String, lease: &Lease) {
    let end_ns = Hold::now_ns().min(wall_of(lease.deadline().into_std()));
    let reason = match lease.lost_reason() {
        Some(r) => format!("lost:{r:?}"),
        None if lease.is_valid() => "released".to_string(),
        None => "expired".to_string(),
    };
    emit(&Event::End {
        hold,
        end_ns,
        reason,
    });
}

/// How long the fastest recent acquire and release took: a cancellation
/// comes within 1.5 times that, so it often lands while the request is at
/// the server.
struct Pace {
    acquire: Duration,
    release: Duration,
}

impl Pace {
    fn new() -> Pace {
        Pace {
            acquire: Duration::from_millis(20),
            release: Duration::from_millis(20),
        }
    }

    /// Takes `took` into `slot`: the fastest, drifting up slowly.
    fn observe(slot: &mut Duration, took: Duration) {
        *slot = took.min(slot.mul_f64(1.05));
    }

    fn budget(rng: &mut fastrand::Rng, slot: Duration) -> Duration {
        slot.mul_f64(1.5 * rng.f64() * rng.f64())
    }
}

/// Runs the client until stdin closes; returns the process's exit status.
pub async fn client(cfg: ClientConfig) -> u8 {
    tokio::spawn(commands());
    let locker = match connect(&cfg.backend).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("torture client {}: {e}", cfg.name);
            return 69;
        }
    };
    let mut register = match RegisterClient::connect(cfg.register).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("torture client {}: register: {e}", cfg.name);
            return 1;
        }
    };
    let caps = locker.capabilities();
    let [kx, krw, ksem] = keys(&cfg.prefix);
    let mut rng = fastrand::Rng::with_seed(cfg.seed);
    let mut pace = Pace::new();
    for n in 0u64.. {
        let ttl = draw_ttl(&mut rng, cfg.ttl);
        let roll = rng.u32(0..100);
        let nest = (roll < 55 && caps.reentrant && rng.u32(0..100) < NEST_PERCENT)
            .then(|| format!("{}-{n}", cfg.name));
        let (key, builder) = match roll {
            0..55 => match &nest {
                Some(owner) => (&kx, locker.lock(&kx).owner(owner)),
                None => (&kx, locker.lock(&kx)),
            },
            55..70 => (&krw, locker.lock(&krw)),
            70..85 if caps.shared => (&krw, locker.read_lock(&krw)),
            85..100 if caps.semaphore => (&ksem, locker.semaphore(&ksem, PERMITS)),
            _ => (&kx, locker.lock(&kx)),
        };
        let wait = cfg.ttl.mul_f64(1.0 + 2.0 * rng.f64());
        emit(&Event::Ask {
            at_ns: Hold::now_ns(),
            key: key.clone(),
            ttl_ns: ttl.as_nanos(),
        });
        let asked = Instant::now();
        let acquire = builder.ttl(ttl).wait(wait).acquire();
        // Now and then the acquire is dropped in flight, within a few round
        // trips: what it did at the server must not outlive it for long.
        let got = if rng.u32(0..100) < CANCEL_PERCENT {
            let budget = Pace::budget(&mut rng, pace.acquire);
            match tokio::time::timeout(budget, acquire).await {
                Ok(got) => got,
                Err(_) => {
                    emit(&Event::Cancel {
                        at_ns: Hold::now_ns(),
                        key: key.clone(),
                        what: "acquire".into(),
                        ttl_ns: ttl.as_nanos(),
                    });
                    continue;
                }
            }
        } else {
            acquire.await
        };
        let took = asked.elapsed();
        Pace::observe(&mut pace.acquire, took);
        if took > wait + crate::check::LATE_BOUND {
            emit(&Event::Late {
                at_ns: Hold::now_ns(),
                key: key.clone(),
                waited_ns: took.as_nanos(),
                wait_ns: wait.as_nanos(),
            });
        }
        match got {
            Ok(guard) => {
                let held = Held {
                    key,
                    hold: format!("{}#{n}", cfg.name),
                    ttl,
                    guard,
                    nest: nest.map(|owner| (&locker, owner)),
                };
                work(&cfg, &mut rng, &mut pace, &mut register, held).await;
            }
            Err(Error::Timeout { .. }) => emit(&Event::Timeout {
                at_ns: Hold::now_ns(),
                key: key.clone(),
                waited_ns: asked.elapsed().as_nanos(),
            }),
            Err(e) => {
                emit(&Event::Error {
                    at_ns: Hold::now_ns(),
                    text: format!("acquire: {e}"),
                });
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    0
}

/// Takes `key` again as `owner`, who holds it (`outer`), with a quarter of
/// `ttl`; keeps it past that (the watchdog renews it) and releases it. Under a
/// backend that let the nested hold's renewals or release set the key's
/// expiry, the outer hold would end early while its guard stayed valid. A
/// refusal while the outer hold stayed valid throughout is reported as an
/// error (reentrancy that treats the owner as a stranger).
async fn nested(
    locker: &Locker,
    rng: &mut fastrand::Rng,
    key: &str,
    outer: &Guard,
    owner: &str,
    ttl: Duration,
) {
    let short = ttl / 4;
    let acquire = locker
        .lock(key)
        .owner(owner)
        .ttl(short)
        .wait(Duration::ZERO)
        .acquire();
    let valid_before = outer.is_valid();
    let guard = match tokio::time::timeout(ttl * 2, acquire).await {
        Ok(Ok(guard)) => guard,
        Ok(Err(e @ (Error::Lost { .. } | Error::NotHeld { .. } | Error::Timeout { .. }))) => {
            if valid_before && outer.is_valid() {
                emit_error(format!(
                    "nested acquire refused while the hold was valid: {e}"
                ));
            }
            return;
        }
        Ok(Err(e)) => return emit_error(format!("nested acquire: {e}")),
        Err(_) => return emit_error("nested acquire: no answer within 2 × ttl".into()),
    };
    let lost = guard.lost();
    tokio::select! {
        () = tokio::time::sleep(short.mul_f64(1.0 + rng.f64())) => {}
        _ = lost => {}
    }
    match tokio::time::timeout(ttl * 2, guard.release()).await {
        Ok(Ok(()) | Err(Error::Lost { .. } | Error::NotHeld { .. })) => {}
        Ok(Err(e)) => emit_error(format!("nested release: {e}")),
        Err(_) => emit_error("nested release: no answer within 2 × ttl".into()),
    }
}

fn emit_error(text: String) {
    emit(&Event::Error {
        at_ns: Hold::now_ns(),
        text,
    });
}

/// Connects, retrying for a while: a client started during a partition.
async fn connect(url: &str) -> fencelock::Result<Locker> {
    let start = Instant::now();
    loop {
        match tokio::time::timeout(Duration::from_secs(10), fencelock::connect(url)).await {
            Ok(Ok(l)) => return Ok(l),
            Ok(Err(e)) if start.elapsed() > Duration::from_secs(30) => return Err(e),
            Ok(Err(Error::InvalidConfig(m))) => return Err(Error::InvalidConfig(m)),
            _ if start.elapsed() > Duration::from_secs(30) => {
                return Err(Error::config(format!("cannot connect to {url} in 30 s")));
            }
            _ => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

/// The controller's commands on stdin.
async fn commands() {
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if let Some(ms) = line
            .strip_prefix("clock ")
            .and_then(|m| m.trim().parse().ok())
        {
            fencelock_core::clock::shift_wall_clock_for_tests(ms);
        }
    }
    // The controller is gone (or done): so is this client, holds and all.
    let mut current = current();
    if let Some((hold, lease)) = current.take() {
        emit_end(hold, &lease);
    }
    std::process::exit(0);
}

fn emit(e: &Event) {
    println!("{}", e.to_line());
}

/// `instant` on the shared wall clock.
fn wall_of(instant: Instant) -> u128 {
    let (now_i, now_w) = (Instant::now(), Hold::now_ns());
    match instant.checked_duration_since(now_i) {
        Some(ahead) => now_w + ahead.as_nanos(),
        None => now_w.saturating_sub(now_i.duration_since(instant).as_nanos()),
    }
}

/// A grant a client works under.
struct Held<'a> {
    key: &'a str,
    /// `NAME#N`.
    hold: String,
    /// The TTL asked for.
    ttl: Duration,
    guard: Guard,
    /// The locker and the owner of a hold that nests a reentrant one.
    nest: Option<(&'a Locker, String)>,
}

/// One hold: announce it, write to the register under it (exclusive modes),
/// sleep a while (sometimes past the TTL, so the watchdog must renew), end it.
async fn work(
    cfg: &ClientConfig,
    rng: &mut fastrand::Rng,
    pace: &mut Pace,
    register: &mut RegisterClient,
    held: Held<'_>,
) {
    let Held {
        key,
        hold,
        ttl,
        guard,
        nest,
    } = held;
    let hold = hold.as_str();
    let token = guard.token().map(|t| t.get());
    let watcher = announce(key, hold, &guard);
    let lost = guard.lost();
    tokio::pin!(lost);
    let writes = if guard.mode() == Mode::Exclusive {
        rng.u32(1..=3)
    } else {
        1
    };
    // Once `lost` fired it is not polled again.
    let mut ended = false;
    if let Some((locker, owner)) = nest {
        tokio::select! {
            () = nested(locker, rng, key, &guard, &owner, ttl) => {}
            _ = &mut lost, if !cfg.ignore_lost => ended = true,
        }
        // The outer hold goes on past the nested one's TTL: a release that
        // left the key with the nested hold's expiry shows as an overlap.
        if !ended {
            tokio::select! {
                () = tokio::time::sleep(ttl / 2) => {}
                _ = &mut lost, if !cfg.ignore_lost => ended = true,
            }
        }
    }
    for _ in 0..writes {
        if ended || !cfg.ignore_lost && !guard.is_valid() {
            break;
        }
        if guard.mode() == Mode::Exclusive
            && let Err(e) = register.write(key, token, hold).await
        {
            emit(&Event::Error {
                at_ns: Hold::now_ns(),
                text: format!("register: {e}"),
            });
        }
        tokio::select! {
            () = tokio::time::sleep(nap(rng, ttl)) => {}
            _ = &mut lost, if !cfg.ignore_lost => break,
        }
    }
    if cfg.ignore_lost && guard.mode() == Mode::Exclusive {
        // The negative control writes once more whatever the guard says.
        let _ = register.write(key, token, hold).await;
    }
    watcher.abort();
    if let Some((hold, lease)) = current().take() {
        emit_end(hold, &lease);
    }
    release(rng, pace, key, ttl, guard).await;
}

/// Reports the grant of `hold` and makes it the current one; the task it
/// returns reports the hold's end when `lost()` fires, whatever the client
/// is doing then (if it never fires, the end is reported before the release).
fn announce(key: &str, hold: &str, guard: &Guard) -> tokio::task::JoinHandle<()> {
    {
        let mut now_held = current();
        emit(&Event::Grant {
            hold: hold.to_string(),
            key: key.to_string(),
            mode: guard.mode(),
            token: guard.token().map(|t| t.get()),
            seen_ns: Hold::now_ns(),
            valid_ns: wall_of(guard.deadline().into_std()),
            valid_on_arrival: guard.is_valid(),
        });
        *now_held = Some((hold.to_string(), guard.lease()));
    }
    let (lease, hold) = (guard.lease(), hold.to_string());
    tokio::spawn(async move {
        let _ = lease.lost().await;
        let mut current = current();
        if current.as_ref().is_some_and(|(h, _)| *h == hold)
            && let Some((hold, lease)) = current.take()
        {
            emit_end(hold, &lease);
        }
    })
}

/// A pause between writes: mostly short, so that grants are many; sometimes
/// past the TTL, so that the watchdog must renew.
fn nap(rng: &mut fastrand::Rng, ttl: Duration) -> Duration {
    match rng.u32(0..100) {
        0..10 => ttl.mul_f64(1.0 + rng.f64()),
        10..25 => ttl.mul_f64(0.2 + rng.f64() / 3.0),
        _ => ttl.mul_f64(rng.f64() / 5.0),
    }
}

/// Releases `guard`. Now and then the release is dropped in flight (the
/// guard's drop then queues another); otherwise it has two TTLs to answer.
async fn release(rng: &mut fastrand::Rng, pace: &mut Pace, key: &str, ttl: Duration, guard: Guard) {
    let cancel = rng.u32(0..100) < CANCEL_PERCENT;
    let budget = if cancel {
        Pace::budget(rng, pace.release)
    } else {
        ttl * 2
    };
    let sent = Instant::now();
    let released = tokio::time::timeout(budget, guard.release()).await;
    if !cancel {
        Pace::observe(&mut pace.release, sent.elapsed());
    }
    match released {
        Err(_) if cancel => emit(&Event::Cancel {
            at_ns: Hold::now_ns(),
            key: key.to_string(),
            what: "release".into(),
            ttl_ns: ttl.as_nanos(),
        }),
        Ok(Ok(())) | Ok(Err(Error::Lost { .. } | Error::NotHeld { .. })) => {}
        Ok(Err(e)) => emit(&Event::Error {
            at_ns: Hold::now_ns(),
            text: format!("release: {e}"),
        }),
        Err(_) => emit(&Event::Error {
            at_ns: Hold::now_ns(),
            text: "release: no answer within 2 × ttl".into(),
        }),
    }
}
