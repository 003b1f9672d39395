//! A throw-away PostgreSQL server of the test's own (fault tests restart it),
//! and the holder process the SIGKILL/SIGSTOP tests signal.

#![allow(dead_code)]

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fencelock_core::backend::async_trait;
use fencelock_core::{FencingToken, Locker, Result};
use fencelock_postgres::PostgresBackend;
use fencelock_postgres::patterns::Fenced;
use fencelock_testkit::faults::FaultHarness;
use fencelock_testkit::{
    Signal, account_ids, free_port, postgres_program, send_signal, wait_for_port,
};

pub const SHARED: &str = "postgres://postgres:postgres@127.0.0.1:5432/test";

/// The newest installed PostgreSQL's program `name`.
fn bin(name: &str) -> PathBuf {
    postgres_program(name).expect("PostgreSQL is installed (scripts/services.sh)")
}

/// The uid and gid of the `postgres` account (the server refuses to run as root).
fn postgres_ids() -> (u32, u32) {
    account_ids("postgres").expect("a postgres account")
}

/// A private server on a free port, in a temporary data directory.
pub struct PrivatePostgres {
    dir: tempfile::TempDir,
    port: u16,
    ids: (u32, u32),
    child: Option<Child>,
    /// `-c name=value` settings of the server.
    settings: Vec<String>,
}

impl PrivatePostgres {
    pub fn start() -> PrivatePostgres {
        PrivatePostgres::start_with(&[])
    }

    /// A private server with extra settings (`"synchronous_commit=off"`).
    pub fn start_with(settings: &[&str]) -> PrivatePostgres {
        let ids = postgres_ids();
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::chown(dir.path(), Some(ids.0), Some(ids.1)).unwrap();
        let status = Command::new(bin("initdb"))
            .args([
                "-D",
                &data(dir.path()),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
            ])
            .uid(ids.0)
            .gid(ids.1)
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "initdb failed");
        let mut pg = PrivatePostgres {
            dir,
            port: free_port(),
            ids,
            child: None,
            settings: settings.iter().map(|s| s.to_string()).collect(),
        };
        pg.run();
        pg
    }

    fn run(&mut self) {
        let dir = self.dir.path().to_string_lossy().to_string();
        let child = Command::new(bin("postgres"))
            .args(["-D", &data(self.dir.path()), "-p", &self.port.to_string()])
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                &format!("unix_socket_directories={dir}"),
            ])
            .args(self.settings.iter().flat_map(|s| ["-c", s.as_str()]))
            .uid(self.ids.0)
            .gid(self.ids.1)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        wait_for_port(([127, 0, 0, 1], self.port).into(), Duration::from_secs(30)).unwrap();
        self.wait_ready(Duration::from_secs(60));
    }

    /// Waits until the server takes queries: after a crash it listens while
    /// it still replays its WAL and refuses sessions ("the database system is
    /// starting up"), longer on a loaded machine.
    fn wait_ready(&self, limit: Duration) {
        let start = std::time::Instant::now();
        loop {
            let ready = Command::new(bin("pg_isready"))
                .args(["-q", "-h", "127.0.0.1", "-p", &self.port.to_string()])
                .status()
                .is_ok_and(|s| s.success());
            if ready {
                return;
            }
            assert!(
                start.elapsed() < limit,
                "postgres on port {} not ready after {limit:?}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn url(&self, mode: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres?mode={mode}",
            self.port
        )
    }

    /// Stops the server (fast shutdown: sessions are ended) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = send_signal(child.id(), Signal::SIGINT);
            let _ = child.wait();
        }
    }

    /// Stops and starts the server again on the same port and data.
    pub fn restart(&mut self) {
        self.stop();
        self.run();
    }

    /// SIGKILLs the server and every process of it (a crash: what was not
    /// flushed is lost), then starts it again (crash recovery).
    pub fn crash_and_restart(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = child.id();
            // The backends first (they are the postmaster's children), then it.
            for p in children_of(pid) {
                let _ = send_signal(p, Signal::SIGKILL);
            }
            let _ = send_signal(pid, Signal::SIGKILL);
            let _ = child.wait();
            for p in children_of(pid) {
                let _ = send_signal(p, Signal::SIGKILL);
            }
        }
        // The killed backends must be gone before a new postmaster starts.
        std::thread::sleep(Duration::from_millis(500));
        self.run();
    }
}

/// Processes whose parent is `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in dir.flatten() {
        let Some(p) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        // pid (comm) state ppid …; comm may hold spaces, so split after ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push(p);
        }
    }
    out
}

fn data(dir: &Path) -> String {
    dir.join("data").to_string_lossy().to_string()
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The harness of the fault scenarios: clients of the URL given, and the
/// protected resource a row in the shared test database, fenced by token.
pub struct Pg;

#[async_trait]
impl FaultHarness for Pg {
    async fn locker(&self, url: &str) -> Result<Locker> {
        Ok(Locker::new(PostgresBackend::connect(url).await?))
    }

    async fn fenced_write(&self, key: &str, token: FencingToken) -> Result<bool> {
        let pool = PostgresBackend::connect(SHARED).await?.pool().clone();
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS t_fault_resource (id bigint PRIMARY KEY, body text NOT NULL, last_token bigint NOT NULL)",
        )
        .execute(&pool)
        .await
        .map_err(|e| fencelock_core::Error::backend("postgres", e))?;
        let id = key
            .bytes()
            .fold(0i64, |h, b| h.wrapping_mul(31).wrapping_add(i64::from(b)));
        Fenced::new("t_fault_resource", "id", "body", "last_token")?
            .write(&pool, id, key, token)
            .await
    }
}
