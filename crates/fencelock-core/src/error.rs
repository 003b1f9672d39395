//! The one error type of fencelock, and URL redaction for messages.

use std::time::Duration;

use crate::guard::LostReason;

/// A `Result` whose error is fencelock's [`enum@Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong when taking, keeping or giving back a lock.
///
/// Every message says what happened and what to do about it. Addresses inside
/// messages never contain passwords (see [`redact_url`]).
///
/// # Examples
///
/// ```
/// use fencelock_core::{Error, Key};
///
/// let err = Key::new("").unwrap_err();
/// assert!(matches!(err, Error::InvalidKey { .. }));
/// assert!(err.to_string().contains("empty"));
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The key breaks the rules of [`Key`](crate::Key); no I/O was done.
    #[error(
        "invalid lock key {key:?}: {reason}; use 1 to 256 bytes of UTF-8 without control characters"
    )]
    InvalidKey {
        /// The key as given (shortened if very long).
        key: String,
        /// Which rule it breaks.
        reason: String,
    },
    /// A URL, option or argument is wrong; the message names the bad part.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// The lock was not acquired within the wait the caller allowed.
    #[error("lock {key:?} not acquired within {}; it stayed held, or the backend kept the request waiting (check `fencelock status {key}`, or raise the wait)", humanize(*.waited))]
    Timeout {
        /// The key that was busy.
        key: String,
        /// How long the caller waited.
        waited: Duration,
    },
    /// The caller does not hold this lock (never held, already released, expired,
    /// or taken over). Nothing was changed on the backend.
    #[error(
        "lock {key:?} is not held by {owner:?}; it was released, expired or taken by another holder, and nothing was changed"
    )]
    NotHeld {
        /// The key.
        key: String,
        /// The owner that tried to release or renew.
        owner: String,
    },
    /// The lease was lost while the caller held it; stop touching the resource.
    #[error(
        "lease on {key:?} lost: {reason}; stop writing to the protected resource, then acquire again"
    )]
    Lost {
        /// The key.
        key: String,
        /// Why the lease is gone.
        reason: LostReason,
    },
    /// The backend cannot do what was asked (a mode, inspection, …).
    #[error("{backend} does not support {what}")]
    Unsupported {
        /// The backend's name.
        backend: &'static str,
        /// What was asked for.
        what: String,
    },
    /// The backend could not be reached or the connection broke.
    #[non_exhaustive]
    #[error("cannot reach {backend} at {addr}: {message}; {}", connection_hint(.backend))]
    Connection {
        /// The backend's name.
        backend: &'static str,
        /// The address, with any password redacted.
        addr: String,
        /// What the client library said.
        message: String,
        /// The client library's error, if there was one (see [`Error::with_source`]).
        #[source]
        source: Option<Cause>,
        /// Whether asking again may cure it: see [`Error::is_transient`].
        transient: bool,
    },
    /// The backend answered with an error.
    #[error("{backend} error: {message}")]
    Backend {
        /// The backend's name.
        backend: &'static str,
        /// What the backend said.
        message: String,
        /// The client library's error, if there was one (see [`Error::with_source`]).
        #[source]
        source: Option<Cause>,
    },
}

/// The error of a client library behind an [`Error::Connection`] or
/// [`Error::Backend`], kept as its [`source`](std::error::Error::source) so
/// that error chains (`anyhow`, `eyre`) show it.
///
/// It prints the library's message with passwords redacted (as every message
/// of fencelock), and ends the chain there; [`Cause::get_ref`] gives the
/// library's error itself, to downcast.
#[derive(Clone)]
pub struct Cause(std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>);

impl Cause {
    /// The client library's error.
    pub fn get_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.0
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&redact_in_text(&self.0.to_string()))
    }
}

impl std::fmt::Debug for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Cause").field(&self.to_string()).finish()
    }
}

impl std::error::Error for Cause {}

/// What to check when `backend` cannot be reached.
fn connection_hint(backend: &str) -> &'static str {
    match backend {
        "sqlite" => "check that the file's directory exists and that this process may write there",
        _ => "check that the server runs and the address is right",
    }
}

impl Error {
    /// Builds [`Error::InvalidConfig`] from anything printable.
    pub fn config(message: impl Into<String>) -> Self {
        Error::InvalidConfig(message.into())
    }

    /// Builds the [`Error::InvalidConfig`] of a reentrant acquire that asks
    /// for another mode than the one `owner` already holds `key` in.
    pub fn mode_mismatch(
        owner: &str,
        key: &str,
        held: impl std::fmt::Display,
        asked: crate::Mode,
    ) -> Self {
        Error::InvalidConfig(format!(
            "owner {owner:?} already holds {key:?} as {held}; a reentrant acquire must ask for the same mode (asked {asked})"
        ))
    }

    /// The refusal of a semaphore request whose permit count differs from the
    /// one the key's holders took it with (a key has one count while held).
    pub fn permits_mismatch(key: &str, held: impl std::fmt::Display, asked: u32) -> Self {
        Error::InvalidConfig(format!(
            "semaphore {key:?} is held with {held} permits; asked with {asked} (a key has one permit count while anyone holds it: use the same count everywhere, or change it only while the key is free)"
        ))
    }

    /// Builds [`Error::Backend`].
    pub fn backend(backend: &'static str, message: impl std::fmt::Display) -> Self {
        Error::Backend {
            backend,
            message: message.to_string(),
            source: None,
        }
    }

    /// Keeps `cause` (the client library's error) as the
    /// [`source`](std::error::Error::source) of an [`Error::Connection`] or
    /// [`Error::Backend`]; other kinds of error are returned unchanged.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::error::Error as _;
    /// use fencelock_core::Error;
    ///
    /// let io = std::io::Error::other("connection reset");
    /// let err = Error::connection("redis", "redis://h:6379", &io).with_source(io);
    /// let Error::Connection { source: Some(cause), .. } = &err else { unreachable!() };
    /// assert!(cause.get_ref().downcast_ref::<std::io::Error>().is_some());
    /// assert_eq!(err.source().map(|c| c.to_string()).as_deref(), Some("connection reset"));
    /// ```
    #[must_use]
    pub fn with_source(mut self, cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        if let Error::Connection { source, .. } | Error::Backend { source, .. } = &mut self {
            *source = Some(Cause(std::sync::Arc::new(cause)));
        }
        self
    }

    /// Builds the [`Error::Connection`] of a server that refused the login
    /// (a wrong user or password, missing credentials). Not transient: a
    /// retry cannot cure it, so no wait goes on through it.
    pub fn login_refused(
        backend: &'static str,
        addr: &str,
        message: impl std::fmt::Display,
    ) -> Self {
        Error::connection(
            backend,
            addr,
            format!("{message} (check the user and password in the URL)"),
        )
        .lasting()
    }

    /// Marks an [`Error::Connection`] as one that asking again cannot cure
    /// (a refused login, a file that cannot be opened): no wait goes on
    /// through it.
    pub fn lasting(mut self) -> Self {
        if let Error::Connection { transient, .. } = &mut self {
            *transient = false;
        }
        self
    }

    /// Builds [`Error::Connection`]; `addr` is redacted here, so callers may pass a raw URL.
    pub fn connection(backend: &'static str, addr: &str, message: impl std::fmt::Display) -> Self {
        Error::Connection {
            backend,
            addr: redact_url(addr),
            message: redact_in_text(&message.to_string()),
            source: None,
            transient: true,
        }
    }

    /// Builds [`Error::Unsupported`].
    pub fn unsupported(backend: &'static str, what: impl Into<String>) -> Self {
        Error::Unsupported {
            backend,
            what: what.into(),
        }
    }

    /// True for errors that a retry might cure: connection trouble, but not
    /// a refused login nor others marked [`Error::lasting`].
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Error::Connection {
                transient: true,
                ..
            }
        )
    }
}

pub(crate) fn humanize(d: Duration) -> String {
    // Round to milliseconds so messages stay short.
    humantime::format_duration(Duration::from_millis(d.as_millis() as u64)).to_string()
}

/// Replaces the password of a URL (`scheme://user:password@host`) and any
/// `password=`/`pass=` query value with `***`.
///
/// Every error and log line that contains an address goes through this.
///
/// # Examples
///
/// ```
/// use fencelock_core::backend::redact_url;
///
/// assert_eq!(
///     redact_url("postgres://app:s3cret@db:5432/x?sslmode=require"),
///     "postgres://app:***@db:5432/x?sslmode=require"
/// );
/// assert_eq!(redact_url("redis://:pw@h:6379"), "redis://:***@h:6379");
/// assert_eq!(redact_url("etcd://h:2379?password=pw&user=u"), "etcd://h:2379?password=***&user=u");
/// assert_eq!(redact_url("sqlite:///tmp/x.db"), "sqlite:///tmp/x.db");
/// ```
pub fn redact_url(url: &str) -> String {
    let mut out = String::with_capacity(url.len());
    let (head, query) = match url.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (url, None),
    };
    match head.split_once("://") {
        Some((scheme, rest)) => {
            out.push_str(scheme);
            out.push_str("://");
            // The authority ends at the first '/' after the scheme; userinfo ends at the last '@' in it.
            let (authority, path) = match rest.find('/') {
                Some(i) => rest.split_at(i),
                None => (rest, ""),
            };
            match authority.rfind('@') {
                Some(at) => {
                    let (userinfo, hosts) = authority.split_at(at);
                    match userinfo.split_once(':') {
                        Some((user, _pw)) => {
                            out.push_str(user);
                            out.push_str(":***");
                        }
                        None => out.push_str(userinfo),
                    }
                    out.push_str(hosts);
                }
                None => out.push_str(authority),
            }
            out.push_str(path);
        }
        None => out.push_str(head),
    }
    if let Some(q) = query {
        out.push('?');
        let parts: Vec<String> = q
            .split('&')
            .map(|kv| match kv.split_once('=') {
                Some((k, _)) if is_secret_param(k) => format!("{k}=***"),
                _ => kv.to_string(),
            })
            .collect();
        out.push_str(&parts.join("&"));
    }
    out
}

fn is_secret_param(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n == "password" || n == "pass" || n == "pwd" || n == "secret" || n == "token"
}

/// Redacts every URL-looking word of a free text (client libraries like to echo URLs).
pub(crate) fn redact_in_text(text: &str) -> String {
    if !text.contains("://") {
        return text.to_string();
    }
    text.split(' ')
        .map(|w| {
            if w.contains("://") {
                redact_url(w)
            } else {
                w.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_login_is_a_connection_error_that_no_retry_cures() {
        let refused = Error::login_refused("etcd", "etcd://u:pw@h:2379", "permission denied");
        assert!(matches!(refused, Error::Connection { .. }));
        assert!(!refused.is_transient(), "{refused}");
        assert!(
            refused.to_string().contains("user and password"),
            "{refused}"
        );
        assert!(!refused.to_string().contains("pw@"), "{refused}");
        assert!(Error::connection("etcd", "h:2379", "connection refused").is_transient());
    }

    #[test]
    fn a_kept_cause_is_the_source_and_prints_without_passwords() {
        use std::error::Error as _;
        let io = std::io::Error::other("refused by redis://app:s3cret@10.0.0.5:6379");
        let err = Error::backend("redis", "refused").with_source(io);
        let cause = err.source().expect("the cause is kept");
        assert!(!cause.to_string().contains("s3cret"), "{cause}");
        assert!(!format!("{err:?}").contains("s3cret"), "{err:?}");
        let Error::Backend {
            source: Some(kept), ..
        } = &err
        else {
            panic!("{err:?}")
        };
        assert!(kept.get_ref().downcast_ref::<std::io::Error>().is_some());
        // Only connection and backend errors carry one.
        assert!(
            Error::config("x")
                .with_source(std::io::Error::other("y"))
                .source()
                .is_none()
        );
    }

    #[test]
    fn redacts_userinfo_with_at_in_password() {
        assert_eq!(
            redact_url("mysql://root:p@ss@127.0.0.1:3306/test"),
            "mysql://root:***@127.0.0.1:3306/test"
        );
    }

    #[test]
    fn keeps_user_without_password() {
        assert_eq!(
            redact_url("mysql://root@127.0.0.1/test"),
            "mysql://root@127.0.0.1/test"
        );
    }

    #[test]
    fn connection_error_redacts_message_urls() {
        let e = Error::connection("redis", "redis://u:pw@h", "failed redis://u:pw@h refused");
        let s = e.to_string();
        assert!(!s.contains("pw@"), "{s}");
        assert!(s.contains("redis://u:***@h"), "{s}");
    }
}
