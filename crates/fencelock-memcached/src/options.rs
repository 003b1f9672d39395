//! Options of the memcached backend and its URL form.

use std::time::Duration;

use fencelock_core::{Error, Result, redact_url};

/// Options of [`MemcachedBackend`](crate::MemcachedBackend), from the URL query.
///
/// | URL option | default | meaning |
/// |---|---|---|
/// | `prefix=` | `fencelock:` | prepended to every item name |
/// | `ttl=` | 30 s | default TTL of holds |
/// | `pool=` | 8 | idle connections kept |
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemcachedOptions {
    /// Prepended to every item name.
    pub prefix: String,
    /// Default TTL of holds.
    pub default_ttl: Option<Duration>,
    /// Idle connections kept.
    pub pool: usize,
}

impl Default for MemcachedOptions {
    fn default() -> Self {
        MemcachedOptions {
            prefix: "fencelock:".into(),
            default_ttl: None,
            pool: 8,
        }
    }
}

/// Splits a `memcached://host:port[?options]` URL into the address and options.
pub(crate) fn parse_url(url: &str) -> Result<(String, MemcachedOptions)> {
    let rest = url
        .strip_prefix("memcached://")
        .ok_or_else(|| Error::config(format!("{:?} is not a memcached:// URL", redact_url(url))))?;
    let (addr, query) = rest.split_once('?').unwrap_or((rest, ""));
    let addr = addr.trim_end_matches('/');
    if addr.is_empty() || addr.contains(',') || addr.contains('@') {
        return Err(Error::config(format!(
            "memcached URL {:?}: write memcached://HOST:PORT (one server, no login)",
            redact_url(url)
        )));
    }
    let addr = if addr.contains(':') {
        addr.to_string()
    } else {
        format!("{addr}:11211")
    };
    let mut options = MemcachedOptions::default();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "prefix" => {
                if !v.bytes().all(|b| b.is_ascii_graphic()) || v.len() > 100 {
                    return Err(Error::config(format!(
                        "memcached option prefix={v:?}: use at most 100 printable ASCII characters without spaces"
                    )));
                }
                options.prefix = v.to_string();
            }
            "ttl" => {
                options.default_ttl = Some(humantime::parse_duration(v).map_err(|e| {
                    Error::config(format!(
                        "memcached option ttl={v:?}: {e}; write e.g. ttl=30s"
                    ))
                })?)
            }
            "pool" => {
                options.pool = v.parse().map_err(|_| {
                    Error::config(format!("memcached option pool={v:?}: expected a number"))
                })?
            }
            _ => {
                return Err(Error::config(format!(
                    "unknown memcached option {k:?}; known: prefix, ttl, pool"
                )));
            }
        }
    }
    Ok((addr, options))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_address_and_options() {
        let (a, o) = parse_url("memcached://127.0.0.1:11311?prefix=app:&ttl=5s").unwrap();
        assert_eq!(a, "127.0.0.1:11311");
        assert_eq!(o.prefix, "app:");
        assert_eq!(o.default_ttl, Some(Duration::from_secs(5)));
        assert_eq!(parse_url("memcached://cache").unwrap().0, "cache:11211");
        assert!(parse_url("memcached://h?prefix=a b").is_err());
        assert!(
            parse_url("memcached://h?colour=red")
                .unwrap_err()
                .to_string()
                .contains("colour")
        );
        assert!(parse_url("memcached://a:1,b:2").is_err());
        assert!(parse_url("redis://h").is_err());
    }
}
