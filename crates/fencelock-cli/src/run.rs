//! `fencelock run`: hold a lock while a command runs.
//!
//! CMD runs in a process group of its own (see [`crate::process_tree`]). The
//! lock is released only after every process of that group has ended, and the
//! group is stopped before the lease can run out: SIGTERM once the lease's
//! renewal is late by more than the grace (`--kill-grace`, by default the
//! lesser of 5 s and a third of the TTL), SIGKILL a margin (a tenth of the TTL,
//! at most 1 s) before the lease's deadline. The TTL is the one the backend
//! granted ([`fencelock::Guard::ttl`]), which may be shorter than `--ttl`. A lease found already lost
//! (fencelock was paused past it, or the lock was taken away) SIGKILLs the
//! group at once. Signals fencelock receives (INT, TERM, HUP, QUIT) go to the
//! group once.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};
use tokio::time::Instant;

use crate::cli::{RunArgs, Wait};
use crate::exit;
use crate::process_tree::{Event, Tree};

/// SIGINT, SIGTERM, SIGHUP and SIGQUIT, received as a stream.
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    quit: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Signals> {
        Ok(Signals {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            hup: signal(SignalKind::hangup())?,
            quit: signal(SignalKind::quit())?,
        })
    }

    /// The next signal that arrives.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe (tokio's `Signal::recv` is).
    async fn recv(&mut self) -> Signal {
        tokio::select! {
            _ = self.int.recv() => Signal::SIGINT,
            _ = self.term.recv() => Signal::SIGTERM,
            _ = self.hup.recv() => Signal::SIGHUP,
            _ = self.quit.recv() => Signal::SIGQUIT,
        }
    }
}

/// The shell's convention: the exit code, or 128 + the signal that killed it.
fn status_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(c), _) => u8::try_from(c & 0xff).unwrap_or(exit::FAILURE),
        (None, Some(sig)) => u8::try_from(128 + (sig & 0x7f)).unwrap_or(exit::FAILURE),
        (None, None) => exit::FAILURE,
    }
}

/// How long before the lease's deadline CMD's group must be dead.
fn margin(ttl: Duration) -> Duration {
    (ttl / 10).min(Duration::from_secs(1))
}

/// How long `run` waits, before it exits, for the work the lock left to the
/// background: leaving a server-side line after a signal ended the wait, a
/// release.
const SETTLE: Duration = Duration::from_secs(3);

pub async fn run(args: RunArgs) -> u8 {
    crate::process_tree::ignore_terminal_output_stops();
    let mut signals = match Signals::new() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("fencelock: cannot install signal handlers: {e}");
            return exit::FAILURE;
        }
    };
    let code = hold_and_run(&args, &mut signals).await;
    // A waiter stopped by a signal leaves its place in the backend's line
    // here, rather than stay in it, a ghost, until its TTL ends. Another
    // signal ends the wait.
    tokio::select! {
        _ = fencelock::settle(SETTLE) => {}
        _ = signals.recv() => {}
    }
    code
}

/// Acquires, runs CMD under the lock, releases; returns the exit status.
async fn hold_and_run(args: &RunArgs, signals: &mut Signals) -> u8 {
    let guard = match acquire(args, signals).await {
        Ok(g) => g,
        Err(code) => return code,
    };
    // The TTL the backend granted, which may be shorter than `--ttl` (a
    // ZooKeeper session or an etcd lease caps it): every time below is a
    // share of the lease there is.
    let timing = Timing::of(args, guard.ttl());
    // A grant that is no longer valid (the backend took long to answer) must
    // not start CMD.
    if guard.deadline() <= Instant::now() + timing.window + timing.margin {
        eprintln!(
            "fencelock: the lease on {:?} had too little time left when it was granted ({:?}); CMD was not started",
            args.key,
            guard.deadline().saturating_duration_since(Instant::now())
        );
        drop(guard);
        return exit::LOST;
    }
    let token = guard.token().map(|t| t.to_string()).unwrap_or_default();
    let env = [
        ("FENCELOCK_TOKEN", token),
        ("FENCELOCK_KEY", args.key.clone()),
    ];
    match Tree::spawn(&args.command, &env) {
        Ok(tree) => supervise(args, timing, guard, tree, signals).await,
        Err(e) => {
            eprintln!("fencelock: cannot run {:?}: {e}", args.command[0]);
            if let Err(e) = guard.release().await {
                eprintln!("fencelock: warning: {e}");
            }
            if e.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            }
        }
    }
}

/// When CMD's group is stopped, relative to the lease's deadline.
#[derive(Clone, Copy)]
struct Timing {
    /// `--kill-grace`: how late a renewal may be before SIGTERM.
    grace: Duration,
    /// What CMD gets between SIGTERM and SIGKILL: SIGTERM comes no sooner
    /// than a renewal is late by this, and SIGKILL no later than `margin`
    /// before the deadline.
    window: Duration,
    /// How long before the deadline the group must be dead.
    margin: Duration,
}

impl Timing {
    /// The timing `args` ask for on a lease of `ttl` (the granted TTL); warns
    /// when `--kill-grace` is more than a third of it (the window is cut to
    /// that).
    fn of(args: &RunArgs, ttl: Duration) -> Timing {
        let grace = args
            .kill_grace
            .unwrap_or_else(|| (ttl / 3).min(Duration::from_secs(5)));
        let window = grace.min(ttl / 3);
        if grace > ttl / 3 {
            let granted = match args.ttl {
                Some(asked) if ttl < asked => format!(
                    " (the TTL the backend granted for --ttl {})",
                    humantime::format_duration(asked)
                ),
                _ => String::new(),
            };
            eprintln!(
                "fencelock: warning: --kill-grace {} is more than a third of the lease's TTL {}{granted}: CMD gets at most {} between SIGTERM and SIGKILL, so that it has ended before the lease could run out",
                humantime::format_duration(grace),
                humantime::format_duration(ttl),
                humantime::format_duration(window),
            );
        }
        Timing {
            grace,
            window,
            margin: margin(ttl),
        }
    }
}

/// Acquires the lock `args` name; `Err` is the exit status (an error, or
/// 128 + a signal that came while connecting or waiting). `--wait` covers
/// the connect too, which asks again through an outage until the wait ends
/// (see [`fencelock::connect_within`]).
async fn acquire(args: &RunArgs, signals: &mut Signals) -> Result<fencelock::Guard, u8> {
    let wait = match args.wait {
        Wait::Forever => None,
        Wait::For(d) => Some(d),
    };
    let deadline = wait.map(|d| Instant::now() + d);
    let url = args.backend.url();
    let connect = fencelock::connect_within(&url, wait);
    let locker = tokio::select! {
        r = connect => r.map_err(|e| exit::report(&e))?,
        sig = signals.recv() => return Err(128 + sig as u8),
    };
    let builder = if args.shared {
        locker.read_lock(&args.key)
    } else if let Some(n) = args.permits {
        locker.semaphore(&args.key, n)
    } else {
        locker.lock(&args.key)
    };
    // Without --ttl, the locker's default: the URL's `ttl=`, else 30 s.
    let builder = match args.ttl {
        Some(ttl) => builder.ttl(ttl),
        None => builder,
    };
    let builder = match deadline {
        None => builder.wait_forever(),
        Some(at) => builder.wait(at.saturating_duration_since(Instant::now())),
    };
    tokio::select! {
        r = builder.acquire() => r.map_err(|e| match (e, wait) {
            // The wait the user gave, not what the connect left of it.
            (fencelock::Error::Timeout { key, .. }, Some(waited)) => {
                exit::report(&fencelock::Error::Timeout { key, waited })
            }
            (e, _) => exit::report(&e),
        }),
        sig = signals.recv() => Err(128 + sig as u8),
    }
}

/// Runs until CMD's group has ended, the lease is lost, or its renewal is so
/// late that the group must be stopped; forwards signals to the group.
/// Returns the exit status.
async fn supervise(
    args: &RunArgs,
    t: Timing,
    guard: fencelock::Guard,
    mut tree: Tree,
    signals: &mut Signals,
) -> u8 {
    loop {
        let stop_at = guard
            .deadline()
            .checked_sub(t.window + t.margin)
            .unwrap_or_else(Instant::now);
        tokio::select! {
            biased;
            event = tree.event() => match event {
                Event::Exited => return exited(args, t, guard, tree, signals).await,
                Event::Stopped => tree.stopped(),
            },
            lost = guard.lost() => {
                tree.kill(false).await;
                eprintln!("fencelock: {lost}; killed {:?}", args.command[0]);
                tree.stop(true, Instant::now()).await;
                let _ = tree.finish().await;
                drop(guard);
                return exit::LOST;
            }
            _ = tokio::time::sleep_until(stop_at) => {
                if guard.deadline() > Instant::now() + t.window + t.margin {
                    continue; // renewed meanwhile
                }
                eprintln!(
                    "fencelock: the lease on {:?} was not renewed in time; stopping {:?} so that it has ended before the lease could run out",
                    args.key, args.command[0]
                );
                let kill_at = guard.deadline().checked_sub(t.margin).unwrap_or_else(Instant::now);
                tree.stop(false, kill_at).await;
                let _ = tree.finish().await;
                // Still held, maybe: let it go rather than make the next holder
                // wait for the expiry.
                let _ = release(guard, signals).await;
                return exit::LOST;
            }
            sig = signals.recv() => tree.signal(sig),
        }
    }
}

/// CMD has exited: what it left in its group ends before the lock goes.
/// Returns CMD's status.
async fn exited(
    args: &RunArgs,
    t: Timing,
    guard: fencelock::Guard,
    mut tree: Tree,
    signals: &mut Signals,
) -> u8 {
    let kill_at = guard
        .deadline()
        .checked_sub(t.margin)
        .unwrap_or_else(Instant::now);
    tree.stop(true, kill_at.min(Instant::now() + t.grace)).await;
    let code = match tree.finish().await {
        Ok(s) => status_code(s),
        Err(e) => {
            eprintln!("fencelock: cannot wait for {:?}: {e}", args.command[0]);
            exit::FAILURE
        }
    };
    if !guard.is_valid() {
        eprintln!(
            "fencelock: warning: the lease on {:?} was lost by the time {:?} had ended (its status: {code})",
            args.key, args.command[0]
        );
    }
    if let Err(e) = release(guard, signals).await {
        eprintln!("fencelock: warning: releasing {:?} failed: {e}", args.key);
    }
    code
}

/// How long `run` waits for a release before it exits (the hold then ends
/// with its TTL).
const RELEASE_LIMIT: Duration = Duration::from_secs(10);

/// Releases `guard`, for at most [`RELEASE_LIMIT`] and until a signal comes;
/// `Err` says why it failed.
async fn release(guard: fencelock::Guard, signals: &mut Signals) -> Result<(), String> {
    let ttl = humantime::format_duration(guard.ttl());
    tokio::select! {
        r = tokio::time::timeout(RELEASE_LIMIT, guard.release()) => match r {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => Err(format!(
                "no answer within {}; the hold ends with its TTL ({ttl})",
                humantime::format_duration(RELEASE_LIMIT)
            )),
        },
        sig = signals.recv() => Err(format!("stopped by {sig}; the hold ends with its TTL ({ttl})")),
    }
}
