//! The blocking API through the conformance essentials, on the embedded
//! SQLite backend: exclusion and rising tokens across threads, and a holder
//! paused past its TTL (a child process, SIGSTOPped) that finds its lease lost.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fencelock::blocking::Locker;
use fencelock::{Hold, Mode, check_history};
use fencelock_testkit::{Signal, send_signal};

#[test]
fn threads_exclude_each_other_and_tokens_rise() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("l.db").display());
    let holds = Arc::new(Mutex::new(Vec::new()));
    let counter = Arc::new(Mutex::new(0u32));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            // A locker per thread: they contend as separate clients do.
            let locker = Locker::connect(&url).unwrap();
            let (holds, counter) = (holds.clone(), counter.clone());
            std::thread::spawn(move || {
                for _ in 0..10 {
                    let g = locker
                        .lock("shared")
                        .ttl(Duration::from_secs(30))
                        .acquire()
                        .unwrap();
                    let acquired_ns = Hold::now_ns();
                    // Read, pause, write: a lost update if two held at once.
                    let seen = *counter.lock().unwrap();
                    std::thread::sleep(Duration::from_millis(2));
                    *counter.lock().unwrap() = seen + 1;
                    let hold = Hold {
                        holder: format!("t{t}"),
                        mode: Mode::Exclusive,
                        token: g.token().map(|t| t.get()),
                        acquired_ns,
                        released_ns: Hold::now_ns(),
                    };
                    g.release().unwrap();
                    holds.lock().unwrap().push(hold);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(*counter.lock().unwrap(), 40, "an update was lost");
    let holds = holds.lock().unwrap().clone();
    check_history(&holds).expect("overlapping holds or tokens that did not rise");
}

#[test]
fn a_dropped_guard_releases_and_try_acquire_sees_it() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("l.db").display());
    let (a, b) = (
        Locker::connect(&url).unwrap(),
        Locker::connect(&url).unwrap(),
    );
    let g = a.lock("k").acquire().unwrap();
    assert!(b.lock("k").try_acquire().unwrap().is_none());
    let info = b.inspect("k").unwrap().expect("a holder");
    assert_eq!(info.holders.len(), 1);
    drop(g);
    // The drop waited for the release: free at once.
    assert!(b.lock("k").try_acquire().unwrap().is_some());
}

/// The child of `a_holder_paused_past_its_ttl_finds_its_lease_lost`.
#[test]
#[ignore = "run by a_holder_paused_past_its_ttl_finds_its_lease_lost"]
fn paused_child() {
    let Ok(url) = std::env::var("FENCELOCK_BLOCKING_CHILD") else {
        return;
    };
    let locker = Locker::connect(&url).unwrap();
    let g = locker
        .lock("paused")
        .ttl(Duration::from_secs(1))
        .acquire()
        .unwrap();
    let mut out = std::io::stdout();
    writeln!(out, "held {}", g.token().unwrap().get()).unwrap();
    out.flush().unwrap();
    match g.wait_lost_timeout(Duration::from_secs(60)) {
        Some(e) => writeln!(out, "verdict lost: {e}").unwrap(),
        None => writeln!(out, "verdict still held").unwrap(),
    }
    out.flush().unwrap();
}

#[test]
fn a_holder_paused_past_its_ttl_finds_its_lease_lost() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("l.db").display());
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "paused_child", "--ignored", "--nocapture"])
        .env("FENCELOCK_BLOCKING_CHILD", &url)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut next = |prefix: &str| loop {
        let line = lines
            .next()
            .expect("the child ended early")
            .expect("the child's output");
        if let Some(rest) = line.strip_prefix(prefix) {
            return rest.to_string();
        }
    };
    let child_token: u64 = next("held ").parse().unwrap();
    send_signal(child.id(), Signal::SIGSTOP).unwrap();
    // Paused past its TTL (its watchdog stopped with it): another takes the lock.
    let locker = Locker::connect(&url).unwrap();
    let start = Instant::now();
    let g = loop {
        if let Some(g) = locker.lock("paused").try_acquire().unwrap() {
            break g;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the paused holder's lock never expired"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        g.token().unwrap().get() > child_token,
        "the token did not rise"
    );
    send_signal(child.id(), Signal::SIGCONT).unwrap();
    let verdict = next("verdict ");
    assert!(
        verdict.starts_with("lost"),
        "the paused holder did not find its lease lost: {verdict:?}"
    );
    assert!(child.wait().unwrap().success());
    g.release().unwrap();
}
