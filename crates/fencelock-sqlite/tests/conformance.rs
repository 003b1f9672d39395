//! The SQLite backend against the conformance suite, on a real file.

use std::path::PathBuf;
use std::sync::Arc;

use fencelock_core::backend::async_trait;
use fencelock_core::{Backend, Key, Result};
use fencelock_sqlite::SqliteBackend;
use fencelock_testkit::{Harness, conformance_tests};

struct Sqlite {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Sqlite {
    /// A harness on a new file in a directory of its own.
    fn in_new_dir() -> Sqlite {
        let dir = tempfile::tempdir().expect("a temporary directory");
        Sqlite {
            path: dir.path().join("locks.db"),
            _dir: dir,
        }
    }
}

#[async_trait]
impl Harness for Sqlite {
    async fn backend(&self) -> Result<Arc<dyn Backend>> {
        // A new connection per client, as a separate process would open.
        Ok(Arc::new(SqliteBackend::open(&self.path).await?))
    }

    async fn steal(&self, key: &Key) -> Result<()> {
        SqliteBackend::open(&self.path)
            .await?
            .force_release(key)
            .await
    }
}

mod suite {
    use super::*;
    conformance_tests!("sqlite", Sqlite::in_new_dir(), none_skipped);
}

#[tokio::test]
async fn fence_survives_reopening_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locks.db");
    let first = {
        let locker = fencelock_core::Locker::new(SqliteBackend::open(&path).await.unwrap());
        let g = locker.lock("k").acquire().await.unwrap();
        let t = g.token().unwrap();
        g.release().await.unwrap();
        t
    };
    let locker = fencelock_core::Locker::new(SqliteBackend::open(&path).await.unwrap());
    let g = locker.lock("k").acquire().await.unwrap();
    assert!(g.token().unwrap() > first);
}

#[tokio::test]
async fn unopenable_path_is_a_connection_error_naming_it() {
    let err = SqliteBackend::open("/nonexistent-dir/x/locks.db")
        .await
        .unwrap_err();
    assert!(
        matches!(err, fencelock_core::Error::Connection { .. }),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("/nonexistent-dir/x/locks.db"),
        "{err}"
    );
    // A file has no server: the hint is about the directory.
    assert!(
        !err.to_string().contains("server") && err.to_string().contains("directory"),
        "{err}"
    );
}
