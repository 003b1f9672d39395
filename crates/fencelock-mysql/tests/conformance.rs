//! Both MySQL/MariaDB modes against the conformance suite, on the shared test
//! server (scripts/services.sh).

use std::sync::Arc;

use fencelock_core::{Backend, Key, Result, async_trait};
use fencelock_mysql::MySqlBackend;
use fencelock_testkit::{Harness, run_conformance};

const URL: &str = "mysql://root@127.0.0.1:3306/test";

struct My {
    url: String,
}

#[async_trait]
impl Harness for My {
    async fn backend(&self) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(MySqlBackend::connect(&self.url).await?))
    }

    async fn steal(&self, key: &Key) -> Result<()> {
        MySqlBackend::connect(&self.url)
            .await?
            .force_release(key)
            .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_mode_passes_the_conformance_suite() {
    let report = run_conformance(
        "mysql-lease",
        My {
            url: format!("{URL}?mode=lease"),
        },
    )
    .await;
    report.assert_passed();
    assert!(
        report.skipped().is_empty(),
        "skipped: {:?}",
        report.skipped()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_lock_mode_passes_the_conformance_suite() {
    let report = run_conformance(
        "mysql-get-lock",
        My {
            url: format!("{URL}?mode=get_lock"),
        },
    )
    .await;
    report.assert_passed();
    // GET_LOCK has no shared form: only the readers case may be skipped.
    assert_eq!(report.skipped(), ["readers_coexist_and_exclude_writers"]);
}
