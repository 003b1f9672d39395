//! Options of the PostgreSQL backend and its URL form.

use std::time::Duration;

use fencelock_core::Result;
use fencelock_core::backend::BackendUrl;

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
/// | `connect_timeout=` | 10 s | how long a connect may take (the first connection, the pool's, the schema check) |
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
    /// How long a connect may take.
    pub connect_timeout: Duration,
}

impl Default for PgOptions {
    fn default() -> Self {
        PgOptions {
            mode: PgMode::Lease,
            default_ttl: None,
            pool: 8,
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// Splits our options off a `postgres://` URL; returns the driver's URL.
pub(crate) fn parse_url(url: &str) -> Result<(String, PgOptions)> {
    let mut u = BackendUrl::parse("postgres", url, &["postgres", "postgresql"])?;
    let options = take_options(&mut u)?;
    // The rest are the driver's options.
    Ok((u.with_rest(u.base()), options))
}

/// Takes the options of the table above out of `u` (the rest are the driver's).
fn take_options(u: &mut BackendUrl) -> Result<PgOptions> {
    let (mode, default_ttl, pool) = u.take_sql_options(
        &[("lease", PgMode::Lease), ("advisory", PgMode::Advisory)],
        PgOptions::default().pool,
    )?;
    let connect_timeout = u
        .take_duration("connect_timeout")?
        .unwrap_or(PgOptions::default().connect_timeout);
    Ok(PgOptions {
        mode,
        default_ttl,
        pool,
        connect_timeout,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_options_table_lists_every_option_the_parser_takes() {
        let mut u = BackendUrl::parse("postgres", "postgres://h/db", &["postgres"]).unwrap();
        take_options(&mut u).unwrap();
        fencelock_testkit::assert_options_documented(include_str!("options.rs"), u.asked());
    }

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
