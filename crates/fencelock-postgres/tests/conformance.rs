//! Both PostgreSQL modes against the conformance suite, on the shared test
//! server (scripts/services.sh).

use std::sync::Arc;

use fencelock_core::{Backend, Key, Result, async_trait};
use fencelock_postgres::PostgresBackend;
use fencelock_testkit::{Harness, run_conformance};

const URL: &str = "postgres://postgres:postgres@127.0.0.1:5432/test";

struct Pg {
    url: String,
}

#[async_trait]
impl Harness for Pg {
    async fn backend(&self) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(PostgresBackend::connect(&self.url).await?))
    }

    async fn steal(&self, key: &Key) -> Result<()> {
        PostgresBackend::connect(&self.url)
            .await?
            .force_release(key)
            .await
    }
}

async fn suite(label: &str, mode: &str) {
    let url = format!("{URL}?mode={mode}");
    let report = run_conformance(label, Pg { url }).await;
    report.assert_passed();
    assert!(
        report.skipped().is_empty(),
        "skipped: {:?}",
        report.skipped()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_mode_passes_the_conformance_suite() {
    suite("postgres-lease", "lease").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_mode_passes_the_conformance_suite() {
    suite("postgres-advisory", "advisory").await;
}
