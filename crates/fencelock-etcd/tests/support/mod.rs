//! What the etcd fault tests share: the [`FaultHarness`] (fenced writes go to
//! an etcd key guarded by a transaction) and private etcd members started from
//! a temporary directory, to kill and restart.
#![allow(dead_code)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp};
use fencelock_core::backend::async_trait;
use fencelock_core::{Error, FencingToken, Locker, Result};
use fencelock_etcd::EtcdBackend;
use fencelock_testkit::faults::FaultHarness;
use fencelock_testkit::{ServerProcess, free_port};

/// The shared standalone server of scripts/services.sh.
pub const SHARED: &str = "etcd://127.0.0.1:2379?session_ttl=2s";

pub struct Etcd;

#[async_trait]
impl FaultHarness for Etcd {
    async fn locker(&self, url: &str) -> Result<Locker> {
        Ok(Locker::new(EtcdBackend::connect(url).await?))
    }

    async fn fenced_write(&self, key: &str, token: FencingToken) -> Result<bool> {
        fenced_write("127.0.0.1:2379", key, token.get(), "written").await
    }
}

/// Writes `data` to the resource `key` protects if `token` is larger than
/// every token written before (tokens zero-padded, so etcd's byte order is
/// numeric order). True if written.
pub async fn fenced_write(endpoint: &str, key: &str, token: u64, data: &str) -> Result<bool> {
    let fail = |e: etcd_client::Error| Error::backend("etcd", e);
    let mut c = Client::connect([endpoint], None).await.map_err(fail)?;
    let fence = format!("resource/{key}/fence");
    c.txn(
        Txn::new()
            .when([Compare::version(fence.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(fence.as_str(), format!("{:020}", 0), None)]),
    )
    .await
    .map_err(fail)?;
    let padded = format!("{token:020}");
    let r = c
        .txn(
            Txn::new()
                .when([Compare::value(
                    fence.as_str(),
                    CompareOp::Less,
                    padded.as_str(),
                )])
                .and_then([
                    TxnOp::put(fence.as_str(), padded.as_str(), None),
                    TxnOp::put(format!("resource/{key}/data"), data, None),
                ]),
        )
        .await
        .map_err(fail)?;
    Ok(r.succeeded())
}

/// The data of the resource `key` protects.
pub async fn resource(endpoint: &str, key: &str) -> Option<String> {
    let mut c = Client::connect([endpoint], None).await.ok()?;
    let r = c.get(format!("resource/{key}/data"), None).await.ok()?;
    r.kvs()
        .first()
        .map(|kv| String::from_utf8_lossy(kv.value()).into_owned())
}

/// One member of a private cluster.
struct Member {
    name: String,
    client: u16,
    peer: u16,
    process: Option<ServerProcess>,
}

/// A private etcd cluster of 1 or 3 members, on free ports, stopped on drop.
pub struct Cluster {
    members: Vec<Member>,
    dir: tempfile::TempDir,
}

impl Cluster {
    pub async fn start(n: usize) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let members: Vec<Member> = (0..n)
            .map(|i| Member {
                name: format!("m{i}"),
                client: free_port(),
                peer: free_port(),
                process: None,
            })
            .collect();
        let mut c = Cluster { members, dir };
        for i in 0..n {
            c.spawn(i, "new");
        }
        c.wait_leader().await;
        c
    }

    fn spawn(&mut self, i: usize, state: &str) {
        let initial: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer))
            .collect();
        let m = &self.members[i];
        let data = self.dir.path().join(&m.name);
        let log = std::fs::File::create(self.dir.path().join(format!("{}.log", m.name))).unwrap();
        let mut cmd = Command::new("etcd");
        cmd.arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&data)
            .arg("--listen-client-urls")
            .arg(format!("http://127.0.0.1:{}", m.client))
            .arg("--advertise-client-urls")
            .arg(format!("http://127.0.0.1:{}", m.client))
            .arg("--listen-peer-urls")
            .arg(format!("http://127.0.0.1:{}", m.peer))
            .arg("--initial-advertise-peer-urls")
            .arg(format!("http://127.0.0.1:{}", m.peer))
            .arg("--initial-cluster")
            .arg(initial.join(","))
            .arg("--initial-cluster-state")
            .arg(state)
            .arg("--initial-cluster-token")
            .arg(format!("fencelock-test-{}", self.members[0].client))
            .stdout(Stdio::null())
            .stderr(log);
        let port = self.members[i].client;
        self.members[i].process = Some(
            ServerProcess::spawn("etcd", cmd, port, Duration::from_secs(30))
                .expect("etcd (Debian etcd-server; scripts/services.sh installs it)"),
        );
    }

    pub fn endpoint(&self, i: usize) -> String {
        format!("127.0.0.1:{}", self.members[i].client)
    }

    /// `etcd://` with every member and the given query.
    pub fn url(&self, query: &str) -> String {
        let hosts: Vec<String> = (0..self.members.len()).map(|i| self.endpoint(i)).collect();
        format!("etcd://{}?{query}", hosts.join(","))
    }

    pub fn kill(&mut self, i: usize) {
        if let Some(mut p) = self.members[i].process.take() {
            p.kill();
        }
    }

    /// Kills member `i` and starts it again on its data.
    pub async fn restart(&mut self, i: usize) {
        self.kill(i);
        self.spawn(i, "existing");
        self.wait_leader().await;
    }

    /// The index of the member that leads, waiting up to 30 s for an election.
    pub async fn wait_leader(&self) -> usize {
        let start = Instant::now();
        loop {
            if let Some(i) = self.leader().await {
                return i;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no etcd leader within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn leader(&self) -> Option<usize> {
        {
            for (i, m) in self.members.iter().enumerate() {
                if m.process.is_none() {
                    continue;
                }
                let Ok(Ok(mut c)) = tokio::time::timeout(
                    Duration::from_secs(1),
                    Client::connect([self.endpoint(i)], None),
                )
                .await
                else {
                    continue;
                };
                if let Ok(Ok(s)) = tokio::time::timeout(Duration::from_secs(1), c.status()).await
                    && s.leader() != 0
                    && s.header().is_some_and(|h| h.member_id() == s.leader())
                {
                    return Some(i);
                }
            }
            None
        }
    }
}
