//! A client whose link goes silent (a paused VM, a cable pulled without a
//! FIN) in the middle of what it sends holds nothing on the server that
//! keeps other clients from connecting or locking.

mod support;

use std::time::Duration;

use fencelock_core::Locker;
use fencelock_postgres::PostgresBackend;
use fencelock_testkit::FaultProxy;
use support::PrivatePostgres;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_frozen_during_its_schema_setup_blocks_nobody() {
    let pg = PrivatePostgres::start();
    let direct = pg.url("lease");
    let port: u16 = direct
        .split("127.0.0.1:")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .and_then(|p| p.parse().ok())
        .unwrap();
    let proxy = FaultProxy::start(([127, 0, 0, 1], port).into())
        .await
        .unwrap();
    let via_proxy = direct.replace(&format!(":{port}/"), &format!(":{}/", proxy.addr().port()));
    // Every message takes 300 ms each way: the setup is under way when the
    // link goes silent.
    proxy.set_latency(Duration::from_millis(300));
    let frozen = tokio::spawn(async move { PostgresBackend::connect(&via_proxy).await });
    tokio::time::sleep(Duration::from_secs(3)).await;
    proxy.blackhole();
    let other = tokio::time::timeout(Duration::from_secs(60), async {
        let b = PostgresBackend::connect(&direct).await?;
        Locker::new(b).lock("k").try_acquire().await
    })
    .await
    .expect("connect and lock blocked for 60 s behind a client frozen in its schema setup");
    assert!(
        matches!(other, Ok(Some(_))),
        "the other client could not lock: {other:?}"
    );
    frozen.abort();
}
