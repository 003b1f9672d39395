//! Options of the etcd backend and its URL form.

use std::time::Duration;

use fencelock_core::backend::BackendUrl;
use fencelock_core::{Error, Result};

/// Options of [`EtcdBackend`](crate::EtcdBackend), from the URL query.
///
/// | URL option | default | meaning |
/// |---|---|---|
/// | `prefix=` | `fencelock/` | prepended to every lock name (`<prefix><key>/<lease id in hex>`); empty gives the bare layout of `etcdctl lock` |
/// | `session_ttl=` | 30 s | the longest etcd lease (whole seconds): a hold of TTL `t` lives on a lease of `min(ceil(t), session_ttl)`, which is what its holder's death costs |
/// | `connect_timeout=` | 5 s | how long `connect` waits |
/// | `request_timeout=` | 5 s | how long one request may take |
/// | `ttl=` | – | default TTL of holds |
/// | `ca=`, `cert=`, `key=`, `domain=` | – | TLS (`etcds://`): CA bundle, client certificate and key (PEM files), server name |
///
/// A user and password in the URL (`etcd://user:pass@h1:2379,h2:2379`) log in
/// with etcd's authentication.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EtcdOptions {
    /// Prepended to every lock name.
    pub prefix: String,
    /// TTL of the etcd lease every hold of this backend is attached to.
    pub session_ttl: Duration,
    /// How long `connect` waits.
    pub connect_timeout: Duration,
    /// How long one request may take.
    pub request_timeout: Duration,
    /// Default TTL of holds.
    pub default_ttl: Option<Duration>,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            prefix: "fencelock/".into(),
            session_ttl: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
            default_ttl: None,
        }
    }
}

/// TLS settings of an `etcds://` URL.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Tls {
    pub(crate) ca: Option<String>,
    pub(crate) cert: Option<String>,
    pub(crate) key: Option<String>,
    pub(crate) domain: Option<String>,
}

/// A parsed `etcd://` or `etcds://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EtcdUrl {
    /// `http://h:p` (or `https://`) per server.
    pub(crate) endpoints: Vec<String>,
    pub(crate) user: Option<(String, String)>,
    pub(crate) tls: Option<Tls>,
    pub(crate) options: EtcdOptions,
}

/// The TLS settings to fill in for option `k`, if the URL is `etcds://`.
fn tls_file<'a>(tls: &'a mut Option<Tls>, k: &str) -> Result<&'a mut Tls> {
    tls.as_mut().ok_or_else(|| {
        Error::config(format!(
            "etcd option {k}= is a TLS setting: use an etcds:// URL"
        ))
    })
}

pub(crate) fn parse_url(url: &str) -> Result<EtcdUrl> {
    let mut u = BackendUrl::parse("etcd", url, &["etcd", "etcds"])?;
    let secure = u.scheme() == "etcds";
    let user = u
        .user()
        .map(|name| (name.to_string(), u.password().unwrap_or("").to_string()));
    let scheme = if secure { "https" } else { "http" };
    let endpoints: Vec<String> = u
        .hosts()
        .map(|h| {
            if h.contains(':') {
                format!("{scheme}://{h}")
            } else {
                format!("{scheme}://{h}:2379")
            }
        })
        .collect();
    if endpoints.is_empty() || u.path().len() > 1 {
        return Err(Error::config(format!(
            "{:?}: write etcd://host:2379[,host:2379…][?options]",
            u.redacted()
        )));
    }
    let (options, tls) = take_options(&mut u, secure)?;
    u.finish()?;
    Ok(EtcdUrl {
        endpoints,
        user,
        tls,
        options,
    })
}

/// Takes the options of the table above out of `u` (TLS ones only from an
/// `etcds://` URL).
fn take_options(u: &mut BackendUrl, secure: bool) -> Result<(EtcdOptions, Option<Tls>)> {
    let mut options = EtcdOptions::default();
    if let Some(prefix) = u.take("prefix") {
        options.prefix = prefix;
    }
    if let Some(d) = u.take_duration("session_ttl")? {
        if d < Duration::from_secs(1) {
            return Err(u.bad_value(
                "session_ttl",
                &humantime::format_duration(d).to_string(),
                "etcd leases count whole seconds; use at least 1s (etcd raises it to its minimum, about 2s)",
            ));
        }
        options.session_ttl = d;
    }
    if let Some(d) = u.take_duration("connect_timeout")? {
        options.connect_timeout = d;
    }
    if let Some(d) = u.take_duration("request_timeout")? {
        options.request_timeout = d;
    }
    options.default_ttl = u.take_duration("ttl")?;
    let mut tls = secure.then(Tls::default);
    for k in ["ca", "cert", "key", "domain"] {
        if let Some(v) = u.take(k) {
            let t = tls_file(&mut tls, k)?;
            *match k {
                "ca" => &mut t.ca,
                "cert" => &mut t.cert,
                "key" => &mut t.key,
                _ => &mut t.domain,
            } = Some(v);
        }
    }
    if let Some(t) = &tls
        && t.cert.is_some() != t.key.is_some()
    {
        return Err(Error::config(
            "etcd TLS: cert= and key= go together (the client certificate and its private key)",
        ));
    }
    Ok((options, tls))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_options_table_lists_every_option_the_parser_takes() {
        let mut u = BackendUrl::parse("etcd", "etcds://h", &["etcds"]).unwrap();
        take_options(&mut u, true).unwrap();
        fencelock_testkit::assert_options_documented(include_str!("options.rs"), u.asked());
    }

    #[test]
    fn parses_hosts_auth_and_options() {
        let u = parse_url("etcd://app:p%40ss@h1:2379,h2?prefix=&session_ttl=3s&ttl=1s").unwrap();
        assert_eq!(u.endpoints, ["http://h1:2379", "http://h2:2379"]);
        assert_eq!(u.user, Some(("app".into(), "p@ss".into())));
        assert_eq!(u.options.prefix, "");
        assert_eq!(u.options.session_ttl, Duration::from_secs(3));
        assert_eq!(u.options.default_ttl, Some(Duration::from_secs(1)));
        assert_eq!(u.tls, None);
        let d = parse_url("etcd://127.0.0.1:2379").unwrap();
        assert_eq!(d.options.prefix, "fencelock/");
        let s = parse_url("etcds://h:2379?ca=/etc/ca.pem&domain=etcd.local").unwrap();
        assert_eq!(s.endpoints, ["https://h:2379"]);
        let tls = s.tls.unwrap();
        assert_eq!(tls.ca.as_deref(), Some("/etc/ca.pem"));
        assert_eq!(tls.domain.as_deref(), Some("etcd.local"));
    }

    #[test]
    fn bad_urls_are_named() {
        for (url, needle) in [
            ("etcd://", "etcd://host:2379"),
            ("redis://h", "not a URL of the etcd backend"),
            ("etcd://h/path", "etcd://host:2379"),
            ("etcd://h?session_ttl=x", "session_ttl"),
            ("etcd://h?session_ttl=100ms", "whole seconds"),
            ("etcd://h?color=red", "color"),
            ("etcd://h?ca=/x.pem", "etcds://"),
            ("etcds://h?cert=/c.pem", "go together"),
            ("etcd://h?prefix=%zz", "bad escape"),
            ("etcd://u:p%zz@h", "bad escape in the password"),
        ] {
            let e = parse_url(url).unwrap_err().to_string();
            assert!(e.contains(needle), "{url}: {e}");
        }
    }
}
