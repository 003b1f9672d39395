//! `fencelock run` and CMD's process tree: a lost lease, a late renewal and
//! fencelock's own death stop every process of CMD's group; a signal reaches
//! CMD once; CMD never starts, or runs on, past the lease.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fencelock_testkit::{Signal, send_signal};

const BIN: &str = env!("CARGO_BIN_EXE_fencelock");

static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A private lock file per test.
struct Env {
    dir: tempfile::TempDir,
    url: String,
}

impl Env {
    fn new() -> Env {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("locks.db").display());
        Env { dir, url }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn db(&self) -> PathBuf {
        self.path("locks.db")
    }

    /// The command, and the file its stderr goes to (a pipe would stay open
    /// as long as any process CMD left behind lives).
    fn cmd(&self, args: &[&str]) -> Proc {
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let stderr = self.path(&format!("stderr-{n}"));
        let mut c = Command::new(BIN);
        c.args(args)
            .env("FENCELOCK_BACKEND", &self.url)
            .env_remove("FENCELOCK_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap());
        Proc { cmd: c, stderr }
    }

    /// `fencelock run --key KEY EXTRA… -- sh -c SCRIPT`.
    fn run(&self, key: &str, extra: &[&str], script: &str) -> Proc {
        let mut args = vec!["run", "--key", key];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", "sh", "-c", script]);
        self.cmd(&args)
    }
}

/// A `fencelock` command and where its stderr goes.
struct Proc {
    cmd: Command,
    stderr: PathBuf,
}

/// A running `fencelock`.
struct Running {
    child: Child,
    stderr: PathBuf,
}

impl Proc {
    fn spawn(mut self) -> Running {
        Running {
            child: self.cmd.spawn().unwrap(),
            stderr: self.stderr,
        }
    }

    /// Runs it to the end: its exit status and stderr.
    fn output(self) -> (i32, String) {
        finish(self.spawn(), Duration::from_secs(60))
    }
}

impl Running {
    fn id(&self) -> u32 {
        self.child.id()
    }
}

/// Waits until `path` holds a whole line; returns the file's text.
fn wait_file(path: &Path, limit: Duration) -> String {
    let start = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(path)
            && s.ends_with('\n')
        {
            return s;
        }
        assert!(start.elapsed() < limit, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The pids a script wrote (`echo $$ $! > file`).
fn pids(path: &Path) -> Vec<i32> {
    wait_file(path, Duration::from_secs(20))
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect()
}

fn alive(pid: i32) -> bool {
    // A zombie still has /proc/PID; look at its state.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.split_whitespace().next() != Some("Z"))
        })
        .unwrap_or(false)
}

/// Waits until none of `pids` lives, up to `limit`; the ones still alive.
fn survivors(pids: &[i32], limit: Duration) -> Vec<i32> {
    let start = Instant::now();
    loop {
        let left: Vec<i32> = pids.iter().copied().filter(|&p| alive(p)).collect();
        if left.is_empty() || start.elapsed() > limit {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn kill_all(pids: &[i32]) {
    for &p in pids {
        let _ = send_signal(p as u32, Signal::SIGKILL);
    }
}

/// Exit status and stderr of `p`, which must end within `limit`.
fn finish(mut p: Running, limit: Duration) -> (i32, String) {
    let start = Instant::now();
    let status = loop {
        if let Some(s) = p.child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > limit {
            let _ = p.child.kill();
            let _ = p.child.wait();
            panic!("fencelock did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let err = std::fs::read_to_string(&p.stderr).unwrap_or_default();
    (status.code().unwrap_or(-1), err)
}

/// A script that starts a background writer, records `$$ $!`, and waits.
fn tree_script(pids: &Path) -> String {
    format!("sleep 300 & echo $$ $! > {}; wait", pids.display())
}

#[test]
fn a_lost_lease_stops_every_process_of_the_command() {
    let env = Env::new();
    let p = env.path("pids");
    let h = env
        .run(
            "tree",
            &["--ttl", "1s", "--kill-grace", "1s"],
            &tree_script(&p),
        )
        .spawn();
    let tree = pids(&p);
    // Paused past its TTL: on resume the lease is lost.
    send_signal(h.id(), Signal::SIGSTOP).unwrap();
    std::thread::sleep(Duration::from_secs(3));
    send_signal(h.id(), Signal::SIGCONT).unwrap();
    let (status, err) = finish(h, Duration::from_secs(30));
    let left = survivors(&tree, Duration::from_secs(5));
    kill_all(&tree);
    assert_eq!(status, 76, "{err}");
    assert!(
        left.is_empty(),
        "after the lost lease these processes of CMD still run: {left:?} (tree {tree:?})"
    );
}

#[test]
fn a_killed_fencelock_takes_the_command_tree_with_it() {
    let env = Env::new();
    let p = env.path("pids");
    let mut h = env
        .run("orphan", &["--ttl", "2s"], &tree_script(&p))
        .spawn();
    let tree = pids(&p);
    send_signal(h.id(), Signal::SIGKILL).unwrap();
    h.child.wait().unwrap();
    // Dead before its lease could run out and another holder start.
    let left = survivors(&tree, Duration::from_secs(2));
    kill_all(&tree);
    assert!(
        left.is_empty(),
        "fencelock was SIGKILLed and CMD's processes {left:?} run on unlocked (tree {tree:?})"
    );
    // The lock comes free after the TTL.
    let (status, err) = env
        .cmd(&["run", "--key", "orphan", "--wait", "20s", "--", "true"])
        .output();
    assert_eq!(status, 0, "{err}");
}

#[test]
fn a_signal_to_the_whole_job_reaches_the_command_once() {
    let env = Env::new();
    let (p, log) = (env.path("pids"), env.path("log"));
    let script = format!(
        "trap 'echo INT >> {log}' INT; trap 'exit 9' TERM; echo $$ > {p}; while :; do sleep 0.05; done",
        log = log.display(),
        p = p.display()
    );
    // A shell runs fencelock as a job of its own process group, and a
    // terminal's Ctrl-C signals that whole group.
    let mut cmd = env.run("ctrl-c", &[], &script);
    std::os::unix::process::CommandExt::process_group(&mut cmd.cmd, 0);
    let h = cmd.spawn();
    let shell = pids(&p);
    let job = nix::unistd::Pid::from_raw(-(h.id() as i32));
    // fencelock is held still while the terminal's signal goes out, so what
    // it forwards cannot merge with what CMD got directly.
    send_signal(h.id(), Signal::SIGSTOP).unwrap();
    nix::sys::signal::kill(job, Signal::SIGINT).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    send_signal(h.id(), Signal::SIGCONT).unwrap();
    std::thread::sleep(Duration::from_secs(1));
    send_signal(h.id(), Signal::SIGTERM).unwrap();
    let (status, err) = finish(h, Duration::from_secs(20));
    kill_all(&shell);
    let got = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(
        got.lines().count(),
        1,
        "CMD received one Ctrl-C this many times: {got:?}"
    );
    assert_eq!(status, 9, "not CMD's status: {err}");
}

#[test]
fn sigquit_and_sighup_reach_the_command_and_the_lock_is_released() {
    for (sig, name) in [(Signal::SIGQUIT, "QUIT"), (Signal::SIGHUP, "HUP")] {
        let env = Env::new();
        let (p, log) = (env.path("pids"), env.path("log"));
        let script = format!(
            "trap 'echo {name} >> {log}; exit 5' {name}; echo $$ > {p}; while :; do sleep 0.05; done",
            log = log.display(),
            p = p.display()
        );
        let h = env.run("quit", &[], &script).spawn();
        let shell = pids(&p);
        send_signal(h.id(), sig).unwrap();
        let (status, err) = finish(h, Duration::from_secs(20));
        let left = survivors(&shell, Duration::from_secs(2));
        kill_all(&shell);
        assert!(left.is_empty(), "SIG{name} orphaned CMD: {err}");
        assert_eq!(status, 5, "SIG{name}: not CMD's status: {err}");
        let (status, err) = env
            .cmd(&["run", "--key", "quit", "--wait", "0s", "--", "true"])
            .output();
        assert_eq!(status, 0, "SIG{name}: the lock was not released: {err}");
    }
}

/// Now in ns since the epoch, as `date +%s%N` prints it.
fn epoch_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

#[test]
fn a_command_is_dead_before_its_lease_can_expire_and_the_next_grant_is_valid_on_arrival() {
    let env = Env::new();
    let (a_log, b_start, b_done) = (env.path("a.log"), env.path("b.start"), env.path("b.done"));
    // A ignores SIGTERM and writes every 50 ms while it lives.
    let a_script = format!(
        "trap '' TERM; while :; do date +%s%N >> {}; sleep 0.05; done",
        a_log.display()
    );
    let a = env
        .run("late", &["--ttl", "3s", "--kill-grace", "10s"], &a_script)
        .spawn();
    wait_file(&a_log, Duration::from_secs(20));
    // B waits for the lock with a TTL of 1 s.
    let b_script = format!(
        "date +%s%N > {}; sleep 2; touch {}",
        b_start.display(),
        b_done.display()
    );
    let b = env
        .run("late", &["--ttl", "1s", "--wait", "60s"], &b_script)
        .spawn();
    std::thread::sleep(Duration::from_millis(500));
    // Another process keeps the file's write lock for 6 s: A cannot renew,
    // and B's grant waits in `BEGIN IMMEDIATE` until the lock is let go.
    let conn = rusqlite::Connection::open(env.db()).unwrap();
    conn.execute_batch("BEGIN IMMEDIATE").unwrap();
    let blocked_at = epoch_ns();
    std::thread::sleep(Duration::from_secs(6));
    conn.execute_batch("COMMIT").unwrap();
    let (a_status, a_err) = finish(a, Duration::from_secs(30));
    let (b_status, b_err) = finish(b, Duration::from_secs(30));
    assert_eq!(a_status, 76, "A: {a_err}");
    assert_eq!(b_status, 0, "B's grant was lost on arrival: {b_err}");
    assert!(b_done.exists(), "B's command did not finish");
    let b_started: u128 = wait_file(&b_start, Duration::from_secs(5))
        .trim()
        .parse()
        .unwrap();
    assert!(
        b_started > blocked_at,
        "B started while the file was locked"
    );
    let a_last: u128 = std::fs::read_to_string(&a_log)
        .unwrap()
        .lines()
        .filter_map(|l| l.parse().ok())
        .max()
        .unwrap();
    assert!(
        a_last < b_started,
        "A's command wrote {:.2} s after B's command started",
        (a_last - b_started) as f64 / 1e9
    );
    assert!(
        a_err.contains("warning") && a_err.contains("kill-grace"),
        "no warning for a grace longer than the TTL: {a_err}"
    );
}

/// A tmux server of its own, killed when dropped.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn start(shell_dir: &Path) -> Tmux {
        let t = Tmux {
            socket: format!("fencelock-test-{}", std::process::id()),
        };
        let ok = t
            .cmd(&["new-session", "-d", "-s", "t", "-x", "150", "-y", "40"])
            .args(["-c", &shell_dir.display().to_string()])
            .args(["bash", "--norc", "--noprofile"])
            .status()
            .unwrap()
            .success();
        assert!(ok, "tmux did not start");
        t
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new("tmux");
        c.args(["-L", &self.socket]).args(args);
        c
    }

    fn send(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "t"];
        args.extend_from_slice(keys);
        assert!(self.cmd(&args).status().unwrap().success());
    }

    fn pane(&self) -> String {
        let o = self
            .cmd(&["capture-pane", "-p", "-t", "t"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    fn wait_pane(&self, what: &str) {
        let start = Instant::now();
        while !self.pane().contains(what) {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "{what:?} never showed in the terminal:\n{}",
                self.pane()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd(&["kill-server"]).status();
    }
}

#[test]
fn in_a_terminal_the_command_reads_it_ctrl_c_reaches_it_once_and_ctrl_z_stops_the_job() {
    let env = Env::new();
    let script = "trap 'echo INT >> log' INT; trap 'exit 7' QUIT; echo ready > ready; \
                  read a; echo \"$a\" > got1; read b; echo \"$b\" > got2; \
                  while :; do sleep 0.1; done";
    std::fs::write(env.path("cmd.sh"), script).unwrap();
    let run = |key: &str| {
        format!(
            "FENCELOCK_BACKEND={} {BIN} run --key {key} -- sh cmd.sh",
            env.url
        )
    };
    let tmux = Tmux::start(&env.path(""));
    tmux.send(&[&run("tty"), "Enter"]);
    wait_file(&env.path("ready"), Duration::from_secs(20));
    // CMD reads the terminal (it has the foreground).
    tmux.send(&["hello", "Enter"]);
    assert_eq!(
        wait_file(&env.path("got1"), Duration::from_secs(20)).trim(),
        "hello"
    );
    // Ctrl-Z stops the job, as the shell sees it; `fg` resumes CMD.
    tmux.send(&["C-z"]);
    tmux.wait_pane("Stopped");
    tmux.send(&["fg", "Enter"]);
    std::thread::sleep(Duration::from_millis(500));
    tmux.send(&["again", "Enter"]);
    assert_eq!(
        wait_file(&env.path("got2"), Duration::from_secs(20)).trim(),
        "again"
    );
    // One Ctrl-C, one SIGINT for CMD.
    tmux.send(&["C-c"]);
    wait_file(&env.path("log"), Duration::from_secs(20));
    std::thread::sleep(Duration::from_secs(1));
    let ints = std::fs::read_to_string(env.path("log")).unwrap();
    assert_eq!(
        ints.lines().count(),
        1,
        "one Ctrl-C reached CMD as {ints:?}"
    );
    // Ctrl-\ ends CMD (its QUIT trap exits 7); the lock is free after.
    tmux.send(&["C-\\"]);
    tmux.send(&[
        &format!(
            "{BIN} run --backend {} --key tty --wait 0s -- true; echo free=$?",
            env.url
        ),
        "Enter",
    ]);
    tmux.wait_pane("free=0");
    // fencelock exits with CMD's status.
    for f in ["ready", "got1", "got2"] {
        std::fs::remove_file(env.path(f)).unwrap();
    }
    tmux.send(&[
        &format!("{}; echo status=$? > status", run("tty2")),
        "Enter",
    ]);
    wait_file(&env.path("ready"), Duration::from_secs(20));
    tmux.send(&["C-\\"]);
    assert_eq!(
        wait_file(&env.path("status"), Duration::from_secs(20)).trim(),
        "status=7",
        "{}",
        tmux.pane()
    );
}

/// A process whose main thread called pthread_exit shows as a zombie while
/// its other threads run on: it is still alive, and must be killed before
/// the lock goes.
#[test]
fn a_grandchild_with_a_zombie_main_thread_is_not_taken_for_dead() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("writes");
    let script = format!(
        "import ctypes, threading, time\n\
         def w():\n    \
             while True:\n        \
                 open({out:?}, 'a').write('x\\n'); time.sleep(0.05)\n\
         threading.Thread(target=w).start()\n\
         time.sleep(0.2)\n\
         ctypes.CDLL(None).pthread_exit(None)\n",
        out = out.display().to_string()
    );
    let url = format!("sqlite://{}", dir.path().join("l.db").display());
    let status = Command::new(env!("CARGO_BIN_EXE_fencelock"))
        .args(["run", "--backend", &url, "--key", "k", "--ttl", "3s", "--"])
        .args(["sh", "-c", "python3 -c \"$0\" & sleep 1; exit 0", &script])
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    let size = || std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
    let before = size();
    assert!(before > 0, "the grandchild never wrote");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        size(),
        before,
        "the grandchild wrote on after fencelock released the lock"
    );
}
