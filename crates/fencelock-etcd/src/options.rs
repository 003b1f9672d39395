//! Options of the etcd backend and its URL form.

use std::time::Duration;

use fencelock_core::{Error, Result, redact_url};

/// Options of [`EtcdBackend`](crate::EtcdBackend), from the URL query.
///
/// | URL option | default | meaning |
/// |---|---|---|
/// | `prefix=` | `fencelock/` | prepended to every lock name (`<prefix><key>/<lease id in hex>`); empty gives the bare layout of `etcdctl lock` |
/// | `session_ttl=` | 10 s | the longest etcd lease (whole seconds): a hold of TTL `t` lives on a lease of `min(ceil(t), session_ttl)`, which is what its holder's death costs |
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
            session_ttl: Duration::from_secs(10),
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

fn duration(name: &str, v: &str) -> Result<Duration> {
    humantime::parse_duration(v).map_err(|e| {
        Error::config(format!(
            "etcd option {name}={v:?}: {e}; write e.g. {name}=10s"
        ))
    })
}

/// Decodes `%XX` escapes (a prefix or password may need them).
fn unescape(v: &str) -> Result<String> {
    let bytes = v.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = v.get(i + 1..i + 3).unwrap_or("");
            let b = u8::from_str_radix(hex, 16).map_err(|_| {
                Error::config(format!(
                    "etcd URL: bad escape %{hex} in {v:?}; write %XX with two hex digits"
                ))
            })?;
            out.push(b);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| Error::config(format!("etcd URL: {v:?} is not UTF-8")))
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
    let (rest, secure) = if let Some(r) = url.strip_prefix("etcd://") {
        (r, false)
    } else if let Some(r) = url.strip_prefix("etcds://") {
        (r, true)
    } else {
        return Err(Error::config(format!(
            "{:?} is not an etcd:// or etcds:// URL",
            redact_url(url)
        )));
    };
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (auth, hosts) = match rest.rfind('@') {
        Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
        None => (None, rest),
    };
    let user = auth
        .map(|a| -> Result<(String, String)> {
            let (u, p) = a.split_once(':').unwrap_or((a, ""));
            Ok((unescape(u)?, unescape(p)?))
        })
        .transpose()?;
    let scheme = if secure { "https" } else { "http" };
    let endpoints: Vec<String> = hosts
        .trim_end_matches('/')
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(|h| {
            if h.contains(':') {
                format!("{scheme}://{h}")
            } else {
                format!("{scheme}://{h}:2379")
            }
        })
        .collect();
    if endpoints.is_empty() || hosts.contains('/') {
        return Err(Error::config(format!(
            "{:?}: write etcd://host:2379[,host:2379…][?options]",
            redact_url(url)
        )));
    }
    let mut options = EtcdOptions::default();
    let mut tls = secure.then(Tls::default);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = unescape(v)?;
        match k {
            "prefix" => options.prefix = v,
            "session_ttl" => {
                let d = duration(k, &v)?;
                if d < Duration::from_secs(1) {
                    return Err(Error::config(format!(
                        "etcd option session_ttl={v:?}: etcd leases count whole seconds; use at least 1s (etcd raises it to its minimum, about 2s)"
                    )));
                }
                options.session_ttl = d;
            }
            "connect_timeout" => options.connect_timeout = duration(k, &v)?,
            "request_timeout" => options.request_timeout = duration(k, &v)?,
            "ttl" => options.default_ttl = Some(duration(k, &v)?),
            "ca" => tls_file(&mut tls, k)?.ca = Some(v),
            "cert" => tls_file(&mut tls, k)?.cert = Some(v),
            "key" => tls_file(&mut tls, k)?.key = Some(v),
            "domain" => tls_file(&mut tls, k)?.domain = Some(v),
            _ => {
                return Err(Error::config(format!(
                    "unknown etcd option {k:?}; known: prefix, session_ttl, connect_timeout, request_timeout, ttl, ca, cert, key, domain"
                )));
            }
        }
    }
    if let Some(t) = &tls
        && t.cert.is_some() != t.key.is_some()
    {
        return Err(Error::config(
            "etcd TLS: cert= and key= go together (the client certificate and its private key)",
        ));
    }
    Ok(EtcdUrl {
        endpoints,
        user,
        tls,
        options,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
            ("redis://h", "not an etcd"),
            ("etcd://h/path", "etcd://host:2379"),
            ("etcd://h?session_ttl=x", "session_ttl"),
            ("etcd://h?session_ttl=100ms", "whole seconds"),
            ("etcd://h?color=red", "color"),
            ("etcd://h?ca=/x.pem", "etcds://"),
            ("etcds://h?cert=/c.pem", "go together"),
            ("etcd://h?prefix=%zz", "bad escape"),
        ] {
            let e = parse_url(url).unwrap_err().to_string();
            assert!(e.contains(needle), "{url}: {e}");
        }
    }
}
