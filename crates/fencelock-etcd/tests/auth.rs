//! A user and password in the URL log in with etcd's authentication, on a
//! private server with auth enabled; a wrong password is refused at connect
//! with a message saying what to check, and never shows the password.

mod support;

use etcd_client::Client;
use fencelock_core::{Error, Locker};
use fencelock_etcd::EtcdBackend;
use support::Cluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_and_password_in_the_url_log_in() {
    let etcd = Cluster::start(1).await;
    let mut admin = Client::connect([etcd.endpoint(0)], None).await.unwrap();
    admin.role_add("root").await.unwrap();
    admin.user_add("root", "s3cret-pw", None).await.unwrap();
    admin.user_grant_role("root", "root").await.unwrap();
    admin.auth_enable().await.unwrap();

    let url = |auth: &str| format!("etcd://{auth}{}?session_ttl=2s", etcd.endpoint(0));
    let locker = Locker::new(EtcdBackend::connect(&url("root:s3cret-pw@")).await.unwrap());
    let g = locker.lock("with-auth").acquire().await.unwrap();
    assert!(g.token().is_some());
    g.release().await.unwrap();

    let e = EtcdBackend::connect(&url("root:wrong-pw@"))
        .await
        .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Connection { .. }), "{e:?}");
    assert!(msg.contains("user and password"), "{msg}");
    assert!(!msg.contains("wrong-pw"), "{msg}");
    // Without credentials no lock is granted (etcd 3.4 grants leases to
    // anyone, so the refusal may come at the first acquire).
    let refused = match EtcdBackend::connect(&url("")).await {
        Err(e) => e,
        Ok(b) => Locker::new(b)
            .lock("with-auth")
            .acquire()
            .await
            .unwrap_err(),
    };
    assert!(
        refused.to_string().contains("user and password"),
        "{refused}"
    );
}
