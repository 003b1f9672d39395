//! The ZooKeeper backend against the conformance suite, on the shared test
//! servers (scripts/services.sh): standalone on 2181, an ensemble on 2281–2283.

use std::sync::Arc;

use fencelock_core::backend::async_trait;
use fencelock_core::{Backend, Key, Result};
use fencelock_testkit::{Harness, conformance_tests};
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

mod standalone {
    use super::*;
    conformance_tests!("zookeeper", Zk { url: STANDALONE }, none_skipped);
}

mod ensemble {
    use super::*;
    conformance_tests!("zookeeper-ensemble", Zk { url: ENSEMBLE }, none_skipped);
}
