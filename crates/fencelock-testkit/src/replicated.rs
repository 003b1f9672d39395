//! Private replicated Redis setups for failover tests: a master with replicas
//! and three Sentinels, and a cluster with a replica per primary. Each can
//! make the seeds' failure happen on purpose: a primary that dies before its
//! replica copied a grant.

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
        let replicas: Vec<&ServerProcess> =
            self.nodes.iter().filter(|n| n.port() != master).collect();
        isolate(master, &replicas)
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

    /// Starts the data node on `port` again (empty), as a replica of the
    /// master the Sentinels name now; they reconfigure it if that changes.
    ///
    /// # Errors
    ///
    /// If no Sentinel names a master, or the node does not start.
    pub fn restart_node(&mut self, port: u16) -> io::Result<()> {
        let master = self.master_port()?;
        self.node(port).kill();
        let _ = std::fs::remove_dir_all(self.dir.join(format!("redis-{port}")));
        let of = vec!["--replicaof".to_string(), format!("127.0.0.1 {master}")];
        let fresh = redis_server(&self.dir, port, &of)?;
        if let Some(n) = self.nodes.iter_mut().find(|n| n.port() == port) {
            *n = fresh;
        }
        Ok(())
    }

    /// Waits until the Sentinels name a master other than `old` and that
    /// server says it is the master; returns its port. (Sentinel has no
    /// event a test could wait on instead.)
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

/// Stops each of `replicas` (SIGSTOP) and has the primary on `primary` drop
/// their links: a write to the primary meanwhile reaches no replica, not
/// even from a socket buffer.
fn isolate(primary: u16, replicas: &[&ServerProcess]) -> io::Result<()> {
    for r in replicas {
        if let Some(pid) = r.pid() {
            send_signal(pid, Signal::SIGSTOP)?;
        }
    }
    redis_cli(primary, &["client", "kill", "type", "replica"])?;
    Ok(())
}

/// A Redis Cluster of three primaries with a replica each, on free loopback
/// ports (no persistence), nodes failing over after `node_timeout`.
/// Dropped, every process is killed.
pub struct ClusterSetup {
    dir: PathBuf,
    nodes: Vec<ServerProcess>,
    /// Each node's cluster arguments, in the order of `nodes`.
    args: Vec<Vec<String>>,
}

/// One line of `CLUSTER NODES`.
struct NodeLine {
    id: String,
    port: u16,
    primary: bool,
    failed: bool,
    /// The primary's id, for a replica.
    of: Option<String>,
    slots: Vec<(u16, u16)>,
}

fn cluster_nodes(port: u16) -> io::Result<Vec<NodeLine>> {
    let out = redis_cli(port, &["cluster", "nodes"])?;
    let mut lines = Vec::new();
    for l in out.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() < 8 {
            continue;
        }
        let port = f[1]
            .split('@')
            .next()
            .and_then(|a| a.rsplit(':').next())
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        let slots = f[8..]
            .iter()
            .filter(|s| !s.starts_with('['))
            .filter_map(|s| match s.split_once('-') {
                Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                None => s.parse().ok().map(|a| (a, a)),
            })
            .collect();
        lines.push(NodeLine {
            id: f[0].to_string(),
            port,
            primary: f[2].contains("master"),
            failed: f[2].contains("fail"),
            of: (f[3] != "-").then(|| f[3].to_string()),
            slots,
        });
    }
    Ok(lines)
}

impl ClusterSetup {
    /// Starts six nodes in `dir` and joins them as three primaries with a
    /// replica each; returns once every replica's link is up.
    ///
    /// # Errors
    ///
    /// If a node does not start, or the cluster is not whole within 60 s.
    pub fn start(dir: &Path, node_timeout: Duration) -> io::Result<ClusterSetup> {
        let (mut nodes, mut all_args) = (Vec::new(), Vec::new());
        for _ in 0..6 {
            let port = free_port();
            let timeout = node_timeout.as_millis().to_string();
            // The bus port too: the default, port + 10000, may be taken.
            let bus = free_port().to_string();
            let args: Vec<String> = [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                &timeout,
                "--cluster-port",
                &bus,
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            nodes.push(redis_server(dir, port, &args)?);
            all_args.push(args);
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "redis-cli --cluster create: {}",
                String::from_utf8_lossy(&out.stdout)
            )));
        }
        let setup = ClusterSetup {
            dir: dir.to_path_buf(),
            nodes,
            args: all_args,
        };
        setup.wait_whole(Duration::from_secs(60))?;
        Ok(setup)
    }

    fn wait_whole(&self, limit: Duration) -> io::Result<()> {
        let start = Instant::now();
        while !self.whole() {
            if start.elapsed() > limit {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "the cluster in {} is not whole within {limit:?}",
                        self.dir.display()
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// Starts the node on `port` again (empty, with its node table) and
    /// waits until the cluster is whole: a primary that was replaced comes
    /// back as a replica of the node that took its slots.
    ///
    /// # Errors
    ///
    /// If the node does not start, or the cluster is not whole within 60 s.
    pub fn restart_node(&mut self, port: u16) -> io::Result<()> {
        let i = self
            .nodes
            .iter()
            .position(|n| n.port() == port)
            .ok_or_else(|| io::Error::other(format!("no cluster node on port {port}")))?;
        self.nodes[i].kill();
        self.nodes[i] = redis_server(&self.dir, port, &self.args[i])?;
        self.wait_whole(Duration::from_secs(60))
    }

    /// Every node sees the cluster ok with three primaries, each with a
    /// replica whose link is up.
    fn whole(&self) -> bool {
        let views_agree = self.nodes.iter().all(|n| {
            redis_cli(n.port(), &["cluster", "info"]).is_ok_and(|i| i.contains("cluster_state:ok"))
                && cluster_nodes(n.port()).is_ok_and(|lines| {
                    lines.iter().filter(|l| l.of.is_some()).count() == 3
                        && lines
                            .iter()
                            .filter(|l| l.primary && !l.slots.is_empty())
                            .count()
                            == 3
                })
        });
        views_agree
            && self.nodes.iter().all(|n| {
                redis_cli(n.port(), &["role"])
                    .is_ok_and(|r| r.starts_with("master") || r.lines().nth(3) == Some("connected"))
            })
    }

    /// `redis+cluster://…` naming every node, with `query` appended.
    pub fn url(&self, query: &str) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        format!("redis+cluster://{}{query}", hosts.join(","))
    }

    /// The port of the primary serving the Redis key `name`, as a live node
    /// sees it.
    ///
    /// # Errors
    ///
    /// If no live node answers, or none serves the key's slot.
    pub fn primary_of(&self, name: &str) -> io::Result<u16> {
        let mut last = io::Error::other("no node answers");
        for n in self.nodes.iter().filter(|n| n.pid().is_some()) {
            let slot: u16 = match redis_cli(n.port(), &["cluster", "keyslot", name]) {
                Ok(s) => s.parse().map_err(io::Error::other)?,
                Err(e) => {
                    last = e;
                    continue;
                }
            };
            match cluster_nodes(n.port()) {
                Ok(lines) => {
                    return lines
                        .iter()
                        .find(|l| {
                            l.primary
                                && !l.failed
                                && l.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot))
                        })
                        .map(|l| l.port)
                        .ok_or_else(|| {
                            io::Error::other(format!("no live primary serves slot {slot}"))
                        });
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// The node on `port`.
    ///
    /// # Panics
    ///
    /// If the setup has no node on `port`.
    pub fn node(&mut self, port: u16) -> &mut ServerProcess {
        self.nodes
            .iter_mut()
            .find(|n| n.port() == port)
            .unwrap_or_else(|| panic!("no cluster node on port {port}"))
    }

    fn replicas_of(&self, primary: u16) -> io::Result<Vec<u16>> {
        let lines = cluster_nodes(primary)?;
        let id = lines
            .iter()
            .find(|l| l.port == primary)
            .map(|l| l.id.clone())
            .ok_or_else(|| io::Error::other(format!("{primary} is not in its own node table")))?;
        let ports: Vec<u16> = lines
            .iter()
            .filter(|l| l.of.as_deref() == Some(id.as_str()))
            .map(|l| l.port)
            .collect();
        if ports.is_empty() {
            return Err(io::Error::other(format!("{primary} has no replica")));
        }
        Ok(ports)
    }

    /// As [`SentinelSetup::isolate_replicas`], for the replicas of the
    /// primary on `primary`; returns their ports.
    ///
    /// # Errors
    ///
    /// If the node table cannot be read, or a signal or `CLIENT KILL` fails.
    pub fn isolate_replicas(&mut self, primary: u16) -> io::Result<Vec<u16>> {
        let ports = self.replicas_of(primary)?;
        let replicas: Vec<&ServerProcess> = self
            .nodes
            .iter()
            .filter(|n| ports.contains(&n.port()))
            .collect();
        isolate(primary, &replicas)?;
        Ok(ports)
    }

    /// Resumes the nodes on `ports` (stopped by
    /// [`ClusterSetup::isolate_replicas`]).
    ///
    /// # Errors
    ///
    /// If a signal fails.
    pub fn resume(&mut self, ports: &[u16]) -> io::Result<()> {
        for n in self.nodes.iter().filter(|n| ports.contains(&n.port())) {
            if let Some(pid) = n.pid() {
                send_signal(pid, Signal::SIGCONT)?;
            }
        }
        Ok(())
    }

    /// Waits until a node other than `old` serves the Redis key `name` as a
    /// primary and the cluster is ok again; returns its port.
    ///
    /// # Errors
    ///
    /// If that does not happen within `limit`.
    pub fn wait_for_failover(&self, old: u16, name: &str, limit: Duration) -> io::Result<u16> {
        let start = Instant::now();
        loop {
            if let Ok(p) = self.primary_of(name)
                && p != old
                && redis_cli(p, &["cluster", "info"]).is_ok_and(|i| i.contains("cluster_state:ok"))
            {
                return Ok(p);
            }
            if start.elapsed() > limit {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "no replica took over from {old} within {limit:?} (logs in {})",
                        self.dir.display()
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
