//! A chroot in the URL that the server does not have: the connect fails at
//! once, naming the chroot, as a configuration error (no wait cures it).

use fencelock_core::Error;
use fencelock_zookeeper::ZooKeeperBackend;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_chroot_is_named() {
    let url = format!("zk://127.0.0.1:2181/no-such-chroot-{}", std::process::id());
    let e = ZooKeeperBackend::connect(&url)
        .await
        .expect_err("connected under a chroot that does not exist");
    assert!(
        matches!(e, Error::InvalidConfig { .. }) && e.to_string().contains("chroot"),
        "{e:?}"
    );
}
