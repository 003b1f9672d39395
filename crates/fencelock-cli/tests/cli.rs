//! The built `fencelock` binary, driven like a user would: every subcommand and
//! every exit status of the CLI contract.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use fencelock_testkit::{Signal, send_signal};

const BIN: &str = env!("CARGO_BIN_EXE_fencelock");

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

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        c.args(args)
            .env("FENCELOCK_BACKEND", &self.url)
            .env_remove("FENCELOCK_LOG");
        c
    }

    fn output(&self, args: &[&str]) -> Output {
        self.cmd(args).output().unwrap()
    }

    fn spawn(&self, args: &[&str]) -> Child {
        self.cmd(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Waits until `path` exists and holds a line; returns it.
fn wait_file(path: &Path, limit: Duration) -> String {
    let start = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(path)
            && s.ends_with('\n')
        {
            return s.trim().to_string();
        }
        assert!(start.elapsed() < limit, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn alive(pid: i32) -> bool {
    // A zombie still has /proc/PID; look at its state.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.split_whitespace().nth(2) != Some("Z"))
        .unwrap_or(false)
}

fn wait_exit(child: &mut Child, limit: Duration) -> i32 {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s.code().unwrap_or(-1);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("fencelock did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A holder that records its token and shell pid, then sleeps.
fn holder(env: &Env, key: &str, extra: &[&str], token_file: &Path, sleep: u32) -> Child {
    let script = format!(
        "echo $FENCELOCK_TOKEN $$ > {}; sleep {sleep}",
        token_file.display()
    );
    let mut args = vec!["run", "--key", key];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", &script]);
    env.spawn(&args)
}

fn token_and_pid(line: &str) -> (u64, i32) {
    let mut parts = line.split_whitespace();
    let t = parts.next().unwrap().parse().unwrap();
    let p = parts.next().unwrap().parse().unwrap();
    (t, p)
}

#[test]
fn run_passes_token_key_and_exit_status() {
    let env = Env::new();
    let out = env.path("env");
    let script = format!(
        "echo \"$FENCELOCK_TOKEN $FENCELOCK_KEY\" > {}; exit 3",
        out.display()
    );
    let o = env.output(&["run", "--key", "jobs/nightly", "--", "sh", "-c", &script]);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    let first = std::fs::read_to_string(&out).unwrap();
    let (t1, key) = first.trim().split_once(' ').unwrap();
    assert_eq!(key, "jobs/nightly");
    let t1: u64 = t1.parse().unwrap();
    // The lock was released after CMD: the next run gets it at once with a larger token.
    let o = env.output(&[
        "run",
        "--key",
        "jobs/nightly",
        "--wait",
        "0s",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert_eq!(code(&o), 3);
    let second = std::fs::read_to_string(&out).unwrap();
    let t2: u64 = second.split_whitespace().next().unwrap().parse().unwrap();
    assert!(t2 > t1, "token {t2} after {t1}");
}

#[test]
fn busy_lock_exits_75_after_the_wait() {
    let env = Env::new();
    let tf = env.path("t");
    let mut h = holder(&env, "busy", &[], &tf, 30);
    let (_, shell) = token_and_pid(&wait_file(&tf, Duration::from_secs(20)));
    let o = env.output(&["run", "--key", "busy", "--wait", "0s", "--", "true"]);
    assert_eq!(code(&o), 75, "{}", stderr(&o));
    let start = Instant::now();
    let o = env.output(&["run", "--key", "busy", "--wait", "300ms", "--", "true"]);
    assert_eq!(code(&o), 75);
    assert!(start.elapsed() >= Duration::from_millis(300));
    assert!(stderr(&o).contains("not acquired"), "{}", stderr(&o));
    send_signal(h.id(), Signal::SIGTERM).unwrap();
    wait_exit(&mut h, Duration::from_secs(20));
    let _ = send_signal(shell as u32, Signal::SIGKILL);
}

#[test]
fn bad_usage_exits_64() {
    let env = Env::new();
    let cases: &[&[&str]] = &[
        &["run", "--key", "", "--", "true"],
        &["run", "--key", "a\nb", "--", "true"],
        &["run", "--key", "k", "--ttl", "soon", "--", "true"],
        &["run", "--key", "k", "--ttl", "0s", "--", "true"],
        &["run", "--key", "k", "--wait", "never", "--", "true"],
        &[
            "run",
            "--key",
            "k",
            "--shared",
            "--permits",
            "2",
            "--",
            "true",
        ],
        &["run", "--key", "k", "--permits", "0", "--", "true"],
        &["run", "--key", "k"],
        &["run", "--backend", "nope://x", "--key", "k", "--", "true"],
        &[
            "run",
            "--backend",
            "sqlite:///tmp/x.db?colour=red",
            "--key",
            "k",
            "--",
            "true",
        ],
        &["frobnicate"],
        &[],
        // Durations so long that deadlines overflow the clock (panicked, exit 101).
        &[
            "run",
            "--key",
            "k",
            "--ttl",
            "18446744073709551615s",
            "--",
            "true",
        ],
        &[
            "run",
            "--key",
            "k",
            "--wait",
            "18446744073709551615s",
            "--",
            "true",
        ],
        &[
            "run",
            "--key",
            "k",
            "--kill-grace",
            "18446744073709551615s",
            "--",
            "true",
        ],
    ];
    for args in cases {
        let o = env.output(args);
        assert_eq!(code(&o), 64, "{args:?}: {}", stderr(&o));
        assert!(!stderr(&o).trim().is_empty(), "{args:?} printed no message");
    }
}

#[test]
fn unreachable_backend_exits_69_naming_the_address() {
    let env = Env::new();
    let o = env.output(&[
        "run",
        "--backend",
        "sqlite:///nonexistent-dir/locks.db",
        "--key",
        "k",
        "--",
        "true",
    ]);
    assert_eq!(code(&o), 69, "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("/nonexistent-dir/locks.db"), "{e}");
    assert_eq!(e.trim().lines().count(), 1, "not one line: {e}");
}

/// A closed port of a database server: the error says the connection was
/// refused (not that a pool timed out).
#[test]
fn a_closed_database_port_is_reported_as_refused() {
    let env = Env::new();
    for url in [
        "postgres://postgres:postgres@127.0.0.1:1/test",
        "mysql://root@127.0.0.1:1/test",
    ] {
        let o = env.output(&[
            "run",
            "--backend",
            url,
            "--key",
            "k",
            "--wait",
            "2s",
            "--",
            "true",
        ]);
        assert_eq!(code(&o), 69, "{url}: {}", stderr(&o));
        let e = stderr(&o).to_lowercase();
        assert!(e.contains("refused"), "{url}: {e}");
    }
}

#[test]
fn missing_command_exits_127() {
    let env = Env::new();
    let o = env.output(&["run", "--key", "k", "--", "/nonexistent/command"]);
    assert_eq!(code(&o), 127, "{}", stderr(&o));
    // The lock was released.
    let o = env.output(&["run", "--key", "k", "--wait", "0s", "--", "true"]);
    assert_eq!(code(&o), 0);
}

#[test]
fn sigkilled_holder_is_replaced_after_the_ttl_with_a_larger_token() {
    let env = Env::new();
    let (t1, t2) = (env.path("t1"), env.path("t2"));
    let mut h = holder(&env, "crash", &["--ttl", "1s"], &t1, 60);
    let (token1, shell) = token_and_pid(&wait_file(&t1, Duration::from_secs(20)));
    send_signal(h.id(), Signal::SIGKILL).unwrap();
    h.wait().unwrap();
    let start = Instant::now();
    let script = format!("echo $FENCELOCK_TOKEN 0 > {}", t2.display());
    let o = env.output(&[
        "run", "--key", "crash", "--wait", "20s", "--", "sh", "-c", &script,
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        start.elapsed() >= Duration::from_millis(300),
        "taken at once, not after the TTL"
    );
    let (token2, _) = token_and_pid(&wait_file(&t2, Duration::from_secs(5)));
    assert!(token2 > token1, "token {token2} after {token1}");
    let _ = send_signal(shell as u32, Signal::SIGKILL);
}

#[test]
fn sigstopped_holder_kills_its_command_and_exits_76_when_resumed() {
    let env = Env::new();
    let (t1, t2, finished) = (env.path("t1"), env.path("t2"), env.path("finished"));
    let script = format!(
        "echo $FENCELOCK_TOKEN $$ > {}; sleep 8; touch {}",
        t1.display(),
        finished.display()
    );
    let mut h = env.spawn(&[
        "run",
        "--key",
        "pause",
        "--ttl",
        "1s",
        "--kill-grace",
        "1s",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let (token1, shell) = token_and_pid(&wait_file(&t1, Duration::from_secs(20)));
    send_signal(h.id(), Signal::SIGSTOP).unwrap();
    // Another process takes the lock once the paused holder's lease expires.
    let script2 = format!("echo $FENCELOCK_TOKEN 0 > {}", t2.display());
    let o = env.output(&[
        "run", "--key", "pause", "--wait", "20s", "--", "sh", "-c", &script2,
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let (token2, _) = token_and_pid(&wait_file(&t2, Duration::from_secs(5)));
    assert!(token2 > token1);
    send_signal(h.id(), Signal::SIGCONT).unwrap();
    let status = wait_exit(&mut h, Duration::from_secs(20));
    let mut err = String::new();
    std::io::Read::read_to_string(h.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert_eq!(status, 76, "{err}");
    assert!(err.contains("lost"), "{err}");
    assert!(!alive(shell), "CMD still runs after the lease was lost");
    std::thread::sleep(Duration::from_secs(1));
    assert!(!finished.exists(), "CMD finished its work without the lock");
}

#[test]
fn sigterm_reaches_the_command_and_the_lock_is_released() {
    let env = Env::new();
    let tf = env.path("t");
    let mut h = holder(&env, "term", &[], &tf, 30);
    let (_, shell) = token_and_pid(&wait_file(&tf, Duration::from_secs(20)));
    send_signal(h.id(), Signal::SIGTERM).unwrap();
    let status = wait_exit(&mut h, Duration::from_secs(20));
    assert_eq!(
        status,
        128 + 15,
        "the exit status is not the command's death by SIGTERM"
    );
    assert!(!alive(shell), "the command survived SIGTERM");
    let o = env.output(&["run", "--key", "term", "--wait", "0s", "--", "true"]);
    assert_eq!(code(&o), 0, "the lock was not released: {}", stderr(&o));
}

#[test]
fn shared_and_semaphore_modes() {
    let env = Env::new();
    let tf = env.path("t");
    let mut reader = holder(&env, "rw", &["--shared"], &tf, 30);
    let (_, shell) = token_and_pid(&wait_file(&tf, Duration::from_secs(20)));
    let o = env.output(&[
        "run", "--key", "rw", "--shared", "--wait", "0s", "--", "true",
    ]);
    assert_eq!(code(&o), 0, "a second reader was refused: {}", stderr(&o));
    let o = env.output(&["run", "--key", "rw", "--wait", "0s", "--", "true"]);
    assert_eq!(code(&o), 75, "a writer got in beside a reader");
    send_signal(reader.id(), Signal::SIGTERM).unwrap();
    wait_exit(&mut reader, Duration::from_secs(20));
    let _ = send_signal(shell as u32, Signal::SIGKILL);

    let (a, b) = (env.path("a"), env.path("b"));
    let mut p1 = holder(&env, "sem", &["--permits", "2"], &a, 30);
    let mut p2 = holder(&env, "sem", &["--permits", "2"], &b, 30);
    let (_, s1) = token_and_pid(&wait_file(&a, Duration::from_secs(20)));
    let (_, s2) = token_and_pid(&wait_file(&b, Duration::from_secs(20)));
    let o = env.output(&[
        "run",
        "--key",
        "sem",
        "--permits",
        "2",
        "--wait",
        "0s",
        "--",
        "true",
    ]);
    assert_eq!(code(&o), 75, "a third permit of two was granted");
    for (p, s) in [(&mut p1, s1), (&mut p2, s2)] {
        send_signal(p.id(), Signal::SIGTERM).unwrap();
        wait_exit(p, Duration::from_secs(20));
        let _ = send_signal(s as u32, Signal::SIGKILL);
    }
}

#[test]
fn status_and_list_show_the_holder() {
    let env = Env::new();
    let o = env.output(&["status", "orders/1"]);
    assert_eq!(code(&o), 0);
    assert!(stdout(&o).contains("free"), "{}", stdout(&o));
    let tf = env.path("t");
    let mut h = holder(&env, "orders/1", &[], &tf, 30);
    let (token, shell) = token_and_pid(&wait_file(&tf, Duration::from_secs(20)));
    let o = env.output(&["status", "orders/1"]);
    let s = stdout(&o);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(s.contains("held") && s.contains("exclusive"), "{s}");
    assert!(
        s.contains(&format!(" {token} ")),
        "token {token} missing: {s}"
    );
    let o = env.output(&["list", "--prefix", "orders/"]);
    assert!(stdout(&o).contains("orders/1"), "{}", stdout(&o));
    let o = env.output(&["list", "--prefix", "invoices/"]);
    assert!(stdout(&o).contains("no held locks"), "{}", stdout(&o));
    send_signal(h.id(), Signal::SIGTERM).unwrap();
    wait_exit(&mut h, Duration::from_secs(20));
    let _ = send_signal(shell as u32, Signal::SIGKILL);
    let o = env.output(&["status", "orders/1"]);
    assert!(
        stdout(&o).contains("free") && stdout(&o).contains(&format!("last token {token}")),
        "{}",
        stdout(&o)
    );
}

/// `fencelock status k | head -1`: a reader that stops early is no error.
#[test]
fn status_and_list_into_a_closed_pipe_end_quietly() {
    let env = Env::new();
    for args in [&["status", "orders/1"][..], &["list"][..]] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let o = env.cmd(args).stdout(writer).output().unwrap();
        assert_eq!(code(&o), 0, "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).is_empty(), "{args:?}: {}", stderr(&o));
    }
}

#[test]
fn bench_prints_json_lines_a_table_and_a_plot() {
    let env = Env::new();
    let svg = env.path("bench.svg");
    let o = env.output(&[
        "bench",
        "--backend",
        "memory://",
        "--backend",
        &env.url,
        "--scenario",
        "all",
        "--cycles",
        "200",
        "--workers",
        "4",
        "--json",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let lines: Vec<serde_json::Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 6, "two backends × three scenarios");
    let fields = [
        "system",
        "backend",
        "scenario",
        "workers",
        "ops",
        "secs",
        "ops_per_sec",
        "p50_ms",
        "p99_ms",
        "max_ms",
        "owner_switches",
        "final_counter",
        "expected_counter",
        "correct",
    ];
    for l in &lines {
        for f in fields {
            assert!(l.get(f).is_some(), "{f} missing in {l}");
        }
        assert_eq!(l["correct"], true, "{l}");
        assert_eq!(l["final_counter"], l["expected_counter"]);
        assert!(l["ops_per_sec"].as_f64().unwrap() > 0.0);
    }
    let scenarios: Vec<&str> = lines
        .iter()
        .map(|l| l["scenario"].as_str().unwrap())
        .collect();
    assert_eq!(
        scenarios,
        [
            "uncontended",
            "contended",
            "handoff",
            "uncontended",
            "contended",
            "handoff"
        ]
    );
    assert!(
        stderr(&o).contains("ops/s"),
        "the table goes to stderr with --json"
    );
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(
        plot.contains("<svg")
            && plot.lines().any(|l| l.trim() == "sqlite")
            && plot.lines().any(|l| l.trim() == "contended"),
        "not a plot of the runs"
    );
}

#[test]
fn bench_spreads_workers_over_processes_and_checks_the_merged_history() {
    let env = Env::new();
    let o = env.output(&[
        "bench",
        "--scenario",
        "contended",
        "--processes",
        "3",
        "--workers",
        "6",
        "--cycles",
        "90",
        "--json",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let line: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(line["processes"], 3, "{line}");
    assert_eq!(
        line["final_counter"], 90,
        "the counter file lost updates: {line}"
    );
    assert_eq!(line["correct"], true, "{line}");
    assert!(line["owner_switches"].as_u64().unwrap() > 3, "{line}");
}

#[test]
fn demo_sells_exactly_the_stock_and_fences_the_paused_holder() {
    let env = Env::new();
    let o = env.output(&["demo", "--processes", "8", "--stock", "20"]);
    let s = stdout(&o);
    assert_eq!(code(&o), 0, "{s}\n{}", stderr(&o));
    for needle in [
        "1  no lock",
        "2  fencelock",
        "3  paused holder",
        "rejected",
        "correct",
    ] {
        assert!(s.contains(needle), "{needle:?} missing:\n{s}");
    }
    let o = env.output(&["demo", "--backend", "memory://"]);
    assert_eq!(code(&o), 64, "the demo cannot run on a per-process backend");
}

/// On a Sentinel setup (private: the act fails it over) the demo adds act 4:
/// a grant the replicas missed, a failover, two holders, a fenced write.
#[test]
fn demo_on_sentinel_fences_the_holder_a_failover_lost() {
    let env = Env::new();
    let dir = tempfile::Builder::new()
        .prefix("fencelock-demo-sentinel-")
        .tempdir()
        .unwrap();
    let setup =
        fencelock_testkit::replicated::SentinelSetup::start(dir.path(), 2, Duration::from_secs(5))
            .expect("sentinel setup");
    let old = setup.master_port().unwrap();
    let o = env.output(&[
        "demo",
        "--backend",
        &setup.url(""),
        "--processes",
        "4",
        "--stock",
        "10",
    ]);
    let s = stdout(&o);
    assert_eq!(code(&o), 0, "{s}\n{}", stderr(&o));
    let row = s
        .lines()
        .find(|l| l.starts_with("4  failover"))
        .unwrap_or_else(|| panic!("no act 4:\n{s}"));
    assert!(row.contains("rejected") && row.contains("correct"), "{row}");
    assert!(s.contains("at its next renewal"), "{s}");
    assert_ne!(
        setup.master_port().unwrap(),
        old,
        "the act fails the service over"
    );
    // The drill let the replicas copy again.
    let new = setup.master_port().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !fencelock_testkit::replicated::redis_cli(new, &["info", "replication"])
        .is_ok_and(|i| i.contains("connected_slaves:2"))
    {
        assert!(Instant::now() < deadline, "the replicas stayed cut off");
        std::thread::sleep(Duration::from_millis(500));
    }
    // With wait_replicas the failure cannot happen: the act is skipped.
    let o = env.output(&[
        "demo",
        "--backend",
        &setup.url("?wait_replicas=1"),
        "--processes",
        "2",
        "--stock",
        "2",
    ]);
    assert_eq!(code(&o), 0, "{}\n{}", stdout(&o), stderr(&o));
    assert!(
        stdout(&o).contains("act 4 skipped: with wait_replicas"),
        "{}",
        stdout(&o)
    );
    // A master that refuses writes without its replicas cannot lose a grant:
    // the act says so and changes nothing.
    let master = setup.master_port().unwrap();
    fencelock_testkit::replicated::redis_cli(
        master,
        &["config", "set", "min-replicas-to-write", "1"],
    )
    .unwrap();
    let o = env.output(&[
        "demo",
        "--backend",
        &setup.url(""),
        "--processes",
        "2",
        "--stock",
        "2",
    ]);
    assert_eq!(code(&o), 0, "{}\n{}", stdout(&o), stderr(&o));
    assert!(
        stdout(&o).contains("min-replicas-to-write"),
        "{}",
        stdout(&o)
    );
    assert_eq!(
        setup.master_port().unwrap(),
        master,
        "no failover without a cut"
    );
}

/// A demo stopped with SIGTERM during act 4 lets the replicas copy again
/// first; one killed outright (SIGKILL) leaves a mark the next demo names.
#[test]
fn demo_stopped_during_the_failover_act_puts_the_replicas_back() {
    use fencelock_testkit::replicated::{SentinelSetup, redis_cli};
    let env = Env::new();
    let dir = tempfile::Builder::new()
        .prefix("fencelock-demo-stop-")
        .tempdir()
        .unwrap();
    let setup =
        SentinelSetup::start(dir.path(), 2, Duration::from_secs(5)).expect("sentinel setup");
    let masterauth = |port: u16| redis_cli(port, &["config", "get", "masterauth"]).unwrap();
    let url = setup.url("");
    let out = env.path("demo.out");
    let mut demo = env
        .cmd(&[
            "demo",
            "--backend",
            &url,
            "--processes",
            "3",
            "--stock",
            "200",
            "--think",
            "50ms",
        ])
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !std::fs::read_to_string(&out).is_ok_and(|s| s.contains("a holder got the lock")) {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "act 4 did not start: {}",
            std::fs::read_to_string(&out).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    send_signal(demo.id(), Signal::SIGTERM).unwrap();
    let status = demo.wait().unwrap();
    assert!(!status.success(), "a stopped demo does not pass");
    for port in setup.node_ports() {
        let auth = masterauth(port);
        assert!(
            !auth.contains("fencelock-drill-"),
            "{port} kept the drill's masterauth: {auth}"
        );
    }
    // A mark left by a drill that was killed: the next demo names the node.
    let replica = setup
        .node_ports()
        .into_iter()
        .find(|&p| p != setup.master_port().unwrap())
        .unwrap();
    redis_cli(
        replica,
        &["config", "set", "masterauth", "fencelock-drill-0"],
    )
    .unwrap();
    let o = env.output(&[
        "demo",
        "--backend",
        &url,
        "--processes",
        "2",
        "--stock",
        "2",
    ]);
    assert_eq!(code(&o), 0, "{}\n{}", stdout(&o), stderr(&o));
    assert!(
        stdout(&o).contains("killed left masterauth") && stdout(&o).contains(&replica.to_string()),
        "{}",
        stdout(&o)
    );
    redis_cli(replica, &["config", "set", "masterauth", ""]).unwrap();
}

#[test]
fn version_and_help() {
    let env = Env::new();
    let o = env.output(&["--version"]);
    assert_eq!(code(&o), 0);
    assert!(
        stdout(&o).contains("memory") && stdout(&o).contains("sqlite"),
        "{}",
        stdout(&o)
    );
    for sub in ["run", "demo", "bench", "status", "list"] {
        let o = env.output(&[sub, "--help"]);
        assert_eq!(code(&o), 0);
        assert!(
            stdout(&o).contains("Examples:"),
            "{sub} --help has no example"
        );
    }
}
