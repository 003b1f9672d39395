//! Options of the SQLite backend and its URL form.

use std::path::PathBuf;
use std::time::Duration;

use fencelock_core::Result;
use fencelock_core::backend::BackendUrl;

/// How hard SQLite flushes commits to disk (`PRAGMA synchronous`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Synchronous {
    /// Survives process crashes; a power loss may lose the last commits (default).
    #[default]
    Normal,
    /// fsync on every commit: survives power loss, costs a disk flush per operation.
    Full,
}

/// Options of [`SqliteBackend`](crate::SqliteBackend), also from the URL
/// query (`sqlite:///var/lib/app/locks.db?busy_timeout=10s`).
///
/// | URL option | default | meaning |
/// |---|---|---|
/// | `busy_timeout=` | 5 s | how long a statement waits for another process's write to the file |
/// | `synchronous=normal\|full` | `normal` | `PRAGMA synchronous`: `full` also flushes every commit to disk |
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_sqlite::{SqliteOptions, Synchronous};
///
/// let opts = SqliteOptions::default().busy_timeout(Duration::from_secs(10)).synchronous(Synchronous::Full);
/// # let _ = opts;
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SqliteOptions {
    /// How long a transaction waits for another process's write lock (default 5 s).
    pub busy_timeout: Duration,
    /// Flush policy (default [`Synchronous::Normal`]).
    pub synchronous: Synchronous,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        SqliteOptions {
            busy_timeout: Duration::from_secs(5),
            synchronous: Synchronous::Normal,
        }
    }
}

impl SqliteOptions {
    /// Sets [`SqliteOptions::busy_timeout`].
    pub fn busy_timeout(mut self, d: Duration) -> Self {
        self.busy_timeout = d;
        self
    }

    /// Sets [`SqliteOptions::synchronous`].
    pub fn synchronous(mut self, s: Synchronous) -> Self {
        self.synchronous = s;
        self
    }
}

/// Splits `sqlite://PATH?busy_timeout=5s&synchronous=full` into the path (`None`
/// when empty) and options.
pub(crate) fn parse_url(url: &str) -> Result<(Option<PathBuf>, SqliteOptions)> {
    let mut u = BackendUrl::parse("sqlite", url, &["sqlite"])?;
    let options = take_options(&mut u)?;
    u.finish()?;
    // sqlite://PATH: the path is all that stands between the scheme and the
    // options, as written (relative without a leading slash).
    let path = &u.base()["sqlite://".len()..];
    Ok(((!path.is_empty()).then(|| PathBuf::from(path)), options))
}

/// Takes the options of the table above out of `u`.
fn take_options(u: &mut BackendUrl) -> Result<SqliteOptions> {
    let mut options = SqliteOptions::default();
    if let Some(d) = u.take_duration("busy_timeout")? {
        options.busy_timeout = d;
    }
    if let Some(s) = u.take_choice(
        "synchronous",
        &[("normal", Synchronous::Normal), ("full", Synchronous::Full)],
    )? {
        options.synchronous = s;
    }
    Ok(options)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_options_table_lists_every_option_the_parser_takes() {
        let mut u = BackendUrl::parse("sqlite", "sqlite:///x", &["sqlite"]).unwrap();
        take_options(&mut u).unwrap();
        fencelock_testkit::assert_options_documented(include_str!("options.rs"), u.asked());
    }

    #[test]
    fn parses_paths_and_options() {
        let (p, o) = parse_url("sqlite:///tmp/x.db?busy_timeout=250ms&synchronous=FULL").unwrap();
        assert_eq!(p.unwrap(), PathBuf::from("/tmp/x.db"));
        assert_eq!(o.busy_timeout, Duration::from_millis(250));
        assert_eq!(o.synchronous, Synchronous::Full);
        assert_eq!(
            parse_url("sqlite://rel.db").unwrap().0.unwrap(),
            PathBuf::from("rel.db")
        );
        assert!(parse_url("sqlite://").unwrap().0.is_none());
    }

    #[test]
    fn rejects_bad_options_by_name() {
        let e = parse_url("sqlite:///x?timeout=1s").unwrap_err().to_string();
        assert!(e.contains("timeout"), "{e}");
        let e = parse_url("sqlite:///x?busy_timeout=soon")
            .unwrap_err()
            .to_string();
        assert!(e.contains("busy_timeout"), "{e}");
        assert!(parse_url("postgres://x").is_err());
    }
}
