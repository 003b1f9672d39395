//! Interop with a client nobody here wrote: kazurator (PyPI), a Python port of
//! Curator's recipes, on the same ZooKeeper paths as fencelock.
//!
//! scripts/services.sh installs kazurator into a venv; its python is
//! `$FENCELOCK_KAZURATOR_PYTHON` or /tmp/fencelock-services/pyenv/bin/python.

use std::process::Stdio;
use std::time::Duration;

use fencelock_core::Locker;
use fencelock_zookeeper::ZooKeeperBackend;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

const HOSTS: &str = "127.0.0.1:2181";

fn python() -> String {
    std::env::var("FENCELOCK_KAZURATOR_PYTHON")
        .unwrap_or_else(|_| "/tmp/fencelock-services/pyenv/bin/python".into())
}

/// A kazurator lock in a Python process.
struct Kazurator {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Kazurator {
    /// Starts it on `path`; it tries for `timeout` and reports.
    fn start(path: &str, kind: &str, timeout: Duration) -> Kazurator {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/support/kazurator_lock.py"
        );
        let mut child = Command::new(python())
            .args([
                script,
                HOSTS,
                path,
                kind,
                &timeout.as_secs_f64().to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run kazurator with {} (scripts/services.sh installs it): {e}",
                    python()
                )
            });
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Kazurator { child, lines }
    }

    async fn said(&mut self) -> String {
        tokio::time::timeout(Duration::from_secs(30), self.lines.next_line())
            .await
            .expect("kazurator said nothing for 30 s")
            .unwrap()
            .expect("kazurator exited")
    }

    async fn release(mut self) {
        let mut stdin = self.child.stdin.take().unwrap();
        stdin.write_all(b"release\n").await.unwrap();
        assert_eq!(self.said().await, "released");
        self.child.wait().await.unwrap();
    }
}

async fn locker(query: &str) -> Locker {
    Locker::new(
        ZooKeeperBackend::connect(&format!("zk://{HOSTS}?session_timeout=3s{query}"))
            .await
            .unwrap(),
    )
}

fn key(name: &str) -> String {
    format!("interop-{name}-{}", std::process::id())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kazurator_mutex_and_fencelock_exclude_each_other() {
    let k = key("mutex");
    let path = format!("/fencelock/{k}");
    let fl = locker("").await;

    // kazurator first: fencelock waits until kazurator releases.
    let mut kz = Kazurator::start(&path, "mutex", Duration::from_secs(10));
    assert_eq!(kz.said().await, "acquired");
    assert!(
        fl.lock(&k).try_acquire().await.unwrap().is_none(),
        "fencelock got a lock kazurator holds"
    );
    let waiter = tokio::spawn({
        let (fl, k) = (fl.clone(), k.clone());
        async move { fl.lock(&k).wait(Duration::from_secs(20)).acquire().await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "fencelock did not wait for kazurator"
    );
    kz.release().await;
    let g = waiter
        .await
        .unwrap()
        .expect("fencelock never got the lock kazurator released");

    // fencelock first: kazurator times out, then gets it after the release.
    let mut kz = Kazurator::start(&path, "mutex", Duration::from_millis(700));
    assert_eq!(
        kz.said().await,
        "timeout",
        "kazurator got a lock fencelock holds"
    );
    g.release().await.unwrap();
    let mut kz2 = Kazurator::start(&path, "mutex", Duration::from_secs(10));
    assert_eq!(kz2.said().await, "acquired");
    kz2.release().await;
    let _ = kz.child.wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kazurator_reader_blocks_a_fencelock_writer_and_shares_with_a_fencelock_reader() {
    let k = key("rw");
    let path = format!("/fencelock/{k}");
    let fl = locker("").await;
    let mut reader = Kazurator::start(&path, "read", Duration::from_secs(10));
    assert_eq!(reader.said().await, "acquired");
    assert!(
        fl.lock(&k).try_acquire().await.unwrap().is_none(),
        "a fencelock writer got in beside a kazurator reader"
    );
    let shared = fl
        .read_lock(&k)
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .expect("a fencelock reader was refused");
    reader.release().await;
    shared.release().await.unwrap();
    fl.lock(&k)
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_writer_rwlock_fencelock_exclusive_locks_block_kazurator_readers_and_writers() {
    let k = key("writer");
    let path = format!("/fencelock/{k}");
    let fl = locker("&writer=rwlock").await;
    let g = fl.lock(&k).acquire().await.unwrap();
    for kind in ["read", "write"] {
        let mut kz = Kazurator::start(&path, kind, Duration::from_millis(700));
        assert_eq!(
            kz.said().await,
            "timeout",
            "a kazurator {kind} lock got in beside a fencelock writer"
        );
        let _ = kz.child.wait().await;
    }
    g.release().await.unwrap();
    let mut kz = Kazurator::start(&path, "write", Duration::from_secs(10));
    assert_eq!(kz.said().await, "acquired");
    assert!(
        fl.read_lock(&k).try_acquire().await.unwrap().is_none(),
        "a fencelock reader got in beside a kazurator writer"
    );
    kz.release().await;
}

/// A fencelock request mode of the interop matrix.
#[derive(Debug, Clone, Copy)]
enum FlMode {
    Exclusive,
    Shared,
    Semaphore,
}

/// What one cell of the matrix promises.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Cell {
    /// Each excludes the other, whoever comes first.
    Excludes,
    /// Both hold at once (readers).
    Shares,
    /// fencelock waits for the kazurator holder, but kazurator does not see
    /// fencelock's node (its recipe sorts it after its own): do not mix.
    OneWay,
}

/// The matrix docs/backends/zookeeper.md states: (writer option, fencelock mode, kazurator
/// recipe) → what holds.
const MATRIX: [(&str, FlMode, &str, Cell); 18] = [
    ("mutex", FlMode::Exclusive, "mutex", Cell::Excludes),
    ("mutex", FlMode::Exclusive, "read", Cell::OneWay),
    ("mutex", FlMode::Exclusive, "write", Cell::OneWay),
    ("mutex", FlMode::Shared, "mutex", Cell::Excludes),
    ("mutex", FlMode::Shared, "read", Cell::Shares),
    ("mutex", FlMode::Shared, "write", Cell::OneWay),
    ("mutex", FlMode::Semaphore, "mutex", Cell::Excludes),
    ("mutex", FlMode::Semaphore, "read", Cell::OneWay),
    ("mutex", FlMode::Semaphore, "write", Cell::OneWay),
    ("rwlock", FlMode::Exclusive, "mutex", Cell::OneWay),
    ("rwlock", FlMode::Exclusive, "read", Cell::Excludes),
    ("rwlock", FlMode::Exclusive, "write", Cell::Excludes),
    ("rwlock", FlMode::Shared, "mutex", Cell::OneWay),
    ("rwlock", FlMode::Shared, "read", Cell::Shares),
    ("rwlock", FlMode::Shared, "write", Cell::Excludes),
    ("rwlock", FlMode::Semaphore, "mutex", Cell::OneWay),
    ("rwlock", FlMode::Semaphore, "read", Cell::Excludes),
    ("rwlock", FlMode::Semaphore, "write", Cell::Excludes),
];

async fn fl_try(fl: &Locker, k: &str, mode: FlMode) -> Option<fencelock_core::Guard> {
    let b = match mode {
        FlMode::Exclusive => fl.lock(k),
        FlMode::Shared => fl.read_lock(k),
        FlMode::Semaphore => fl.semaphore(k, 2),
    };
    b.try_acquire().await.unwrap()
}

/// One cell, both ways round: fencelock first, then kazurator first.
async fn check_cell(writer: &str, mode: FlMode, recipe: &str, cell: Cell) {
    let what = format!("writer={writer} {mode:?} × kazurator {recipe}");
    let k = key(&format!("matrix-{writer}-{mode:?}-{recipe}"));
    let path = format!("/fencelock/{k}");
    let fl = locker(&format!("&writer={writer}")).await;

    // fencelock holds; kazurator tries.
    if cell != Cell::OneWay {
        let g = fl_try(&fl, &k, mode)
            .await
            .expect("fencelock on a free lock");
        let patience = if cell == Cell::Excludes { 1 } else { 20 };
        let mut kz = Kazurator::start(&path, recipe, Duration::from_secs(patience));
        let said = kz.said().await;
        match cell {
            Cell::Excludes => {
                assert_eq!(said, "timeout", "{what}: kazurator got in beside fencelock")
            }
            _ => {
                assert_eq!(
                    said, "acquired",
                    "{what}: kazurator was refused a shared hold"
                );
                kz.release().await;
            }
        }
        g.release().await.unwrap();
    }

    // kazurator holds; fencelock tries.
    let mut kz = Kazurator::start(&path, recipe, Duration::from_secs(20));
    assert_eq!(
        kz.said().await,
        "acquired",
        "{what}: kazurator on a free lock"
    );
    let got = fl_try(&fl, &k, mode).await;
    assert_eq!(
        got.is_some(),
        cell == Cell::Shares,
        "{what}: fencelock {}",
        if got.is_some() {
            "got in beside kazurator"
        } else {
            "was refused a shared hold"
        }
    );
    if let Some(g) = got {
        g.release().await.unwrap();
    }
    kz.release().await;
}

/// Every cell of the interop matrix of docs/backends/zookeeper.md, against kazurator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_interop_matrix_holds_cell_by_cell() {
    // A few cells at a time: each starts Python twice.
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(3));
    let mut cells = tokio::task::JoinSet::new();
    for (writer, mode, recipe, cell) in MATRIX {
        let gate = gate.clone();
        cells.spawn(async move {
            let _turn = gate.acquire().await.unwrap();
            check_cell(writer, mode, recipe, cell).await;
        });
    }
    while let Some(done) = cells.join_next().await {
        done.unwrap();
    }
}
