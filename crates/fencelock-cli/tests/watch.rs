//! `fencelock status --watch` in a real terminal (tmux: the screen read with
//! capture-pane, Ctrl-C sent with send-keys), with holders that come and go.

use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_fencelock");

/// A private tmux server, killed on drop.
struct Tmux(String);

impl Tmux {
    fn run(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .args(["-L", &self.0])
            .args(args)
            .output()
            .expect("tmux (scripts/services.sh installs it)")
    }

    fn screen(&self) -> String {
        String::from_utf8_lossy(&self.run(&["capture-pane", "-p", "-t", "w"]).stdout).into_owned()
    }

    /// Waits until the screen satisfies `ok`.
    fn until(&self, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let s = self.screen();
            if ok(&s) {
                return s;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the screen never showed {what}:\n{s}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
    }
}

/// `fencelock run` holding `key` until it is killed (at the latest when the
/// test ends, passed or failed: before its file is deleted).
struct Holder(Option<Child>);

impl Holder {
    /// Ends it once (a reaped pid may be another process's by now).
    fn end(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
            let _ = c.wait();
        }
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        self.end();
    }
}

fn holder(url: &str, key: &str) -> Holder {
    Holder(Some(raw_holder(url, key)))
}

fn raw_holder(url: &str, key: &str) -> Child {
    Command::new(BIN)
        .args([
            "run",
            "--backend",
            url,
            "--ttl",
            "30s",
            "--key",
            key,
            "--",
            "sleep",
            "120",
        ])
        .spawn()
        .unwrap()
}

#[test]
fn the_live_view_follows_holders_and_ends_on_ctrl_c() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("l.db").display());
    let tmux = Tmux(format!("fencelock-watch-{}", std::process::id()));
    let cmd = format!("{BIN} status --watch --prefix orders/ --interval 300ms --backend {url}");
    let started = tmux.run(&[
        "new-session",
        "-d",
        "-s",
        "w",
        "-x",
        "120",
        "-y",
        "30",
        &cmd,
    ]);
    assert!(started.status.success(), "{started:?}");
    tmux.until("the empty table", |s| s.contains("(nothing held)"));

    let mut a = holder(&url, "orders/1");
    let mut b = holder(&url, "orders/2");
    let mut other = holder(&url, "invoices/9");
    let s = tmux.until("both holders", |s| {
        s.contains("orders/1") && s.contains("orders/2")
    });
    assert!(s.contains("2 held"), "{s}");
    assert!(
        !s.contains("invoices/9"),
        "a key outside --prefix was shown:\n{s}"
    );
    for line in s.lines().filter(|l| l.starts_with("orders/")) {
        assert!(
            line.contains("exclusive") && line.contains("s "),
            "{line:?}"
        );
        assert!(
            line.chars().count() <= 120,
            "wider than the terminal: {line:?}"
        );
    }

    // A holder ends: its row goes.
    a.end();
    tmux.until("the first holder gone", |s| {
        !s.contains("orders/1") && s.contains("orders/2") && s.contains("1 held")
    });

    let _ = tmux.run(&["send-keys", "-t", "w", "C-c"]);
    let start = Instant::now();
    while tmux.run(&["has-session", "-t", "w"]).status.success() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "Ctrl-C did not end the live view:\n{}",
            tmux.screen()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    b.end();
    other.end();
}

#[test]
fn a_zero_interval_is_bad_usage() {
    let out = Command::new(BIN)
        .args([
            "status",
            "--watch",
            "--interval",
            "0s",
            "--backend",
            "memory://",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64), "{out:?}");
}

#[test]
fn json_refreshes_are_one_object_a_line() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("l.db").display());
    let mut h = holder(&url, "jobs/a");
    let out = Command::new("timeout")
        .args([
            "-s",
            "INT",
            "3",
            BIN,
            "status",
            "--watch",
            "--json",
            "--interval",
            "200ms",
        ])
        .args(["--backend", &url])
        .output()
        .unwrap();
    h.end();
    let text = String::from_utf8_lossy(&out.stdout);
    let objects: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect();
    assert!(objects.len() >= 2, "{text}");
    // The holder may still be starting at the first refresh; the last one shows it.
    let last = objects.last().unwrap();
    assert_eq!(last["locks"][0]["key"], "jobs/a", "{last}");
    assert_eq!(
        last["locks"][0]["holders"][0]["mode"], "exclusive",
        "{last}"
    );
    assert!(
        last["locks"][0]["holders"][0]["token"].as_u64().is_some(),
        "{last}"
    );
}
