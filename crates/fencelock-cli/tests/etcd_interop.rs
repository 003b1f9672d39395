//! Interop with a client nobody here wrote: `etcdctl lock NAME -- CMD` (Debian's
//! etcd-client, Go's `concurrency.Mutex`) and `fencelock run --backend
//! 'etcd://…?prefix='` on the same NAME exclude each other, in both orders.
//! Each command appends to one log; the order of the lines is the verdict.
#![cfg(feature = "etcd")]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_fencelock");
const ENDPOINT: &str = "127.0.0.1:2379";

/// `sh -c` that logs `<who>-start <token>`, holds for a while, logs `<who>-end`.
fn script(who: &str, token_var: &str, log: &Path) -> String {
    format!(
        "echo {who}-start ${token_var} >> {log}; sleep 1.5; echo {who}-end >> {log}",
        log = log.display()
    )
}

fn etcdctl(name: &str, log: &Path) -> Child {
    Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args(["--endpoints", ENDPOINT, "lock", name, "--", "sh", "-c"])
        .arg(script("etcdctl", "ETCD_LOCK_REV", log))
        .stdout(Stdio::null())
        .spawn()
        .expect("etcdctl (Debian etcd-client; scripts/services.sh installs it)")
}

fn fencelock(name: &str, log: &Path) -> Child {
    Command::new(BIN)
        .args([
            "run",
            "--backend",
            &format!("etcd://{ENDPOINT}?prefix="),
            "--key",
            name,
            "--wait",
            "30s",
            "--",
            "sh",
            "-c",
        ])
        .arg(script("fencelock", "FENCELOCK_TOKEN", log))
        .env_remove("FENCELOCK_LOG")
        .spawn()
        .unwrap()
}

fn wait_line(log: &Path, prefix: &str) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        if std::fs::read_to_string(log).is_ok_and(|s| s.lines().any(|l| l.starts_with(prefix))) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("no {prefix:?} in {} within 30 s", log.display());
}

/// Runs `first` until it holds, then `second`; returns the log's lines.
fn both(
    first: fn(&str, &Path) -> Child,
    first_name: &str,
    second: fn(&str, &Path) -> Child,
) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let name = format!("interop-{first_name}-{}", std::process::id());
    let mut a = first(&name, &log);
    wait_line(&log, &format!("{first_name}-start"));
    let mut b = second(&name, &log);
    assert!(a.wait().unwrap().success());
    assert!(b.wait().unwrap().success());
    std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(String::from)
        .collect()
}

/// The revision in a `<who>-start <rev>` line.
fn rev(line: &str) -> u64 {
    line.split_whitespace()
        .nth(1)
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no revision in {line:?}"))
}

#[test]
fn fencelock_run_waits_for_etcdctl_lock() {
    let log = both(etcdctl, "etcdctl", fencelock);
    let kinds: Vec<&str> = log.iter().map(|l| l.split(' ').next().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "etcdctl-start",
            "etcdctl-end",
            "fencelock-start",
            "fencelock-end"
        ],
        "{log:?}"
    );
    // fencelock's token is its key's create revision, after etcdctl's.
    assert!(rev(&log[2]) > rev(&log[0]), "{log:?}");
}

#[test]
fn etcdctl_lock_waits_for_fencelock_run() {
    let log = both(fencelock, "fencelock", etcdctl);
    let kinds: Vec<&str> = log.iter().map(|l| l.split(' ').next().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "fencelock-start",
            "fencelock-end",
            "etcdctl-start",
            "etcdctl-end"
        ],
        "{log:?}"
    );
    assert!(rev(&log[2]) > rev(&log[0]), "{log:?}");
}
