//! The fault tools themselves: the proxy's modes and the server helper.

use std::net::TcpStream;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use fencelock_testkit::{FaultProxy, ServerProcess, free_port};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// An echo server; the counter says how many bytes it has received.
async fn counting_echo_server() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let received = Arc::new(AtomicUsize::new(0));
    let r = received.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let r = r.clone();
            tokio::spawn(async move {
                let mut b = [0u8; 256];
                while let Ok(n) = s.read(&mut b).await {
                    r.fetch_add(n, Ordering::SeqCst);
                    if n == 0 || s.write_all(&b[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    (addr, received)
}

async fn echo_server() -> std::net::SocketAddr {
    counting_echo_server().await.0
}

async fn round_trip(c: &mut tokio::net::TcpStream, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    c.write_all(b"x").await.ok()?;
    let mut b = [0u8; 1];
    match tokio::time::timeout(limit, c.read_exact(&mut b)).await {
        Ok(Ok(_)) => Some(start.elapsed()),
        _ => None,
    }
}

#[tokio::test]
async fn latency_blackhole_and_restore() {
    let proxy = FaultProxy::start(echo_server().await).await.unwrap();
    let mut c = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    assert!(round_trip(&mut c, Duration::from_secs(5)).await.is_some());

    proxy.set_latency(Duration::from_millis(100));
    let rtt = round_trip(&mut c, Duration::from_secs(5))
        .await
        .expect("answer with latency");
    assert!(
        rtt >= Duration::from_millis(200),
        "latency not applied both ways: {rtt:?}"
    );
    proxy.set_latency(Duration::ZERO);

    proxy.blackhole();
    assert!(
        round_trip(&mut c, Duration::from_millis(300))
            .await
            .is_none(),
        "a black-holed connection answered"
    );
    proxy.restore();
    // The byte held during the black hole arrives now, then the connection works.
    let mut b = [0u8; 1];
    tokio::time::timeout(Duration::from_secs(5), c.read_exact(&mut b))
        .await
        .unwrap()
        .unwrap();
    assert!(round_trip(&mut c, Duration::from_secs(5)).await.is_some());

    proxy.cut();
    let mut rest = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap_or(0);
    assert_eq!(n, 0, "a cut connection delivered data");
    // New connections are refused (closed) while cut, accepted after restore.
    let mut c2 = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    assert!(
        round_trip(&mut c2, Duration::from_millis(500))
            .await
            .is_none()
    );
    proxy.restore();
    let mut c3 = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    assert!(round_trip(&mut c3, Duration::from_secs(5)).await.is_some());
}

#[test]
fn server_process_starts_pauses_and_dies() {
    let port = free_port();
    let mut cmd = Command::new("python3");
    cmd.args([
        "-c",
        &format!(
            "import socket,time\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\ns.bind(('127.0.0.1',{port}))\ns.listen(16)\ntime.sleep(120)"
        ),
    ]);
    let mut server =
        ServerProcess::spawn("python listener", cmd, port, Duration::from_secs(20)).unwrap();
    let pid = server.pid().unwrap();
    server.pause().unwrap();
    let state = || {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        stat.split_whitespace().nth(2).unwrap_or("?").to_string()
    };
    let start = Instant::now();
    while state() != "T" && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(state(), "T", "SIGSTOP did not stop the server");
    server.resume().unwrap();
    server.kill();
    assert!(server.pid().is_none());
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "still listening after kill"
    );
}

#[test]
fn server_that_exits_early_is_an_error() {
    let port = free_port();
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "exit 3"]);
    let err = ServerProcess::spawn("quitter", cmd, port, Duration::from_secs(5))
        .err()
        .unwrap();
    assert!(err.to_string().contains("exited early"), "{err}");
}

#[tokio::test]
async fn dropped_replies_reach_the_server_but_not_the_client() {
    let (upstream, received) = counting_echo_server().await;
    let proxy = FaultProxy::start(upstream).await.unwrap();
    let mut c = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    assert!(round_trip(&mut c, Duration::from_secs(5)).await.is_some());
    let before = received.load(Ordering::SeqCst);
    proxy.drop_replies();
    assert!(
        round_trip(&mut c, Duration::from_millis(300))
            .await
            .is_none(),
        "a reply got through"
    );
    assert_eq!(
        received.load(Ordering::SeqCst),
        before + 1,
        "the request did not reach the server"
    );
    proxy.cut();
    let mut rest = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap_or(0);
    assert_eq!(n, 0, "the held reply was delivered after a cut");
}
