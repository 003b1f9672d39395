//! Both MySQL/MariaDB modes against the conformance suite, on the shared test
//! server (scripts/services.sh).

use std::sync::Arc;

use fencelock_core::backend::async_trait;
use fencelock_core::{Backend, Key, Result};
use fencelock_mysql::MySqlBackend;
use fencelock_testkit::{Harness, conformance_tests};

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

mod lease {
    use super::*;
    conformance_tests!(
        "mysql-lease",
        My {
            url: format!("{URL}?mode=lease"),
        },
        none_skipped
    );
}

mod get_lock {
    use super::*;
    // GET_LOCK has no shared form: only the readers case is skipped.
    conformance_tests!(
        "mysql-get-lock",
        My {
            url: format!("{URL}?mode=get_lock"),
        },
        skips: [
            readers_coexist_and_exclude_writers,
            racing_shared_holds_of_one_owner_keep_their_grants
        ]
    );
}
