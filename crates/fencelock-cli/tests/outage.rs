//! `fencelock run` started while the server is down (maintenance, a restart):
//! it waits for the server within `--wait`, says so once on stderr, and a
//! signal still ends it.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fencelock_testkit::{ServerProcess, Signal, free_port, send_signal};

const BIN: &str = env!("CARGO_BIN_EXE_fencelock");

fn redis(port: u16) -> ServerProcess {
    let mut cmd = Command::new("redis-server");
    cmd.args([
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ])
    .stdout(Stdio::null());
    ServerProcess::spawn("redis-server", cmd, port, Duration::from_secs(10))
        .expect("redis-server starts")
}

fn fencelock(args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(args)
        .env_remove("FENCELOCK_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

#[test]
fn run_started_during_an_outage_waits_for_the_server_within_its_wait() {
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let dir = tempfile::tempdir().unwrap();
    let ran = dir.path().join("ran");
    let script = format!("echo $FENCELOCK_TOKEN > {}", ran.display());
    let child = fencelock(&[
        "run",
        "--backend",
        &url,
        "--key",
        "k",
        "--wait",
        "60s",
        "--",
        "sh",
        "-c",
        &script,
    ])
    .spawn()
    .unwrap();
    // The server comes up a few seconds later.
    std::thread::sleep(Duration::from_secs(3));
    let _server = redis(port);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
    assert!(ran.exists(), "CMD did not run");
    // One line says why it waited.
    assert_eq!(stderr.lines().count(), 1, "stderr: {stderr}");
    assert!(stderr.contains("asking again"), "stderr: {stderr}");
}

/// The wait covers the connect; when it ends, the message names the wait the
/// user gave, not what the connect left of it.
#[test]
fn a_wait_spent_partly_on_the_connect_is_reported_whole() {
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let server = redis(port);
    let holder = fencelock(&["run", "--backend", &url, "--key", "k", "--", "sleep", "60"])
        .spawn()
        .unwrap();
    let status = fencelock(&["status", "--backend", &url, "k", "--json"]);
    let held = || {
        let mut c = Command::new(status.get_program());
        c.args(status.get_args());
        c.output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("\"token\""))
    };
    let start = Instant::now();
    while !held() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the holder never held"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The server stalls for a few seconds of the waiter's connect.
    server.pause().unwrap();
    let child = fencelock(&[
        "run",
        "--backend",
        &url,
        "--key",
        "k",
        "--wait",
        "8s",
        "--",
        "true",
    ])
    .spawn()
    .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    server.resume().unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "stderr: {stderr}");
    assert!(
        stderr.contains("not acquired within 8s;"),
        "stderr: {stderr}"
    );
    send_signal(holder.id(), Signal::SIGTERM).unwrap();
    holder.wait_with_output().unwrap();
}

#[test]
fn run_waiting_for_a_server_that_is_down_ends_by_its_wait_or_a_signal() {
    let url = format!("redis://127.0.0.1:{}", free_port());
    let start = Instant::now();
    let out = fencelock(&[
        "run",
        "--backend",
        &url,
        "--key",
        "k",
        "--wait",
        "3s",
        "--",
        "true",
    ])
    .output()
    .unwrap();
    let took = start.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "stderr: {stderr}");
    assert!(
        stderr.to_lowercase().contains("refused"),
        "stderr: {stderr}"
    );
    assert!(
        took >= Duration::from_secs(3) && took < Duration::from_secs(20),
        "ended after {took:?}, not by its 3 s wait"
    );
    // Without a deadline it waits on; SIGTERM ends it.
    let child = fencelock(&["run", "--backend", &url, "--key", "k", "--", "true"])
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    send_signal(child.id(), Signal::SIGTERM).unwrap();
    let start = Instant::now();
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(128 + 15),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "SIGTERM was not honoured"
    );
}

/// A server that caps the TTL (ZooKeeper's `maxSessionTimeout=4000`): `run
/// --ttl 30s` runs on the TTL the server granted, renews on it, and a job
/// that outlives that TTL several times runs to its end, with nothing on
/// stderr.
#[test]
fn run_holds_on_a_ttl_the_server_caps_for_a_long_job() {
    let dir = tempfile::tempdir().unwrap();
    let zk = fencelock_testkit::zookeeper(&dir.path().join("zk"), "maxSessionTimeout=4000")
        .expect("zookeeper starts (scripts/services.sh installs it)");
    let url = format!("zk://127.0.0.1:{}", zk.port());
    let done = dir.path().join("done");
    let script = format!("sleep 12; echo $FENCELOCK_TOKEN > {}", done.display());
    // A JVM just started may take a while to take sessions: --wait covers it.
    let out = fencelock(&[
        "run",
        "--backend",
        &url,
        "--key",
        "k",
        "--ttl",
        "30s",
        "--wait",
        "60s",
        "--",
        "sh",
        "-c",
        &script,
    ])
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
    assert!(done.exists(), "the job did not run to its end");
    assert!(stderr.is_empty(), "stderr: {stderr}");
}

/// Another process keeps the SQLite file's write lock (a process stopped
/// inside its transaction): `run --wait` ends by its wait with "not
/// acquired" (75), and stderr tells the real cause.
#[test]
fn a_sqlite_file_kept_busy_ends_the_wait_in_time_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("locks.db");
    let url = format!("sqlite://{}", db.display());
    let out = fencelock(&["run", "--backend", &url, "--key", "k", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    // Python's sqlite3 holds a write transaction open, as a stopped process would.
    let mut holder = Command::new("python3")
        .args([
            "-c",
            "import sqlite3, sys, time\nc = sqlite3.connect(sys.argv[1], isolation_level=None)\nc.execute('BEGIN IMMEDIATE')\nprint('in', flush=True)\ntime.sleep(60)",
        ])
        .arg(&db)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(holder.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "in");
    let start = Instant::now();
    let out = fencelock(&[
        "run",
        "--backend",
        &url,
        "--key",
        "k",
        "--wait",
        "3s",
        "--",
        "true",
    ])
    .output()
    .unwrap();
    let took = start.elapsed();
    let _ = holder.kill();
    let _ = holder.wait();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "stderr: {stderr}");
    assert!(
        stderr.contains("kept the lock file busy"),
        "stderr: {stderr}"
    );
    assert!(took < Duration::from_secs(15), "ended after {took:?}");
}

/// Maintenance: the only server restarts (down a few seconds) under a job
/// run with the defaults (no `--ttl`). The hold's session or lease outlives
/// the outage, and so does the job: exit 0, the job complete.
fn a_job_with_the_defaults_outlives_a_restart(url: &str, restart: impl FnOnce()) {
    let dir = tempfile::tempdir().unwrap();
    let (started, done) = (dir.path().join("started"), dir.path().join("done"));
    let script = format!(
        "touch {}; sleep 25; touch {}",
        started.display(),
        done.display()
    );
    // A server just started may take a while to answer: --wait covers it.
    let child = fencelock(&[
        "run",
        "--backend",
        url,
        "--key",
        "k",
        "--wait",
        "60s",
        "--",
        "sh",
        "-c",
        &script,
    ])
    .spawn()
    .unwrap();
    let start = Instant::now();
    while !started.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the job did not start"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(3));
    let down = Instant::now();
    restart();
    let outage = down.elapsed();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(0),
        "the server was down {outage:?}; stderr: {stderr}"
    );
    assert!(done.exists(), "the job did not run to its end");
}

fn etcd_on(data: &std::path::Path, client: u16, peer: u16) -> ServerProcess {
    let mut cmd = Command::new("etcd");
    cmd.arg("--data-dir")
        .arg(data)
        .arg("--listen-client-urls")
        .arg(format!("http://127.0.0.1:{client}"))
        .arg("--advertise-client-urls")
        .arg(format!("http://127.0.0.1:{client}"))
        .arg("--listen-peer-urls")
        .arg(format!("http://127.0.0.1:{peer}"))
        .arg("--initial-advertise-peer-urls")
        .arg(format!("http://127.0.0.1:{peer}"))
        .arg("--initial-cluster")
        .arg(format!("default=http://127.0.0.1:{peer}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    ServerProcess::spawn("etcd", cmd, client, Duration::from_secs(30))
        .expect("etcd (scripts/services.sh installs it)")
}

#[test]
fn a_job_with_the_defaults_outlives_a_restart_of_etcd() {
    let dir = tempfile::tempdir().unwrap();
    let (client, peer) = (free_port(), free_port());
    let mut etcd = etcd_on(dir.path(), client, peer);
    let url = format!("etcd://127.0.0.1:{client}");
    a_job_with_the_defaults_outlives_a_restart(&url, || {
        etcd.kill();
        std::thread::sleep(Duration::from_secs(5));
        etcd = etcd_on(dir.path(), client, peer);
    });
}

#[test]
fn a_job_with_the_defaults_outlives_a_restart_of_zookeeper() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    // The production default allows sessions up to 40 s (20 ticks of 2 s);
    // the test server ticks every 500 ms.
    let cfg = "maxSessionTimeout=40000";
    let mut zk = fencelock_testkit::zookeeper_on(dir.path(), port, cfg)
        .expect("zookeeper starts (scripts/services.sh installs it)");
    let url = format!("zk://127.0.0.1:{port}");
    a_job_with_the_defaults_outlives_a_restart(&url, || {
        zk.kill();
        std::thread::sleep(Duration::from_secs(3));
        zk = fencelock_testkit::zookeeper_on(dir.path(), port, cfg).expect("zookeeper restarts");
    });
}
