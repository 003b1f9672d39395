//! Separate OS processes on one SQLite file: exclusion across processes (merged
//! history checked), and holders that are SIGKILLed or SIGSTOPped.
//!
//! The worker processes are this very test binary, re-executed with
//! `--ignored --exact worker` and its instructions in the environment.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fencelock_core::{Hold, Locker, Mode, check_history};
use fencelock_sqlite::SqliteBackend;
use fencelock_testkit::{Signal, send_signal};

const ROLE: &str = "FENCELOCK_XP_ROLE";
const DB: &str = "FENCELOCK_XP_DB";
const OUT: &str = "FENCELOCK_XP_OUT";
const NAME: &str = "FENCELOCK_XP_NAME";
const CYCLES: &str = "FENCELOCK_XP_CYCLES";

fn worker_command(role: &str, db: &Path) -> Command {
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new(exe);
    cmd.args([
        "--ignored",
        "--exact",
        "worker",
        "--nocapture",
        "--test-threads",
        "1",
    ])
    .env(ROLE, role)
    .env(DB, db)
    .stdin(Stdio::null());
    cmd
}

/// The entry point of worker processes; does nothing unless spawned by a test.
#[test]
#[ignore = "worker process of the cross-process tests; they start it themselves"]
fn worker() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let db = std::env::var(DB).expect("db path");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let locker = Locker::new(SqliteBackend::open(&db).await.expect("open db"));
        match role.as_str() {
            "contend" => contend(&locker).await,
            "hold" => hold(&locker).await,
            other => panic!("unknown role {other}"),
        }
    });
}

/// Four tasks, each doing CYCLES acquire / read-modify-write of a counter file /
/// release; the holds go to OUT, one per line.
async fn contend(locker: &Locker) {
    let out = std::env::var(OUT).expect("out path");
    let name = std::env::var(NAME).expect("name");
    let cycles: usize = std::env::var(CYCLES)
        .expect("cycles")
        .parse()
        .expect("number");
    let counter = Path::new(&out).with_file_name("counter");
    let mut tasks = Vec::new();
    for t in 0..4 {
        let (locker, counter, holder) = (locker.clone(), counter.clone(), format!("{name}-{t}"));
        tasks.push(tokio::spawn(async move {
            let mut lines = Vec::new();
            for _ in 0..cycles {
                let g = locker
                    .lock("xp")
                    .ttl(Duration::from_secs(5))
                    .wait(Duration::from_secs(60))
                    .acquire()
                    .await
                    .expect("acquire");
                let acquired_ns = Hold::now_ns();
                let v: u64 = std::fs::read_to_string(&counter)
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .unwrap_or(0);
                tokio::task::yield_now().await;
                std::fs::write(&counter, (v + 1).to_string()).expect("write counter");
                let released_ns = Hold::now_ns();
                assert!(g.is_valid(), "lease lost during a short hold");
                lines.push(
                    Hold {
                        holder: holder.clone(),
                        mode: Mode::Exclusive,
                        token: g.token().map(|t| t.get()),
                        acquired_ns,
                        released_ns,
                    }
                    .to_line(),
                );
                g.release().await.expect("release");
            }
            lines
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("task"));
    }
    std::fs::write(&out, all.join("\n") + "\n").expect("write history");
}

/// Takes the lock with a 600 ms TTL, prints its token, then reports on stdout
/// when the lease is lost (after a SIGSTOP/SIGCONT) and sleeps.
async fn hold(locker: &Locker) {
    let g = locker
        .lock("held")
        .ttl(Duration::from_millis(600))
        .acquire()
        .await
        .expect("acquire");
    println!("acquired {}", g.token().expect("token"));
    let lost = g.lost().await;
    println!("lost {lost}");
    tokio::time::sleep(Duration::from_secs(600)).await;
}

#[test]
fn processes_contend_on_one_file_without_overlap() {
    const PROCS: usize = 4;
    const CYCLES_PER_TASK: usize = 15;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("locks.db");
    let children: Vec<Child> = (0..PROCS)
        .map(|p| {
            worker_command("contend", &db)
                .env(OUT, dir.path().join(format!("history-{p}")))
                .env(NAME, format!("proc{p}"))
                .env(CYCLES, CYCLES_PER_TASK.to_string())
                .stdout(Stdio::null())
                .spawn()
                .expect("spawn worker")
        })
        .collect();
    for mut c in children {
        let status = c.wait().unwrap();
        assert!(status.success(), "worker failed: {status}");
    }
    let mut holds = Vec::new();
    for p in 0..PROCS {
        let text = std::fs::read_to_string(dir.path().join(format!("history-{p}"))).unwrap();
        holds.extend(
            text.lines()
                .map(|l| Hold::from_line(l).expect("history line")),
        );
    }
    let expected = PROCS * 4 * CYCLES_PER_TASK;
    assert_eq!(holds.len(), expected);
    let summary =
        check_history(&holds).unwrap_or_else(|v| panic!("cross-process history violated: {v}"));
    assert_eq!(summary.max_concurrent, 1);
    let counter: usize = std::fs::read_to_string(dir.path().join("counter"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(counter, expected, "the counter file lost updates");
    // Holds by different processes interleaved: the lock was really contended.
    assert!(
        summary.owner_switches > PROCS,
        "only {} owner switches",
        summary.owner_switches
    );
}

/// Spawns a holder and waits for its "acquired N" line. The caller reaps it.
#[allow(clippy::zombie_processes)]
fn spawn_holder(db: &Path) -> (Child, BufReader<std::process::ChildStdout>, u64) {
    let mut child = worker_command("hold", db)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        if out.read_line(&mut line).unwrap_or(0) == 0 {
            let _ = child.kill();
            let status = child.wait();
            panic!("holder exited before acquiring: {status:?}");
        }
        // The test harness may print its own text before ours on the same line.
        if let Some((_, t)) = line.trim().split_once("acquired ") {
            return (child, out, t.parse().unwrap());
        }
    }
}

#[tokio::test]
async fn sigkilled_holder_frees_the_lock_after_its_ttl() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("locks.db");
    let (mut child, _out, token) = spawn_holder(&db);
    let locker = Locker::new(SqliteBackend::open(&db).await.unwrap());
    assert!(
        locker.lock("held").try_acquire().await.unwrap().is_none(),
        "held by the worker"
    );
    child.kill().unwrap(); // SIGKILL: no release, no renewal
    child.wait().unwrap();
    let start = Instant::now();
    let g = locker
        .lock("held")
        .wait(Duration::from_secs(20))
        .acquire()
        .await
        .unwrap();
    assert!(
        start.elapsed() >= Duration::from_millis(200),
        "freed at once, not by the TTL"
    );
    assert!(
        g.token().unwrap().get() > token,
        "token did not increase after the crash"
    );
}

#[tokio::test]
async fn sigstopped_holder_loses_the_lock_and_learns_it_on_resume() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("locks.db");
    let (mut child, mut out, token) = spawn_holder(&db);
    let pid = child.id();
    send_signal(pid, Signal::SIGSTOP).unwrap();
    let locker = Locker::new(SqliteBackend::open(&db).await.unwrap());
    // The paused holder cannot renew: the lock frees after its TTL.
    let g = locker
        .lock("held")
        .wait(Duration::from_secs(20))
        .acquire()
        .await
        .unwrap();
    assert!(g.token().unwrap().get() > token);
    send_signal(pid, Signal::SIGCONT).unwrap();
    let mut line = String::new();
    let reader = std::thread::spawn(move || {
        out.read_line(&mut line).unwrap();
        line
    });
    let line = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::task::spawn_blocking(move || reader.join().unwrap()),
    )
    .await;
    let _ = child.kill();
    let line = line
        .expect("the resumed holder never reported a lost lease")
        .unwrap();
    assert!(
        line.contains("lost "),
        "the resumed holder printed {line:?}"
    );
    child.wait().unwrap();
    // The new holder kept its lock throughout.
    assert!(g.is_valid());
    g.release().await.unwrap();
}
