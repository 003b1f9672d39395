//! Private Redis servers for fault tests: single servers, and a 3-master
//! cluster whose nodes announce fault proxies, so that a test can cut, slow or
//! black-hole the way to one primary (and SIGSTOP it) without touching the
//! shared servers.
#![allow(dead_code)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fencelock_testkit::{FaultProxy, ServerProcess, free_port};
use redis::aio::MultiplexedConnection;

/// A throw-away redis-server on `port` (no persistence: a restart comes back empty).
pub fn redis_on(port: u16, extra: &[&str]) -> ServerProcess {
    let dir = std::env::temp_dir().join(format!("fencelock-redis-test-{port}"));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::create_dir_all(&dir);
    let mut cmd = Command::new("redis-server");
    cmd.args([
        "--bind",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--save",
        "",
        "--appendonly",
        "no",
    ])
    .arg("--dir")
    .arg(&dir)
    .args(extra)
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    ServerProcess::spawn("redis-server", cmd, port, Duration::from_secs(20))
        .expect("start redis-server")
}

/// A plain connection to `127.0.0.1:port`, around every proxy.
pub async fn direct(port: u16) -> MultiplexedConnection {
    redis::Client::open(format!("redis://127.0.0.1:{port}").as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Three primaries, each reached through its own proxy: the nodes announce the
/// proxies' ports, so a cluster client talks to them only through the proxies.
/// Nodes do not fail each other over a long pause (node timeout 60 s), and a
/// stalled primary does not stop the others (`cluster-require-full-coverage no`).
pub struct PrivateCluster {
    pub servers: Vec<ServerProcess>,
    pub proxies: Vec<FaultProxy>,
    pub ports: Vec<u16>,
}

impl PrivateCluster {
    pub async fn start() -> PrivateCluster {
        let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let buses: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let mut proxies = Vec::new();
        for p in &ports {
            proxies.push(
                FaultProxy::start(format!("127.0.0.1:{p}").parse().unwrap())
                    .await
                    .unwrap(),
            );
        }
        let mut servers = Vec::new();
        for i in 0..3 {
            let (port, bus) = (ports[i].to_string(), buses[i].to_string());
            let announce = proxies[i].addr().port().to_string();
            servers.push(redis_on(
                ports[i],
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &format!("nodes-{port}.conf"),
                    "--cluster-port",
                    &bus,
                    "--cluster-announce-ip",
                    "127.0.0.1",
                    "--cluster-announce-port",
                    &announce,
                    "--cluster-announce-bus-port",
                    &bus,
                    "--cluster-node-timeout",
                    "60000",
                    "--cluster-require-full-coverage",
                    "no",
                ],
            ));
        }
        let ranges = [(0, 5460), (5461, 10922), (10923, 16383)];
        for (i, (lo, hi)) in ranges.iter().enumerate() {
            let _: () = redis::cmd("CLUSTER")
                .arg("ADDSLOTSRANGE")
                .arg(lo)
                .arg(hi)
                .query_async(&mut direct(ports[i]).await)
                .await
                .unwrap();
        }
        let mut first = direct(ports[0]).await;
        for i in 1..3 {
            let _: () = redis::cmd("CLUSTER")
                .arg("MEET")
                .arg("127.0.0.1")
                .arg(ports[i])
                .arg(buses[i])
                .query_async(&mut first)
                .await
                .unwrap();
        }
        let start = Instant::now();
        'wait: loop {
            assert!(
                start.elapsed() < Duration::from_secs(90),
                "the private cluster never reached cluster_state:ok"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
            for p in &ports {
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query_async(&mut direct(*p).await)
                    .await
                    .unwrap();
                if !info.contains("cluster_state:ok") || !info.contains("cluster_known_nodes:3") {
                    continue 'wait;
                }
            }
            break;
        }
        PrivateCluster {
            servers,
            proxies,
            ports,
        }
    }

    /// The URL a client uses (through the proxies), with `query` appended.
    pub fn url(&self, query: &str) -> String {
        let hosts: Vec<String> = self.proxies.iter().map(|p| p.addr().to_string()).collect();
        format!("redis+cluster://{}{query}", hosts.join(","))
    }

    /// Which node (index) serves the Redis key `name`.
    pub async fn node_of(&self, name: &str) -> usize {
        let slot: i64 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(name)
            .query_async(&mut direct(self.ports[0]).await)
            .await
            .unwrap();
        match slot {
            0..=5460 => 0,
            5461..=10922 => 1,
            _ => 2,
        }
    }
}
