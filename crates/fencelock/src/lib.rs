//! fencelock: distributed locks that stay correct when holders pause, servers
//! fail over and networks split.
//!
//! Every backend gives the same API: fencing tokens where the backend can
//! guarantee them, a lease-lost signal, watchdog renewal, and waiting woken by
//! the backend's notification where it has one (pub/sub, watches, `LISTEN`, the
//! server's own lock queue; across processes, SQLite, memcached and the MySQL
//! lease table poll with backoff). Pick the backend with a URL:
//!
//! | URL | backend | cargo feature |
//! |---|---|---|
//! | `memory://[name]` | this process's memory | always |
//! | `sqlite://PATH` (`sqlite://` = default file) | a SQLite file shared by the machine's processes | `sqlite` (default) |
//! | `redis://`, `rediss://`, `redis+cluster://h1:p1,h2:p2`, `redis+sentinel://s1:p1,s2:p2/SERVICE` | Redis, Redis Cluster, the master of a Sentinel service | `redis` |
//! | `redlock://h1:p1,h2:p2,h3:p3,…` | Redlock over N independent Redis masters | `redis` |
//! | `zk://h1:p1,h2:p2/chroot` | ZooKeeper (Curator-compatible recipes) | `zookeeper` |
//! | `etcd://h1:p1,h2:p2` (`etcds://` for TLS) | etcd (the layout of Go's `concurrency.Mutex`) | `etcd` (needs `protoc`), `etcd-tls` |
//! | `postgres://user:pw@host/db[?mode=lease\|advisory]` | PostgreSQL lease table or advisory locks | `postgres` |
//! | `mysql://user:pw@host/db[?mode=lease\|get_lock]` (`mariadb://`) | MySQL/MariaDB lease table or `GET_LOCK` | `mysql` |
//! | `memcached://host:port` | memcached `add` with expiry (no fencing tokens) | `memcached` |
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock::Result<()> {
//! # let dir = tempfile::tempdir().unwrap();
//! # let url = format!("sqlite://{}", dir.path().join("locks.db").display());
//! let locker = fencelock::connect(&url).await?;
//! let guard = locker
//!     .lock("orders/42")
//!     .ttl(Duration::from_secs(30))
//!     .wait(Duration::from_secs(5))
//!     .acquire()
//!     .await?;
//! let token = guard.token(); // send it with every write; the resource rejects older ones
//! guard.release().await?;
//! # let _ = token; Ok(()) }
//! ```
#![warn(missing_docs)]

use std::sync::Arc;

pub use fencelock_core::*;

use fencelock_core::backend::{Driver, MEMORY_DRIVER, redact_url};

#[cfg(feature = "blocking")]
pub mod blocking;
mod connect_within;

pub use connect_within::connect_within;

/// The backend crates compiled into this build.
pub mod backends {
    /// The in-memory backend (always present).
    pub use fencelock_core::MemoryBackend;
    #[cfg(feature = "etcd")]
    pub use fencelock_etcd as etcd;
    #[cfg(feature = "memcached")]
    pub use fencelock_memcached as memcached;
    #[cfg(feature = "mysql")]
    pub use fencelock_mysql as mysql;
    #[cfg(feature = "postgres")]
    pub use fencelock_postgres as postgres;
    #[cfg(feature = "redis")]
    pub use fencelock_redis as redis;
    #[cfg(feature = "sqlite")]
    pub use fencelock_sqlite as sqlite;
    #[cfg(feature = "zookeeper")]
    pub use fencelock_zookeeper as zookeeper;
}

/// The drivers compiled into this build: one line per backend crate, gated
/// by its cargo feature. Adding a backend is adding its line here (and its
/// schemes and feature to `KNOWN`).
fn drivers() -> Vec<Driver> {
    vec![
        MEMORY_DRIVER,
        #[cfg(feature = "sqlite")]
        fencelock_sqlite::DRIVER,
        #[cfg(feature = "redis")]
        fencelock_redis::DRIVER,
        #[cfg(feature = "redis")]
        fencelock_redis::REDLOCK_DRIVER,
        #[cfg(feature = "zookeeper")]
        fencelock_zookeeper::DRIVER,
        #[cfg(feature = "etcd")]
        fencelock_etcd::DRIVER,
        #[cfg(feature = "postgres")]
        fencelock_postgres::DRIVER,
        #[cfg(feature = "mysql")]
        fencelock_mysql::DRIVER,
        #[cfg(feature = "memcached")]
        fencelock_memcached::DRIVER,
    ]
}

/// Every backend, compiled in or not: its schemes and the cargo feature that
/// compiles it, so that a URL of a backend left out names the feature. (A
/// test checks it against the drivers of a build with every feature.)
const KNOWN: &[(&str, &[&str], &str)] = &[
    ("memory", &["memory"], ""),
    ("sqlite", &["sqlite"], "sqlite"),
    (
        "redis",
        &[
            "redis",
            "rediss",
            "redis+cluster",
            "rediss+cluster",
            "redis+sentinel",
        ],
        "redis",
    ),
    ("redlock", &["redlock", "rediss+redlock"], "redis"),
    ("zookeeper", &["zk"], "zookeeper"),
    ("etcd", &["etcd"], "etcd"),
    ("etcd", &["etcds"], "etcd-tls"),
    ("postgres", &["postgres", "postgresql"], "postgres"),
    ("mysql", &["mysql", "mariadb"], "mysql"),
    ("memcached", &["memcached"], "memcached"),
];

/// The name of the backend `url`'s scheme names ("backend" if none).
fn backend_name(url: &str) -> &'static str {
    let scheme = url.trim().split_once("://").map_or("", |(s, _)| s);
    KNOWN
        .iter()
        .find(|(_, schemes, _)| schemes.iter().any(|s| s.eq_ignore_ascii_case(scheme)))
        .map_or("backend", |(name, ..)| name)
}

/// The backends compiled into this build, by name.
pub fn compiled_backends() -> Vec<&'static str> {
    drivers().iter().map(|d| d.name).collect()
}

/// The URL of the embedded default: the SQLite file of
/// `fencelock_sqlite::default_path()`.
pub const DEFAULT_URL: &str = "sqlite://";

/// Opens the backend that `url` names.
///
/// # Errors
///
/// [`Error::InvalidConfig`] naming the bad part of the URL, or the cargo feature
/// to enable when the backend is not compiled in; connection errors of the
/// backend (with passwords redacted).
pub async fn connect_backend(url: &str) -> Result<Arc<dyn Backend>> {
    let url = url.trim();
    let Some((scheme, _)) = url.split_once("://") else {
        return Err(Error::config(format!(
            "backend URL {:?} has no scheme; write SCHEME://…, e.g. sqlite:///tmp/locks.db or memory://",
            redact_url(url)
        )));
    };
    let scheme = scheme.to_ascii_lowercase();
    if let Some(driver) = drivers()
        .into_iter()
        .find(|d| d.schemes.contains(&scheme.as_str()))
    {
        return (driver.connect)(url).await;
    }
    Err(
        match KNOWN
            .iter()
            .find(|(_, schemes, _)| schemes.contains(&scheme.as_str()))
        {
            Some((backend, _, feature)) => Error::config(format!(
                "the {backend} backend ({scheme}://) is not compiled into this build; enable the cargo feature `{feature}` of the fencelock crate"
            )),
            None => Error::config(format!(
                "unknown backend scheme {scheme:?} in {:?}; known schemes: {}",
                redact_url(url),
                KNOWN
                    .iter()
                    .flat_map(|(_, schemes, _)| schemes.iter())
                    .map(|s| format!("{s}://"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        },
    )
}

/// Opens a [`Locker`] on the backend `url` names (see the table in the crate
/// docs). The locker is the core's: build one on a backend value with
/// [`Locker::new`] instead.
///
/// # Errors
///
/// As [`connect_backend`].
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock::Result<()> {
/// let locker = fencelock::connect("memory://").await?;
/// assert_eq!(locker.backend().name(), "memory");
/// let e = fencelock::connect("nope://x").await.unwrap_err();
/// assert!(e.to_string().contains("unknown backend scheme"));
/// # Ok(()) }
/// ```
pub async fn connect(url: &str) -> Result<Locker> {
    Ok(Locker::from_arc(connect_backend(url).await?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_compiled_driver_is_in_the_table_of_known_backends() {
        let known = |name: &str| -> Vec<&str> {
            KNOWN
                .iter()
                .filter(|(n, ..)| *n == name)
                .flat_map(|(_, schemes, _)| schemes.iter().copied())
                .collect()
        };
        for d in drivers() {
            assert_eq!(known(d.name), d.schemes, "{d:?}");
        }
        if cfg!(all(
            feature = "sqlite",
            feature = "redis",
            feature = "zookeeper",
            feature = "etcd",
            feature = "postgres",
            feature = "mysql",
            feature = "memcached"
        )) {
            for (name, ..) in KNOWN {
                assert!(
                    drivers().iter().any(|d| d.name == *name),
                    "no driver for {name}"
                );
            }
        }
    }

    #[tokio::test]
    async fn unknown_and_missing_schemes_are_named() {
        let e = connect_backend("nope://x").await.err().unwrap().to_string();
        assert!(e.contains("\"nope\"") && e.contains("sqlite://"), "{e}");
        if !cfg!(feature = "etcd") {
            let e = connect_backend("etcd://127.0.0.1:2379")
                .await
                .err()
                .unwrap()
                .to_string();
            assert!(e.contains("`etcd`"), "{e}");
        }
        let e = connect_backend("/tmp/x.db")
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("no scheme"), "{e}");
    }

    #[tokio::test]
    async fn passwords_never_reach_messages() {
        let e = connect_backend("bogus://user:hunter2@host/db")
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(!e.contains("hunter2"), "{e}");
    }

    #[tokio::test]
    async fn named_memory_instances_are_shared() {
        let a = connect("memory://facade-test").await.unwrap();
        let b = connect("memory://facade-test").await.unwrap();
        let c = connect("memory://other").await.unwrap();
        let g = a.lock("k").acquire().await.unwrap();
        assert!(b.lock("k").try_acquire().await.unwrap().is_none());
        assert!(c.lock("k").try_acquire().await.unwrap().is_some());
        g.release().await.unwrap();
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn sqlite_url_opens_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!(
            "sqlite://{}?busy_timeout=2s",
            dir.path().join("l.db").display()
        );
        let locker = connect(&url).await.unwrap();
        assert_eq!(locker.backend().name(), "sqlite");
        let e = connect_backend("sqlite:///tmp/x.db?colour=red")
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("colour"), "{e}");
    }
}
