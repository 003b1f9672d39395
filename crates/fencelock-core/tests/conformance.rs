//! The memory backend against the conformance suite.

use std::sync::Arc;

use fencelock_core::{Backend, Key, MemoryBackend, Result, async_trait};
use fencelock_testkit::{Harness, run_conformance};

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_passes_the_conformance_suite() {
    let report = run_conformance("memory", Memory(MemoryBackend::new())).await;
    report.assert_passed();
    // Memory supports every capability the suite switches on.
    assert!(
        report.skipped().is_empty(),
        "skipped: {:?}",
        report.skipped()
    );
}
