//! Both PostgreSQL modes against the conformance suite, on the shared test
//! server (scripts/services.sh).

use std::sync::Arc;

use fencelock_core::backend::async_trait;
use fencelock_core::{Backend, Key, Result};
use fencelock_postgres::PostgresBackend;
use fencelock_testkit::{Harness, conformance_tests};

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

mod lease {
    use super::*;
    conformance_tests!(
        "postgres-lease",
        Pg {
            url: format!("{URL}?mode=lease"),
        },
        none_skipped
    );
}

mod advisory {
    use super::*;
    conformance_tests!(
        "postgres-advisory",
        Pg {
            url: format!("{URL}?mode=advisory"),
        },
        none_skipped
    );
}
