//! Options of the SQLite backend and its URL form.

use std::path::PathBuf;
use std::time::Duration;

use fencelock_core::{Error, Result};

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

/// Options of [`SqliteBackend`](crate::SqliteBackend).
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
    let rest = url.strip_prefix("sqlite://").ok_or_else(|| {
        Error::config(format!(
            "{url:?} is not a sqlite URL; write sqlite://PATH, e.g. sqlite:///var/lib/app/locks.db"
        ))
    })?;
    let (path, query) = match rest.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (rest, None),
    };
    let mut options = SqliteOptions::default();
    for pair in query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .filter(|p| !p.is_empty())
    {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "busy_timeout" => {
                options.busy_timeout = humantime::parse_duration(v).map_err(|e| {
                    Error::config(format!(
                        "sqlite option busy_timeout={v:?}: {e}; write e.g. busy_timeout=5s"
                    ))
                })?;
            }
            "synchronous" => {
                options.synchronous = match v.to_ascii_lowercase().as_str() {
                    "normal" => Synchronous::Normal,
                    "full" => Synchronous::Full,
                    _ => {
                        return Err(Error::config(format!(
                            "sqlite option synchronous={v:?}: expected normal or full"
                        )));
                    }
                };
            }
            _ => {
                return Err(Error::config(format!(
                    "unknown sqlite option {k:?} in {url:?}; known: busy_timeout, synchronous"
                )));
            }
        }
    }
    let path = (!path.is_empty()).then(|| PathBuf::from(path));
    Ok((path, options))
}

#[cfg(test)]
mod tests {
    use super::*;

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
