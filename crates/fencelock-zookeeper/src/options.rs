//! Options of the ZooKeeper backend and its URL form.

use std::time::Duration;

use fencelock_core::backend::BackendUrl;
use fencelock_core::{Error, Result};

/// Which Curator recipe fencelock's exclusive locks interoperate with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Writer {
    /// `_c_<uuid>-lock-<seq>`, as `InterProcessMutex` (and kazurator's `Mutex`).
    #[default]
    Mutex,
    /// `_c_<uuid>-__WRIT__<seq>`, the write side of `InterProcessReadWriteLock`.
    ReadWriteLock,
}

/// Options of [`ZooKeeperBackend`](crate::ZooKeeperBackend).
///
/// | URL option | default | meaning |
/// |---|---|---|
/// | `prefix=` | `/fencelock` | parent path of every lock (`<prefix>/<escaped key>`) |
/// | `session_timeout=` | 30 s | the longest ZooKeeper session: a hold of TTL `t` lives in a session of `min(ceil(t), session_timeout)`, which is what a lost holder costs |
/// | `connect_timeout=` | 5 s | how long `connect` waits |
/// | `writer=mutex\|rwlock` | `mutex` | name exclusive nodes as Curator's `InterProcessMutex` or as the write lock of its `InterProcessReadWriteLock` |
/// | `ttl=` | – | default TTL of holds |
///
/// A user and password in the URL (`zk://user:pass@h1,h2`) authenticate with the
/// `digest` scheme; a path after the hosts is the chroot.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ZkOptions {
    /// Parent path of every lock.
    pub prefix: String,
    /// Session timeout.
    pub session_timeout: Duration,
    /// Connection timeout.
    pub connect_timeout: Duration,
    /// Node names of exclusive locks.
    pub writer: Writer,
    /// Default TTL of holds.
    pub default_ttl: Option<Duration>,
}

impl Default for ZkOptions {
    fn default() -> Self {
        ZkOptions {
            prefix: "/fencelock".into(),
            session_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            writer: Writer::Mutex,
            default_ttl: None,
        }
    }
}

/// A parsed `zk://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ZkUrl {
    /// `h1:p1,h2:p2[/chroot]` for the client.
    pub(crate) cluster: String,
    /// `user:password` for the digest scheme.
    pub(crate) digest: Option<String>,
    pub(crate) options: ZkOptions,
}

pub(crate) fn parse_url(url: &str) -> Result<ZkUrl> {
    let mut u = BackendUrl::parse("zookeeper", url, &["zk"])?;
    let digest = u
        .user()
        .map(|user| format!("{user}:{}", u.password().unwrap_or("")));
    if u.hosts().next().is_none() {
        return Err(Error::config(format!(
            "{:?} names no ZooKeeper server; write zk://host:2181[,host:2181…][/chroot]",
            u.redacted()
        )));
    }
    let chroot = u.path().trim_end_matches('/');
    let cluster = format!("{}{chroot}", u.hosts_text());
    let options = take_options(&mut u)?;
    u.finish()?;
    Ok(ZkUrl {
        cluster,
        digest,
        options,
    })
}

/// Takes the options of the table above out of `u`.
fn take_options(u: &mut BackendUrl) -> Result<ZkOptions> {
    let mut options = ZkOptions::default();
    if let Some(prefix) = u.take("prefix") {
        options.prefix = prefix.trim_end_matches('/').to_string();
    }
    if let Some(d) = u.take_duration("session_timeout")? {
        options.session_timeout = d;
    }
    if let Some(d) = u.take_duration("connect_timeout")? {
        options.connect_timeout = d;
    }
    options.default_ttl = u.take_duration("ttl")?;
    if let Some(w) = u.take_choice(
        "writer",
        &[("mutex", Writer::Mutex), ("rwlock", Writer::ReadWriteLock)],
    )? {
        options.writer = w;
    }
    if !options.prefix.starts_with('/') || options.prefix.len() < 2 || options.prefix.contains("//")
    {
        return Err(Error::config(format!(
            "zookeeper prefix {:?} must be an absolute path like /fencelock",
            options.prefix
        )));
    }
    Ok(options)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_options_table_lists_every_option_the_parser_takes() {
        let mut u = BackendUrl::parse("zookeeper", "zk://h", &["zk"]).unwrap();
        take_options(&mut u).unwrap();
        fencelock_testkit::assert_options_documented(include_str!("options.rs"), u.asked());
    }

    #[test]
    fn parses_hosts_chroot_auth_and_options() {
        let u = parse_url(
            "zk://app:pw@h1:2181,h2:2182/svc/locks?prefix=/l&session_timeout=3s&writer=rwlock",
        )
        .unwrap();
        assert_eq!(u.cluster, "h1:2181,h2:2182/svc/locks");
        assert_eq!(u.digest.as_deref(), Some("app:pw"));
        assert_eq!(u.options.prefix, "/l");
        assert_eq!(u.options.session_timeout, Duration::from_secs(3));
        assert_eq!(u.options.writer, Writer::ReadWriteLock);
        assert_eq!(
            parse_url("zk://127.0.0.1:2181").unwrap().cluster,
            "127.0.0.1:2181"
        );
    }

    #[test]
    fn bad_urls_are_named() {
        for (url, needle) in [
            ("zk://", "no ZooKeeper server"),
            ("zk://h?session_timeout=x", "session_timeout"),
            ("zk://h?prefix=rel", "absolute"),
            ("zk://h?color=red", "color"),
            ("zk://h?writer=rw", "writer"),
        ] {
            let e = parse_url(url).unwrap_err().to_string();
            assert!(e.contains(needle), "{url}: {e}");
        }
    }
}
