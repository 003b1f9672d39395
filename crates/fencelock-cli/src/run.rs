//! `fencelock run`: hold a lock while a command runs.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::signal::unix::{SignalKind, signal};

use crate::cli::{RunArgs, Wait};
use crate::exit;

/// SIGINT, SIGTERM and SIGHUP, received as a stream.
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Signals> {
        Ok(Signals {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            hup: signal(SignalKind::hangup())?,
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

fn send(pid: Option<u32>, sig: Signal) {
    if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
        let _ = kill(Pid::from_raw(pid), sig);
    }
}

/// SIGTERM, then SIGKILL after `grace`; reaps the child.
async fn terminate(child: &mut Child, grace: Duration) {
    send(child.id(), Signal::SIGTERM);
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        let _ = child.kill().await;
    }
}

pub async fn run(args: RunArgs) -> u8 {
    let mut signals = match Signals::new() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("fencelock: cannot install signal handlers: {e}");
            return exit::FAILURE;
        }
    };
    let locker = match fencelock::Locker::connect(&args.backend.url()).await {
        Ok(l) => l,
        Err(e) => return exit::report(&e),
    };
    let builder = if args.shared {
        locker.read_lock(&args.key)
    } else if let Some(n) = args.permits {
        locker.semaphore(&args.key, n)
    } else {
        locker.lock(&args.key)
    }
    .ttl(args.ttl);
    let builder = match args.wait {
        Wait::Forever => builder.wait_forever(),
        Wait::For(d) => builder.wait(d),
    };
    let guard = tokio::select! {
        r = builder.acquire() => match r {
            Ok(g) => g,
            Err(e) => return exit::report(&e),
        },
        sig = signals.recv() => return 128 + sig as u8,
    };
    let token = guard.token().map(|t| t.to_string()).unwrap_or_default();
    let spawned = Command::new(&args.command[0])
        .args(&args.command[1..])
        .env("FENCELOCK_TOKEN", &token)
        .env("FENCELOCK_KEY", &args.key)
        .spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => {
            eprintln!("fencelock: cannot run {:?}: {e}", args.command[0]);
            if let Err(e) = guard.release().await {
                eprintln!("fencelock: warning: {e}");
            }
            return if e.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            };
        }
    };
    loop {
        tokio::select! {
            biased;
            lost = guard.lost() => {
                eprintln!("fencelock: {lost}; stopping {:?}", args.command[0]);
                terminate(&mut child, args.kill_grace).await;
                drop(guard);
                return exit::LOST;
            }
            status = child.wait() => {
                let code = match status {
                    Ok(s) => status_code(s),
                    Err(e) => {
                        eprintln!("fencelock: cannot wait for {:?}: {e}", args.command[0]);
                        exit::FAILURE
                    }
                };
                if let Err(e) = guard.release().await {
                    eprintln!("fencelock: warning: releasing {:?} failed: {e}", args.key);
                }
                return code;
            }
            sig = signals.recv() => send(child.id(), sig),
        }
    }
}
