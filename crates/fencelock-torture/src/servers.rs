//! Private servers the tool starts itself — the only servers whose processes
//! it kills and restarts. Each runs on free loopback ports with its data in a
//! temporary directory, and is killed when the campaign ends.

use std::io::{self, Read, Write as _};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fencelock_testkit::{ServerProcess, free_port};

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
}

impl SpawnKind {
    /// Every kind, with its name on the command line.
    pub const ALL: [(&'static str, SpawnKind); 5] = [
        ("redis", SpawnKind::Redis),
        ("redlock", SpawnKind::Redlock),
        ("memcached", SpawnKind::Memcached),
        ("etcd", SpawnKind::Etcd),
        ("zookeeper", SpawnKind::Zookeeper),
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
            SpawnKind::Redis | SpawnKind::Memcached => 1,
            SpawnKind::Redlock => 5,
            SpawnKind::Etcd | SpawnKind::Zookeeper => 3,
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
            _dir: dir,
        };
        for i in 0..n {
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
        let port = m.port.to_string();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(m.dir.with_extension("log"))?;
        let mut cmd;
        let name;
        match self.kind {
            SpawnKind::Redis | SpawnKind::Redlock => {
                name = "redis-server";
                cmd = Command::new(name);
                cmd.args(["--bind", "127.0.0.1", "--port", &port, "--save", ""])
                    .args(["--appendonly", "yes", "--appendfsync", "always"])
                    .arg("--dir")
                    .arg(&m.dir);
            }
            SpawnKind::Memcached => {
                name = "memcached";
                cmd = Command::new(name);
                cmd.args(["-l", "127.0.0.1", "-p", &port, "-U", "0", "-m", "16"]);
                if running_as_root() {
                    cmd.args(["-u", "memcache"]);
                }
            }
            SpawnKind::Etcd => {
                name = "etcd";
                let initial: Vec<String> = self
                    .members
                    .iter()
                    .enumerate()
                    .map(|(j, m)| format!("m{j}=http://127.0.0.1:{}", m.peer[0]))
                    .collect();
                let client = format!("http://127.0.0.1:{port}");
                let peer = format!("http://127.0.0.1:{}", m.peer[0]);
                cmd = Command::new(name);
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
            }
            SpawnKind::Zookeeper => {
                name = "zookeeper";
                let servers: Vec<String> = self
                    .members
                    .iter()
                    .enumerate()
                    .map(|(j, m)| format!("server.{}=127.0.0.1:{}:{}", j + 1, m.peer[0], m.peer[1]))
                    .collect();
                std::fs::create_dir_all(m.dir.join("data"))?;
                std::fs::write(m.dir.join("data/myid"), format!("{}\n", i + 1))?;
                let cfg = format!(
                    "tickTime=500\ninitLimit=20\nsyncLimit=10\ndataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\nmaxSessionTimeout=60000\nadmin.enableServer=false\n4lw.commands.whitelist=*\n{}\n",
                    m.dir.join("data").display(),
                    servers.join("\n")
                );
                std::fs::write(m.dir.join("zoo.cfg"), cfg)?;
                cmd = Command::new("java");
                cmd.args([
                    "-cp",
                    "/etc/zookeeper/conf_example:/usr/share/java/zookeeper.jar",
                ])
                .arg(format!("-Dzookeeper.log.dir={}", m.dir.display()))
                .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
                .arg(m.dir.join("zoo.cfg"));
            }
        }
        cmd.stdout(Stdio::null()).stderr(log);
        let process = ServerProcess::spawn(name, cmd, m.port, Duration::from_secs(60))?;
        self.members[i].process = Some(process);
        Ok(())
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
