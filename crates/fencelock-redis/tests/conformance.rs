//! The Redis backend against the conformance suite, on the shared test servers
//! (scripts/services.sh): a single Redis on 6379, a cluster of three primaries
//! (7101–7103, a replica each) and a Sentinel service (Sentinels on 7211–7213,
//! a master and two replicas).

use std::sync::Arc;

use fencelock_core::backend::async_trait;
use fencelock_core::{Backend, Key, Result};
use fencelock_redis::RedisBackend;
use fencelock_testkit::{Harness, conformance_tests};

pub const SINGLE: &str = "redis://127.0.0.1:6379";
pub const CLUSTER: &str = "redis+cluster://127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103";
pub const SENTINEL: &str =
    "redis+sentinel://127.0.0.1:7211,127.0.0.1:7212,127.0.0.1:7213/fencelock";

struct Redis {
    url: &'static str,
}

#[async_trait]
impl Harness for Redis {
    async fn backend(&self) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(RedisBackend::connect(self.url).await?))
    }

    async fn steal(&self, key: &Key) -> Result<()> {
        RedisBackend::connect(self.url)
            .await?
            .force_release(key)
            .await
    }
}

mod single {
    use super::*;
    conformance_tests!("redis", Redis { url: SINGLE }, none_skipped);
}

mod cluster {
    use super::*;
    conformance_tests!("redis-cluster", Redis { url: CLUSTER }, none_skipped);
}

mod sentinel {
    use super::*;
    conformance_tests!("redis-sentinel", Redis { url: SENTINEL }, none_skipped);
}

mod redlock {
    use std::sync::Arc;

    use fencelock_core::backend::async_trait;
    use fencelock_core::{Backend, Key, Result};
    use fencelock_redis::RedlockBackend;
    use fencelock_testkit::{Harness, conformance_tests};

    pub const FIVE: &str =
        "redlock://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003,127.0.0.1:7004,127.0.0.1:7005";
    pub const THREE: &str = "redlock://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003";

    struct Redlock {
        url: &'static str,
    }

    #[async_trait]
    impl Harness for Redlock {
        async fn backend(&self) -> Result<Arc<dyn Backend>> {
            Ok(Arc::new(RedlockBackend::connect(self.url).await?))
        }

        async fn steal(&self, key: &Key) -> Result<()> {
            RedlockBackend::connect(self.url)
                .await?
                .force_release(key)
                .await
        }

        // An instance that missed the first hold (slow on a loaded machine)
        // grants the reentrant one anew, with a larger token (crate docs).
        fn reentrant_token_may_rise(&self) -> bool {
            true
        }
    }

    // A semaphore is not safe under a plain majority: its cases are skipped.
    mod five {
        use super::*;
        conformance_tests!(
            "redlock-5",
            Redlock { url: FIVE },
            skips: [semaphore_admits_exactly_n, a_semaphore_keeps_one_permit_count_while_held]
        );
    }

    mod three {
        use super::*;
        conformance_tests!(
            "redlock-3",
            Redlock { url: THREE },
            skips: [semaphore_admits_exactly_n, a_semaphore_keeps_one_permit_count_while_held]
        );
    }
}
