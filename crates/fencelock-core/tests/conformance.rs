//! The memory backend against the conformance suite.

use std::sync::Arc;

use fencelock_core::backend::async_trait;
use fencelock_core::{Backend, Key, MemoryBackend, Result};
use fencelock_testkit::Harness;

struct Memory(MemoryBackend);

#[async_trait]
impl Harness for Memory {
    async fn backend(&self) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(self.0.clone()))
    }

    async fn steal(&self, key: &Key) -> Result<()> {
        self.0.force_release(key);
        Ok(())
    }
}

// Memory supports every capability the suite switches on.
fencelock_testkit::conformance_tests!("memory", Memory(MemoryBackend::new()), none_skipped);
