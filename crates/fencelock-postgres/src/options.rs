//! Options of the PostgreSQL backend and its URL form.

use std::time::Duration;

use fencelock_core::{Error, Result, redact_url};

/// How locks are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PgMode {
    /// Rows of the `fencelock_locks` table with a server-clock expiry and a fence
    /// column (`?mode=lease`, the default).
    #[default]
    Lease,
    /// `pg_advisory_lock` on a session held for the guard's life (`?mode=advisory`).
    Advisory,
}

/// Options of [`PostgresBackend`](crate::PostgresBackend), from the URL query.
///
/// | URL option | default | meaning |
/// |---|---|---|
/// | `mode=lease\|advisory` | `lease` | how locks are kept |
/// | `ttl=` | 30 s | default TTL of holds |
/// | `pool=` | 8 | connections of the lease mode's pool |
///
/// Every other query parameter (e.g. `sslmode`) goes to the driver.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PgOptions {
    /// How locks are kept.
    pub mode: PgMode,
    /// Default TTL of holds.
    pub default_ttl: Option<Duration>,
    /// Size of the connection pool.
    pub pool: u32,
}

impl Default for PgOptions {
    fn default() -> Self {
        PgOptions {
            mode: PgMode::Lease,
            default_ttl: None,
            pool: 8,
        }
    }
}

/// Splits our options off a `postgres://` URL; returns the driver's URL.
pub(crate) fn parse_url(url: &str) -> Result<(String, PgOptions)> {
    let scheme_ok = url.starts_with("postgres://") || url.starts_with("postgresql://");
    if !scheme_ok {
        return Err(Error::config(format!(
            "{:?} is not a postgres:// URL",
            redact_url(url)
        )));
    }
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, q),
        None => (url, ""),
    };
    let mut options = PgOptions::default();
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "mode" => {
                options.mode = match v {
                    "lease" => PgMode::Lease,
                    "advisory" => PgMode::Advisory,
                    _ => {
                        return Err(Error::config(format!(
                            "postgres option mode={v:?}: expected lease or advisory"
                        )));
                    }
                }
            }
            "ttl" => {
                options.default_ttl = Some(humantime::parse_duration(v).map_err(|e| {
                    Error::config(format!(
                        "postgres option ttl={v:?}: {e}; write e.g. ttl=30s"
                    ))
                })?)
            }
            "pool" => {
                options.pool = v.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                    Error::config(format!(
                        "postgres option pool={v:?}: expected a positive number"
                    ))
                })?
            }
            _ => rest.push(pair),
        }
    }
    let driver = if rest.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", rest.join("&"))
    };
    Ok((driver, options))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_our_options_and_passes_the_rest() {
        let (u, o) =
            parse_url("postgres://u:p@h:5432/db?mode=advisory&sslmode=disable&ttl=5s").unwrap();
        assert_eq!(u, "postgres://u:p@h:5432/db?sslmode=disable");
        assert_eq!(o.mode, PgMode::Advisory);
        assert_eq!(o.default_ttl, Some(Duration::from_secs(5)));
        assert!(
            parse_url("postgres://h/db?mode=rows")
                .unwrap_err()
                .to_string()
                .contains("mode")
        );
        assert!(parse_url("mysql://h/db").is_err());
    }
}
