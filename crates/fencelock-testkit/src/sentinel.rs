//! A private Redis master with replicas and three Sentinels, for failover
//! tests: the seeds' failure (a master that dies before its replica copied a
//! grant) made to happen on purpose.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::server::{ServerProcess, free_port, send_signal};
use nix::sys::signal::Signal;

/// The service name the Sentinels monitor.
pub const SERVICE: &str = "fencelock";

/// A master, its replicas and three Sentinels on free loopback ports (no
/// persistence). Dropped, every process is killed.
pub struct SentinelSetup {
    dir: PathBuf,
    /// The data nodes, by port; the first is the master at the start.
    nodes: Vec<ServerProcess>,
    sentinels: Vec<ServerProcess>,
}

/// Runs `redis-cli -p PORT ARGS…` and returns its output, trimmed.
///
/// # Errors
///
/// If redis-cli cannot be run or fails.
pub fn redis_cli(port: u16, args: &[&str]) -> io::Result<String> {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "redis-cli -p {port} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn redis_server(dir: &Path, port: u16, args: &[String]) -> io::Result<ServerProcess> {
    let data = dir.join(format!("redis-{port}"));
    std::fs::create_dir_all(&data)?;
    let mut cmd = Command::new("redis-server");
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no", "--dir"])
        .arg(&data)
        .args(["--repl-diskless-sync-delay", "0", "--logfile"])
        .arg(data.join("redis.log"))
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    ServerProcess::spawn("redis-server", cmd, port, Duration::from_secs(20))
}

impl SentinelSetup {
    /// Starts a master, `replicas` replicas and three Sentinels with
    /// `down-after-milliseconds` `down_after` (quorum 2), in `dir`; returns
    /// once every Sentinel sees every replica up.
    ///
    /// # Errors
    ///
    /// If a process does not start, or the Sentinels do not see the
    /// replicas within 30 s.
    pub fn start(dir: &Path, replicas: usize, down_after: Duration) -> io::Result<SentinelSetup> {
        let master_port = free_port();
        let mut nodes = vec![redis_server(dir, master_port, &[])?];
        for _ in 0..replicas {
            let port = free_port();
            let of = vec![
                "--replicaof".to_string(),
                format!("127.0.0.1 {master_port}"),
            ];
            nodes.push(redis_server(dir, port, &of)?);
        }
        let mut sentinels = Vec::new();
        for _ in 0..3 {
            let port = free_port();
            let conf = dir.join(format!("sentinel-{port}.conf"));
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {d}\nlogfile {d}/sentinel-{port}.log\n\
                     sentinel monitor {SERVICE} 127.0.0.1 {master_port} 2\n\
                     sentinel down-after-milliseconds {SERVICE} {down}\n\
                     sentinel failover-timeout {SERVICE} 10000\n\
                     sentinel parallel-syncs {SERVICE} 1\n",
                    d = dir.display(),
                    down = down_after.as_millis()
                ),
            )?;
            let mut cmd = Command::new("redis-sentinel");
            cmd.arg(&conf)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null());
            sentinels.push(ServerProcess::spawn(
                "redis-sentinel",
                cmd,
                port,
                Duration::from_secs(20),
            )?);
        }
        let setup = SentinelSetup {
            dir: dir.to_path_buf(),
            nodes,
            sentinels,
        };
        setup.wait_until(
            Duration::from_secs(30),
            "every Sentinel sees every replica",
            |s| {
                s.sentinels.iter().all(|x| {
                    redis_cli(x.port(), &["sentinel", "replicas", SERVICE])
                        .is_ok_and(|r| r.matches("master-link-status\nok").count() == replicas)
                })
            },
        )?;
        Ok(setup)
    }

    /// `redis+sentinel://…/fencelock` with `query` appended (`?ttl=10s`, or empty).
    pub fn url(&self, query: &str) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()))
            .collect();
        format!("redis+sentinel://{}/{SERVICE}{query}", hosts.join(","))
    }

    /// The Sentinels' ports.
    pub fn sentinel_ports(&self) -> Vec<u16> {
        self.sentinels.iter().map(ServerProcess::port).collect()
    }

    /// The port the first Sentinel that answers names as the master.
    ///
    /// # Errors
    ///
    /// If no Sentinel answers.
    pub fn master_port(&self) -> io::Result<u16> {
        let mut last = io::Error::other("no Sentinel");
        for s in &self.sentinels {
            match redis_cli(s.port(), &["sentinel", "get-master-addr-by-name", SERVICE]) {
                Ok(out) => {
                    if let Some(port) = out.lines().nth(1).and_then(|p| p.trim().parse().ok()) {
                        return Ok(port);
                    }
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// The data node on `port`.
    ///
    /// # Panics
    ///
    /// If the setup has no node on `port`.
    pub fn node(&mut self, port: u16) -> &mut ServerProcess {
        self.nodes
            .iter_mut()
            .find(|n| n.port() == port)
            .unwrap_or_else(|| panic!("no data node on port {port}"))
    }

    /// The data nodes' ports, the master at the start first.
    pub fn node_ports(&self) -> Vec<u16> {
        self.nodes.iter().map(ServerProcess::port).collect()
    }

    /// Cuts the master on `master` off from its replicas without the
    /// replicas knowing for a while: each replica is stopped (SIGSTOP), the
    /// master drops their links, and the replicas stay stopped until
    /// [`SentinelSetup::resume_replicas`]. A write to the master meanwhile
    /// reaches no replica, not even from a socket buffer.
    ///
    /// # Errors
    ///
    /// If a signal or the master's `CLIENT KILL` fails.
    pub fn isolate_replicas(&mut self, master: u16) -> io::Result<()> {
        for n in self.nodes.iter().filter(|n| n.port() != master) {
            if let Some(pid) = n.pid() {
                send_signal(pid, Signal::SIGSTOP)?;
            }
        }
        redis_cli(master, &["client", "kill", "type", "replica"])?;
        Ok(())
    }

    /// Resumes the replicas [`SentinelSetup::isolate_replicas`] stopped.
    ///
    /// # Errors
    ///
    /// If a signal fails.
    pub fn resume_replicas(&mut self, master: u16) -> io::Result<()> {
        for n in self.nodes.iter().filter(|n| n.port() != master) {
            if let Some(pid) = n.pid() {
                send_signal(pid, Signal::SIGCONT)?;
            }
        }
        Ok(())
    }

    /// Waits until the Sentinels name a master other than `old` and that
    /// server says it is the master; returns its port.
    ///
    /// # Errors
    ///
    /// If that does not happen within `limit`.
    pub fn wait_for_failover(&self, old: u16, limit: Duration) -> io::Result<u16> {
        let mut found = 0;
        self.wait_until(limit, "the Sentinels promote a replica", |s| {
            match s.master_port() {
                Ok(p)
                    if p != old
                        && redis_cli(p, &["role"]).is_ok_and(|r| r.starts_with("master")) =>
                {
                    found = p;
                    true
                }
                _ => false,
            }
        })?;
        Ok(found)
    }

    fn wait_until(
        &self,
        limit: Duration,
        what: &str,
        mut done: impl FnMut(&SentinelSetup) -> bool,
    ) -> io::Result<()> {
        let start = Instant::now();
        while !done(self) {
            if start.elapsed() > limit {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "{what}: not within {limit:?} (logs in {})",
                        self.dir.display()
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }
}
