//! `rediss://`: locks over TLS to a private redis-server with a self-signed
//! certificate (generated here with openssl).
#![cfg(feature = "tls")]

use std::process::{Command, Stdio};
use std::time::Duration;

use fencelock_core::Locker;
use fencelock_redis::RedisBackend;
use fencelock_testkit::{ServerProcess, free_port};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_work_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    let openssl = |args: &[&str]| {
        let status = Command::new("openssl")
            .args(args)
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("openssl");
        assert!(status.success(), "openssl {args:?} failed");
    };
    // A throw-away CA, and a server certificate for 127.0.0.1 signed by it.
    std::fs::write(path("san.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=fencelock test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ]);
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "san.ext",
        "-out",
        "server.pem",
    ]);
    let (cert, key, ca) = (path("server.pem"), path("server.key"), path("ca.pem"));
    let port = free_port();
    let mut cmd = Command::new("redis-server");
    cmd.args([
        "--port",
        "0",
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ])
    .args(["--tls-port", &port.to_string(), "--tls-auth-clients", "no"])
    .arg("--tls-cert-file")
    .arg(&cert)
    .arg("--tls-key-file")
    .arg(&key)
    .arg("--tls-ca-cert-file")
    .arg(&ca)
    .arg("--dir")
    .arg(dir.path())
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    let _server =
        ServerProcess::spawn("redis-server (TLS)", cmd, port, Duration::from_secs(20)).unwrap();

    let url = format!("rediss://127.0.0.1:{port}/?tls_ca={}", ca.display());
    let locker = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let a = locker.lock("k").acquire().await.unwrap();
    assert!(locker.lock("k").try_acquire().await.unwrap().is_none());
    let t = a.token().unwrap();
    a.release().await.unwrap();
    let b = locker.lock("k").acquire().await.unwrap();
    assert!(b.token().unwrap() > t);
    b.release().await.unwrap();

    // Without the CA the server's certificate is not trusted.
    let untrusted =
        RedisBackend::connect(&format!("rediss://127.0.0.1:{port}/?connect_timeout=2s")).await;
    assert!(untrusted.is_err(), "an unverified certificate was accepted");
    // A plain-text client cannot talk to the TLS port.
    let plain = RedisBackend::connect(&format!(
        "redis://127.0.0.1:{port}/?timeout=1s&connect_timeout=1s"
    ))
    .await;
    assert!(plain.is_err(), "plain text worked on a TLS port");
}
