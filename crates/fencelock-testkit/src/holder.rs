//! A lock holder in a separate OS process, for the SIGKILL and SIGSTOP fault
//! tests: the test binary runs one of its own ignored tests as the holder, which
//! reports what happens to it on stdout, one line per event.

use std::io::{self, BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};

use nix::sys::signal::Signal;

use crate::server::send_signal;

/// The holder process; killed on drop.
///
/// # Examples
///
/// ```no_run
/// use fencelock_testkit::{HolderProcess, Signal};
///
/// // In the test binary: `#[test] #[ignore] fn holder_worker() { … println!("acquired {token}"); … }`
/// let mut holder = HolderProcess::spawn("holder_worker", &[("HOLD_KEY", "k")])?;
/// let token: u64 = holder.expect("acquired ")?.parse().unwrap();
/// holder.signal(Signal::SIGSTOP)?;
/// // … take the lock elsewhere, then let the holder go on:
/// holder.signal(Signal::SIGCONT)?;
/// let rest = holder.finish();
/// assert!(rest.iter().any(|l| l == "lost true"));
/// # Ok::<(), std::io::Error>(())
/// ```
pub struct HolderProcess {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl HolderProcess {
    /// Runs the ignored test `test_name` of the current test binary with `env`.
    ///
    /// # Errors
    ///
    /// If the process cannot be started.
    pub fn spawn(test_name: &str, env: &[(&str, &str)]) -> io::Result<HolderProcess> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args([
            "--ignored",
            "--exact",
            test_name,
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .stdout(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn()?;
        let out = child
            .stdout
            .take()
            .map(BufReader::new)
            .ok_or_else(|| io::Error::other("no stdout pipe"))?;
        Ok(HolderProcess { child, out })
    }

    /// Reads lines until one contains `marker`; returns what follows it. (The
    /// first line the holder prints follows the test harness's `test … ... `.)
    ///
    /// # Errors
    ///
    /// [`io::ErrorKind::UnexpectedEof`] if the holder exits first.
    pub fn expect(&mut self, marker: &str) -> io::Result<String> {
        let mut line = String::new();
        loop {
            line.clear();
            if self.out.read_line(&mut line)? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the holder exited before printing {marker:?}"),
                ));
            }
            if let Some((_, rest)) = line.trim_end().split_once(marker) {
                return Ok(rest.to_string());
            }
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` to the holder.
    ///
    /// # Errors
    ///
    /// If it has exited.
    pub fn signal(&self, signal: Signal) -> io::Result<()> {
        send_signal(self.pid(), signal)
    }

    /// Every line the holder prints until it exits.
    pub fn finish(mut self) -> Vec<String> {
        let lines = (&mut self.out)
            .lines()
            .map_while(Result::ok)
            .map(|l| l.trim_end().to_string())
            .collect();
        let _ = self.child.wait();
        lines
    }
}

impl Drop for HolderProcess {
    fn drop(&mut self) {
        let _ = send_signal(self.pid(), Signal::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
