//! A throw-away MariaDB server of the test's own (fault tests restart it), a
//! fenced resource, and helpers of the SIGKILL/SIGSTOP tests.

#![allow(dead_code)]

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fencelock_core::backend::async_trait;
use fencelock_core::{FencingToken, Locker, Result};
use fencelock_mysql::MySqlBackend;
use fencelock_testkit::faults::FaultHarness;
use fencelock_testkit::{Signal, free_port, send_signal, wait_for_port};

pub mod line;

pub const SHARED: &str = "mysql://root@127.0.0.1:3306/test";

/// A private server on a free port, in a temporary data directory, without
/// grant tables (any login works).
pub struct PrivateMariaDb {
    dir: tempfile::TempDir,
    port: u16,
    child: Option<Child>,
    spawned: std::time::Instant,
    settings: Vec<String>,
}

impl PrivateMariaDb {
    pub fn start() -> PrivateMariaDb {
        PrivateMariaDb::start_with(&[])
    }

    /// A private server with extra options (`"--wait-timeout=2"`).
    pub fn start_with(settings: &[&str]) -> PrivateMariaDb {
        let dir = tempfile::tempdir().unwrap();
        // A private tmpdir: bootstraps running at once collide on the names
        // of their temporary tables in a shared /tmp.
        std::fs::create_dir(dir.path().join("tmp")).unwrap();
        let status = Command::new("mariadb-install-db")
            .args([
                "--no-defaults",
                "--user=root",
                "--skip-test-db",
                "--auth-root-authentication-method=normal",
            ])
            .arg(format!("--datadir={}", dir.path().join("data").display()))
            .arg(format!("--tmpdir={}", dir.path().join("tmp").display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("mariadb-install-db (scripts/services.sh installs MariaDB)");
        assert!(status.success(), "mariadb-install-db failed");
        let mut db = PrivateMariaDb {
            dir,
            port: free_port(),
            child: None,
            spawned: std::time::Instant::now(),
            settings: settings.iter().map(|s| s.to_string()).collect(),
        };
        db.run();
        db
    }

    fn run(&mut self) {
        let d = self.dir.path();
        self.spawned = std::time::Instant::now();
        let child = Command::new("mariadbd")
            .args([
                "--no-defaults",
                "--user=root",
                "--skip-grant-tables",
                "--bind-address=127.0.0.1",
            ])
            .args(["--innodb-buffer-pool-size=16M", "--skip-log-bin"])
            .arg(format!("--datadir={}", d.join("data").display()))
            .arg(format!("--socket={}", d.join("sock").display()))
            .arg(format!("--tmpdir={}", d.join("tmp").display()))
            .arg(format!("--pid-file={}", d.join("pid").display()))
            .arg(format!("--port={}", self.port))
            .args(&self.settings)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        wait_for_port(([127, 0, 0, 1], self.port).into(), Duration::from_secs(60)).unwrap();
    }

    /// When the running server's process was last started: it has been up
    /// for at most the time since.
    pub fn spawned(&self) -> std::time::Instant {
        self.spawned
    }

    pub fn url(&self, mode: &str) -> String {
        format!("mysql://root@127.0.0.1:{}/mysql?mode={mode}", self.port)
    }

    /// Stops the server (SIGTERM: a clean shutdown that ends every session).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = send_signal(child.id(), Signal::SIGTERM);
            let _ = child.wait();
        }
    }

    /// Stops and starts the server again on the same port and data.
    pub fn restart(&mut self) {
        self.stop();
        self.run();
    }

    /// SIGKILLs the server (a crash: what was not flushed is lost) and starts
    /// it again (crash recovery).
    pub fn crash_and_restart(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.run();
    }
}

impl Drop for PrivateMariaDb {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The harness of the fault scenarios: clients of the URL given, and the
/// protected resource a row in the shared test database; a write counts only
/// with a token larger than the last one written.
pub struct My;

#[async_trait]
impl FaultHarness for My {
    async fn locker(&self, url: &str) -> Result<Locker> {
        Ok(Locker::new(MySqlBackend::connect(url).await?))
    }

    async fn fenced_write(&self, key: &str, token: FencingToken) -> Result<bool> {
        Ok(fenced_write(key, token).await)
    }
}

async fn fenced_write(key: &str, token: FencingToken) -> bool {
    let pool = sqlx::MySqlPool::connect(SHARED).await.unwrap();
    sqlx::query("CREATE TABLE IF NOT EXISTS t_fault_resource (id VARBINARY(256) PRIMARY KEY, last_token BIGINT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("INSERT IGNORE INTO t_fault_resource VALUES (?, 0)")
        .bind(key.as_bytes())
        .execute(&pool)
        .await
        .unwrap();
    let done =
        sqlx::query("UPDATE t_fault_resource SET last_token = ? WHERE id = ? AND last_token < ?")
            .bind(token.get() as i64)
            .bind(key.as_bytes())
            .bind(token.get() as i64)
            .execute(&pool)
            .await
            .unwrap();
    done.rows_affected() == 1
}
