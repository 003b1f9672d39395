//! The etcd backend against the conformance suite, on the shared test servers
//! (scripts/services.sh): standalone on 2379, a 3-member cluster on 2479–2679.

use std::sync::Arc;

use fencelock_core::backend::async_trait;
use fencelock_core::{Backend, Key, Result};
use fencelock_etcd::EtcdBackend;
use fencelock_testkit::{Harness, conformance_tests};

const STANDALONE: &str = "etcd://127.0.0.1:2379?session_ttl=2s";
const CLUSTER: &str = "etcd://127.0.0.1:2479,127.0.0.1:2579,127.0.0.1:2679?session_ttl=2s";

struct Etcd {
    url: &'static str,
}

#[async_trait]
impl Harness for Etcd {
    async fn backend(&self) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(EtcdBackend::connect(self.url).await?))
    }

    async fn steal(&self, key: &Key) -> Result<()> {
        EtcdBackend::connect(self.url)
            .await?
            .force_release(key)
            .await
    }
}

mod standalone {
    use super::*;
    conformance_tests!("etcd", Etcd { url: STANDALONE }, none_skipped);
}

mod cluster {
    use super::*;
    conformance_tests!("etcd-cluster", Etcd { url: CLUSTER }, none_skipped);
}

/// Keys are raw path segments (the layout of `etcdctl lock`), so a lock
/// named `a` must not count the keys of a lock named `a/b` as its queue, and
/// listing by prefix names each lock once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_whose_names_nest_stay_apart_and_list_by_prefix() {
    use fencelock_core::Locker;
    let base = format!("nest-{}", std::process::id());
    let (a, b) = (
        Locker::new(EtcdBackend::connect(STANDALONE).await.unwrap()),
        Locker::new(EtcdBackend::connect(STANDALONE).await.unwrap()),
    );
    let deep = a.lock(format!("{base}/b")).acquire().await.unwrap();
    let sibling = a.lock(format!("{base}b")).acquire().await.unwrap();
    let top = b
        .lock(&base)
        .try_acquire()
        .await
        .unwrap()
        .expect("a lock was blocked by a lock whose name extends it");
    let listed: Vec<String> = b
        .list(&base)
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.key)
        .collect();
    assert_eq!(
        listed,
        [base.clone(), format!("{base}/b"), format!("{base}b")]
    );
    for g in [top, deep, sibling] {
        g.release().await.unwrap();
    }
    assert!(b.list(&base).await.unwrap().is_empty());
}

/// A holder's time left is its lease's: what remains of the session TTL,
/// which keepalives renew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_the_time_left_of_the_holders_lease() {
    use fencelock_core::Locker;
    use std::time::Duration;
    let url = "etcd://127.0.0.1:2379?session_ttl=10s";
    let (a, b) = (
        Locker::new(EtcdBackend::connect(url).await.unwrap()),
        Locker::new(EtcdBackend::connect(url).await.unwrap()),
    );
    let key = format!("left-{}", std::process::id());
    let g = a.lock(&key).acquire().await.unwrap();
    let info = b
        .inspect(&key)
        .await
        .unwrap()
        .expect("inspect found nothing");
    let left = info.holders[0].expires_in;
    assert!(
        left.is_some_and(|d| d >= Duration::from_secs(1) && d <= Duration::from_secs(10)),
        "time left {left:?}, the session TTL is 10 s"
    );
    let listed = b.list(&key).await.unwrap();
    assert!(
        listed[0].holders[0].expires_in.is_some(),
        "list shows no time left"
    );
    g.release().await.unwrap();
}
