//! The memcached backend against the conformance suite, on the shared test
//! server (scripts/services.sh): every case its capabilities allow.

use std::sync::Arc;

use fencelock_core::{Backend, Key, Result, async_trait};
use fencelock_memcached::MemcachedBackend;
use fencelock_testkit::{Harness, run_conformance};

const URL: &str = "memcached://127.0.0.1:11211";

struct Memcached;

#[async_trait]
impl Harness for Memcached {
    async fn backend(&self) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(MemcachedBackend::connect(URL).await?))
    }

    async fn steal(&self, key: &Key) -> Result<()> {
        MemcachedBackend::connect(URL)
            .await?
            .force_release(key)
            .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memcached_passes_the_conformance_suite() {
    let report = run_conformance("memcached", Memcached).await;
    report.assert_passed();
    let mut skipped = report.skipped();
    skipped.sort_unstable();
    // No fencing (a cache may evict), no shared or semaphore modes.
    assert_eq!(
        skipped,
        [
            "a_semaphore_keeps_one_permit_count_while_held",
            "readers_coexist_and_exclude_writers",
            "semaphore_admits_exactly_n",
            "tokens_increase_across_holders",
        ]
    );
}
