//! Options of the MySQL/MariaDB backend and its URL form.

use std::time::Duration;

use fencelock_core::Result;
use fencelock_core::backend::BackendUrl;

/// How locks are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MyMode {
    /// Rows of the `fencelock_locks` table with a server-clock expiry and a fence
    /// column (`?mode=lease`, the default).
    #[default]
    Lease,
    /// `GET_LOCK` on a session held for the guard's life (`?mode=get_lock`).
    GetLock,
}

/// Options of [`MySqlBackend`](crate::MySqlBackend), from the URL query.
///
/// | URL option | default | meaning |
/// |---|---|---|
/// | `mode=lease\|get_lock` | `lease` | how locks are kept |
/// | `ttl=` | 30 s | default TTL of holds |
/// | `connect_timeout=` | 10 s | how long a connect may take (the first connection, the pool's, the schema check) |
/// | `pool=` | 8 | connections of the pool (and idle `get_lock` sessions kept) |
///
/// Every other query parameter (e.g. `ssl-mode`) goes to the driver.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MyOptions {
    /// How locks are kept.
    pub mode: MyMode,
    /// Default TTL of holds.
    pub default_ttl: Option<Duration>,
    /// Size of the connection pool.
    pub pool: u32,
    /// How long a connect may take.
    pub connect_timeout: Duration,
}

impl Default for MyOptions {
    fn default() -> Self {
        MyOptions {
            mode: MyMode::Lease,
            default_ttl: None,
            pool: 8,
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// Splits our options off a `mysql://` (or `mariadb://`) URL; returns the
/// driver's `mysql://` URL.
pub(crate) fn parse_url(url: &str) -> Result<(String, MyOptions)> {
    let mut u = BackendUrl::parse("mysql", url, &["mysql", "mariadb"])?;
    let options = take_options(&mut u)?;
    // The rest are the driver's options.
    let driver = u.with_rest(&format!("mysql://{}", &u.base()[u.scheme().len() + 3..]));
    Ok((driver, options))
}

/// Takes the options of the table above out of `u` (the rest are the driver's).
fn take_options(u: &mut BackendUrl) -> Result<MyOptions> {
    let (mode, default_ttl, pool) = u.take_sql_options(
        &[("lease", MyMode::Lease), ("get_lock", MyMode::GetLock)],
        MyOptions::default().pool,
    )?;
    let connect_timeout = u
        .take_duration("connect_timeout")?
        .unwrap_or(MyOptions::default().connect_timeout);
    Ok(MyOptions {
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
        let mut u = BackendUrl::parse("mysql", "mysql://h/db", &["mysql"]).unwrap();
        take_options(&mut u).unwrap();
        fencelock_testkit::assert_options_documented(include_str!("options.rs"), u.asked());
    }

    #[test]
    fn takes_our_options_and_passes_the_rest() {
        let (u, o) =
            parse_url("mariadb://root@h:3306/db?mode=get_lock&ssl-mode=disabled&ttl=5s").unwrap();
        assert_eq!(u, "mysql://root@h:3306/db?ssl-mode=disabled");
        assert_eq!(o.mode, MyMode::GetLock);
        assert_eq!(o.default_ttl, Some(Duration::from_secs(5)));
        assert!(
            parse_url("mysql://h/db?mode=rows")
                .unwrap_err()
                .to_string()
                .contains("mode")
        );
        assert!(parse_url("mysql://h/db?pool=0").is_err());
        assert!(parse_url("postgres://h/db").is_err());
    }
}
