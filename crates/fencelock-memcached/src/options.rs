//! Options of the memcached backend and its URL form.

use std::time::Duration;

use fencelock_core::backend::BackendUrl;
use fencelock_core::{Error, Result};

/// Options of [`MemcachedBackend`](crate::MemcachedBackend), from the URL query.
///
/// | URL option | default | meaning |
/// |---|---|---|
/// | `prefix=` | `fencelock:` | prepended to every item name |
/// | `ttl=` | 30 s | default TTL of holds |
/// | `pool=` | 8 | idle connections kept |
/// | `timeout=` | 5 s | how long a connect or a request may take before it fails |
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemcachedOptions {
    /// Prepended to every item name.
    pub prefix: String,
    /// Default TTL of holds.
    pub default_ttl: Option<Duration>,
    /// Idle connections kept.
    pub pool: usize,
    /// How long a connect or a request may take before it fails (the
    /// connection is then dropped): a frozen server cannot hold a caller.
    pub timeout: Duration,
}

impl Default for MemcachedOptions {
    fn default() -> Self {
        MemcachedOptions {
            prefix: "fencelock:".into(),
            default_ttl: None,
            pool: 8,
            timeout: Duration::from_secs(5),
        }
    }
}

/// Splits a `memcached://host:port[?options]` URL into the address and options.
pub(crate) fn parse_url(url: &str) -> Result<(String, MemcachedOptions)> {
    let mut u = BackendUrl::parse("memcached", url, &["memcached"])?;
    let addr = u.hosts_text();
    if addr.is_empty() || addr.contains(',') || u.user().is_some() || u.path().len() > 1 {
        return Err(Error::config(format!(
            "memcached URL {:?}: write memcached://HOST:PORT (one server, no login)",
            u.redacted()
        )));
    }
    let addr = if addr.contains(':') {
        addr.to_string()
    } else {
        format!("{addr}:11211")
    };
    let options = take_options(&mut u)?;
    u.finish()?;
    Ok((addr, options))
}

/// Takes the options of the table above out of `u`.
fn take_options(u: &mut BackendUrl) -> Result<MemcachedOptions> {
    let mut options = MemcachedOptions::default();
    if let Some(v) = u.take("prefix") {
        if !v.bytes().all(|b| b.is_ascii_graphic()) || v.len() > 100 {
            return Err(u.bad_value(
                "prefix",
                &v,
                "use at most 100 printable ASCII characters without spaces",
            ));
        }
        options.prefix = v;
    }
    options.default_ttl = u.take_duration("ttl")?;
    if let Some(pool) = u.take_parsed("pool", "a number")? {
        options.pool = pool;
    }
    if let Some(t) = u.take_duration("timeout")? {
        if t.is_zero() {
            return Err(u.bad_value("timeout", "0s", "use a duration above zero"));
        }
        options.timeout = t;
    }
    Ok(options)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_options_table_lists_every_option_the_parser_takes() {
        let mut u = BackendUrl::parse("memcached", "memcached://h", &["memcached"]).unwrap();
        take_options(&mut u).unwrap();
        fencelock_testkit::assert_options_documented(include_str!("options.rs"), u.asked());
    }

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
