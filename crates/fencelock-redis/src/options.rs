//! Options of the Redis backend and its URL forms.

use std::time::Duration;

use fencelock_core::backend::BackendUrl;
use fencelock_core::{Error, Result};

/// Options of [`RedisBackend`](crate::RedisBackend), from the URL query or a builder.
///
/// | URL option | default | meaning |
/// |---|---|---|
/// | `prefix=` | `fencelock:` | namespace of every key (no `{` or `}`) |
/// | `ttl=` | 30 s | default TTL of holds taken through this URL |
/// | `wait_replicas=N` | 0 | a grant or renewal counts only after N replicas acknowledged it (`WAIT`); not on a cluster |
/// | `wait_timeout=` | 1 s | how long `WAIT` may take |
/// | `timeout=` | 5 s | response timeout of every command |
/// | `connect_timeout=` | 5 s | how long a connect may take (each connection of the client) |
/// | `tls_ca=PATH` | system roots | PEM file of the CA that signed the server's certificate (`rediss://`) |
/// | `sentinel_user=` | none | user to log in to the Sentinels with (`redis+sentinel://`) |
/// | `sentinel_password=` | none | password of the Sentinels (the login in the URL is the data nodes') |
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_redis::RedisOptions;
///
/// let opts = RedisOptions::default().prefix("app:locks:").wait_replicas(1);
/// assert_eq!(opts.prefix, "app:locks:");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisOptions {
    /// Namespace of every key.
    pub prefix: String,
    /// Default TTL of holds (a Locker on this backend uses it).
    pub default_ttl: Option<Duration>,
    /// Replicas that must acknowledge a grant (Redisson's `checkLockSyncedSlaves`).
    pub wait_replicas: u32,
    /// Bound of the `WAIT` for replicas.
    pub wait_timeout: Duration,
    /// Response timeout of every command.
    pub response_timeout: Duration,
    /// Connection timeout.
    pub connect_timeout: Duration,
    /// CA certificate (PEM) to verify a TLS server with, instead of the system roots.
    pub tls_ca: Option<std::path::PathBuf>,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            prefix: "fencelock:".into(),
            default_ttl: None,
            wait_replicas: 0,
            wait_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            tls_ca: None,
        }
    }
}

impl RedisOptions {
    /// Sets [`RedisOptions::prefix`].
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Sets [`RedisOptions::default_ttl`].
    pub fn default_ttl(mut self, ttl: Duration) -> Self {
        self.default_ttl = Some(ttl);
        self
    }

    /// Sets [`RedisOptions::wait_replicas`].
    pub fn wait_replicas(mut self, n: u32) -> Self {
        self.wait_replicas = n;
        self
    }

    /// Sets [`RedisOptions::wait_timeout`].
    pub fn wait_timeout(mut self, d: Duration) -> Self {
        self.wait_timeout = d;
        self
    }

    /// Sets [`RedisOptions::response_timeout`].
    pub fn response_timeout(mut self, d: Duration) -> Self {
        self.response_timeout = d;
        self
    }

    /// Sets [`RedisOptions::connect_timeout`].
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    pub(crate) fn validate(&self, cluster: bool) -> Result<()> {
        if self.prefix.contains(['{', '}']) || self.prefix.chars().any(char::is_control) {
            return Err(Error::config(format!(
                "redis prefix {:?} may not contain braces or control characters (fencelock adds the {{…}} hash tag itself)",
                self.prefix
            )));
        }
        if cluster && self.wait_replicas > 0 {
            return Err(Error::config(
                "wait_replicas works on a single Redis instance (redis://, redis+sentinel://), not on a cluster URL",
            ));
        }
        Ok(())
    }
}

/// Where to connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// One server: the URL for the redis client (our options removed).
    Single(String),
    /// Cluster seed nodes, one URL each.
    Cluster(Vec<String>),
    /// The master of a service the Sentinels monitor.
    Sentinel(SentinelTarget),
}

/// The Sentinels and how to log in to them and to the data nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SentinelTarget {
    pub(crate) sentinels: Vec<(String, u16)>,
    pub(crate) service: String,
    pub(crate) db: i64,
    pub(crate) user: Option<String>,
    pub(crate) password: Option<String>,
    pub(crate) sentinel_user: Option<String>,
    pub(crate) sentinel_password: Option<String>,
}

/// The port of a Sentinel named without one.
const SENTINEL_PORT: u16 = 26379;

/// Splits a fencelock Redis URL into the connection target and our options.
pub(crate) fn parse_url(url: &str) -> Result<(Target, RedisOptions)> {
    let mut u = BackendUrl::parse(
        "redis",
        url,
        &[
            "redis",
            "rediss",
            "redis+cluster",
            "rediss+cluster",
            "redis+sentinel",
        ],
    )?;
    let options = take_options(&mut u)?;
    if u.scheme() == "redis+sentinel" {
        let target = sentinel_target(&mut u)?;
        if options.tls_ca.is_some() {
            return Err(Error::config(
                "redis+sentinel:// does not speak TLS; tls_ca= works with rediss:// and rediss+cluster://",
            ));
        }
        options.validate(false)?;
        return Ok((Target::Sentinel(target), options));
    }
    let base = u.base();
    let target = if u.scheme().ends_with("+cluster") {
        let node_scheme = if u.scheme().starts_with("rediss") {
            "rediss"
        } else {
            "redis"
        };
        // The login as written (still percent-encoded), for each node's URL.
        let authority = base[u.scheme().len() + 3..].split('/').next().unwrap_or("");
        let auth = authority.rfind('@').map_or("", |at| &authority[..=at]);
        if u.path().len() > 1 {
            return Err(Error::config(
                "a redis cluster URL has no database path (clusters have only db 0)",
            ));
        }
        // The cluster client takes no options of its own through the URL.
        u.finish()?;
        let nodes: Vec<String> = u
            .hosts()
            .map(|h| format!("{node_scheme}://{auth}{h}"))
            .collect();
        if nodes.is_empty() {
            return Err(Error::config(format!(
                "{:?} names no cluster node; write redis+cluster://host:port,host:port",
                u.redacted()
            )));
        }
        Target::Cluster(nodes)
    } else {
        // Options of the redis client itself (e.g. protocol) pass through.
        Target::Single(u.with_rest(base))
    };
    options.validate(matches!(target, Target::Cluster(_)))?;
    Ok((target, options))
}

/// `redis+sentinel://[user:password@]h1:p1,h2:p2/SERVICE[/db]`: the
/// Sentinels, the service's name and the database.
fn sentinel_target(u: &mut BackendUrl) -> Result<SentinelTarget> {
    let mut sentinels = Vec::new();
    for h in u.hosts() {
        let (host, port) = match h.rsplit_once(':').filter(|_| !h.ends_with(']')) {
            Some((host, port)) => (
                host,
                port.parse::<u16>().map_err(|_| {
                    Error::config(format!(
                        "{:?}: the port of Sentinel {h:?} is not a number",
                        u.redacted()
                    ))
                })?,
            ),
            None => (h, SENTINEL_PORT),
        };
        sentinels.push((host.trim_matches(['[', ']']).to_string(), port));
    }
    if sentinels.is_empty() {
        return Err(Error::config(format!(
            "{:?} names no Sentinel; write redis+sentinel://host:port,host:port/SERVICE",
            u.redacted()
        )));
    }
    let mut path = u.path().trim_start_matches('/').split('/');
    let service = path.next().unwrap_or_default().to_string();
    if service.is_empty() {
        return Err(Error::config(format!(
            "{:?} names no service; write redis+sentinel://host:port,host:port/SERVICE[/db]",
            u.redacted()
        )));
    }
    if let Some(extra) = path.clone().nth(1).filter(|x| !x.is_empty()) {
        return Err(Error::config(format!(
            "{:?}: {extra:?} after the database; write redis+sentinel://host:port,host:port/SERVICE[/db]",
            u.redacted()
        )));
    }
    let db = match path.next().filter(|d| !d.is_empty()) {
        Some(d) => d.parse().map_err(|_| {
            Error::config(format!(
                "{:?}: the database {d:?} after the service is not a number",
                u.redacted()
            ))
        })?,
        None => 0,
    };
    let target = SentinelTarget {
        sentinels,
        service,
        db,
        user: u.user().filter(|u| !u.is_empty()).map(str::to_string),
        password: u.password().map(str::to_string),
        sentinel_user: u.take("sentinel_user"),
        sentinel_password: u.take("sentinel_password"),
    };
    u.finish()?;
    Ok(target)
}

/// Takes the options of the table above out of `u` (the rest are the redis
/// client's).
fn take_options(u: &mut BackendUrl) -> Result<RedisOptions> {
    let mut options = RedisOptions::default();
    if let Some(prefix) = u.take("prefix") {
        options.prefix = prefix;
    }
    options.default_ttl = u.take_duration("ttl")?;
    if let Some(n) = u.take_parsed("wait_replicas", "a number of replicas")? {
        options.wait_replicas = n;
    }
    if let Some(d) = u.take_duration("wait_timeout")? {
        options.wait_timeout = d;
    }
    if let Some(d) = u.take_duration("timeout")? {
        options.response_timeout = d;
    }
    if let Some(d) = u.take_duration("connect_timeout")? {
        options.connect_timeout = d;
    }
    if let Some(ca) = u.take("tls_ca") {
        options.tls_ca = Some(ca.into());
    }
    Ok(options)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_options_table_lists_every_option_the_parser_takes() {
        let mut u =
            BackendUrl::parse("redis", "redis+sentinel://h/s", &["redis+sentinel"]).unwrap();
        take_options(&mut u).unwrap();
        sentinel_target(&mut u).unwrap();
        fencelock_testkit::assert_options_documented(include_str!("options.rs"), u.asked());
    }

    #[test]
    fn single_url_keeps_client_options_and_takes_ours() {
        let (t, o) =
            parse_url("redis://:pw@127.0.0.1:6379/2?prefix=app:&ttl=10s&protocol=resp3&timeout=2s")
                .unwrap();
        assert_eq!(
            t,
            Target::Single("redis://:pw@127.0.0.1:6379/2?protocol=resp3".into())
        );
        assert_eq!(o.prefix, "app:");
        assert_eq!(o.default_ttl, Some(Duration::from_secs(10)));
        assert_eq!(o.response_timeout, Duration::from_secs(2));
    }

    #[test]
    fn cluster_url_becomes_node_urls_with_credentials() {
        let (t, _) = parse_url("redis+cluster://u:pw@h1:7101,h2:7102/").unwrap();
        assert_eq!(
            t,
            Target::Cluster(vec![
                "redis://u:pw@h1:7101".into(),
                "redis://u:pw@h2:7102".into()
            ])
        );
        let (t, _) = parse_url("rediss+cluster://h1:1").unwrap();
        assert_eq!(t, Target::Cluster(vec!["rediss://h1:1".into()]));
    }

    #[test]
    fn sentinel_url_names_sentinels_service_db_and_logins() {
        let (t, o) = parse_url(
            "redis+sentinel://:pw@s1:7211,s2,[::1]:7213/orders/2?sentinel_password=spw&prefix=x:",
        )
        .unwrap();
        assert_eq!(
            t,
            Target::Sentinel(SentinelTarget {
                sentinels: vec![
                    ("s1".into(), 7211),
                    ("s2".into(), 26379),
                    ("::1".into(), 7213)
                ],
                service: "orders".into(),
                db: 2,
                user: None,
                password: Some("pw".into()),
                sentinel_user: None,
                sentinel_password: Some("spw".into()),
            })
        );
        assert_eq!(o.prefix, "x:");
        for (url, needle) in [
            ("redis+sentinel://s1/", "no service"),
            ("redis+sentinel:///svc", "no Sentinel"),
            ("redis+sentinel://s1:x/svc", "port"),
            ("redis+sentinel://s1/svc/x", "database"),
            ("redis+sentinel://s1/svc/3/junk", "after the database"),
            (
                "redis+sentinel://s1/svc?protocol=resp3",
                "unknown redis option",
            ),
        ] {
            let e = parse_url(url).unwrap_err().to_string();
            assert!(e.contains(needle), "{url}: {e}");
        }
    }

    #[test]
    fn bad_options_are_named() {
        for (url, needle) in [
            ("redis://h?prefix=a{b}", "braces"),
            ("redis://h?ttl=soon", "ttl"),
            ("redis://h?wait_replicas=x", "wait_replicas"),
            ("redis+cluster://h:1?wait_replicas=1", "single"),
            ("redis+cluster://", "no cluster node"),
            (
                "redis+cluster://h:1?protocol=resp3",
                "unknown redis option \"protocol\"",
            ),
        ] {
            let e = parse_url(url).unwrap_err().to_string();
            assert!(e.contains(needle), "{url}: {e}");
        }
    }
}
