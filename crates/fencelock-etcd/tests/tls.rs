//! `etcds://`: a private etcd serving TLS with a certificate of a throw-away
//! CA (made with the openssl command). With `ca=` the backend verifies the
//! server and locks work; without it, or in plain text, it is refused.
#![cfg(feature = "tls")]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use fencelock_core::{Error, Locker};
use fencelock_etcd::EtcdBackend;
use fencelock_testkit::{ServerProcess, free_port};

fn openssl(dir: &Path, args: &[&str]) {
    let ok = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("the openssl command")
        .success();
    assert!(ok, "openssl {args:?} failed");
}

/// A CA and a server certificate for 127.0.0.1 signed by it.
fn certificates(dir: &Path) {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec![
        "req",
        "-x509",
        "-days",
        "1",
        "-subj",
        "/CN=fencelock test CA",
    ];
    ca.extend(ec);
    ca.extend(["-keyout", "ca.key", "-out", "ca.pem"]);
    openssl(dir, &ca);
    let mut csr = vec!["req", "-subj", "/CN=localhost"];
    csr.extend(ec);
    csr.extend(["-keyout", "server.key", "-out", "server.csr"]);
    openssl(dir, &csr);
    std::fs::write(
        dir.join("ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-days",
            "1",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-extfile",
            "ext",
            "-out",
            "server.pem",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcds_verifies_the_server_with_the_given_ca() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    certificates(d);
    let (port, peer) = (free_port(), free_port());
    let mut cmd = Command::new("etcd");
    cmd.args(["--name", "tls", "--data-dir"])
        .arg(d.join("data"))
        .arg("--listen-client-urls")
        .arg(format!("https://127.0.0.1:{port}"))
        .arg("--advertise-client-urls")
        .arg(format!("https://127.0.0.1:{port}"))
        .arg("--listen-peer-urls")
        .arg(format!("http://127.0.0.1:{peer}"))
        .arg("--initial-advertise-peer-urls")
        .arg(format!("http://127.0.0.1:{peer}"))
        .arg("--initial-cluster")
        .arg(format!("tls=http://127.0.0.1:{peer}"))
        .arg("--cert-file")
        .arg(d.join("server.pem"))
        .arg("--key-file")
        .arg(d.join("server.key"))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let _etcd = ServerProcess::spawn("etcd", cmd, port, Duration::from_secs(30)).unwrap();

    let ca = d.join("ca.pem");
    let url = format!(
        "etcds://127.0.0.1:{port}?ca={}&session_ttl=2s&connect_timeout=3s",
        ca.display()
    );
    let locker = Locker::new(EtcdBackend::connect(&url).await.expect("TLS with the CA"));
    let g = locker.lock("over-tls").acquire().await.unwrap();
    assert!(g.token().is_some());
    let other = Locker::new(EtcdBackend::connect(&url).await.unwrap());
    assert!(
        other
            .lock("over-tls")
            .try_acquire()
            .await
            .unwrap()
            .is_none(),
        "a held lock was granted over TLS"
    );
    g.release().await.unwrap();

    // No CA to trust the server's certificate: refused, as a connection error.
    let e = EtcdBackend::connect(&format!(
        "etcds://127.0.0.1:{port}?session_ttl=2s&connect_timeout=3s"
    ))
    .await
    .unwrap_err();
    assert!(matches!(e, Error::Connection { .. }), "{e:?}");
    // Plain text to a TLS port: refused.
    let e = EtcdBackend::connect(&format!(
        "etcd://127.0.0.1:{port}?session_ttl=2s&connect_timeout=3s"
    ))
    .await
    .unwrap_err();
    assert!(matches!(e, Error::Connection { .. }), "{e:?}");
    // A missing CA file is named.
    let e = EtcdBackend::connect(&format!("etcds://127.0.0.1:{port}?ca=/nonexistent.pem"))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("/nonexistent.pem"), "{e}");
}
