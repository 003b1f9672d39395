//! The memcached backend against the conformance suite, on the shared test
//! server (scripts/services.sh): every case its capabilities allow.

use std::sync::Arc;

use fencelock_core::backend::async_trait;
use fencelock_core::{Backend, Key, Result};
use fencelock_memcached::MemcachedBackend;
use fencelock_testkit::{Harness, conformance_tests};

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

// No fencing (a cache may evict), no shared or semaphore modes.
conformance_tests!(
    "memcached",
    Memcached,
    skips: [
        tokens_increase_across_holders,
        readers_coexist_and_exclude_writers,
        racing_shared_holds_of_one_owner_keep_their_grants,
        semaphore_admits_exactly_n,
        a_semaphore_keeps_one_permit_count_while_held,
    ]
);
