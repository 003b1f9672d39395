//! Options of the MySQL/MariaDB backend and its URL form.

use std::time::Duration;

use fencelock_core::{Error, Result, redact_url};

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
}

impl Default for MyOptions {
    fn default() -> Self {
        MyOptions {
            mode: MyMode::Lease,
            default_ttl: None,
            pool: 8,
        }
    }
}

/// Splits our options off a `mysql://` (or `mariadb://`) URL; returns the
/// driver's `mysql://` URL.
pub(crate) fn parse_url(url: &str) -> Result<(String, MyOptions)> {
    let rest = url
        .strip_prefix("mysql://")
        .or_else(|| url.strip_prefix("mariadb://"))
        .ok_or_else(|| Error::config(format!("{:?} is not a mysql:// URL", redact_url(url))))?;
    let (base, query) = rest.split_once('?').unwrap_or((rest, ""));
    let mut options = MyOptions::default();
    let mut passed = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "mode" => {
                options.mode = match v {
                    "lease" => MyMode::Lease,
                    "get_lock" => MyMode::GetLock,
                    _ => {
                        return Err(Error::config(format!(
                            "mysql option mode={v:?}: expected lease or get_lock"
                        )));
                    }
                }
            }
            "ttl" => {
                options.default_ttl = Some(humantime::parse_duration(v).map_err(|e| {
                    Error::config(format!("mysql option ttl={v:?}: {e}; write e.g. ttl=30s"))
                })?)
            }
            "pool" => {
                options.pool = v.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                    Error::config(format!(
                        "mysql option pool={v:?}: expected a positive number"
                    ))
                })?
            }
            _ => passed.push(pair),
        }
    }
    let mut driver = format!("mysql://{base}");
    if !passed.is_empty() {
        driver = format!("{driver}?{}", passed.join("&"));
    }
    Ok((driver, options))
}

#[cfg(test)]
mod tests {
    use super::*;

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
