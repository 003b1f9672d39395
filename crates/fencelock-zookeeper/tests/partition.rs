//! A follower cut off from the rest of the ensemble keeps serving its clients'
//! reads for syncLimit × tickTime, while the leader expires the sessions of
//! that follower's clients after their session timeout. A holder connected to
//! such a follower must not renew from those stale reads ("the node is still
//! there") and believe its lock valid after the leader has deleted the node
//! and granted the lock to a client on the majority side.
//!
//! The quorum and election links go through FaultProxies (one per ordered pair
//! of servers, each server's config naming its peers by their proxy), so one
//! follower can be partitioned from its peers while its client port stays up.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fencelock_core::Locker;
use fencelock_testkit::{FaultProxy, ServerProcess, free_port};
use fencelock_zookeeper::ZooKeeperBackend;

struct Ensemble {
    client_ports: Vec<u16>,
    servers: Vec<Option<ServerProcess>>,
    /// proxies[i][j]: how server i reaches server j (quorum, election); None on the diagonal.
    proxies: Vec<Vec<Option<(FaultProxy, FaultProxy)>>>,
    _dir: tempfile::TempDir,
}

impl Ensemble {
    async fn start(tick_ms: u64, sync_limit: u32) -> Ensemble {
        let dir = tempfile::tempdir().unwrap();
        let client_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let quorum: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let election: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let mut proxies: Vec<Vec<Option<(FaultProxy, FaultProxy)>>> = Vec::new();
        for i in 0..3 {
            let mut row = Vec::new();
            for j in 0..3 {
                if i == j {
                    row.push(None);
                } else {
                    let q = FaultProxy::start(format!("127.0.0.1:{}", quorum[j]).parse().unwrap())
                        .await
                        .unwrap();
                    let e =
                        FaultProxy::start(format!("127.0.0.1:{}", election[j]).parse().unwrap())
                            .await
                            .unwrap();
                    row.push(Some((q, e)));
                }
            }
            proxies.push(row);
        }
        let mut servers = Vec::new();
        for (i, port) in client_ports.iter().enumerate() {
            let d = dir.path().join(format!("zk{i}"));
            std::fs::create_dir_all(d.join("data")).unwrap();
            std::fs::write(d.join("data/myid"), format!("{}\n", i + 1)).unwrap();
            let peers: Vec<String> = (0..3)
                .map(|j| {
                    if i == j {
                        format!("server.{}=127.0.0.1:{}:{}", j + 1, quorum[j], election[j])
                    } else {
                        let (q, e) = proxies[i][j].as_ref().unwrap();
                        format!(
                            "server.{}=127.0.0.1:{}:{}",
                            j + 1,
                            q.addr().port(),
                            e.addr().port()
                        )
                    }
                })
                .collect();
            let cfg = format!(
                "tickTime={tick_ms}\ninitLimit=20\nsyncLimit={sync_limit}\ndataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\nmaxSessionTimeout=60000\nadmin.enableServer=false\n4lw.commands.whitelist=*\nreconfigEnabled=false\n{}\n",
                d.join("data").display(),
                peers.join("\n")
            );
            std::fs::write(d.join("zoo.cfg"), cfg).unwrap();
            let mut cmd = Command::new("java");
            cmd.args([
                "-cp",
                // With a log4j binding (libzookeeper-java's dependencies):
                // the members' logs say why, should an ensemble not form.
                "/etc/zookeeper/conf_example:/usr/share/java/zookeeper.jar:\
                 /usr/share/java/slf4j-log4j12.jar:/usr/share/java/log4j-1.2.jar",
            ])
            .arg(format!("-Dzookeeper.log.dir={}", d.display()))
            .arg("-Dzookeeper.root.logger=INFO,ROLLINGFILE")
            .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
            .arg(d.join("zoo.cfg"))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
            servers.push(Some(
                ServerProcess::spawn("zookeeper", cmd, *port, Duration::from_secs(60)).unwrap(),
            ));
        }
        let e = Ensemble {
            client_ports,
            servers,
            proxies,
            _dir: dir,
        };
        let start = Instant::now();
        loop {
            let modes: Vec<Option<String>> = (0..3).map(|i| e.mode(i)).collect();
            let leaders = modes
                .iter()
                .filter(|m| m.as_deref() == Some("leader"))
                .count();
            let followers = modes
                .iter()
                .filter(|m| m.as_deref() == Some("follower"))
                .count();
            if leaders == 1 && followers == 2 {
                break;
            }
            if start.elapsed() > Duration::from_secs(90) {
                // Say why: the end of each member's log.
                for (i, mode) in modes.iter().enumerate() {
                    let log = e._dir.path().join(format!("zk{i}/zookeeper.log"));
                    let text = std::fs::read_to_string(&log).unwrap_or_default();
                    let tail: Vec<&str> = text.lines().rev().take(15).collect();
                    eprintln!("--- server {} ({mode:?}):", i + 1);
                    tail.iter().rev().for_each(|l| eprintln!("{l}"));
                }
                panic!("no ensemble formed: {modes:?}");
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        e
    }

    fn mode(&self, i: usize) -> Option<String> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.client_ports[i])).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        s.write_all(b"srvr").ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        out.lines()
            .find_map(|l| l.strip_prefix("Mode: ").map(str::to_string))
    }

    fn leader(&self) -> Option<usize> {
        (0..3).find(|i| self.servers[*i].is_some() && self.mode(*i).as_deref() == Some("leader"))
    }

    /// Cuts server `f` off from both peers (packets vanish both ways).
    fn isolate(&self, f: usize) {
        for j in 0..3 {
            if j == f {
                continue;
            }
            for (a, b) in [(f, j), (j, f)] {
                let (q, e) = self.proxies[a][b].as_ref().unwrap();
                q.blackhole();
                e.blackhole();
            }
        }
    }

    fn url(&self, servers: &[usize], session: &str) -> String {
        let hosts: Vec<String> = servers
            .iter()
            .map(|i| format!("127.0.0.1:{}", self.client_ports[*i]))
            .collect();
        format!("zk://{}?session_timeout={session}", hosts.join(","))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_on_a_partitioned_follower_loses_its_lock_before_the_majority_grants_it() {
    // syncLimit × tickTime = 6 s: how long a cut-off follower keeps serving.
    let ens = Ensemble::start(500, 12).await;
    let leader = ens.leader().unwrap();
    let follower = (0..3).find(|i| *i != leader).unwrap();
    let others: Vec<usize> = (0..3).filter(|i| *i != follower).collect();
    println!(
        "leader = server {}, isolating follower server {}",
        leader + 1,
        follower + 1
    );

    let a = Locker::new(
        ZooKeeperBackend::connect(&ens.url(&[follower], "10s"))
            .await
            .unwrap(),
    );
    let b = Locker::new(
        ZooKeeperBackend::connect(&ens.url(&others, "10s"))
            .await
            .unwrap(),
    );
    // A hold of a 2 s TTL: its own 2 s session (on the follower).
    let ga = a
        .lock("k")
        .ttl(Duration::from_secs(2))
        .acquire()
        .await
        .unwrap();
    let token_a = ga.token().unwrap();
    // Let a couple of renewals go by normally.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(ga.is_valid());

    let cut = Instant::now();
    ens.isolate(follower);
    let gb = b
        .lock("k")
        .ttl(Duration::from_secs(2))
        .wait(Duration::from_secs(60))
        .acquire()
        .await
        .expect("the majority never granted the lock");
    let granted = cut.elapsed();
    let a_valid_at_grant = ga.is_valid();
    println!(
        "B granted {granted:?} after the cut (token {} > A's {}); A valid then: {a_valid_at_grant}",
        gb.token().unwrap().get(),
        token_a.get()
    );
    // How long does A go on believing?
    let mut overlap = Duration::ZERO;
    let grant_instant = Instant::now();
    while ga.is_valid() && gb.is_valid() {
        overlap = grant_instant.elapsed();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "A stayed valid {overlap:?} beside B (A lost: {:?}); A deadline was {:?} after the cut",
        ga.lease().lost_reason(),
        ga.deadline().into_std().saturating_duration_since(cut)
    );
    assert!(
        !a_valid_at_grant,
        "double grant: B was granted {granted:?} after the cut while A (on the cut-off follower) \
         still believed its lock valid, and kept believing it for another {overlap:?}"
    );
}
