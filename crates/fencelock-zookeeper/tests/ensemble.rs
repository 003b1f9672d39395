//! The ensemble's leader killed while locks are held (its own test binary, so
//! that it does not share the machine with the other fault tests).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fencelock_core::Locker;
use fencelock_testkit::{ServerProcess, free_port};
use fencelock_zookeeper::ZooKeeperBackend;

/// A private 3-server ensemble.
struct Ensemble {
    client_ports: Vec<u16>,
    servers: Vec<Option<ServerProcess>>,
    _dir: tempfile::TempDir,
}

impl Ensemble {
    fn start() -> Ensemble {
        let dir = tempfile::tempdir().unwrap();
        let client_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let peers: Vec<String> = (0..3)
            .map(|i| format!("server.{}=127.0.0.1:{}:{}", i + 1, free_port(), free_port()))
            .collect();
        let mut servers = Vec::new();
        for (i, port) in client_ports.iter().enumerate() {
            let d = dir.path().join(format!("zk{i}"));
            std::fs::create_dir_all(d.join("data")).unwrap();
            std::fs::write(d.join("data/myid"), format!("{}\n", i + 1)).unwrap();
            let cfg = format!(
                "tickTime=500\ninitLimit=20\nsyncLimit=10\ndataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\nmaxSessionTimeout=60000\nadmin.enableServer=false\n4lw.commands.whitelist=*\n{}\n",
                d.join("data").display(),
                peers.join("\n")
            );
            std::fs::write(d.join("zoo.cfg"), cfg).unwrap();
            let mut cmd = Command::new("java");
            cmd.args([
                "-cp",
                "/etc/zookeeper/conf_example:/usr/share/java/zookeeper.jar",
            ])
            .arg(format!("-Dzookeeper.log.dir={}", d.display()))
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
            _dir: dir,
        };
        let start = Instant::now();
        while e.leader().is_none() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "no leader was elected"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        e
    }

    fn url(&self, session: &str) -> String {
        let hosts: Vec<String> = self
            .client_ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("zk://{}?session_timeout={session}", hosts.join(","))
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_keeps_held_locks_and_grants_follow_the_election() {
    let mut ens = Ensemble::start();
    let url = ens.url("20s");
    let a = Locker::new(ZooKeeperBackend::connect(&url).await.unwrap());
    let b = Locker::new(ZooKeeperBackend::connect(&url).await.unwrap());
    let held = a
        .lock("held")
        .ttl(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap();
    let token = held.token().unwrap();
    let leader = ens.leader().unwrap();
    ens.servers[leader].take().unwrap().kill();
    // A new grant after the election, on the surviving majority.
    let start = Instant::now();
    let other = b
        .lock("other")
        .ttl(Duration::from_secs(10))
        .wait(Duration::from_secs(30))
        .acquire()
        .await
        .expect("no grant after the election");
    println!("granted {:?} after the leader was killed", start.elapsed());
    assert!(other.token().unwrap() > token);
    // The holder's session survived the election: it still holds, and nobody else can.
    assert!(held.is_valid(), "the holder lost its lock to an election");
    assert!(
        b.lock("held").try_acquire().await.unwrap().is_none(),
        "a held lock was granted after the election"
    );
    held.release().await.unwrap();
    other.release().await.unwrap();
    b.lock("held")
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}
