//! `fencelock run` against a server that freezes (SIGSTOP: a stuck VM, a
//! full disk) while it holds or waits: it still ends, by its `--wait`, and
//! after CMD ends, with CMD's status.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fencelock_testkit::{ServerProcess, free_port};

const BIN: &str = env!("CARGO_BIN_EXE_fencelock");

fn memcached(port: u16) -> ServerProcess {
    let mut cmd = Command::new("memcached");
    cmd.args([
        "-l",
        "127.0.0.1",
        "-p",
        &port.to_string(),
        "-U",
        "0",
        "-m",
        "16",
        "-u",
        "memcache",
    ]);
    ServerProcess::spawn("memcached", cmd, port, Duration::from_secs(10)).expect("memcached starts")
}

/// Runs `fencelock args`; its status and stderr, or a failure if it has not
/// ended within `limit` (then it is killed).
fn run(args: &[&str], limit: Duration) -> (i32, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .env_remove("FENCELOCK_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "fencelock {args:?} still ran after {limit:?} against a frozen server; stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn run_ends_with_cmds_status_when_the_server_froze_under_it_and_a_waiter_by_its_wait() {
    let port = free_port();
    let server = memcached(port);
    let url = format!("memcached://127.0.0.1:{port}");
    let pid = server.pid().unwrap();
    // CMD freezes the server, then exits 3: the release gets no answer.
    let script = format!("kill -STOP {pid}; exit 3");
    let (code, stderr) = run(
        &[
            "run",
            "--backend",
            &url,
            "--key",
            "k",
            "--",
            "sh",
            "-c",
            &script,
        ],
        Duration::from_secs(60),
    );
    assert_eq!(code, 3, "CMD's status; stderr {stderr:?}");
    assert!(
        stderr.contains("releasing"),
        "a warning says the release failed: {stderr:?}"
    );
    // A waiter against the frozen server ends by its wait (plus a request's
    // timeout): not acquired, or the backend did not answer.
    let (code, stderr) = run(
        &[
            "run",
            "--backend",
            &url,
            "--key",
            "k",
            "--wait",
            "3s",
            "--",
            "true",
        ],
        Duration::from_secs(60),
    );
    assert!(code == 69 || code == 75, "exit {code}; stderr {stderr:?}");
    server.resume().unwrap();
}
