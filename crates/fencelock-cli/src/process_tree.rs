//! CMD's process tree for `fencelock run`: CMD runs in a process group of its
//! own, every signal and every stop goes to that whole group, and the group
//! dies with fencelock.
//!
//! - CMD leads a new process group, so what it starts (unless it leaves the
//!   group: `setsid`, a daemon) is stopped with it. When fencelock's group owns
//!   the terminal, the terminal goes to CMD's group while it runs: Ctrl-C and
//!   Ctrl-Z reach CMD's processes once, from the terminal, and CMD can read the
//!   terminal. When CMD is stopped from the terminal, fencelock stops too, so
//!   the shell's job control works (`fg` resumes both).
//! - If fencelock dies (even by SIGKILL), CMD gets SIGKILL from the kernel
//!   (Linux: `PR_SET_PDEATHSIG`, checked against the race with the parent's
//!   death), and a small reaper process (`fencelock __reap`, in a group of its
//!   own, holding the read end of a pipe only fencelock writes to) sees the
//!   pipe close and SIGKILLs the rest of CMD's group. On other systems the
//!   reaper alone does it.
//! - CMD is not reaped before the rest of its group is dealt with, so its
//!   process id — the group's id — cannot be reused meanwhile.

use std::io::{Read, Write};
use std::os::fd::BorrowedFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use nix::sys::signal::{SigHandler, SigSet, SigmaskHow, Signal, kill, pthread_sigmask};
use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
use nix::unistd::{Pid, getpgrp, getpid, tcgetpgrp, tcsetpgrp};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// What happened to CMD.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// CMD was stopped (SIGTSTP, SIGTTIN, SIGSTOP).
    Stopped,
    /// CMD exited (not yet reaped).
    Exited,
}

/// CMD, its process group, its reaper and the terminal.
pub(crate) struct Tree {
    pgid: Pid,
    events: mpsc::UnboundedReceiver<Event>,
    /// Tells the thread that spawned CMD to reap it; the answer comes back.
    reap: Option<std::sync::mpsc::Sender<()>>,
    status: Option<tokio::sync::oneshot::Receiver<std::io::Result<ExitStatus>>>,
    reaper: Option<(Child, std::io::PipeWriter)>,
    terminal: Option<Terminal>,
}

/// The controlling terminal, when fencelock's group is in its foreground.
struct Terminal {
    own: Pid,
}

fn stdin() -> BorrowedFd<'static> {
    // SAFETY: fd 0 stays open for the life of the process.
    unsafe { BorrowedFd::borrow_raw(0) }
}

impl Terminal {
    fn detect() -> Option<Terminal> {
        let own = getpgrp();
        (tcgetpgrp(stdin()).ok()? == own).then_some(Terminal { own })
    }

    /// Makes `pgrp` the terminal's foreground group (fencelock may be in the
    /// background meanwhile: SIGTTOU is blocked on this thread for the call).
    fn hand_to(&self, pgrp: Pid) {
        let mut ttou = SigSet::empty();
        ttou.add(Signal::SIGTTOU);
        let mut old = SigSet::empty();
        if pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&ttou), Some(&mut old)).is_ok() {
            let _ = tcsetpgrp(stdin(), pgrp);
            let _ = pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&old), None);
        }
    }

    fn take_back(&self) {
        self.hand_to(self.own);
    }
}

/// Makes fencelock ignore SIGTTOU for good: once CMD has the terminal,
/// fencelock is in the background, and with `stty tostop` its first message
/// (a late renewal, a lost lease) would stop it before it could stop CMD.
pub(crate) fn ignore_terminal_output_stops() {
    // SAFETY: ignoring a signal installs no handler.
    let _ = unsafe { nix::sys::signal::signal(Signal::SIGTTOU, SigHandler::SigIgn) };
}

impl Tree {
    /// Starts `command[0]` with `command[1..]` and `env` in a process group
    /// of its own, and its reaper.
    ///
    /// # Errors
    ///
    /// CMD could not be started (the caller maps `NotFound` to 127).
    pub(crate) fn spawn(command: &[String], env: &[(&str, String)]) -> std::io::Result<Tree> {
        let terminal = Terminal::detect();
        let foreground = terminal.is_some();
        let (events_tx, events) = mpsc::unbounded_channel();
        let (reap_tx, reap_rx) = std::sync::mpsc::channel::<()>();
        let (status_tx, status) = tokio::sync::oneshot::channel();
        let (spawned_tx, spawned_rx) = std::sync::mpsc::channel();
        let mut cmd = Command::new(&command[0]);
        cmd.args(&command[1..]);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let parent = getpid();
        // SAFETY: only async-signal-safe calls (setpgid, sigprocmask, tcsetpgrp,
        // sigaction, prctl, getppid) run between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                nix::unistd::setpgid(Pid::from_raw(0), Pid::from_raw(0))?;
                if foreground {
                    let mut ttou = SigSet::empty();
                    ttou.add(Signal::SIGTTOU);
                    let mut old = SigSet::empty();
                    nix::sys::signal::sigprocmask(
                        SigmaskHow::SIG_BLOCK,
                        Some(&ttou),
                        Some(&mut old),
                    )?;
                    let _ = tcsetpgrp(stdin(), getpid());
                    nix::sys::signal::sigprocmask(SigmaskHow::SIG_SETMASK, Some(&old), None)?;
                }
                // fencelock ignores SIGTTOU (see `ignore_terminal_output_stops`); CMD must not.
                nix::sys::signal::signal(Signal::SIGTTOU, SigHandler::SigDfl)?;
                #[cfg(target_os = "linux")]
                {
                    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
                    // fencelock died before the line above: do not run at all.
                    if nix::unistd::getppid() != parent {
                        return Err(std::io::Error::other("fencelock exited"));
                    }
                }
                #[cfg(not(target_os = "linux"))]
                let _ = parent;
                Ok(())
            });
        }
        // The parent-death signal follows the thread that forked, so CMD is
        // spawned — and waited for, and reaped — by a thread that lives as
        // long as CMD does.
        std::thread::Builder::new()
            .name("fencelock-cmd".into())
            .spawn(move || {
                let mut child = match cmd.spawn() {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = spawned_tx.send(Err(e));
                        return;
                    }
                };
                let pid = Pid::from_raw(child.id() as i32);
                let _ = spawned_tx.send(Ok(pid));
                watch_child(pid, &events_tx);
                // Reap only when told: the group is dealt with first.
                let _ = reap_rx.recv();
                let _ = status_tx.send(child.wait());
            })?;
        let pgid = spawned_rx
            .recv()
            .map_err(|_| std::io::Error::other("the thread that starts CMD died"))??;
        let reaper = spawn_reaper(pgid)
            .inspect_err(|e| {
                eprintln!(
                    "fencelock: warning: no reaper for CMD's process group ({e}); if fencelock dies, processes CMD started may live on"
                )
            })
            .ok();
        Ok(Tree {
            pgid,
            events,
            reap: Some(reap_tx),
            status: Some(status),
            reaper,
            terminal,
        })
    }

    /// The next thing that happens to CMD.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe (an mpsc receive).
    pub(crate) async fn event(&mut self) -> Event {
        self.events.recv().await.unwrap_or(Event::Exited)
    }

    /// Sends `sig` to CMD's whole group.
    pub(crate) fn signal(&self, sig: Signal) {
        let _ = kill(Pid::from_raw(-self.pgid.as_raw()), sig);
    }

    /// CMD was stopped: with the terminal, stop fencelock too (the shell sees
    /// the job stopped), and on resuming give CMD the terminal back and
    /// continue its group.
    pub(crate) fn stopped(&self) {
        let Some(t) = &self.terminal else { return };
        t.take_back();
        let _ = kill(getpid(), Signal::SIGSTOP);
        // Resumed (`fg` or `bg`): the terminal is CMD's only if it is ours.
        if tcgetpgrp(stdin()).ok() == Some(t.own) {
            t.hand_to(self.pgid);
        }
        self.signal(Signal::SIGCONT);
    }

    /// Whether a process of CMD's group other than a zombie lives.
    fn group_alive(&self) -> bool {
        group_alive(self.pgid)
    }

    /// Stops the group: SIGTERM now, SIGKILL once it has not ended by
    /// `kill_at`; then waits (bounded) for CMD to exit. Call it after an
    /// [`Event::Exited`] too, for what CMD left behind.
    pub(crate) async fn stop(&mut self, exited: bool, kill_at: Instant) {
        if exited && !self.group_alive() {
            // A scan of /proc can miss a process that forks and exits in a
            // loop; a signal to the group cannot.
            self.signal(Signal::SIGKILL);
            self.wait_group_gone().await;
            return;
        }
        self.signal(Signal::SIGTERM);
        // Stopped processes would not see the TERM until continued.
        self.signal(Signal::SIGCONT);
        let mut exited = exited;
        loop {
            if exited && !self.group_alive() {
                return;
            }
            if Instant::now() >= kill_at {
                break;
            }
            tokio::select! {
                ev = self.events.recv(), if !exited => {
                    exited = matches!(ev, Some(Event::Exited) | None);
                }
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
        self.kill(exited).await;
    }

    /// SIGKILLs the group now and waits (bounded) for CMD to exit and for
    /// the rest of the group to be gone.
    pub(crate) async fn kill(&mut self, exited: bool) {
        self.signal(Signal::SIGKILL);
        if !exited {
            let _ = tokio::time::timeout(Duration::from_secs(10), async {
                while let Some(ev) = self.events.recv().await {
                    if ev == Event::Exited {
                        break;
                    }
                }
            })
            .await;
        }
        self.wait_group_gone().await;
    }

    /// Waits (at most 10 s) until no live process is left in the group,
    /// SIGKILLing it again meanwhile.
    async fn wait_group_gone(&self) {
        let give_up = Instant::now() + Duration::from_secs(10);
        while self.group_alive() && Instant::now() < give_up {
            tokio::time::sleep(Duration::from_millis(10)).await;
            self.signal(Signal::SIGKILL);
        }
    }

    /// Reaps CMD (after its group was dealt with), dismisses the reaper and
    /// takes the terminal back; CMD's exit status.
    pub(crate) async fn finish(mut self) -> std::io::Result<ExitStatus> {
        if let Some(reap) = self.reap.take() {
            let _ = reap.send(());
        }
        let status = match self.status.take() {
            Some(rx) => rx
                .await
                .unwrap_or_else(|_| Err(std::io::Error::other("CMD's thread ended"))),
            None => Err(std::io::Error::other("CMD was already reaped")),
        };
        self.dismiss();
        status
    }

    fn dismiss(&mut self) {
        if let Some((mut child, mut pipe)) = self.reaper.take() {
            let _ = pipe.write_all(b"x");
            drop(pipe);
            let _ = child.wait();
        }
        if let Some(t) = self.terminal.take() {
            t.take_back();
        }
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        // Not finished (fencelock is returning early): the group must not
        // outlive it. The reaper would do this when the pipe closes.
        if self.reap.is_some() {
            self.signal(Signal::SIGKILL);
            if let Some(reap) = self.reap.take() {
                let _ = reap.send(());
            }
        }
        self.dismiss();
    }
}

/// Reports CMD's stops and its exit (without reaping it).
fn watch_child(pid: Pid, events: &mpsc::UnboundedSender<Event>) {
    loop {
        let flags = WaitPidFlag::WEXITED | WaitPidFlag::WSTOPPED | WaitPidFlag::WNOWAIT;
        match waitid(Id::Pid(pid), flags) {
            Ok(WaitStatus::Stopped(..)) => {
                // Take the stop off the record (not the exit: WEXITED unset).
                let _ = waitid(Id::Pid(pid), WaitPidFlag::WSTOPPED | WaitPidFlag::WNOHANG);
                let _ = events.send(Event::Stopped);
            }
            Ok(WaitStatus::Exited(..) | WaitStatus::Signaled(..)) | Err(nix::Error::ECHILD) => {
                let _ = events.send(Event::Exited);
                return;
            }
            Ok(_) | Err(nix::Error::EINTR) => {}
            Err(_) => {
                let _ = events.send(Event::Exited);
                return;
            }
        }
    }
}

/// Starts `fencelock __reap <pgid>` in a group of its own, reading a pipe
/// only this process writes to.
fn spawn_reaper(pgid: Pid) -> std::io::Result<(Child, std::io::PipeWriter)> {
    let (reader, writer) = std::io::pipe()?;
    // The running program itself, even if its file was replaced since (an
    // upgrade while `run` waited): Linux keeps it reachable there.
    let exe = if cfg!(target_os = "linux") {
        std::path::PathBuf::from("/proc/self/exe")
    } else {
        std::env::current_exe()?
    };
    let child = Command::new(exe)
        .arg("__reap")
        .arg(pgid.as_raw().to_string())
        .stdin(Stdio::from(reader))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()?;
    Ok((child, writer))
}

/// The body of `fencelock __reap PGID`: waits until fencelock writes `x`
/// (dismissed) or the pipe closes (fencelock died), then SIGKILLs the group.
pub(crate) fn reap(pgid: i32) -> u8 {
    for s in [
        Signal::SIGINT,
        Signal::SIGQUIT,
        Signal::SIGTERM,
        Signal::SIGHUP,
        Signal::SIGTSTP,
        Signal::SIGTTIN,
        Signal::SIGTTOU,
        Signal::SIGPIPE,
    ] {
        // SAFETY: ignoring a signal installs no handler.
        let _ = unsafe { nix::sys::signal::signal(s, SigHandler::SigIgn) };
    }
    let mut byte = [0u8; 1];
    let dismissed = loop {
        match std::io::stdin().read(&mut byte) {
            Ok(1) => break byte[0] == b'x',
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            _ => break false,
        }
    };
    if !dismissed && pgid > 1 {
        let _ = kill(Pid::from_raw(-pgid), Signal::SIGKILL);
    }
    0
}

/// Whether a live (not zombie) process is in group `pgid`. Linux: from
/// `/proc`; elsewhere, whether the group exists at all.
fn group_alive(pgid: Pid) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return kill(Pid::from_raw(-pgid.as_raw()), None).is_ok();
    };
    for entry in dir.flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid pgrp …; comm may hold spaces and parentheses.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next();
        let pgrp = fields.nth(1).and_then(|p| p.parse::<i32>().ok());
        if pgrp != Some(pgid.as_raw()) {
            continue;
        }
        // A zombie is gone unless other threads of it still run (its main
        // thread called pthread_exit).
        if !matches!(state, Some("Z" | "X")) || has_live_thread(&entry.path()) {
            return true;
        }
    }
    false
}

/// Whether a thread of process `/proc/PID` is not a zombie.
fn has_live_thread(proc_dir: &std::path::Path) -> bool {
    let Ok(tasks) = std::fs::read_dir(proc_dir.join("task")) else {
        return false;
    };
    tasks.flatten().any(|t| {
        std::fs::read_to_string(t.path().join("stat")).is_ok_and(|stat| {
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().next());
            !matches!(state, Some("Z" | "X"))
        })
    })
}
