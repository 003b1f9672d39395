//! Private servers the tool starts itself — the only servers whose processes
//! it kills and restarts. Each runs on free loopback ports with its data in a
//! temporary directory, and is killed when the campaign ends.

use std::io::{self, Read, Write as _};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fencelock_testkit::replicated::{ClusterSetup, SentinelSetup};
use fencelock_testkit::{ServerProcess, account_ids, free_port, postgres_program};

/// Which private servers to start (`--spawn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SpawnKind {
    /// One redis-server with an fsync'd append-only file.
    Redis,
    /// Five independent redis-servers (fsync'd), under `redlock://`.
    Redlock,
    /// One memcached.
    Memcached,
    /// A 3-member etcd cluster.
    Etcd,
    /// A 3-server ZooKeeper ensemble.
    Zookeeper,
    /// One PostgreSQL server, lease mode, at `synchronous_commit=off` (a
    /// tuning fencelock must defend against: it pins the setting where it
    /// counts).
    PostgresLease,
    /// The same server, advisory mode.
    PostgresAdvisory,
    /// One MariaDB server, lease mode, at its default durability and with
    /// `READ-COMMITTED` as the default isolation (fencelock pins what it needs).
    MysqlLease,
    /// The same server, `GET_LOCK` mode.
    MysqlGetLock,
    /// A Redis master, one replica and three Sentinels (down-after 1 s), no
    /// persistence, under `redis+sentinel://`.
    RedisSentinel,
    /// The same, grants acknowledged by the replica (`wait_replicas=1`).
    RedisSentinelWait,
    /// A Redis Cluster of three primaries with a replica each (node timeout
    /// 2 s), no persistence, under `redis+cluster://`.
    RedisCluster,
}

impl SpawnKind {
    /// Every kind, with its name on the command line.
    pub const ALL: [(&'static str, SpawnKind); 12] = [
        ("redis", SpawnKind::Redis),
        ("redlock", SpawnKind::Redlock),
        ("memcached", SpawnKind::Memcached),
        ("etcd", SpawnKind::Etcd),
        ("zookeeper", SpawnKind::Zookeeper),
        ("postgres-lease", SpawnKind::PostgresLease),
        ("postgres-advisory", SpawnKind::PostgresAdvisory),
        ("mysql-lease", SpawnKind::MysqlLease),
        ("mysql-get-lock", SpawnKind::MysqlGetLock),
        ("redis-sentinel", SpawnKind::RedisSentinel),
        ("redis-sentinel-wait", SpawnKind::RedisSentinelWait),
        ("redis-cluster", SpawnKind::RedisCluster),
    ];

    /// Parses a name of [`SpawnKind::ALL`].
    pub fn parse(s: &str) -> Option<SpawnKind> {
        Self::ALL.iter().find(|(n, _)| *n == s).map(|(_, k)| *k)
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, k)| *k == self)
            .map_or("?", |(n, _)| n)
    }
}

/// A failover under way: the primary cut off and its stopped replicas (a
/// cluster's), and a key the primary serves (a cluster's).
struct FailingOver {
    primary: u16,
    replicas: Vec<u16>,
    key: String,
}

struct Member {
    port: u16,
    /// The ZooKeeper quorum ports or the etcd peer port.
    peer: Vec<u16>,
    dir: PathBuf,
    process: Option<ServerProcess>,
}

/// The started servers.
pub struct Servers {
    kind: SpawnKind,
    members: Vec<Member>,
    /// The Sentinel kinds' servers (no members then).
    sentinel: Option<SentinelSetup>,
    /// The cluster kind's servers (no members then).
    cluster: Option<ClusterSetup>,
    /// The primary a failover fault cut off from its replicas, until it heals.
    failing_over: Option<FailingOver>,
    _dir: tempfile::TempDir,
}

impl Servers {
    /// Starts the servers of `kind` and waits until they serve (a leader is
    /// elected where there is one).
    ///
    /// # Errors
    ///
    /// If a server program is missing or does not come up.
    pub fn start(kind: SpawnKind) -> io::Result<Servers> {
        let dir = tempfile::Builder::new()
            .prefix("fencelock-torture-")
            .tempdir()?;
        let n = match kind {
            SpawnKind::Redlock => 5,
            SpawnKind::Etcd | SpawnKind::Zookeeper => 3,
            SpawnKind::RedisSentinel | SpawnKind::RedisSentinelWait | SpawnKind::RedisCluster => 0,
            _ => 1,
        };
        let sentinel = match kind {
            SpawnKind::RedisSentinel | SpawnKind::RedisSentinelWait => {
                Some(SentinelSetup::start(dir.path(), 1, Duration::from_secs(1))?)
            }
            _ => None,
        };
        let cluster = match kind {
            SpawnKind::RedisCluster => {
                Some(ClusterSetup::start(dir.path(), Duration::from_secs(2))?)
            }
            _ => None,
        };
        let members = (0..n)
            .map(|i| {
                let d = dir.path().join(format!("m{i}"));
                std::fs::create_dir_all(&d)?;
                Ok(Member {
                    port: free_port(),
                    peer: vec![free_port(), free_port()],
                    dir: d,
                    process: None,
                })
            })
            .collect::<io::Result<Vec<_>>>()?;
        let mut s = Servers {
            kind,
            members,
            sentinel,
            cluster,
            failing_over: None,
            _dir: dir,
        };
        for i in 0..n {
            s.bootstrap(i)?;
            s.start_member(i, true)?;
        }
        s.wait_ready(Duration::from_secs(60))?;
        Ok(s)
    }

    /// How many members there are.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether there are none (never: every kind has at least one).
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The URL that reaches every member directly.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.port))
            .collect();
        match self.kind {
            SpawnKind::Redis => format!("redis://{}", hosts[0]),
            SpawnKind::Redlock => format!("redlock://{}", hosts.join(",")),
            SpawnKind::Memcached => format!("memcached://{}", hosts[0]),
            SpawnKind::Etcd => format!("etcd://{}", hosts.join(",")),
            SpawnKind::Zookeeper => format!("zk://{}?session_timeout=6s", hosts.join(",")),
            SpawnKind::PostgresLease => {
                format!("postgres://postgres@{}/postgres?mode=lease", hosts[0])
            }
            SpawnKind::PostgresAdvisory => {
                format!("postgres://postgres@{}/postgres?mode=advisory", hosts[0])
            }
            SpawnKind::MysqlLease => format!("mysql://root@{}/mysql?mode=lease", hosts[0]),
            SpawnKind::MysqlGetLock => format!("mysql://root@{}/mysql?mode=get_lock", hosts[0]),
            SpawnKind::RedisSentinel | SpawnKind::RedisSentinelWait => {
                let query = if self.kind == SpawnKind::RedisSentinelWait {
                    "?wait_replicas=1"
                } else {
                    ""
                };
                self.sentinel
                    .as_ref()
                    .map_or_else(String::new, |s| s.url(query))
            }
            SpawnKind::RedisCluster => self
                .cluster
                .as_ref()
                .map_or_else(String::new, |c| c.url("")),
        }
    }

    /// A failover, first half: a primary is cut off from its replicas (so
    /// what it grants from now on is lost in the failover); returns its port.
    /// `None` without a replicated setup, or while a failover is under way.
    pub fn isolate_master(&mut self) -> Option<u16> {
        if self.failing_over.is_some() {
            return None;
        }
        let failing = if let Some(s) = self.sentinel.as_mut() {
            let master = s.master_port().ok()?;
            s.isolate_replicas(master).ok()?;
            FailingOver {
                primary: master,
                replicas: Vec::new(),
                key: String::new(),
            }
        } else {
            // The primary of a random slot.
            let c = self.cluster.as_mut()?;
            let key = format!("failover-{}", fastrand::u32(..));
            let primary = c.primary_of(&key).ok()?;
            let replicas = c.isolate_replicas(primary).ok()?;
            FailingOver {
                primary,
                replicas,
                key,
            }
        };
        let port = failing.primary;
        self.failing_over = Some(failing);
        Some(port)
    }

    /// A failover, second half: the primary cut off by
    /// [`Servers::isolate_master`] is SIGKILLed and its replicas resumed;
    /// returns once one was promoted, with the old primary started again
    /// (empty) as a replica.
    ///
    /// # Errors
    ///
    /// If no replica is promoted within 60 s, or the old primary does not
    /// start or rejoin.
    pub fn fail_over(&mut self) -> io::Result<()> {
        let Some(f) = self.failing_over.take() else {
            return Ok(());
        };
        let limit = Duration::from_secs(60);
        if let Some(s) = self.sentinel.as_mut() {
            s.node(f.primary).kill();
            s.resume_replicas(f.primary)?;
            s.wait_for_failover(f.primary, limit)?;
            s.restart_node(f.primary)
        } else if let Some(c) = self.cluster.as_mut() {
            c.node(f.primary).kill();
            c.resume(&f.replicas)?;
            c.wait_for_failover(f.primary, &f.key, limit)?;
            c.restart_node(f.primary)
        } else {
            Ok(())
        }
    }

    /// Whether member `i` runs.
    pub fn is_up(&self, i: usize) -> bool {
        self.members[i].process.is_some()
    }

    /// SIGKILLs member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut p) = self.members[i].process.take() {
            p.kill();
        }
    }

    /// Starts member `i` again; with `keep_data` false its data is wiped first.
    ///
    /// # Errors
    ///
    /// If it does not come up.
    pub fn restart(&mut self, i: usize, keep_data: bool) -> io::Result<()> {
        self.kill(i);
        if !keep_data {
            let d = &self.members[i].dir;
            std::fs::remove_dir_all(d)?;
            std::fs::create_dir_all(d)?;
            self.bootstrap(i)?;
        }
        self.start_member(i, false)
    }

    /// The member that leads (etcd, ZooKeeper), if one is known.
    pub fn leader(&self) -> Option<usize> {
        (0..self.members.len()).find(|&i| {
            self.is_up(i)
                && match self.kind {
                    SpawnKind::Zookeeper => {
                        four_letter(self.members[i].port, "srvr").contains("Mode: leader")
                    }
                    SpawnKind::Etcd => etcd_is_leader(self.members[i].port),
                    _ => false,
                }
        })
    }

    /// Creates what a database server needs before its first start (its data
    /// directory); nothing for the others.
    fn bootstrap(&self, i: usize) -> io::Result<()> {
        let d = &self.members[i].dir;
        let status = match self.kind {
            SpawnKind::PostgresLease | SpawnKind::PostgresAdvisory => {
                let (uid, gid) = account_ids("postgres")?;
                std::os::unix::fs::chown(d, Some(uid), Some(gid))?;
                Command::new(postgres_program("initdb")?)
                    .arg("-D")
                    .arg(d.join("data"))
                    .args(["-U", "postgres", "--auth=trust", "-E", "UTF8"])
                    .uid(uid)
                    .gid(gid)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()?
            }
            SpawnKind::MysqlLease | SpawnKind::MysqlGetLock => {
                // A private tmpdir: bootstraps running at once collide on
                // the names of their temporary tables in a shared /tmp.
                std::fs::create_dir_all(d.join("tmp"))?;
                Command::new("mariadb-install-db")
                    .args(["--no-defaults", "--user=root", "--skip-test-db"])
                    .arg("--auth-root-authentication-method=normal")
                    .arg(format!("--datadir={}", d.join("data").display()))
                    .arg(format!("--tmpdir={}", d.join("tmp").display()))
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()?
            }
            _ => return Ok(()),
        };
        if status.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!(
                "the {} data directory could not be created ({status})",
                self.kind.name()
            )))
        }
    }

    fn wait_ready(&self, timeout: Duration) -> io::Result<()> {
        let start = Instant::now();
        while matches!(self.kind, SpawnKind::Zookeeper | SpawnKind::Etcd) && self.leader().is_none()
        {
            if start.elapsed() > timeout {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no {} leader within {timeout:?}", self.kind.name()),
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(())
    }

    fn start_member(&mut self, i: usize, first: bool) -> io::Result<()> {
        let m = &self.members[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(m.dir.with_extension("log"))?;
        let (name, mut cmd) = self.command(i, first)?;
        // Its own process group: a kill takes every process of the server.
        cmd.stdout(Stdio::null()).stderr(log).process_group(0);
        let process = ServerProcess::spawn(name, cmd, m.port, Duration::from_secs(60))?;
        self.members[i].process = Some(process);
        if matches!(
            self.kind,
            SpawnKind::PostgresLease | SpawnKind::PostgresAdvisory
        ) {
            // After a crash it listens while it still replays its WAL.
            pg_wait_ready(self.members[i].port, Duration::from_secs(60))?;
        }
        Ok(())
    }

    /// The server program's name and the command that starts member `i`
    /// (`first`: the ensemble is new).
    fn command(&self, i: usize, first: bool) -> io::Result<(&'static str, Command)> {
        let m = &self.members[i];
        let port = m.port.to_string();
        Ok(match self.kind {
            SpawnKind::Redis | SpawnKind::Redlock => {
                let mut cmd = Command::new("redis-server");
                cmd.args(["--bind", "127.0.0.1", "--port", &port, "--save", ""])
                    .args(["--appendonly", "yes", "--appendfsync", "always"])
                    .arg("--dir")
                    .arg(&m.dir);
                ("redis-server", cmd)
            }
            SpawnKind::Memcached => {
                let mut cmd = Command::new("memcached");
                cmd.args(["-l", "127.0.0.1", "-p", &port, "-U", "0", "-m", "16"]);
                if running_as_root() {
                    cmd.args(["-u", "memcache"]);
                }
                ("memcached", cmd)
            }
            SpawnKind::RedisSentinel | SpawnKind::RedisSentinelWait | SpawnKind::RedisCluster => {
                return Err(io::Error::other(
                    "a replicated setup starts its servers itself",
                ));
            }
            SpawnKind::Etcd => ("etcd", self.etcd_command(i, first)),
            SpawnKind::Zookeeper => ("zookeeper", self.zookeeper_command(i)?),
            SpawnKind::PostgresLease | SpawnKind::PostgresAdvisory => {
                let (uid, gid) = account_ids("postgres")?;
                let mut cmd = Command::new(postgres_program("postgres")?);
                cmd.arg("-D")
                    .arg(m.dir.join("data"))
                    .args(["-p", &port, "-c", "listen_addresses=127.0.0.1"])
                    .arg("-c")
                    .arg(format!("unix_socket_directories={}", m.dir.display()))
                    .args(["-c", "synchronous_commit=off"])
                    .uid(uid)
                    .gid(gid);
                ("postgres", cmd)
            }
            SpawnKind::MysqlLease | SpawnKind::MysqlGetLock => {
                let d = &m.dir;
                let mut cmd = Command::new("mariadbd");
                cmd.args(["--no-defaults", "--user=root", "--skip-grant-tables"])
                    .args(["--bind-address=127.0.0.1", "--skip-log-bin"])
                    .args(["--innodb-buffer-pool-size=16M"])
                    .arg("--transaction-isolation=READ-COMMITTED")
                    .arg(format!("--datadir={}", d.join("data").display()))
                    .arg(format!("--socket={}", d.join("sock").display()))
                    .arg(format!("--tmpdir={}", d.join("tmp").display()))
                    .arg(format!("--pid-file={}", d.join("pid").display()))
                    .arg(format!("--port={port}"));
                ("mariadbd", cmd)
            }
        })
    }

    /// etcd member `i` of the cluster (`first`: a new cluster).
    fn etcd_command(&self, i: usize, first: bool) -> Command {
        let m = &self.members[i];
        let initial: Vec<String> = self
            .members
            .iter()
            .enumerate()
            .map(|(j, m)| format!("m{j}=http://127.0.0.1:{}", m.peer[0]))
            .collect();
        let client = format!("http://127.0.0.1:{}", m.port);
        let peer = format!("http://127.0.0.1:{}", m.peer[0]);
        let mut cmd = Command::new("etcd");
        cmd.arg("--name")
            .arg(format!("m{i}"))
            .arg("--data-dir")
            .arg(m.dir.join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &initial.join(",")])
            .args([
                "--initial-cluster-state",
                if first { "new" } else { "existing" },
            ])
            .args([
                "--initial-cluster-token",
                &format!("torture-{}", self.members[0].port),
            ]);
        cmd
    }

    /// ZooKeeper member `i` of the ensemble: its `myid` and `zoo.cfg` written.
    fn zookeeper_command(&self, i: usize) -> io::Result<Command> {
        let m = &self.members[i];
        let servers: Vec<String> = self
            .members
            .iter()
            .enumerate()
            .map(|(j, m)| format!("server.{}=127.0.0.1:{}:{}", j + 1, m.peer[0], m.peer[1]))
            .collect();
        std::fs::create_dir_all(m.dir.join("data"))?;
        std::fs::write(m.dir.join("data/myid"), format!("{}\n", i + 1))?;
        let cfg = format!(
            "tickTime=500\ninitLimit=20\nsyncLimit=10\ndataDir={}\nclientPort={}\nclientPortAddress=127.0.0.1\nmaxSessionTimeout=60000\nadmin.enableServer=false\n4lw.commands.whitelist=*\n{}\n",
            m.dir.join("data").display(),
            m.port,
            servers.join("\n")
        );
        std::fs::write(m.dir.join("zoo.cfg"), cfg)?;
        let mut cmd = Command::new("java");
        cmd.args([
            "-cp",
            "/etc/zookeeper/conf_example:/usr/share/java/zookeeper.jar",
        ])
        .arg(format!("-Dzookeeper.log.dir={}", m.dir.display()))
        .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
        .arg(m.dir.join("zoo.cfg"));
        Ok(cmd)
    }
}

/// Waits until the PostgreSQL server on `port` takes sessions.
fn pg_wait_ready(port: u16, timeout: Duration) -> io::Result<()> {
    let start = Instant::now();
    let isready = postgres_program("pg_isready")?;
    loop {
        let ready = Command::new(&isready)
            .args(["-q", "-h", "127.0.0.1", "-p", &port.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        if ready {
            return Ok(());
        }
        if start.elapsed() > timeout {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("postgres on port {port} takes no sessions after {timeout:?}"),
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A ZooKeeper four-letter word's answer ("" if none).
fn four_letter(port: u16, word: &str) -> String {
    let mut out = String::new();
    if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        if s.write_all(word.as_bytes()).is_ok() {
            let _ = s.read_to_string(&mut out);
        }
    }
    out
}

/// Whether the etcd member on `port` leads (its gRPC gateway's status).
fn etcd_is_leader(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let body = "{}";
    let req = format!(
        "POST /v3/maintenance/status HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut out = String::new();
    if s.write_all(req.as_bytes()).is_err() || s.read_to_string(&mut out).is_err() && out.is_empty()
    {
        return false;
    }
    // The body, also when it came chunked: from the first `{` to the last `}`.
    let (Some(a), Some(b)) = (out.find('{'), out.rfind('}')) else {
        return false;
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&out[a..=b]) else {
        return false;
    };
    let member = v["header"]["member_id"].as_str();
    member.is_some() && member == v["leader"].as_str()
}

/// Whether this process runs as root (memcached then needs `-u`).
fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}
