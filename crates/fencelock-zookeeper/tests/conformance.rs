//! The ZooKeeper backend against the conformance suite, on the shared test
//! servers (scripts/services.sh): standalone on 2181, an ensemble on 2281–2283.

use std::sync::Arc;

use fencelock_core::{Backend, Key, Result, async_trait};
use fencelock_testkit::{Harness, run_conformance};
use fencelock_zookeeper::ZooKeeperBackend;

const STANDALONE: &str = "zk://127.0.0.1:2181?session_timeout=3s";
const ENSEMBLE: &str = "zk://127.0.0.1:2281,127.0.0.1:2282,127.0.0.1:2283?session_timeout=3s";

struct Zk {
    url: &'static str,
}

#[async_trait]
impl Harness for Zk {
    async fn backend(&self) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(ZooKeeperBackend::connect(self.url).await?))
    }

    async fn steal(&self, key: &Key) -> Result<()> {
        ZooKeeperBackend::connect(self.url)
            .await?
            .force_release(key)
            .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_zookeeper_passes_the_conformance_suite() {
    let report = run_conformance("zookeeper", Zk { url: STANDALONE }).await;
    report.assert_passed();
    assert!(
        report.skipped().is_empty(),
        "skipped: {:?}",
        report.skipped()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_ensemble_passes_the_conformance_suite() {
    let report = run_conformance("zookeeper-ensemble", Zk { url: ENSEMBLE }).await;
    report.assert_passed();
    assert!(
        report.skipped().is_empty(),
        "skipped: {:?}",
        report.skipped()
    );
}
